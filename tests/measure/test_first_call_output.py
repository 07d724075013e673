"""The measuring call and the chain's output the code around the chain keeps
(Note [The chain's output], remat/measure/chain_record.py): a first call cannot
know whether the loop keeps it through the backward."""

import pytest
import torch
import torch.nn as nn

import remat


def test_a_first_call_under_the_least_with_its_output_kept_warns():
    """A first call at the least budget a first call's ``BudgetError`` named, whose loop
    keeps the chain's output through the backward (``y = net(x); loss(y).backward()``):
    it ran over the budget by the output it could not know of, and said nothing
    before the next call raised. It warns now, naming the least with the output."""
    torch.manual_seed(0)
    blocks = [remat.stage(nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Dropout(0.3), nn.Linear(64, 32)))
              for _ in range(5)]
    head, x = nn.Linear(32, 4), torch.randn(16, 32, requires_grad=True)

    def step(budget):
        with remat.chain(budget=budget):
            h = x
            for b in blocks:
                h = b(h)
        head(h).square().mean().backward()   # (h kept through the backward)

    remat.clear_cache()
    with pytest.raises(remat.BudgetError) as caught:
        step(20000)
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="kept the chain's output through the first call's backward"):
        step(caught.value.minimum)
    with pytest.raises(remat.BudgetError, match="minimum of"):
        step(caught.value.minimum)
