"""Planning with autocast's casts held in the forward phase only (``Costs.cast_bytes``).

Note [Casts freed at the Loss]
------------------------------
Under ``torch.autocast`` each stage's bf16 copies of its weights live in
autocast's cache from its first forward until the autocast block ends; with
the backward after the block, as PyTorch advises, only the records that saved
them hold them after ``Loss`` (``simulate``'s rule 10). The persistent program
(Note [The recurrence], remat/solver/solve.py) has one headroom for a whole
subproblem and no term for memory held through the forward phase only, so the
C solver plans them as ``held_bytes``, through the step: every plan it makes
fits under rule 10 too, but on six MLP blocks with a small head under bf16
autocast (tests/runtime/test_autocast_casts.py, CPU) its plans measured 10-13%
under their predictions and its least budget was 16% above the least plan's
peak. Planned by rule 10 they measure within 2% of it.

So an optimal solve of such costs also solves at raised budgets, up to the
budget plus every cast's bytes, and keeps the fastest schedule whose peak by
rule 10 fits the budget (a bisection for the largest raise that fits, over
``RAISES`` solves at most, down to one of the table's slots: below that the
table barely changes, and on 200 stages, where a solve takes 0.16 s, ten
steps made it 2.2-2.9 s): never slower than the schedule at the budget itself, and
below the C solver's least budget, the least-memory schedule wherever rule 10
fits it. A long chain solved on groups (remat/solver/group.py) plans as
before: each solve there takes up to seconds. So does a chain whose
``RAISES`` + 1 exact solves would take longer than one exact table may
(``EXACT_WORK``; its least-memory plan still competes below the C solver's
least): 1,000 stages with casts took minutes at their least budget, against
15 s without.

2. A stage's backward lets its casts go too, each as the node that read it
last has run (autograd releases a node's saved tensors then, and the cache
that also held them is gone). A stage's ``bwd_tmp`` is measured inside the
autocast block, where the cache keeps them all, so the measuring call meters
its backward both ways on CPU (``Releases`` in remat/measure/timing.py:
the peak less the casts let go so far, ``StageCosts.bwd_cast_less``), and the
planning costs take that off ``bwd_tmp`` where the casts go at the loss
(``casts_freed``, remat/measure/record.py): a ResNet-18 in bf16 (batch 32, CPU)
had plans predicted 11-15% above their measured peaks, a large conv's cast
counted through the backward that had let it go; within 0.1% since. Not on
CUDA (the allocator's peak is read once per run; those casts stay counted),
nor for a stage that starts the sums of shared leaves' gradients, nor after
run 4, whose ``bwd_tmp`` is another peak: those plans stay on the safe side.
"""

from ..errors import BudgetError
from ..units import format_bytes
from .costs import Costs
from .group import EXACT_WORK
from .schedule import Schedule, simulate

__all__ = ["RAISES", "least_schedule", "solve_with_casts"]

RAISES = 10   # bisection steps of the raised budget


def solve_with_casts(costs, budget, solve_at, slot=1, work=0):
    """The fastest schedule ``solve_at(b)`` (the optimal solve at ``b`` bytes, planning
    the casts through the step) gives for ``b`` from ``budget`` to ``budget`` + the
    casts whose peak (``simulate``'s, rule 10) fits ``budget``, the raise found to
    within ``slot`` bytes (at ``budget`` alone where ``RAISES`` more solves of ``work``
    each, the table's, would exceed ``EXACT_WORK``); a ``BudgetError`` naming the least
    such peak where none fits."""
    best = None
    try:
        best = solve_at(budget)
    except BudgetError:
        pass
    if best is None:   # (below the C solver's least budget: its least-memory plan may fit by rule 10)
        ops, sim, least = least_schedule(costs)
        if sim.peak > budget:
            raise BudgetError(
                f"remat: budget {format_bytes(budget)} is below this chain's minimum of {format_bytes(sim.peak)} "
                f"({sim.peak} bytes, autocast's copies of the weights let go at the loss); raise the budget or "
                f"split the largest stage", sim.peak)
        best, low = Schedule(ops, sim.time, sim.peak, "optimal", budget, None, costs.tail), least
    else:
        low = budget
    if work * (RAISES + 1) > EXACT_WORK:
        return best
    high = budget + sum(costs.cast_bytes)
    top = _fitting(solve_at, high, budget)
    if top is not None:
        best = min(best, top, key=lambda s: s.time)
    else:
        for _ in range(RAISES):   # (the largest raise whose schedule still fits, roughly)
            mid = (low + high) // 2
            if mid <= low or high - low <= slot:
                break
            found = _fitting(solve_at, mid, budget)
            if found is None:
                high = mid
            else:
                low, best = mid, min(best, found, key=lambda s: s.time)
    return Schedule(best.ops, best.time, best.peak, "optimal", budget, best.slot_bytes, costs.tail, best.grouping)


def _fitting(solve_at, raised, budget):
    try:
        schedule = solve_at(raised)
    except BudgetError:
        return None
    return schedule if schedule.peak <= budget else None


def least_schedule(costs):
    """(ops, Simulation) of the C solver's least-memory schedule of ``costs``, of them
    without their options, or of them with each stage's casts in its record instead of
    held through the step, whichever rule 10 puts lower (an option's record is counted
    holding its casts after Loss, as the base record's: the least schedule may then be
    one of base records), and the C solver's least budget (the casts through the step).
    (Several schedules may need the C solver's least, of which it returns one: on a
    linear, two tied, a BatchNorm and a tied stage under bf16 autocast the one it
    returned peaked at 3,800 bytes by rule 10, the one that charges the casts to the
    records at 3,648, and which it returned turned on 128 bytes of one stage's bwd_tmp.)"""
    from . import binding as _c_solver

    ops, least = _c_solver.least_memory(costs)
    found = [(ops, simulate(costs, ops))]
    if costs.has_options:
        other = _c_solver.least_memory(costs.without_options())[0]
        found.append((other, simulate(costs, other)))
    base, casts = costs.without_options(), costs.cast_bytes
    in_records = Costs.from_dict({**base.to_dict(), "cast_bytes": [0] * len(casts),
                                  "held_bytes": base.held_bytes - sum(casts),
                                  "saved_bytes": [s + c for s, c in zip(base.saved_bytes, casts)]})
    other = _c_solver.least_memory(in_records)[0]
    found.append((other, simulate(costs, other)))
    ops, sim = min(found, key=lambda f: (f[1].peak, f[1].time))
    return ops, sim, least + costs.held_bytes
