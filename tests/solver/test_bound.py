"""``time_bound`` near the least budget (remat/solver/bound.py Note [A bound on any
schedule], its second bound): no schedule at all is faster, and where nothing but
the chain's input can be held through a backward op it counts every run again."""

import random

import pytest

from exhaustive import best_schedule
from random_costs import random_costs, random_options
from remat.solver.costs import Costs
from remat.solver.schedule import simulate
from remat.solver.solve import minimum_budget, solve, store_all, time_bound


def _close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


@pytest.mark.parametrize("nograd", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("length, size, saved", [(6, 4, 6), (6, 1, 12), (5, 2, 10), (4, 3, 9)])
def test_the_bound_is_the_optimum_where_only_the_input_outlives_a_backward(length, size, saved, nograd):
    """Like blocks whose a-bar leaves no room at the least budget for any activation
    through ``B(i)``: every schedule runs the stages before i-1 again before each
    ``B(i-1)``, and the bound, counting those runs (without recording, but stage
    i-1's, at their own times: a forward without recording may be the slower, as on
    a GPT on CPU), is the time of the best schedule of all (exhaustive, persistent
    or not), the DP's; a byte more, still below it."""
    costs = Costs.uniform(length, time=1.0, size=size, saved=saved, nograd_time=nograd)
    low = minimum_budget(costs)
    best, _ = best_schedule(costs, low, persistent=False)
    assert _close(time_bound(costs, low), best)
    assert _close(simulate(costs, solve(costs, low)).time, best)
    for budget in (low + 1, low + size):
        assert time_bound(costs, budget) <= best_schedule(costs, budget, persistent=False)[0] * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(60))
def test_no_schedule_beats_the_bound_near_the_least_budget(seed):
    """Random chains of 2 to 5 stages (forward-phase drops, rebuilt backwards needing
    less, tails, a held output, options), at their least budget and a little above:
    the bound is at most the least time of any schedule (exhaustive)."""
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(2, 5), size=rng.choice([6, 40]))
    if rng.random() < 0.4:
        costs = random_options(rng, costs)
    low = minimum_budget(costs)
    high = simulate(costs, store_all(costs.length)).peak
    for budget in sorted({low, low + 1, low + (high - low) // 8}):
        assert time_bound(costs, budget) <= best_schedule(costs, budget, persistent=False)[0] * (1 + 1e-9)


@pytest.mark.parametrize("length, saved, tail_tmp", [(3, 6, 6), (4, 6, 6), (4, 8, 5)])
def test_whole_records_and_the_tails_forward_make_the_bound_the_optimum_at_most_budgets(length, saved, tail_tmp):
    """Like blocks under a tail whose forward's transient leaves no room for the last
    block's record beside it (a head's logits): counting records kept whole, and what
    each first forward leaves, the bound is the best schedule's time (exhaustive,
    persistent or not) at two budgets in three from the least to storing everything,
    never above it. Kept fractionally, and with only what each backward leaves, it
    was below it at every budget but the ends."""
    costs = Costs.uniform(length, time=1.0, size=1, saved=saved).with_tail(1.0, 1.0, 0, 0, tail_tmp, 0)
    low, high = minimum_budget(costs), simulate(costs, store_all(costs.length)).peak
    equal = 0
    for budget in range(low, high + 1):
        best, _ = best_schedule(costs, budget, persistent=False)
        bound = time_bound(costs, budget)
        assert bound <= best * (1 + 1e-9), budget
        equal += _close(bound, best)
    assert 3 * equal >= 2 * (high - low + 1), (equal, high - low + 1)
