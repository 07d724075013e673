"""Calls of one chain alive together (Note [Calls alive together]).

Note [Calls alive together]
---------------------------
The same chain opened again before the backward has reached the last stage of
an earlier call (a siamese encoder's two views, a GAN discriminator on real and
fake data, two micro-batches summed into one loss) shares its stages'
parameters with it, and a parameter has one AccumulateGrad node, which runs once
both calls' shares of its gradient are in. The later call's backward runs
first: the engine holds its shares of each stage's parameter gradients until
the earlier call's backward reaches that stage, then adds the two out of place
(a siamese step of a 4-block MLP chain peaked at 1.9 times the two calls'
budgets, plain PyTorch's peak nearly). The budget is per call, calls alive
together holding the sum of theirs: the later call's plan counts those
gradients as held through its step (all of them, and the largest stage's again
for the sum), where they are made, and the earlier call's plan, made before,
runs as it would alone (its backward's share of the memory is within its
budget, the gradients within the later call's). A call is in flight from the
end of its forward until the backward reaches its last stage, or its graph
goes (``flying``, remat/runtime/executor.py), whatever its chain key (a global
and a local crop of other shapes, a GAN critic on data needing grad or not).
Only one backward reaching both calls holds the gradients (a graph kept for a
log, never backwarded, holds none): a chain counts them once a backward has
reached a call of it and then one in flight before it (``_InFlight.end``), from
the next call opened while another is in flight; the step that showed it ran
without them. A parameter several stages share is held already
(``Upstream.held_grads``) and not counted again.
"""

import warnings

import torch

from ..units import format_bytes

__all__ = ["overlap_bytes"]


def overlap_bytes(record):
    """The bytes a call of ``record``'s chain opened while another is in flight holds
    for the stages' parameter gradients (Note [Calls alive together]); the first
    time, it warns."""
    if record.overlap is not None:
        return record.overlap
    seen = {key for s in record.stages for key in s.held if not isinstance(key, tuple)}
    sizes = [0]
    for stage in record.stages:   # (the leaves its backward reaches, as measured; else its module's parameters)
        leaves = stage.leaves
        if leaves is None:
            params = getattr(stage.ident(), "parameters", None)
            leaves = {id(p): p.numel() * p.element_size() for p in (params() if callable(params) else ())
                      if isinstance(p, torch.Tensor) and p.requires_grad}
        sizes.append(sum(n for key, n in leaves.items() if key not in seen))
        seen.update(leaves)
    record.overlap = sum(sizes) + max(sizes)
    if record.overlap:
        warnings.warn(
            f"remat: the chain of {record.names[0]}... opened again before the backward reached its earlier "
            f"call (two calls alive together: a siamese pair, a GAN's real and fake): the engine holds the "
            f"later call's gradients of the stages' parameters until the earlier call's backward reaches each "
            f"stage, {format_bytes(record.overlap)} at most, which the later call's plan counts. Give its budget "
            f"room for them, or, where the loss allows, run each call's backward before the next call's forward",
            RuntimeWarning, stacklevel=6)
    return record.overlap

