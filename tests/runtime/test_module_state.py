"""State on the modules a chain runs: parametrizations whose forward updates and
reads buffers (spectral norm, also the old one whose forward pre-hook sets the
weight), stages whose output depends on state they update in place, state
written through an alias of a buffer or parameter, BatchNorm's statistics,
tensors held outside autograd (on a custom Function's ctx, in autocast's
cache). Each against plain PyTorch, bit for bit (the same ops in the same order
on CPU)."""

import contextlib
import copy
import importlib

import pytest
import torch
import torch.nn as nn

import remat
from blocks import BlockNet, LnBlock, assert_blocks_same, block_budgets, block_net, train_blocks

chain_module = importlib.import_module("remat.runtime.chain_call")


@pytest.mark.parametrize("kind", ["spectral", "spectral_hook", "weight_norm", "counting"])
@pytest.mark.parametrize("where", [0, 1])
def test_stage_reading_state_it_updates_matches_plain(kind, where):
    """Spectral norm's power iteration updates its vectors in place and then reads
    them: a recomputation starting from the updated values computes another weight.
    remat starts it from the values the first forward found (remat/runtime/replay.py Note
    [Replaying a stage] 3); parameters, gradients and buffers stay plain PyTorch's."""
    x = torch.randn(4, 8, 16)
    ref = block_net(kind)
    net = copy.deepcopy(ref)
    net.budget = block_budgets(net, x)[where]
    train_blocks(ref, x)
    train_blocks(net, x)
    assert remat.explain().schedule.recomputations() > 0
    assert_blocks_same(ref, net)
    entry = next(iter(chain_module._cache.values()))
    reads = [kind != "weight_norm" and (kind != "counting" or i % 2 == 1) for i in range(5)]
    assert [s.reads_state for s in entry.stages] == reads


@pytest.mark.parametrize("shared", [False, True])
def test_weight_set_by_a_pre_hook_of_the_stage_module(shared):
    """The old torch.nn.utils.spectral_norm sets ``weight`` as a plain attribute in a
    forward pre-hook, which for a stage module runs before the stage, on every call.
    A discriminator step runs two forwards (real, fake) before one backward, and a
    module may be several stages of one chain: each recomputation runs with the
    weight its own forward used (the slots hold tensor attributes: remat/runtime/replay.py
    Note [Replaying a stage] 5), and gradients are plain PyTorch's."""
    torch.manual_seed(0)
    layers = [nn.utils.spectral_norm(nn.Linear(16, 16)) for _ in range(4)]
    if shared:
        layers = [layers[0]] * 4
    base = BlockNet([remat.stage(m) for m in layers], d=16)

    def steps(net):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            real, fake = torch.randn(128, 16, generator=g), torch.randn(128, 16, generator=g)
            opt.zero_grad()
            (torch.relu(1 - net(real)).mean() + torch.relu(1 + net(fake)).mean()).backward()
            opt.step()

    ref, net = copy.deepcopy(base), copy.deepcopy(base)
    net.budget = block_budgets(net, torch.randn(128, 16))[0]
    steps(ref)
    steps(net)
    assert remat.explain().schedule.recomputations() > 0
    assert_blocks_same(ref, net)


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
    assert [s.reads_state for s in entry.stages] == [False, False, False]
    assert entry.held_bytes() == 0


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
    from remat.measure.meter import Instrument
    torch.manual_seed(0)
    ref = BlockNet([CtxBlock(16) for _ in range(6)])
    net = copy.deepcopy(ref)
    x = torch.randn(32, 16, requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"stage 1 \(CtxBlock\) still holds 2.00 KiB .* ctx"):
        net.budget = block_budgets(net, x)[0]
    train_blocks(ref, x)
    train_blocks(net, x)
    assert_blocks_same(ref, net)
    assert remat.explain().schedule.recomputations() > 0
    with Instrument() as inst:   # the parameters' and input's gradients exist: added in place
        net(x).sum().backward()
    assert inst.peak <= net.budget
    assert remat.explain().measured.held_bytes == 6 * 2048 and remat.explain().measured.input_bytes == x.untyped_storage().nbytes()


def test_autocast_weight_casts_are_held_silently(recwarn):
    """Under autocast the cast weights stay in autocast's cache after a stage's
    forward, to the end of the autocast region: all of them (the linear layers'
    weights, which autograd saves, and their biases, which it does not) count as
    held through the step, as a cache's, without a warning (Note [Saved tensors
    held elsewhere]; remat/solver/casts.py plans them where they live)."""
    remat.clear_cache()
    x = torch.randn(4, 8, 16)
    net = block_net("plain")
    net.budget = 2**40
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train_blocks(net, x, steps=2)
    assert not [w for w in recwarn if "still holds" in str(w.message) or "keeps too" in str(w.message)]
    entry = next(iter(chain_module._cache.values()))
    casts = sum(2 * (m.weight.numel() + m.bias.numel()) for b in net.blocks for m in (b.l1, b.l2))
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
    ref = BlockNet([kind(16) if i % 2 == 0 else LnBlock(16) for i in range(5)])
    net = copy.deepcopy(ref)
    x = torch.randn(4, 8, 16)
    net.budget = block_budgets(net, x)[0]
    train_blocks(ref, x)
    train_blocks(net, x)
    assert remat.explain().schedule.recomputations() > 0
    assert_blocks_same(ref, net)


def test_a_stage_writing_its_side_input_in_place():
    """A stage that reads a side input and then writes it in place (a mask flipped for the
    next use): plain PyTorch's backward uses what the forward computed from it before.
    Measured, the write was found on that call's mask, and later calls, each with a
    mask of its own, found none: their recomputations read the flipped mask, the
    gradients off from the second call on. Now it is found among each call's tensor
    arguments (``state_plan``), and a recomputation starts from its values before."""
    torch.manual_seed(0)
    lins = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    @remat.stage
    def masked(x, mask):
        y = torch.tanh(lins[1](x)) * (~mask).float()
        mask.logical_not_()
        return y

    stages = [remat.stage(lambda x, i=i: torch.tanh(lins[i](x))) for i in (0, 2, 3)]
    x = torch.randn(8, 16)

    def step(budget):
        mask = torch.zeros(8, 16, dtype=torch.bool)
        mask[:, :4] = True
        lins.zero_grad(set_to_none=True)
        with remat.chain(budget=budget) if budget is not None else contextlib.nullcontext():
            h = stages[2](stages[1](masked(stages[0](x), mask)))
        h.square().sum().backward()
        return [p.grad.clone() for p in lins.parameters()] + [mask]

    want = step(None)
    step(remat.chain.NO_LIMIT)
    least = remat.explain().least_budget
    remat.clear_cache()
    try:
        for call in range(3):
            got = step(least)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), call
        assert "Fall2" in str(remat.explain().schedule).split("|")[1]   # (stage 2 run again)
    finally:
        remat.clear_cache()


class _Checkpointed(nn.Module):
    """A conv and a BatchNorm under torch.utils.checkpoint inside the stage: plain PyTorch's
    backward runs them again, and updates the statistics a second time."""

    def __init__(self, k):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, k, padding=k // 2, bias=False), nn.BatchNorm2d(4)

    def inner(self, x):
        return torch.relu(self.bn(self.conv(x)))

    @remat.stage
    def forward(self, x):
        return x + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("budget", [2**30, None])
def test_a_checkpoint_inside_a_stage_updates_batchnorm_as_plain_pytorch(budget):
    """The measuring call's own run of a stage's backward (run 2) ran the checkpoint's
    BatchNorm again, one update of its statistics too many, kept for good (the undo of
    run 2's writes left out the state the forward had written): every stage the first
    call measured drifted from plain PyTorch (a helper's find). The state run 2 writes
    again goes back as the forward left it (the meter's ``again``; a first version put
    back every written tensor, copies and version bumps that put 14 tests off).
    Statistics, gradients and parameters bitwise plain PyTorch's over three steps."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Checkpointed(k) for k in (1, 3, 5))
    x = torch.randn(2, 4, 8, 8)

    def steps(net, budget):
        out = []
        for step in range(3):
            with remat.chain(budget=budget) if budget else contextlib.nullcontext():
                h = x
                for b in net:
                    h = b(h)
            h.square().mean().backward()
            out += [t.clone() for t in [*net.buffers(), *(p.grad for p in net.parameters())]]
        return out

    remat.clear_cache()
    try:
        want = steps(copy.deepcopy(blocks), None)
        if budget is None:
            steps(copy.deepcopy(blocks), 2**30)
            budget = remat.explain().least_budget
            remat.clear_cache()
        got = steps(blocks, budget)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    finally:
        remat.clear_cache()
