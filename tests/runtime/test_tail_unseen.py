"""What a measuring call does not see of the chain's tail: a head whose backward
needs more than its forward showed (the minimum it names says so), and a chain
run plainly under no_grad between the forward and the backward (an EMA
teacher's), which is part of the tail, not a chain cutting it short (Note [The
chain's tail], remat/measure/tail.py)."""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

import remat


def test_a_first_calls_minimum_made_before_the_heads_backward_says_it_may_be_more():
    """A head whose backward needs far more than its forward showed (the logits'
    gradient of a 2,000-word vocabulary): the measuring call's BudgetError, solved
    before that backward ran, says its minimum may be short; the next call at that
    minimum, which has seen the backward, raises a larger one and says nothing of it."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
            self.head = nn.Linear(16, 2000)

        def forward(self, x, y):
            for block in self.blocks:
                x = block(x)
            return nn.functional.cross_entropy(self.head(x), y)

    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 2000, (64,))
    errors, budget = [], 1024
    while len(errors) < 6:
        remat.clear_cache()
        net = Net()
        remat.wrap(net, net.blocks, budget=budget)
        try:
            with pytest.warns(RuntimeWarning) if errors and "has not run yet" in str(errors[-1]) else \
                    contextlib.nullcontext():   # (the first call at such a minimum learns it was short)
                for _ in range(2):
                    net(x, y).backward()
            break
        except remat.BudgetError as exc:
            errors.append(exc)
            budget = exc.minimum
    said = ["their backward has not run yet and may need more" in str(e) for e in errors]
    assert True in said, [str(e) for e in errors]
    k = said.index(True)
    assert len(errors) > k + 1 and errors[k + 1].minimum > errors[k].minimum and not said[k + 1]


def test_a_no_grad_chain_between_the_forward_and_the_backward_is_part_of_the_tail():
    """An EMA teacher's forward under no_grad (a chain run plainly) after the student's
    chain and before its backward: the student's tail goes on being metered through it
    (it cut the tail short, and every step from the second went to the store-all peak,
    25% over the budget)."""
    from remat.measure.meter import Instrument
    from remat.solver.schedule import simulate
    from remat.solver.solve import store_all

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(32, 128), nn.Linear(128, 32)

        @remat.stage
        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self, budget):
            super().__init__()
            self.blocks, self.head, self.budget = nn.ModuleList(Block() for _ in range(6)), nn.Linear(32, 2000), budget

        def forward(self, x):
            with remat.chain(budget=self.budget):
                for b in self.blocks:
                    x = b(x)
            return self.head(x)

    def run(budget, steps):
        remat.clear_cache()
        torch.manual_seed(0)
        net = Net(budget)
        teacher = copy.deepcopy(net).requires_grad_(False)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        peaks = []
        for s in range(steps):
            g = torch.Generator().manual_seed(s)
            x, y = torch.randn(8, 16, 32, generator=g), torch.randint(0, 2000, (8 * 16,), generator=g)
            with Instrument(writes=False) as inst:
                logits = net(x)
                with torch.no_grad():
                    teacher(torch.randn(1, 2, 32, generator=g))
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), y).backward()
            peaks.append(inst.peak + x.untyped_storage().nbytes())
        return peaks, remat.explain()

    _, probe = run(2**40, 2)
    low, high = probe.least_budget, simulate(probe.costs, store_all(probe.costs.length)).peak
    budget = int(low + 0.2 * (high - low))
    peaks, explanation = run(budget, 4)
    assert max(peaks) <= budget, (peaks, budget)
    assert "cut short" not in str(explanation.tail)
