"""``solve``: from costs and a budget to a ``Schedule`` (docs/how-it-works.md,
"The optimal solver").

Note [The recurrence]
---------------------
The optimal algorithm is the persistent dynamic program of Beaumont et al.
(2019), with every memory condition derived from ``simulate``'s accounting
(remat/solver/schedule.py Note [Accounting]) rather than copied from rotor.

P(a, t, m) backpropagates stages a..t. On entry a^(a-1) and the gradient of
a^t are held by the caller (the latter only if t < L: before ``Loss`` there
is no gradient) and m is the headroom, the budget minus everything held.
With g = x[t] if t < L else 0, and forward cost f_k = fwd_time[k] if t = L
(the forward phase) else fwd_nograd_time[k]:

* Fall branch: Fall(a), P(a+1, t, m - s[a]), B(a). Needs
  max(s[a], x[a] + fwd_tmp[a]) <= m and
  s[a] + x[a] + x[a-1] + bwd_tmp[a] <= m + g
  (B(a) holds a-bar^a, the gradient of a^a and makes that of a^(a-1); the
  gradient of a^t that the caller held is gone by then), and at a = L also
  s[L] + x[L] <= m: ``Loss`` holds a-bar^L with the gradient of a^L, more
  than B(L)'s peak where bwd_tmp[L] < -x[L-1] (a stage that gives its output
  back, Costs.bwd_tmp); elsewhere the ops before B(a) held as much. For a = t
  the middle call is empty. With options (remat/solver/option.py Note
  [Options]) there is one Fall branch per way to record stage a: Fall(a,
  option=o), P(a+1, t, m - s_o), B(a), the same conditions with option o's
  saved_bytes, fwd_tmp and bwd_tmp, at fwd_time_o + bwd_time_o; P is the least
  over them and the checkpoint branch. B(a)'s condition uses bwd_tmp_o because
  the persistent schedule holds a^(a-1), which the option's backward rebuilds
  from, from Fall(a) to B(a): nothing else changes.
* Drops (forward phase, t = L; Note [Accounting] 6 in remat/solver/schedule.py): in
  P(a, L) whose caller holds a^(a-1) on its own with fwd_drop[a-1] > 0, or
  inside a-bar^(a-1) with fwd_drop_whole[a-1] > 0, a Fall(a) lets go of
  r = fwd_drop[a-1] of it: the rest of the Fall branch has headroom m - s[a]
  + r and B(a) needs its condition with m + g + r. Only the base record's
  Fall(a) does, and only after the base record of stage a-1 when a^(a-1) is
  inside a-bar^(a-1): an option's backward may read both (Note [Options] 3). The checkpoint branch is
  unchanged (Fck(a) keeps a^(a-1)); its P(j, L) drops after Fn/Fck(j-1) as
  above. Sizes dropped round down to slots.
* Checkpoint branch, for j in a+1..t: Fck(a), Fn(a+1) .. Fn(j-1),
  P(j, t, m - x[j-1]), P(a, j-1, m + g - x[j-1]). Needs x[a] + fwd_tmp[a] <= m
  and x[k-1] + x[k] + fwd_tmp[k] <= m for a < k < j, where t < L with
  fwd_tmp less fwd_nograd_less (after Loss these forwards do not record).

The top call is P(1, L, budget - x[0] - held_bytes). Sizes are rounded *up* to slots of
``ceil(budget / slots)`` bytes and the budget down, so a schedule that fits in
slots fits in bytes. The C solver (src_c/solver.c) computes this table;
tests/reference_solver.py is its plain Python twin.
"""

import math
import re
import warnings

from .bound import time_bound
from .casts import least_schedule, solve_with_casts
from .checks import check_costs
from .costs import MAX_BYTES, Costs
from .group import EXACT_WORK, exact_work, group_count, solve_on_groups
from .option import Option
from .progress import solving
from ..errors import BudgetError, RematError, SolverError, UsageError
from .schedule import B, Fall, Fck, Fn, Loss, Schedule, simulate
from ..units import format_bytes

__all__ = ["solve", "discretise", "ALGORITHMS", "minimum_budget", "time_bound", "fastest"]

ALGORITHMS = ("optimal", "store_all", "min_memory", "sqrt", "periodic(k)")
DEFAULT_SLOTS = 500
REFINE = (1, 4, 16)   # the factors of slots the table is tried with, in turn (_solver_ops)


def discretise(costs, slot):
    """``costs`` with every size rounded up to whole slots of ``slot`` bytes (what the
    forward phase drops, down)."""
    check_costs(costs, "discretise")
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 1:
        raise UsageError(f"remat: discretise's slot must be an int of bytes >= 1, got {slot!r}")
    up = lambda v: -(-v // slot)
    return Costs(
        fwd_time=costs.fwd_time, fwd_nograd_time=costs.fwd_nograd_time, bwd_time=costs.bwd_time,
        out_bytes=[up(v) for v in costs.out_bytes], saved_bytes=[up(v) for v in costs.saved_bytes],
        fwd_tmp=[up(v) for v in costs.fwd_tmp], bwd_tmp=[up(v) for v in costs.bwd_tmp],
        input_bytes=up(costs.input_bytes), held_bytes=up(costs.held_bytes),
        # (a rebuilt B's transient, and a forward's without recording, round up on their own)
        bwd_rebuilt_less=[up(b) - up(b - v) for b, v in zip(costs.bwd_tmp, costs.bwd_rebuilt_less)],
        fwd_nograd_less=[up(f) - up(f - v) for f, v in zip(costs.fwd_tmp, costs.fwd_nograd_less)],
        tail=costs.tail, tail_kept=up(costs.tail_kept), output_held=costs.output_held,
        # what is let go rounds down: held less dropped stays at least the bytes
        fwd_drop=[v // slot for v in costs.fwd_drop], fwd_drop_whole=[v // slot for v in costs.fwd_drop_whole],
        options=[[Option(up(o.saved_bytes), o.fwd_time, o.bwd_time, up(o.fwd_tmp), up(o.bwd_tmp)) for o in stage]
                 for stage in costs.options],
    )


def slot_size(budget, slots):
    """Bytes per slot for a budget cut into ``slots`` slots (at least 1)."""
    return max(1, -(-budget // slots))


def store_all(n):
    """Plain PyTorch: record every stage, recompute nothing."""
    return tuple(Fall(i) for i in range(1, n + 1)) + (Loss,) + tuple(B(i) for i in range(n, 0, -1))


def fastest(costs):
    """Record every stage with its fastest way (least fwd_time + bwd_time, the base
    record among equals; remat/solver/option.py Note [Options]), recompute nothing:
    no schedule is faster. ``store_all`` where no option is faster."""
    ops = list(store_all(check_costs(costs, "fastest").length))
    for i, listed in enumerate(costs.options):
        times = [costs.fwd_time[i] + costs.bwd_time[i]] + [o.fwd_time + o.bwd_time for o in listed]
        best = times.index(min(times))
        if best:
            ops[i] = Fall(i + 1, option=best)
    return tuple(ops)


def periodic(n, k, tail=False):
    """What checkpoint_sequential does with segments of ``k`` stages: keep each
    segment's input, recompute the segment before its backward; the last
    segment is recorded. With ``tail``, stage n is the chain's tail, recorded
    after the last segment (the segments cut stages 1..n-1)."""
    if tail:
        ops = list(periodic(n - 1, k))
        at = ops.index(Loss)
        return tuple(ops[:at] + [Fall(n), Loss, B(n)] + ops[at + 1:])
    if k >= n:
        return store_all(n)
    starts = list(range(1, n + 1, k))
    last = starts[-1]
    ops = []
    for a in starts[:-1]:
        ops.append(Fck(a))
        ops.extend(Fn(i) for i in range(a + 1, a + k))
    ops.extend(Fall(i) for i in range(last, n + 1))
    ops.append(Loss)
    ops.extend(B(i) for i in range(n, last - 1, -1))
    for a in reversed(starts[:-1]):
        ops.extend(Fall(i) for i in range(a, a + k))
        ops.extend(B(i) for i in range(a + k - 1, a - 1, -1))
    return tuple(ops)


def min_memory(n):
    """Keep only stage inputs: checkpoint every stage but the last, which is
    recorded; with a tail (the last stage, ``Costs.tail``), every stage of the
    chain is checkpointed, as per-block checkpointing does."""
    ops = [Fck(i) for i in range(1, n)] + [Fall(n), Loss, B(n)]
    for i in range(n - 1, 0, -1):
        ops += [Fall(i), B(i)]
    return tuple(ops)


def check_slots(slots):
    """Raise ValueError unless ``slots`` is an int the solver takes (1..10^7)."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 10**7:
        raise UsageError(f"remat: slots must be an int in 1..10^7, got {slots!r}")


def _parse_algorithm(algorithm, n):
    if not isinstance(algorithm, str):
        raise UsageError(f"remat: algorithm must be a string such as 'optimal', got {algorithm!r}")
    name = algorithm.strip().lower()
    if name in ("optimal", "store_all", "min_memory", "sqrt"):
        return name, None
    match = re.fullmatch(r"periodic\((\d+)\)", name.replace(" ", ""))
    if match and int(match.group(1)) >= 1:
        return "periodic", int(match.group(1))
    raise UsageError(f"remat: unknown algorithm {algorithm!r}; choose one of "
                     f"'optimal', 'store_all', 'min_memory', 'sqrt' or 'periodic(k)' with k >= 1")


def _check_budget(budget):
    if isinstance(budget, bool) or not isinstance(budget, int):
        text = ("; remat.chain reads sizes ('2GiB') and 'auto', solve takes bytes (2 * 2**30)"
                if isinstance(budget, str) else "")
        raise BudgetError(f"remat: budget must be an int of bytes here, got {budget!r}{text}")
    if budget <= 0:
        raise BudgetError(f"remat: budget must be positive, got {budget} bytes")
    if budget >= MAX_BYTES:
        raise BudgetError(f"remat: budget {budget} bytes is beyond any device; check the unit")
    return budget


def solve(costs, budget, algorithm="optimal", slots=DEFAULT_SLOTS, groups=None):
    """The schedule of ``algorithm`` for ``costs`` under ``budget`` bytes.

    Args:
        costs: a ``remat.Costs``.
        budget: bytes of activation memory (int).
        algorithm: 'optimal' (persistent dynamic program, least time),
            'store_all', 'min_memory', 'sqrt' or 'periodic(k)'.
        slots: how finely the optimal solver cuts the budget; more slots
            give schedules closer to the true optimum and cost more time.
        groups: None (the default): the optimal solver plans on groups of
            adjacent stages only where the exact table would take too long
            (remat/solver/group.py Note [Groups]); an int k: on at most k
            groups (exact where k >= L).

    Returns:
        A ``Schedule`` whose ``time`` and ``peak`` come from ``simulate``;
        its peak never exceeds ``budget``.

    Raises:
        BudgetError: the budget is below what the algorithm needs; the
            message gives the chain's minimum (on groups: the least schedule
            found).
        ValueError: unknown algorithm, bad slots or groups.
        KeyboardInterrupt: Ctrl-C during the solve, which stops it
            (remat/solver/progress.py Note [Stopping a solve]).

    Example:
        >>> from remat import Costs
        >>> s = solve(Costs.uniform(4, size=10), budget=10**6)
        >>> s.recomputations()
        0
    """
    check_costs(costs, "solve")
    budget = _check_budget(budget)
    check_slots(slots)
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
        raise UsageError(f"remat: groups must be None or an int >= 1 (the most groups of stages), got {groups!r}")
    n = costs.length
    if n == 0:
        raise UsageError("remat: the chain has no stages; call at least one @remat.stage inside the chain")
    (name, k), work = _parse_algorithm(algorithm, n), exact_work(n, slots)
    if name != "optimal":
        return _solve_fixed(costs, budget, algorithm, name, k)
    with solving(f"remat: solving {n:,} stages"):   # (progress past 2 s; Ctrl-C stops it)
        if any(costs.cast_bytes) and (groups or n) >= n and work <= EXACT_WORK:   # (casts.py)
            return solve_with_casts(costs, budget, lambda at: _solve_optimal(costs, at, slots), budget // slots, work)
        return _solve_optimal(costs, budget, slots, groups)


def _solve_fixed(costs, budget, algorithm, name, k):
    """The schedule of an algorithm that does not look at the costs (all but
    'optimal'); a ``BudgetError`` if it does not fit."""
    n, tail = costs.length, costs.tail
    ops = {"store_all": lambda: store_all(n), "min_memory": lambda: min_memory(n),
           "sqrt": lambda: periodic(n, max(1, round(math.sqrt(costs.stages))), tail),
           "periodic": lambda: periodic(n, k, tail)}[name]()
    sim = simulate(costs, ops)
    if sim.peak > budget:
        raise BudgetError(f"remat: the {algorithm} schedule needs {format_bytes(sim.peak)} but the budget is "
                          f"{format_bytes(budget)}; raise the budget or use algorithm='optimal' "
                          f"(this chain's minimum is {format_bytes(minimum_budget(costs))})", sim.peak)
    return Schedule(ops, sim.time, sim.peak, algorithm, budget, None, costs.tail)


def _solve_optimal(costs, budget, slots, groups=None):
    """The 'optimal' schedule: store everything if it fits, else the C solver's
    (docs/how-it-works.md, "Slots", lists the steps), on groups of stages where
    the exact table would take too long (remat/solver/group.py Note [Groups])."""
    n = costs.length
    full = simulate(costs, store_all(n))
    quick = store_all(n), full
    if costs.has_options:
        quick = fastest(costs), simulate(costs, fastest(costs))
    if quick[1].peak <= budget:
        return Schedule(quick[0], quick[1].time, quick[1].peak, "optimal", budget, None, costs.tail)
    if groups is None and exact_work(n, slots) > EXACT_WORK:
        groups = group_count(slots)
    if groups is not None and groups < n:
        return solve_on_groups(costs, budget, slots, groups)
    from . import binding as _c_solver

    # the C solver plans the activations: what is held through the step comes off the budget
    held = costs.held_bytes
    least = _c_solver.least_memory(costs)[1] + held
    if budget < least:
        shown = format_bytes(budget)
        if shown == format_bytes(least):   # (7.62 KiB below 7.62 KiB reads as a contradiction)
            shown += f" ({int(budget)} bytes)"
        raise BudgetError(
            f"remat: budget {shown} is below this chain's minimum of "
            f"{format_bytes(least)} ({least} bytes; storing everything needs "
            f"{format_bytes(full.peak)}); raise the budget or split the largest stage", least
        )
    factors, plain_ops = REFINE, None
    if costs.has_options:
        factors, plain_ops = _as_without_options(costs, budget - held, slots)
    ops, slot = _solver_ops(costs, budget - held, slots, factors)
    sim = simulate(costs, ops)
    _check_fits(sim, budget)
    if costs.has_options:   # (what the chain without options would return competes: _as_without_options)
        others = [(o, simulate(costs, o)) for o in (store_all(n), plain_ops) if o is not None]
        ops, sim = min([(ops, sim)] + [o for o in others if o[1].peak <= budget], key=lambda c: c[1].time)
    ops, sim = _at_least_periodic(costs, budget, ops, sim)
    return Schedule(ops, sim.time, sim.peak, "optimal", budget, slot, costs.tail)


def _solver_ops(costs, room, slots, factors=None):
    """The C solver's ops for ``room`` bytes, and the slot size it used (None for
    the exact least-memory schedule).

    Rounding sizes up to slots can make a budget just above the minimum look
    infeasible: refine the slots a few times (``factors`` of ``slots``, by
    default ``REFINE``), then fall back to the exact least-memory schedule,
    which fits by construction."""
    from . import binding as _c_solver

    for factor in REFINE if factors is None else factors:
        attempt = slots * factor
        try:
            ops, _, slot = _c_solver.optimal(costs, room, attempt)
        except _c_solver.Infeasible:
            if slot_size(room, attempt) == 1:
                break
            continue
        except SolverError as exc:
            # stacklevel: the warning names the code that called solve
            warnings.warn(f"{exc}; falling back to the least-memory schedule", RuntimeWarning, stacklevel=4)
            break
        return ops, slot
    return _c_solver.least_memory(costs)[0], None


def _as_without_options(costs, room, slots):
    """Where ``_solver_ops`` would find the schedule of ``costs`` without their
    options: the factors of ``slots`` from the first whose table that chain fits
    in (its least memory in those slots, a far cheaper dynamic program, within
    ``room``), and, where it fits in none, its least-memory schedule (else None).

    Options only add choices at one slot size. Solved from that slot size on,
    the chain with options is no slower than without them, where otherwise its
    table might fit coarser slots than theirs and miss what their finer slots
    find; where that chain falls back to its least-memory schedule (or stores
    everything, which the table's rounding may shut out), that schedule competes."""
    from . import binding as _c_solver

    plain = costs.without_options()
    try:
        for k, factor in enumerate(REFINE):
            slot = slot_size(room, slots * factor)
            if _c_solver.least_memory(discretise(plain, slot))[1] <= room // slot:
                return REFINE[k:], None
            if slot == 1:
                break
        return REFINE, _c_solver.least_memory(plain)[0]
    except SolverError:   # (tables too large: solved as they come, no promise)
        return REFINE, None


def _at_least_periodic(costs, budget, ops, sim, few=False):
    """The faster of the solver's schedule and those of the periodic family and
    per-block checkpointing that fit the budget in bytes. Sizes rounded up to
    slots can shut out a schedule that fits exactly, as checkpoint_sequential's
    and per-block checkpointing's do at their own measured peak; the periodic
    family (all of it up to 64 stages, else segment lengths near the usual
    choices; with ``few``, for a long chain solved on groups, the three
    nearest √L) costs a few simulations."""
    n = costs.stages
    lengths = range(1, n + 1) if n <= 64 else sorted(
        {1, 2, 3, 4, 6, 8, n // 2, n // 4, n // 8} | {max(1, round(math.sqrt(n))) + d for d in (-2, -1, 0, 1, 2)})
    if few and n > 64:
        lengths = [max(1, round(math.sqrt(n))) + d for d in (-1, 0, 1)]
    best = best_periodic(costs, budget, lengths)
    if best is not None and best[2].time < sim.time:
        ops, sim = best[1], best[2]
    if costs.tail:   # (per-block checkpointing, HF's, which no periodic schedule is where there is a tail)
        block = min_memory(costs.length)
        block_sim = simulate(costs, block)
        if block_sim.peak <= budget and block_sim.time < sim.time:
            return block, block_sim
    return ops, sim


def best_periodic(costs, budget, lengths=None):
    """The fastest periodic schedule (``periodic(k)``, checkpoint_sequential's) that
    fits ``budget`` in bytes, over segment lengths ``lengths`` (all by default), as
    (k, ops, Simulation); None if none fits. Segments cut the chain's own stages
    (its tail, if the costs have one, is recorded after them)."""
    n = costs.stages
    best = None
    for k in (range(1, n + 1) if lengths is None else lengths):
        if not 1 <= k <= n:
            continue
        ops = periodic(costs.length, k, costs.tail)
        sim = simulate(costs, ops)
        if sim.peak <= budget and (best is None or sim.time < best[2].time):
            best = (k, ops, sim)
    return best


def minimum_budget(costs):
    """The least budget in bytes any persistent schedule of ``costs`` fits in."""
    if any(check_costs(costs, "minimum_budget").cast_bytes):   # (remat/solver/casts.py)
        _, sim, least = least_schedule(costs)
        return min(least, sim.peak)
    from . import binding as _c_solver
    return _c_solver.least_memory(costs)[1] + costs.held_bytes


def _check_fits(sim, budget):
    if sim.peak > budget:
        raise RematError(
            f"remat: the solver returned a schedule peaking at {sim.peak} bytes over the budget "
            f"of {budget}; please report this bug with the chain's costs"
        )
