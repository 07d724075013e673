"""Chains of small stages for tests only: random chains and the plain-PyTorch
reference to hold them to, one step of a chain over a costs file, budgets
between a chain's minimum and its store-all peak and the peak a step meters
(the block models of the parameter and module tests are in tests/blocks.py)."""

import copy
import math
import sys
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

import remat
from remat.measure.holding import measuring_least
from remat.solver.schedule import simulate
from remat.solver.solve import minimum_budget, solve, store_all

SEQ_KINDS = ("linear", "mlp", "ln", "dropout", "gelu", "relu", "bn", "attn", "tied", "scale", "swiglu")
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


class SwiGlu(nn.Module):
    """LLaMA's MLP: bias-free linears, whose outputs on 3-D input are ``_unsafe_view``s of their
    ``mm``, one written in place (an option must make it again: remat/runtime/option_modes.py)."""

    def __init__(self, d):
        super().__init__()
        self.up, self.gate, self.down = (nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False),
                                         nn.Linear(2 * d, d, bias=False))

    def forward(self, x):
        h = self.up(x)
        h *= F.silu(self.gate(x))
        return x + self.down(h)


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
    if kind == "swiglu":
        return Stage(kind, SwiGlu(d))
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
    """Measure ``net``'s chain once (on a copy) and return its Costs, with the tail
    ``train``'s step runs after the chain's block (its output held, a loss of it and
    a target), which the budget counts (remat/measure/tail.py Note [The chain's tail] 5)."""
    probe = copy.deepcopy(net)
    probe.budget, probe.algorithm = 2**50, "store_all"
    x, mask = make_input(probe, batch, length, device=device)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(100)).to(device)
    y = probe(x, mask)
    (y * target).sum().backward()
    costs = remat.explain().costs
    remember_least(costs)
    return costs


_FIRST_CALL = {}   # id(Costs measured_costs returned) -> (them, the least every call of their chain needs)


def remember_least(costs):
    """Note ``remat.explain().least_budget`` as that of ``costs``, the latest chain's."""
    _FIRST_CALL[id(costs)] = (costs, remat.explain().least_budget)


def least_budget(costs):
    """The least budget every call of the chain of ``costs`` runs under, its first
    included (``Explanation.least_budget``, as noted by ``remember_least``; else
    from the costs alone, which may be below what measuring a stage held)."""
    return _FIRST_CALL.get(id(costs), (None, max(minimum_budget(costs), measuring_least(costs))))[1]


def head_step(blocks, head, x, budget):
    """One training step of ``blocks`` as a chain under ``budget``, with ``head`` and a
    logsumexp loss inside the chain's block."""
    with remat.chain(budget=budget):
        h = x
        for b in blocks:
            h = b(h)
        loss = head(h).logsumexp(-1).mean()
    loss.backward()


def calls_at_least(step, calls=3):
    """The least budget ``step(budget, seed)`` (a training step returning
    ``remat.explain()``) shows after two calls at no limit, and ``calls`` steps at it
    on a fresh cache: (that budget, their explanations)."""
    remat.clear_cache()
    step(2**40, 100)
    least = step(2**40, 101).least_budget
    remat.clear_cache()
    return least, [step(least, seed) for seed in range(calls)]


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


def run_blocks(blocks, x, budget):
    """``x`` through ``blocks`` in turn: plain PyTorch with ``budget`` None, else a chain under it."""
    if budget is None:
        for b in blocks:
            x = b(x)
        return x
    with remat.chain(budget=budget):
        for b in blocks:
            x = b(x)
    return x


def square_step(blocks, head, x, budget):
    """A step of ``run_blocks`` and ``head`` with a mean-square loss after the chain's block,
    the gradients resident and the step metered (``remat.measure_peak``): every gradient."""
    params = [p for m in (*blocks, head) for p in m.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    with remat.measure_peak():
        head(run_blocks(blocks, x, budget)).square().mean().backward()
    return [p.grad.clone() for p in params]


ALGORITHMS = ("optimal", "store_all", "min_memory", "sqrt", "periodic(2)", "periodic(3)")


@st.composite
def random_chains(draw):
    """(kinds, image): a random chain of one to twelve stage kinds, of images or of sequences."""
    image = draw(st.booleans())
    kinds = draw(st.lists(st.sampled_from(IMG_KINDS if image else SEQ_KINDS), min_size=1, max_size=12))
    return kinds, image


def budget_for(costs, algorithm, fraction):
    """A budget ``fraction`` of the way from the chain's minimum to its store-all peak,
    raised to what ``algorithm`` needs if it is not the optimal one. The minimum is
    a first call's, which measures each stage whole: with options (Costs.options)
    a plan can need less than that."""
    low = least_budget(costs)
    high = simulate(costs, store_all(costs.length)).peak
    budget = int(low + fraction * (high - low))
    if algorithm != "optimal":
        budget = max(budget, solve(costs, 2**50, algorithm).peak)
    return max(budget, low)


def plain_and_budgeted(kinds, image, opt, fraction):
    """A ``Net`` of ``kinds`` (seed 0) trained as plain PyTorch (``train``'s result),
    and an untrained copy of it at a budget ``fraction`` of the way up (``budget_for``)."""
    torch.manual_seed(0)
    base = Net(kinds, image=image)
    ref = train(copy.deepcopy(base), opt=opt)
    net = copy.deepcopy(base)
    net.budget = budget_for(measured_costs(base), "optimal", fraction)
    return ref, net


def physical_peak(net, batch=4, length=6, seed=7, hold=True):
    """Peak bytes of tensor storages live during one training step of ``net``
    (new allocations, plus the chain input, which the budget counts): those of
    the chain, its output's gradient and its input's, not the loss's forward.
    With ``hold`` the step keeps the output through the backward, as ``train``."""
    from remat.measure.meter import Instrument

    x, mask = make_input(net, batch, length, seed=seed)
    target = torch.randn(x.shape)
    with Instrument() as inst:   # metering only what the chain makes (its gate)
        x.register_hook(lambda g: inst.set_gate(False))
        y = net(x, mask)
        inst.set_gate(False)
        loss = (y * target).sum()
        if not hold:
            del y
        seed = torch.ones(())      # the loss's own gradient is not the chain's
        inst.set_gate(True)
        loss.backward(seed)
    return inst.peak + x.untyped_storage().nbytes()


def fresh_net(kinds=("mlp", "attn", "bn", "dropout", "mlp"), image=False):
    """A ``Net`` of ``kinds`` made from seed 0."""
    torch.manual_seed(0)
    return Net(list(kinds), image=image)


def with_budget(net, fraction=0.0, algorithm="optimal"):
    """A copy of ``net`` with the budget ``fraction`` of the way up (``budget_for``) for ``algorithm``."""
    out = copy.deepcopy(net)
    out.budget = budget_for(measured_costs(net), algorithm, fraction)
    out.algorithm = algorithm
    return out


def tracked_runs(monkeypatch):
    """A weak set of every ``Run`` the chains make from now on (until ``monkeypatch`` undoes it)."""
    from remat.runtime.executor import Run
    made = weakref.WeakSet()

    class Tracked(Run):
        def __init__(self, *args):
            super().__init__(*args)
            made.add(self)

    for part in ("remat.runtime.runner", "remat.measure.measuring"):   # (where the parts make their Runs)
        monkeypatch.setattr(sys.modules[part], "Run", Tracked)
    return made


def bf16_image_step(net, batch, seed, classes=10):
    """One step of an image classifier ``net`` on ``batch`` random 32x32 images (seed ``seed``),
    its forward under CPU bf16 autocast and its backward after the block, the parameters'
    gradients resident; ``remat.explain()`` after it, its peak measured (``measure_peak``)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, classes, (batch,), generator=g)
    for p in net.parameters():
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
    with remat.measure_peak():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
    return remat.explain()


def under_budget(net, run, seed, bound):
    """``run(net, seed)``; where that call refuses ``net.budget`` (a stage's gradient came in another
    layout than measured, with no room to measure it again: counted a copy of it more, ``Run4._unmeasured``
    in remat/measure/stage_backward.py), at the minimum it names, at most ``bound`` above the budget."""
    try:
        return run(net, seed)
    except remat.BudgetError as exc:
        assert seed and exc.minimum <= net.budget + bound, (exc.minimum, net.budget, bound)
        net.budget = exc.minimum
        return run(net, seed)
