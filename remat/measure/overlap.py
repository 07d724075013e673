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
reached a call of it and then one in flight before it (``_InFlight.end``).
Until a backward has told, a call opened while another is in flight counts
them where its budget has room for them, so that a siamese pair's first step
stays under it too (``overlapping_plan``); once a backward has reached such a
call and passed the one in flight before it by (that one's graph kept for a
log), the chain's calls count nothing (``record.overlap_seen``). A parameter
several stages share is held already (``Upstream.held_grads``) and not counted
again.
"""

import warnings

import torch

from ..errors import BudgetError
from ..units import format_bytes

__all__ = ["other_chains", "overlap_bytes", "overlapping_plan"]

_WARNED = set()   # the chain sites ``other_chains`` has warned of


def other_chains(flights, site):
    """A chain (opened at ``site``) opened while calls of other chains are in flight (``flights``, weak
    references to their ``_InFlight``): each budget bounds its own call, the step holds them all; say so
    once (docs/limitations.md)."""
    names = sorted({rec.names[0] for r in flights if (f := r()) is not None and (rec := f.record()) is not None})
    if not names or site in _WARNED:
        return
    _WARNED.add(site)
    warnings.warn(
        f"remat: a chain opened while a call of the chain of {', '.join(names)}... is in flight (its backward "
        f"comes after this one's: an encoder chain, then a decoder chain): each chain's budget bounds its own "
        f"call from its opening, and the step holds both, up to the sum of their budgets. Give each chain its "
        f"share of the step's memory", RuntimeWarning, stacklevel=5)


def overlapping_plan(record, alive, plan):
    """``plan(held)``, the plan of a call of ``record``'s chain with ``held`` bytes held beside it,
    for one opened while the calls ``alive`` (weak references to their ``_InFlight``) are in
    flight: with them counted (``record.overlapping``), unless a backward has passed such a
    call by (a graph kept for a log); until a backward has shown them held, where no plan fits
    with them, without (Note [Calls alive together])."""
    probe = record.overlap_probe
    if alive and record.overlap_seen is None and probe is not None:
        later = probe[0]
        if later.ended and any((f := r()) is not None and not f.ended for r in probe[1]):
            record.overlap_seen = False   # (its backward reached the later call, not the one before)
    record.overlapping = overlap_bytes(record) if alive and record.overlap_seen is not False else 0
    if not record.overlapping or record.overlap_seen:
        return plan(record.overlapping)
    try:
        return plan(record.overlapping)
    except BudgetError:
        record.overlapping = 0
        return plan(0)


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
            f"stage, {format_bytes(record.overlap)} at most, which the later call's plan counts where its budget "
            f"has room for them. Give it that room, or, where the loss allows, run each call's backward before "
            f"the next call's forward (a graph kept with no backward, a loss kept for a log, holds its call's "
            f"memory as long as it is kept: log loss.item())", RuntimeWarning, stacklevel=7)
    return record.overlap

