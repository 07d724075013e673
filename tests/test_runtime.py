"""The runtime against plain PyTorch: random chains, every algorithm, every budget."""

import copy

import pytest
import torch
from hypothesis import given, strategies as st

import remat
from remat.schedule import simulate
from remat.solve import minimum_budget, solve, store_all
from chains import IMG_KINDS, SEQ_KINDS, Net, assert_same, measured_costs, train

ALGORITHMS = ("optimal", "store_all", "min_memory", "sqrt", "periodic(2)", "periodic(3)")


@st.composite
def chains(draw):
    image = draw(st.booleans())
    kinds = draw(st.lists(st.sampled_from(IMG_KINDS if image else SEQ_KINDS), min_size=1, max_size=12))
    return kinds, image


def budget_for(costs, algorithm, fraction):
    """A budget ``fraction`` of the way from the chain's minimum to its store-all peak,
    raised to what ``algorithm`` needs if it is not the optimal one."""
    low = minimum_budget(costs)
    high = simulate(costs, store_all(costs.length)).peak
    budget = int(low + fraction * (high - low))
    if algorithm != "optimal":
        budget = max(budget, solve(costs, 2**50, algorithm).peak)
    return max(budget, low)


@given(chains(), st.sampled_from(ALGORITHMS), st.floats(0, 1), st.sampled_from(["sgd", "adam"]))
def test_random_chains_match_plain_pytorch(chain, algorithm, fraction, opt):
    """Losses, input and parameter gradients, BatchNorm statistics and parameters after
    three optimizer steps are bitwise those of plain PyTorch (all ops here are
    deterministic on CPU), for every algorithm and budget."""
    kinds, image = chain
    torch.manual_seed(0)
    base = Net(kinds, image=image)
    ref = train(copy.deepcopy(base), opt=opt)
    net = copy.deepcopy(base)
    net.budget = budget_for(measured_costs(base), algorithm, fraction)
    net.algorithm = algorithm
    got = train(net, opt=opt)
    assert_same(ref, got)
    assert remat.explain().schedule.peak <= net.budget
