"""Running a stage again in the backward (Note [The life of a saved tensor] 4-5,
remat/runtime/executor.py): on a detached copy of its input, its state replayed
(remat/runtime/replay.py), outside the engine's vmap and inference mode, recording
or not, and what a recording recomputation saved checked against the forward.
"""

import contextlib
import threading

import torch

from ..errors import RecomputeMismatchError, StageError
from .replay import Replay, check_saved

__all__ = ["hooks_disabled", "record_again", "replaying", "run_again"]

_local = threading.local()


def replaying():
    """True while remat recomputes a stage on this thread (stages run plainly)."""
    return getattr(_local, "replaying", False)


def run_again(call, x, grad, autocast):
    """Stage ``call`` run again on ``x`` (its input, held or rebuilt), its RNG,
    autocast (``autocast``, the chain's) and in-place state replayed: recording
    (``grad``), its output returned as it comes; else its output detached."""
    if call.side:
        call.check_side()
    _local.replaying = True
    try:
        with _outside_vmap(), _outside_inference(), Replay(call, autocast):
            if grad:
                return call.activation(x)
            leaf = None
            if call.input_requires_grad and not x.requires_grad:
                # (as its forward had it: a stage may differentiate by it)
                leaf = x.detach().requires_grad_()
                x = _handle(leaf)
            if call.grad_replay:
                _check_hooks(call)
                made = []   # (read only by a stage backwarding its own graph inside its forward)
                try:
                    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                            lambda t: made.append(t) or len(made) - 1, made.__getitem__):
                        out = call.activation(x).detach()
                finally:
                    made.clear()
                if leaf is not None:
                    _let_go(leaf)
                return out
            with torch.no_grad():
                return call.activation(x).detach()
    except (StageError, RecomputeMismatchError):
        raise
    except Exception as exc:
        raise StageError(
            f"remat: stage {call.index} ({call.name}) raised {type(exc).__name__} while being "
            f"recomputed during backward: {exc}. It ran in the forward pass: make the stage a "
            f"pure function of its inputs, parameters and RNG"
        ) from exc
    finally:
        _local.replaying = False


def record_again(call, x, autocast):
    """Stage ``call`` run again on ``x``, recording (``Fall`` in the backward
    phase): (its output, detached; what autograd saved, as the forward phase's
    pack hook would have seen it), checked against what its forward saved."""
    saved = []
    made = []   # as saved, for a stage that backwards its own graph inside its forward

    def pack(t):
        saved.append(t.detach() if t.requires_grad else t)
        made.append(t)
        return len(made) - 1

    leaf = x.detach().requires_grad_(call.input_requires_grad)
    inp = _handle(leaf)
    _check_hooks(call)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, made.__getitem__):
            out = run_again(call, inp, True, autocast)
    finally:
        made.clear()   # (the recomputed graph holds its hooks: no cycle through it)
    out = out.detach()
    _let_go(leaf)
    check_saved(call, saved)
    return out, saved


def _handle(leaf):
    """What a recomputation that records is run on, given ``leaf``, a detached copy
    of its input: ``leaf`` itself, or where it needs grad a view of it, which
    ``_let_go`` leaves whole."""
    if not leaf.requires_grad:
        return leaf
    # (recomputations run inside the engine, grad mode off, maybe in inference mode)
    with torch.enable_grad(), _outside_inference():
        return leaf.view_as(leaf)


def _let_go(leaf):
    """The recomputed graph's AccumulateGrad holds ``leaf``: a tensor of that graph
    kept past B(i) (attention maps a hook collects) would keep a^(i-1) with it.
    ``leaf`` lets go of its storage; what the stage kept of its input (the view
    ``_handle`` gave it, saved tensors, detached) keeps it as long as it must."""
    if leaf.requires_grad:
        with _outside_inference():
            leaf.data = leaf.data.new_empty(0)


@contextlib.contextmanager
def _outside_vmap():
    """Leave the vmap of a batched backward (``is_grads_batched=True``) while a
    recomputation runs: its inputs and outputs are plain tensors, and under that
    vmap random ops (dropout) are refused."""
    inc = getattr(torch._C, "_vmapmode_increment_nesting", None)
    if inc is None:
        yield
        return
    dec = torch._C._vmapmode_decrement_nesting
    level = inc() - 1
    dec()
    for _ in range(level):
        dec()
    try:
        yield
    finally:
        for _ in range(level):
            inc()


def _outside_inference():
    """A backward run under ``torch.inference_mode()`` (plain PyTorch allows it)
    still needs a recomputation to record and to make tensors with version counters."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def hooks_disabled():
    """The message ``disable_saved_tensors_hooks`` was given, where it is in force
    (remat drops and recomputes saved tensors through those hooks), else None."""
    autograd = torch._C._autograd
    if hasattr(autograd, "_saved_tensors_hooks_is_enabled") and not autograd._saved_tensors_hooks_is_enabled():
        return autograd._saved_tensors_hooks_get_disabled_error_message()
    return None


def _check_hooks(call):
    """A recomputation collects saved tensors through saved-tensor hooks: a backward
    run under ``disable_saved_tensors_hooks`` cannot have one."""
    why = hooks_disabled()
    if why is not None:
        raise StageError(
            f"remat: stage {call.index} ({call.name}) must be recomputed in this backward, which runs where "
            f"saved-tensor hooks are disabled (by torch.autograd.graph.disable_saved_tensors_hooks: {why!r}); "
            f"remat recomputes saved tensors through those hooks. Run the backward outside that context, "
            f"or give the chain a budget that stores every stage")
