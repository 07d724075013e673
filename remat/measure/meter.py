"""``Instrument``: a storage meter and in-place write detector for one region
of code, as a TorchDispatchMode (Note [Measuring a stage] in remat/measure/profile.py).

While active it (a) meters the storages allocated by the ops it sees, each counted
once and let go when its last reference goes (weak references on the storage
objects, which PyTorch keeps alive as long as the storage lives; no callback holds
the meter: that cycle kept a finished meter's state copies to the next GC), (b) notes every
tensor that existed before and that an op writes in place, cloning it first (Note
3 of remat/runtime/replay.py), and (c) adds up the time spent inside the ops
themselves, its own work left out (on CUDA, with ``sync``, their kernels').

Note [Dynamo and the meter]
---------------------------
``TorchDispatchMode`` runs every subclass's ``__torch_dispatch__`` outside
Dynamo, and so imports Dynamo on the first op it sees: over a second of a
first call. No compiled code can be running before Dynamo is imported, so
``Instrument`` asks for that only when Dynamo is already loaded
(``_DynamoSafeInstrument``). Compiled code never runs under the meter: see
Note [Compiled code in a stage] in remat/dynamo.py.
"""

import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..runtime.option_modes import KEPT_OPS, kept_flops, written_arguments as _written_arguments
from .linger import settle

__all__ = ["Instrument", "storage_key"]


def _returns_views(schema):
    """True if every output of the op aliases an input (a view): nothing to meter."""
    return bool(schema.returns) and not schema.is_mutable and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


_PLANS = {}   # op -> (_written_arguments, _returns_views) of its schema
_TO_COPY, _PARAMETER = torch.ops.aten._to_copy.default, torch.nn.Parameter

_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_csc: ("ccol_indices", "row_indices"),
               torch.sparse_bsr: ("crow_indices", "col_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}


def dense_parts(t):
    """The strided tensors holding ``t``'s memory: itself, or a sparse tensor's
    indices and values (an ``nn.Embedding(sparse=True)``'s gradient); none for
    other layouts, which the meter does not see."""
    if t.layout == torch.strided:
        return (t,)
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    names = _COMPRESSED.get(t.layout)
    if names is None:
        return ()
    return (getattr(t, names[0])(), getattr(t, names[1])(), t.values())


def _keys(t):
    return (t.untyped_storage()._cdata,) if t.layout == torch.strided else tuple(map(storage_key, dense_parts(t)))


def _storage_keys(args, kwargs):
    """Storage ids of the tensors among an op's arguments (lists of tensors included)."""
    return {key for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
            if isinstance(t, torch.Tensor) for key in _keys(t)}


def storage_key(t):
    """An id of ``t``'s storage, valid while the storage lives (of its first part,
    ``dense_parts``, for a sparse tensor)."""
    if t.layout != torch.strided:
        parts = dense_parts(t)
        return parts[0].untyped_storage()._cdata if parts else id(t)
    return t.untyped_storage()._cdata


class InputWritten(Exception):
    """An op was about to write the tensor an ``Instrument`` protects (not run)."""


class Instrument(TorchDispatchMode):
    """Storage meter, in-place write detector and op timer (see the module's docstring)."""

    remat_meter = True   # (one of remat's: a meter may linger above it, remat/measure/linger.py)
    off = cut = False    # (a lingering meter's metering is over: ops pass straight through; cut short: linger.py)
    watch = None         # called as watch(func, args, kwargs, ran) before (ran False) and after each op not a view
    leaves = None        # a dict: {id: weak reference} of the leaves needing grad ops take are added to it
    grad_reads = None    # a dict: {storage: shape} of older tensors needing grad that ops take (not parameters)
    sync = False         # synchronize CUDA around each op: its time is its kernels' (options' shares on a GPU)
    again = None         # {key: None} of written state to watch: a write fills in (tensor, its value before it)

    def __new__(cls, *args, **kwargs):
        # Note [Dynamo and the meter]: keep Dynamo away only where it is loaded
        if cls is Instrument and "torch._dynamo" in sys.modules:
            cls = _DynamoSafeInstrument
        return super().__new__(cls)

    @classmethod
    def _should_skip_dynamo(cls):
        return False

    def __init__(self, exclude=(), sources=(), protect=None, writes=True, timeline=False):
        super().__init__()
        self._writes = writes   # note (and clone) the older tensors ops write in place
        self.made = None        # a list: weak references to the tensors ops return are added to it
        # a tensor no op may write: raises ``InputWritten`` before such an op runs
        self._protect = storage_key(protect) if protect is not None else None
        self.live = 0
        self.peak = 0
        self.gate = True   # only storages made while the gate is open are metered
        self.window = set()
        self.window_live = 0
        self.window_peak = 0
        self.created = {}
        self.mutated = {}
        self.reads = set()    # storages an op took as an input it does not write
        self._blind = set()   # writes seen only by their effect (``note_changed``)
        self.op_seconds = 0.0   # time inside the ops it let through
        self._refs = {}
        me = weakref.ref(self)   # (see the module's docstring)
        self._on_free = lambda key, nbytes: (inst := me()) is not None and inst._free(key, nbytes)
        self._exclude = {storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}
        # storages made from older tensors alone (parameters, buffers), not from
        # ``sources``, what the region made or nothing: autocast's cached casts of the weights
        # (and of leaf inputs needing grad, which its cache holds alike)
        self._sources = {storage_key(t) for t in sources if isinstance(t, torch.Tensor)}
        self._from_params = set()
        # storages made from older tensors alone through any number of ops (a
        # parametrized weight), casts of leaves needing grad, and what is made from those
        self._derived = set()
        self.generators = {}   # id -> (torch.Generator an op drew from, its state before the first)
        # what options keep (remat/measure/options.py): each call of a ``KEPT_OPS`` op in turn, as
        # [seconds, bytes it made, an op wrote them since, their spans, FLOPs]; the call that made each live
        # storage they made; the bytes of those an op then wrote; all ops' count and the others' time
        self.kept, self.kept_calls, self.kept_written = {}, [], 0
        self.ops, self.cheap_seconds = 0, 0.0
        # (``timeline``: the live bytes kept ops did not make, and all, at each storage made; the kept ones' spans)
        self._timeline, self._unkept, self.unkept_live, self.events, self.spans = timeline, set(), 0, [], {}

    def ignore_writes(self, tensors):
        """Writes into ``tensors`` from now on are not state of the region (not noted)."""
        self._exclude.update(storage_key(t) for t in tensors)

    def set_gate(self, open_):
        """Meter only storages made while ``open_`` (e.g. inside a chain's forward and backward)."""
        self.gate = open_

    def open_window(self, held=0):
        """From now on also meter storages allocated after this call on their own
        (``window_peak``): what a region adds, however much older memory it frees,
        plus ``held`` bytes of older memory that ``release`` lets go along the way."""
        self.window = set()
        self.window_live = held
        self.window_peak = held

    def release(self, nbytes):
        """Count ``nbytes`` of the older memory given to ``open_window`` as gone."""
        self.window_live -= nbytes

    def count(self, t):
        """Meter ``t``'s storage from now on as if made while the gate was open
        (a tensor made outside the region that the region's budget counts)."""
        for part in dense_parts(t):
            st = part.untyped_storage()
            if not self.created.get(st._cdata):
                self._track(st, st.nbytes())

    def _track(self, st, nbytes, kept=False):
        """Count storage ``st`` as ``nbytes`` live until it is freed (``kept``: a kept op made it)."""
        key = st._cdata
        self.created[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if self._timeline:   # (Note [Measuring an option] 4, remat/measure/options.py)
            if kept:
                self.spans[key] = [len(self.events), None, nbytes]   # (first event, last, bytes)
            else:
                self._unkept.add(key)
                self.unkept_live += nbytes
            self.events.append((self.unkept_live, self.live))
        self._refs[key] = weakref.ref(st, lambda _, key=key, nbytes=nbytes, free=self._on_free: free(key, nbytes))

    def _free(self, key, nbytes):
        self._refs.pop(key, None)
        self.kept.pop(key, None)
        self._from_params.discard(key)
        self._derived.discard(key)
        if self.created.pop(key, None) is not None:
            self.live -= nbytes
            if key in self._unkept:
                self._unkept.discard(key)
                self.unkept_live -= nbytes
            elif key in self.spans:   # (it ends; its key may be used again)
                span = self.spans[key, len(self.events)] = self.spans.pop(key)
                span[1] = len(self.events)
            if key in self.window:
                self.window.discard(key)
                self.window_live -= nbytes

    def __exit__(self, *exc):
        settle()   # (a meter left above this one goes first: remat/measure/linger.py)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        gen = kwargs.get("generator")
        if gen is not None and id(gen) not in self.generators:
            self.generators[id(gen)] = (gen, gen.get_state())
        plan = _PLANS.get(func)
        if plan is None:
            plan = _PLANS[func] = (_written_arguments(func._schema), _returns_views(func._schema))
        writes, views = plan
        self.ops += 1
        if self.leaves is not None or self.grad_reads is not None:
            self._note_leaves(args)
        if views:
            out, dt = self._timed(func, args, kwargs)
            self.cheap_seconds += dt
            return out
        inputs = _storage_keys(args, kwargs)
        if writes:
            written = set()
            for i, name in writes:
                value = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(value, torch.Tensor):
                    written.add(self._note_write(value))
                elif isinstance(value, (list, tuple)):
                    for t in value:
                        if isinstance(t, torch.Tensor):
                            written.add(self._note_write(t))
            if self._protect is not None and self._protect in written:
                raise InputWritten(func)
            for key in written & self.kept.keys():
                self.kept_written += self.created.get(key, 0)
                self.kept_calls[self.kept.pop(key)][2] = True
            self.reads.update(inputs - written)
        else:
            self.reads.update(inputs)
        if self.watch is not None:
            self.watch(func, args, kwargs, False)
        out, dt = self._timed(func, args, kwargs)
        kept = not writes and getattr(func, "overloadpacket", None) in KEPT_OPS
        if kept:
            self.kept_calls.append([dt, 0, False, [], kept_flops(func, args, kwargs, out)])
        self.cheap_seconds += 0.0 if kept else dt
        if self.made is not None:
            self.made.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if isinstance(out, torch.Tensor):
            self._note_outputs((out,), inputs, kept)
            if func is _TO_COPY and args[0].is_leaf and args[0].requires_grad and out.layout == torch.strided:
                # autocast's cache holds a cast of a leaf that needs grad (a weight, the
                # chain's input) to the region's end: counted as a cast of a weight is
                self._from_params.add(out.untyped_storage()._cdata)
                self._derived.add(out.untyped_storage()._cdata)
        elif out is not None:
            self._note_outputs([t for t in tree_leaves(out) if isinstance(t, torch.Tensor)], inputs, kept)
        if self.watch is not None:
            self.watch(func, args, kwargs, True)
        return out

    def _timed(self, func, args, kwargs):
        """``func``'s result and its seconds (kernels included where ``sync``)."""
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if self.sync:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.op_seconds += dt
        return out, dt

    def _note_leaves(self, args):
        for t in (t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                if self.leaves is not None and t.is_leaf and id(t) not in self.leaves:
                    self.leaves[id(t)] = weakref.ref(t)
                if self.grad_reads is not None and not isinstance(t if t._base is None else t._base, _PARAMETER) \
                        and (key := storage_key(t)) not in self.created:   # (nor a view of one: a weight's t())
                    self.grad_reads[key] = t.shape

    def _note_outputs(self, outs, inputs, kept=False):
        created = self.created
        made = None
        if any(t.layout != torch.strided for t in outs):
            outs = [p for t in outs for p in dense_parts(t)]
        for t in outs:
            if t.is_meta:
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in created or key in inputs:
                continue
            # storages made while the gate is shut are not metered at all
            nbytes = st.nbytes() if self.gate else 0
            self._track(st, nbytes, kept)
            if kept:   # (its span: None without ``timeline``)
                self.kept[key] = len(self.kept_calls) - 1
                self.kept_calls[-1][1] += nbytes
                self.kept_calls[-1][3].append(self.spans.get(key))
            if made is None:
                made = not inputs or any(k in created or k in self._sources for k in inputs)
                derived = bool(inputs) and not any(
                    k in self._sources or (k in created and k not in self._derived) for k in inputs)
            if not made:
                self._from_params.add(key)
            if derived:
                self._derived.add(key)
            self.window.add(key)
            self.window_live += nbytes
            self.window_peak = max(self.window_peak, self.window_live)

    def _note_write(self, t):
        key = storage_key(t)
        if self._writes and key not in self.created and key not in self.mutated and key not in self._exclude:
            self.mutated[key] = (t, t.detach().clone())
        elif self.again is not None and self.again.get(key, 1) is None:   # (written again: its value before)
            self.again[key] = (t, t.detach().clone())
        return key

    def note_changed(self, before):
        """Add tensors of ``before`` (tensor, clone) pairs whose values changed."""
        for t, old in before:
            key = storage_key(t)
            if key not in self.mutated and not torch.equal(t, old):
                self.mutated[key] = (t, old)
                self._blind.add(key)

    def alive_bytes(self, besides=()):
        """Bytes of the storages the region made from ``sources`` (or from what it
        made) that are still alive, but those of the tensors ``besides``."""
        skip = {storage_key(t) for t in besides} | self._from_params
        return sum(n for key, n in self.created.items() if key not in skip)

    def held_elsewhere(self, saved, returned, besides=()):
        """The storages the region made that autograd saved and that something
        else holds too (Note [Saved tensors held elsewhere]), as two dicts of
        {storage: bytes}: those made from the region's sources, and those made
        from parameters and buffers alone (a cache's: autocast's or a
        parametrization's). ``saved`` are the tensors remat holds for autograd,
        one each (``detach()``), ``returned`` what the region returned; storages
        of ``besides`` aside."""
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:
            return {}, {}
        skip = {storage_key(t) for t in besides}
        ours = {}      # storage -> the tensors known to hold it
        for t in saved:
            key = storage_key(t)
            if key not in skip and self.created.get(key) and t.layout == torch.strided:
                ours.setdefault(key, [t.untyped_storage(), 0])[1] += 1
        seen = set()
        for t in returned:
            # (a view keeps its base's tensor alive)
            for u in (t, t._base):
                if u is not None and id(u) not in seen and u.layout == torch.strided:
                    seen.add(id(u))
                    if (key := storage_key(u)) in ours:
                        ours[key][1] += 1
        # one more for the storage's own Python object
        held = [key for key, (st, n) in ours.items() if use_count(st._cdata) > n + 1]
        return ({key: self.created[key] for key in held if key not in self._derived},
                {key: self.created[key] for key in held if key in self._derived})

    def reads_state(self):
        """True if the region's result may depend on the values it found in the
        tensors it writes in place (``mutated``): an op read one without writing
        it (spectral norm's power iteration vectors, a quantisation observer's
        range), or a write was only seen by its effect. BatchNorm's running
        statistics are read only by the op that updates them: False."""
        return any(key in self.reads or key in self._blind for key in self.mutated)


class _DynamoSafeInstrument(Instrument):
    """``Instrument``, its ``__torch_dispatch__`` run outside Dynamo as by default (Note [Dynamo and the meter])."""

    __torch_dispatch__ = Instrument.__torch_dispatch__

    @classmethod
    def _should_skip_dynamo(cls):
        return True
