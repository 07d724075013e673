"""``time_bound``: how fast any schedule of a chain can be within a budget,
persistent or not (the benchmarks hold remat's schedules to it).

Note [A bound on any schedule]
------------------------------
In any schedule each stage i runs forward before ``Loss`` (the loss needs the
chain's output), and ``B(i)`` needs a-bar^i from a ``Fall(i)``. Either that
``Fall(i)`` ran before ``Loss`` and its a-bar^i is held from then until
``B(i)`` (less what rule 6 of Note [Accounting] lets go of a^i,
``fwd_drop_whole``: its weight), or it runs after, and stage i runs forward at
least twice: its run in the forward phase (fwd_time there, with or without
recording: Note [Accounting]; or an option's) more than in plain PyTorch's
schedule (its gain). Call the first kind kept. With a^0 and ``held_bytes``
held throughout, the kept stages' weights fit in the budget at ``Loss``, and
at each ``B(i)`` so do the kept stages before i together with what ``B(i)``
itself holds (a-bar^i, the gradients of a^i and a^(i-1), ``bwd_tmp``). The
least extra time is then a knapsack under nested capacities (one per prefix
of the chain); its fractional relaxation is a polymatroid, which the greedy
order, by gain per byte, solves exactly, and that bounds every schedule from
below. On a chain of like blocks whose a-bar dwarfs their output, the bound
at checkpoint_sequential's peak is checkpoint_sequential's own time, to
within the bytes its segment inputs take: no schedule can be much faster
there (benchmarks/README.md).

With options (remat/solver/option.py Note [Options]) a stage is recorded and
backwarded at least once with one of its ways, so its least time is that of
its fastest way; kept with way o it weighs that way's saved bytes (an option
lets nothing go) and takes its time over the fastest, not kept it takes the
gain. Each stage's choices are points (weight, extra time); the relaxation
may mix any two, so only their lower convex hull counts: from weight 0 down to
the fastest way, segments of falling gain per byte. The extra time is then a
concave function of each stage's bytes kept, over the same polymatroid, and
the greedy order over all stages' segments still solves it exactly (a stage's
segments come in their own order). Without options each stage has one
segment, its gain over its weight, as above.

Two things make it closer. A stage run once ran before every later stage's
first forward, and is held from then to its backward: so each first forward
(the tail's, a head's logits, among them) bounds the kept weights before it
too, beside its output and least transient; the capacities stay nested. And
a stage is kept whole or not at all: with the stages in order, a table of
the weight kept so far (in units, each weight and room rounded down, so
that whatever fits still does) gives the least extra time over whole
choices, exactly; the relaxation stands where the table would be too large.
On like blocks under a head whose logits leave no room for the last block's
record, that is the best schedule's time at two budgets in three
(tests/solver/test_bound.py). What it still leaves out: the stage inputs a
schedule holds to rebuild from (at per-block checkpointing's peak of a
GPT, keeping the last block's record leaves too little room for them).

Near the least budget that bound is loose: it lets every stage run forward
twice at most, where a schedule that can hold no activation through a
backward op runs the early stages again before each one. A second bound
counts those runs. While ``B(i)`` runs, the budget holds a^0, held_bytes,
the a-bar^i it reads (its way of least saved bytes plus bwd_tmp), the
gradients of a^i and a^(i-1) and a^(i-1) itself (its least holding: on its
own, in an a-bar or an option's record, less what rule 6 may drop). Where
what is left cannot hold any other a^j (1 <= j < L, j not i-1 or i) in its
least holding, nothing but a^0 is held once ``B(i)`` is done (rule 5 lets
a^(i-1) go with it); ``B(i-1)`` needs a^(i-2), so every stage before i-1
runs forward between the two, and stage i-1 too where its least record
could not be held through ``B(i)`` in place of a^(i-1). Those runs are over
the one each stage takes at least, in turns that do not overlap: each costs
at least the stage's least forward time (fwd_time, fwd_nograd_time or an
option's). Closer: a run of stage j < i-1 whose record, in its least
holding, could not be held through ``B(i-1)`` beside what that op needs
records nothing, so it takes fwd_nograd_time; and the run of stage i-1
there records it, so it is charged to the stage's run in the forward phase,
another run, which takes fwd_time or an option's at least. (At a GPT's
least budget on CPU, where a forward without recording measured slower
than one recording, these brought the bound from 6% under the best plan's
time to 2%.) The larger of the two bounds holds.
"""

import math

from .checks import check_bound_budget, check_costs

__all__ = ["time_bound"]


def time_bound(costs, budget):
    """A lower bound on the time of any schedule of ``costs`` within ``budget``,
    persistent or not (Note [A bound on any schedule]); inf if none fits (a
    budget below the chain's input, negative ones among them).

    Raises:
        TypeError: ``costs`` is not a Costs.
        BudgetError: ``budget`` is not a finite number of bytes (None, a str, NaN, inf).

    Example:
        >>> from remat import Costs
        >>> c = Costs.uniform(4, time=1.0, size=1, saved=10)
        >>> time_bound(c, 44)   # store-all's peak: store-all's time
        12.0
        >>> time_bound(c, 24)   # room for two a-bar: the other two run twice (the best schedule's)
        14.0
    """
    n = check_costs(costs, "time_bound").length
    budget = check_bound_budget(budget)
    x = costs.sizes()
    tf, tn = costs.fwd_time, costs.fwd_nograd_time
    # each stage's ways to record it: (saved, bwd_tmp, fwd_time, bwd_time), the base record first
    # (the base record's bwd_tmp as where rebuilt, the lesser: a bound holds for either)
    ways = [[(costs.saved_bytes[i], costs.bwd_tmp_rebuilt[i], tf[i], costs.bwd_time[i])]
            + [(o.saved_bytes, o.bwd_tmp, o.fwd_time, o.bwd_time) for o in costs.options[i]] for i in range(n)]
    fastest = [min(w, key=lambda way: way[2] + way[3]) for w in ways]   # (the first of equals)
    room = budget - costs.input_bytes - costs.held_bytes + sum(costs.cast_bytes)   # (casts: maybe gone, rule 10)
    # rooms[i] (0-based i < n): what B(i+1) leaves for the a-bar of earlier stages
    # held from the forward phase (with the way that leaves most); rooms[n]: what Loss leaves for all of them
    rooms = [room - min(s + x[i + 1] + x[i] + bt for s, bt, _, _ in ways[i]) for i in range(n)] + [room]
    # and what stage i+1's first forward leaves for them (its output and transient, in the way
    # that needs least: a stage run once ran before it, and is held from then to its backward)
    alone = costs.alone_sizes()
    ft = [min([costs.fwd_tmp[i]] + [o.fwd_tmp for o in costs.options[i]]) for i in range(n)]
    rooms = [min(r, room - alone[i + 1] - ft[i]) if i else r for i, r in enumerate(rooms[:n])] + rooms[n:]
    chain = range(n)
    if costs.tail:   # (it runs once, recorded: held at Loss, never run again)
        rooms[n] -= max(costs.saved_bytes[n - 1], 0)
        rooms[n - 1] = min(rooms[n - 1], room - max(costs.saved_bytes[n - 1], alone[n] + costs.fwd_tmp[n - 1]))
        chain = range(n - 1)
    if min(rooms) < 0:
        return math.inf
    tops, segments, choices = [], [], []
    for i in chain:
        drop = costs.fwd_drop_whole[i] if i < n - 1 else 0
        best = fastest[i][2] + fastest[i][3]
        points = [(0, min(w[2] for w in ways[i]))] + [
            (max(s - (drop if q == 0 else 0), 0), (f + b) - best if (s, bt, f, b) != fastest[i] else 0.0)
            for q, (s, bt, f, b) in enumerate(ways[i])]
        choices.append(points)
        hull = _lower_hull(points)
        tops.append(hull[0][1])
        segments += [(i, e0 - e1, w1 - w0) for (w0, e0), (w1, e1) in zip(hull, hull[1:])]
    whole = _whole_choices(choices, rooms)   # (before the greedy takes from rooms)
    saved = 0.0
    for i, gain, weight in sorted(segments, key=lambda seg: -seg[1] / seg[2]):
        share = min(weight, min(rooms[i + 1:]))   # (B of every later stage, and Loss)
        if share <= 0:
            continue
        saved += gain * (share / weight)
        for j in range(i + 1, n + 1):
            rooms[j] -= share
    least = math.fsum(fastest[i][2] for i in range(n)) + math.fsum(fastest[i][3] for i in range(n))
    again, nograd, recording = _runs_again(costs, ways, room)
    return max(least + max(math.fsum(tops) - saved, whole, 0.0),
               least + math.fsum(k * min(tf[j], tn[j], *(w[2] for w in ways[j])) for j, k in enumerate(again) if k)
               + math.fsum(k * tn[j] for j, k in enumerate(nograd) if k)
               + math.fsum(k * min(w[2] for w in ways[j]) for j, k in enumerate(recording) if k))


def _runs_again(costs, ways, room):
    """Forward runs of each stage beyond its one that any schedule of ``costs``
    takes with ``room`` bytes beside the chain's input and held_bytes (the second
    bound of Note [A bound on any schedule]): (those that may or may not record
    it, those that cannot, those that must, each a list by stage)."""
    n = costs.length
    x, alone = costs.sizes(), costs.alone_sizes()
    drop, whole = (0,) + costs.fwd_drop, (0,) + costs.fwd_drop_whole
    # the least bytes that hold a^j: on its own, or inside an a-bar^j (any way of recording it)
    record = [0] + [max(0, min(w[0] - (whole[j] if q == 0 else 0) for q, w in enumerate(ways[j - 1])))
                    for j in range(1, n)]
    least = [0] + [min(max(0, alone[j] - drop[j]), record[j]) for j in range(1, n)]
    again, nograd, recording = [0] * n, [0] * n, [0] * n
    # what B(i) leaves beside what it needs (1-based i; a^(i-1) not yet counted)
    lefts = [0, 0] + [room - min(w[0] + w[1] for w in ways[i - 1]) - x[i] - x[i - 1] for i in range(2, n + 1)]
    for i in range(2, n + 1):   # (B(i), 1-based)
        left = lefts[i]
        if left - least[i - 1] < min((least[j] for j in range(1, n) if j not in (i - 1, i)), default=math.inf):
            # stage j runs before B(i-1); recording it, it would hold its record through B(i-1)
            for j in range(1, i - 1):
                beside = lefts[i - 1] if j == i - 2 else lefts[i - 1] - least[i - 2]
                (again if beside >= record[j] else nograd)[j - 1] += 1
            if left < record[i - 1]:
                recording[i - 2] += 1
    return again, nograd, recording


def _whole_choices(choices, rooms, cells=1 << 22):
    """The least extra time of the first bound with each stage taking one of its
    points (weight, extra time) whole, ``choices[i]`` for the i-th stage of the
    chain, its prefix sums of weights within ``rooms`` (rooms[k] bounds the weights
    of the stages before k): a knapsack whose nested capacities a pass over the
    stages in order solves exactly, on weights and rooms counted in units of
    ``unit`` bytes, each rounded down (a choice that fits fits so: a bound still).
    0.0 where the table would take over ``cells`` cells (the relaxation alone then)."""
    points = sum(len(c) for c in choices)
    width = min(4096, cells // max(points, 1))
    if not choices or width < 64:
        return 0.0
    unit = max(1, -(-int(max(rooms)) // width))
    limits = [math.floor(min(rooms[k + 1:]) / unit) for k in range(len(choices))]
    table = {0: 0.0}   # units of weight so far -> least extra time
    for points, limit in zip(choices, limits):
        grown = {}
        for w, extra in table.items():
            for weight, more in points:
                v = w + int(weight // unit)
                if v <= limit and extra + more < grown.get(v, math.inf):
                    grown[v] = extra + more
        table = grown
    return min(table.values(), default=0.0)


def _lower_hull(points):
    """The lower convex hull of points (weight, extra time) from weight 0 to the
    least extra time: weights rising, extra times falling, gain per byte falling."""
    hull = []
    for w, e in sorted(points):
        if hull and e >= hull[-1][1]:
            continue   # (no lower than a lighter point)
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (e - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (w - hull[-2][0])) <= 0:
            hull.pop()   # (on or above the line from the one before to this one)
        hull.append((w, e))
    return hull
