"""Faults: an exception (or a KeyboardInterrupt) in a stage's forward or in a
recomputation during backward, or a forward dropped without backward, leaves
no activation and no ``Run`` alive, and the next step is exactly plain PyTorch's.
Also ``backward(retain_graph=True)`` twice, and random chains with a random
fault under every budget (the deep property of HYPOTHESIS_PROFILE=deep)."""

import copy
import gc
import sys
import weakref

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

import remat
from chains import IMG_KINDS, SEQ_KINDS, make_stage, tracked_runs
from remat.runtime.recompute import replaying
from remat.solver.schedule import Fall, simulate
from remat.solver.solve import store_all

_chain_module = sys.modules["remat.runtime.chain_call"]
D = 8
# weak references to the storage of every activation a stage made (forward or recompute)
_made = []


class Faulty(nn.Module):
    """A stage around a chains.py body that raises ``fault = (phase, exception type)``:
    phase "forward" when run plainly, "recompute" when remat recomputes it."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.fault = None

    @remat.stage
    def forward(self, x, mask=None):
        if self.fault is not None:
            phase, exc = self.fault
            if (phase == "recompute") == replaying():
                raise exc(f"injected into a {phase}")
        out = self.body(x, mask)
        _made.append(weakref.ref(out.untyped_storage()))
        return out


class Model(nn.Module):
    def __init__(self, kinds, image=False):
        super().__init__()
        self.shared = nn.Linear(D, D)
        self.stages = nn.ModuleList(Faulty(make_stage(k, D, 0.25, self.shared)) for k in kinds)
        self.image = image
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


def _batch(model, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (4, D, 6, 6) if model.image else (4, 6, D)
    x = torch.randn(shape, generator=g, requires_grad=True)
    target = torch.randn(shape, generator=g)
    return x, torch.full((6, 6), float("-inf")).triu(1), target


def _loss(model, seed):
    torch.manual_seed(seed)
    x, mask, target = _batch(model, seed)
    return x, (model(x, mask) * target).sum()


def _step(model, seed):
    """One backward; returns loss, input grad, parameter grads, buffers (grads zeroed after)."""
    x, loss = _loss(model, seed)
    loss.backward()
    out = [loss.detach(), x.grad] + [p.grad for p in model.parameters() if p.grad is not None]
    out += [b.clone() for b in model.buffers()]
    model.zero_grad(set_to_none=True)
    return out


def _assert_equal(ref, got):
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"item {i}: {m}")


def _budget(model, fraction, algorithm="optimal"):
    """``fraction`` of the way from the chain's least budget to store-all, at least
    what ``algorithm`` needs and the least budget (a first call may need more than
    storing everything does: a single BatchNorm stage, 68 bytes more)."""
    probe = copy.deepcopy(model)
    probe.budget, probe.algorithm = 2**50, "store_all"
    _step(probe, 0)
    costs = remat.explain().costs
    low, high = remat.explain().least_budget, simulate(costs, store_all(costs.length)).peak
    return max(int(low + fraction * max(0, high - low)), low, remat.solve(costs, 2**50, algorithm).peak
               if algorithm != "optimal" else low)


pytestmark = pytest.mark.usefixtures("one_thread")   # (tests/conftest.py)


@pytest.fixture
def runs(monkeypatch):
    """Every ``Run`` the chains make, weakly."""
    made = tracked_runs(monkeypatch)
    _made.clear()
    yield made
    _made.clear()


def _assert_nothing_left(runs):
    """No activation storage and no Run is alive once garbage is collected."""
    gc.collect()
    alive = [i for i, r in enumerate(_made) if r() is not None]
    assert not alive, f"{len(alive)} of {len(_made)} activations still alive"
    assert len(runs) == 0, f"{len(runs)} remat Run objects still alive"
    _made.clear()


def _fail(model, seed, backward):
    """Run a step that must raise; return (exception type, message); keep no reference."""
    try:
        x, loss = _loss(model, seed)
        if backward:
            loss.backward()
    except BaseException as exc:  # noqa: B036 - KeyboardInterrupt is one of the faults
        return type(exc), str(exc)
    raise AssertionError("the injected fault did not raise")


def _pair(kinds=("mlp", "attn", "bn", "dropout", "mlp", "ln"), fraction=0.0, algorithm="optimal"):
    torch.manual_seed(0)
    plain = Model(list(kinds))
    net = copy.deepcopy(plain)
    net.budget, net.algorithm = _budget(plain, fraction, algorithm), algorithm
    return plain, net


FAULTS = [ValueError, KeyboardInterrupt]


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("measured", [False, True], ids=["measuring-call", "scheduled-call"])
@pytest.mark.parametrize("k", [0, 3, 5])
def test_fault_in_forward(runs, exc, measured, k):
    """A stage raising in the forward reaches the caller unchanged, leaves nothing alive,
    and the next steps equal plain PyTorch's (which met the same fault)."""
    plain, net = _pair()
    if measured:
        _assert_equal(_step(plain, 1), _step(net, 1))
    for m in (plain, net):
        m.stages[k].fault = ("forward", exc)
    assert _fail(plain, 2, False)[0] is exc
    kind, message = _fail(net, 2, False)
    assert kind is exc and "injected" in message
    _assert_nothing_left(runs)
    for m in (plain, net):
        m.stages[k].fault = None
    for seed in (3, 4):
        _assert_equal(_step(plain, seed), _step(net, seed))


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("measured", [False, True], ids=["measuring-call", "scheduled-call"])
@pytest.mark.parametrize("algorithm", ["optimal", "min_memory"])
def test_fault_in_recomputation(runs, exc, measured, algorithm):
    """A stage raising while recomputed in backward raises (a ValueError as remat's
    StageError, a KeyboardInterrupt as itself), leaves nothing alive, and the next steps
    equal plain PyTorch's (whose faulty step ran its forward only)."""
    plain, net = _pair(algorithm=algorithm)
    if measured:
        # two calls: the first one's backward may change the plan (remat/measure/chain_record.py
        # Note [The chain's output]); the second shows the one the next call runs
        for seed in (1, 5):
            _assert_equal(_step(plain, seed), _step(net, seed))
        modes = remat.explain().schedule.forward_modes()
        k = max(i for i, m in enumerate(modes) if m is not Fall)   # recomputed in backward
    else:
        k = 4   # the measuring call keeps saved tensors while they fit the budget: the last ones go
    net.stages[k].fault = ("recompute", exc)
    kind, message = _fail(net, 2, True)
    if exc is KeyboardInterrupt:
        assert kind is KeyboardInterrupt
    else:
        assert issubclass(kind, remat.StageError)
        assert f"stage {k + 1} " in message and "recomputed during backward" in message
    _loss(plain, 2)                                        # the same forward, dropped
    net.zero_grad(set_to_none=True)                        # what the failed backward accumulated
    _assert_nothing_left(runs)
    net.stages[k].fault = None
    for seed in (3, 4):
        _assert_equal(_step(plain, seed), _step(net, seed))


@pytest.mark.parametrize("measured", [False, True], ids=["measuring-call", "scheduled-call"])
def test_forward_dropped_without_backward(runs, measured):
    """A forward whose result is dropped without backward frees every activation and its Run;
    the next steps equal plain PyTorch's."""
    plain, net = _pair(fraction=0.3)
    if measured:
        _assert_equal(_step(plain, 1), _step(net, 1))
    for m in (plain, net):
        x, loss = _loss(m, 2)
    # alive while held (the measuring call may hold no activation: its backward rebuilds them)
    assert len(runs) >= 1 and (not measured or any(r() is not None for r in _made))
    del x, loss
    _assert_nothing_left(runs)
    for seed in (3, 4):
        _assert_equal(_step(plain, seed), _step(net, seed))


def test_steps_leave_nothing_alive(runs):
    """After full training steps (measuring and scheduled) nothing of the chain is alive."""
    plain, net = _pair(fraction=0.2)
    for seed in (1, 2):
        _assert_equal(_step(plain, seed), _step(net, seed))
    _assert_nothing_left(runs)


@pytest.mark.parametrize("measured", [False, True], ids=["measuring-call", "scheduled-call"])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_retain_graph_twice(measured, fraction):
    """backward(retain_graph=True) then backward again accumulates plain PyTorch's gradients."""
    plain, net = _pair(fraction=fraction)
    if measured:
        _assert_equal(_step(plain, 1), _step(net, 1))
    got = []
    for m in (plain, net):
        x, loss = _loss(m, 2)
        loss.backward(retain_graph=True)
        first = [x.grad.clone()] + [p.grad.clone() for p in m.parameters() if p.grad is not None]
        loss.backward()
        second = [x.grad] + [p.grad for p in m.parameters() if p.grad is not None]
        got.append(first + second)
        m.zero_grad(set_to_none=True)
    _assert_equal(*got)
    _assert_equal(_step(plain, 3), _step(net, 3))


# the deep property -------------------------------------------------------

def _saves_something(stage):
    """Whether the measuring call saw autograd save tensors for ``stage``."""
    cache = _chain_module._cache
    for entry in cache.values():
        for record in entry.stages:
            if record.ident() is stage:
                return bool(record.meta)
    raise AssertionError("the stage is in no cached chain")


@st.composite
def faulty_chains(draw):
    image = draw(st.booleans())
    kinds = draw(st.lists(st.sampled_from(IMG_KINDS if image else SEQ_KINDS), min_size=1, max_size=10))
    fault = draw(st.sampled_from([None, "forward", "recompute"]))
    where = draw(st.integers(0, len(kinds) - 1))
    return kinds, image, fault, where


@given(faulty_chains(), st.floats(0, 1), st.sampled_from(["optimal", "optimal", "min_memory", "sqrt"]))
def test_random_chain_budget_and_fault(chain, fraction, algorithm):
    """For a random chain, budget and algorithm, with or without a fault injected into one
    stage's forward or recomputation of the second step, every step around it gives plain
    PyTorch's gradients and buffers bitwise, and nothing is left alive."""
    kinds, image, fault, where = chain
    torch.manual_seed(0)
    plain = Model(kinds, image=image)
    net = copy.deepcopy(plain)
    net.budget = _budget(plain, fraction, algorithm)
    net.algorithm = algorithm
    _made.clear()
    _assert_equal(_step(plain, 1), _step(net, 1))
    if fault is not None:
        net.stages[where].fault = (fault, ValueError)
        if fault == "forward":
            plain.stages[where].fault = (fault, ValueError)
        try:
            _loss(plain, 2)
        except ValueError:
            pass
        loss = None
        recomputed = False
        try:
            _, loss = _loss(net, 2)
            # this call's schedule (the first call's backward may have changed the
            # plan: remat/measure/chain_record.py Note [The chain's output])
            recomputed = fault == "recompute" and remat.explain().schedule.forward_modes()[where] is not Fall
            loss.backward()
            raised = None
        except (ValueError, remat.StageError) as exc:
            raised = type(exc)
        if fault == "forward":
            assert raised is ValueError
        elif recomputed and _saves_something(net.stages[where]):
            assert raised is remat.StageError
        elif recomputed:
            # a stage autograd saves nothing of is rebuilt only as the input of
            # another rebuild, and not at all once its backward has run
            assert raised in (None, remat.StageError)
        else:
            assert raised is None
        del loss
        net.stages[where].fault = plain.stages[where].fault = None
        net.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in _made)
    for seed in (3, 4):
        _assert_equal(_step(plain, seed), _step(net, seed))


@pytest.mark.parametrize("algorithm", ["optimal", "min_memory"])
@pytest.mark.parametrize("measured", [False, True], ids=["measuring-call", "scheduled-call"])
def test_backward_in_inference_mode(measured, algorithm):
    """Plain PyTorch runs a backward under ``torch.inference_mode()``; so does a chain:
    its recomputations leave inference mode to record and to make tensors that have
    version counters (a raw "Inference tensors do not track version counter", or a
    false RecomputeMismatchError, before; and for a recording recomputation, whose
    input's view was made in inference mode, now and then with the optimal
    schedule, whose recomputations depend on the measured times: min_memory
    recomputes every stage)."""
    plain, net = _pair(algorithm=algorithm)
    if measured:
        _step(net, 9)
        _step(plain, 9)
    for seed in range(2):
        grads = []
        for model in (plain, net):
            x, loss = _loss(model, seed)
            with torch.inference_mode():
                loss.backward()
            grads.append([x.grad] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
            model.zero_grad(set_to_none=True)
        _assert_equal(*grads)
    assert remat.explain().schedule.recomputations() > 0


def test_backward_with_saved_tensor_hooks_disabled():
    """A backward under ``disable_saved_tensors_hooks`` cannot recompute (remat collects
    a recomputation's saved tensors through those hooks): a StageError naming the
    stage and the context, not the context's bare RuntimeError; the next step is exact."""
    plain, net = _pair()
    _step(net, 0)
    _step(plain, 0)
    _loss(plain, 1)   # (the failed step's forward moved BatchNorm statistics: so does plain's)
    _, loss = _loss(net, 1)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this region"):
        with pytest.raises(remat.StageError, match="saved-tensor hooks are disabled.*no hooks in this region"):
            loss.backward()
    del loss
    net.zero_grad(set_to_none=True)
    _assert_equal(_step(plain, 2), _step(net, 2))
