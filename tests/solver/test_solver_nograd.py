"""Forwards without recording (``Costs.fwd_nograd_less``): ``Fn`` and ``Fck`` after
``Loss`` run under no_grad and need less than the recording forward's ``fwd_tmp``
(remat/solver/schedule.py Note [Accounting] 2); ``simulate``, the C solver, the
reference DP, the exhaustive search and the grouped chains all count it."""

import math
import random
import sys
import types

import pytest
from hypothesis import given, strategies as st

from exhaustive import best_schedule
from random_costs import random_costs, unheld
import reference_solver
from remat.errors import CostsError, SolverError
from remat.solver import binding as _c_solver
from remat.solver.costs import Costs
from remat.solver.group import cuts, expand, grouped_costs
from remat.solver.schedule import B, Fall, Fck, Fn, Loss, simulate
from remat.solver.solve import discretise, minimum_budget, store_all


def _optimal(costs, budget):
    """(time, ops) of the C solver in 1-byte slots, (inf, None) where nothing fits."""
    try:
        ops, time, _ = _c_solver.optimal(costs, budget, max(budget, 1))
    except _c_solver.Infeasible:
        return math.inf, None
    return time, ops


def _reference(costs, budget):
    limit = sys.getrecursionlimit()
    try:
        return reference_solver.reference_optimal(costs, budget, 1)[0]
    finally:
        sys.setrecursionlimit(limit)


def _close(a, b):
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _with_less(costs, less=None):
    """``costs`` with ``fwd_nograd_less`` (at its most, fwd_tmp, if None)."""
    return Costs(**{**costs.to_dict(), "fwd_nograd_less": list(costs.fwd_tmp) if less is None else less})


def _big_transients(rng, n, uniform=False):
    """A chain without tail, options or held output whose recording forwards'
    transients are large against its sizes (where the no-grad forward's matters)."""
    costs, _ = unheld(random_costs(rng, n, size=8, tail=False), 0)
    data = {**costs.to_dict(), "output_held": False, "held_bytes": 0}
    data["fwd_tmp"] = [rng.randint(0, 40) for _ in range(n)]
    if uniform:   # (every stage's output of one size)
        out = rng.randint(1, 8)
        data.update(out_bytes=[out] * n, saved_bytes=[out + rng.randint(0, 8) for _ in range(n)],
                    bwd_tmp=[max(-out, b) for b in data["bwd_tmp"]], fwd_drop=None, fwd_drop_whole=None,
                    bwd_rebuilt_less=None)
    data.pop("fwd_nograd_less", None)
    return Costs(**data)


def test_simulate_charges_it_after_loss_only():
    """Fn and Fck in the forward phase record (fwd_tmp); after Loss they take
    fwd_tmp less fwd_nograd_less; Fall always records."""
    costs = Costs(fwd_time=[1.0] * 3, fwd_nograd_time=[1.0] * 3, bwd_time=[1.0] * 3, out_bytes=[10] * 3,
                  saved_bytes=[10] * 3, fwd_tmp=[100, 100, 100], bwd_tmp=[0] * 3, input_bytes=10,
                  fwd_nograd_less=[90, 60, 0])
    ops = [Fck(1), Fn(2), Fall(3), Loss, B(3), Fck(1), Fall(2), B(2), Fall(1), B(1)]
    trace = []
    simulate(costs, ops, trace)
    during = {i: d for i, (op, d, _) in enumerate(trace)}
    assert during[0] == 10 + 10 + 100            # Fck(1) before Loss: recording
    assert during[1] == 10 + 10 + 10 + 100       # Fn(2) before Loss (a^1 still held): recording
    assert during[5] == 10 + 10 + 10 + 10        # Fck(1) after Loss: a^0, the gradient of a^2, a^1, 100 - 90
    assert during[6] == 10 + 10 + 10 + 10 + 100  # Fall(2) after Loss records: fwd_tmp whole
    plain = Costs(**{**costs.to_dict(), "fwd_nograd_less": None})
    trace = []
    simulate(plain, ops, trace)
    assert trace[5][1] == 10 + 10 + 10 + 100


@pytest.mark.parametrize("seed", range(30))
def test_planned_exactly(seed):
    """With big recording transients and fwd_nograd_less at random (at its most in
    half), the C solver, the reference DP and the exhaustive search of persistent
    schedules agree to the byte, and the plan fits by ``simulate``."""
    rng = random.Random(seed)
    base = _big_transients(rng, rng.randint(2, 4))
    costs = _with_less(base, None if seed % 2 else [rng.randint(0, f) for f in base.fwd_tmp])
    least = minimum_budget(costs)
    assert least <= minimum_budget(base)
    for budget in sorted({least, least + rng.randint(0, 10), least + rng.randint(0, 40)}):
        dp, ops = _optimal(costs, budget)
        assert _close(dp, best_schedule(costs, budget, persistent=True)[0])
        assert _close(dp, _reference(costs, budget))
        assert simulate(costs, ops).peak <= budget
        assert dp <= _optimal(base, budget)[0] + 1e-9


def test_it_buys_faster_plans_and_lower_minimums():
    """On chains whose stage outputs differ in size, the no-grad forward's
    smaller transient lets the solver recompute less, and go lower, than if it
    were charged the recording one (a solver ignoring it finds neither)."""
    faster = lower = 0
    for seed in range(120):
        rng = random.Random(seed)
        base = _big_transients(rng, rng.randint(2, 5))
        costs = _with_less(base)
        lower += minimum_budget(costs) < minimum_budget(base)
        for budget in range(minimum_budget(costs), simulate(base, store_all(base.length)).peak + 1, 3):
            with_less, without = _optimal(costs, budget)[0], _optimal(base, budget)[0]
            assert with_less <= without + 1e-9
            faster += with_less < without - 1e-9
    assert faster > 0 and lower > 0


@given(seed=st.integers(0, 2**32), n=st.integers(2, 6))
def test_outputs_of_one_size_never_change(seed, n):
    """Where every stage's output has one size (a transformer's blocks) and no stage
    has options (an option's Fall may need less than Fn's recording transient), charging
    Fn/Fck after Loss the recording transient changes no optimum: each such run
    of stage k is followed, before B(k), by Fall(k), which records, with no less
    held (the gradient of a^k in place of that of a^t, of the same size). Checked
    at every budget from the least to store-all."""
    rng = random.Random(seed)
    base = _big_transients(rng, n, uniform=True)
    costs = _with_less(base)
    assert minimum_budget(costs) == minimum_budget(base)
    for budget in range(minimum_budget(base), simulate(base, store_all(n)).peak + 1):
        assert _close(_optimal(costs, budget)[0], _optimal(base, budget)[0])


@given(seed=st.integers(0, 2**32), n=st.integers(2, 12))
def test_grouped_chains_bound_their_stages(seed, n):
    """A coarse chain's fwd_nograd_less (remat/solver/group.py Note [Groups] 3):
    its schedules, as its stages' ops, peak no higher on the stages' own costs."""
    rng = random.Random(seed)
    costs = _with_less(_big_transients(rng, n), None if rng.random() < 0.5 else
                       [rng.randint(0, f) for f in _big_transients(random.Random(seed), n).fwd_tmp])
    ranges = cuts(costs, rng.randint(1, n))
    coarse = grouped_costs(costs, ranges)
    assert all(0 <= v <= f for v, f in zip(coarse.fwd_nograd_less, coarse.fwd_tmp))
    top = simulate(coarse, store_all(coarse.length)).peak
    for budget in (minimum_budget(coarse), (minimum_budget(coarse) + top) // 2):
        ops = _optimal(coarse, budget)[1]
        assert simulate(costs, expand(ops, ranges)).peak <= simulate(coarse, ops).peak


def test_the_field_is_checked_and_kept(tmp_path):
    """0..fwd_tmp, optional (files without it read as 0 everywhere, and costs where it
    is 0 write none), kept through files, tails and slot rounding; the solver
    refuses a value out of range that reached it unchecked."""
    good = dict(fwd_time=[1.0, 1.0], fwd_nograd_time=[1.0, 1.0], bwd_time=[2.0, 2.0], out_bytes=[10, 10],
                saved_bytes=[10, 10], fwd_tmp=[5, 7], bwd_tmp=[0, 0], input_bytes=10)
    with pytest.raises(CostsError, match=r"fwd_nograd_less\[1\] \(stage 2\) is 8; it must be at most the "
                                         r"stage's fwd_tmp \(7\)"):
        Costs(**{**good, "fwd_nograd_less": [0, 8]})
    with pytest.raises(CostsError, match=r"fwd_nograd_less\[0\] \(stage 1\)"):
        Costs(**{**good, "fwd_nograd_less": [-1, 0]})
    plain = Costs(**good)
    assert "fwd_nograd_less" not in plain.to_dict() and plain.fwd_tmp_nograd == (5, 7)
    less = Costs(**{**good, "fwd_nograd_less": [5, 3]})
    assert less.fwd_tmp_nograd == (0, 4)
    less.save(tmp_path / "less.json")
    assert Costs.load(tmp_path / "less.json") == less
    tailed = less.with_tail(1.0, 1.0, 1, 4, 2, 0)
    assert tailed.fwd_nograd_less == (5, 3, 0) and tailed.without_tail() == less
    rows = tailed.table().splitlines()   # (a column of its own; none for the tail, never run so)
    assert rows[0].split()[-2:] == ["nograd", "tmp"] and rows[2].split()[-2:] == ["0", "B"]
    assert rows[3].split()[-2:] == ["4", "B"] and len(rows[4].split()) == len(rows[3].split()) - 2
    rounded = discretise(less, 4)   # (fwd_tmp 7 -> 2 slots; without recording 4 bytes -> 1 slot)
    assert rounded.fwd_tmp == (2, 2) and rounded.fwd_tmp_nograd == (0, 1)
    with pytest.raises(SolverError, match=r"fwd_nograd_less\[1\] \(stage 2\) is 9; the solver needs 0..fwd_tmp"):
        _c_solver._check_costs(types.SimpleNamespace(**{**good, "fwd_nograd_less": [0, 9], "length": 2}))
