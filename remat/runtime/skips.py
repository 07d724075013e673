"""A call that skips stages of its chain's recorded path (LayerDrop) runs that
record's plan without them (Note [Skipped stages]
---------------------
A call that leaves its record's path at stage k for a stage m the record holds
further on (stages k..m-1 skipped: LayerDrop, an optional block) takes a path
that record has measured, less those stages. It runs on a view of the record
without them (``_without``): the same stage records, the costs without their
rows. Where the stages around a gap meet, a^(k-1) is counted gone once stage m
has run as ``forward_drops`` (remat/measure/costs_source.py) says across it: m
keeps none of its input, and the code around the chain does not hold a^(k-1).
The plan is the faster of two that fit the budget, each simulated on the view's
costs:

1. The record's plan without the skipped stages' ops (``_holed``): a stage after
   a gap keeps the input a checkpoint before it kept, and the ops that only led
   to a skipped stage's rebuild go. It is the record's plan, less work, where
   it is valid.
2. The plan stitched as for another path (``_stitched``, Note [Paths of a
   chain]): the stages before k as they ran, the rest solved again beside what
   they hold, their backward rebuilding each from the nearest input held.

Of those, the ones that leave room as their forward ends to measure a stage
past it come first, as for another path (``_leaving``, Note [Paths of a
chain] 2): a view of a record without its last block, taken by a call that
skipped a block and then ran the last, stored every stage and measured that
block beside them, 15% over the budget. Where neither fits, the call
measures, as before. A record of another path the
chain keeps serves so too, the stages the call ran before k found in it in
order; it then becomes the chain's record. Otherwise nothing is measured and
the record stays the chain's: a view is the plan of one call. A stage given
its input in another layout than recorded (a transposing stage skipped before
it) does not match (``layout``, remat/runtime/stage_call.py), and the call
measures. Each new view costs a solve of the rest (C: milliseconds); a record
keeps the views its plans made (``SKIPS`` of them). So LayerDrop measures
until a call has taken every stage, and then no more; a call that skips the
first stage has another key (Note [Chain keys], remat/chain.py). A call that
stops short (its last stages skipped, or an early exit) runs the plan's
prefix, and its backward the plan less the stages it did not reach
(``stopped_short``: ``_holed`` again), where that fits; a chain seen skipping
stages waits four times as many such calls in a row before it measures the
shorter path (``Runner.finish``): LayerDrop drops the last layer now and then.
"""

import dataclasses
import types

from ..solver.schedule import B, Fck, Fn, Loss, op_from_code
from .paths import _PER_STAGE, _alike, _leaving, _planned, _room, _succeeds

__all__ = ["SKIPS", "skip_stages", "stopped_short"]

SKIPS = 64   # views a record keeps of its plans with stages skipped


def skip_stages(runner, k, ident, x, call, budget, spec):
    """The call of ``runner`` left its record's path at stage ``call`` (k, of
    ``ident`` on ``x``) for a stage its record, or a record of another path the
    chain keeps, holds further on, the stages before as that record holds them: run
    on a view of that record without the stages the call skipped (Note [Skipped
    stages]); True if it does, False if none holds it so or the plan does not fit."""
    entry, plan, base = runner.entry, runner.plan, runner.base
    for record in [entry, *base.others] if k > 1 else ():   # (entry: the chain's record, or a view of it)
        keep = _kept(entry, record, k, ident)
        if keep is None or record.costs is None:
            continue
        home = base if record is entry else record   # (the record the view is of)
        index = _index(record)
        key = (id(plan), k, tuple(index[i] for i in keep))
        kept = home.skips.get(key)
        if kept is None or kept[0] is not plan:
            view = _without(record, home, index, keep)
            holed = _holed(plan, keep, view, budget, spec) if record is entry else None
            stitched, how = _leaving(plan, k, view, budget, spec, _room(home, budget), holed)
            view.view += (how,)   # (what explain() says of it)
            kept = _keep(home, key, (plan, view, stitched))
        view, stitched = kept[1:]
        if stitched is None:
            continue
        runner.adopt(view, stitched, home)
        if runner.matches(k, ident, x, call):
            if record is not entry:
                record.suspects |= {keep[i - 1] + 1 for i in entry.suspects if i < k}
                _succeeds(base, record)
            runner.run.clock = None   # (this call's times are not the record's plan's)
            home.skipped = True
            return True
        runner.adopt(entry, plan, base)
    return False


def stopped_short(runner, k):
    """The call of ``runner`` ended at its stage k, short of its record's: the plan
    for its backward, that of the record less the stages after k (``_holed``), or
    None where it does not fit (the backward then rebuilds each stage from the
    nearest input held, ``Run._rebuild``)."""
    entry, plan, base = runner.entry, runner.plan, runner.base
    if entry.costs is None or plan.schedule.budget is None:
        return None
    key = (id(plan), "short", k)
    kept = base.skips.get(key)
    if kept is None or kept[0] is not plan:
        view = _without(entry, base, _index(entry), list(range(k)))
        options = types.SimpleNamespace(options=plan.costs.options is not None)
        kept = _keep(base, key, (plan, _holed(plan, list(range(k)), view, plan.schedule.budget, options)))
    return kept[1]


def _index(record):
    """The stage of the chain's record each of ``record``'s is (itself, or a view's)."""
    return record.view[1] if record.view else tuple(range(1, len(record.stages) + 1))


def _keep(record, key, value):
    """Keep ``value`` (its first item the plan it was made from: kept alive, its id in
    ``key`` stays its own) in ``record.skips``, the oldest of ``SKIPS`` going; return it."""
    if len(record.skips) >= SKIPS:
        record.skips.pop(next(iter(record.skips)))
    record.skips[key] = value
    return value


def _holed(plan, keep, view, budget, spec):
    """``plan`` without the ops of the stages not in ``keep`` (0-based), for
    ``view`` (Note [Skipped stages]): a stage after a gap keeps the input a
    checkpoint before it kept (``Fck``); None where that schedule is not valid
    on the view's costs or does not fit ``budget``."""
    costs = view.planning_costs(options=spec.options)
    new = {i + 1: n + 1 for n, i in enumerate(keep)}
    if costs.tail:
        new[len(plan.modes)] = len(keep) + 1   # (the tail's op, after the stages)
    ops, carry, start = [], False, 0   # (start: where the ops since the last backward op begin)
    for op in plan.schedule.ops:
        if op is Loss:
            ops.append(op)
            start, carry = len(ops), False
            continue
        i = new.get(op.stage)
        if i is None:
            carry = carry or type(op) is Fck   # (its input goes on to the next stage kept)
            if type(op) is B:   # (what ran on to rebuild it goes too; a checkpoint made on the way stays)
                while len(ops) > start and type(ops[-1]) is Fn:
                    ops.pop()
                if len(ops) > start and type(ops[-1]) is Fck:
                    ops.pop()   # (its input, the checkpoint, is the last output held)
                start = len(ops)
            continue
        code = Fck.code if carry and type(op) is Fn else op.code
        carry = False
        ops.append(op_from_code(code, i, getattr(op, "option", 0)))
        start = len(ops) if type(op) is B else start
    return _planned(ops, costs, budget, plan.schedule, view.policies())


def _kept(entry, record, k, ident):
    """The stages of ``record`` (0-based) a call on ``entry``'s path to stage k-1
    that goes on with stage ``ident`` runs: those like its stages before k, in
    order, then the first of ``ident`` after them and all after it; None if
    ``record`` holds them not so, or with none skipped."""
    keep, j, n = [], 0, len(record.stages)
    for a in entry.stages[:k - 1]:
        while j < n and not _alike(a, record.stages[j]):
            j += 1
        if j == n:
            return None
        keep.append(j)
        j += 1
    m = next((i for i in range(j, n) if record.ident(i + 1) is ident), None)
    if m is None or m == k - 1:   # (none skipped: a stage that changed, or another path's)
        return None
    return keep + list(range(m, n))


def _without(record, base, index, keep):
    """A view of ``record`` (whose stages are ``base``'s ``index``) with only its
    stages ``keep`` (0-based), for one call (Note [Skipped stages])."""
    from ..measure.chain_record import ChainRecord   # (measure/ imports the runtime)
    costs = record.costs
    fields = {f: tuple(getattr(costs, f)[i] for i in keep) for f in _PER_STAGE if getattr(costs, f) is not None}
    drop, whole = list(fields["fwd_drop"]), list(fields["fwd_drop_whole"])
    for n, (a, b) in enumerate(zip(keep, keep[1:])):
        if b != a + 1:   # (a gap: forward_drops' test, remat/measure/costs_source.py, across it)
            before, after = record.stages[a].costs, record.stages[b].costs
            gone = before is not None and after is not None and after.input_kept is False \
                and before.caller_holds is False and a + 1 not in record.caller
            drop[n] = costs.out_bytes[a] if gone else 0
            whole[n] = drop[n] if before is not None and before.out_freed else 0
    fields["fwd_drop"], fields["fwd_drop_whole"] = tuple(drop), tuple(whole)
    view = ChainRecord()
    view.stages, view.names = [record.stages[i] for i in keep], [record.names[i] for i in keep]
    view.costs = dataclasses.replace(costs, **fields)
    new = {i + 1: n + 1 for n, i in enumerate(keep)}
    view.caller = {new[i] for i in record.caller if i in new}
    view.suspects = {new[i] for i in record.suspects if i in new}
    view.input_bytes, view.tail, view.output_held = record.input_bytes, record.tail, record.output_held
    view.before = record.before
    view.view = (base, tuple(index[i] for i in keep))
    return view
