"""Unit tests of remat/runtime/replay.py (Note [Replaying a stage] 1-3 and 5), one
piece at a time and without a chain: RNG capture and replay, autocast capture,
``restore_tensors``, ``snapshot`` and ``Replay`` around one hand-made stage call."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, strategies as st

from remat.errors import StageError
from remat.runtime.recompute import Replay
from remat.runtime.replay import capture_autocast, capture_rng, restore_tensors, snapshot
from remat.runtime.stage_call import StageCall
from remat.runtime.recompute import module_slots, take

SEEDS = st.integers(0, 2**32 - 1)


def _mask(shape=(64,), p=0.5):
    """A dropout mask drawn from the CPU generator (dropout of ones: 0 or 1/(1-p))."""
    return F.dropout(torch.ones(shape), p=p, training=True)


# RNG (Note 1) ------------------------------------------------------------------------------


@given(seed=SEEDS, p=st.floats(0.1, 0.9))
def test_replayed_rng_draws_the_first_dropout_mask_bitwise(seed, p):
    """Under ``replayed()`` dropout draws bitwise the mask it drew right after the capture."""
    torch.manual_seed(seed)
    rng = capture_rng()
    first = _mask(p=p)
    _mask(p=p)   # the program draws on
    with rng.replayed():
        again = _mask(p=p)
    assert torch.equal(first, again)


@given(seed=SEEDS)
def test_replayed_rng_leaves_the_global_stream_where_it_would_be(seed):
    """After ``replayed()`` the CPU stream is where it was before it, so the next draw
    is the one the program would have made without the replay."""
    torch.manual_seed(seed)
    rng = capture_rng()
    _mask()
    state = torch.get_rng_state()
    expected = torch.rand(8)
    torch.set_rng_state(state)
    with rng.replayed():
        _mask()
        _mask()   # the body may draw more than the first forward did
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(8), expected)


def test_replayed_rng_puts_the_stream_back_when_the_body_raises():
    """An exception inside ``replayed()`` propagates and the CPU stream is still put back."""
    torch.manual_seed(3)
    rng = capture_rng()
    torch.rand(4)
    state = torch.get_rng_state()
    with pytest.raises(KeyError):
        with rng.replayed():
            torch.rand(4)
            raise KeyError("in the stage")
    assert torch.equal(torch.get_rng_state(), state)


@given(seed=SEEDS)
def test_replayed_rng_replays_a_stage_own_generator(seed):
    """A ``torch.Generator`` given to ``capture_rng`` replays its first draw and is left
    where it was, and the CPU generator, not drawn from, is left alone too."""
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(seed)
    rng = capture_rng(generators=[g])
    first = torch.rand(16, generator=g)
    g_state, cpu_state = g.get_state(), torch.get_rng_state()
    with rng.replayed():
        again = torch.rand(16, generator=g)
    assert torch.equal(first, again)
    assert torch.equal(g.get_state(), g_state)
    assert torch.equal(torch.get_rng_state(), cpu_state)


def test_changed_tells_whether_a_stream_was_drawn_from():
    """``changed()`` is False right after the capture and True once the CPU stream or a
    captured generator has been drawn from."""
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    rng = capture_rng(generators=[g])
    assert not rng.changed()
    torch.rand(1, generator=g)
    assert rng.changed()
    rng = capture_rng()
    assert not rng.changed()
    torch.rand(1)
    assert rng.changed()


# Autocast (Note 2) -------------------------------------------------------------------------


def test_autocast_captured_outside_autocast_is_off_and_current():
    """Outside autocast the captured state is ``off`` and is the current one."""
    state = capture_autocast()
    assert state.off
    assert state.current()


def test_autocast_captured_inside_autocast_is_entered_again_by_its_context():
    """A state captured inside CPU bfloat16 autocast is not current outside it, and its
    ``context()`` brings it back (a matmul then gives bfloat16) until it exits."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = capture_autocast()
    assert not state.off
    assert not state.current()
    a = torch.randn(4, 4)
    with state.context():
        assert state.current()
        assert (a @ a).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    assert (a @ a).dtype == torch.float32


def test_capture_autocast_hands_back_like_only_when_the_state_is_the_same():
    """``capture_autocast(like)`` returns ``like`` itself for the same state, and a new,
    unequal state once autocast is entered; captures of one state are equal and hash alike."""
    like = capture_autocast()
    assert capture_autocast(like) is like
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = capture_autocast(like)
        twin = capture_autocast()
        assert capture_autocast(inside) is inside
    assert inside is not like and inside != like
    assert inside == twin and hash(inside) == hash(twin)


# restore_tensors and snapshot (Note 3) -----------------------------------------------------


@given(seed=SEEDS, count=st.integers(1, 4), writes=st.lists(st.sampled_from(["mul", "add", "zero", "fill"]),
                                                            min_size=1, max_size=4))
def test_restore_tensors_puts_in_place_writes_back(seed, count, writes):
    """Whatever the body writes in place, the tensors have their old values and version
    counters again after ``restore_tensors``, and stay the same objects."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(3, generator=g) for _ in range(count)]
    values = [t.clone() for t in tensors]
    versions = [t._version for t in tensors]
    ids = [id(t) for t in tensors]
    with restore_tensors(tensors):
        for t in tensors:
            for w in writes:
                {"mul": lambda: t.mul_(3), "add": lambda: t.add_(1), "zero": t.zero_,
                 "fill": lambda: t.fill_(7)}[w]()
        assert not all(torch.equal(t, v) for t, v in zip(tensors, values))
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))
    assert [t._version for t in tensors] == versions
    assert [id(t) for t in tensors] == ids


def test_restore_tensors_undoes_a_batchnorm_forward():
    """A training BatchNorm forward inside ``restore_tensors`` of its buffers leaves
    running statistics and ``num_batches_tracked`` as they were, versions included."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    bn(torch.randn(8, 4))   # statistics that are not the initial ones
    before = {k: v.clone() for k, v in bn.named_buffers()}
    versions = {k: v._version for k, v in bn.named_buffers()}
    with restore_tensors(bn.buffers()):
        bn(torch.randn(8, 4) * 3 + 1)
        assert not torch.equal(bn.running_mean, before["running_mean"])
    for k, v in bn.named_buffers():
        assert torch.equal(v, before[k]), k
        assert v._version == versions[k], k


def test_restore_tensors_puts_writes_back_when_the_body_raises():
    """An exception in the body propagates and the written tensor is put back anyway."""
    t = torch.arange(4.0)
    with pytest.raises(RuntimeError):
        with restore_tensors([t]):
            t.mul_(10)
            raise RuntimeError("recomputation failed")
    assert torch.equal(t, torch.arange(4.0))


@given(seed=SEEDS)
def test_snapshot_copies_are_detached_and_independent(seed):
    """``snapshot`` gives detached copies, None kept for None, that later in-place writes
    to the originals do not reach."""
    g = torch.Generator().manual_seed(seed)
    leaf = torch.randn(5, generator=g, requires_grad=True)
    buf = torch.randn(2, 3, generator=g)
    values = buf.clone(), leaf.detach().clone()
    copies = snapshot([buf, None, leaf])
    assert copies[1] is None
    with torch.no_grad():
        buf.add_(1)
        leaf.mul_(2)
    assert torch.equal(copies[0], values[0]) and torch.equal(copies[2], values[1])
    assert not copies[2].requires_grad and copies[2].grad_fn is None
    assert copies[0].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()


# Replay around one hand-made stage call -----------------------------------------------------


class Ema(nn.Module):
    """A stage that reads a buffer it then updates in place (its output depends on it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        y = self.lin(x) + self.avg
        with torch.no_grad():
            self.avg.mul_(0.5).add_(y.mean(0))
        return y


def _first_forward(module, x, state=(), reads_state=False, autocast=None):
    """Run ``module`` on ``x`` as a chain's first forward of a stage does: capture what a
    recomputation replays (RNG, slots and their tensors, state and, where the stage
    reads it, its values before), run, seal; return (call, output)."""
    call = StageCall(0, type(module).__name__, module, (None,), {}, 0, None, x.requires_grad)
    call.slots = module_slots(module)
    call.tensors = take(call.slots[0])
    call.rng = capture_rng()
    call.state = list(state)
    call.autocast = autocast
    if reads_state:
        call.before = snapshot(call.state)
    out = module(x)
    call.seal()
    return call, out


def _dropout_bn_stage():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 4)).train()


@given(seed=SEEDS)
def test_replay_reruns_a_stage_bitwise(seed):
    """A stage with dropout and BatchNorm run again under ``Replay`` gives its first
    forward's output bitwise, though the program drew random numbers in between."""
    stage = _dropout_bn_stage()
    torch.manual_seed(seed)
    x = torch.randn(8, 4)
    call, first = _first_forward(stage, x, state=list(stage[1].buffers()))
    torch.rand(100)
    with Replay(call, capture_autocast()):
        again = call.activation(x)
    assert torch.equal(first, again)


def test_replay_leaves_state_and_rng_as_the_forward_left_them():
    """After a run under ``Replay`` the BatchNorm buffers (values and versions) and the
    CPU stream are as they were before it: one step updates the statistics once."""
    stage = _dropout_bn_stage()
    x = torch.randn(8, 4)
    call, _ = _first_forward(stage, x, state=list(stage[1].buffers()))
    buffers = [b.clone() for b in stage[1].buffers()]
    versions = [b._version for b in stage[1].buffers()]
    rng = torch.get_rng_state()
    with Replay(call, capture_autocast()):
        call.activation(x)
    assert all(torch.equal(b, v) for b, v in zip(stage[1].buffers(), buffers))
    assert [b._version for b in stage[1].buffers()] == versions
    assert torch.equal(torch.get_rng_state(), rng)


def test_replay_starts_a_stage_reading_its_state_from_the_values_before_its_forward():
    """A stage whose output reads a buffer it updates recomputes its first output when the
    call kept the buffer's values before the forward (``before``), and not without them;
    either way the buffer is left as the forward left it."""
    torch.manual_seed(0)
    stage = Ema()
    x = torch.randn(3, 4)
    stage(x)   # a non-zero average
    call, first = _first_forward(stage, x, state=[stage.avg], reads_state=True)
    after = stage.avg.clone()
    with Replay(call, capture_autocast()):
        again = call.activation(x)
    assert torch.equal(first, again)
    assert torch.equal(stage.avg, after)
    call.before = None
    with Replay(call, capture_autocast()):
        stale = call.activation(x)
    assert not torch.equal(first, stale)
    assert torch.equal(stage.avg, after)


def test_replay_puts_the_forward_parameters_in_their_slots_for_its_length():
    """A parameter replaced after the forward (``load_state_dict(assign=True)``) is the
    forward's again inside ``Replay``, so the output is the first one, and the new one
    is back in its slot after."""
    torch.manual_seed(0)
    stage = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    call, first = _first_forward(stage, x)
    old = stage.weight
    new = {"weight": torch.randn(4, 4), "bias": stage.bias.detach().clone()}
    stage.load_state_dict(new, assign=True)
    assert stage.weight is not old
    replaced = stage.weight
    with Replay(call, capture_autocast()):
        assert stage.weight is old
        again = call.activation(x)
    assert torch.equal(first, again)
    assert stage.weight is replaced


def test_replay_refuses_a_parameter_changed_in_place_and_changes_nothing():
    """A parameter written in place since the forward is a ``StageError`` naming it, raised
    before ``Replay`` has set the RNG streams or anything else."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(2, 4)
    call, _ = _first_forward(stage, x)
    with torch.no_grad():
        stage[0].weight.add_(1)
    torch.rand(3)
    rng = torch.get_rng_state()
    with pytest.raises(StageError, match=r"parameter '0\.weight' of stage 0 \(Sequential\) was modified in place"):
        with Replay(call, capture_autocast()):
            pass
    assert torch.equal(torch.get_rng_state(), rng)


def test_replay_reenters_the_autocast_state_of_the_forward():
    """A call made under CPU bfloat16 autocast runs again under it from outside autocast,
    its output bitwise the first, and autocast is off again after."""
    torch.manual_seed(0)
    stage = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        call, first = _first_forward(stage, x, autocast=capture_autocast())
    assert first.dtype == torch.bfloat16
    with Replay(call, capture_autocast()):
        assert torch.is_autocast_enabled("cpu")
        again = call.activation(x)
    assert torch.equal(first, again)
    assert not torch.is_autocast_enabled("cpu")


def test_replay_takes_the_autocast_given_where_the_call_has_none():
    """``Replay(call, autocast)`` uses the call's own autocast state where it has one, and
    the one given otherwise."""
    stage = nn.Linear(4, 4)
    call, _ = _first_forward(stage, torch.randn(2, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        given_state = capture_autocast()
    assert Replay(call, given_state).autocast is given_state
    call.autocast = capture_autocast()
    assert Replay(call, given_state).autocast is call.autocast
