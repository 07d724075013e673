"""A stage module changed between calls of a chain, in ways the chain's record cannot
show by its key: it starts drawing random numbers, a submodule is replaced, a
buffer is registered, parameters are pruned to another shape. Each call after
the change is plain PyTorch's, at a budget that recomputes. Also a chain whose
path of stages changes from call to call (LayerDrop), which is warned of."""

import copy

import pytest
import torch
import torch.nn as nn

import remat
from remat.solver.schedule import simulate
from remat.solver.solve import minimum_budget, store_all
from chains import run_blocks

D = 16


class Block(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.lin = nn.Linear(D, hidden)
        self.lin2 = nn.Linear(hidden, D)
        self.bn = nn.BatchNorm1d(D)
        self.drop = nn.Dropout(0.0)
        self.sigma = 0.0

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.sigma:
            h = h + self.sigma * torch.randn_like(h)   # noise injection
        if hasattr(self, "ema"):
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean(0)[:D], alpha=0.1)
        return x + self.drop(self.bn(self.lin2(h)))


def _step(blocks, x, budget):
    h = run_blocks(blocks, x, budget)
    h.square().mean().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in blocks.parameters()]   # (frozen: None)
    for p in blocks.parameters():
        p.grad = None
    return grads


def _pair(block, n):
    """Plain PyTorch's ``n`` blocks and a copy of them marked as stages, the cache cleared."""
    remat.clear_cache()
    torch.manual_seed(0)
    plain = nn.ModuleList(block() for _ in range(n))
    blocks = copy.deepcopy(plain)
    for b in blocks:
        remat.stage(b)
    return plain, blocks


@pytest.fixture
def measured(monkeypatch):
    """The stages measured (remat.profile's instrumented run), in order, since last cleared."""
    from remat.measure import measuring

    seen = []
    run = measuring.instrumented_run
    monkeypatch.setattr(measuring, "instrumented_run", lambda call, *a, **kw: seen.append(call.index) or
                        run(call, *a, **kw))
    return seen


def _prune(block):
    block.lin.weight = nn.Parameter(block.lin.weight.detach()[:8].clone())
    block.lin.bias = nn.Parameter(block.lin.bias.detach()[:8].clone())
    block.lin2.weight = nn.Parameter(block.lin2.weight.detach()[:, :8].clone())


CHANGES = {
    "dropout-p-raised": lambda b: setattr(b.drop, "p", 0.5),        # saves one tensor more
    "noise-switched-on": lambda b: setattr(b, "sigma", 0.1),         # saves as many as before
    "batchnorm-replaced": lambda b: setattr(b, "bn", nn.BatchNorm1d(D)),
    "buffer-registered": lambda b: b.register_buffer("ema", torch.zeros(D)),
    "pruned": _prune,
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_stage_changed_between_calls_stays_exact(change):
    """Before: recomputations drew fresh noise and dropout masks (a stage recorded
    as drawing no random numbers was not replayed), updated a new BatchNorm's or a
    new buffer's statistics once per run (gradients and statistics off, every call
    after), and a pruned stage raised RecomputeMismatchError on every call. Now a
    recomputed stage always replays the RNG, and a stage made of other submodules,
    parameters or buffers, or with parameters of other shapes, is measured again."""
    plain, blocks = _pair(Block, 4)
    x = torch.randn(8, D)
    _step(copy.deepcopy(blocks), x, 2**50)
    costs = remat.explain().costs
    low, high = minimum_budget(costs), simulate(costs, store_all(costs.length)).peak
    budget = int(low + 0.3 * (high - low))
    remat.clear_cache()
    for step in range(4):
        if step == 2:
            for b in list(plain) + list(blocks):
                CHANGES[change](b)
        torch.manual_seed(100 + step)
        want = _step(plain, x, None)
        rng_want = torch.get_rng_state()
        torch.manual_seed(100 + step)
        got = _step(blocks, x, budget)
        if step < 2 or change != "pruned":   # (pruned, everything fits)
            assert remat.explain().schedule.recomputations() > 0
        assert torch.equal(torch.get_rng_state(), rng_want), step
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        for a, b in zip(plain.buffers(), blocks.buffers()):
            assert torch.equal(a, b), step


class _Skipping(nn.Module):
    """Five stages; ``skip`` leaves one out (LayerDrop, an optional block)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(remat.stage(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)))
                                    for _ in range(5))
        self.budget = None

    def forward(self, x, skip=None):
        blocks = [b for i, b in enumerate(self.blocks) if i != skip]
        if self.budget is None:
            return nn.Sequential(*blocks)(x)
        with remat.chain(budget=self.budget):
            for block in blocks:
                x = block(x)
        return x


def test_a_path_changing_from_call_to_call_is_warned_of(monkeypatch):
    """Each call a path not taken before (here stages skipped, with the records of
    other paths and the views without skipped stages turned off): each measures the
    rest again (exact, but over the budget), which a warning says once
    ``PATH_CHANGES`` calls in a row have; a path that changes once and stays does
    not, nor do paths taken in turn or stages skipped (tests/runtime/test_paths.py)."""
    import warnings

    from remat.runtime import chain_call
    from remat.runtime.paths import PATH_CHANGES

    torch.manual_seed(0)
    net = _Skipping()
    x = torch.randn(8, 16)
    net.budget = 2**40
    net(x).sum().backward()
    net.budget = minimum_budget(remat.explain().costs)
    remat.clear_cache()
    ref = copy.deepcopy(net)
    ref.budget = None

    def step(skip):
        for model in (ref, net):
            model.zero_grad()
            model(x, skip).square().mean().backward()
        assert all((a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
                   for a, b in zip(ref.parameters(), net.parameters()))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for skip in (None, 2, 2, 2, 2):   # the same stages skipped on each call after the first
            step(skip)
    # (each call measures, as one taking a path not seen before does: here two paths
    # taken in turn, which would otherwise run on their records)
    monkeypatch.setattr(chain_call, "switch_path", lambda *args: False)
    for i in range(PATH_CHANGES - 1):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step((3, None)[i % 2])
    with pytest.warns(RuntimeWarning, match=rf"took another path of stages than its record on {PATH_CHANGES} "
                                            r"calls in a row .*reordered"):
        step((3, None)[(PATH_CHANGES - 1) % 2])


def _frozen_lin(block):
    for p in block.lin.parameters():
        p.requires_grad_(False)


WHOLE_CHANGES = {
    "frozen": _frozen_lin,                                              # saves less
    "batchnorm-to-eval": lambda b: b.bn.eval(),                         # writes no statistics
    "batchnorm-replaced": lambda b: setattr(b, "bn", nn.BatchNorm1d(D)),
    "buffer-registered": lambda b: b.register_buffer("ema", torch.zeros(D)),
}


@pytest.mark.parametrize("change", WHOLE_CHANGES)
def test_a_stage_recorded_whole_changed_is_measured_again_by_the_call_that_meets_it(change, measured):
    """At a budget that stores everything each stage is recorded whole, and its
    module is checked as the call opens (Note [Stages recorded whole] in
    remat/runtime/runner.py): the call after a change measures that stage again
    (and the stages after it), exact, and no call after it does. (Until 2026-11-29
    the check ran at the call's end: that call ran on the old costs.)"""
    plain, blocks = _pair(Block, 4)
    x = torch.randn(8, D)
    for step in range(6):
        if step == 2:
            for net in (plain, blocks):
                WHOLE_CHANGES[change](net[1])
        measured.clear()
        torch.manual_seed(100 + step)
        want = _step(plain, x, None)
        torch.manual_seed(100 + step)
        got = _step(blocks, x, 2**40)
        assert remat.explain().schedule.recomputations() == 0
        assert all(a is b or torch.equal(a, b) for a, b in zip(got, want)), step
        for a, b in zip(plain.buffers(), blocks.buffers()):
            assert torch.equal(a, b), step
        assert measured == ([1, 2, 3, 4] if step == 0 else [2, 3, 4] if step == 2 else []), step


class _Resharding(nn.Module):
    """Holds its weight otherwise between calls than during them, as FSDP frees its
    unsharded parameters after a forward: a hook puts a stand-in of another shape
    in its slot after the forward, one before the next puts the weight back."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.full = self.lin.weight
        self.register_forward_pre_hook(lambda m, args: m.lin.register_parameter("weight", m.full))
        self.register_forward_hook(
            lambda m, args, out: m.lin.register_parameter("weight", nn.Parameter(torch.zeros(1))))

    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_a_stage_held_otherwise_between_calls_is_not_measured_again(measured):
    """A stage recorded whole whose module looks changed at the call's end but is
    as recorded whenever it is called: checked as it is called from the next call
    on, and never measured again; gradients exact throughout."""
    remat.clear_cache()
    torch.manual_seed(0)
    stages = [remat.stage(_Resharding()) for _ in range(3)]
    x = torch.randn(8, D, requires_grad=True)
    for step in range(4):
        measured.clear()
        with remat.chain(budget=2**40):
            h = x
            for s in stages:
                h = s(h)
        h.square().sum().backward()
        grads = [s.full.grad.clone() for s in stages]
        for s in stages:
            s.full.grad = None
        h = x
        for s in stages:
            h = s(h)
        h.square().sum().backward()
        assert all(torch.equal(g, s.full.grad) for g, s in zip(grads, stages)), step
        for s in stages:
            s.full.grad = None
        assert measured == ([1, 2, 3] if step == 0 else []), step


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + self.lin(x)   # (the Linear saves its input only if its weight needs grad)


def test_a_stage_recorded_whole_unfrozen_at_the_minimum_budget_keeps_running():
    """Progressive unfreezing: the last stage, recorded whole, starts frozen and keeps
    nothing of its input; unfrozen, it keeps it. The call after that runs it as
    recorded and must not take the input it keeps for one the code around the chain
    holds (a warning, and held bytes that put the minimum above the budget: every
    call after failed with BudgetError); the one after measures it again. Every call
    exact, none warned of."""
    import warnings

    plain, blocks = _pair(_Residual, 4)
    x = torch.randn(32, D)
    for net in (plain, blocks):
        net[-1].requires_grad_(False)
    _step(blocks, x, 2**40)
    low = minimum_budget(remat.explain().costs)
    # (the least the unfrozen chain needs, measured apart: with the step's tail after the
    # block counted, keeping the last stage's input can need more than the frozen chain)
    unfrozen = copy.deepcopy(blocks)
    unfrozen[-1].requires_grad_(True)
    _step(unfrozen, x, 2**40)
    low = max(low, minimum_budget(remat.explain().costs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(5):
            if step == 2:
                for net in (plain, blocks):
                    net[-1].requires_grad_(True)
            want = _step(plain, x, None)
            got = _step(blocks, x, low)
            assert remat.explain().schedule.recomputations() > 0
            assert all(a is b or torch.equal(a, b) for a, b in zip(got, want)), step


class _Observer(nn.Module):
    """Reads a buffer it writes in place once its observer is switched on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("avg", torch.zeros(D))
        self.observe = False

    def forward(self, x):
        if self.observe:
            self.avg.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return x + torch.tanh(self.lin(x - self.avg))


def test_a_stage_recorded_whole_that_starts_writing_a_buffer_is_measured_again():
    """An observer switched on in a stage recorded whole: the call measures the
    chain again on the next call (it did not: a later budget that recomputes the
    stage replayed it from the buffer's value after its forward, and its gradients
    were off), as for a stage recomputed. Every call exact."""
    import warnings

    plain, blocks = _pair(_Observer, 5)
    x = torch.randn(8, D, requires_grad=True)
    _step(copy.deepcopy(blocks), x, 2**40)
    low = int(minimum_budget(remat.explain().costs) * 1.2)
    remat.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, budget in enumerate([2**40, 2**40, 2**40, low, low]):
            if step == 1:
                for net in (plain, blocks):
                    net[2].observe = True
            want = _step(plain, x, None)
            got = _step(blocks, x, budget)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), step
            for a, b in zip(plain.buffers(), blocks.buffers()):
                assert torch.equal(a, b), step
    assert remat.explain().schedule.recomputations() > 0
