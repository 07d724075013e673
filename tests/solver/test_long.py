"""Long chains (docs/how-it-works.md, "Long chains"): solved on groups of stages
where the exact table would take too long, valid on the stages' own costs and
said so; Ctrl-C stops a solve within a second and leaves nothing behind; one
that runs long shows its progress."""

import _thread
import math
import os
import random
import sys
import threading
import time

import pytest
from hypothesis import given, strategies as st

from random_costs import random_costs, random_options
import remat
from remat.chain import Explanation
from remat.errors import BudgetError
from remat.solver import binding as _c_solver, progress
from remat.solver.costs import Costs
from remat.solver.group import EXACT_WORK, cuts, exact_work, expand, group_count, grouped_costs
from remat.solver.plan import Plan
from remat.solver.schedule import simulate
from remat.solver.solve import minimum_budget, solve, store_all

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from solver import make_chain  # noqa: E402  (benchmarks/solver.py: random realistic chains)


def _mid_budget(costs):
    """Halfway (geometric mean) between the chain's minimum and storing everything."""
    return int((minimum_budget(costs) * simulate(costs, store_all(costs.length)).peak) ** 0.5)


def test_ctrl_c_stops_a_solve_within_a_second():
    """A KeyboardInterrupt during a long table stops the C solve within 1 s, reaches
    the caller, leaves no solver thread behind, and the next solve runs as usual."""
    costs = Costs(**make_chain(700))
    budget = _mid_budget(costs)   # (the 700-stage table runs for seconds)
    sent = []
    timer = threading.Timer(0.7, lambda: (sent.append(time.monotonic()), _thread.interrupt_main()))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            solve(costs, budget)
            time.sleep(5)   # (finished first: the interrupt lands here, and the check below fails)
        stopped = time.monotonic()
    finally:
        timer.cancel()
        timer.join()
    assert sent and stopped - sent[0] < 1.0
    assert not [t for t in threading.enumerate() if t.name == "remat-solver" and t.is_alive()]
    small = Costs(**make_chain(30))
    assert solve(small, _mid_budget(small)).peak <= _mid_budget(small)


def test_ctrl_c_stops_the_least_memory_program():
    """The least-memory program (src_c/minmemory.c) stops within 1 s of a Ctrl-C too."""
    costs = Costs(**make_chain(2500))   # (its least-memory program runs for seconds)
    sent = []
    timer = threading.Timer(0.5, lambda: (sent.append(time.monotonic()), _thread.interrupt_main()))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _c_solver.least_memory(costs)
            time.sleep(5)
        stopped = time.monotonic()
    finally:
        timer.cancel()
        timer.join()
    assert sent and stopped - sent[0] < 1.0


def test_an_interrupted_chain_call_caches_no_plan():
    """Ctrl-C during a chain call's solve (``plan_for``) keeps no plan: the next call
    with the same key solves again."""
    from remat.runtime.chain_call import plan_for

    big, small = Costs(**make_chain(700)), Costs(**make_chain(20))

    class Entry:   # (what plan_for reads of a chain's record)
        plans = {}
        costs = big
        others = []   # (no other paths: Note [Paths of a chain])

        def planning_costs(self, output=True, options=True):
            return self.costs

        def counts_output(self):
            return False

        def policies(self):
            return ()

        def step_end(self, costs):   # (nothing metered before the chain)
            return 0

    entry, budget = Entry(), _mid_budget(big)
    spec = remat.chain(budget=budget, algorithm="optimal", slots=500)   # (what plan_for reads of the chain)
    timer = threading.Timer(0.7, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            plan_for(entry, budget, spec)
            time.sleep(5)
    finally:
        timer.cancel()
        timer.join()
    assert entry.plans == {}
    entry.costs = small
    plan = plan_for(entry, budget, spec)
    assert plan.costs is small and entry.plans == {(budget, "optimal", 500, "auto"): plan}


def test_a_long_solve_shows_progress(monkeypatch, capsys):
    """Past SHOW_AFTER seconds a solve shows a bar on stderr naming its table."""
    monkeypatch.setattr(progress, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(progress, "INLINE_WORK", 0)
    monkeypatch.setattr(progress, "POLL", 0.005)
    costs = Costs(**make_chain(250))
    solve(costs, _mid_budget(costs))
    assert "remat: solving" in capsys.readouterr().err


def test_a_long_grouped_solve_says_its_steps(monkeypatch, capsys):
    """Past SHOW_AFTER seconds the steps of a solve on groups say a line each."""
    monkeypatch.setattr(progress, "SHOW_AFTER", 0.0)
    costs = Costs(**make_chain(60))
    solve(costs, _mid_budget(costs), groups=10)
    err = capsys.readouterr().err
    assert "remat: solving 60 stages: planning on 10 groups of stages" in err and "checking" in err


def test_a_short_solve_shows_nothing(capsys):
    """A solve that ends within SHOW_AFTER prints nothing."""
    costs = Costs(**make_chain(100))
    solve(costs, _mid_budget(costs))
    assert capsys.readouterr().err == ""


def _budget_between(costs, rng, frac=None):
    """A budget between the chain's minimum and storing everything (``frac`` of the
    way, random if None)."""
    lo, hi = minimum_budget(costs), simulate(costs, store_all(costs.length)).peak
    return int(lo + (rng.random() if frac is None else frac) * (hi - lo))


@given(seed=st.integers(0, 2**32), n=st.integers(2, 30))
def test_grouped_costs_bound_their_stages(seed, n):
    """On random chains (tails, drops, options), every schedule of a coarse chain,
    written as its stages' ops, takes the coarse schedule's time and peaks no
    higher on the stages' own costs (remat/solver/group.py Note [Groups])."""
    rng = random.Random(seed)
    costs = random_costs(rng, n)
    if rng.random() < 0.5:
        costs = random_options(rng, costs)
    ranges = cuts(costs, rng.randint(1, n))
    coarse = grouped_costs(costs, ranges)
    assert [lo for lo, _ in ranges] == [1] + [hi + 1 for _, hi in ranges[:-1]] and ranges[-1][1] == n
    if costs.tail:
        assert ranges[-1] == (n, n) and coarse.tail
    schedules = [_c_solver.least_memory(coarse)[0], store_all(coarse.length)]
    top = simulate(coarse, store_all(coarse.length)).peak
    for _ in range(3):
        try:
            schedules.append(solve(coarse, rng.randint(1, top + 5)).ops)
        except BudgetError:
            pass
    for ops in schedules:
        want, got = simulate(coarse, ops), simulate(costs, expand(ops, ranges))
        assert got.peak <= want.peak
        assert math.isclose(got.time, want.time, rel_tol=1e-9, abs_tol=1e-9)


@given(seed=st.integers(0, 2**32), n=st.integers(3, 30))
def test_grouped_schedules_are_valid_and_never_faster(seed, n):
    """Forced onto groups, ``solve`` returns a schedule of the L stages that fits the
    budget on their own costs (``simulate``), that ``Plan.of`` takes, says it was
    grouped, and is never faster than the exact optimum (1-byte slots); where 4
    times the groups reach the stages themselves, it fits wherever the exact solve does."""
    rng = random.Random(seed)
    costs = random_costs(rng, n)
    if rng.random() < 0.5:
        costs = random_options(rng, costs)
    budget = _budget_between(costs, rng)
    exact = solve(costs, budget, slots=budget)   # (1-byte slots: the true optimum)
    groups = rng.randint(1, n - 1)
    try:
        grouped = solve(costs, budget, groups=groups)
    except BudgetError:
        assert 4 * groups < n   # (the finer chain is still coarse)
        return
    sim = simulate(costs, grouped)
    assert sim.peak <= budget and (grouped.time, grouped.peak) == sim
    assert grouped.time >= exact.time - 1e-9 * max(1.0, exact.time)
    assert grouped.length == n and grouped.tail == costs.tail
    Plan.of(grouped, costs)
    assert grouped.grouping is None or sum(grouped.grouping.sizes) == n


@pytest.mark.parametrize("seed", range(4))
def test_grouped_realistic_chains_fit_and_stay_close(seed):
    """On a realistic chain of 120 stages at a mid budget, 30 groups fit, and are
    within 1.5 x the exact schedule's time."""
    costs = Costs(**make_chain(120, seed=seed))
    budget = _mid_budget(costs)
    exact, grouped = solve(costs, budget), solve(costs, budget, groups=30)
    assert grouped.peak <= budget and simulate(costs, grouped).peak <= budget
    assert exact.time - 1e-9 <= grouped.time <= 1.5 * exact.time
    assert grouped.grouping is not None and len(grouped.grouping.sizes) <= 30


def test_chains_the_table_handles_are_not_grouped():
    """Up to EXACT_WORK (1,000 stages at 500 slots) the solve is exact; past it, grouped."""
    assert exact_work(1000, 500) <= EXACT_WORK < exact_work(1001, 500)
    costs = Costs(**make_chain(60))
    assert solve(costs, _mid_budget(costs)).grouping is None


def test_a_long_chain_is_grouped_and_says_so():
    """A 3,000-stage chain solves on a few hundred groups, fits, and its summary
    and explain()'s text say so."""
    costs = Costs(**make_chain(3000))
    top = simulate(costs, store_all(3000)).peak
    schedule = solve(costs, top // 3)
    assert schedule.grouping is not None and len(schedule.grouping.sizes) <= group_count(500)
    assert sum(schedule.grouping.sizes) == 3000 and simulate(costs, schedule).peak <= top // 3
    assert "groups of stages" in schedule.summary()
    text = str(Explanation(costs, schedule, top // 3, []))
    assert "solved on 299 groups of" in text and "the exact table would take ~" in text


def test_a_budget_below_every_coarse_chain_says_what_it_found():
    """Below the finest coarse chain's minimum the error names that minimum and the
    grouping; where the finer chain is the stages themselves, the chain's minimum."""
    costs = Costs(**make_chain(40))
    least = minimum_budget(costs)
    with pytest.raises(BudgetError, match="this chain's minimum") as exc:
        solve(costs, least - 1, groups=10)
    assert exc.value.minimum == least
    with pytest.raises(BudgetError, match="planned on 8 groups"):
        solve(costs, least, groups=2)


def test_groups_must_be_a_positive_int():
    """``groups`` is None or an int >= 1."""
    costs = Costs.uniform(4, size=10)
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="groups must be"):
            solve(costs, 45, groups=bad)


def test_the_runtime_runs_a_grouped_schedule(monkeypatch):
    """A chain solved on groups (forced: every chain past the exact table, 4 groups)
    trains bitwise as plain PyTorch does, within its budget, and explain() says it
    was grouped."""
    import copy

    import torch

    import remat
    import remat.solver.solve as solve_module
    from chains import Net, assert_same, budget_for, measured_costs, train

    monkeypatch.setattr(solve_module, "EXACT_WORK", 0)
    monkeypatch.setattr(solve_module, "group_count", lambda slots: 4)
    kinds = ["mlp", "attn", "bn", "dropout", "mlp", "linear", "gelu", "mlp", "attn", "linear", "relu", "mlp"]
    torch.manual_seed(0)
    base = Net(kinds)
    ref = train(copy.deepcopy(base))
    net = copy.deepcopy(base)
    net.budget = budget_for(measured_costs(base), "optimal", 0.5)
    assert_same(ref, train(net))
    explained = remat.explain()
    assert explained.schedule.grouping is not None and explained.schedule.peak <= net.budget
    assert "solved on 4 groups of" in str(explained)
