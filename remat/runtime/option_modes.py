"""The dispatch modes of a stage recorded with an option (``option_contexts``):
the cache of its expensive ops' outputs, kept in its forward and handed back
in its rebuild before B(i).

Note [Running an option]
------------------------
Option 1 of a stage (remat/solver/option.py Note [Options]) is the policy of
torch's selective activation checkpointing (SAC) that keeps matmul outputs:
the outputs of ``KEPT_OPS`` (mm, addmm, bmm, convolutions, attention kernels)
stay, every other op (pointwise, norms, softmax, dropout) runs again in B(i).
Option 2 keeps fewer: those of the outputs that autograd saves (or that are
the stage's output); an expensive output only a later op reads and lets go (a
residual branch's projection, summed into the stream) runs again too. A rung
(6 of Note [Measuring an option], remat/measure/options.py) keeps the outputs
of some calls of those ops, numbered in the forward's order.
``Fall(i, option=o)`` runs the stage as ``Fck`` does (its input kept, handles
for what autograd saves) under the forward mode of ``option_contexts()``,
which caches those outputs (option 2 then lets go of those no handle's
storage shares: ``keep_only``); the anchor holds the recompute mode
(``_Anchor.cache``) and with it the cache. The rebuild before
B(i) is the usual ``Fall`` recomputation (RNG, autocast and state replayed,
saved tensors checked) under that mode: kept ops hand back the cached
tensors, the others run; a later rebuild runs the whole stage (same bits). A
backward-phase ``Fall(i, option=o)`` records under the forward mode and lets
the saved tensors go. a^i is in the option's record: the stage after keeps
it as its input, as after a stage recorded whole. The modes are remat's, not
torch's SAC pair: torch's imports Dynamo and sympy on its first op (over a
second) and refuses a recomputation that runs a cheap op its forward did not
(an autocast cast the forward found cached); remat's file only the kept ops,
by op and argument shapes, and make again an output written in place since
(its version counter moved, or an op wrote its storage: a bias-free linear
on a 3-D input returns ``_unsafe_view`` of its ``mm``, which shares the
storage and not the counter, and SwiGLU's ``h *= silu(gate(x))`` wrote it
unseen, the rebuild handed it back written: wrong gradients). Each op goes through Python: measured into the
option's fwd_time (remat/measure/options.py). Deciding at pack time, from the
op that made each saved tensor, would skip that cost: not done (a cached
output must be handed back to the very op that made it, and what links the two
without a mode is autograd's node order, which an autocast cast found cached in
one run and not the other shifts).
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KEPT_OPS", "KEEP_EXPENSIVE", "KEEP_SAVED", "Calls", "keep_only", "kept_flops", "option_contexts",
           "written_arguments"]

# what a stage's option keeps (``Plan.policy``, remat/solver/plan.py): every output of
# ``KEPT_OPS`` (option 1), or those of them autograd saves and the stage's output (option 2);
# ``Calls``: those of the calls of ``KEPT_OPS`` it numbers, in the forward's order (a rung)
KEEP_EXPENSIVE, KEEP_SAVED = 1, 2


class Calls(frozenset):
    """A rung's policy: the numbers of the kept ops' calls whose outputs it keeps, in
    a forward that makes ``total`` such calls (one that makes another number keeps none)."""

    def __new__(cls, calls, total):
        self = super().__new__(cls, calls)
        self.total = total
        return self

    def __reduce__(self):
        return Calls, (frozenset(self), self.total)

KEPT_OPS = frozenset(getattr(torch.ops.aten, name) for name in (   # the expensive ops, whose outputs it keeps
    "mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "linear", "convolution", "_convolution",
    "mkldnn_convolution", "cudnn_convolution", "convolution_overrideable", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_efficient_attention_forward", "_flash_attention_forward")
    if hasattr(torch.ops.aten, name))


_FLOPS = {}   # op -> torch's FLOP formula for it (torch.utils.flop_counter), filled on first use


def kept_flops(func, args, kwargs, out):
    """The floating-point operations of a call of a kept op, by torch's formula for
    it (``torch.utils.flop_counter``); None where torch has none."""
    if not _FLOPS:
        from torch.utils.flop_counter import flop_registry
        _FLOPS.update(flop_registry)
        flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
        if flash in _FLOPS and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            _FLOPS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _FLOPS[flash]   # (its q, k, v first)
    formula = _FLOPS.get(getattr(func, "overloadpacket", None))
    try:
        return None if formula is None else int(formula(*args, **kwargs, out_val=out))
    except Exception:   # (a formula that does not take these arguments: ranked by time instead)
        return None


def option_contexts():
    """An option's (forward, recompute) dispatch modes, sharing one cache of the
    outputs of ``KEPT_OPS``: the first keeps them, the second hands them back,
    each op's in the order it made them, and runs every other op."""
    cache = {}   # (op, its tensor arguments' shapes and dtypes) -> [(outputs detached, their versions, call)]
    return _Keeping(cache), _Handing(cache)


def _key(func, args):
    """Where a kept op's outputs are filed (None for other ops): by the op and its tensor arguments'
    shapes and dtypes, so that a recomputation that skips one (a cached parametrization) shifts no other."""
    if getattr(func, "overloadpacket", None) not in KEPT_OPS or func._schema.is_mutable:
        return None
    return (func, *[(a.shape, a.dtype) for a in args if isinstance(a, torch.Tensor)])


class _Mode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls):   # (Note [Dynamo and the meter], remat/measure/meter.py)
        return False

    def __init__(self, cache):
        super().__init__()
        self.cache = cache
        self.calls = 0   # (the forward's kept calls so far: each is numbered)
        self.written = set()   # (the storages ops wrote in place: ``_Keeping``)


class _Keeping(_Mode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _WRITES:
            _WRITES[func] = written_arguments(func._schema)
        if self.cache and _WRITES[func]:   # (by storage, as the meter sees writes: a kept output written
            self.written.update(_written(func, args, kwargs))   # through ``_unsafe_view``, a bias-free linear's
        out = func(*args, **(kwargs or {}))                     # on 3-D input, moves no version: wrong gradients)
        key = _key(func, args)
        if key is not None:
            # (detached below autograd, sharing the version counter: a write into it shows)
            with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
                kept = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in _many(out))
            kept = kept if isinstance(out, (tuple, list)) else kept[0]
            self.cache.setdefault(key, []).append((kept, _versions(kept), self.calls))
            self.calls += 1
        return out

    def __exit__(self, *exc):   # outputs the stage wrote into in place are not kept: made again in B(i)
        for listed in self.cache.values():
            listed[:] = [(kept if _versions(kept) == v and not self.written & _storages(kept) else None, v, j)
                         for kept, v, j in listed]
        self.written.clear()
        return super().__exit__(*exc)


class _Handing(_Mode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        listed = self.cache.get(_key(func, args)) if self.cache else None
        if listed:
            out, versions, _ = listed.pop(0)
            if out is not None and _versions(out) == versions:   # (else written since: made again)
                return out
        return func(*args, **(kwargs or {}))


def _many(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def _versions(out):
    return tuple(t._version for t in _many(out) if isinstance(t, torch.Tensor))


# ops that write arguments in place their schema does not say they write (BatchNorm's statistics): name -> positions
_UNDECLARED_WRITES = {f"aten::{kind}_batch_norm": (3, 4) for kind in ("native", "cudnn", "miopen")}
_WRITES = {}   # op -> ``written_arguments`` of its schema


def written_arguments(schema):
    """(position, name) of the arguments an op writes in place."""
    if schema.is_mutable:
        return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                     if a.alias_info is not None and a.alias_info.is_write)
    return tuple((i, None) for i in _UNDECLARED_WRITES.get(schema.name, ()))


def _storages(out):
    return {t.untyped_storage()._cdata for t in _many(out) if isinstance(t, torch.Tensor) and t.layout == torch.strided}


def _written(func, args, kwargs):
    """The storages of the arguments ``func`` writes in place (``written_arguments``)."""
    for i, name in _WRITES.get(func, ()):
        value = args[i] if i < len(args) else (kwargs or {}).get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                yield t.untyped_storage()._cdata


def keep_only(modes, policy, saved, out):
    """Of the outputs the forward mode of ``modes`` (its recompute mode) kept, keep
    what ``policy`` says; the others are made again in B(i). ``KEEP_SAVED``: those
    whose storage one of ``saved`` (what autograd saved) or the stage's output
    ``out`` shares; ``Calls``: the outputs of those calls, where the forward made as many
    calls as the stage's measured one (else none: fewer bytes than planned, never more)."""
    if policy == KEEP_SAVED:
        keys = {t.untyped_storage()._cdata for t in (*saved, out) if isinstance(t, torch.Tensor)
                and t.layout == torch.strided}

        def keep(kept, _):
            return any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in keys for t in _many(kept))
    elif isinstance(policy, frozenset):
        same = sum(map(len, modes.cache.values())) == getattr(policy, "total", None)

        def keep(_, j):
            return same and j in policy
    else:
        return
    for listed in modes.cache.values():
        listed[:] = [(kept if kept is not None and keep(kept, j) else None, v, j) for kept, v, j in listed]
