"""Hooks and checkpointing on the modules a chain runs: full backward hooks and
pre-hooks on the stage modules or on every submodule, forward hooks and
pre-hooks, ``torch.utils.checkpoint`` inside a stage. Each against plain
PyTorch, bit for bit (the same ops in the same order on CPU), or a clear error
naming the fix."""

import copy

import pytest
import torch
import torch.nn as nn

import remat
from blocks import assert_blocks_same, block_budgets, block_net, train_blocks
from chains import run_blocks


@pytest.mark.parametrize("pre", [False, True])
def test_module_backward_hooks(pre):
    """A module with full backward hooks gets its input and output through identity
    views (``BackwardHookFunction``): the chain takes them as the activation handed
    on, and the hooks see plain PyTorch's gradients, once per step."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    ref = block_net("plain")
    net = copy.deepcopy(ref)
    net.budget = block_budgets(net, x)[0]
    seen = {id(ref): [], id(net): []}
    for model in (ref, net):
        for b in model.blocks:
            record = (lambda mod, go, m=model: seen[id(m)].append(go[0].clone())) if pre else \
                (lambda mod, gi, go, m=model: seen[id(m)].append(go[0].clone()))
            (b.register_full_backward_pre_hook if pre else b.register_full_backward_hook)(record)
    train_blocks(ref, x)
    train_blocks(net, x)
    assert remat.explain().schedule.recomputations() > 0
    assert_blocks_same(ref, net)
    assert len(seen[id(net)]) == 15
    assert all(torch.equal(a, b) for a, b in zip(seen[id(ref)], seen[id(net)]))


def test_module_forward_hooks_run_once_per_call():
    """Forward hooks and pre-hooks run around the module's call, once per forward:
    a recomputation runs the stage's forward alone."""
    x = torch.randn(4, 8, 16)
    ref = block_net("plain")
    net = copy.deepcopy(ref)
    net.budget = block_budgets(net, x)[0]
    calls = {id(ref): 0, id(net): 0}

    def count(model):
        def hook(*_):
            calls[id(model)] += 1
        return hook

    for model in (ref, net):
        for b in model.blocks:
            b.register_forward_hook(count(model))
            b.register_forward_pre_hook(count(model))
    train_blocks(ref, x)
    train_blocks(net, x)
    assert_blocks_same(ref, net)
    assert calls[id(net)] == calls[id(ref)] == 30


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
        for s in ref:   # (before the chain: the code after its block is its tail, in its budget)
            g = s(g)
        g.sum().backward()
        with remat.chain(budget=budget):
            for s in net:
                h = s(h)
        h.sum().backward()
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
        h = run_blocks(mods, x, budget)
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
