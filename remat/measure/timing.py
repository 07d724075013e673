"""Timing a stage's runs while it is measured: wall-clock regions that
synchronise CUDA, CUDA's once-per-process set-up done before the first stage,
on CUDA a forward and backward timed on a copy of the input, and run 3, the
forward without recording, timed and metered (Note [Measuring a stage],
remat/measure/profile.py); and ``Releases``, which meters run 2, the backward, as one
that frees its graph runs it.

Note [Metering the forward without recording]
---------------------------------------------
``fwd_tmp`` is the recording forward's peak, the tensors it saves included, so
it overstates a forward under ``torch.no_grad`` (``Fn``, ``Fck`` after ``Loss``),
which lets each go once the ops reading it are done: ``Costs.fwd_nograd_less``.
Run 3 meters its own forward with the conventions of run 1: above what was
allocated as it began (the input not counted), the output counted, then
taken out; plus the copy a recomputation holds of the state the stage writes
in place (``_due_for_run4``'s, which Replay makes before the metered part
starts); plus what run 1 made from parameters and buffers alone and left
alive, which run 3 finds made (autocast's casts of the weights, cached to
the end of the autocast region) and a recomputation after ``Loss``, in an
autocast region of its own, makes again: on CPU those run 3's ops read, on
CUDA all of them (a bound: the allocator does not say what ops read).

On CPU the meter is run 1's (``Instrument``), on a second run after the timed
one: a dispatch mode's work is in every op (on a 32-wide GPT block, wall time
less the time inside the mode's handler was twice a plain forward's), and the
time kept is the wall time of a forward as a recomputation runs it, the
model's Python included, as the second and third calls' refined times are
(remat/measure/refine.py). Only the twins' first stage pays it. On CUDA the
allocator's peak statistics meter the timed run, reset inside it
(microseconds, taken out of the time).
"""

import contextlib
import time

import torch

from .leaves import StepGrads, stage_leaves, stop_nodes, walk
from .meter import Instrument, storage_key
from .cuda_peak import reset_own
from ..runtime.executor import RELEASES
from ..runtime.option_modes import option_contexts
from ..runtime.recompute import Replay, uncached
from ..runtime.replay import bitwise_equal, restore_tensors

__all__ = ["Releases", "Timer", "made_alone", "nograd_less", "nograd_run", "timed_rebuild", "timed_step", "warm_cuda"]

_warm = set()   # CUDA devices warm_cuda has set up
_SUM = torch.ops.aten.sum.dim_IntList


class Timer:
    """Wall time of a region, synchronising CUDA when the work runs there."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.seconds = 0.0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._t0
        return False



def warm_cuda(devices):
    """Make CUDA's lazy, once-per-process set-up happen before a stage is measured
    on ``devices``, not inside it (Note [Measuring a stage], remat/measure/profile.py):
    the cuBLAS handles and workspaces of the calling thread and of the engine's
    backward thread (32 MiB each on an H100, held for good, which the allocator's
    peak would count as the first stage's transient memory), and the loading of
    the GEMM kernels (seconds, which its time would count). A small Linear
    forward and backward, per device, once; it draws no random numbers."""
    for d in devices:
        if d in _warm:
            continue
        with torch.cuda.device(d), torch.enable_grad():
            w = torch.ones(64, 64, device="cuda", requires_grad=True)
            b = torch.zeros(64, device="cuda", requires_grad=True)
            a = torch.ones(64, 64, device="cuda", requires_grad=True)
            torch.nn.functional.linear(a @ w, w, b).sum().backward()
            torch.cuda.synchronize()
        _warm.add(d)


def timed_step(call, x, cuda, rng0, state):
    """Forward and backward times on a detached copy, on CUDA (Note [Measuring a
    stage], remat/measure/profile.py): the lesser of two runs, the first of which may
    still load kernels."""
    first = _timed_step(call, x, cuda, rng0, state)
    second = _timed_step(call, x, cuda, rng0, state)
    return min(first[0], second[0]), min(first[1], second[1])


def _timed_step(call, x, cuda, rng0, state):
    xin = x.detach().requires_grad_(x.requires_grad)
    inp, stop = uncached(xin, call.autocast), stop_nodes((call.args, call.kwargs))
    with rng0.replayed(), restore_tensors(state), torch.enable_grad():
        with Timer(cuda) as tf:
            out = call.activation(inp)
        tb = 0.0
        if out.requires_grad:
            params = [v for v in stage_leaves(out, stop) if v is not xin]
            inputs = [xin] if xin.requires_grad else []
            if inputs or params:
                grad_out = torch.ones_like(out)
                with StepGrads(params), Timer(cuda) as timer:
                    torch.autograd.backward(out, grad_out, inputs=inputs + params)
                tb = timer.seconds
    return tf.seconds, tb


def timed_rebuild(call, x, cuda, rng0, state):
    """Seconds of a rebuild of the stage under option 1's cache (on CUDA: Note
    [Measuring an option] 3, remat/measure/options.py): the kept ops' outputs handed
    back, the other ops run again, recording, as B(i) runs it; the lesser of two,
    each after a recording forward that fills the cache. None where the rebuild
    fails (the estimate from the cheap ops' share stands)."""
    best = None
    for _ in range(2):
        keep, hand = option_contexts()
        xin = x.detach().requires_grad_(x.requires_grad)
        inp = uncached(xin, call.autocast)   # (made outside the options' modes, as a rebuild's input is)
        try:
            with rng0.replayed(), restore_tensors(state), torch.enable_grad():
                with keep:
                    call.activation(inp)
            with rng0.replayed(), restore_tensors(state), torch.enable_grad():
                with Timer(cuda) as timer, hand:
                    call.activation(inp)
        except Exception:   # (a timing, not the stage's result: the estimate stands)
            return None
        best = timer.seconds if best is None else min(best, timer.seconds)
    return best


def made_alone(inst):
    """{storage: (weak reference, bytes)} of the storages the meter ``inst`` saw made
    from parameters and buffers alone that are still alive (a cache's)."""
    return {key: (inst._refs[key], inst.created[key]) for key in inst._from_params
            if inst.created.get(key) and key in inst._refs}


def nograd_run(call, x, writes, rng0, cuda, autocast, meter, act):
    """Stage ``call``'s forward on ``x`` under ``torch.no_grad``, from the RNG
    state ``rng0`` and the state ``writes`` ((tensor, value before) pairs) it
    started from, replayed as a recomputation is (Note [Metering the forward
    without recording]).

    Returns:
        (whether its output equals ``act``, the recorded one, bit for bit; its
        seconds; None if not ``meter``, else (its peak above what was allocated
        as it began, the output included; the storages its ops read that it did
        not make, or None on CUDA)).
    """
    with _from_start(writes, rng0), Timer(cuda) as timer, Replay(call, autocast):
        own = 0.0
        if cuda and meter:
            t0 = time.perf_counter()
            reset_own()
            base = torch.cuda.memory_allocated()
            own = time.perf_counter() - t0
        out = call.activation(x).detach()
    metered = (torch.cuda.max_memory_allocated() - base, None) if cuda and meter else None   # (before the check)
    same = isinstance(act, torch.Tensor) and bitwise_equal(out, act)
    del out   # (not held through the metered run: the measuring call's own peak)
    if meter and not cuda:
        inst = Instrument(writes=False)
        with _from_start(writes, rng0), Replay(call, autocast), inst:
            call.activation(x)
        metered = (inst.peak, inst.reads)
    return same, max(0.0, timer.seconds - own), metered


@contextlib.contextmanager
def _from_start(writes, rng0):
    """Without recording, from the RNG streams and the state the stage started from
    (put back after)."""
    state = [t for t, _ in writes]
    with rng0.replayed(), torch.no_grad(), restore_tensors(state):
        for t, old in writes:
            t.copy_(old)
        yield


def nograd_less(costs, metered, writes, cached):
    """``fwd_nograd_less`` of a stage whose ``costs`` run 1 (and its state copies)
    gave, from what ``nograd_run`` ``metered``; ``writes`` as there, ``cached``:
    ``made_alone`` of run 1's meter."""
    peak, reads = metered
    more = sum(t.numel() * t.element_size() for t, _ in writes)
    more += sum(n for key, (ref, n) in (cached or {}).items()
                if ref() is not None and (reads is None or key in reads))
    return min(costs.fwd_tmp, max(0, costs.fwd_tmp - max(0, peak - costs.out_bytes) - more))


class Releases:
    """Meters a stage's backward as one that frees its graph runs it: each saved
    storage the stage made (its output aside, which stays as the next input) is
    let go once the node unpacking its last handle has run, as ``_unpack`` and
    autograd do (Note [The life of a saved tensor] 2 in remat/runtime/executor.py).
    ``held`` is their bytes at the start. Without the engine's keep-graph query
    (old PyTorch) the runtime keeps them to the stage's end, and so does this.
    With ``free``, the storages also go for real (their tensors dropped from
    ``saved``, the anchor's list), where the call keeps none of them.

    That is the backward of a stage recorded in the forward phase, whose saved
    tensors autograd keeps itself: they go once the node has run, after the engine
    has checked its outputs (summing a bias's gradient to the bias's shape). A
    stage rebuilt in the backward runs under remat's hooks, which let each go as
    the engine unpacks it: gone as the node's apply returns, before those sums.
    ``rebuilt_peak`` is the window's peak as such a backward would see it
    (``Costs.bwd_rebuilt_less``): what a node lets go is taken off the sums
    (``sum(..., keepdim=True)``, as ``at::sum_to`` runs it) that end its run.
    ``cast_peak``: the window's peak less the ``casts`` (storage: bytes) that autocast's
    cache holds, each let go as the node unpacking its last handle has run (Note
    [Casts freed at the Loss] 2, remat/solver/casts.py), beside ``plain``, the peak."""

    def __init__(self, act, stop, saved, sizes, out_key, inst, anchor, free=False, casts=None):
        self.inst, self.anchor, self.saved, self.casts = inst, anchor, saved, casts or {}
        self.left, self.pending, self.hooks = {}, [], []
        self.where = {} if free else None   # storage -> the indices of ``saved`` holding it
        self.rebuilt_peak, self.sums = None, None   # (sums: the most live at the sums ending a node so far)
        self.cast_freed = self.cast_peak = self.plain = 0
        if not RELEASES or anchor is None or act.grad_fn is None:
            self.held = 0
            return
        for t in saved:
            key = storage_key(t)
            if key in self.casts or key in sizes and key != out_key:
                self.left[key] = self.left.get(key, 0) + 1
        if self.where is not None:
            for i, t in enumerate(saved):
                self.where.setdefault(storage_key(t), []).append(i)
        self.held = self.rebuilt_peak = self.plain = self.cast_peak = sum(sizes.get(k, 0) for k in self.left)
        self.key_at = [storage_key(t) for t in saved]
        inst.watch = self._op
        anchor.observe = self.pending.append
        for node in walk([act.grad_fn], stop):
            if type(node).__name__ != "AccumulateGrad":
                self.hooks.append(node.register_hook(self._ran))
        self.sizes = sizes

    def _op(self, func, args, kwargs, ran):
        """An op is to run or ran (``Instrument.watch``): a sum to a shape may be the
        engine's, after the node's apply; any other op is not."""
        if ran:
            live = self.inst.window_live
            self.plain, self.cast_peak = max(self.plain, live), max(self.cast_peak, live - self.cast_freed)
        if func is _SUM and (args[2] if len(args) > 2 else kwargs.get("keepdim", False)):
            if not ran:
                if self.where is not None and self.pending:
                    self._drop_early()
                return
            live = self.inst.window_live
            self.sums = live if self.sums is None else max(self.sums, live)
            return
        if not ran:
            return
        live = self.inst.window_live
        self._settle(0)
        if live > self.rebuilt_peak:
            self.rebuilt_peak = live

    def _settle(self, freed):
        if self.sums is not None:
            self.rebuilt_peak = max(self.rebuilt_peak, self.sums - freed)
            self.sums = None

    def _drop_early(self):
        """Let go for real of what the node has read for the last time, as its sums
        start (the apply that read it has returned, as in a rebuilt stage's backward);
        ``_release`` counts it at the node's end."""
        reads = {}
        for i in self.pending:
            reads[self.key_at[i]] = reads.get(self.key_at[i], 0) + 1
        for key, n in reads.items():
            if self.left.get(key) == n:
                for j in self.where[key]:
                    self.saved[j] = None

    def _ran(self, *_):
        before = self.inst.window_live
        self._release()
        self._settle(before - self.inst.window_live)

    def _release(self):
        for i in self.pending:
            key = self.key_at[i]
            n = self.left.get(key)
            if n:
                self.left[key] = n - 1
                if n == 1 and key in self.casts:
                    self.cast_freed += self.casts[key]
                elif n == 1:
                    self.inst.release(self.sizes[key])
                    if self.where is not None:
                        for j in self.where[key]:
                            self.saved[j] = None
        self.pending.clear()

    def close(self):
        self._settle(0)
        self.inst.watch = None
        for h in self.hooks:
            h.remove()
        if self.anchor is not None:
            self.anchor.observe = None
