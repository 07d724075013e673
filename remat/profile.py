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
2. A timed forward without recording: fwd_nograd_time.
3. The real forward, whose graph the user will backward through, timed
   (fwd_time), then a timed backward of the stage alone with
   ``torch.autograd.grad(..., retain_graph=True)`` (bwd_time), which leaves
   parameter ``.grad`` untouched.

Runs 1 and 2 are thrown away; run 3 is the one that counts, so RNG streams
and BatchNorm statistics end where one plain forward leaves them.
"""

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Instrument", "Timer", "stage_leaves", "storage_key"]


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
        self.window = set()
        self.window_live = 0
        self.window_peak = 0
        self.created = {}
        self.mutated = {}
        self._exclude = {storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}

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
                nbytes = st.nbytes()
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
