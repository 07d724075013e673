"""What each stage call is checked against: the activation among its arguments
(``find_activation``), that it was handed on from the stage before
(``handed_on``), what it returned (``check_output``), and on later calls, that it
is the stage recorded, on a like input, made of the same modules
(``signature_matches``, ``same_structure``; Note [Chain keys], remat/chain.py).
The measuring call (remat/measure/measuring.py) records what these read, the running
calls (remat/runtime/runner.py) compare.
"""

import functools
import inspect
import itertools
import operator
import weakref

import torch
from torch.utils._pytree import tree_leaves

from ..errors import StageError, input_modified
from .recompute import hooks_disabled

__all__ = ["check_hooks_enabled", "check_output", "find_activation", "handed_on", "input_signature",
           "module_dicts", "module_structure", "same_structure", "signature", "signature_matches", "trained_as"]


def signature(value):
    """A hashable summary of a stage's arguments: tensors by shape, dtype, device and
    requires_grad, small Python values by value, other objects by type."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.requires_grad)
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


def input_signature(x, call, dicts):
    """What each stage of a recording is checked against on later calls: input
    shape and dtype, the training flags of its module and submodules (a stage, or
    a BatchNorm inside it, switched to eval or back is measured again), and its
    side inputs by ``signature`` (an encoder output of another length, another
    model's weights passed to a function stage)."""
    return (tuple(x.shape), x.dtype, tuple([d.get("training") for d in dicts]),
            signature((call.args, call.kwargs)))


_NO_SIDE = signature(((None,), {}))   # a stage given its activation alone


def signature_matches(sig, x, call, dicts=None):
    """``input_signature(x, call, dicts) == sig``, with less work: every stage of
    every call is checked. With ``dicts`` None the training flags are left out
    (``trained_as``)."""
    if x.shape != sig[0] or x.dtype != sig[1] or (dicts is not None and not trained_as(sig, dicts)):
        return False
    args, kwargs = call.args, call.kwargs
    if len(args) == 1 and not kwargs:   # (args is (None,): the activation, left out)
        return sig[3] == _NO_SIDE
    return signature((args, kwargs)) == sig[3]


def trained_as(sig, dicts):
    """The training flags of a stage's module and submodules (``dicts``, their
    ``__dict__``) are those of ``input_signature``'s ``sig``."""
    return tuple([d.get("training") for d in dicts]) == sig[2]


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
    act = out[0] if isinstance(out, tuple) else out
    if not isinstance(act, torch.Tensor):
        what = (f"a tuple whose first item is {type(act).__name__}" if isinstance(out, tuple)
                else type(act).__name__)
        raise StageError(
            f"remat: stage {call.index} ({call.name}) returned {what}; a stage must return "
            f"its output activation as a tensor, or a tuple whose first item is that tensor"
        )
    if isinstance(out, tuple):
        for j, item in enumerate(out[1:], 1):
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(item)):
                raise StageError(
                    f"remat: stage {call.index} ({call.name}) returned a tuple whose item {j} requires "
                    f"grad; only the first item, the activation, may carry gradient. If that item needs "
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
