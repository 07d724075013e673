"""A chain whose path of stages changes between a few: each path measured once
(Note [Paths of a chain]).

Note [Paths of a chain]
-----------------------
A call that leaves its record's path at stage k (another stage there: a block
skipped, a route taken) measures the rest of the chain (``Runner.diverge``,
remat/runtime/runner.py), and the record it makes becomes the chain's. That
record keeps the one it left, and those that one kept, up to ``OTHER_PATHS``
(``ChainRecord.others``), so that paths taken in turn are measured once each
rather than on every change.

A later call that leaves the path at stage k where one of those records goes
on as this call does (the same stages before k, on like inputs, and stage k
as called) runs on that record instead (``switch_path``):

1. The stages before k ran in the forward phase as the plan the call started
   with said, and what they hold stays.
2. The rest of the chain, from stage k, runs a plan of its own: the optimal
   one for the budget, solved on that record's costs from stage k on, with
   what the stages before hold counted as held through it; or, where that
   one would leave too little free as its forward ends to measure a stage
   like the record's largest, or the tail after one (``_room``), the one
   solved for the most budget that leaves it, where one does (``_leaving``):
   a call that has left its path may go on past that record's end, and
   measure there beside what the plan holds.
3. The backward of the stages before k rebuilds each from the nearest input
   held below it, as after any change of path (``Run._rebuild``,
   remat/runtime/executor.py); a stage they recorded whole needs nothing.

The whole schedule, stitched so, is simulated on that record's costs
(``simulate``): it must fit the budget, or the call measures as before. The
record it ran on becomes the chain's and keeps the one it left. Its plan is
slower than one solved for that path from the start where the stages before k
would have run otherwise; a call that takes the path from stage 1 runs that
one.

A plan that records its last stages whole can leave too little beside them
for the rest of another path (a block more after them): the call would then
measure that path again beside them, up to 19% over the budget on small
test chains (the measuring call counts what the stages before it hold,
``held_before``: Note [Measuring within the budget]). So a record's plan is
solved, where the one for its budget would leave too little for the rest of
one of the other paths, for the most budget that leaves enough for each
(``path_room``): slower, as long as the others are kept. They are let go
after ``STALE`` calls in a row that took this record's path to its end
(``Runner.finish``), for a chain that changed its path once. A call that stops short of its record several times (Note [Chain
keys]) makes the next one measure that shorter path, unless the record keeps
that path's own (``shorter_path``). A path met for the first time is
measured (docs/limitations.md).

A stage recorded frozen that has a parameter needing grad as a call opens
(progressive unfreezing) makes that call measure the chain from its first
stage, within the budget, as a first call does, with no hint from the record
(``unfrozen``): found as the stage is called, the stages before it would have
run on a plan that counted its backward and its weights' gradients out, and
measuring it beside what they held went 8% over the least budget (the second
block unfrozen from the top of eight), 23% (the last of four); and the
record's figures, the frozen stage's among them, under-count what measuring
it takes (7% over).
"""

import dataclasses
import warnings

from ..errors import RematError
from ..solver.costs import SIZE_FIELDS, TIME_FIELDS
from ..solver.plan import Plan
from ..solver.schedule import B, Fall, Fck, Fn, Loss, Schedule, op_from_code, simulate
from ..solver.solve import solve
from ..units import format_bytes
from .recompute import take

__all__ = ["OTHER_PATHS", "PATH_CHANGES", "STALE", "held_before", "keep_path", "path_changed", "path_changes",
           "path_lines", "path_room", "shorter_path", "site_text", "switch_path"]

OTHER_PATHS = 3   # records of other paths a chain's record keeps
STALE = 50        # calls in a row on one path after which it lets the others go
PATH_CHANGES = 3  # calls in a row that left the recorded path before a warning (``path_changed``)
path_changes = {}       # chain key -> such calls so far
_warned_paths = set()    # chain sites warned of
SHAPES = 8         # input shapes a model's chain has measured (and keeps) as ``new_shape`` warns
_PER_STAGE = TIME_FIELDS + SIZE_FIELDS + ("fwd_drop", "fwd_drop_whole", "bwd_rebuilt_less", "fwd_nograd_less",
                                          "options", "cast_bytes")


def site_text(site):
    """``file:line`` of a chain's site (Note [Chain keys]): the ``with`` line, or a
    decorated function's first line."""
    code, line = site
    if not hasattr(code, "co_filename"):
        return repr(code)
    return f"{code.co_filename}:{line or code.co_firstlineno}"


def path_changed(key, site):
    """A call of the chain ``key`` (at ``site``) left its recorded path (another
    stage, or fewer): after ``PATH_CHANGES`` such calls in a row (``path_changes``,
    which a call that takes it to its end clears), warn once per chain site that
    the budget is not kept (each measures again)."""
    if len(path_changes) > 1000:
        path_changes.clear()
    n = path_changes[key] = path_changes.get(key, 0) + 1
    if n == PATH_CHANGES and site not in _warned_paths:
        _warned_paths.add(site)
        warnings.warn(
            f"remat: the chain at {site_text(site)} took another path of stages than its record on "
            f"{PATH_CHANGES} calls in a row (stages added, replaced or reordered from call to call); each "
            f"such call measures the rest of the chain again, slower than a step and near the budget "
            f"rather than under it for sure. remat keeps the budget on a path it has measured and runs "
            f"again, and on one that skips some of its stages (docs/limitations.md)", RuntimeWarning, stacklevel=6)


def new_shape(site, ident, seen):
    """A call of the chain at ``site`` whose first stage is ``ident`` measures an input shape
    besides the ``seen`` ones the cache keeps of that model's chain: as it makes ``SHAPES``,
    say what that costs, and what to do (once per model: the cache keeps the shapes' records)."""
    if (n := seen + 1) == SHAPES:
        first = getattr(ident, "__name__", None) or type(ident).__name__   # (a function's name, a module's class)
        warnings.warn(
            f"remat: the chain at {site_text(site)} (stage 1: {first}) has measured {n} input shapes (batch "
            f"sizes or sequence lengths it had not seen): the first call of each shape measures its stages, two "
            f"to three steps' time, and remat keeps the 64 chains used last. Where the shape changes from step "
            f"to step (each batch padded to its longest sequence), pad to a few lengths (a multiple of 64, or "
            f"fixed buckets): each is then measured once", RuntimeWarning, stacklevel=7)


def unfrozen(entry):
    """Whether a stage ``entry`` recorded frozen (parameters, none needing grad: a suspect,
    Note [Stages recorded whole]) has one needing grad now (Note [Paths of a chain])."""
    for k in entry.suspects:
        if k <= len(entry.stages):
            record = entry.stages[k - 1]
            slots, flags = record.slots, record.grads
            if flags and not any(f[1] for f in flags if f is not None) \
                    and any(t is not None and t.requires_grad for t in take(slots[0][:slots[1]])):
                return True
    return False


def keep_path(new, old):
    """``new``, the record of a call that left ``old``'s path, keeps ``old`` and
    the records ``old`` kept among its others (Note [Paths of a chain])."""
    new.others = [old] + [r for r in old.others if r is not new][:OTHER_PATHS - 1]
    old.remeasure = False
    new.abandoned = old.abandoned   # (measured again once, not on every call: ``abandoned`` in tail.py)


def path_room(entry, plan, budget, spec, solve_at):
    """``plan`` for ``entry``, or where it would leave too little for the rest of
    one of the other paths its record keeps (a call that goes on with one would
    measure it beside what the stages before hold, over the budget), the plan
    ``solve_at`` gives at the most budget, found by halving, that leaves room for
    each (Note [Paths of a chain])."""
    parts = [(k, other) for other in entry.others if (k := _parting(entry, other)) is not None]
    if not parts or all(_fits(plan, k, other, budget, spec) for k, other in parts):
        return plan
    low, high, best = 0, budget - 1, plan
    for _ in range(12):
        if low > high:
            break
        mid = (low + high) // 2
        try:
            tried = solve_at(mid)
        except RematError:
            low = mid + 1
            continue
        if all(_fits(tried, k, other, budget, spec) for k, other in parts):
            best, low = tried, mid + 1
        else:
            high = mid - 1
    return best


def shorter_path(key, entry, k, remember):
    """A call of ``entry`` (the record under ``key``) that ended at stage k makes the
    next measure again (a shorter path taken on several calls, or a stage that
    changed): where it stopped short on the path of another record it keeps, that
    record becomes the chain's instead (``remember(key, record)``)."""
    other = next((o for o in entry.others if len(o.stages) == k and o.costs is not None
                  and _same_prefix(entry, o, k + 1)), None) if k < len(entry.stages) else None
    if other is None:
        entry.remeasure = True
        return
    _succeeds(entry, other)
    remember(key, other)


def _succeeds(entry, other):
    """``other``, a record ``entry`` keeps, becomes the chain's and keeps ``entry``."""
    other.others = [entry] + [r for r in entry.others if r is not other][:OTHER_PATHS - 1]
    entry.others, other.quiet, other.remeasure = [], 0, False


def _parting(entry, other):
    """The stage at which a call leaving ``entry``'s path would go on with
    ``other``'s, or None (one stops short of the other, or the records differ in a
    stage that changed rather than in the path: ``switch_path``)."""
    n = len(entry.stages)
    k = next((i + 1 for i, (a, b) in enumerate(zip(entry.stages, other.stages))
              if not _alike(a, b)), min(n, len(other.stages)) + 1)
    if other.costs is None or k < 2 or k > len(other.stages) or (k <= n and entry.ident(k) is other.ident(k)):
        return None
    return k


def _fits(plan, k, other, budget, spec):
    try:
        return _stitched(plan, k, other, budget, spec) is not None
    except RematError:
        return False


def switch_path(runner, k, ident, x, call, budget, spec):
    """The call of ``runner`` left its record's path at stage ``call`` (k, of
    ``ident`` on ``x``): run on a record of another path that goes on so, with a
    plan stitched from the stages already run (Note [Paths of a chain]), or
    else on a view of its record without stages it skipped (Note [Skipped
    stages]); True if it does, False if none fits (the call then measures)."""
    from .runner import _same_module   # (runner.py imports this module)
    entry = runner.entry
    mine = entry.ident(k) if k <= len(entry.stages) else None
    for other in entry.others:
        if other.costs is None or len(other.stages) < k or not _same_prefix(entry, other, k):
            continue
        if other.ident(k) is mine or _same_module(other.stages[k - 1]) is False:
            continue   # (the stage there changed: not another path, measured again)
        key = ("leaving", k, budget, spec.algorithm, spec.slots, spec.options)   # (routes taken in turn: once)
        kept = other.plans.get(key)
        if kept is None or kept[0] is not runner.plan:
            kept = other.plans[key] = (runner.plan, _leaving(runner.plan, k, other, budget, spec,
                                                             _room(other, budget))[0])
        plan = kept[1]
        if plan is None:
            continue
        before = runner.entry, runner.plan
        runner.adopt(other, plan)
        if runner.matches(k, ident, x, call):
            other.suspects |= {i for i in entry.suspects if i < k}   # (Note [Stages recorded whole])
            _succeeds(entry, other)
            runner.run.clock = None   # (this call's times are not the record's plan's)
            return True
        runner.adopt(*before)
    from .skips import skip_stages   # (skips.py imports this module)
    return skip_stages(runner, k, ident, x, call, budget, spec)


def held_before(plan, k):
    """Bytes ``plan``'s schedule holds after its ops of stages 1..k-1 beyond the
    chain's input and stage k's: what a call that measures from stage k on holds
    beside what it measures (Note [Measuring within the budget], remat/measure/holding.py)."""
    costs, trace = plan.costs, []
    try:
        simulate(costs, plan.schedule.ops[:k - 1], trace)
    except RematError:   # (no Loss: what each op left held is in the trace)
        pass
    if k < 2 or len(trace) != k - 1:
        return 0
    return max(0, trace[-1][2] - costs.input_bytes - costs.sizes()[k - 1])


def path_lines(record, schedule, budget):
    """What ``explain()`` says of the other paths ``record`` keeps and of the stages
    a call skipped ("" if neither)."""
    text = ""
    if record.view:
        index, n = record.view[1], len(record.view[0].stages)
        gone = [str(i) for i in range(1, n + 1) if i not in index]
        how = ("that record's plan without them" if record.view[2:] == ("holed",) else
               "the rest of the chain solved again beside what the stages before held")
        text += f"\nthis call skipped stage(s) {', '.join(gone)} of the chain's {n} (Note [Skipped stages]): " \
            f"it ran {how}"
    others = record.view[0].others if record.view else record.others
    if others:
        low = schedule.budget if (schedule.budget or budget) < budget else None
        text += (f"\n{len(others)} other path(s) of the chain kept: a call taking one goes on with its record"
                 + (f"; this plan, solved for {format_bytes(low)}, leaves room for its rest" if low else ""))
    return text


def _same_prefix(entry, other, k):
    """The records' stages before k are the same stage objects on like inputs."""
    return all(_alike(a, b) for a, b in zip(entry.stages[:k - 1], other.stages[:k - 1]))


def _alike(a, b):
    """Two stage records are of one stage object, alive, on like inputs."""
    return a.ident() is b.ident() and a.ident() is not None and a.in_sig == b.in_sig and a.autocast == b.autocast


def _stitched(plan, k, other, budget, spec, solve_at=None):
    """The plan of a call that ran stages 1..k-1 as ``plan`` says and goes on as
    the record ``other`` (Note [Paths of a chain]), the rest solved for ``budget``
    (or ``solve_at``), or None where its schedule would not fit ``budget``."""
    costs = other.planning_costs(options=spec.options)
    prefix = plan.schedule.ops[:k - 1]   # (the forward phase runs stage 1 on, in order)
    trace = []
    try:
        simulate(costs, prefix, trace)
    except RematError:   # (it has no Loss: what each op left held is in the trace)
        pass
    if len(trace) != k - 1:
        return None
    held = trace[-1][2] if trace else costs.input_bytes + costs.held_bytes
    x_in = costs.sizes()[k - 1]
    rest = dataclasses.replace(costs, input_bytes=x_in, held_bytes=held - x_in + sum(costs.cast_bytes[k - 1:]),
                               **{f: getattr(costs, f)[k - 1:] for f in _PER_STAGE})   # (casts: rule 10)
    schedule = solve(rest, budget if solve_at is None else solve_at, spec.algorithm, spec.slots)
    moved = [op_from_code(op.code, op.stage + k - 1, getattr(op, "option", 0)) if op is not Loss else Loss
             for op in schedule.ops]
    return _planned(tuple(prefix) + tuple(moved) + _rebuilds(plan, k), costs, budget, schedule, other.policies())


def _leaving(plan, k, other, budget, spec, room, holed=None):
    """(the plan of a call that left ``plan`` at stage k to go on as ``other``,
    "stitched" or "holed"): the faster of ``_stitched``'s and ``holed`` (if any)
    among those that leave ``room`` bytes free as the forward ends
    (``_held_at_end``), else the stitched one solved for the most budget that
    does, found by halving, else the faster of the two (Note [Paths of a chain]);
    (None, "stitched") if neither fits ``budget``."""
    def stitch(at=None):
        try:
            return _stitched(plan, k, other, budget, spec, at)
        except RematError:   # (no plan of the rest fits beside what the stages before hold)
            return None
    found = [(p, how) for p, how in ((stitch(), "stitched"), (holed, "holed")) if p is not None]
    roomy = [(p, how) for p, how in found if _held_at_end(p) + room <= budget]
    low, high = 0, budget - 1
    for _ in range(12 if found and not roomy and room else 0):
        if low > high:
            break
        mid = (low + high) // 2
        try:
            tried = _stitched(plan, k, other, budget, spec, mid)
        except RematError:   # (below what the rest needs)
            low = mid + 1
            continue
        if tried is not None and _held_at_end(tried) + room <= budget:
            roomy, low = [(tried, "stitched")], mid + 1
        else:
            high = mid - 1
    return min(roomy or found, key=lambda c: c[0].schedule.time, default=(None, "stitched"))


def _room(record, budget):
    """Bytes a call going on past the end of ``record``'s path needs free to
    measure a stage like its largest, or the tail after one, as far as
    ``record`` knows them (``ChainRecord.hint``; 0 where it does not)."""
    tail, _, largest, widest = record.hint(budget)
    return 0 if tail is None else max(largest, widest + tail)


def _held_at_end(plan):
    """Bytes ``plan``'s schedule holds after its last stage's forward-phase op."""
    trace, ops = [], plan.schedule.ops
    try:
        simulate(plan.costs, ops, trace)
    except RematError:
        return float("inf")
    n = plan.costs.stages
    return max((held for op, _, held in trace[:ops.index(Loss)] if op.stage == n), default=0)


def _planned(ops, costs, budget, like, policies):
    """The plan of ``ops`` on ``costs`` (its schedule made as ``like`` was), or None
    where they are not a valid schedule of them or do not fit ``budget``."""
    try:
        sim = simulate(costs, ops)
    except RematError:
        return None
    if sim.peak > budget:
        return None
    schedule = Schedule(tuple(ops), sim.time, sim.peak, like.algorithm, budget, like.slot_bytes, costs.tail)
    return Plan.of(schedule, costs, policies)


def _rebuilds(plan, k):
    """The backward ops of stages k-1 down to 1, run in the forward phase as
    ``plan`` says, as ``Run._rebuild`` runs them: a stage recorded in the forward
    phase is backwarded, another rebuilt from the nearest input held below it
    (a stage's own, unless it ran as ``Fn`` after one that did not keep its
    output, or was recorded whole)."""
    modes, options = plan.modes, plan.options
    keeps = lambda m: modes[m] is Fall and options[m] == 0   # (recorded whole: no anchor)
    holds = lambda m: not keeps(m) and (modes[m] is not Fn or (m > 1 and modes[m - 1] is Fall))
    ops = []
    for i in range(k - 1, 0, -1):
        if modes[i] is Fall:
            ops.append(B(i))
            continue
        j = i
        while j > 1 and not holds(j):
            j -= 1
        ops += ([Fck(j)] + [Fn(m) for m in range(j + 1, i)] if j < i else []) + [Fall(i), B(i)]
    return tuple(ops)
