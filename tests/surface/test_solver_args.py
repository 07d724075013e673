"""The solver's entry points given the wrong thing (None, a dict, a string, NaN, a
percentage for a budget) raise a ``RematError`` that names the argument, what was
given and what to give, where they raised raw AttributeErrors and TypeErrors from
deep inside; and the failed call changes nothing: not the costs, the ops, the trace
or what ``remat.explain()`` shows (docs/hostile-input.md)."""

import copy
import math

import pytest
import torch
import torch.nn as nn

import remat
from remat import B, Costs, Fall, Loss, Schedule, simulate
from remat.solver.solve import discretise, fastest, minimum_budget, time_bound

COSTS = Costs.uniform(3, time=1.0, size=10)
OPS = [Fall(1), Fall(2), Fall(3), Loss, B(3), B(2), B(1)]
HOW_COSTS = ("needs a remat.Costs", "remat.explain().costs", "Costs.load(path)")
HOW_OPS = ("must be", "remat.solve(costs, budget)", "remat.explain().schedule", "[Fall(1), Loss, B(1)]")

BAD = [
    (lambda: simulate({}, OPS), TypeError, ("remat: simulate needs a remat.Costs, got dict", "Costs.from_dict(d)",
                                            *HOW_COSTS)),
    (lambda: simulate(None, OPS), TypeError, ("remat: simulate needs a remat.Costs, got NoneType None", *HOW_COSTS)),
    (lambda: simulate(COSTS, None), TypeError, ("remat: simulate's schedule must be a Schedule or a list of ops, got "
                                                "NoneType None", *HOW_OPS)),
    (lambda: simulate(COSTS, "Fall"), TypeError, ("simulate's schedule", "got str 'Fall'",
                                                  "(ops are objects such as Fall(1), not their names)", *HOW_OPS)),
    (lambda: simulate(COSTS, 3), TypeError, ("simulate's schedule", "got int 3", *HOW_OPS)),
    (lambda: simulate(COSTS, {}), TypeError, ("simulate's schedule", "got dict", *HOW_OPS)),
    (lambda: simulate(COSTS, [Fall, Fall(2)]), remat.InvalidScheduleError,
     ("op 0 (Fall) of the schedule is invalid: not an op", "write Fall(stage)")),
    (lambda: Schedule(None), TypeError, ("remat: Schedule's ops must be a list of ops", "got NoneType None",
                                         *HOW_OPS)),
    (lambda: Schedule("abc"), TypeError, ("Schedule's ops", "got str 'abc'", "not their names", *HOW_OPS)),
    (lambda: Schedule(OPS, peak=None), TypeError, ("remat: Schedule's peak must be an int of bytes, got NoneType",)),
    (lambda: Schedule(OPS, budget="1GiB"), TypeError, ("Schedule's budget must be None or an int of bytes",)),
    (lambda: remat.solve(None, 100), TypeError, ("remat: solve needs a remat.Costs, got NoneType", *HOW_COSTS)),
    (lambda: remat.solve(COSTS, "2GiB"), ValueError, ("budget must be an int of bytes here, got '2GiB'",
                                                      "remat.chain reads sizes", "solve takes bytes")),
    (lambda: remat.solve(COSTS, math.nan), ValueError, ("budget must be an int of bytes here, got nan",)),
    (lambda: minimum_budget({}), TypeError, ("remat: minimum_budget needs a remat.Costs, got dict", *HOW_COSTS)),
    (lambda: fastest(None), TypeError, ("remat: fastest needs a remat.Costs", *HOW_COSTS)),
    (lambda: discretise("costs", 4), TypeError, ("remat: discretise needs a remat.Costs, got str",)),
    (lambda: discretise(COSTS, 0), ValueError, ("remat: discretise's slot must be an int of bytes >= 1, got 0",)),
    (lambda: time_bound(None, 100), TypeError, ("remat: time_bound needs a remat.Costs, got NoneType", *HOW_COSTS)),
    (lambda: time_bound(COSTS, None), ValueError, ("remat: time_bound's budget must be a finite number of bytes",
                                                   "got NoneType None")),
    (lambda: time_bound(COSTS, math.nan), ValueError, ("time_bound's budget", "got float nan")),
    (lambda: time_bound(COSTS, math.inf), ValueError, ("time_bound's budget", "got float inf")),
    (lambda: time_bound(COSTS, "1GiB"), ValueError, ("time_bound's budget", "got str '1GiB'")),
    (lambda: Costs.uniform(3, time=None), ValueError, ("remat: Costs.uniform's time must be a number of seconds",
                                                       "got NoneType None")),
    (lambda: Costs.uniform(3, nograd_time="fast"), ValueError, ("Costs.uniform's nograd_time", "got str 'fast'")),
    (lambda: COSTS.with_tail(0.0, 0.0, None, 0, 0, 0), ValueError,
     ("remat: with_tail's out_bytes must be an int of bytes, got NoneType None",)),
    (lambda: COSTS.with_tail(0.0, 0.0, 0, "a", 0, 0), ValueError, ("with_tail's saved_bytes", "got str 'a'")),
    (lambda: COSTS.with_tail(0.0, 0.0, 0, 0, 0, 0, kept=None), ValueError, ("with_tail's kept",)),
    (lambda: COSTS.with_held("1GiB"), ValueError, ("remat: with_held's extra must be an int of bytes, got str",)),
    (lambda: COSTS.with_held(None), ValueError, ("with_held's extra", "got NoneType None")),
    (lambda: COSTS.with_options(None), ValueError, ("remat: with_options takes a dict of stage numbers (1-based) to "
                                                    "lists of remat.Option", "got NoneType None")),
    (lambda: COSTS.with_options([1]), ValueError, ("with_options takes a dict", "got list [1]")),
]


@pytest.mark.parametrize("call,kind,words", BAD, ids=range(len(BAD)))
def test_a_wrong_argument_is_named_and_nothing_changes(call, kind, words):
    """Each raises a ``RematError`` of the documented kind whose message has the words;
    the shared costs and ops are as before, and so is what ``explain()`` shows."""
    costs_before, ops_before, shown = COSTS.to_dict(), list(OPS), remat.explain()
    with pytest.raises(kind) as caught:
        call()
    message = str(caught.value)
    assert isinstance(caught.value, remat.RematError) and message.startswith("remat: "), message
    for word in words:
        assert word in message, (word, message)
    assert COSTS.to_dict() == costs_before and OPS == ops_before and remat.explain() is shown


def test_a_failed_simulate_leaves_the_trace_alone():
    """The trace is written only by a schedule that runs: a bad one leaves it empty."""
    trace = []
    for schedule in (None, "Fall", [Fall]):
        with pytest.raises((TypeError, remat.InvalidScheduleError)):
            simulate(COSTS, schedule, trace=trace)
    assert trace == []
    assert simulate(COSTS, iter(OPS), trace=trace) == simulate(COSTS, Schedule(OPS))   # (any iterable of ops)
    assert len(trace) == len(OPS)


def test_what_was_right_still_is():
    """A Schedule of a list keeps its ops as a tuple (hashable, equal to one of the tuple);
    a time bound below the chain's input is still inf; Costs.with_* as before."""
    assert Schedule(OPS) == Schedule(tuple(OPS)) and hash(Schedule(OPS)) == hash(Schedule(tuple(OPS)))
    assert Schedule(OPS).ops == tuple(OPS) and Schedule(Schedule(OPS).ops).length == 3
    assert time_bound(COSTS, -5) == math.inf and time_bound(COSTS, 10**6) == simulate(COSTS, OPS).time
    assert COSTS.with_held(0) is COSTS and COSTS.with_held(5).held_bytes == 5
    assert COSTS.with_tail(0.0, 0.0, 0, 0, 0, 0).tail and Costs.uniform(2, time=2).bwd_time == (4.0, 4.0)
    assert discretise(COSTS, 4).out_bytes == (3, 3, 3)


class _Twice(nn.Module):
    def __init__(self, budget):
        super().__init__()
        self.blocks = nn.ModuleList(remat.stage(nn.Sequential(nn.Linear(4, 4), nn.Tanh())) for _ in range(3))
        self.budget = budget

    def forward(self, x):
        with remat.chain(budget=self.budget):
            for b in self.blocks:
                x = b(x)
        return x


@pytest.mark.parametrize("budget", ["90%", " 50 %", "40%"])
def test_a_percentage_budget_says_what_to_give(budget):
    """A share of storing everything is the demo's reading of a budget: elsewhere the
    error says a percentage is not a budget and what is (it said it could not read
    '90%' as a size). The model's parameters, their gradients and ``explain()`` are as
    before, and the next call with a budget in bytes gives plain PyTorch's gradients."""
    torch.manual_seed(0)
    model, shown = _Twice(budget), remat.explain()
    params = copy.deepcopy(list(model.parameters()))
    x = torch.randn(2, 4, requires_grad=True)
    for make in (lambda: model(x), lambda: remat.Sequential(nn.Linear(2, 2), budget=budget)):
        with pytest.raises(remat.BudgetError) as caught:
            make()
        message = str(caught.value)
        for word in (f"remat: budget {budget!r}: a percentage is not a budget here", "an int of bytes", "'2GiB'",
                     "'auto'", "read only by remat's demo (python -m remat demo --budget 40%)"):
            assert word in message, (word, message)
    assert remat.explain() is shown and x.grad is None
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(params, model.parameters()))
    model.budget = "1MiB"
    model(x).sum().backward()
    plain = copy.deepcopy(model)
    for p in plain.parameters():
        p.grad = None
    y = x.detach().requires_grad_()
    for b in plain.blocks:   # (outside a chain a stage is its module)
        y = b(y)
    y.sum().backward()
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


def test_the_demo_still_reads_a_share():
    """The demo's budget reader takes the percentage the chain refuses."""
    from remat.tools.demo import parse_demo_budget

    assert parse_demo_budget("40%") == ("share", 0.4)
    assert parse_demo_budget("2GiB") == ("bytes", 2 * 2**30)
