"""One call of a stage in one run of a chain (``StageCall``): its function and
side inputs (never its activation), and what running it again needs and checks:
the state it writes, its module's parameter slots and their version counters,
its side inputs' version counters, its autocast state and the parametrization
cache as it found them (Note [Replaying a stage], remat/runtime/replay.py).
"""

import contextlib
import sys

import torch
import torch.nn.utils.parametrize as _parametrize

from ..dynamo import STANCES
from ..errors import StageError
from .tensor_slots import NO_SLOTS

__all__ = ["StageCall", "first"]


class StageCall:
    """One stage's call in one run: what it needs to run again."""

    __slots__ = ("index", "name", "fn", "args", "kwargs", "pos", "in_kw", "rng", "state", "before", "meta",
                 "input_requires_grad", "grad_replay", "slots", "tensors", "versions", "side", "autocast", "flags",
                 "count", "pcache")

    def __init__(self, index, name, fn, args, kwargs, pos, in_kw, input_requires_grad):
        self.index = index
        self.name = name
        self.fn = fn
        # never hold the activation itself: only its side inputs
        if in_kw is not None:
            kwargs = dict(kwargs)
            kwargs[in_kw] = None
        else:
            args = args[:pos] + (None,) + args[pos + 1:]
        self.args = args
        self.kwargs = kwargs
        self.pos = pos
        self.in_kw = in_kw
        self.rng = None
        self.state = ()
        self.before = None   # the values of ``state`` before the stage's first forward, if it reads them
        self.meta = None
        self.grad_replay = False
        self.input_requires_grad = input_requires_grad
        self.slots = NO_SLOTS   # where its module's parameters and buffers live (Note [Replaying a stage] 5)
        self.tensors = None     # the tensors in those slots as it ran
        self.versions = None    # the parameters' version counters after its forward
        self.side = ()          # (tensor, version after its forward) of each tensor side input
        self.autocast = None    # the autocast state it ran in (Note [Replaying a stage] 2)
        self.flags = None       # its parameters' dtype and requires_grad as it ran (tensor_slots.param_flags)
        self.count = None       # how many tensors its forward saved, where ``meta`` (recorded) is not it
        # the parametrization cache as its forward found it (Note [Replaying a stage] 6)
        self.pcache = dict(_parametrize._cache) if _parametrize._cache_enabled else None

    def seal(self):
        """After the stage's forward: note the version counters a recomputation checks."""
        tensors = self.tensors
        if tensors is not None:
            self.versions = [-1 if t is None else t._version for t in tensors[:self.slots[1]]]
        args, kwargs = self.args, self.kwargs
        if len(args) == 1 and not kwargs:
            return   # (args is (None,): the activation alone, left out)
        side = [a for a in args if isinstance(a, torch.Tensor)]
        if kwargs:
            side += [a for a in kwargs.values() if isinstance(a, torch.Tensor)]
        if side:
            self.side = [(t, t._version) for t in side]

    def check_side(self):
        """Raise if a tensor side input changed in place since the forward (and is not
        state the stage itself writes, put back after each run: Note [Replaying a stage] 3)."""
        for j, (t, version) in enumerate(self.side):
            if t._version != version and not any(t is s for s in self.state):
                raise StageError(
                    f"remat: a tensor side input of stage {self.index} ({self.name}) (the {_ordinal(j + 1)}) "
                    f"was modified in place between the forward and the backward; remat recomputes the "
                    f"stage in the backward from the values its forward used, and those are gone. Pass "
                    f"the stage a copy (.clone()), or change the tensor after the backward")

    def activation(self, x):
        """Run the stage again on activation ``x`` with its side inputs; return the activation out."""
        if self.pcache is None and not _parametrize._cache_enabled:
            return first(self.invoke(x))
        with _parametrize_cache(self.pcache):
            return first(self.invoke(x))

    def invoke(self, x):
        """Run the stage on activation ``x``; return what it returns."""
        args, kwargs = self.args, self.kwargs
        if self.in_kw is not None:
            kwargs = dict(kwargs)
            kwargs[self.in_kw] = x
        else:
            args = args[:self.pos] + (x,) + args[self.pos + 1:]
        if STANCES and "torch._dynamo" in sys.modules:   # Note [Compiled code in a stage] (remat/dynamo.py)
            with torch.compiler.set_stance("force_eager"):
                return self.fn(*args, **kwargs)
        return self.fn(*args, **kwargs)

@contextlib.contextmanager
def _parametrize_cache(entries):
    """``torch.nn.utils.parametrize``'s cache as a stage's forward found it: on
    (holding ``entries``, the parametrized tensors computed before the stage) or
    off, whatever it is now."""
    enabled, cache = _parametrize._cache_enabled, _parametrize._cache
    _parametrize._cache_enabled = 0 if entries is None else 1
    _parametrize._cache = {} if entries is None else dict(entries)
    try:
        yield
    finally:
        _parametrize._cache_enabled, _parametrize._cache = enabled, cache


def _ordinal(n):
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def first(out):
    """The activation of what a stage returned."""
    return out[0] if isinstance(out, tuple) else out
