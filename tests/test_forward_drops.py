"""What the forward phase lets go (remat/recording.py Note [What the forward phase
drops]): a^i of a stage whose successor's recording keeps no part of it, unless
the code around the chain holds it."""

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn

import remat
from chains import Net, assert_same, measured_costs, train
from test_runtime import _physical_peak, budget_for

KINDS = ["linear", "dropout", "scale", "dropout", "relu", "scale", "linear"]


class Keeping(Net):
    """A loop that keeps every activation (``how``: the tensor itself, as a list of
    hidden states does, or an alias of it, which no weak reference to it sees)."""

    def __init__(self, kinds, how):
        super().__init__(kinds)
        self.how = how
        self.kept = []

    def forward(self, x, mask):
        self.kept = []
        if self.budget is None:
            return self._loop(x, mask)
        with remat.chain(budget=self.budget, algorithm=self.algorithm):
            return self._loop(x, mask)

    def _loop(self, x, mask):
        for s in self.stages:
            x = s(x, mask)
            self.kept.append(x if self.how == "tensor" else x.detach())
        return x


def _quiet_and_under_budget(net):
    """Two more steps warn of nothing, and a step's real peak is under the budget."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(net, steps=2, hold=False)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    assert _physical_peak(net, hold=False) <= net.budget


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_stages_keeping_nothing_of_their_input(fraction):
    """Dropout and scale stages keep nothing of their input: the plan counts it gone
    once the next stage has run, and the real peak stays under the budget and
    within 10% of the prediction; results are plain PyTorch's."""
    torch.manual_seed(0)
    base = Net(KINDS)
    costs = measured_costs(base)
    # a^1 (linear's output) goes: dropout keeps only its mask, and linear's backward
    # does not read its output
    assert costs.fwd_drop[0] == costs.fwd_drop_whole[0] == costs.out_bytes[0]
    # a^5 (relu's output) goes on its own (scale keeps nothing), but relu's backward
    # reads it: not inside a-bar^5; a^6 stays (linear saves its input)
    assert costs.fwd_drop[4] == costs.out_bytes[4] and costs.fwd_drop_whole[4] == 0
    assert costs.fwd_drop[5] == 0 and costs.fwd_drop[-1] == 0
    net = copy.deepcopy(base)
    net.budget = budget_for(costs, "optimal", fraction)
    assert_same(train(copy.deepcopy(base), hold=False), train(net, hold=False))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    peak = _physical_peak(net, hold=False)
    predicted = remat.explain().schedule.peak
    assert 0.9 * predicted <= peak <= net.budget


def test_loop_keeping_its_activations_is_seen_while_measuring():
    """A loop that keeps every activation (a list of hidden states): the measuring
    call sees them alive as the chain ends, says so, and counts them as held
    through the step; nothing is counted as let go, and the budget holds."""
    torch.manual_seed(0)
    net = Keeping(KINDS, "tensor")
    with pytest.warns(RuntimeWarning, match=r"keeps the outputs of stages 1-6 \(4.50 KiB\)"):
        costs = measured_costs(net)
    assert not any(costs.fwd_drop)
    assert costs.held_bytes >= sum(costs.out_bytes[:-1])
    net.budget = budget_for(costs, "optimal", 0.3)
    with pytest.warns(RuntimeWarning, match="keeps the outputs"):   # net's own measuring call
        train(net, steps=1, hold=False)
    _quiet_and_under_budget(net)


def test_loop_keeping_aliases_is_caught_by_the_first_run():
    """A loop that keeps aliases of its activations (``detach()``): measuring cannot
    see them, the first call that runs the plan finds storages alive as the chain
    ends that its schedule let go, warns, and from then on counts them as held:
    later calls plan with them and stay under the budget, silently."""
    torch.manual_seed(0)
    net = Keeping(KINDS, "alias")
    costs = measured_costs(net)
    measured = remat.explain().measured   # (costs: as planned, with a^L held)
    assert any(costs.fwd_drop)
    net.budget = budget_for(costs, "optimal", 1.0)   # store-all: every stage records
    with pytest.warns(RuntimeWarning) as seen:
        train(net, steps=2, hold=False)
    said = " ".join(str(w.message) for w in seen)
    assert "kept the outputs of stages 1-4 after the next stage had run" in said
    assert "kept the outputs of stages 5-6 through its backward" in said
    entry = next(e for e in importlib.import_module("remat.chain")._cache.values() if e.idents[0]() is net.stages[0])
    now = entry.costs
    assert not any(now.fwd_drop) and now.held_bytes == measured.held_bytes + sum(costs.out_bytes[:-1])
    net.budget = budget_for(entry.planning_costs(), "optimal", 0.3)
    _quiet_and_under_budget(net)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_stages_returning_their_input(fraction):
    """Identity stages hand on their input as it is, so an activation can share the
    storage of a checkpoint remat holds: no stage output is taken for one the loop
    kept, results are plain PyTorch's and the peak stays under the budget."""
    from chains import Stage
    torch.manual_seed(0)
    base = Net(["linear", "scale", "linear", "scale", "scale", "relu"])
    for i in (1, 3, 4):
        base.stages[i] = Stage("identity", torch.nn.Identity())
    net = copy.deepcopy(base)
    net.budget = budget_for(measured_costs(base), "optimal", fraction)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(train(copy.deepcopy(base), hold=False), train(net, hold=False))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    assert _physical_peak(net, hold=False) <= net.budget


@pytest.mark.parametrize("how", ["slice", "transpose"])
def test_first_stage_returning_a_view_of_the_input_is_not_a_caller_keep(how):
    """A first stage returning a view of the chain's input shares its storage, which
    the loop holds and the costs count already: not an activation the code around
    the chain kept (a false warning, and then a held count that refused the budget)."""

    @remat.stage
    def first(x):
        return x[:, :16] if how == "slice" else x.t().t()

    torch.manual_seed(0)
    layers = [remat.stage(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(8, 32 if how == "slice" else 16, requires_grad=True)
            with remat.chain(budget=12000):
                h = first(x)
                for layer in layers:
                    h = layer(h)
            h.sum().backward()
    assert not [w for w in caught if "kept" in str(w.message)]
    assert remat.explain().schedule.recomputations() > 0
