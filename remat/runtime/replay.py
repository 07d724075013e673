"""State a recomputation must replay exactly: RNG streams, autocast, and
tensors a stage updates in place (BatchNorm running statistics), captured as
a stage runs; ``Replay`` (remat/runtime/recompute.py) puts it back around a
recomputation.

Note [Replaying a stage]
------------------------
A recomputed stage must compute bit for bit what its first forward did and
leave no trace:

1. RNG: the CPU generator and the generator of every CUDA device the stage's
   inputs live on are captured before the stage's first forward, set to that
   state for each recomputation, and put back afterwards, so the stream the
   rest of the program sees is untouched; so are the stage's own
   ``torch.Generator`` objects, which measuring finds in the ops' arguments
   (their state before the first op that draws from each). A stage whose
   forward drew nothing (its streams where they were captured, looked at
   after each call's forward) sets no stream at all, nor do its measuring
   runs: a chain of such stages leaves the generators to other threads. A
   stage that draws is replayed by setting the process's generators, which
   every thread shares: another thread drawing from them meanwhile sees the
   replayed stream, and two threads training chains that draw (dropout)
   disturb each other's masks (remat cannot give a thread its own default
   generator; docs/limitations.md).
2. Autocast: the enabled flag and dtype of every device type, and the cache
   flag, are captured with each stage (a chain may enter autocast around some
   of its stage calls only) and re-entered around a recomputation
   when they differ from the state the backward runs in (usually they are
   the same, and entering them would cost a small stage's recomputation a
   few percent).
3. In-place state: while measuring, remat records every tensor that existed
   before the stage and that the stage writes in place (BatchNorm's
   ``running_mean``, ``running_var``, ``num_batches_tracked``, any EMA
   buffer). A recomputation snapshots those tensors and restores them after
   (one ``_foreach_copy_`` for all), so one step updates them exactly once,
   as plain PyTorch does. Where the stage also reads their values (an op
   takes one as an input it does not write: spectral norm's power iteration
   vectors, a quantisation observer's range; ``Instrument.reads_state``),
   what it computes depends on them: each call keeps the values they had
   before the stage's first forward (``snapshot``, counted as held in the
   budget) and a recomputation starts from those. BatchNorm's statistics are
   read only by the op that updates them, and the output in training does
   not depend on them: no copy is kept. A later call whose stage writes a
   buffer it did not write when measured (version counters, compared around
   each stage) measures the chain again on the next call; that call's
   recomputations put the buffer back as its forward left it
   (remat/runtime/runner.py, ``_new_writes``).
4. Grad mode: a recomputation that only rebuilds an activation runs without
   recording, which is cheaper, unless the stage computes something else
   that way: some kernels are chosen by grad mode (scaled_dot_product_attention
   on CPU draws its dropout differently with and without grad). Measuring
   compares the stage's output with and without recording, bit for bit; a
   stage that differs is recomputed with grad mode on, its saved tensors
   dropped as they are made.
5. Parameters and buffers: a recomputation must see the tensors the first
   forward saw. For a stage that is a module (or a module's method), measuring
   notes where each of its parameters and buffers lives (the ``_parameters``
   or ``_buffers`` dict of the module or a submodule, and the name: its
   ``slots``), and each call takes the tensors found there as it runs the
   stage (``take``). So with plain tensor attributes (in a module's
   ``__dict__``): the old ``torch.nn.utils.spectral_norm`` sets ``weight`` so
   in a forward pre-hook, which for the stage module itself runs before the
   stage, once per call (two forwards before one backward, a GAN's real and
   fake: the recomputation of the first read the second's weight). Code that
   swaps them for the forward only (``torch.func.functional_call``, an EMA
   or meta-learning copy) has put the module's own back by the time the
   backward recomputes: the recomputation
   puts the forward's in their place for its length (``ForwardTensors``), as
   ``functional_call`` itself does (not a tensor whose memory has been freed
   since: FSDP swaps in sharded parameters between its units' forward and
   backward, and puts the forward's back, memory and all, before the
   backward). A parameter still in place but changed in
   place since the forward (a version counter moved: an optimizer step or a
   manual edit before the backward) cannot give the forward's values again:
   ``StageError``, where plain PyTorch raises too if autograd saved it (and
   would give the forward's gradients otherwise, which remat cannot). The
   in-place state of 3 is found through the slots too, so state replaced by
   new tensors between calls (``load_state_dict(..., assign=True)``) is the
   state put back. Stages that are plain functions reach their modules through
   closures remat cannot see: none of this applies to them.
6. Parametrization cache: under ``torch.nn.utils.parametrize.cached()`` a
   parametrized weight is computed once, by the first stage to use it, and the
   later ones reuse that tensor. Each stage call notes the cache as it found
   it (its entries then, or off), and every run of the stage again (a
   recomputation, a measuring run) runs with that cache, whatever it is then
   (``StageCall.call``): a stage that computed the weight computes it again
   and saves what it saved, one that reused it reuses the same tensor, in or
   out of ``cached()`` around the backward.
"""

import contextlib
import functools

import torch

from ..errors import RecomputeMismatchError, StageError

__all__ = ["RngState", "capture_rng", "AutocastState", "capture_autocast", "restore_tensors", "snapshot", "copy_all",
           "param_flags", "check_saved", "bitwise_equal"]


class RngState:
    """CPU and CUDA generator states captured at one point, and those of the
    stage's own ``torch.Generator`` objects (``extra``: (generator, state))."""

    __slots__ = ("cpu", "cuda", "extra", "used")

    def __init__(self, cpu, cuda, extra=()):
        self.cpu = cpu
        self.cuda = cuda
        self.extra = extra
        self.used = True   # False once the stage is known to draw nothing: no stream is set again

    def changed(self):
        """True if a stream has moved since it was captured (something drew from it)."""
        return not torch.equal(torch.get_rng_state(), self.cpu) or any(
            not torch.equal(torch.cuda.get_rng_state(d), s) for d, s in self.cuda) or any(
            not torch.equal(g.get_state(), s) for g, s in self.extra)

    def replayed(self):
        """Run the body with the captured streams, then put the current ones back;
        a body that draws nothing (``used`` False) leaves them alone (Note 1)."""
        return _Replayed(self) if self.used else contextlib.nullcontext()

    def enter(self):
        """Set the captured streams; return the ones they replace (for ``leave``)."""
        now = (torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d, _ in self.cuda],
               [(g, g.get_state()) for g, _ in self.extra])
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda:
            torch.cuda.set_rng_state(state, d)
        for g, state in self.extra:
            g.set_state(state)
        return now

    @staticmethod
    def leave(now):
        """Put back the streams ``enter`` replaced."""
        cpu, cuda, extra = now
        torch.set_rng_state(cpu)
        for d, state in cuda:
            torch.cuda.set_rng_state(state, d)
        for g, state in extra:
            g.set_state(state)


class _Replayed:
    __slots__ = ("rng", "now")

    def __init__(self, rng):
        self.rng = rng

    def __enter__(self):
        self.now = self.rng.enter()

    def __exit__(self, *exc):
        RngState.leave(self.now)
        return False


def cuda_devices(tensors):
    """Indices of the CUDA devices among ``tensors`` (an iterable)."""
    return sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                   for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})


def capture_rng(devices=(), generators=()):
    """Capture the CPU stream, the streams of the given CUDA devices and those of
    ``generators`` (a stage's own ``torch.Generator`` objects)."""
    return RngState(torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices],
                    [(g, g.get_state()) for g in generators])


class AutocastState:
    """Autocast flags of the CPU and CUDA device types, as a hashable value."""

    __slots__ = ("key", "off")

    def __init__(self, key):
        self.key = key
        self.off = not any(enabled for _, enabled, _, _ in key)   # autocast on no device

    def current(self):
        """True if this is the autocast state now (entering it would change nothing)."""
        if torch.is_autocast_cache_enabled() != self.key[0][3]:
            return False
        return all(torch.is_autocast_enabled(d) == enabled and torch.get_autocast_dtype(d) == dtype
                   for d, enabled, dtype, _ in self.key)

    def context(self):
        """A context manager that re-enters this autocast state."""
        stack = contextlib.ExitStack()
        for device_type, enabled, dtype, cache in self.key:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        return stack

    def __eq__(self, other):
        return isinstance(other, AutocastState) and self.key == other.key

    def __hash__(self):
        return hash(self.key)


def capture_autocast(like=None):
    """The autocast state now, for CPU and (if available) CUDA: ``like`` itself
    if it is that state (every stage of a call checks it: no new object; where
    autocast is off on every device, as in ``like``, with one call: dtypes and
    caching then change nothing)."""
    if like is not None and like.off and _any_autocast is not None and not _any_autocast():
        return like
    cache = torch.is_autocast_cache_enabled()
    key = tuple([(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), cache)
                 for device_type in _autocast_devices()])
    if like is not None and like.key == key:
        return like
    return AutocastState(key)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def weight_caches():
    """(autocast on, parametrize's cache of weights on) now, this thread's: the caches the
    copies of weights a stage saves live in (``Costs.cast_bytes``)."""
    on = _any_autocast() if _any_autocast is not None else any(map(torch.is_autocast_enabled, _autocast_devices()))
    return on, bool(torch.nn.utils.parametrize._cache_enabled)


@functools.lru_cache(maxsize=None)
def _autocast_devices():
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def restore_tensors(tensors):
    """Run the body, then write back the values ``tensors`` had before it (Note 3)."""
    return _Restored(list(tensors))


class _Restored:
    """The values and version counters of some tensors, to put back after a run.
    The counters too: a run of a stage that leaves no trace must not make autograd
    (BatchNorm's backward saves its running statistics) or remat's own checks
    (Note 5) see its writes as a change."""

    __slots__ = ("tensors", "values", "versions")

    def __init__(self, tensors):
        self.tensors = tensors
        self.values = None

    def __enter__(self):
        tensors = self.tensors
        if tensors:
            with torch.no_grad():
                self.values = [t.clone() for t in tensors]
            self.versions = [t._version for t in tensors]
        return self

    def __exit__(self, *exc):
        if self.values is not None:
            with torch.no_grad():
                copy_all(self.tensors, self.values)
            _set_versions(self.tensors, self.versions)
        return False


def _set_versions_each(tensors, versions):
    for t, v in zip(tensors, versions):
        torch._C._autograd._unsafe_set_version_counter(t, v)


def _set_versions_all(tensors, versions):
    torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


def _pick_set_versions():
    """One call for all of a stage's tensors where this torch takes a tuple (2.6 and
    later), one call each before."""
    probe = torch.zeros(())
    try:
        _set_versions_all([probe], [0])
    except TypeError:
        return _set_versions_each
    return _set_versions_all


_set_versions = _pick_set_versions()


def snapshot(tensors):
    """Copies of ``tensors`` (None for a None)."""
    with torch.no_grad():
        return [None if t is None else t.detach().clone() for t in tensors]


def _copy_each(targets, sources):
    for t, s in zip(targets, sources):
        t.copy_(s)


# one call for all of a stage's buffers (a BatchNorm stage has three per norm):
# a recomputation of a small stage pays this on every step
copy_all = getattr(torch, "_foreach_copy_", None) or _copy_each


def param_flags(tensors, n):
    """dtype, requires_grad and shape of each of the first ``n`` of ``tensors``
    (the parameters), a list."""
    return [None if t is None else (t.dtype, t.requires_grad, t.shape) for t in tensors[:n]]


def check_saved(call, saved):
    """The determinism guard: what a recomputation of ``call`` saved against what its
    first forward saved (Note [The life of a saved tensor] 5 in remat/runtime/executor.py)."""
    meta = call.meta
    if meta is None:
        if call.count is not None and len(saved) != call.count:
            raise RecomputeMismatchError(
                f"remat: stage {call.index} ({call.name}) saved {call.count} tensors in its forward but "
                f"{len(saved)} when recomputed. The stage must take the same path each time it runs: "
                f"make control flow depend only on its inputs' shapes, not on values or global state")
        return
    if tuple([(t.shape, t.dtype, t.device) for t in saved]) == meta:
        return
    if call.flags is not None and call.tensors is not None and param_flags(call.tensors, call.slots[1]) != call.flags:
        raise StageError(
            f"remat: parameters of stage {call.index} ({call.name}) were frozen or unfrozen (requires_grad) "
            f"or cast between the forward and the backward, so recomputing it saves other tensors; "
            f"change them before the forward or after the backward")
    if len(saved) != len(meta):
        raise RecomputeMismatchError(
            f"remat: stage {call.index} ({call.name}) saved {len(meta)} tensors when measured but "
            f"{len(saved)} when recomputed. The stage must take the same path each time it runs: "
            f"make control flow depend only on its inputs' shapes, not on values or global state"
        )
    for j, (t, (shape, dtype, device)) in enumerate(zip(saved, meta)):
        if t.shape != shape or t.dtype != dtype or t.device != device:
            raise RecomputeMismatchError(
                f"remat: stage {call.index} ({call.name}) saved tensor {j} as "
                f"{tuple(shape)} {dtype} on {device} in its forward but as {tuple(t.shape)} "
                f"{t.dtype} on {t.device} when recomputed; the stage must compute the same "
                f"thing each time it runs"
            )


def bitwise_equal(a, b):
    """Same shape, dtype and bits (NaNs included), read in place: a copy of each
    (to make them contiguous) once put a measuring call's run 3 (Note [Measuring
    a stage], remat/measure/profile.py) one output or two above the budget."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    try:
        return torch.equal(a.view(_BITS[a.element_size()]), b.view(_BITS[a.element_size()]))
    except (KeyError, RuntimeError):   # (a layout ``view`` cannot take: compared through copies)
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # (an integer of each element size)
