"""Autocast's casts held in the forward phase only (``Costs.cast_bytes``, remat/solver/schedule.py
Note [Accounting] 10, remat/solver/casts.py Note [Casts freed at the Loss]): ``simulate``'s rule,
and the optimal solve that plans at raised budgets and keeps what the rule fits."""

import random

import pytest
from hypothesis import given, strategies as st

from random_costs import random_costs
from remat.errors import BudgetError, CostsError
from remat.solver.costs import Costs
from remat.solver.schedule import B, Fall, Fck, Loss, simulate
from remat.solver.solve import minimum_budget, solve, store_all, time_bound


def _with_casts(costs, casts):
    """``costs`` with ``casts`` bytes of autocast's copies per stage, held through the step
    as the C solver plans them (in ``held_bytes``)."""
    return Costs.from_dict({**costs.to_dict(), "cast_bytes": casts, "held_bytes": costs.held_bytes + sum(casts)})


def test_rule_10_by_hand():
    """Two stages of output 10 and record 30, each with 5 bytes of casts: the forward phase
    holds each stage's from its forward on, the backward only the records' casts."""
    plain = Costs.uniform(2, size=10, saved=30)
    costs = _with_casts(plain, [5, 5])
    through = plain.with_held(10)   # (the casts held through the step, as the C solver plans them)
    trace = []
    # store all: input 10; Fall1 10 + 30 + 5; Fall2 + 30 + 5; Loss + the gradient (10), the casts
    # now the records'; B2's peak + the gradient it makes (10); then 35 + 10 of it go
    assert simulate(costs, store_all(2), trace).peak == 100 == simulate(through, store_all(2)).peak
    assert [(during, mem) for _, during, mem in trace] == [(45, 45), (80, 80), (90, 90), (100, 55), (65, 10)]
    # stage 1 recomputed: Fck1 holds a^1 and stage 1's casts (10 + 5) to Loss, which lets the
    # casts go (the cache) but stage 2's (its record's); Fall(1) after Loss rebuilds a-bar^1
    # with its casts (35)
    ops = [Fck(1), Fall(2), Loss, B(2), Fall(1), B(1)]
    trace = []
    assert simulate(costs, ops, trace).peak == 75
    assert [(during, mem) for _, during, mem in trace] == [(20, 25), (60, 60), (65, 65), (75, 20), (55, 55), (65, 10)]
    assert simulate(through, ops).peak == 80   # (stage 1's casts held at B(2) too)
    with pytest.raises(CostsError, match="cast_bytes"):   # (the casts are part of held_bytes)
        Costs.from_dict({**costs.to_dict(), "held_bytes": 9})


@given(st.integers(0, 2**32), st.integers(2, 9), st.floats(0, 1))
def test_the_solve_fits_by_rule_10_and_is_never_slower(seed, n, where):
    """Random chains with random casts: the optimal schedule's peak by rule 10 is within
    the budget, its time no more than that of the schedule planning the casts through the
    step, and the least budget no more than that one's, and it solves there; the bound
    on any schedule stays under it."""
    rng = random.Random(seed)
    base = random_costs(rng, n, tail=rng.random() < 0.3)
    stages = base.stages
    casts = [rng.randint(0, 12) if rng.random() < 0.7 else 0 for _ in range(stages)] + [0] * base.tail
    costs = _with_casts(base, casts)
    through = Costs.from_dict({k: v for k, v in costs.to_dict().items() if k != "cast_bytes"})
    least, held_least = minimum_budget(costs), minimum_budget(through)
    assert least <= held_least
    assert solve(costs, least).peak <= least
    with pytest.raises(BudgetError) as raised:
        solve(costs, least - 1)
    assert raised.value.minimum <= least
    top = simulate(costs, store_all(costs.length)).peak
    budget = int(least + where * (top - least))
    schedule = solve(costs, budget)
    assert schedule.peak == simulate(costs, schedule.ops).peak <= budget
    assert schedule.budget == budget
    if budget >= held_least:
        assert schedule.time <= solve(through, budget).time + 1e-9
    assert time_bound(costs, budget) <= schedule.time + 1e-9


def test_casts_freed_at_the_loss_buy_lower_budgets_and_faster_plans():
    """On random chains the rule lowers the least budget and, at budgets the C solver's
    own plan fits, finds faster plans (2026-11-29: 276 of 300 chains, 360 of 600 budgets)."""
    lower = faster = 0
    for seed in range(60):
        rng = random.Random(seed)
        base = random_costs(rng, rng.randint(2, 9))
        costs = _with_casts(base, [rng.randint(0, 12) for _ in range(base.stages)] + [0] * base.tail)
        through = Costs.from_dict({k: v for k, v in costs.to_dict().items() if k != "cast_bytes"})
        least = minimum_budget(through)
        lower += minimum_budget(costs) < least
        budget = int(least + 0.3 * (simulate(through, store_all(costs.length)).peak - least))
        faster += solve(costs, budget).time < solve(through, budget).time - 1e-9
    assert lower >= 30 and faster >= 20, (lower, faster)


def test_a_chain_too_long_for_the_raises_solves_once(monkeypatch):
    """Where ``RAISES`` more exact solves would exceed one exact table's work, the casts'
    solve takes the budget's schedule, or the least-memory one below the C solver's
    least, and no raised solves: 1,000 stages with casts took minutes at their least
    budget (a helper's find, 2026-11-29), 6 s now. Such a chain still fits by rule 10
    down to its least budget."""
    import remat.solver.casts as casts
    import remat.solver.solve as solving

    calls = []
    real = solving._solve_optimal
    monkeypatch.setattr(solving, "_solve_optimal", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    rng = random.Random(7)
    base = random_costs(rng, 8)
    costs = _with_casts(base, [rng.randint(1, 12) for _ in range(base.stages)] + [0] * base.tail)
    least = minimum_budget(costs)
    budget = int(least + 0.3 * (simulate(costs, store_all(costs.length)).peak - least))
    for b in (least, budget):
        calls.clear()
        solve(costs, b)
        assert len(calls) > 1, b   # (the raises, where the work allows them)
    monkeypatch.setattr(casts, "EXACT_WORK", 8 ** 3 * 500 * casts.RAISES)
    for b in (least, budget):
        calls.clear()
        assert solve(costs, b).peak <= b
        assert len(calls) == 1, (b, calls)
