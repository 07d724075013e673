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


@pytest.mark.parametrize("length, size, saved", [(6, 4, 6), (6, 1, 12), (5, 2, 10), (4, 3, 9)])
def test_the_bound_is_the_optimum_where_only_the_input_outlives_a_backward(length, size, saved):
    """Like blocks whose a-bar leaves no room at the least budget for any activation
    through ``B(i)``: every schedule runs the stages before i-1 again before each
    ``B(i-1)``, and the bound, counting those runs, is the time of the best schedule
    of all (exhaustive, persistent or not), the DP's; a byte more, still below it."""
    costs = Costs.uniform(length, time=1.0, size=size, saved=saved)
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
