"""The C solver against the Python reference DP, exhaustive search and simulate."""

import math
import os
import random
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from exhaustive import best_schedule
from random_costs import random_costs, unheld
import reference_solver
from remat.solver import binding as _c_solver
from remat.solver._solver import ffi, lib
from remat.solver.costs import Costs
from remat.errors import BudgetError, CostsError, SolverError
from remat.solver.schedule import simulate
from remat.solver.solve import discretise, minimum_budget, periodic, slot_size, solve, store_all, time_bound
from remat.units import format_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository
STATUSES = set(range(lib.REMAT_OK, lib.REMAT_E_INTERNAL))   # INTERNAL is a bug


def reference_optimal(costs, budget_units, units):
    """tests/reference_solver.py, leaving the recursion limit as it found it."""
    limit = sys.getrecursionlimit()
    try:
        return reference_solver.reference_optimal(costs, budget_units, units)
    finally:
        sys.setrecursionlimit(limit)


def c_optimal(costs, budget, slots):
    """(time, ops) from the C solver, (inf, None) if infeasible."""
    try:
        ops, time, _ = _c_solver.optimal(costs, budget, slots)
    except _c_solver.Infeasible:
        return math.inf, None
    return time, ops


def close(a, b, rel=1e-9):
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


@given(seed=st.integers(0, 2**32), n=st.integers(1, 40), slots=st.sampled_from([4, 9, 20]))
def test_matches_reference(seed, n, slots):
    """C and the Python reference DP agree on feasibility and optimal time."""
    rng = random.Random(seed)
    costs, budget = unheld(random_costs(rng, n, zero_times=rng.random() < 0.3), 0)
    budget = rng.randint(1, simulate(costs, store_all(n)).peak + 10)
    slot = slot_size(budget, slots)
    want, _ = reference_optimal(discretise(costs, slot), budget // slot, slot)
    got, ops = c_optimal(costs, budget, slots)
    assert (want == math.inf) == (got == math.inf)
    if ops is not None:
        assert close(got, want)
        assert simulate(discretise(costs, slot), ops).peak <= budget // slot


@pytest.mark.parametrize("seed", range(6))
def test_fast_matches_naive_table(seed):
    """The pruned ranged table and the plain O(L^3 slots) table give the same time."""
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(10, 30))
    budget = (minimum_budget(costs) + simulate(costs, store_all(costs.length)).peak) // 2
    fast = _raw(costs, budget, 50, lib.REMAT_MIN_TIME)
    naive = _raw(costs, budget, 50, lib.REMAT_MIN_TIME_NAIVE)
    assert fast[0] == naive[0] == lib.REMAT_OK
    assert close(fast[1].time, naive[1].time)


@pytest.mark.parametrize("seed", range(12))
def test_fast_matches_naive_table_where_the_caller_holds_the_output(seed):
    """The same where the caller holds a^L (Costs.output_held: a^L on its own takes
    nothing more, only in the split before the tail) at budgets near the least."""
    rng = random.Random(seed)
    base = random_costs(rng, rng.randint(10, 30), tail=False)
    out = base.out_bytes[-1]
    costs = Costs(**{**base.to_dict(), "output_held": True, "held_bytes": base.held_bytes + out}).with_tail(
        1.0, 1.0, 2, 10 * max(out, 5), 5 * max(out, 5), 0)
    least, most = minimum_budget(costs), simulate(costs, store_all(costs.length)).peak
    for budget in (least + 2 * out, (least + most) // 3):
        fast = _raw(costs, budget, 50, lib.REMAT_MIN_TIME)
        naive = _raw(costs, budget, 50, lib.REMAT_MIN_TIME_NAIVE)
        assert fast[0] == naive[0]
        assert fast[0] != lib.REMAT_OK or close(fast[1].time, naive[1].time)


def test_float_tables_stay_close():
    """Tables too large for doubles fall back to float32 and stay within 1e-6 of the double result."""
    costs = random_costs(random.Random(3), 30)
    budget = (minimum_budget(costs) + simulate(costs, store_all(30)).peak) // 2
    status, plan = _raw(costs, budget, 200, lib.REMAT_MIN_TIME)
    assert status == lib.REMAT_OK
    lo, hi = 0, 2**30    # the least max_table_bytes that still solves uses float32
    while lo < hi:
        mid = (lo + hi) // 2
        if _raw(costs, budget, 200, lib.REMAT_MIN_TIME, limit=mid)[0] == lib.REMAT_OK:
            hi = mid
        else:
            lo = mid + 1
    status, small = _raw(costs, budget, 200, lib.REMAT_MIN_TIME, limit=lo)
    assert status == lib.REMAT_OK
    assert close(small.time, plan.time, rel=1e-6)
    assert _raw(costs, budget, 200, lib.REMAT_MIN_TIME, limit=lo - 1)[0] == lib.REMAT_E_TOO_LARGE


_GAINS = []


@pytest.mark.parametrize("seed", range(60))
def test_exhaustive_persistent_equals_dp(seed):
    """On L <= 4 the best persistent schedule (exhaustive) has the DP's time, in exact bytes."""
    rng = random.Random(seed)
    costs, _ = unheld(random_costs(rng, rng.randint(1, 4), size=6), 0)
    budget = rng.randint(minimum_budget(costs), simulate(costs, store_all(costs.length)).peak)
    dp, _ = c_optimal(costs, budget, max(budget, 1))    # slot = 1 byte: exact
    want, _ = best_schedule(costs, budget, persistent=True)
    assert close(dp, want)
    anything, _ = best_schedule(costs, budget, persistent=False)
    assert anything <= dp * (1 + 1e-9)
    _GAINS.append(anything < dp * (1 - 1e-9))
    assert time_bound(costs, budget) <= anything * (1 + 1e-9)   # Note [A bound on any schedule]


@pytest.mark.parametrize("seed", range(40))
def test_rebuilt_backwards_needing_less_are_planned_exactly(seed):
    """Where every rebuilt B(i) needs as little as it may (Costs.bwd_rebuilt_less at
    its most), the DP, the reference and the exhaustive search agree in exact bytes,
    at budgets from the minimum up (a solver that ignored it finds slower plans, or none)."""
    rng = random.Random(seed)
    costs, _ = unheld(random_costs(rng, rng.randint(2, 4), size=6), 0)
    costs = Costs(**{**costs.to_dict(), "bwd_rebuilt_less": [b + o for b, o in zip(costs.bwd_tmp, costs.out_bytes)]})
    budget = rng.randint(minimum_budget(costs), minimum_budget(costs) + 6)
    dp, ops = c_optimal(costs, budget, max(budget, 1))
    assert close(dp, best_schedule(costs, budget, persistent=True)[0])
    assert close(dp, reference_optimal(costs, budget, 1)[0])
    assert simulate(costs, ops).peak <= budget


def test_non_persistent_gain_is_recorded(record_property):
    """Records how often a non-persistent schedule beats the persistent optimum on L <= 4."""
    gains = _GAINS or [
        best_schedule(c, b, False)[0] < best_schedule(c, b, True)[0] * (1 - 1e-9)
        for c, b in ((random_costs(random.Random(s), 4, size=6), 40) for s in range(20))
    ]
    fraction = sum(gains) / len(gains)
    record_property("non_persistent_gain_fraction", fraction)
    print(f"non-persistent schedules beat the persistent optimum in {sum(gains)}/{len(gains)} chains")
    assert 0 <= fraction < 1


@pytest.mark.parametrize("seed", range(20))
def test_time_bound(seed):
    """Note [A bound on any schedule]: no schedule the solver finds is faster than the
    bound, which is store-all's time where that fits and inf below what a^0 and
    held_bytes take; on like blocks whose a-bar dwarfs their output it is, at each
    periodic schedule's peak, within the segment inputs' bytes of that schedule."""
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(1, 30), size=rng.choice([6, 40]))
    all_peak = simulate(costs, store_all(costs.length)).peak
    assert close(time_bound(costs, all_peak), simulate(costs, store_all(costs.length)).time)
    assert time_bound(costs, costs.input_bytes - 1) == math.inf
    for budget in sorted(rng.randint(minimum_budget(costs), all_peak) for _ in range(4)):
        assert time_bound(costs, budget) <= simulate(costs, solve(costs, budget)).time * (1 + 1e-9)
    like = Costs.uniform(12, time=1.0, size=1, saved=100)
    for k in (2, 3, 4, 6):
        sim = simulate(like, periodic(12, k))
        assert sim.time - 1.0 <= time_bound(like, sim.peak) <= sim.time


ALGOS = ["optimal", "store_all", "min_memory", "sqrt", "periodic(2)", "periodic(3)"]


@pytest.mark.parametrize("seed", range(12))
def test_every_algorithm_fits_and_optimal_wins(seed):
    """Every algorithm's schedule simulates within budget, and optimal beats any that fits its slots."""
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(2, 14), size=200)
    least, peak = minimum_budget(costs), simulate(costs, store_all(costs.length)).peak
    budget = rng.randint(least, peak)
    schedules = {}
    for algo in ALGOS:
        try:
            schedules[algo] = solve(costs, budget, algo, slots=50)
        except BudgetError:
            continue
        s = schedules[algo]
        sim = simulate(costs, s.ops)
        assert sim.peak <= budget and s.peak == sim.peak and s.time == sim.time
    best = schedules["optimal"]
    if best.slot_bytes is None:
        return
    small = discretise(costs, best.slot_bytes)
    for algo, s in schedules.items():
        if simulate(small, s.ops).peak <= budget // best.slot_bytes:
            assert best.time <= s.time * (1 + 1e-9), algo


@pytest.mark.parametrize("seed", range(12))
def test_optimal_at_a_periodic_peak_is_no_slower(seed):
    """At the exact peak of a periodic schedule (checkpoint_sequential's, at the
    memory it measures), optimal is at least as fast, slots or not."""
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(2, 30), size=10**6)
    n = costs.length
    for k in range(1, costs.stages + 1):
        p = simulate(costs, periodic(n, k, costs.tail))
        if p.peak < minimum_budget(costs):
            continue
        assert solve(costs, p.peak, slots=20).time <= p.time * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_more_budget_never_slower(seed):
    """At a fixed slot size, a larger budget never gives a slower optimal schedule."""
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(3, 20), size=40)
    slot = 3
    last = math.inf
    for k in range(1, simulate(costs, store_all(costs.length)).peak // slot + 3):
        time, _ = c_optimal(costs, k * slot, k)
        assert time <= last * (1 + 1e-12)
        last = time


def _boundary_costs():
    return random_costs(random.Random(11), 9, size=1000)


@pytest.mark.parametrize("which", ["minimum", "minimum-1", "zero", "store_all"])
def test_budget_boundaries(which):
    """Budget at the minimum fits, one byte less or zero raises, store-all peak recomputes nothing."""
    costs = _boundary_costs()
    least, peak = minimum_budget(costs), simulate(costs, store_all(9)).peak
    budget = {"minimum": least, "minimum-1": least - 1, "zero": 0, "store_all": peak}[which]
    if which in ("minimum-1", "zero"):
        with pytest.raises(BudgetError):
            solve(costs, budget)
        return
    s = solve(costs, budget)
    assert s.peak <= budget
    if which == "store_all":
        assert s.recomputations() == 0


def test_budget_error_names_minimum():
    """A budget below the minimum raises BudgetError naming the minimum in human units."""
    costs = Costs.uniform(12, size=3 * 2**20)
    least = minimum_budget(costs)
    with pytest.raises(BudgetError) as info:
        solve(costs, least - 1)
    assert format_bytes(least) in str(info.value)


def test_output_given_back_loss_level_binds():
    """A last stage whose backward gives its output back (bwd_tmp = -out_bytes) still
    needs, at ``Loss``, a-bar^L with the gradient of a^L: the solvers' B(L) condition
    counts that level, which B(L)'s own sum (smaller than it here) does not."""
    costs = Costs(fwd_time=[1.0, 1.0], fwd_nograd_time=[1.0, 1.0], bwd_time=[1.0, 1.0],
                  out_bytes=[4, 40], saved_bytes=[4, 40], fwd_tmp=[0, 0], bwd_tmp=[0, -40],
                  input_bytes=4)
    peak = simulate(costs, store_all(2)).peak
    assert peak == 4 + 4 + 40 + 40   # Loss: a^0, a-bar^1, a-bar^2 and the gradient of a^2
    assert minimum_budget(costs) == peak == solve(costs, peak).peak
    assert reference_optimal(costs, peak, 1)[0] < math.inf
    assert reference_optimal(costs, peak - 1, 1)[0] == math.inf
    with pytest.raises(BudgetError):
        solve(costs, peak - 1)


def test_least_memory_is_least():
    """The least-memory schedule fits its minimum, and the reference finds nothing one byte below."""
    for seed in range(30):
        costs, _ = unheld(random_costs(random.Random(seed), random.Random(seed).randint(1, 8), size=12), 0)
        ops, least = _c_solver.least_memory(costs)
        assert simulate(costs, ops).peak <= least
        assert reference_optimal(costs, least, 1)[0] < math.inf
        assert reference_optimal(costs, least - 1, 1)[0] == math.inf


@pytest.mark.parametrize("seed", range(5))
def test_held_bytes_come_off_the_budget(seed):
    """held_bytes is held through the step: simulate adds it to every level, and the
    solver plans the activations in the budget less it (the same schedule)."""
    rng = random.Random(seed)
    bare, _ = unheld(random_costs(rng, rng.randint(2, 12)), 0)
    held = rng.randint(1, 50)
    costs = Costs(**{**bare.to_dict(), "held_bytes": held})
    assert minimum_budget(costs) == minimum_budget(bare) + held
    assert simulate(costs, store_all(bare.length)).peak == simulate(bare, store_all(bare.length)).peak + held
    budget = (minimum_budget(bare) + simulate(bare, store_all(bare.length)).peak) // 2
    with_held, without = solve(costs, budget + held), solve(bare, budget)
    assert with_held.ops == without.ops and with_held.peak == without.peak + held <= budget + held
    with pytest.raises(BudgetError, match=format_bytes(minimum_budget(costs)).replace(".", r"\.")):
        solve(costs, minimum_budget(costs) - 1)


def test_solver_rejects_absurd_time_naming_stage():
    """A time above 1e18 s, which Costs refuses too, raises SolverError naming the stage
    in the solver's own check (for costs that did not come through Costs)."""
    c = Costs.uniform(3).to_dict()
    with pytest.raises(CostsError, match=r"bwd_time\[2\] \(stage 3\) is 1e\+30 seconds"):
        Costs(**{**c, "bwd_time": [1.0, 1.0, 1e30]})
    costs = Costs(**c)
    object.__setattr__(costs, "bwd_time", (1.0, 1.0, 1e30))
    with pytest.raises(SolverError, match=r"bwd_time\[2\] \(stage 3\)"):
        _c_solver.optimal(costs, 100, 10)


def test_capacity_status_gives_needed_count():
    """A plan too small for the schedule gets REMAT_E_CAPACITY and the count it needs."""
    costs = random_costs(random.Random(5), 12)
    status, plan = _raw(costs, 10**6, 100, lib.REMAT_MIN_TIME, capacity=3)
    assert status == lib.REMAT_E_CAPACITY
    status2, plan2 = _raw(costs, 10**6, 100, lib.REMAT_MIN_TIME, capacity=plan.n_ops)
    assert status2 == lib.REMAT_OK and plan2.n_ops == plan.n_ops


def test_too_large_table_is_a_status():
    """A table beyond max_table_bytes is refused with REMAT_E_TOO_LARGE, not attempted."""
    costs = Costs.uniform(2000, size=10)
    assert _raw(costs, 10**6, 10**6, lib.REMAT_MIN_TIME, limit=2**30, capacity=0)[0] == lib.REMAT_E_TOO_LARGE
    with pytest.raises(SolverError, match="max_table_bytes"):
        _c_solver.optimal(costs, 10**6, 10**6)


_times = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e18, 1e19]))
_sizes = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, 2**62 - 1, 2**62, -1]),
                   st.integers(0, 50))


@given(
    n=st.integers(-3, 12), data=st.data(),
    budget=st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(0, 500)),
    slots=st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(1, 100)),
    mode=st.integers(-2, 4), limit=st.one_of(st.integers(-(2**63), 2**63 - 1), st.just(2**26)),
    capacity=st.integers(-5, 200), nulls=st.sets(st.sampled_from(["chain", "plan", "fwd_time", "bwd_tmp", "codes"])),
)
def test_entry_point_survives_hostile_input(n, data, budget, slots, mode, limit, capacity, nulls):
    """remat_solve returns a defined status for any input, and a well-formed schedule on success."""
    m = max(n, 0)
    arrays = {k: ffi.new("double[]", data.draw(st.lists(_times, min_size=m, max_size=m)) or [0.0])
              for k in ("fwd_time", "fwd_nograd_time", "bwd_time")}
    arrays.update({k: ffi.new("long long[]", data.draw(st.lists(_sizes, min_size=m, max_size=m)) or [0])
                   for k in ("out_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp")})
    chain = ffi.new("remat_chain *")
    chain.length = n
    for k, v in arrays.items():
        setattr(chain, k, ffi.NULL if k in nulls else v)
    chain.input_bytes = data.draw(_sizes)
    codes, stages = ffi.new("int[]", max(capacity, 1)), ffi.new("int[]", max(capacity, 1))
    plan = ffi.new("remat_plan *")
    plan.capacity, plan.codes, plan.stages = capacity, ffi.NULL if "codes" in nulls else codes, stages
    status = lib.remat_solve(ffi.NULL if "chain" in nulls else chain, budget, slots, mode,
                             min(limit, 2**28), ffi.NULL if "plan" in nulls else plan)
    assert status in STATUSES
    assert ffi.string(lib.remat_strerror(status))
    if status == lib.REMAT_OK:
        ops = [(plan.codes[i], plan.stages[i]) for i in range(plan.n_ops)]
        assert ops.count((lib.REMAT_OP_LOSS, 0)) == 1
        assert [s for c, s in ops if c == lib.REMAT_OP_B] == list(range(n, 0, -1))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_c_fuzz_under_sanitizers():
    """The C fuzz driver runs clean under AddressSanitizer and UBSan."""
    run = subprocess.run([os.path.join(ROOT, ".ci", "fuzz.sh"), "1500"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _raw(costs, budget, slots, mode, limit=2**31, capacity=None):
    """(status, plan) straight from lib.remat_solve."""
    chain, keep = _c_solver._chain(costs)
    n = costs.length
    cap = n * (n + 1) // 2 + 2 * n + 1 if capacity is None else capacity
    codes, stages = ffi.new("int[]", max(cap, 1)), ffi.new("int[]", max(cap, 1))
    plan = ffi.new("remat_plan *")
    plan.capacity, plan.codes, plan.stages = cap, codes, stages
    status = lib.remat_solve(chain, budget, slots, mode, limit, plan)
    del keep, codes, stages   # plan.codes/stages dangle from here on: read only scalars
    return status, plan


def test_a_schedule_made_by_hand_says_it_is_unsimulated():
    """``Schedule(ops).summary()`` of ops written by hand printed 'predicted nan ms, peak -1 B'."""
    from remat import B, Fall, Loss, Schedule

    ops = [Fall(1), Fall(2), Loss, B(2), B(1)]
    assert Schedule(ops).summary() == "custom schedule: unsimulated, 0 recomputed stages"
    assert "predicted 6000.000 ms, peak 50 B" in solve(Costs.uniform(2, time=1.0, size=10), 10**6).summary()
