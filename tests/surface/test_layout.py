"""The layout's promises (docs/how-it-works.md, "The life of a training step"): a
later call runs code in at most 8 of remat's modules, and no module is over 400
lines."""

import os
import sys

import torch

import remat
from remat.models import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import call_path  # noqa: E402


def test_no_module_over_400_lines():
    long = []
    for folder, _, files in os.walk(os.path.join(ROOT, "remat")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    n = sum(1 for _ in f)
                if n > call_path.MAX_LINES:
                    long.append((os.path.relpath(path, ROOT), n))
    assert not long


def test_a_later_call_enters_at_most_8_modules():
    """The sixth step of a GPT chain that recomputes, past the calls that refine its
    times: the modules of remat it runs code in (benchmarks/call_path.py)."""
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.1)
    data = torch.randint(0, 64, (4, 16))

    def step():
        logits = model(data)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), data.flatten()).backward()

    remat.clear_cache()
    model.budget = remat.chain.NO_LIMIT
    step()
    costs = remat.explain().costs
    remat.clear_cache()
    low = remat.solver.solve.minimum_budget(costs)
    model.budget = (low + costs.held_bytes + sum(costs.saved_bytes) * 2) // 3
    for _ in range(5):
        step()
    order, _ = call_path.trace(step)
    assert remat.explain().schedule.recomputations() > 0
    names = [os.path.relpath(p, ROOT) for p in order]
    assert len(names) <= 8, " ".join(names)
    remat.clear_cache()
