"""``remat.chain``: stage calls inside it form a chain that is measured once,
solved for the budget and then run on the schedule (DESIGN.md section 2).

Note [Chain keys]
-----------------
A chain is keyed by its call site (code object and line of the ``with``, or
the decorated function), the identity of its first stage (so two models of
one class do not share measurements), the signature of the first stage's
arguments (shape, dtype, device and requires_grad of every tensor, value of
small Python values), the first stage module's training flag and the
autocast state. A key seen before runs its schedule; a new budget re-solves
from the cached costs; a new key measures. While running, each stage is
checked against the recording (same stage object, same input shape): if the
chain takes another path, the rest of it is measured again and the
recording replaced. At most ``CACHE_SIZE`` keys are kept (least recently
used first out).
"""

import collections
import functools
import os
import sys
import threading
import weakref

import torch
from torch.utils._pytree import tree_leaves

from .budget import parse_budget, resolve_budget
from .costs_source import FIELDS, chain_costs, read_costs
from .errors import RematError, StageError
from .meter import Instrument, storage_key
from .profile import GradPool, Timer, Upstream, backward_again, instrumented_run, stage_leaves, timed_step
from .recording import Explanation, Recording, _last, explain
from .replay import capture_autocast, capture_rng, cuda_devices, restore_tensors
from .runtime import FALL, FCK, Run, StageCall, _Replay, _Saved, first, replaying
from .solve import DEFAULT_SLOTS, _parse_algorithm

__all__ = ["chain", "explain", "CACHE_SIZE", "clear_cache"]

CACHE_SIZE = 64
_local = threading.local()
_cache = collections.OrderedDict()
_cache_lock = threading.Lock()


def clear_cache():
    """Forget every recorded chain (the next call of each measures again)."""
    with _cache_lock:
        _cache.clear()


def _publish(explanation):
    _last[0] = explanation
    chain.last = explanation


def active():
    """The chain being recorded or run on this thread, or None."""
    return getattr(_local, "active", None)


class chain:
    """Stage calls inside form a chain run under a memory budget.

    Use it as a context manager around the loop that calls the stages, or
    as a decorator of a function that calls them.

    Args:
        budget: activation memory allowed, as an int of bytes, a string
            with a unit ("900MB", "1.5GiB") or "auto" (free device memory
            less 10%).
        algorithm: "optimal" (default), "store_all", "min_memory", "sqrt"
            or "periodic(k)".
        slots: memory resolution of the optimal solver.
        costs: path of a JSON file of measured costs. If it exists, the first
            call uses those costs instead of timing the stages (it still runs
            each stage once to learn what to replay); if not, the measured
            costs are written there. Under torch.distributed every rank uses
            rank 0's costs, so all ranks run the same schedule.

    Raises:
        BudgetError: malformed budget (at once), or a budget below the
            chain's minimum (at the end of the first call; the message gives
            the minimum). Nothing is lost: the model, RNG and BatchNorm state
            are as before the call and the next call re-solves without
            measuring again.
        StageError: misuse inside the chain (the message names the stage).

    Example:
        >>> import torch, remat
        >>> lin = remat.stage(torch.nn.Linear(4, 4))
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with remat.chain(budget="1MiB"):
        ...     y = lin(lin(x))
        >>> y.sum().backward()
    """

    last = None

    def __init__(self, budget="auto", algorithm="optimal", slots=DEFAULT_SLOTS, costs=None):
        self.budget = parse_budget(budget)
        if costs is not None and not isinstance(costs, (str, os.PathLike)):
            raise TypeError(f"remat: costs must be a path to a JSON file, got {type(costs).__name__}")
        self.costs_path = costs
        _parse_algorithm(algorithm, 1)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"remat: slots must be a positive int, got {slots!r}")
        self.algorithm = algorithm
        self.slots = slots
        self._site = None

    def __enter__(self):
        if active() is not None:
            raise StageError(
                "remat: chains cannot be nested; a chain is already open on this thread. Remove "
                "the inner remat.chain (its stages then join the outer chain) or close the outer one first"
            )
        site = self._site
        if site is None:
            frame = sys._getframe(1)
            site = (frame.f_code, frame.f_lineno)
        _local.active = _Active(self, site)
        return self

    def __exit__(self, exc_type, exc, tb):
        current = _local.active
        _local.active = None
        if exc_type is None:
            current.finish()
        return False

    def __call__(self, fn):
        spec = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            inner = chain.__new__(chain)
            inner.__dict__.update(spec.__dict__)
            inner._site = (fn.__code__ if hasattr(fn, "__code__") else fn, 0)
            with inner:
                return fn(*args, **kwargs)

        return wrapper


def _signature(value):
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _find_activation(args, kwargs, start):
    for i in range(start, len(args)):
        if isinstance(args[i], torch.Tensor):
            return i, None, args[i]
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return None, name, value
    return None, None, None


class _Active:
    """One open chain on one thread (one call of the user's forward)."""

    def __init__(self, spec, site):
        self.spec = spec
        self.site = site
        self.k = 0
        self.prev = None
        self.prev_version = 0
        self.prev_name = None
        self.mode = None
        self.in_stage = False
        self.entry = None
        self.key = None
        self.run = None
        self.plan = None
        self.budget = None
        self.new = None
        self.diverged = 0
        self.rng_start = None
        self.originals = {}
        self.given = None
        self.grad_pool = None
        self.upstream = None
        self.held_bytes = 0
        self.measured = None    # what run 4 of Note [Measuring a stage] needs of the last stage
        self.relayout = None    # (that of the stage before, the layout its gradient has) due for run 4

    # stage calls ---------------------------------------------------------

    def call(self, ident, name, fn, args, kwargs, start):
        if self.in_stage or replaying() or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        pos, in_kw, x = _find_activation(args, kwargs, start)
        if x is None:
            raise StageError(
                f"remat: stage {self.k + 1} ({name}) got no tensor argument; the first tensor "
                f"argument of a stage is the activation that flows along the chain"
            )
        k = self.k + 1
        if k == 1:
            self._begin(ident, args, kwargs, x)
        elif x is not self.prev:
            raise StageError(
                f"remat: stage {k} ({name}) did not receive the tensor stage {k - 1} ({self.prev_name}) "
                f"returned; code between the two stages changed the activation. Move that code into "
                f"stage {k - 1} or {k}, or make it a stage of its own"
            )
        elif x._version != self.prev_version:
            raise StageError(
                f"remat: the output of stage {k - 1} ({self.prev_name}) was modified in place before "
                f"stage {k} ({name}); move the in-place code into one of the stages"
            )
        self.k = k
        call = StageCall(k, name, fn, args, kwargs, pos, in_kw, x.requires_grad)
        if self.mode == "run" and not self._matches(k, ident, x):
            self._diverge(k)
        version = x._version
        self.in_stage = True
        try:
            if self.mode == "run":
                out = self._run_stage(call, x)
            else:
                out = self._measure_stage(call, ident, x)
        except BaseException as exc:
            if hasattr(exc, "add_note") and not isinstance(exc, RematError):
                exc.add_note(f"(raised in remat stage {k}: {name})")
            raise
        finally:
            self.in_stage = False
        act = _check_output(call, out, x, version)
        self.prev = act
        self.prev_version = act._version
        self.prev_name = name
        return out

    def _begin(self, ident, args, kwargs, x):
        autocast = capture_autocast()
        training = getattr(ident, "training", None)
        self.key = (self.site, id(ident), _signature((args[1:] if args and args[0] is ident else args, kwargs)),
                    training, autocast)
        self.autocast = autocast
        with _cache_lock:
            entry = _cache.get(self.key)
            if entry is not None:
                if entry.idents[0]() is not ident:
                    entry = None
                    del _cache[self.key]
                else:
                    _cache.move_to_end(self.key)
        self.entry = entry
        self.budget = resolve_budget(self.spec.budget, x.device)
        if entry is not None and entry.costs is not None:
            self.plan = entry.plan(self.budget, self.spec.algorithm, self.spec.slots)
            schedule, modes, back, fall_at = self.plan
            self.mode = "run"
            self.run = Run(back, fall_at, autocast)
        else:
            self.mode = "measure"
            self.new = Recording()
            self.run = Run(None, {}, autocast)
            self.rng_start = capture_rng(cuda_devices([x]))
            self.given = read_costs(self.spec.costs_path)

    def _matches(self, k, ident, x):
        entry = self.entry
        if k > len(entry.idents):
            return False
        return entry.idents[k - 1]() is ident and entry.in_sigs[k - 1] == _input_signature(ident, x)

    def _diverge(self, k):
        """The chain left the recorded path at stage k: measure the rest (Note [Chain keys])."""
        old = self.entry
        new = Recording()
        for attr in ("idents", "names", "in_sigs", "meta", "uses_rng", "grad_replay", "state", "held"):
            setattr(new, attr, list(getattr(old, attr)[:k - 1]))
        new.rows = [{f: getattr(old.costs, f)[i] for f in FIELDS} for i in range(k - 1)]
        new.input_bytes = old.input_bytes
        self.new = new
        self.mode = "measure"
        self.run.ops = None
        self.diverged = k

    def _run_stage(self, call, x):
        entry, run, k = self.entry, self.run, call.index
        call.meta = entry.meta[k - 1]
        call.state = entry.state[k - 1]
        call.grad_replay = entry.grad_replay[k - 1]
        mode = self.plan[1][k]
        if mode == FALL:
            run.add_whole(call)
            return call.invoke(x)
        if entry.uses_rng[k - 1]:
            call.rng = capture_rng(cuda_devices([x] + [a for a in call.args if isinstance(a, torch.Tensor)]))
        keep = mode == FCK or (k > 1 and run.whole[k - 1])
        anchor, pack, count = run.new_anchor(call, keep, x)
        with run.hooks(pack):
            out = call.invoke(x)
        run.settle(anchor, count[0], x)
        if count[0]:
            run.watch(anchor, first(out))
        return out

    # measuring (Note [Measuring a stage] in remat/profile.py) -----------

    def _measure_stage(self, call, ident, x):
        run, new, k = self.run, self.new, call.index
        cuda = x.is_cuda
        devices = cuda_devices([x] + [a for a in call.args if isinstance(a, torch.Tensor)])
        rng0 = capture_rng(devices)
        # the previous stage kept its saved tensors in case it was the last one:
        # it is not, so they go before this stage is measured (DESIGN.md section 2),
        # unless they fit the budget, which spares rebuilding it in the backward
        prev_anchor = run._anchor(k - 1) if k > 1 else None
        if prev_anchor is not None and not self._keep_saved(k - 1):
            prev_anchor.saved = None
        self._measure_backward_again()
        # the forward that counts: checkpoint the input, keep the saved tensors
        # until the next stage starts so the last stage needs no recomputation
        anchor, _, count = run.new_anchor(call, True, x)
        kept = []
        anchor.saved = kept

        def pack(t):
            i = len(kept)
            kept.append(t.detach())
            return _Saved(anchor, i)

        if self.upstream is None:
            self.upstream = Upstream()
        self.upstream.add(tree_leaves((x, call.args, call.kwargs)))
        if self.given is None:
            if self.grad_pool is None:
                self.grad_pool = GradPool()
            out, row, originals, uses_rng = instrumented_run(call, ident, x, cuda, rng0, _check_output, run.hooks(pack),
                                                             kept, self.grad_pool, self.upstream, anchor)
        else:
            # costs come from a file: learn only what replay needs, from this forward
            detector = Instrument(exclude=[x])
            buffers = [(b, b.detach().clone()) for b in ident.buffers()] if isinstance(ident, torch.nn.Module) else []
            with detector, run.hooks(pack):
                out = call.invoke(x)
            detector.note_changed(buffers)
            originals = list(detector.mutated.values())
            uses_rng = rng0.changed()
            act = out[0] if isinstance(out, tuple) else out
            row = {"out_bytes": act.untyped_storage().nbytes()} if isinstance(act, torch.Tensor) else None
            if row is not None and act.requires_grad:
                stop = {a.grad_fn for a in (x, *call.args) if isinstance(a, torch.Tensor) and a.grad_fn is not None}
                row["held_grads"] = self.upstream.held_grads(p for p in stage_leaves(act, stop) if p is not x)
        held = row.pop("held_grads", {}) if row is not None else {}
        if self.given is None and row is not None:
            # a recomputation holds a copy of the state the stage writes in place
            # (remat/replay.py, restore_tensors) on top of what its forward holds
            row["fwd_tmp"] += sum(t.numel() * t.element_size() for t, _ in originals)
            # run 4 of the Note: the gradient reaching the previous stage is laid
            # out as this stage's backward made it, not as the ones it was measured with
            layout, seen = row.pop("grad_layout", None), row.pop("input_grad_layout", None)
            last = self.measured
            if last is not None and last[0] == k - 1 and last[6] is not None and seen not in (None, last[6]):
                self.relayout = (last, seen)
            # (the leaves behind it as they were: later stages add this one's own)
            self.measured = (k, call, x, cuda, rng0, list(originals), layout, frozenset(self.upstream.leaves))
        state = [t for t, _ in originals]
        for t, old in originals:
            self.originals.setdefault(storage_key(t), (t, old))
        meta = tuple((t.shape, t.dtype, t.device) for t in kept)
        call.meta = meta
        call.state = [weakref.ref(t) for t in state]
        call.rng = rng0 if uses_rng else None
        run.settle(anchor, len(kept), x)
        if kept:
            run.watch(anchor, first(out))
        # run 3 of the Note: without recording, from the state the stage started in,
        # replayed as a recomputation is (what it costs is what Fn and Fck cost)
        with rng0.replayed(), torch.no_grad(), restore_tensors(state):
            for t, old in originals:
                t.copy_(old)
            with Timer(cuda) as timer, _Replay(call, self.autocast):
                nograd_out = call.call(x).detach()
        if self.given is None:
            row["fwd_nograd_time"] = timer.seconds
            if cuda:
                row["fwd_time"], row["bwd_time"] = timed_step(call, x, cuda, rng0, state)
        # Note [Replaying a stage] 4: a stage whose forward without recording
        # differs from the recorded one is recomputed with grad mode on
        act = out[0] if isinstance(out, tuple) else out
        call.grad_replay = not (isinstance(act, torch.Tensor) and _bitwise_equal(nograd_out, act))
        if call.grad_replay and self.given is None:
            row["fwd_nograd_time"] = row["fwd_time"]
        del nograd_out
        if k == 1:
            new.input_bytes = x.untyped_storage().nbytes()
        new.idents.append(weakref.ref(ident))
        new.names.append(call.name)
        new.in_sigs.append(_input_signature(ident, x))
        new.meta.append(meta)
        new.uses_rng.append(uses_rng)
        new.grad_replay.append(call.grad_replay)
        new.state.append(call.state)
        new.rows.append(row)
        new.held.append(held)
        return out

    def _measure_backward_again(self):
        """Run 4 of Note [Measuring a stage] for the stage due (if any), after the
        saved tensors of the stage past it have gone or been kept."""
        due, self.relayout = self.relayout, None
        if due is None:
            return
        (i, call, x, cuda, rng0, originals, _, leaves), layout = due
        row = self.new.rows[i - 1]
        if i < self.diverged or row is None or "bwd_tmp" not in row:
            return
        again = backward_again(call, x, cuda, rng0, originals, layout, row.get("out_freed", 0),
                               self.grad_pool, leaves)
        if again is not None:
            row["bwd_time"], row["bwd_tmp"] = again

    def _keep_saved(self, i):
        """Whether measured stage i keeps its saved tensors for this call's backward.

        Yes while the inputs held so far and the saved tensors kept so far fit
        the budget (each stage's saved bytes include its output, the next
        stage's input), so that a budget that fits everything makes the first
        backward rebuild nothing. A stage run by a schedule before the chain
        diverged is left to it.
        """
        if i < self.diverged:
            return False
        rows, given = self.new.rows, self.given
        saved = rows[i - 1].get("saved_bytes") if rows[i - 1] is not None else None
        if saved is None and given is not None and i <= given.length:
            saved = given.saved_bytes[i - 1]
        out = rows[i - 1].get("out_bytes", 0) if rows[i - 1] is not None else 0
        if saved is None:
            return False
        if self.new.input_bytes + self.held_bytes + saved > self.budget:
            self.held_bytes += out   # dropped: its output stays, as the next stage's input
            return False
        self.held_bytes += saved
        return True

    # end of the chain ----------------------------------------------------

    def finish(self):
        if self.k == 0:
            return
        if self.mode == "run":
            if self.k != len(self.entry.idents):
                self.run.ops = None
                with _cache_lock:
                    _cache.pop(self.key, None)
            _publish(Explanation(self.entry.costs, self.plan[0], self.budget, self.entry.names))
            return
        new = self.new
        try:
            self.in_stage = True   # stages inside the stage measured again run plainly
            try:
                self._measure_backward_again()
            finally:
                self.in_stage = False
                self.measured = self.grad_pool = self.upstream = None
            new.costs = chain_costs(new.rows, new.input_bytes + new.held_bytes(), self.spec.costs_path,
                                    self.given)
        except BaseException:
            self._undo()
            raise
        with _cache_lock:
            _cache[self.key] = new
            _cache.move_to_end(self.key)
            if len(_cache) > CACHE_SIZE:
                # recordings of models that are gone can never match again: they go first
                for key in [k for k, e in _cache.items() if e.idents[0]() is None]:
                    del _cache[key]
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
        try:
            schedule = new.plan(self.budget, self.spec.algorithm, self.spec.slots)[0]
        except RematError:
            self._undo()
            _publish(Explanation(new.costs, None, self.budget, new.names))
            raise
        _publish(Explanation(new.costs, schedule, self.budget, new.names))

    def _undo(self):
        """Put RNG and in-place state back as before this call (a failed first call leaves no trace)."""
        if self.rng_start is not None:
            torch.set_rng_state(self.rng_start.cpu)
            for d, s in self.rng_start.cuda:
                torch.cuda.set_rng_state(s, d)
        with torch.no_grad():
            for t, old in self.originals.values():
                t.copy_(old)


def _bitwise_equal(a, b):
    """Same shape, dtype and bits (NaNs included)."""
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and torch.equal(a.reshape(-1).view(torch.uint8) if a.is_contiguous() and b.is_contiguous()
                            else a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def _input_signature(ident, x):
    """What each stage of a recording is checked against: input shape and dtype,
    and its module's training flag (a stage switched to eval is measured again)."""
    return (tuple(x.shape), x.dtype, getattr(ident, "training", None))


def _check_output(call, out, x, version):
    """What a stage returned is an activation (or a tuple led by one, the rest needing
    no grad) and its input was not modified in place; returns the activation."""
    act = out[0] if isinstance(out, tuple) else out
    if not isinstance(act, torch.Tensor):
        raise StageError(
            f"remat: stage {call.index} ({call.name}) returned {type(act).__name__}; a stage must return "
            f"its output activation as a tensor, or a tuple whose first item is that tensor"
        )
    if isinstance(out, tuple):
        for j, item in enumerate(out[1:], 1):
            if isinstance(item, torch.Tensor) and item.requires_grad:
                raise StageError(
                    f"remat: stage {call.index} ({call.name}) returned a tuple whose item {j} requires "
                    f"grad; only the first item may carry gradient (detach the others)"
                )
    if x._version != version:
        raise StageError(
            f"remat: stage {call.index} ({call.name}) modified its input in place (e.g. a "
            f"ReLU(inplace=True) as its first op); remat needs the input unchanged to recompute the "
            f"stage. Make that op out of place or move it to the end of stage {call.index - 1}"
        )
    return act


