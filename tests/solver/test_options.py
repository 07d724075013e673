"""Options, other ways to record a stage (remat/solver/option.py Note [Options]):
the C solver against the reference DP and exhaustive search with them, simulate's
accounting, what they gain, and Costs, schedules and plans that carry them."""

import math
import pickle
import random

import pytest
from hypothesis import given, strategies as st

from exhaustive import best_schedule
from random_costs import random_costs, random_options, unheld
from test_solver import c_optimal, close, reference_optimal
from remat.solver import binding as _c_solver
from remat.solver._solver import ffi, lib
from remat.solver.costs import Costs
from remat.solver.option import Option
from remat.solver.plan import Plan
from remat.solver.schedule import B, Fall, Fck, Loss, Schedule, simulate
from remat.solver.solve import discretise, fastest, minimum_budget, slot_size, solve, store_all, time_bound
from remat.errors import InvalidScheduleError, SolverError


def _costs(rng, n, **kw):
    """Random costs with 0 to 3 options a stage, nothing held through the step."""
    return unheld(random_options(rng, random_costs(rng, n, **kw)), 0)[0]


@given(seed=st.integers(0, 2**32), n=st.integers(1, 30), slots=st.sampled_from([4, 9, 20]))
def test_options_match_reference(seed, n, slots):
    """With options, C and the reference DP agree on feasibility and time, and the
    schedule fits its slots with that time."""
    rng = random.Random(seed)
    costs = _costs(rng, n, zero_times=rng.random() < 0.3)
    budget = rng.randint(1, simulate(costs, store_all(n)).peak + 10)
    slot = slot_size(budget, slots)
    want, _ = reference_optimal(discretise(costs, slot), budget // slot, slot)
    got, ops = c_optimal(costs, budget, slots)
    assert (want == math.inf) == (got == math.inf)
    if ops is not None:
        sim = simulate(discretise(costs, slot), ops)
        assert close(got, want) and close(sim.time, got)
        assert sim.peak <= budget // slot


@pytest.mark.parametrize("seed", range(60))
def test_options_exhaustive_equals_dp(seed):
    """On L <= 4 with options, the best persistent schedule (exhaustive) has the DP's
    time in exact bytes, and no schedule at all beats the time bound."""
    rng = random.Random(seed)
    costs = _costs(rng, rng.randint(1, 4), size=6)
    budget = rng.randint(minimum_budget(costs), simulate(costs, store_all(costs.length)).peak)
    dp, ops = c_optimal(costs, budget, max(budget, 1))   # slot = 1 byte: exact
    assert simulate(costs, ops).peak <= budget
    want, _ = best_schedule(costs, budget, persistent=True)
    assert close(dp, want)
    anything, _ = best_schedule(costs, budget, persistent=False)
    assert time_bound(costs, budget) <= anything * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_options_least_memory_is_least(seed):
    """With options the least-memory schedule fits its minimum, the reference finds
    nothing a byte below, and the minimum is at most the one without options."""
    rng = random.Random(seed)
    costs = _costs(rng, rng.randint(1, 8), size=12)
    ops, least = _c_solver.least_memory(costs)
    assert simulate(costs, ops).peak <= least <= _c_solver.least_memory(costs.without_options())[1]
    assert reference_optimal(costs, least, 1)[0] < math.inf
    assert reference_optimal(costs, least - 1, 1)[0] == math.inf


@given(seed=st.integers(0, 2**32), n=st.integers(2, 25))
def test_options_are_never_slower(seed, n):
    """At the same budget a chain with options is never slower than without them:
    in the table at one slot size, and from ``solve``, whose schedule fits."""
    rng = random.Random(seed)
    costs = random_options(rng, random_costs(rng, n, size=rng.choice([40, 10**6])))
    plain = costs.without_options()
    least, peak = minimum_budget(plain), simulate(plain, store_all(n)).peak
    for budget in (least, rng.randint(least, peak), peak):
        slots = rng.choice([5, 20, 500])
        held = costs.held_bytes
        assert c_optimal(costs, budget - held, slots)[0] <= c_optimal(plain, budget - held, slots)[0] * (1 + 1e-12)
        with_options, without = solve(costs, budget, slots=slots), solve(plain, budget, slots=slots)
        assert with_options.peak <= budget and with_options.time <= without.time * (1 + 1e-12)


def test_options_that_keep_less_lower_the_minimum():
    """Three stages whose records are 10x their outputs, each with an option keeping
    its output alone and rebuilding the rest in a backward twice as long, in
    pieces (bwd_tmp 40 of the 90 bytes): the chain's minimum falls from 140 to 90
    bytes, where the plan records with the options; at 100 bytes it records every
    stage with them, and at the old minimum it is as fast as without them."""
    bare = Costs.uniform(3, time=1.0, size=10, saved=100)
    keep_less = Option(saved_bytes=10, fwd_time=1.0, bwd_time=4.0, fwd_tmp=0, bwd_tmp=40)
    costs = bare.with_options({1: [keep_less], 2: [keep_less], 3: [keep_less]})
    assert (minimum_budget(bare), minimum_budget(costs)) == (140, 90)
    s = solve(costs, 90)
    assert Fall(3, option=1) in s.ops and s.peak == simulate(costs, s.ops).peak == 90
    assert solve(costs, 100).ops == tuple(
        Fall(i, option=1) for i in (1, 2, 3)) + (Loss, B(3), B(2), B(1))
    assert solve(costs, 140).time == solve(bare, 140).time == 12.0


def test_fastest_options_are_recorded_where_they_fit():
    """An option faster than its base record (and no larger) is what storing
    everything records, and the time bound at that peak is its time."""
    bare = Costs.uniform(3, time=1.0, size=10, saved=100)
    costs = bare.with_options({1: [Option(saved_bytes=100, fwd_time=0.5, bwd_time=1.0, fwd_tmp=0, bwd_tmp=0)]})
    ops = fastest(costs)
    assert ops[0] == Fall(1, option=1) and ops[1:] == store_all(3)[1:]
    sim = simulate(costs, ops)
    assert sim.time == simulate(bare, store_all(3)).time - 1.5
    s = solve(costs, sim.peak)
    assert s.ops == ops and close(time_bound(costs, sim.peak), sim.time)


@pytest.mark.parametrize("seed", range(4))
def test_options_fast_table_matches_naive(seed):
    """With options, the pruned ranged table, the plain table and the float32 table
    (at the least table size that solves) agree on the optimal time."""
    rng = random.Random(seed)
    costs = _costs(rng, rng.randint(10, 25))
    budget = (minimum_budget(costs) + simulate(costs, store_all(costs.length)).peak) // 2
    fast = _raw(costs, budget, 50, lib.REMAT_MIN_TIME)
    assert fast[0] == _raw(costs, budget, 50, lib.REMAT_MIN_TIME_NAIVE)[0] == lib.REMAT_OK
    assert close(fast[1], _raw(costs, budget, 50, lib.REMAT_MIN_TIME_NAIVE)[1])
    lo, hi = 0, 2**30
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _raw(costs, budget, 50, lib.REMAT_MIN_TIME, mid)[0] == lib.REMAT_OK else (mid + 1, hi)
    assert close(_raw(costs, budget, 50, lib.REMAT_MIN_TIME, lo)[1], fast[1], rel=1e-6)


def test_simulate_charges_the_option_recorded():
    """A Fall with an option holds its saved_bytes with its fwd_tmp and takes its
    fwd_time; the B of that record takes its bwd_time and bwd_tmp and frees it."""
    bare = Costs.uniform(2, time=1.0, size=10, saved=100)
    costs = bare.with_options({1: [Option(saved_bytes=30, fwd_time=2.0, bwd_time=5.0, fwd_tmp=50, bwd_tmp=40)]})
    trace = []
    sim = simulate(costs, [Fall(1, option=1), Fall(2), Loss, B(2), B(1)], trace)
    assert [(str(op), during, held) for op, during, held in trace] == [
        ("Fall1:o1", 10 + 10 + 50, 10 + 30), ("Fall2", 140, 140), ("Loss", 150, 150),
        ("B2", 150 + 10, 50), ("B1", 50 + 10 + 40, 10)]
    assert sim == (2.0 + 1.0 + 2.0 + 5.0, 160)


def test_options_let_nothing_go_in_the_forward_phase():
    """Rule 9 of Note [Accounting]: a Fall with an option lets none of its input go,
    nor does the Fall after it let go of an a^i inside an option's a-bar^i; with the
    base records both are let go (fwd_drop, fwd_drop_whole)."""
    bare = Costs(**{**Costs.uniform(3, size=10, saved=100).to_dict(), "fwd_drop": [10, 10, 0],
                    "fwd_drop_whole": [10, 10, 0]})
    same = Option(saved_bytes=100, fwd_time=1.0, bwd_time=2.0, fwd_tmp=0, bwd_tmp=0)   # the base record's numbers
    costs = bare.with_options({1: [same], 2: [same]})
    def held(*forward):
        trace = []
        simulate(costs, forward + (Loss, B(3), B(2)) + ((B(1),) if type(forward[0]) is Fall else (Fall(1), B(1))),
                 trace)
        return [after for _, _, after in trace[:3]]

    assert held(Fall(1), Fall(2), Fall(3)) == [110, 200, 290]   # a^1, a^2 let go
    assert held(Fall(1, option=1), Fall(2), Fall(3)) == [110, 210, 300]   # a^1 kept, a^2 let go
    assert held(Fall(1), Fall(2, option=1), Fall(3)) == [110, 210, 310]
    assert held(Fck(1), Fall(2), Fall(3)) == [20, 110, 200]
    assert held(Fck(1), Fall(2, option=1), Fall(3)) == [20, 120, 220]


def test_simulate_refuses_an_option_a_stage_does_not_have():
    """Fall(i, option=k) needs the stage to list k options; option 0 always exists."""
    costs = Costs.uniform(2, size=10).with_options({2: [Option(10, 1.0, 1.0, 0, 0)]})
    for op in (Fall(1, option=1), Fall(1, option=-1), Fall(1, option="1")):
        with pytest.raises(InvalidScheduleError, match=r"stage 1 has no option .* lists 0 for it"):
            simulate(costs, [op, Fall(2), Loss, B(2), B(1)])
    assert simulate(costs, [Fall(1, option=0), Fall(2, option=1), Loss, B(2), B(1)]).time == 1 + 1 + 1 + 2


def test_fall_with_an_option_as_a_value():
    """Fall's option is part of its equality, hash, pickle and str (only where it is
    not 0: other schedules read as before), and the plan carries each stage's."""
    op = Fall(3, option=2)
    assert (str(op), repr(op), str(Fall(3)), repr(Fall(3))) == (
        "Fall3:o2", "Fall(stage=3, option=2)", "Fall3", "Fall(stage=3)")
    assert op == Fall(3, 2) != Fall(3) == Fall(3, option=0) and hash(Fall(3)) == hash(Fall(3, option=0))
    assert pickle.loads(pickle.dumps(op)) == op and pickle.loads(pickle.dumps(Fall(3))) == Fall(3)
    costs = Costs.uniform(3, size=10).with_options({1: [Option(10, 1.0, 1.0, 0, 0)], 3: [Option(5, 1.0, 1.0, 0, 0)]})
    ops = (Fall(1, option=1), Fck(2), Fall(3, option=1), Loss, B(3), Fall(2), B(2), B(1))
    assert str(Schedule(ops)) == "Fall1:o1 Fck2 Fall3:o1\n| B3 Fall2 B2 B1"
    plan = Plan.of(Schedule(ops), costs)
    assert plan.options == (None, 1, 0, 1) and plan.modes == (None, Fall, Fck, Fall)


@pytest.mark.parametrize("options, match", [
    ("abc", r"Costs.options must be a list with one entry per stage"),
    ([[], []], r"Costs.options has 2 entries but fwd_time has 3"),
    ([[], Option(1, 1.0, 1.0, 0, 0), []], r"options\[1\] \(stage 2\) must be a list of remat.Option"),
    ([[], [(1, 1.0, 1.0, 0, 0)], []], r"options\[1\]\[0\] \(stage 2, option 1\) must be a remat.Option"),
    ([[{"saved_bytes": 1, "fwd_time": 1.0}], [], []], r"must be a remat.Option or a dict of exactly"),
    ([[Option(-1, 1.0, 1.0, 0, 0)], [], []], r"options\[0\]\[0\].saved_bytes \(stage 1, option 1\) is -1"),
    ([[], [], [Option(1, float("nan"), 1.0, 0, 0)]], r"options\[2\]\[0\].fwd_time \(stage 3, option 1\) is nan"),
    ([[Option(1, 1.0, 1.0, 0, 0), Option(1, 1.0, 1.0, 0, -11)], [], []],
     r"options\[0\]\[1\].bwd_tmp \(stage 1, option 2\) is -11; it may give back"),
    ([[Option(1, 1.0, 1e30, 0, 0)], [], []], r"bwd_time \(stage 1, option 1\) is 1e\+30 seconds"),
    ([[Option(1, 1.0, 1.0, 0.5, 0)], [], []], r"fwd_tmp \(stage 1, option 1\) must be a non-negative int"),
    ([[Option(1, 1.0, 1.0, 0, 0)] * 65, [], []], r"options\[0\] \(stage 1\) lists 65 options; a stage may have at"),
])
def test_costs_check_options(options, match):
    """Costs checks each option as it checks the stage's own fields, naming the
    stage and the option."""
    from remat.errors import CostsError

    with pytest.raises(CostsError, match=match):
        Costs(**{**Costs.uniform(3, size=10).to_dict(), "options": options})


def test_costs_with_options_round_trip(tmp_path):
    """Options survive to_dict/from_dict, a costs file (format remat.costs/2 where
    there are options, /1 and no options key where there are none), the tail's
    transforms (the tail has none) and discretise; the solver refuses options that
    skipped Costs' checks."""
    import json

    from remat.errors import CostsError

    costs = random_options(random.Random(1), random_costs(random.Random(1), 6, tail=False))
    assert costs.has_options and Costs.from_dict(costs.to_dict()) == costs
    costs.save(tmp_path / "o.json")
    assert json.loads((tmp_path / "o.json").read_text())["format"] == "remat.costs/2"
    assert Costs.load(tmp_path / "o.json") == costs
    costs.without_options().save(tmp_path / "plain.json")
    assert "options" not in json.loads((tmp_path / "plain.json").read_text())
    assert json.loads((tmp_path / "plain.json").read_text())["format"] == "remat.costs/1"
    tailed = costs.with_tail(1.0, 1.0, 4, 40, 0, 0)
    assert tailed.options == costs.options + ((),) and tailed.without_tail() == costs
    with pytest.raises(CostsError, match=r"the chain's tail .* give it \[\]"):
        tailed.with_options({7: [Option(4, 1.0, 1.0, 0, 0)]})
    small = discretise(costs, 7)
    assert [len(s) for s in small.options] == [len(s) for s in costs.options]
    assert all(o.saved_bytes == -(-p.saved_bytes // 7) for s, t in zip(small.options, costs.options)
               for o, p in zip(s, t))
    object.__setattr__(costs, "options", ((Option(1, 1.0, -1.0, 0, 0),),) + costs.options[1:])
    with pytest.raises(SolverError, match=r"options\[0\]\[0\].bwd_time \(stage 1, option 1\) is -1.0"):
        _c_solver.optimal(costs, 1000, 10)


def test_entry_point_checks_options():
    """remat_solve refuses option counts that do not count up from 0 by at most 64
    a stage (REMAT_E_OPTIONS, naming the stage), missing option arrays or a plan
    without room for options (REMAT_E_NULL), and bad option numbers."""
    costs = random_options(random.Random(2), random_costs(random.Random(2), 5, tail=False), most=2)
    assert costs.has_options
    chain, keep = _c_solver._chain(costs)
    first, given = list(ffi.unpack(chain.option_first, 6)), chain.option_first
    for bad, stage in (([1] + first[1:], 1), (first[:3] + [first[2] - 1] + first[4:], 3),
                       (first[:4] + [first[3] + 65, first[3] + 65], 4)):
        keep.append(ffi.new("long long[]", bad))
        chain.option_first = keep[-1]
        assert _solve(chain, 5) == (lib.REMAT_E_OPTIONS, stage)
    chain.option_first = given
    assert _solve(chain, 5)[0] == lib.REMAT_OK
    assert _solve(chain, 5, options=False)[0] == lib.REMAT_E_NULL
    saved, chain.option_saved_bytes = chain.option_saved_bytes, ffi.NULL
    assert _solve(chain, 5)[0] == lib.REMAT_E_NULL
    chain.option_saved_bytes = saved
    keep.append(ffi.new("long long[]", [-10**6] * first[-1]))
    chain.option_bwd_tmp = keep[-1]
    assert _solve(chain, 5)[0] == lib.REMAT_E_SIZE


def _solve(chain, n, options=True):
    """(status, bad_stage) of remat_solve on ``chain`` of n stages."""
    cap = n * (n + 1) // 2 + 2 * n + 1
    codes, stages, opts = ffi.new("int[]", cap), ffi.new("int[]", cap), ffi.new("int[]", cap)
    plan = ffi.new("remat_plan *")
    plan.capacity, plan.codes, plan.stages, plan.options = cap, codes, stages, opts if options else ffi.NULL
    status = lib.remat_solve(chain, 10**6, 50, lib.REMAT_MIN_TIME, 2**30, plan)
    return status, plan.bad_stage


def _raw(costs, budget, slots, mode, limit=2**31):
    """(status, time) straight from lib.remat_solve."""
    chain, keep = _c_solver._chain(costs)
    n = costs.length
    cap = n * (n + 1) // 2 + 2 * n + 1
    codes, stages, opts = ffi.new("int[]", cap), ffi.new("int[]", cap), ffi.new("int[]", cap)
    plan = ffi.new("remat_plan *")
    plan.capacity, plan.codes, plan.stages, plan.options = cap, codes, stages, opts
    status = lib.remat_solve(chain, budget, slots, mode, limit, plan)
    return status, plan.time
