"""The chain's tail in the cost model (Costs.tail: the head and loss after the
last stage, rotor's loss stage): the solvers, simulate and Costs."""

import random

import pytest
from hypothesis import given, strategies as st

from random_costs import random_costs
from remat.errors import CostsError
from remat.solver.costs import Costs
from remat.solver.schedule import B, Fall, Loss, simulate
from remat.solver.solve import minimum_budget, solve


def _tail_ops(ops, n):
    """The ops on stage n, the tail, with the op after each (None at the end)."""
    return [(str(op), str(ops[j + 1]) if j + 1 < len(ops) else None) for j, op in enumerate(ops) if op.stage == n]


@given(seed=st.integers(0, 2**32), n=st.integers(2, 14))
def test_tail_runs_once_and_per_block_checkpointing_is_a_plan(seed, n):
    """With a tail, every schedule the solvers return runs it once (Fall before Loss,
    B right after); per-block checkpointing (min_memory: every stage of the chain
    checkpointed, the tail recorded) fits its own peak, and the optimum there is no
    slower than it, in exact bytes and with slots."""
    rng = random.Random(seed)
    costs = random_costs(rng, n, size=rng.choice([40, 10**6]), tail=True)
    per_block = solve(costs, 2**50, "min_memory")
    assert [type(op).__name__ for op in per_block.ops[:n]] == ["Fck"] * (n - 1) + ["Fall"]
    for algorithm in ("optimal", "store_all", "sqrt", f"periodic({rng.randint(1, n)})"):
        s = solve(costs, 2**50 if algorithm != "optimal" else per_block.peak, algorithm)
        assert _tail_ops(s.ops, n) == [(f"Fall{n}", "Loss"), (f"B{n}", _tail_ops(s.ops, n)[1][1])]
        assert s.ops[s.ops.index(Loss) + 1] == B(n)
    best = solve(costs, per_block.peak, slots=20)
    assert best.peak <= per_block.peak and best.time <= per_block.time * (1 + 1e-12)


def test_a_large_tail_checkpoints_the_last_stage():
    """A head much larger than a stage's activations: at per-block checkpointing's
    peak nothing else fits, and the optimum keeps only the last stage's input, as
    that schedule does, where without the tail in the problem the last stage would
    be recorded whole at the turn."""
    bare = Costs.uniform(6, time=1.0, size=10, saved=40)
    costs = bare.with_tail(1.0, 2.0, 4, 400, 200, 0)
    per_block = solve(costs, 2**50, "min_memory")
    best = solve(costs, per_block.peak)
    assert type(best.ops[5]) is not Fall   # stage 6, the chain's last, is not recorded in the forward phase
    assert best.time <= per_block.time
    # without the tail in the problem, the chain's last stage is recorded at the turn, even at its minimum
    assert type(solve(bare, minimum_budget(bare)).ops[5]) is Fall


def test_simulate_refuses_to_run_the_tail_again():
    """The tail runs once, as the caller runs it: a schedule that checkpoints it, or
    records it after Loss, is invalid."""
    from remat.errors import InvalidScheduleError
    from remat.solver.schedule import Fck, Fn

    costs = Costs.uniform(2, size=10).with_tail(1.0, 1.0, 4, 40, 0, 0)
    assert simulate(costs, [Fall(1), Fall(2), Fall(3), Loss, B(3), B(2), B(1)]).peak > 0
    for ops in ([Fall(1), Fck(2), Fn(3), Loss, Fall(3), B(3), Fall(2), B(2), B(1)],
                [Fall(1), Fall(2), Fck(3), Loss, Fall(3), B(3), B(2), B(1)]):
        with pytest.raises(InvalidScheduleError, match="tail"):
            simulate(costs, ops)


def test_costs_with_and_without_a_tail():
    """``with_tail`` appends the tail and adds what the caller keeps to held_bytes;
    ``without_tail`` and ``tail_costs`` take it apart again; a tail needs a stage
    before it, and ``tail_kept`` is part of held_bytes."""
    bare = Costs.uniform(3, size=10)
    costs = bare.with_tail(1.0, 2.0, 4, 40, 20, -4, kept=8)
    assert (costs.length, costs.stages, costs.held_bytes, costs.tail_kept) == (4, 3, 8, 8)
    assert costs.without_tail() == bare and bare.without_tail() is bare
    assert costs.tail_costs() == {"fwd_time": 1.0, "bwd_time": 2.0, "out_bytes": 4, "saved_bytes": 40,
                                  "fwd_tmp": 20, "bwd_tmp": -4, "kept": 8}
    assert Costs.from_dict(costs.to_dict()) == costs
    assert "tail" in costs.table()
    with pytest.raises(CostsError, match="tail"):
        costs.with_tail(1.0, 1.0, 1, 1, 0, 0)
    with pytest.raises(CostsError, match="no stage before the tail"):
        Costs(**{**Costs.uniform(1).to_dict(), "tail": True})
    with pytest.raises(CostsError, match="tail_kept"):
        Costs(**{**costs.to_dict(), "held_bytes": 2})
    with pytest.raises(CostsError, match="tail_kept"):
        Costs(**{**bare.to_dict(), "held_bytes": 8, "tail_kept": 8})


def test_the_held_output_made_again_after_loss_counts_as_a_copy():
    """With ``output_held``, held_bytes counts a^L; a Fall(L) after Loss (stage L
    recomputed after the tail's backward) makes a^L again beside it: its output and
    a-bar^L take x[L] more, to B(L) (Note [Accounting] 1); the forward phase's does not."""
    from remat.solver.schedule import Fn

    base = Costs.uniform(2, time=1.0, size=10)   # (a-bar^i of 10 bytes: a^i alone)
    held = Costs(**{**base.to_dict(), "output_held": True, "held_bytes": 10})
    costs = held.with_tail(fwd_time=1.0, bwd_time=1.0, out_bytes=0, saved_bytes=0, fwd_tmp=0, bwd_tmp=0)
    stored = [Fall(1), Fall(2), Fall(3), Loss, B(3), B(2), B(1)]
    again = [Fall(1), Fn(2), Fall(3), Loss, B(3), Fall(2), B(2), B(1)]
    trace_stored, trace_again = [], []
    simulate(costs, stored, trace_stored)
    simulate(costs, again, trace_again)
    assert [(d, m) for op, d, m in trace_stored if op == Fall(2)] == [(40, 40)]   # (a^2 in held_bytes)
    # after B(3): a^0, a-bar^1, a^2 (held_bytes) and its gradient; Fall(2) keeps a-bar^2 and the copy of a^2
    assert [(d, m) for op, d, m in trace_again if op in (Fall(2), B(2))] == [(60, 60), (70, 40)]
    assert simulate(costs, again).peak == 70 and simulate(costs, stored).peak == 60
