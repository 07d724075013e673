"""A stage whose input needs no grad makes no input gradient at ``B(i)``, and plans
count none (Note [An input needing no grad], remat/measure/profile.py): the chain's
first stage on data, and the first trained stage after frozen ones."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat

C = 16


def _block():
    return nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C), nn.ReLU(), nn.Conv2d(C, C, 3, padding=1),
                         nn.ReLU())


class Net(nn.Module):
    """A frozen stem, six blocks (the first ``frozen`` of them frozen) and a head."""

    def __init__(self, frozen):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.layers = nn.ModuleList(_block() for _ in range(6))
        self.head = nn.Linear(C, 10)
        for m in (self.stem, *self.layers[:frozen]):
            m.requires_grad_(False)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean((2, 3)))


pytestmark = pytest.mark.usefixtures("one_thread")   # (tests/conftest.py)


def _step(model, x, y):
    with remat.measure_peak() as m:
        F.cross_entropy(model(x), y).backward()
    return m.peak


def _least(base, first, x, y):
    """The least budget remat names for ``base`` wrapped from block ``first`` on."""
    model = copy.deepcopy(base)
    remat.wrap(model, model.layers[first:], budget="auto")
    for _ in range(2):
        _step(model, x, y)
    return remat.explain().least_budget


@pytest.mark.parametrize("frozen", [0, 2])
def test_a_frozen_prefix_needs_no_more_than_the_chain_after_it(frozen):
    """Planned as if its first trained stage made its input's gradient, a chain with
    two frozen blocks needed one activation more than the same model wrapped from its
    first trained block (14% here); and every call at that least stays under it, with
    plain PyTorch's gradients and statistics."""
    torch.manual_seed(0)
    base = Net(frozen)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    act = 4 * C * 16 * 16 * 4
    whole, after = _least(base, 0, x, y), _least(base, frozen, x, y)
    assert whole <= after + act // 8, (whole, after, act)
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    remat.wrap(model, model.layers, budget=whole)
    for m in (plain, model):
        for p in m.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
    for step in range(3):
        xs, ys = (x, y) if step < 2 else (x[:3], y[:3])
        _step(plain, xs, ys)
        assert _step(model, xs, ys) <= whole, step
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name
