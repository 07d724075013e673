"""What users put on the modules a chain runs: parametrizations whose forward
updates and reads buffers (spectral norm), stages whose output depends on state
they update in place, module forward and backward hooks. Each against plain
PyTorch, bit for bit (the same ops in the same order on CPU)."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrizations as P

import remat
from remat.solve import minimum_budget

chain_module = importlib.import_module("remat.chain")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.l1 = nn.Linear(d, 2 * d)
        self.l2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)

    @remat.stage
    def forward(self, x):
        return x + self.l2(self.drop(F.gelu(self.l1(self.ln(x)))))


class Counting(nn.Module):
    """A stage whose output depends on a buffer it updates in place."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros(()))

    @remat.stage
    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x)) * self.calls


class Net(nn.Module):
    def __init__(self, blocks, d=16):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, 3)
        self.budget = None

    def forward(self, x):
        if self.budget is None:
            for b in self.blocks:
                x = b(x)
        else:
            with remat.chain(budget=self.budget):
                for b in self.blocks:
                    x = b(x)
        return self.head(x)


def _net(kind, n=5, d=16):
    torch.manual_seed(0)
    if kind == "counting":
        return Net([Counting(d) if i % 2 else Block(d) for i in range(n)], d)
    net = Net([Block(d) for _ in range(n)], d)
    for b in net.blocks:
        if kind == "spectral":
            P.spectral_norm(b.l1)
        elif kind == "spectral_hook":
            torch.nn.utils.spectral_norm(b.l1)
        elif kind == "weight_norm":
            P.weight_norm(b.l1)
    return net


def _train(net, x, steps=3, seed=1):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(seed + step)
        net(x).square().mean().backward()
        opt.step()


def _budgets(net, x):
    """The chain's minimum and the middle of minimum..store-all, from a measuring call
    on a copy (the model itself stays untouched)."""
    probe = copy.deepcopy(net)
    probe.budget = 2**40
    _train(probe, x, steps=1)
    costs = remat.explain().costs
    low, high = minimum_budget(costs), remat.explain().schedule.peak
    remat.clear_cache()
    return low, (low + high) // 2


def _assert_same(ref, net):
    for (name, a), b in zip(ref.named_parameters(), net.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(ref.named_buffers(), net.buffers()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["spectral", "spectral_hook", "weight_norm", "counting"])
@pytest.mark.parametrize("where", [0, 1])
def test_stage_reading_state_it_updates_matches_plain(kind, where):
    """Spectral norm's power iteration updates its vectors in place and then reads
    them: a recomputation starting from the updated values computes another weight.
    remat starts it from the values the first forward found (remat/replay.py Note
    [Replaying a stage] 3); parameters, gradients and buffers stay plain PyTorch's."""
    x = torch.randn(4, 8, 16)
    ref = _net(kind)
    net = copy.deepcopy(ref)
    net.budget = _budgets(net, x)[where]
    _train(ref, x)
    _train(net, x)
    assert remat.explain().schedule.recomputations() > 0
    _assert_same(ref, net)
    entry = next(iter(chain_module._cache.values()))
    reads = [kind != "weight_norm" and (kind != "counting" or i % 2 == 1) for i in range(5)]
    assert entry.reads_state == reads


@pytest.mark.parametrize("shared", [False, True])
def test_weight_set_by_a_pre_hook_of_the_stage_module(shared):
    """The old torch.nn.utils.spectral_norm sets ``weight`` as a plain attribute in a
    forward pre-hook, which for a stage module runs before the stage, on every call.
    A discriminator step runs two forwards (real, fake) before one backward, and a
    module may be several stages of one chain: each recomputation runs with the
    weight its own forward used (the slots hold tensor attributes: remat/replay.py
    Note [Replaying a stage] 5), and gradients are plain PyTorch's."""
    torch.manual_seed(0)
    layers = [nn.utils.spectral_norm(nn.Linear(16, 16)) for _ in range(4)]
    if shared:
        layers = [layers[0]] * 4
    base = Net([remat.stage(m) for m in layers], d=16)

    def steps(net):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            real, fake = torch.randn(128, 16, generator=g), torch.randn(128, 16, generator=g)
            opt.zero_grad()
            (torch.relu(1 - net(real)).mean() + torch.relu(1 + net(fake)).mean()).backward()
            opt.step()

    ref, net = copy.deepcopy(base), copy.deepcopy(base)
    net.budget = _budgets(net, torch.randn(128, 16))[0]
    steps(ref)
    steps(net)
    assert remat.explain().schedule.recomputations() > 0
    _assert_same(ref, net)


def test_batchnorm_statistics_need_no_copy():
    """BatchNorm's running statistics are read only by the op that updates them: no
    stage of a BatchNorm chain keeps a copy of its state through the step."""
    remat.clear_cache()
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
                          for _ in range(3)])
    for m in net:
        remat.stage(m)
    with remat.chain(budget=2**40):
        y = net(torch.randn(2, 4, 6, 6))
    y.sum().backward()
    entry = next(iter(chain_module._cache.values()))
    assert entry.reads_state == [False, False, False]
    assert entry.held_bytes() == 0


@pytest.mark.parametrize("pre", [False, True])
def test_module_backward_hooks(pre):
    """A module with full backward hooks gets its input and output through identity
    views (``BackwardHookFunction``): the chain takes them as the activation handed
    on, and the hooks see plain PyTorch's gradients, once per step."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    ref = _net("plain")
    net = copy.deepcopy(ref)
    net.budget = _budgets(net, x)[0]
    seen = {id(ref): [], id(net): []}
    for model in (ref, net):
        for b in model.blocks:
            record = (lambda mod, go, m=model: seen[id(m)].append(go[0].clone())) if pre else \
                (lambda mod, gi, go, m=model: seen[id(m)].append(go[0].clone()))
            (b.register_full_backward_pre_hook if pre else b.register_full_backward_hook)(record)
    _train(ref, x)
    _train(net, x)
    assert remat.explain().schedule.recomputations() > 0
    _assert_same(ref, net)
    assert len(seen[id(net)]) == 15
    assert all(torch.equal(a, b) for a, b in zip(seen[id(ref)], seen[id(net)]))


def test_module_forward_hooks_run_once_per_call():
    """Forward hooks and pre-hooks run around the module's call, once per forward:
    a recomputation runs the stage's forward alone."""
    x = torch.randn(4, 8, 16)
    ref = _net("plain")
    net = copy.deepcopy(ref)
    net.budget = _budgets(net, x)[0]
    calls = {id(ref): 0, id(net): 0}

    def count(model):
        def hook(*_):
            calls[id(model)] += 1
        return hook

    for model in (ref, net):
        for b in model.blocks:
            b.register_forward_hook(count(model))
            b.register_forward_pre_hook(count(model))
    _train(ref, x)
    _train(net, x)
    _assert_same(ref, net)
    assert calls[id(net)] == calls[id(ref)] == 30


class _KeepOnCtx(torch.autograd.Function):
    """Keeps a tensor as an attribute of ctx, where saved-tensor hooks never see it."""

    @staticmethod
    def forward(ctx, x):
        ctx.keep = x * 2.0
        return x * x

    @staticmethod
    def backward(ctx, g):
        return ctx.keep * g


class CtxBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    @remat.stage
    def forward(self, x):
        return _KeepOnCtx.apply(torch.tanh(self.lin(x)))


def test_tensors_held_outside_autograd_are_counted():
    """A custom Function keeping a tensor on ctx holds it until its backward in every
    mode of the schedule: measuring says so once, counts it as held, and a training
    step's real peak stays under the budget (it went to twice the budget uncounted)."""
    from remat.meter import Instrument
    torch.manual_seed(0)
    ref = Net([CtxBlock(16) for _ in range(6)])
    net = copy.deepcopy(ref)
    x = torch.randn(32, 16, requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"stage 1 \(CtxBlock\) still holds 2.00 KiB .* ctx"):
        net.budget = _budgets(net, x)[0]
    _train(ref, x)
    _train(net, x)
    _assert_same(ref, net)
    assert remat.explain().schedule.recomputations() > 0
    with Instrument() as inst:   # the parameters' and input's gradients exist: added in place
        net(x).sum().backward()
    assert inst.peak <= net.budget
    assert remat.explain().measured.held_bytes == 6 * 2048 and remat.explain().measured.input_bytes == x.untyped_storage().nbytes()


def test_autocast_weight_casts_are_held_silently(recwarn):
    """Under autocast the cast weights stay in autocast's cache after a stage's
    forward, to the end of the autocast region: those autograd saved (the linear
    layers' weights, not their biases) count as held through the step, as a
    cache's, without a warning (Note [Saved tensors held elsewhere])."""
    remat.clear_cache()
    x = torch.randn(4, 8, 16)
    net = _net("plain")
    net.budget = 2**40
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _train(net, x, steps=2)
    assert not [w for w in recwarn if "still holds" in str(w.message) or "keeps too" in str(w.message)]
    entry = next(iter(chain_module._cache.values()))
    casts = sum(2 * m.weight.numel() for b in net.blocks for m in (b.l1, b.l2))
    assert entry.held_bytes() == casts


class ViewEma(nn.Module):
    """A stage that updates a buffer through a view it makes (the view dies with the call)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("ema", torch.zeros(d))

    @remat.stage
    def forward(self, x):
        with torch.no_grad():
            self.ema.view(-1).mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
        return torch.tanh(self.lin(x))


class Renormed(nn.Module):
    """An embedding whose ``max_norm`` renormalises ``weight.detach()`` in place."""

    def __init__(self, d):
        super().__init__()
        self.emb = nn.Embedding(32, d, max_norm=1.0)
        self.lin = nn.Linear(d, d)

    @remat.stage
    def forward(self, x):
        return x + self.lin(self.emb(torch.arange(x.shape[1]) % 32))


class Instance(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.InstanceNorm1d(d, track_running_stats=True)
        self.lin = nn.Linear(d, d)

    @remat.stage
    def forward(self, x):
        return torch.tanh(self.lin(self.norm(x.transpose(1, 2)).transpose(1, 2)))


@pytest.mark.parametrize("kind", [ViewEma, Renormed, Instance])
def test_state_written_through_an_alias_is_put_back(kind):
    """In-place state a stage writes through a tensor it makes (a view of a buffer,
    ``weight.detach()``, instance norm's reshaped statistics) is put back after each
    recomputation: found through the module's buffer or parameter that shares its
    storage (the alias itself is gone by the backward; a recomputation crashed, or
    left the state written twice)."""
    torch.manual_seed(0)
    ref = Net([kind(16) if i % 2 == 0 else Block(16) for i in range(5)])
    net = copy.deepcopy(ref)
    x = torch.randn(4, 8, 16)
    net.budget = _budgets(net, x)[0]
    _train(ref, x)
    _train(net, x)
    assert remat.explain().schedule.recomputations() > 0
    _assert_same(ref, net)


def test_backward_hooks_on_every_module():
    """``model.apply`` a full backward hook (per-module gradient norms): a stage then
    returns a hooked submodule's output, itself made by ``BackwardHookFunction``,
    which the stage's own hook wraps again; the chain follows the views to it (it
    raised 'code between the two stages changed the activation')."""
    torch.manual_seed(0)
    ref = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)) for _ in range(4))
    net = copy.deepcopy(ref)
    seen = {id(ref): [], id(net): []}
    for model in (ref, net):
        model.apply(lambda m, k=id(model): m.register_full_backward_hook(
            lambda mod, gi, go: seen[k].append(go[0].clone())))
    for s in net:
        remat.stage(s)
    x = torch.randn(8, 16)
    for budget in (2**40, 16000, 16000):
        h = g = x
        with remat.chain(budget=budget):
            for s in net:
                h = s(h)
        for s in ref:
            g = s(g)
        h.sum().backward()
        g.sum().backward()
        if budget == 2**40:   # (inner modules' hooks also ran in the measuring call's stage backwards)
            seen[id(ref)].clear()
            seen[id(net)].clear()
    assert remat.explain().schedule.recomputations() > 0
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert len(seen[id(net)]) == len(seen[id(ref)]) == 32
    assert all(torch.equal(a, b) for a, b in zip(seen[id(ref)], seen[id(net)]))


class _Checkpointed(nn.Module):
    """A block that checkpoints part of itself (as library blocks may)."""

    reentrant = True

    def __init__(self, d):
        super().__init__()
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)

    def _inner(self, h):
        return torch.tanh(self.l1(h))

    @remat.stage
    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return x + self.l2(checkpoint(self._inner, x, use_reentrant=self.reentrant))


def test_reentrant_checkpoint_inside_a_stage_is_named():
    """``checkpoint(use_reentrant=True)`` inside a stage rejects the backward remat's
    first call runs on each stage alone (PyTorch's 'incompatible with .grad()', with
    a note blaming hooks, before): a StageError naming the stage and the fixes; the
    next call, the checkpoint made non-reentrant, is plain PyTorch's."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Checkpointed(8) for _ in range(3))
    plain = copy.deepcopy(blocks)
    x = torch.randn(4, 8, requires_grad=True)

    def run(mods, budget):
        h = x
        if budget is None:
            for b in mods:
                h = b(h)
        else:
            with remat.chain(budget=budget):
                for b in mods:
                    h = b(h)
        h.square().sum().backward()
        return [p.grad.clone() for p in mods.parameters()]

    remat.clear_cache()
    with pytest.raises(remat.StageError, match=r"stage 1 \(_Checkpointed\) runs torch.utils.checkpoint with "
                                               r"use_reentrant=True.*use_reentrant=False.*costs="):
        run(blocks, 2**30)
    for b in blocks:
        b.reentrant = False
    blocks.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(run(blocks, 2**30), run(plain, None)))
