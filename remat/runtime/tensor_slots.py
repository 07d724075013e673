"""Where a stage module's parameters, buffers and plain tensor attributes live,
and putting the forward's back in their places for a recomputation (Note
[Replaying a stage] 5 in remat/runtime/replay.py).

A stage's ``slots`` are the (dict, name) pairs of its module and submodules
(``_parameters``, ``_buffers``, ``__dict__``); each call takes the tensors
found there as it runs the stage (``take``), the checks of Note [Chain keys]
(remat/chain.py) compare them with those of the chain's record, and a recomputation puts
them back where they were replaced since (``ForwardTensors``).
"""

import itertools
import operator
import weakref

import torch

from ..errors import StageError

__all__ = ["NO_SLOTS", "module_slots", "take", "param_flags", "state_plan", "resolve_state", "ForwardTensors"]


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


def param_flags(tensors, n):
    """dtype, requires_grad and shape of each of the first ``n`` of ``tensors``
    (the parameters), a list."""
    return [None if t is None else (t.dtype, t.requires_grad, t.shape) for t in tensors[:n]]


def state_plan(state, tensors):
    """How to find each tensor of ``state`` on later calls: the index among
    ``tensors`` (the call's ``take``) of the slot whose tensor it is or shares its
    storage with (a stage may write a buffer through an alias it makes, which dies
    with the call: ``buf.view(-1).mul_()``, instance norm's running statistics,
    an embedding's ``max_norm`` renormalising ``weight.detach()``), or else a weak
    reference to it or to the tensor it is a view of."""
    at = {id(t): i for i, t in enumerate(tensors) if t is not None}
    shared = {t.untyped_storage()._cdata: i for i, t in enumerate(tensors)
              if t is not None and t.layout == torch.strided}
    plan = []
    for t in state:
        i = at.get(id(t))
        if i is None and t.layout == torch.strided:
            i = shared.get(t.untyped_storage()._cdata)
        if i is None:
            while t._base is not None:
                t = t._base
            plan.append(weakref.ref(t))
        elif i not in plan:
            plan.append(i)
    return plan


def resolve_state(plan, tensors):
    """The state tensors of one call from ``state_plan``'s list (dead ones left out)."""
    out = []
    for p in plan:
        t = tensors[p] if type(p) is int else p()
        if t is not None:
            out.append(t)
    return out


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
