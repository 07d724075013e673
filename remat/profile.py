"""Measuring a stage: times, sizes and transient peaks (DESIGN.md section 3).

Note [Measuring a stage]
------------------------
On the first call of a chain key each stage runs, in isolation and on its
real input, in this order (RNG and in-place state reset before each run, so
that only the last run shows):

1. An *instrumented* recording forward and backward under ``Instrument``, a
   TorchDispatchMode that (a) meters storages allocated while it is active,
   each counted once and freed when its last reference goes (weak references
   on the storage objects, which PyTorch keeps alive as long as the storage
   lives), and (b) notes every tensor that existed before the stage and that
   the stage writes in place, cloning it first (Note 3 of remat/replay.py).
   It gives out_bytes, saved_bytes (the distinct storages autograd saved,
   allocated by the stage, plus the output), fwd_tmp and bwd_tmp. On CUDA the
   allocator's peak statistics replace the meter for the peaks.
2. A timed forward without recording: fwd_nograd_time. Its output is kept
   to compare, bit for bit, with the real forward's (Note [Replaying a
   stage] 4 in remat/replay.py).
3. A timed forward and backward on a detached copy of the input
   (``timed_step``): fwd_time and bwd_time. The backward runs as a training
   step runs it: parameter gradients are added into ``.grad`` buffers that
   are swapped in for the run and swapped out after.
4. The real forward, whose graph the user will backward through, under the
   hooks of a checkpointed stage (its input is kept); it is timed too and
   fwd_time is the lesser of runs 3 and 4.

Runs 1 to 3 are thrown away; run 4 is the one that counts, so RNG streams
and BatchNorm statistics end where one plain forward leaves them.
"""

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .replay import restore_tensors

__all__ = ["Instrument", "Timer", "instrumented_run", "timed_step", "stage_leaves", "storage_key"]


# Ops that write some arguments in place although their schema does not say
# so (BatchNorm's running statistics): op name -> argument positions.
_UNDECLARED_WRITES = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}


def storage_key(t):
    """An id of ``t``'s storage, valid while the storage lives."""
    return t.untyped_storage()._cdata


class Instrument(TorchDispatchMode):
    """Storage meter and in-place state detector (Note [Measuring a stage], 1)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.gate = True   # only storages made while the gate is open are metered
        self.window = set()
        self.window_live = 0
        self.window_peak = 0
        self.created = {}
        self.mutated = {}
        self._exclude = {storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}

    def set_gate(self, open_):
        """Meter only storages made while ``open_`` (e.g. inside a chain's forward and backward)."""
        self.gate = open_

    def open_window(self):
        """From now on also meter storages allocated after this call on their own
        (``window_peak``): what a region adds, however much older memory it frees."""
        self.window = set()
        self.window_live = 0
        self.window_peak = 0

    def _free(self, key, nbytes):
        if self.created.pop(key, None) is not None:
            self.live -= nbytes
            if key in self.window:
                self.window.discard(key)
                self.window_live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    for t in value if isinstance(value, (list, tuple)) else (value,):
                        if isinstance(t, torch.Tensor):
                            self._note_write(t)
        else:
            positions = _UNDECLARED_WRITES.get(schema.name)
            if positions is not None:
                for i in positions:
                    if i < len(args) and isinstance(args[i], torch.Tensor):
                        self._note_write(args[i])
        out = func(*args, **kwargs)
        inputs = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st._cdata
                if key in self.created:
                    continue
                if inputs is None:
                    inputs = {storage_key(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
                if key in inputs:
                    continue
                # storages made while the gate is shut are not metered at all
                nbytes = st.nbytes() if self.gate else 0
                self.created[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                self.window.add(key)
                self.window_live += nbytes
                self.window_peak = max(self.window_peak, self.window_live)
                weakref.finalize(st, self._free, key, nbytes)
        return out

    def _note_write(self, t):
        key = storage_key(t)
        if key in self.created or key in self.mutated or key in self._exclude:
            return
        self.mutated[key] = (t, t.detach().clone())

    def restore(self):
        """Write back every noted tensor's value from before the first write."""
        with torch.no_grad():
            for t, old in self.mutated.values():
                t.copy_(old)

    def note_changed(self, before):
        """Add tensors of ``before`` (tensor, clone) pairs whose values changed."""
        for t, old in before:
            key = storage_key(t)
            if key not in self.mutated and not torch.equal(t, old):
                self.mutated[key] = (t, old)

    def state_tensors(self):
        """The tensors written in place that existed before the stage."""
        return [t for t, _ in self.mutated.values()]


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


def stage_leaves(out, stop):
    """Leaf tensors requiring grad reachable from ``out``'s graph without
    passing the nodes in ``stop``: the parameters a stage's backward reaches."""
    found, seen, todo = [], set(), [out.grad_fn] if out.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            found.append(var)
            continue
        todo.extend(n for n, _ in node.next_functions)
    return found


def instrumented_run(call, ident, x, cuda, rng0, check):
    """Run 1 of Note [Measuring a stage]: sizes, peaks, saved metadata, state."""
    inst = Instrument(exclude=[x])
    buffers = [(b, b.detach().clone()) for b in ident.buffers()] if isinstance(ident, torch.nn.Module) else []
    saved = []

    def pack(t):
        saved.append(t)
        return t

    # a non-leaf copy, so that a stage modifying its input in place is caught
    # by the version check below rather than by autograd's leaf check
    leaf = x.detach().requires_grad_(x.requires_grad)
    xin = leaf.clone() if x.requires_grad else leaf
    version = xin._version
    stop = {a.grad_fn for a in call.args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    row = {}
    with rng0.replayed():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with inst, torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = call.invoke(xin)
            check(call, out, xin, version)
            out = out[0] if isinstance(out, tuple) else out
            fwd_peak = inst.peak if not cuda else torch.cuda.max_memory_allocated() - base
            out_bytes = out.untyped_storage().nbytes()
            keys = {}
            for t in saved + [out]:
                key = storage_key(t)
                if key in inst.created:
                    keys[key] = inst.created[key]
            saved_bytes = max(sum(keys.values()), out_bytes)
            meta = tuple((t.shape, t.dtype, t.device) for t in saved)
            bwd_delta = 0
            in_grad = 0
            if out.requires_grad:
                params = [v for v in stage_leaves(out, stop | {xin.grad_fn}) if v is not leaf]
                # the leaf, not its clone: AccumulateGrad then keeps the very tensor
                # the engine made, as a real step hands it on without a copy
                inputs = [leaf] if leaf.requires_grad else []
                if inputs or params:
                    grad_out = torch.ones_like(out)
                    del saved[:]
                    with _step_grads(params):
                        if cuda:
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            base_b = torch.cuda.memory_allocated()
                        else:
                            inst.open_window()
                        torch.autograd.backward(out, grad_out, inputs=inputs + params)
                        if cuda:
                            bwd_delta = torch.cuda.max_memory_allocated() - base_b
                        else:
                            bwd_delta = inst.window_peak
                    in_grad = x.untyped_storage().nbytes() if x.requires_grad else 0
                    leaf.grad = None
                    del grad_out
            del out
        uses_rng = not torch.equal(torch.get_rng_state(), rng0.cpu) or any(
            not torch.equal(torch.cuda.get_rng_state(d), s) for d, s in rng0.cuda)
    inst.note_changed(buffers)
    originals = list(inst.mutated.values())
    inst.restore()
    row["out_bytes"] = out_bytes
    row["saved_bytes"] = saved_bytes
    row["fwd_tmp"] = max(0, fwd_peak - out_bytes)
    row["bwd_tmp"] = max(0, bwd_delta - in_grad)
    return row, meta, originals, uses_rng


class _step_grads:
    """Backward of one stage as a training step runs it: each parameter gradient is
    added into an existing ``.grad`` (and freed), and the stage's parameters get
    their own ``.grad`` back afterwards, untouched."""

    def __init__(self, params):
        self.params = params

    def __enter__(self):
        self.old = [p.grad for p in self.params]
        for p in self.params:
            p.grad = torch.zeros_like(p)

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.old):
            p.grad = g
        return False


def timed_step(call, x, cuda, rng0, state):
    """Run 3 of Note [Measuring a stage]: forward and backward times on a detached copy."""
    xin = x.detach().requires_grad_(x.requires_grad)
    stop = {a.grad_fn for a in call.args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    with rng0.replayed(), restore_tensors(state), torch.enable_grad():
        with Timer(cuda) as tf:
            out = call.call(xin)
        tb = 0.0
        if out.requires_grad:
            params = [v for v in stage_leaves(out, stop) if v is not xin]
            inputs = [xin] if xin.requires_grad else []
            if inputs or params:
                grad_out = torch.ones_like(out)
                with _step_grads(params), Timer(cuda) as timer:
                    torch.autograd.backward(out, grad_out, inputs=inputs + params)
                tb = timer.seconds
    return tf.seconds, tb
