"""A measuring call remat fails (a stage it refuses) leaves no trace: what its stages
wrote goes back (remat/measure/measuring.py ``Measurer.undo``); one a stage's own error
fails leaves what plain PyTorch's leaves."""

import copy

import pytest
import torch
import torch.nn as nn

import remat


class _Counted(nn.Module):
    """A BatchNorm and a step counter: state the first call writes."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(16)
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.n += 1
        return self.bn(x)


@pytest.mark.parametrize("how", ["list", "inplace", "raise"])
def test_a_first_call_a_stage_fails_leaves_no_trace(how):
    """A stage remat refuses (a list returned, its input written in place after its own
    BatchNorm ran) in the measuring call: the BatchNorm statistics and counters of the
    stages before it, and of the stage itself, stay as before the call (they kept that
    call's update, where a BudgetError put them back). A stage raising its own error
    leaves them as plain PyTorch does, with the same fault."""

    class Bad(_Counted):
        def forward(self, x):
            y = super().forward(x)
            if how == "inplace":
                x.mul_(2)
            elif how == "raise":
                raise ValueError("the stage's own error")
            return [y] if how == "list" else y

    torch.manual_seed(0)
    stages = nn.ModuleList([_Counted(), Bad(), nn.Linear(16, 16)])
    plain = copy.deepcopy(stages)
    for stage in stages:
        remat.stage(stage)
    before = {k: v.clone() for k, v in stages.state_dict().items()}
    x = torch.randn(2, 16, 16)
    remat.clear_cache()
    with pytest.raises((remat.StageError, ValueError)):
        with remat.chain(budget=2**20):
            h = x.clone()
            for stage in stages:
                h = stage(h)
    if how == "raise":
        with pytest.raises(ValueError):
            h = x.clone()
            for stage in plain:
                h = stage(h)
        before = plain.state_dict()
    assert all(torch.equal(before[k], v) for k, v in stages.state_dict().items())
