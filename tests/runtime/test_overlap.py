"""Calls of one chain alive together (Note [Calls alive together],
remat/measure/overlap.py): the same chain opened again before the backward has
reached the earlier call (a siamese pair), its stages' parameter gradients held
by the engine between the two calls' backwards."""

import gc

import pytest
import torch
import torch.nn as nn

import remat


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _siamese(budget, steps, seed=0):
    """Steps of a wrapped 4-block chain called on two views before one backward: each
    step's peak, and the gradients."""
    torch.manual_seed(seed)
    net = nn.Sequential(*(_Block(32) for _ in range(4)))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    if budget is not None:
        remat.wrap(net, list(net), budget=budget)
    x1, x2 = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    peaks = []
    for _ in range(steps):
        gc.collect()
        with remat.measure_peak() as m:
            (net(x1) * net(x2)).mean().backward()
        peaks.append(m.peak)
    return peaks, [p.grad.clone() for p in net.parameters()]


def test_a_chain_called_twice_before_one_backward_counts_the_parameter_gradients():
    """The later call's backward runs first, and the engine holds its shares of every
    stage's parameter gradients until the earlier call's backward reaches the stage:
    steps went 1.9 times over the two calls' budgets, near plain PyTorch's peak. The
    second call warns and counts them; a budget under them is refused with the
    least that holds them, and at it every step from the second is under twice the
    budget (each call's), its gradients plain PyTorch's."""
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="opened again before the backward reached its earlier call"):
        _siamese(2**30, 2)
    least = remat.explain().least_budget
    params = sum(p.numel() * 4 for p in nn.Sequential(*(_Block(32) for _ in range(4))).parameters())
    assert least > params
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="opened again"):
        with pytest.raises(remat.BudgetError) as caught:
            _siamese(least - params // 2, 2)
    assert caught.value.minimum > params   # (it counts them)
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="opened again"):
        peaks, grads = _siamese(least, 4)
    assert all(peak <= 2 * least for peak in peaks[1:]), (peaks, least)
    _, want = _siamese(None, 4)
    assert all(torch.equal(a, b) for a, b in zip(want, grads))
    held = remat.explain().held
    assert any("held between two calls' backwards" in k for k in held), held


def test_a_backward_between_the_calls_counts_nothing():
    """Gradient accumulation (each call's backward before the next forward) keeps no
    gradient between calls: nothing is counted, nothing warns."""
    torch.manual_seed(0)
    net = nn.Sequential(*(_Block(32) for _ in range(4)))
    remat.clear_cache()
    remat.wrap(net, list(net), budget=64 * 1024)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(4):
            net(torch.randn(4, 8, 32)).square().mean().backward()
    assert not any("two calls" in k for k in remat.explain().held)
