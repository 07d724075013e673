"""``remat.stage``: mark a function, a method or a module instance as one
stage of a chain (docs/how-it-works.md, "The life of a chain").

Outside a chain, or under ``torch.no_grad()``, a stage is the undecorated
code plus one thread-local lookup. Inside a chain its call is handed to the
chain (``ChainCall``, remat/runtime/chain_call.py), which records, measures or runs it on the schedule.

Note [Compiling around a stage]
-------------------------------
``torch.compile(remat.stage(block))`` (or ``block.compile()``) has Dynamo
trace the stage's call, and through it, inside a chain, remat's own code:
measuring, hooks, the storage meter. Dynamo compiled that code piece by piece
(torch 2.13: 13 of the 16 graphs of three calls of a two-stage chain were
remat's bookkeeping), warned about what it cannot trace, and on some releases
failed inside it (2.5: an internal error; 2.7: a wrong value on resuming after
a graph break). So the chain's code is kept from Dynamo
(``torch.compiler.disable``): inside a chain the stage runs eagerly, with
exact gradients, and a warning says so once; outside a chain it is compiled
as usual. Compiled code inside a stage (``remat.stage(torch.compile(block))``)
runs eagerly inside a chain too: Note [Compiled code in a stage] in
remat/dynamo.py.
"""

import functools
import types
import warnings
import weakref

import torch

from .chain import active as _active
from .dynamo import DYNAMO_SKIPS
from .errors import StageError, UsageError

__all__ = ["stage", "is_stage", "unstage"]


class _StageForward:
    """The instance ``forward`` that ``stage(module)`` installs.

    It calls the forward the module had: an instance ``forward`` already there
    (``torch.compile``'s OptimizedModule, hooks of other libraries), else the
    class's. It pickles as (class, module, that forward), so a marked module
    saves and loads with ``torch.save``/``torch.load`` and deep-copies.
    """

    __slots__ = ("module", "inner")

    def __init__(self, module, inner=None):
        # (weakly: the module's __dict__ holds this, and a chain's record holds that
        # dict; a strong reference back kept a deleted model alive while it was cached)
        self.module = weakref.ref(module)
        self.inner = inner

    def __reduce__(self):
        return (_StageForward, (self.module(), self.inner))

    def __call__(self, *args, **kwargs):
        module = self.module()
        if module is None:
            raise StageError("remat: the module whose forward this was is gone (a forward taken from a "
                                 "stage module outlived it); call the module itself")
        current, inner = _active(), self.inner
        if current is None:   # (the class's forward called on the module: Dynamo traces it with fullgraph=True)
            return inner(*args, **kwargs) if inner is not None else type(module).forward(module, *args, **kwargs)
        # (a bound method made directly: torch 2.5's dynamo fails to trace a function's __get__)
        forward = inner if inner is not None else types.MethodType(type(module).forward, module)
        return _hand_over(current, module, type(module).__name__, forward, args, kwargs)


def _hand_over(current, ident, name, fn, args, kwargs):
    """Hand a stage's call to the open chain ``current``."""
    if _compiling():
        if not _kept_from_dynamo:
            # made here, not at import: torch.compiler.disable imports Dynamo (a second)
            _kept_from_dynamo.append(torch.compiler.disable(_hand_over_eagerly))
        return _kept_from_dynamo[0](current, ident, name, fn, args, kwargs)
    return current.call(ident, name, fn, args, kwargs)


_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
_kept_from_dynamo = []
_warned = []


def _hand_over_eagerly(current, ident, name, fn, args, kwargs):
    """The chain's code, kept from Dynamo (Note [Compiling around a stage])."""
    if not _warned:
        _warned.append(True)
        warnings.warn(
            f"remat: stage {name} is reached by torch.compile (a compiled stage, torch.compile("
            f"remat.stage(block)) or block.compile(), or a model compiled around its chain) but runs "
            f"eagerly inside a chain, where remat's own code is kept from Dynamo; outside a chain code "
            f"runs compiled, but for the code after the chain in the function that opens it, which "
            f"Dynamo does not resume (a compiled model's head and loss run eagerly: compile them apart). "
            f"Gradients are exact either way",
            stacklevel=2,
        )
    return current.call(ident, name, fn, args, kwargs)


def stage(obj):
    """Make ``obj`` one stage of the chains it is called in.

    Args:
        obj: a function, a method (decorate ``forward``), or an ``nn.Module``
            instance, which is marked in place and returned (for modules of
            other libraries).

    Returns:
        The decorated function, or the same module.

    Inside ``remat.chain`` the first tensor argument is the activation; other
    arguments are side inputs, held as given. A stage returns the activation,
    or a tuple whose first item is it and whose other items need no grad. A
    stage must not modify its input in place and must compute the same thing
    when run again on the same input, RNG state aside (remat replays RNG).

    Example:
        >>> import torch, remat
        >>> class Block(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(8, 8)
        ...     @remat.stage
        ...     def forward(self, x):
        ...         return torch.relu(self.lin(x))
        >>> Block()(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """
    if isinstance(obj, _SCRIPTED):
        raise UsageError(
            f"remat.stage cannot mark TorchScript code ({type(obj).__name__}, from torch.jit.script or "
            f"torch.jit.trace): remat measures and replays a stage through its Python code. Mark the "
            f"eager module or function instead")
    if isinstance(obj, torch.nn.Module):
        inner = obj.__dict__.get("forward")
        if isinstance(inner, _StageForward):
            return obj
        if inner is None and getattr(type(obj).forward, "_remat_stage", False):
            return obj
        obj.forward = _StageForward(obj, inner)
        return obj
    if isinstance(obj, (staticmethod, classmethod)):   # (@remat.stage above @staticmethod)
        return type(obj)(stage(obj.__func__))
    if isinstance(obj, type):
        raise UsageError(
            f"remat.stage marks a function, a method or a module instance, not the class {obj.__name__}: "
            f"decorate its forward (@remat.stage above def forward) or mark an instance "
            f"(remat.stage({obj.__name__}(...)))")
    if not callable(obj):
        raise UsageError(f"remat.stage needs a function, a method or an nn.Module, got {type(obj).__name__}")
    if getattr(obj, "_remat_stage", False):
        return obj
    try:
        weakref.ref(obj)
    except TypeError:   # (a builtin, torch.Tensor.exp: the stage's identity is a Python function)
        fn = obj

        def obj(*args, **kwargs):
            return fn(*args, **kwargs)

        functools.update_wrapper(obj, fn)
    return _StageFunction(obj)


_SCRIPTED = tuple(getattr(torch.jit, name) for name in ("ScriptModule", "ScriptFunction")
                  if isinstance(getattr(torch.jit, name, None), type))


class _StageFunction:
    """A function marked as a stage; as a class attribute it binds like a method."""

    _remat_stage = True

    def __init__(self, fn, owner=None):
        self.fn = fn
        self.owner = owner
        functools.update_wrapper(self, fn)
        self.name = getattr(fn, "__qualname__", getattr(fn, "__name__", "stage"))

    def __get__(self, instance, cls=None):
        if instance is None:
            return self
        return _BoundStage(self.fn.__get__(instance, cls), instance, self.name)

    def __call__(self, *args, **kwargs):
        current = _active()
        if current is None:
            return self.fn(*args, **kwargs)
        owner = self.owner
        if owner is not None:
            label = type(owner).__name__ if isinstance(owner, torch.nn.Module) else self.name
            return _hand_over(current, owner, label, self.fn, args, kwargs)
        return _hand_over(current, self.fn, self.name, self.fn, args, kwargs)


DYNAMO_SKIPS.append(_StageFunction.__get__)   # Note [Compiling a model around a chain] in remat/dynamo.py


class _BoundStage:
    """A stage method bound to its instance (the instance is the stage's identity)."""

    __slots__ = ("fn", "owner", "name")
    _remat_stage = True

    def __init__(self, fn, owner, name):
        self.fn = fn
        self.owner = owner
        self.name = name

    def __call__(self, *args, **kwargs):
        current = _active()
        if current is None:
            return self.fn(*args, **kwargs)
        owner = self.owner
        label = type(owner).__name__ if isinstance(owner, torch.nn.Module) else self.name
        return _hand_over(current, owner, label, self.fn, args, kwargs)


def is_stage(obj):
    """True if ``obj`` (a function or module) is a remat stage."""
    if isinstance(obj, torch.nn.Module):
        fwd = obj.__dict__.get("forward")
        return isinstance(fwd, _StageForward) or getattr(type(obj).forward, "_remat_stage", False)
    return getattr(obj, "_remat_stage", False)


def unstage(module):
    """Undo ``stage(module)`` on a module instance (an instance ``forward`` it
    had before comes back); returns the module."""
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, _StageForward):
        if fwd.inner is None:
            del module.__dict__["forward"]
        else:
            module.forward = fwd.inner
    return module
