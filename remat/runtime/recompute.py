"""Running a stage again in the backward (Note [The life of a saved tensor] 4-5,
remat/runtime/executor.py): on a detached copy of its input, with the state its
forward ran with put back (``Replay``: its RNG streams, autocast and in-place
state, captured by remat/runtime/replay.py, and its parameters and buffers in
their slots), outside the engine's vmap and inference mode, recording or not,
and what a recording recomputation saved checked against the forward.

A stage's ``slots`` are the (dict, name) pairs of its module and submodules
(``_parameters``, ``_buffers``, ``__dict__``) where its parameters, buffers and
plain tensor attributes live; each call takes the tensors found there as it
runs the stage (``take``), the checks of Note [Chain keys] (remat/chain.py)
compare them with those of the chain's record, and a recomputation puts them
back where they were replaced since (``ForwardTensors``, Note [Replaying a
stage] 5 in remat/runtime/replay.py).
"""

import contextlib
import itertools
import operator
import threading
import weakref

import torch
from torch.nn.parameter import is_lazy
from torch.utils._pytree import tree_leaves

from ..errors import RecomputeMismatchError, StageError
from .replay import RngState, check_saved, copy_all, restore_tensors

__all__ = ["hooks_disabled", "record_again", "replaying", "run_again", "Replay", "NO_SLOTS", "module_slots", "take", "take_slots",
           "state_plan", "resolve_state", "ForwardTensors"]

_local = threading.local()


def replaying():
    """True while remat recomputes a stage on this thread (stages run plainly)."""
    return getattr(_local, "replaying", False)


def run_again(call, x, grad, autocast, within=None):
    """Stage ``call`` run again on ``x`` (its input, held or rebuilt), its RNG,
    autocast (``autocast``, the chain's) and in-place state replayed: recording
    (``grad``; inside ``within``, if given, the stage's own call alone), its
    output returned as it comes; else its output detached."""
    if call.side:
        call.check_side()
    _local.replaying = True
    try:
        with _outside_vmap(), _outside_inference(), Replay(call, autocast):
            if grad:
                if within is None:
                    return call.activation(x)
                with within:
                    return call.activation(x)
            leaf = None
            if x.is_leaf and x.requires_grad:   # (the chain's own input: record_again)
                x = x.detach()
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


def record_again(call, x, autocast, within=None):
    """Stage ``call`` run again on ``x``, recording (``Fall`` in the backward
    phase): (its output, detached; what autograd saved, as the forward phase's
    pack hook would have seen it), checked against what its forward saved.
    ``within``: a context to run it in (an option's: remat/runtime/option_modes.py)."""
    saved = []
    made = []   # as saved, for a stage that backwards its own graph inside its forward

    def pack(t):
        saved.append(t.detach() if t.requires_grad else t)
        made.append(t)
        return len(made) - 1

    state = call.autocast if call.autocast is not None else autocast
    if x.is_leaf and x.requires_grad and state is not None and not state.off and state.current():
        # (the chain's input, a leaf needing grad, in a backward inside the autocast block: the
        # cast its forward made is in autocast's cache, which every thread shares, and so taken
        # again; on a view of a copy, as below, the stage would make another to hold)
        leaf = None
        inp = x
    else:
        leaf = x.detach().requires_grad_(call.input_requires_grad)
        inp = _handle(leaf)
    _check_hooks(call)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, made.__getitem__):
            out = run_again(call, inp, True, autocast, within)
    finally:
        made.clear()   # (the recomputed graph holds its hooks: no cycle through it)
    out = out.detach()
    if leaf is not None:
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


def uncached(leaf, autocast):
    """What a stage run again on ``leaf``, a detached copy of its input, in the autocast
    state ``autocast`` (an ``AutocastState`` or None) is handed: under autocast a view
    of ``leaf`` where it needs grad, as ``_handle`` gives, since autocast caches its
    cast of a leaf needing grad to the end of the autocast block (a first call's run 4
    kept one such cast per stage measured again: 5% over the budget on three bf16
    stages); else ``leaf`` itself."""
    return _handle(leaf) if autocast is not None and not autocast.off else leaf


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


class Replay:
    """Context: the RNG streams, autocast state and in-place state of one stage's
    call (a ``StageCall``) for a run of it again (the Note, 1-3)."""

    __slots__ = ("call", "autocast", "_tensors", "_rng", "_cast", "_state")

    def __init__(self, call, autocast):
        self.call = call
        self.autocast = call.autocast if call.autocast is not None else autocast
        self._tensors = self._rng = self._cast = self._state = None

    def __enter__(self):
        call = self.call
        try:
            if call.tensors is not None:   # first: it may raise before anything changed
                self._tensors = ForwardTensors(call).__enter__()
            if call.rng is not None:
                self._rng = call.rng.enter()
            if self.autocast is not None and not self.autocast.current():
                cast = self.autocast.context()
                cast.__enter__()
                self._cast = cast
            if call.state:
                self._state = restore_tensors(call.state).__enter__()
                if call.before is not None:   # Note 3: start from the values the first forward found
                    pairs = [(t, b) for t, b in zip(call.state, call.before) if b is not None]
                    if pairs:
                        with torch.no_grad():
                            copy_all([t for t, _ in pairs], [b for _, b in pairs])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        # in the reverse order of ``__enter__``, each undone even if one before raises
        try:
            if self._state is not None:
                self._state.__exit__(None, None, None)
        finally:
            try:
                if self._cast is not None:
                    self._cast.__exit__(None, None, None)
            finally:
                try:
                    if self._rng is not None:
                        RngState.leave(self._rng)
                finally:
                    if self._tensors is not None:
                        self._tensors.__exit__(None, None, None)
        return False


# A stage's slots (Note [Replaying a stage] 5) ---------------------------------------------------

NO_SLOTS = ((), 0, ())
_GONE = object()   # a slot's name no longer in its dict


def module_slots(ident):
    """Note [Replaying a stage] 5: ``(slots, n, names)`` for stage object ``ident``: the (dict, name) of
    each parameter (the first ``n``), buffer and plain tensor attribute of a module
    and its submodules, and their dotted names; ``NO_SLOTS`` for a function."""
    if not isinstance(ident, torch.nn.Module):
        return NO_SLOTS
    params, buffers = [], []
    for prefix, m in ident.named_modules():
        dot = prefix + "." if prefix else ""
        params += [(m._parameters, name, dot + name) for name in m._parameters]
        buffers += [(m._buffers, name, dot + name) for name in m._buffers]
        attrs = m.__dict__
        buffers += [(attrs, name, dot + name) for name, v in attrs.items() if isinstance(v, torch.Tensor)]
    both = params + buffers
    return tuple((d, name) for d, name, _ in both), len(params), tuple(full for _, _, full in both)


def take(slots):
    """The tensors in ``slots`` now (None where a slot is empty or gone)."""
    try:
        return list(itertools.starmap(dict.get, slots))
    except TypeError:   # (a module whose parameters live in a mapping that is no dict)
        return [d.get(name) for d, name in slots]


def state_plan(state, tensors, call=None):
    """How to find each tensor of ``state`` on later calls: the index among
    ``tensors`` (the call's ``take``) of the slot whose tensor it is or shares its
    storage with (a stage may write a buffer through an alias it makes, which dies
    with the call: ``buf.view(-1).mul_()``, instance norm's running statistics,
    an embedding's ``max_norm`` renormalising ``weight.detach()``), or else
    ("arg", j): the j-th tensor argument of ``call`` it shares storage with (a side
    input the stage writes, made anew each call), or else a weak reference to it or
    to the tensor it is a view of."""
    at = {id(t): i for i, t in enumerate(tensors) if t is not None}
    shared = {t.untyped_storage()._cdata: i for i, t in enumerate(tensors)
              if t is not None and t.layout == torch.strided}
    given = {t.untyped_storage()._cdata: ("arg", j) for j, t in enumerate(_tensor_args(call) if call else ())
             if t.layout == torch.strided}
    plan = []
    for t in state:
        i = at.get(id(t))
        if i is None and t.layout == torch.strided:
            i = shared.get(key := t.untyped_storage()._cdata, given.get(key))
        if i is None:
            while t._base is not None:
                t = t._base
            plan.append(weakref.ref(t))
        elif i not in plan:
            plan.append(i)
    return plan


def resolve_state(plan, tensors, call=None):
    """The state tensors of ``call`` from ``state_plan``'s list (dead ones left out)."""
    args = _tensor_args(call) if any(type(p) is tuple for p in plan) else ()
    out = [tensors[p] if type(p) is int else args[p[1]] if type(p) is tuple else p() for p in plan]
    return [t for t in out if t is not None]


def _tensor_args(call):
    return [t for t in tree_leaves((call.args, call.kwargs)) if isinstance(t, torch.Tensor)]


class ForwardTensors:
    """Note [Replaying a stage] 5: for a recomputation of ``call``, the parameters and buffers its
    forward used in their slots, and a check that none changed in place."""

    __slots__ = ("call", "swapped")

    def __init__(self, call):
        self.call = call
        self.swapped = None

    def __enter__(self):
        call = self.call
        slots, n, names = call.slots
        versions = call.versions
        if versions is None:   # (measuring the stage's own forward: nothing to check yet)
            n = 0
        tensors = call.tensors
        self.swapped = None
        if all(map(operator.is_, take(slots), tensors)):   # (every tensor still in its slot)
            if n and [-1 if t is None else t._version for t in tensors[:n]] != versions:
                self._changed(n)
            return self
        swapped, changed = None, False
        for j, ((d, name), t) in enumerate(zip(slots, tensors)):
            now = d.get(name, _GONE)
            if now is t or (t is None and now is _GONE):
                if j < n and t is not None and t._version != versions[j]:
                    changed = True
                continue
            if t is not None and t.layout == torch.strided and t.untyped_storage().nbytes() == 0 and t.numel():
                continue   # its memory freed since: FSDP's resharding, which puts it back before B(i)
            if swapped is None:
                swapped = []
            swapped.append((d, name, now))
            d[name] = t
        self.swapped = swapped
        if changed:
            self.__exit__(None, None, None)
            self.swapped = None
            self._changed(n)
        return self

    def _changed(self, n):
        """Raise for the first of the first ``n`` tensors (parameters) still in its
        slot whose version counter moved since the forward."""
        call = self.call
        slots, _, names = call.slots
        for j, ((d, name), t) in enumerate(zip(slots[:n], call.tensors)):
            if t is not None and d.get(name, _GONE) is t and t._version != call.versions[j]:
                raise StageError(
                    f"remat: parameter {names[j]!r} of stage {call.index} ({call.name}) was modified in "
                    f"place between the forward and the backward; remat recomputes the stage in the "
                    f"backward from the values its forward used, and those are gone. Change parameters "
                    f"after the backward (optimizer.step() after loss.backward()), or out of place")

    def __exit__(self, *exc):
        if self.swapped:
            for d, name, now in reversed(self.swapped):
                if now is _GONE:
                    d.pop(name, None)
                else:
                    d[name] = now
        return False


def take_slots(call, ident):
    """A stage measured: its module's slots and the tensors in them (lazy ones refused)."""
    call.slots = module_slots(ident)
    call.tensors = take(call.slots[0]) if call.slots[0] else None
    if call.tensors and any(is_lazy(t) for t in call.tensors if t is not None):
        raise StageError(
            f"remat: stage {call.index} ({call.name}) has lazy parameters or buffers not initialized yet "
            f"(nn.LazyLinear, ...), which remat cannot measure; run the model once first, e.g. "
            f"under torch.no_grad() (the dry run PyTorch asks for before building an optimizer)")
