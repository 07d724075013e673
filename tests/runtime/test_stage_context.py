"""What a chain's stages run under, against plain PyTorch bit for bit:
torch.func transforms and forward-mode AD around a chain (it runs its stages
plainly), autocast around some stage calls only, a stage's own generator (each
recomputation replays the stage's own autocast state and generator)."""

import contextlib
import copy
import importlib

import pytest
import torch
import torch.nn as nn

import remat
from remat.solver.solve import minimum_budget

chain_module = importlib.import_module("remat.runtime.chain_call")


def test_chain_inside_torch_func_transforms_runs_plainly():
    """Under ``torch.func.vmap`` or ``torch.func.grad`` the chain sees the transforms'
    wrapped tensors, which its hooks and meter cannot handle (vmap raised from the
    meter): it runs the stages plainly, with a warning, and gives plain results."""
    from torch.func import grad, vmap

    chain_module._warned_transforms.clear()   # (warned once per process)
    torch.manual_seed(0)
    layers = nn.ModuleList(remat.stage(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)))
                           for _ in range(3))
    x = torch.randn(8, 16)

    def f(xx, chained):
        h = xx
        if chained:
            with remat.chain(budget=2**40):
                for s in layers:
                    h = s(h)
        else:
            for s in layers:
                h = s(h)
        return h.square().sum()

    with pytest.warns(RuntimeWarning, match="torch.func transform"):
        got = vmap(lambda xx: f(xx, True))(x)
    assert torch.equal(got, vmap(lambda xx: f(xx, False))(x))
    assert torch.equal(grad(lambda xx: f(xx, True))(x), grad(lambda xx: f(xx, False))(x))
    f(x, True).backward()   # an ordinary call afterwards measures and runs the chain
    assert remat.explain().costs.stages == 3


def test_chain_on_forward_ad_dual_tensors_runs_plainly():
    """Forward-mode AD's dual tensors carry tangents whose formulas save tensors for
    the backward, which recomputing the primal cannot make again (a false
    RecomputeMismatchError from the second call), and the measuring call's meter
    moved LayerNorm's tangent by 2e-7: the chain runs plainly on them, with a
    warning; primal, tangent and gradients are plain PyTorch's."""
    import torch.autograd.forward_ad as fwAD

    chain_module._warned_transforms.clear()
    torch.manual_seed(0)
    layers = nn.ModuleList(remat.stage(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.Tanh(),
                                                     nn.Linear(32, 16))) for _ in range(4))
    plain = copy.deepcopy(layers)

    def f(mods, chained, x, t):
        with fwAD.dual_level():
            h = fwAD.make_dual(x, t)
            if chained:
                with remat.chain(budget=1):   # (below any minimum: never measured)
                    for s in mods:
                        h = s(h)
            else:
                for s in mods:
                    h = s(h)
            primal, tangent = fwAD.unpack_dual(h)
        (primal.square().sum() + tangent.square().sum()).backward()
        return [primal, tangent] + [p.grad.clone() for p in mods.parameters()]

    remat.clear_cache()
    before = remat.explain()
    for call in range(3):
        x, t = torch.randn(8, 16, generator=torch.Generator().manual_seed(call)), torch.ones(8, 16)
        with pytest.warns(RuntimeWarning, match="dual tensors") if call == 0 else contextlib.nullcontext():
            got = f(layers, True, x, t)
        want = f(plain, False, x, t)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert remat.explain() is before   # (nothing recorded)


def test_autocast_around_some_stage_calls_only():
    """Autocast entered around one stage call of a chain: its recomputations replay
    that stage's own autocast state, not the chain's (a RecomputeMismatchError:
    bfloat16 saved in the forward, float32 when recomputed)."""

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        @remat.stage
        def forward(self, x):
            return torch.tanh(self.lin(x.float()))

    torch.manual_seed(0)
    layers = nn.ModuleList(Blk() for _ in range(4))
    ref = copy.deepcopy(layers)
    x = torch.randn(8, 16)

    def body(m):
        h = m[0](x)
        with torch.autocast("cpu", torch.bfloat16):
            h = m[1](h)
        return m[3](m[2](h)).float().square().mean()

    budget = 2**40
    for _ in range(3):
        for m in (ref, layers):
            m.zero_grad()
        body(ref).backward()
        with remat.chain(budget=budget):
            loss = body(layers)
        loss.backward()
        for a, b in zip(ref.parameters(), layers.parameters()):
            assert torch.equal(a.grad, b.grad)
        budget = minimum_budget(remat.explain().costs)
    assert remat.explain().schedule.recomputations() > 0


def test_stage_drawing_from_its_own_generator():
    """A stage drawing noise from its own ``torch.Generator`` (seeded noise,
    stochastic depth): its recomputations replay that generator too (they drew
    fresh noise: gradients 0.02 apart), and leave it where plain PyTorch does."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.g = torch.Generator().manual_seed(5)

        @remat.stage
        def forward(self, x):
            return torch.tanh(self.lin(x)) * torch.rand(x.shape, generator=self.g)

    torch.manual_seed(0)
    mods = nn.ModuleList(Noisy() for _ in range(4))
    ref = copy.deepcopy(mods)
    for a, b in zip(ref, mods):
        b.g = torch.Generator().manual_seed(5)
        a.g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 16)
    budget = 2**40
    for _ in range(3):
        for m in (ref, mods):
            m.zero_grad()
        h = g = x
        with remat.chain(budget=budget):
            for s in mods:
                h = s(h)
        for s in ref:
            g = s(g)
        h.square().sum().backward()
        g.square().sum().backward()
        for a, b in zip(ref.parameters(), mods.parameters()):
            assert torch.equal(a.grad, b.grad)
        assert all(torch.equal(a.g.get_state(), b.g.get_state()) for a, b in zip(ref, mods))
        budget = minimum_budget(remat.explain().costs)
    assert remat.explain().schedule.recomputations() > 0
