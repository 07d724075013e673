"""Long chains: the optimal solver on groups of adjacent stages, where the exact
table would take too long (docs/how-it-works.md, "Long chains").

Note [Groups]
-------------
The table's work grows as L^3 x slots (benchmarks/results/solver.md: 11 s at
L = 1,000 and 500 slots on 2 cores, and the least-memory program's as L^3.6:
7 s at L = 2,000). Past ``EXACT_WORK`` remat solves a coarser chain instead:
runs of adjacent stages, each a stage of the coarse chain, then writes each
coarse op as the ops of its stages:

    Fn(g)  -> Fn(lo) .. Fn(hi)        Fck(g) -> Fck(lo), Fn(lo+1) .. Fn(hi)
    Fall(g) -> Fall(lo) .. Fall(hi)   B(g)   -> B(hi) .. B(lo)

So a recorded group records every one of its stages; a checkpointed one keeps
only its input. The group's costs are chosen so that, by the rules of
remat/solver/schedule.py Note [Accounting], every op of the expansion peaks at
most where its coarse op does (x[k] the size of a^k, s[k] of a-bar^k):

1. Times are the stages' sums; the output is a^hi, the input a^(lo-1).
2. saved_bytes is the sum of s[lo..hi]: a recorded group holds them all.
3. fwd_tmp: Fn(k) inside a group holds a^(k-1), Fall(k) the records of the
   stages before it, so fwd_tmp = max over k of (max(x[k-1] (k > lo),
   s[lo] + .. + s[k-1]) + x[k] + fwd_tmp[k]) - x[hi]. After Loss, Fn(k) and
   Fck(k) do not record: the group's fwd_nograd_less is its fwd_tmp less the
   max over k of (x[k-1] (k > lo) + x[k] + fwd_tmp[k] - fwd_nograd_less[k])
   - x[hi] (at least 0).
4. bwd_tmp: B(k) runs with the records of the stages after it gone and the
   gradient of a^k in place of that of a^hi, so bwd_tmp = max over k of
   (x[k] + x[k-1] + bwd_tmp[k] - s[k+1] - .. - s[hi]) - x[hi] - x[lo-1].
5. What the forward phase lets go of a^hi (fwd_drop, fwd_drop_whole) is stage
   hi's: the first op of the next group's Fall is Fall(hi+1), and the first of
   its B is B(hi). Drops inside a group are left out: dropping only lowers a
   peak (Note [Accounting] 6), so the stages' own drops keep the bound.
6. A group of one stage is that stage, its options included; larger groups
   record with the base record only. The tail (``Costs.tail``) is a group of
   its own.

So the expanded schedule fits wherever the coarse one does, and ``solve``
checks it with ``simulate`` on the stages' own costs all the same. It is valid
within the budget, not optimal: it cannot recompute part of a group, nor
checkpoint inside one. Groups are cut where the running sum of a stage's share
of the chain's time plus its share of the bytes it saves crosses an even step,
so each holds about as much of both.
"""

import math
from typing import NamedTuple

from .costs import Costs
from .schedule import B, Fall, Fck, Fn, Loss

__all__ = ["Grouping", "EXACT_WORK", "GROUP_WORK", "exact_work", "group_count", "cuts", "grouped_costs", "expand",
           "solve_on_groups", "least_planned"]

# The exact table runs up to this L^3 x slots: L = 1,000 stages at 500 slots (about
# 11 s on 2 cores), so chains the table used to solve are solved as before.
EXACT_WORK = 1000**3 * 500
# A coarse chain's table: about 300 groups at 500 slots (well under a second).
GROUP_WORK = 300**3 * 500
# Seconds per unit of L^3 x slots of the table, measured (benchmarks/results/solver.md).
SECONDS_PER_WORK = 2.5e-11


class Grouping(NamedTuple):
    """How a schedule was solved on groups of stages (``Schedule.grouping``).

    Attributes:
        sizes: the stages in each group, stage 1's group first.
        exact_seconds: about how long the exact table would have taken.
    """
    sizes: tuple
    exact_seconds: float

    def __str__(self):
        small, large = min(self.sizes), max(self.sizes)
        each = f"{small}" if small == large else f"{small} to {large}"
        return (f"solved on {len(self.sizes):,} groups of {each} adjacent stages: the exact table would take "
                f"{_duration(self.exact_seconds)} (docs/how-it-works.md, \"Long chains\")")


def _duration(seconds):
    if seconds < 120:
        return f"~{seconds:.0f} s"
    if seconds < 7200:
        return f"~{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"~{seconds / 3600:.0f} h"
    return f"~{seconds / 86400:,.0f} days"


def exact_work(n, slots):
    """The exact table's work for ``n`` stages and ``slots`` slots, as L^3 x slots."""
    return float(n) ** 3 * slots


def group_count(slots):
    """How many groups a coarse chain gets: its table within ``GROUP_WORK``."""
    return max(2, int((GROUP_WORK / slots) ** (1 / 3)))


def cuts(costs, groups):
    """At most ``groups`` runs of adjacent stages as (lo, hi), 1-based and inclusive,
    balanced by time and saved bytes (Note [Groups]); the tail alone in the last."""
    n = costs.length
    m = n - costs.tail
    if costs.tail:
        groups -= 1
    if groups >= m:   # (every stage its own group: the chain itself)
        return [(k, k) for k in range(1, n + 1)]
    groups = max(1, groups)
    times = [costs.fwd_time[i] + costs.bwd_time[i] for i in range(m)]
    sizes = costs.saved_bytes[:m]
    total_t, total_s = sum(times), sum(sizes)
    weights = [(times[i] / total_t if total_t else 0.0) + (sizes[i] / total_s if total_s else 0.0)
               for i in range(m)]
    if not any(weights):
        weights = [1.0] * m
    step = sum(weights) / groups
    ranges, acc, lo, last = [], 0.0, 1, 0
    for k in range(1, m + 1):
        w = weights[k - 1]
        g = min(groups - 1, int((acc + w / 2) / step))   # (the group of stage k's middle)
        acc += w
        if g != last and k > lo:
            ranges.append((lo, k - 1))
            lo = k
        last = g
    ranges.append((lo, m))
    if costs.tail:
        ranges.append((n, n))
    return ranges


def grouped_costs(costs, ranges):
    """The coarse chain of ``ranges`` (Note [Groups])."""
    x, s = costs.sizes(), (0,) + costs.saved_bytes
    ft, bt, rebuilt = (0,) + costs.fwd_tmp, (0,) + costs.bwd_tmp, (0,) + costs.bwd_tmp_rebuilt
    ftn = (0,) + costs.fwd_tmp_nograd
    fields = {name: [] for name in ("fwd_time", "fwd_nograd_time", "bwd_time", "out_bytes", "saved_bytes",
                                    "fwd_tmp", "bwd_tmp", "bwd_rebuilt_less", "fwd_nograd_less", "fwd_drop",
                                    "fwd_drop_whole", "options")}
    for lo, hi in ranges:
        for name in ("fwd_time", "fwd_nograd_time", "bwd_time"):
            fields[name].append(math.fsum(getattr(costs, name)[lo - 1:hi]))
        fields["out_bytes"].append(x[hi])
        fields["saved_bytes"].append(sum(s[lo:hi + 1]))
        fwd, nograd, before = 0, 0, 0
        for k in range(lo, hi + 1):   # (3.)
            fwd = max(fwd, max(x[k - 1] if k > lo else 0, before) + x[k] + ft[k])
            nograd = max(nograd, (x[k - 1] if k > lo else 0) + x[k] + ftn[k])
            before += s[k]
        # (4.; a group rebuilt in the backward rebuilds each of its stages: their rebuilt bwd_tmp)
        bwd, bwd_rebuilt = (max(-x[hi], _group_bwd(x, s, b, lo, hi) - x[hi] - x[lo - 1]) for b in (bt, rebuilt))
        fields["fwd_tmp"].append(max(0, fwd - x[hi]))
        fields["fwd_nograd_less"].append(max(0, fwd - x[hi]) - max(0, nograd - x[hi]))
        fields["bwd_tmp"].append(bwd)
        fields["bwd_rebuilt_less"].append(bwd - bwd_rebuilt)
        fields["fwd_drop"].append(costs.fwd_drop[hi - 1])   # (5.)
        fields["fwd_drop_whole"].append(costs.fwd_drop_whole[hi - 1])
        fields["options"].append(costs.options[lo - 1] if lo == hi else ())   # (6.)
    return Costs(**fields, input_bytes=costs.input_bytes, held_bytes=costs.held_bytes, tail=costs.tail,
                 tail_kept=costs.tail_kept, output_held=costs.output_held)


def _group_bwd(x, s, bt, lo, hi):
    """The most B(k), k = hi down to lo, holds above the records gone (4. of Note [Groups])."""
    bwd, after = None, 0
    for k in range(hi, lo - 1, -1):
        level = x[k] + x[k - 1] + bt[k] - after
        bwd = level if bwd is None else max(bwd, level)
        after += s[k]
    return bwd


def expand(ops, ranges):
    """The ops of a coarse chain's schedule written as its stages' (Note [Groups])."""
    out = []
    for op in ops:
        if op is Loss:
            out.append(Loss)
            continue
        lo, hi = ranges[op.stage - 1]
        kind = type(op)
        if kind is B:
            out.extend(B(k) for k in range(hi, lo - 1, -1))
        elif kind is Fall and op.option:
            out.append(Fall(lo, op.option))   # (a group of one stage: 6.)
        elif kind is Fall:
            out.extend(Fall(k) for k in range(lo, hi + 1))
        else:
            out.append(Fck(lo) if kind is Fck else Fn(lo))
            out.extend(Fn(k) for k in range(lo + 1, hi + 1))
    return tuple(out)


def solve_on_groups(costs, budget, slots, count):
    """``solve``'s optimal schedule of ``costs`` planned on at most ``count`` groups,
    then 4 x as many where the budget is below the first coarse chain's minimum;
    the fastest of the coarse chain's schedules that fits on the stages' own costs
    (Note [Groups]), or the periodic one that beats it."""
    from . import binding as _c_solver
    from .solve import REFINE, _as_without_options, _at_least_periodic, _solver_ops, store_all
    from .progress import phase
    from .schedule import Schedule, simulate

    n, held = costs.length, costs.held_bytes
    best = None
    for rung in (count, 4 * count):
        ranges = cuts(costs, rung)
        phase(f"planning on {len(ranges):,} groups of stages")
        coarse = grouped_costs(costs, ranges)
        least_ops, least = _c_solver.least_memory(coarse)
        least += held
        if budget < least:
            continue
        candidates = [(least_ops, None)]
        if exact_work(len(ranges), slots) <= EXACT_WORK:
            factors, plain_ops = REFINE, None
            if coarse.has_options:
                factors, plain_ops = _as_without_options(coarse, budget - held, slots)
            candidates += [_solver_ops(coarse, budget - held, slots, factors), (store_all(coarse.length), None)]
            candidates += [(plain_ops, None)] if plain_ops is not None else []
        phase(f"checking {len(candidates)} schedules on the {n:,} stages")
        for ops, slot in candidates:
            full = expand(ops, ranges)
            sim = simulate(costs, full)
            if sim.peak <= budget and (best is None or sim.time < best[1].time):
                best = (full, sim, slot, tuple(hi - lo + 1 for lo, hi in ranges))
        if best is not None:
            break
    if best is None:
        raise _below(costs, budget, least, len(ranges))
    phase("comparing with the periodic schedules")
    ops, sim = _at_least_periodic(costs, budget, best[0], best[1], few=True)
    grouping = Grouping(best[3], SECONDS_PER_WORK * exact_work(n, slots)) if len(best[3]) < n else None
    return Schedule(ops, sim.time, sim.peak, "optimal", budget, best[2], costs.tail, grouping)


def least_planned(costs, slots):
    """The least budget ``solve``'s optimal algorithm plans ``costs`` in: the chain's
    minimum where it solves exactly, else its finest coarse chain's (4 x
    ``group_count`` groups), the minimum its ``BudgetError`` names."""
    from . import binding as _c_solver

    if exact_work(costs.length, slots) > EXACT_WORK:
        costs = grouped_costs(costs, cuts(costs, 4 * group_count(slots)))
    return _c_solver.least_memory(costs)[1] + costs.held_bytes


def _below(costs, budget, least, groups):
    """The ``BudgetError`` for a budget below the finest coarse chain's minimum."""
    from ..errors import BudgetError
    from ..units import format_bytes

    n = costs.length
    if groups == n:   # (every group one stage: the chain's own minimum)
        return BudgetError(f"remat: budget {format_bytes(budget)} is below this chain's minimum of "
                           f"{format_bytes(least)} ({least} bytes); raise the budget or split the largest stage",
                           least)
    return BudgetError(
        f"remat: budget {format_bytes(budget)} is below the least schedule remat finds for this chain of "
        f"{n:,} stages, {format_bytes(least)} ({least} bytes), planned on {groups:,} groups of adjacent stages "
        f"(the exact least-memory program would take too long on {n:,} stages; docs/how-it-works.md, "
        f"\"Long chains\"); raise the budget", least)
