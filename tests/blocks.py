"""Residual block models shared by the tests of parameter and module changes
(test_parameters, test_changes_before_backward, test_module_state,
test_module_hooks), and their plain-PyTorch comparisons."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrizations as P

import remat


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
    """A model and its remat twin at the chain's least budget (its first call's,
    ``Explanation.least_budget``; every stage but the last recomputed), the cache
    cleared after the probe that found it."""
    torch.manual_seed(0)
    ref = PosNet(n, bn=bn)
    probe = copy.deepcopy(ref)
    probe.budget = 2**40
    probe(torch.randn(4, 8, 16)).sum().backward()
    low = remat.explain().least_budget
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
    """The chain's least budget (its first call's) and the middle of least..store-all,
    from a measuring call on a copy (the model itself stays untouched)."""
    probe = copy.deepcopy(net)
    probe.budget = 2**40
    train_blocks(probe, x, steps=1)
    low, high = remat.explain().least_budget, remat.explain().schedule.peak
    remat.clear_cache()
    return low, (low + high) // 2


def assert_blocks_same(ref, net):
    """Parameters, their gradients and buffers are bitwise equal."""
    for (name, a), b in zip(ref.named_parameters(), net.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(ref.named_buffers(), net.buffers()):
        assert torch.equal(a, b), name
