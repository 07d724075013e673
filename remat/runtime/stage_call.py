"""One call of a stage in one run of a chain (``StageCall``): its function and
side inputs (never its activation), and what running it again needs and checks:
the state it writes, its module's parameter slots and their version counters,
its side inputs' version counters, its autocast state and the parametrization
cache as it found them (Note [Replaying a stage], remat/runtime/replay.py).

And what each stage call is checked against: the activation among its arguments
(``find_activation``), that it was handed on from the stage before
(``handed_on``), what it returned (``check_output``), and on later calls, that it
is the stage recorded, on a like input, made of the same modules
(``signature_matches``, ``same_structure``; Note [Chain keys], remat/chain.py).
The measuring call (remat/measure/measuring.py) records what these read, the running
calls (remat/runtime/runner.py) compare.
"""

import collections.abc
import contextlib
import dataclasses
import functools
import inspect
import itertools
import operator
import sys
import weakref

import torch
import torch.nn.utils.parametrize as _parametrize
from torch.nn.modules import module as nn_module
from torch.utils._pytree import tree_leaves

from ..dynamo import STANCES, eval_frame_callback
from ..errors import StageError, input_modified
from .recompute import NO_SLOTS, hooks_disabled

__all__ = ["StageCall", "check_hooks_enabled", "check_output", "find_activation", "first", "handed_on",
           "hooks_between", "input_signature", "module_dicts", "module_structure", "out_tensors", "packed_hint",
           "same_structure", "signature", "signature_matches", "trained_as"]


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
        self.flags = None       # its parameters' dtype and requires_grad as it ran (replay.param_flags)
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
        if STANCES and "torch._dynamo" in sys.modules and (eval_frame_callback is None
                                                           or eval_frame_callback() in (None, False)):
            # Note [Compiled code in a stage] (remat/dynamo.py)
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
    """The activation of what a stage returned: itself, the first item of a tuple, or
    the first value of a dict or a dataclass (a transformers ``ModelOutput``)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0] if out else None
    items = _items(out)
    return items[0] if items else out


def out_tensors(out):
    """The tensors among what a stage returned: in tuples, lists and dicts (and what
    else torch's pytree takes apart) and in dataclasses, which it does not."""
    found = []
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += out_tensors(_items(leaf))
    return found


def _items(out):
    """The values of a dict or a dataclass, in order (None for anything else)."""
    if isinstance(out, collections.abc.Mapping):
        return list(out.values())
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [getattr(out, f.name) for f in dataclasses.fields(out)]
    return None


def layout(t):
    """A tensor's strides (None for one without: sparse, nested): ops on another
    layout of the same shape may save other tensors (a linear layer on a transposed
    input saves a copy of it), so a stage's record holds for one. One call: checked
    between two stages' forwards, each read of a tensor's fields costs about a
    microsecond there (Note [Stages recorded whole], remat/runtime/runner.py)."""
    try:
        return t.stride()
    except (RuntimeError, NotImplementedError):
        return None


def signature(value):
    """A hashable summary of a stage's arguments: tensors by shape, dtype, device,
    requires_grad and ``layout``, small Python values by value, other objects by type."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.requires_grad, layout(value))
    if isinstance(value, (tuple, list)):
        return tuple(signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, signature(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def module_structure(ident):
    """What a stage module is made of, for ``same_structure`` on later calls: each
    module's ``_modules`` dict with weak references to its children as measured (a
    submodule replaced: a BatchNorm reset by a new one), and each one's
    ``_parameters`` and ``_buffers`` dicts with their sizes (a buffer registered
    since, a parameter deleted); None for a function stage."""
    if not isinstance(ident, torch.nn.Module):
        return None
    mods = tuple(ident.modules())
    children = tuple(m._modules for m in mods)
    refs = [_NONE if c is None else weakref.ref(c) for d in children for c in d.values()]
    tensors = tuple(d for m in mods for d in (m._parameters, m._buffers))
    return children, refs, tensors, list(map(len, tensors))


def _NONE():
    return None


def same_structure(structure):
    """The stage module is still made as ``module_structure`` found it."""
    if structure is None:
        return True
    children, refs, tensors, sizes = structure
    if list(map(len, tensors)) != sizes:
        return False
    now = list(itertools.chain.from_iterable(map(dict.values, children)))
    return len(now) == len(refs) and all(map(operator.is_, now, [r() for r in refs]))


def module_dicts(ident):
    """The ``__dict__`` of a stage module and of each submodule, where their
    training flags live (read on every call by ``input_signature``), or ()."""
    if not isinstance(ident, torch.nn.Module):
        return ()
    return tuple(m.__dict__ for m in ident.modules())


def _settings(dicts):
    """The settings in the ``__dict__`` of each of a stage's modules (``dicts``) that change what
    a forward saves: its training flag and dropout rate (nn.Dropout's p; the floats Hugging
    Face attention and MLP modules hand F.dropout)."""
    return tuple([(d.get("training"), d.get("p"), d.get("dropout"), d.get("attention_dropout"),
                   d.get("activation_dropout")) for d in dicts])


def input_signature(x, call, dicts):
    """What each stage of a chain's record is checked against on later calls: input
    shape and dtype, the training flags and dropout rates of its module and
    submodules (a stage, or a BatchNorm inside it, switched to eval or back, or a
    dropout switched on, is measured again: dropout warm-up from p=0 went 14% over
    the budget), its side inputs by ``signature`` (an encoder output of another
    length, another model's weights passed to a function stage) and its input's
    ``layout``."""
    return (tuple(x.shape), x.dtype, _settings(dicts), signature((call.args, call.kwargs)), layout(x))


_NO_SIDE = signature(((None,), {}))   # a stage given its activation alone


def signature_matches(sig, x, call, dicts=None):
    """``input_signature(x, call, dicts) == sig``, with less work: every stage of
    every call is checked. With ``dicts`` None the training flags are left out
    (``trained_as``)."""
    if x.shape != sig[0] or x.dtype != sig[1] or (dicts is not None and not trained_as(sig, dicts)):
        return False
    if layout(x) != sig[4]:
        return False
    args, kwargs = call.args, call.kwargs
    if len(args) == 1 and not kwargs:   # (args is (None,): the activation, left out)
        return sig[3] == _NO_SIDE
    return signature((args, kwargs)) == sig[3]


def trained_as(sig, dicts):
    """The training flags and dropout rates of a stage's module and submodules (``dicts``,
    their ``__dict__``) are those of ``input_signature``'s ``sig``."""
    try:
        return _settings(dicts) == sig[2]
    except RuntimeError:   # (a tensor by one of those names, of several elements: no truth value)
        return False


def find_activation(args, kwargs, start, fn=None):
    """(position, keyword, tensor) of a stage call's activation: its first tensor
    argument from ``start`` on, else its first tensor keyword argument in the order
    of ``fn``'s parameters (``blk(mask=m, hidden_states=h)`` passes ``h``)."""
    for i in range(start, len(args)):
        if isinstance(args[i], torch.Tensor):
            return i, None, args[i]
    names = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
    if len(names) > 1 and fn is not None:
        # by the signature; among names it does not list (``**kwargs``), one needing grad first
        order = _parameter_order(getattr(fn, "__func__", fn))
        names.sort(key=lambda name: (order.get(name, len(order)), not kwargs[name].requires_grad))
    if names:
        return None, names[0], kwargs[names[0]]
    return None, None, None


@functools.lru_cache(maxsize=256)
def _parameter_order(fn):
    """{name: position} of ``fn``'s parameters (empty if it has no signature)."""
    try:
        return {name: i for i, name in enumerate(inspect.signature(fn).parameters)}
    except (TypeError, ValueError):
        return {}


def handed_on(x, prev):
    """True if stage input ``x`` is ``prev``, the previous stage's output, or that
    tensor as ``torch.nn.Module`` passes it on around a module with full backward
    hooks: an identity view (same storage, layout and values) made by one
    ``BackwardHookFunction`` per hooked call, whose graph node leads to ``prev``'s."""
    if x is prev:
        return True
    if (x.data_ptr() != prev.data_ptr() or x.shape != prev.shape or x.stride() != prev.stride()
            or x.dtype != prev.dtype or x.device != prev.device):
        return False
    node, nr = x.grad_fn, x.output_nr
    target, target_nr = prev.grad_fn, prev.output_nr
    # (prev itself may come out of one: the stage returned a hooked submodule's output)
    while node is not None and not (node is target and nr == target_nr) and \
            type(node).__name__ == "BackwardHookFunctionBackward":
        node, nr = node.next_functions[nr]
    return node is target and (node is None or nr == target_nr)


def check_output(call, out, x, version):
    """What a stage returned is an activation (or a tuple led by one, the rest needing
    no grad) and its input was not modified in place; returns the activation."""
    items = list(out) if isinstance(out, tuple) else None if isinstance(out, torch.Tensor) else _items(out)
    act = out if items is None else items[0] if items else None
    if not isinstance(act, torch.Tensor):
        kind = "tuple" if isinstance(out, tuple) else type(out).__name__
        what = (f"a {kind} whose first item is {type(act).__name__}" if items is not None
                else type(act).__name__)
        raise StageError(
            f"remat: stage {call.index} ({call.name}) returned {what}; a stage must return "
            f"its output activation as a tensor, or a tuple, a dict or a dataclass whose first item "
            f"is that tensor"
        )
    if items is not None:
        for j, item in enumerate(items[1:], 1):
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(item)):
                raise StageError(
                    f"remat: stage {call.index} ({call.name}) returned a {type(out).__name__} whose item {j} "
                    f"requires grad; only the first item, the activation, may carry gradient. If that item needs "
                    f"none, detach it; if the next stage takes it (T5's position_bias), the blocks exchange "
                    f"two tensors, which a chain cannot carry: compute it before the chain and pass it to "
                    f"every stage as a side input, or pack it into the activation (docs/limitations.md)"
                )
    if x._version != version:
        raise input_modified(call.index, call.name)
    return act


def check_hooks_enabled(name):
    """A chain needs saved-tensor hooks, which ``disable_saved_tensors_hooks`` turns off."""
    why = hooks_disabled()
    if why is not None:
        raise StageError(
            f"remat: a chain opened where saved-tensor hooks are disabled (by "
            f"torch.autograd.graph.disable_saved_tensors_hooks: {why!r}), at its first stage ({name}); "
            f"remat drops and recomputes saved tensors through those hooks. Run the chain outside "
            f"that context, or without remat.chain there")


def hooks_between(before, after):
    """For an error about code between two stages: a sentence on the module hooks
    that run there, around the stages' forwards (``before``'s forward hooks,
    ``after``'s forward pre-hooks, global ones), or ""."""
    hooks = []
    if getattr(before, "_forward_hooks", None) or nn_module._global_forward_hooks:
        hooks.append("forward hooks")
    if getattr(after, "_forward_pre_hooks", None) or nn_module._global_forward_pre_hooks:
        hooks.append("forward pre-hooks")
    if not hooks:
        return ""
    return (f". The stage modules' {' and '.join(hooks)} run there, around the stages' forwards: if one "
            f"changes the activation, register it on a submodule inside the stage instead, or do its work "
            f"in the forward")


def packed_hint(args, kwargs):
    """For a stage called with no tensor: a sentence on a tuple or a dict of tensors among
    its arguments (a stage before returned one and the code passed all of it on), or ""."""
    for value in [*args, *kwargs.values()]:
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return (f". It got a {type(value).__name__} of {len(value)} whose first item is a tensor, as a "
                    f"stage that returns (activation, ...) gives: unpack it and pass the activation "
                    f"(h = block(h)[0], or h, *rest = block(h))")
        if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
            keys = ", ".join(repr(k) for k, v in value.items() if isinstance(v, torch.Tensor))
            return (f". It got a {type(value).__name__} of tensors ({keys}): pass the activation itself "
                    f"(h = out[{next(iter(keys.split(', ')))}], say), and the rest as side inputs")
    return ""
