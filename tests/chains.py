"""Chains of small stages for tests only: random chains and the plain-PyTorch
reference to hold them to, the block models of the parameter and module tests,
and one step of a chain over a costs file."""

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrizations as P

import remat
from remat.solve import minimum_budget

SEQ_KINDS = ("linear", "mlp", "ln", "dropout", "gelu", "relu", "bn", "attn", "tied", "scale")
IMG_KINDS = ("conv", "bn2d", "relu", "gelu", "dropout", "convblock", "scale")


class Scale(nn.Module):
    """A stage autograd saves nothing of."""

    def forward(self, x):
        return x * 2.0


class Attention(nn.Module):
    """A small causal self-attention block; the mask is a side input."""

    def __init__(self, d, p):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + mask
        return x + self.proj(self.drop(att.softmax(-1)) @ v)


class Stage(nn.Module):
    """One stage wrapping ``body``; ``takes_mask`` stages get the mask side input."""

    def __init__(self, kind, body, takes_mask=False):
        super().__init__()
        self.kind = kind
        self.body = body
        self.takes_mask = takes_mask

    @remat.stage
    def forward(self, x, mask=None):
        if self.takes_mask:
            return self.body(x, mask)
        if self.kind == "bn":
            return self.body(x.transpose(1, 2)).transpose(1, 2)
        return self.body(x)


class TiedLinear(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = [shared]   # not registered twice: the owner registers it

    def forward(self, x):
        return torch.tanh(F.linear(x, self.shared[0].weight, self.shared[0].bias))


def make_stage(kind, d, p, shared):
    if kind == "linear":
        return Stage(kind, nn.Linear(d, d))
    if kind == "mlp":
        return Stage(kind, nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p), nn.Linear(2 * d, d)))
    if kind == "ln":
        return Stage(kind, nn.LayerNorm(d))
    if kind == "dropout":
        return Stage(kind, nn.Dropout(p))
    if kind == "gelu":
        return Stage(kind, nn.GELU())
    if kind == "relu":
        return Stage(kind, nn.ReLU())
    if kind == "bn":
        return Stage(kind, nn.BatchNorm1d(d))
    if kind == "attn":
        return Stage(kind, Attention(d, p), takes_mask=True)
    if kind == "tied":
        return Stage(kind, TiedLinear(shared))
    if kind == "scale":
        return Stage(kind, Scale())
    if kind == "conv":
        return Stage(kind, nn.Conv2d(d, d, 3, padding=1))
    if kind == "bn2d":
        return Stage(kind, nn.BatchNorm2d(d))
    if kind == "convblock":
        return Stage(kind, nn.Sequential(nn.Conv2d(d, d, 3, padding=1), nn.BatchNorm2d(d), nn.ReLU()))
    raise ValueError(kind)


class Net(nn.Module):
    """A chain of stages; ``budget=None`` runs them plainly."""

    def __init__(self, kinds, d=8, p=0.25, image=False):
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.stages = nn.ModuleList(make_stage(k, d, p, self.shared) for k in kinds)
        self.image = image
        self.d = d
        self.budget = None
        self.algorithm = "optimal"

    def forward(self, x, mask):
        if self.budget is None:
            for s in self.stages:
                x = s(x, mask)
            return x
        with remat.chain(budget=self.budget, algorithm=self.algorithm):
            for s in self.stages:
                x = s(x, mask)
        return x


def make_input(net, batch=4, length=6, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if net.image:
        x = torch.randn(batch, net.d, length, length, generator=g)
    else:
        x = torch.randn(batch, length, net.d, generator=g)
    mask = torch.full((length, length), float("-inf")).triu(1)
    return x.to(device).requires_grad_(), mask.to(device)


def train(net, steps=3, opt="sgd", seed=0, batch=4, length=6, hold=True, device="cpu"):
    """Run ``steps`` training steps; return everything a comparison needs. With
    ``hold``, the loop keeps the net's output through the backward (as
    ``y = net(x); loss = f(y); loss.backward()`` does), else it lets it go."""
    torch.manual_seed(seed)
    params = list(net.parameters())
    optim = torch.optim.SGD(params, lr=0.01) if opt == "sgd" else torch.optim.Adam(params, lr=0.01)
    record = []
    for step in range(steps):
        x, mask = make_input(net, batch, length, seed=seed + step, device=device)
        target = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 100 + step)).to(device)
        y = net(x, mask)
        loss = (y * target).sum()
        if not hold:
            del y
        optim.zero_grad()
        loss.backward()
        record.append((loss.detach(), x.grad.clone(), [None if p.grad is None else p.grad.clone() for p in params]))
        optim.step()
    return {
        "steps": record,
        "buffers": [b.clone() for b in net.buffers()],
        "params": [p.detach().clone() for p in params],
    }


def assert_same(ref, got, exact=True):
    """Every loss, gradient, buffer and parameter equal: bitwise if ``exact``."""
    def check(a, b, what):
        if a is None or b is None:
            assert a is None and b is None, what
        elif exact:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
        else:
            torch.testing.assert_close(a, b, msg=what)

    for i, ((la, xa, ga), (lb, xb, gb)) in enumerate(zip(ref["steps"], got["steps"])):
        check(la, lb, f"loss of step {i}")
        check(xa, xb, f"input grad of step {i}")
        for j, (a, b) in enumerate(zip(ga, gb)):
            check(a, b, f"grad of parameter {j} at step {i}")
    for j, (a, b) in enumerate(zip(ref["buffers"], got["buffers"])):
        check(a, b, f"buffer {j}")
    for j, (a, b) in enumerate(zip(ref["params"], got["params"])):
        check(a, b, f"parameter {j} after the steps")


def measured_costs(net, batch=4, length=6, device="cpu"):
    """Measure ``net``'s chain once (on a copy) and return its Costs."""
    probe = copy.deepcopy(net)
    probe.budget, probe.algorithm = 2**50, "store_all"
    x, mask = make_input(probe, batch, length, device=device)
    probe(x, mask).sum().backward()
    return remat.explain().costs


def costs_file_step(layers, path, batch=8):
    """One step of ``layers`` as a chain whose costs file is ``path``, on ``batch``
    random rows of 16; returns the input's gradient."""
    x = torch.randn(batch, 16, requires_grad=True)
    with remat.chain(budget=2**40, costs=path):
        h = x
        for layer in layers:
            h = layer(h)
    h.sum().backward()
    return x.grad


# The models of test_parameters.py and test_changes_before_backward.py.

class PosBlock(nn.Module):
    """A pre-norm MLP block (BatchNorm if ``bn``) taking an optional ``pos`` side input."""

    def __init__(self, d, bn=False):
        super().__init__()
        self.norm = nn.BatchNorm1d(d) if bn else nn.LayerNorm(d)
        self.l1 = nn.Linear(d, 2 * d)
        self.l2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)
        self.bn = bn

    @remat.stage
    def forward(self, x, pos=None):
        h = self.norm(x.transpose(1, 2)).transpose(1, 2) if self.bn else self.norm(x)
        if pos is not None:
            h = h + pos
        return x + self.l2(self.drop(F.gelu(self.l1(h))))


class PosNet(nn.Module):
    """``n`` PosBlocks and a head; ``budget=None`` runs them plainly."""

    def __init__(self, n=5, d=16, bn=False):
        super().__init__()
        self.blocks = nn.ModuleList(PosBlock(d, bn) for _ in range(n))
        self.head = nn.Linear(d, 3)
        self.budget = None

    def forward(self, x, pos=None):
        if self.budget is None:
            for b in self.blocks:
                x = b(x, pos)
        else:
            with remat.chain(budget=self.budget):
                for b in self.blocks:
                    x = b(x, pos)
        return self.head(x)


def pos_pair(bn=False, n=5):
    """A model and its remat twin at the chain's minimum budget (every stage but the
    last recomputed), the cache cleared after the probe that found it."""
    torch.manual_seed(0)
    ref = PosNet(n, bn=bn)
    probe = copy.deepcopy(ref)
    probe.budget = 2**40
    probe(torch.randn(4, 8, 16)).sum().backward()
    low = minimum_budget(remat.explain().costs)
    remat.clear_cache()
    net = copy.deepcopy(ref)
    net.budget = low
    return ref, net


def grads_of(model):
    """The gradients of ``model``'s parameters, None where there is none."""
    return [p.grad for p in model.parameters()]


def assert_grads_equal(a, b):
    """Two lists of gradients are bitwise equal, None in the same places."""
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


# The models of test_module_state.py and test_module_hooks.py.

class LnBlock(nn.Module):
    """A pre-norm MLP block with dropout."""

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


class BlockNet(nn.Module):
    """The stages ``blocks`` and a head; ``budget=None`` runs them plainly."""

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


def block_net(kind, n=5, d=16):
    """``n`` LnBlocks (every other one Counting if ``kind`` is "counting"), their
    ``l1`` spectral- or weight-normed as ``kind`` says."""
    torch.manual_seed(0)
    if kind == "counting":
        return BlockNet([Counting(d) if i % 2 else LnBlock(d) for i in range(n)], d)
    net = BlockNet([LnBlock(d) for _ in range(n)], d)
    for b in net.blocks:
        if kind == "spectral":
            P.spectral_norm(b.l1)
        elif kind == "spectral_hook":
            torch.nn.utils.spectral_norm(b.l1)
        elif kind == "weight_norm":
            P.weight_norm(b.l1)
    return net


def train_blocks(net, x, steps=3, seed=1):
    """``steps`` SGD steps of ``net`` on ``x``, each under its own seed."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(seed + step)
        net(x).square().mean().backward()
        opt.step()


def block_budgets(net, x):
    """The chain's minimum and the middle of minimum..store-all, from a measuring call
    on a copy (the model itself stays untouched)."""
    probe = copy.deepcopy(net)
    probe.budget = 2**40
    train_blocks(probe, x, steps=1)
    costs = remat.explain().costs
    low, high = minimum_budget(costs), remat.explain().schedule.peak
    remat.clear_cache()
    return low, (low + high) // 2


def assert_blocks_same(ref, net):
    """Parameters, their gradients and buffers are bitwise equal."""
    for (name, a), b in zip(ref.named_parameters(), net.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(ref.named_buffers(), net.buffers()):
        assert torch.equal(a, b), name
