"""Where a chain's costs come from: measured by this process, read from a costs
file (``remat.chain(costs="costs.json")``), or, under torch.distributed, rank
0's, so that every rank runs one schedule (no rank plans on its own noisy
timings)."""

import os
import warnings

import torch

from ..solver.costs import Costs
from ..errors import CostsError, RematError, UsageError
from ..units import format_bytes
from ..runtime.executor import distributed
from .chain_record import write_costs
from ..runtime.option_modes import KEEP_EXPENSIVE, KEEP_SAVED
from .options import stage_options
from .record import COST_FIELDS

__all__ = ["chain_costs", "distributed", "read_costs", "write_costs"]


def read_costs(path):
    """Costs from ``path`` if it exists, else None. Under torch.distributed rank 0
    alone reads, and every rank gets its answer, so that all ranks either load
    the same costs or all measure (and meet in the same broadcast)."""
    if path is None:
        return None
    if not distributed():
        return Costs.load(path) if os.path.exists(path) else None
    box = [None]
    if torch.distributed.get_rank() == 0:
        try:
            box = [Costs.load(path).to_dict() if os.path.exists(path) else None]
        except RematError as exc:
            box = [str(exc)]
    torch.distributed.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise CostsError(box[0])
    return None if box[0] is None else Costs.from_dict(box[0])


def chain_costs(stages, input_bytes, held_bytes, path, given, options=True):
    """The costs of a measuring call: ``given`` (read from ``path``) checked against
    what the call saw, else the measured ``stages`` (rank 0's under torch.distributed),
    written to ``path`` if one is given; with options 1 and 2 and the rungs of each stage where
    they are offered (remat/measure/options.py) if ``options``.

    Args:
        stages: a ``StageCosts`` per stage (remat/measure/record.py; only
            ``out_bytes`` and ``saved_seen`` when the costs are given).
        input_bytes: the chain input's bytes.
        held_bytes: what the chain holds through the step beside its activations
            (``ChainRecord.held_bytes``).
    """
    if given is not None:
        _check_given(given, stages, input_bytes, held_bytes, path)
        if not options or not given.has_options:
            return given.without_options()
        if not all(_runs(listed, s, b) for listed, s, b in zip(given.options, stages, given.saved_bytes)):
            warnings.warn(
                f"remat: the costs in {path} list options (remat.Option: other ways to record a stage) other "
                f"than those remat's runtime runs, option 1, which keeps the outputs of a stage's matmuls, "
                f"convolutions and attention, option 2, those of them autograd saves, and the rungs, those of its "
                f"calls of most FLOPs per byte (their bytes not those "
                f"this chain's forward shows, or more options); this chain plans without them (remat.solve "
                f"plans with them)",
                RuntimeWarning, stacklevel=4)
            return given.without_options()
        return given
    drop, whole = forward_drops(stages)
    costs = Costs(**{f: [getattr(s, f) for s in stages] for f in COST_FIELDS}, input_bytes=input_bytes,
                  fwd_drop=drop, fwd_drop_whole=whole, held_bytes=held_bytes,
                  options=[_option_of(s, b) for s, b in zip(stages, [input_bytes] + [s.out_bytes for s in stages])]
                  if options else None)
    rank = 0
    if distributed():   # (every rank plans rank 0's schedule: where the ranks' sizes differ, none can)
        rank, box = torch.distributed.get_rank(), [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(box, costs.to_dict())
        sizes = [(d["input_bytes"], d["out_bytes"], d["saved_bytes"]) for d in box]
        if any(s != sizes[0] for s in sizes):
            raise UsageError(
                f"remat: the ranks measured this chain on inputs of other sizes (the chain's input: "
                f"{', '.join(f'rank {r} {format_bytes(s[0])}' for r, s in enumerate(sizes))}), and every rank "
                f"plans rank 0's schedule, which fits rank 0's sizes alone: give every rank inputs of one shape "
                f"at each step (pad each batch to a length every rank uses: a fixed length, or buckets chosen "
                f"alike on all ranks); a rank meeting a new shape while the others do not would wait for them")
        costs = Costs.from_dict(box[0])
    if path is not None and rank == 0:
        write_costs(costs, path)
    return costs


def _runs(listed, stage, saved):
    """Whether the options ``listed`` for a stage in a costs file, whose record
    keeps ``saved`` bytes, are some of those the runtime runs, as this call's
    forward of the stage (a ``StageCosts`` of it) shows them: options 1 and 2 as
    far as offered, and its rungs, each keeping those bytes (remat/measure/options.py
    Note [Measuring an option]). If so, the stage's ``policies`` are set for them."""
    seen = stage.kept
    if not listed:
        return True
    if seen is None or not seen.any_kept:
        return False
    ours = {stage.out_bytes + seen.kept: KEEP_EXPENSIVE}
    for kept, policy in ((seen.kept_saved, KEEP_SAVED), *((r.kept, r.calls) for r in seen.ladder)):
        if kept < seen.kept:
            ours.setdefault(stage.out_bytes + kept, policy)
    policies = tuple(ours.get(o.saved_bytes) for o in listed)
    if None in policies or len(set(policies)) < len(policies) or any(o.saved_bytes >= saved for o in listed):
        return False
    stage.policies = policies
    return True


def _option_of(stage, in_bytes):
    """The options of a stage (a ``StageCosts``) whose input is ``in_bytes``, its
    ``policies`` set: measured, or as the costs of the chain measured again after
    it tell; [] where none."""
    if stage.kept is not None and stage.fwd_time is not None:
        options, stage.policies = stage_options(stage, in_bytes)
        return options
    return list(stage.options)


def forward_drops(stages):
    """``Costs.fwd_drop`` and ``fwd_drop_whole`` from the measured rows: a^i goes once
    stage i+1 has run recording if that stage keeps no part of its input
    (``input_kept``) and the code around the chain does not hold it
    (``caller_holds``, remat/runtime/chain_call.py) and it is not a view of a^(i-1), which
    may be held (``out_of_input``: a slice or a transpose of its input; a^i is then no
    storage of its own going); inside a-bar^i only if B(i) does not read it either
    (``out_freed``). Unknown is kept."""
    n = len(stages)
    drop = [0] * n
    for i in range(n - 1):
        if stages[i + 1].input_kept is False and stages[i].caller_holds is False and not stages[i].out_of_input:
            drop[i] = stages[i].out_bytes
    whole = [d if stages[i].out_freed else 0 for i, d in enumerate(drop)]
    return drop, whole


def _check_given(costs, stages, input_bytes, held_bytes, path):
    """Costs read from ``path`` must describe this chain (a file written before
    ``held_bytes`` counted it in ``input_bytes``)."""
    if costs.tail:
        raise CostsError(
            f"remat: the costs in {path} end in a tail (the head and loss after the chain, as "
            f"remat.explain().costs has them); a chain's costs file holds the costs it measured "
            f"(remat.explain().measured): delete the file to measure again, or save those")
    sizes = [s.out_bytes for s in stages]
    same_input = costs.input_bytes in (input_bytes, input_bytes + held_bytes)
    if costs.length != len(sizes) or not same_input or list(costs.out_bytes) != sizes:
        if costs.length != len(sizes):
            what = f"{costs.length} stages, where this one has {len(sizes)}"
        elif not same_input:
            what = f"an input of {costs.input_bytes} bytes, where this one's is {input_bytes}"
        else:
            i = next(i for i, n in enumerate(sizes) if costs.out_bytes[i] != n)
            what = f"stage {i + 1}'s output of {costs.out_bytes[i]} bytes, where this one's is {sizes[i]}"
        raise CostsError(f"remat: the costs in {path} describe another chain ({what}); delete the file "
                         f"to measure again")
    # the sizes above agree for models of another width with the same input and
    # output (a GPT's blocks): what each stage saves, seen in this call's forward, must
    # be within 10% of the file's (the same model gives the same bytes; within 2x, an
    # MLP 7/4 as wide ran 44% over its budget on the file's figures)
    for i, stage in enumerate(stages):
        seen, filed = stage.saved_seen, costs.saved_bytes[i]
        if seen is not None and not (filed / 1.1 <= seen <= 1.1 * filed):
            raise CostsError(
                f"remat: the costs in {path} describe another chain: its stage {i + 1} saves "
                f"{format_bytes(filed)} for the backward, and this chain's saves {format_bytes(seen)} (a "
                f"model of another width or depth per stage?); delete the file to measure again")
