"""Parameters, buffers and code paths other than those a stage was measured with,
or than those its module holds by the backward (remat/runtime/replay.py Note [Replaying
a stage] 5): swapped for the forward only (``torch.func.functional_call``,
``parametrize.cached()``), replaced between calls
(``load_state_dict(assign=True)``), frozen or unfrozen mid-training, cast to
another dtype, a flag switching a stage's path or its buffer writes. The
recomputations use what the forward used, and the chain measures again once
what a stage saves has changed; each against plain PyTorch, bit for bit."""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

import remat
from blocks import PosBlock, PosNet, assert_grads_equal, grads_of, pos_pair
from remat.solver.solve import minimum_budget


def test_functional_call_with_other_parameters_gives_their_gradients():
    """The backward recomputes after ``functional_call`` has put the module's own
    parameters back: the recomputation must use the dict's (meta-learning, an EMA
    copy), as the forward did."""
    ref, net = pos_pair()
    for step in range(4):
        x = torch.randn(4, 8, 16)
        out = []
        for model in (ref, net):
            torch.manual_seed(100 + step)
            fast = {name: (p * 1.5 + 0.1).detach().requires_grad_() for name, p in model.named_parameters()}
            torch.manual_seed(200 + step)
            loss = functional_call(model, fast, (x,)).square().mean()
            grads = torch.autograd.grad(loss, list(fast.values()))
            out.append((loss, grads))
        assert remat.explain().schedule.recomputations() > 0
        assert torch.equal(out[0][0], out[1][0])
        assert_grads_equal(out[0][1], out[1][1])
    # the module's own parameters are in place after each backward
    for (name, a), b in zip(ref.named_parameters(), net.parameters()):
        assert isinstance(b, nn.Parameter) and torch.equal(a, b), name


def test_buffers_replaced_between_calls_are_the_ones_put_back():
    """``load_state_dict(assign=True)`` (resuming from a checkpoint) gives BatchNorm new
    buffer tensors: recomputations must put back those, not the ones measured."""
    ref, net = pos_pair(bn=True)
    for step in range(4):
        if step == 2:
            state = copy.deepcopy(ref.state_dict())
            ref.load_state_dict(copy.deepcopy(state), assign=True)
            net.load_state_dict(copy.deepcopy(state), assign=True)
        x = torch.randn(4, 8, 16)
        for model in (ref, net):
            model.zero_grad()
            torch.manual_seed(step)
            model(x).square().mean().backward()
        assert remat.explain().schedule.recomputations() > 0
        assert_grads_equal(grads_of(ref), grads_of(net))
        for (name, a), b in zip(ref.named_buffers(), net.buffers()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_freezing_a_stage_mid_training_measures_again(change):
    """A stage frozen (or unfrozen) since it was measured saves other tensors: the
    chain measures again from it, and the gradients stay plain PyTorch's."""
    ref, net = pos_pair()
    if change == "unfreeze":
        for model in (ref, net):
            model.blocks[2].requires_grad_(False)
    for step in range(5):
        if step == 2:
            for model in (ref, net):
                model.blocks[2].requires_grad_(change == "unfreeze")
        x = torch.randn(4, 8, 16)
        for model in (ref, net):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            model(x).square().mean().backward()
        assert remat.explain().schedule.recomputations() > 0
        assert_grads_equal(grads_of(ref), grads_of(net))


def test_stage_cast_to_another_dtype_measures_again():
    """Behind a first stage taking integer ids the chain's key does not see a model
    cast to another dtype: each stage's parameters' dtypes do, and the costs follow.
    The first stage, which the plan records whole, is checked at the end of the
    call after the cast and measured again on the next (Note [Stages recorded
    whole] in remat/runtime/runner.py); the stages after it, on their input's dtype."""
    torch.manual_seed(0)
    stages = [remat.stage(nn.Embedding(50, 32))] + [
        remat.stage(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))) for _ in range(3)]
    ids = torch.randint(0, 50, (4, 8))

    def call():
        with remat.chain(budget=2**40):
            x = ids
            for s in stages:
                x = s(x)
        x.square().mean().backward()
        return remat.explain().costs

    single = call()
    for s in stages:
        s.double()
    assert call().out_bytes[1:] == tuple(2 * b for b in single.out_bytes[1:])
    double = call()
    assert double.out_bytes == tuple(2 * b for b in single.out_bytes)
    assert all(p.grad.dtype == torch.float64 for s in stages for p in s.parameters())


@pytest.mark.parametrize("around", ["forward", "forward-and-backward"])
def test_parametrization_cache_is_replayed(around):
    """Under ``parametrize.cached()`` a weight-normed weight shared by two stages is
    computed by the first and reused by the second; a recomputation runs with the
    cache as the stage's forward found it, inside ``cached()`` or not (it saved other
    tensors than its forward, a RecomputeMismatchError or a raw engine error before)."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    ref, net = pos_pair()
    for model in (ref, net):
        for b in model.blocks:
            weight_norm(b.l1)
        model.blocks[3].l1 = model.blocks[1].l1
    torch.manual_seed(0)
    probe = copy.deepcopy(net)
    probe.budget = 2**40
    with parametrize.cached():
        probe(torch.randn(4, 8, 16)).sum().backward()
    net.budget = minimum_budget(remat.explain().costs)
    remat.clear_cache()
    for call in range(4):
        grads = []
        for model in (ref, net):
            torch.manual_seed(call)
            x = torch.randn(4, 8, 16)
            with parametrize.cached():
                loss = model(x).square().sum()
                if around == "forward-and-backward":
                    loss.backward()
            if around == "forward":
                loss.backward()
            grads.append(grads_of(model))
            model.zero_grad()
        assert_grads_equal(*grads)
    assert remat.explain().schedule.recomputations() > 0


def _set_flag(flag, *models):
    for model in models:
        for b in model.blocks:
            setattr(b, flag, True)


def _flag_pair(block, flag):
    """A model of five ``block``s and its remat twin, at a budget just above the
    minimum of the chain with ``flag`` set on every block (not set yet)."""
    torch.manual_seed(0)
    ref = PosNet()
    ref.blocks = nn.ModuleList(block(16) for _ in range(5))
    probe = copy.deepcopy(ref)
    probe.budget = 2**40
    _set_flag(flag, probe)
    probe(torch.randn(4, 8, 16)).sum().backward()
    net = copy.deepcopy(ref)
    net.budget = minimum_budget(remat.explain().costs) + 4096
    remat.clear_cache()
    return ref, net


class _Switch(PosBlock):
    """A block whose path depends on a flag its forward reads (as fake quantization
    switched on after calibration): other tensors saved once it is set."""

    quant = False

    @remat.stage
    def forward(self, x, pos=None):
        h = self.l1(self.norm(x))
        if self.quant:
            h = h * torch.sigmoid(h)
        return x + self.l2(F.gelu(h))


def test_stage_taking_another_path_than_measured():
    """A stage that saves other tensors than when measured (a global flag set since)
    runs this call checked against its own forward, and the next call measures the
    chain again (its saved tensors were handed back by position, from the chain's record of
    the other path: a raw engine error or a false RecomputeMismatchError before)."""
    ref, net = _flag_pair(_Switch, "quant")
    first = None
    for call in range(5):
        if call == 2:
            _set_flag("quant", ref, net)
        grads = []
        for model in (ref, net):
            torch.manual_seed(call)
            model(torch.randn(4, 8, 16)).square().sum().backward()
            grads.append(grads_of(model))
            model.zero_grad()
        assert_grads_equal(*grads)
        assert remat.explain().schedule.recomputations() > 0
        if call == 0:
            first = remat.explain().costs
        elif call == 3:
            assert remat.explain().costs.saved_bytes != first.saved_bytes   # measured again


class _Tracking(PosBlock):
    """A block that starts updating a buffer in place once a flag is set (an
    observer switched on after some steps), the update not read by its output."""

    track = False

    def __init__(self, d):
        super().__init__(d)
        self.register_buffer("peak", torch.zeros(()))

    @remat.stage
    def forward(self, x, pos=None):
        if self.track:
            self.peak.copy_(torch.maximum(self.peak, x.detach().abs().amax()))
        return x + self.l2(F.gelu(self.l1(self.norm(x))))


def test_stage_writing_a_buffer_it_did_not_write_when_measured():
    """A stage that writes a buffer in place it did not write when measured: this
    call's recomputations put it back as the forward left it (they updated it again:
    the buffer plain PyTorch's after one forward no longer), with a warning, and the
    next call measures the chain again, the buffer then part of its state."""
    ref, net = _flag_pair(_Tracking, "track")
    for call in range(5):
        if call == 2:
            _set_flag("track", ref, net)
        grads = []
        for model in (ref, net):
            x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(call)) * (call + 1)
            with pytest.warns(RuntimeWarning, match="did not write when measured") if (
                    call == 2 and model is net) else contextlib.nullcontext():
                model(x).square().sum().backward()
            grads.append(grads_of(model))
            model.zero_grad()
        assert_grads_equal(*grads)
        assert remat.explain().schedule.recomputations() > 0
        for a, b in zip(ref.blocks, net.blocks):
            assert torch.equal(a.peak, b.peak), call
    assert float(net.blocks[4].peak) > 0


def test_a_gate_every_stage_takes_as_a_side_input_stays_under_budget():
    """A Parameter every stage takes as an argument (a gate of shape (12, 1)
    broadcast over the activation): each B(i) makes its share of the gate's
    gradient through activation-sized products (the gradient times tanh's output,
    summed to (12, 1)), which the stages' measured backwards left out while the gate
    was used behind them: every call, the first too, 14% over the least budget and
    10% over one 30% of the way up. Exact now, and the gate's gradient plain's."""
    from remat.measure.meter import Instrument

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        @remat.stage
        def forward(self, x, gate):
            return x + torch.tanh(self.fc(x)) * gate * 2.0

    torch.manual_seed(0)
    blocks, gate = [Blk() for _ in range(5)], nn.Parameter(torch.ones(12, 1))
    params = [p for b in blocks for p in b.parameters()] + [gate]
    for p in params:
        p.grad = torch.zeros_like(p)

    def step(budget, seed):
        x = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()
        with Instrument(writes=False) as meter:
            with remat.chain(budget=budget):
                h = x
                for b in blocks:
                    h = b(h, gate)
            h.sum().backward()
            del h
        return meter.peak + x.untyped_storage().nbytes()

    step(2**40, 0)
    step(2**40, 1)
    costs = remat.explain().costs
    low, high = minimum_budget(costs), remat.explain().schedule.peak
    for budget in (low, low + (high - low) * 3 // 10, high):
        remat.clear_cache()
        for call in range(3):
            assert step(budget, call) <= budget, (budget, call)
    grads = []
    for budget in (low, None):   # (None: no chain, plain PyTorch)
        for p in params:
            p.grad.zero_()
        h = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(9))
        with remat.chain(budget=budget) if budget else contextlib.nullcontext():
            for b in blocks:
                h = b(h, gate)
        h.sum().backward()
        grads.append([p.grad.clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_one_module_as_every_stage_under_autocast():
    """ALBERT-style sharing under bfloat16 autocast: the stages reach the shared
    weights through autocast's cached casts, whose nodes stage 1 made, so a stage's
    measured backward makes no share of them (their sum waits at the cast's node,
    behind it). Counting them as started there put the first call out with an
    internal CostsError; every call now runs, under the budget."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)

    @remat.stage
    def block(x):
        return x + layer(x)

    def step(budget, seed):
        x = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(seed))
        with remat.measure_peak():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with remat.chain(budget=budget):
                    h = x
                    for _ in range(5):
                        h = block(h)
            h.float().square().mean().backward()
        return remat.explain().measured_peak

    remat.clear_cache()
    step(2**30, 0)
    low, high = remat.explain().least_budget, remat.explain().schedule.peak
    for budget in (low, (low + high) // 2):
        remat.clear_cache()
        assert all(step(budget, seed) <= budget for seed in range(3)), budget
