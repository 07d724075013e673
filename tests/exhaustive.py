"""Exhaustive search over every valid op sequence of a tiny chain (tests only).

Dijkstra over simulate's states (remat/solver/schedule.py Note [Accounting]): the
least time of any schedule whose peak stays within the budget. With
``persistent=True`` it keeps to persistent schedules: ``Fn(i)`` may only
follow ``Fn(i-1)`` or ``Fck(i-1)``, so a value that outlives the op after
the one that made it is kept until its last use. A stage with options
(``Costs.options``) may be recorded with any of them (rule 9 of Note
[Accounting]).
"""

import heapq
import math

from remat.solver.schedule import B, Fall, Fck, Fn, Loss


def best_schedule(costs, budget, persistent):
    """(least time, ops) over all (or all persistent) schedules, or (inf, None)."""
    n = costs.length
    x = costs.sizes()
    xa = costs.alone_sizes()   # (a^j held on its own)
    held = costs.stages if costs.output_held else -1   # (rule 1: that one made again after Loss is a copy)
    s, ft, bt = costs.saved_bytes, costs.fwd_tmp, costs.bwd_tmp
    ftn = costs.fwd_tmp_nograd   # (Fn/Fck after Loss, without recording)
    tf, tn, tb = costs.fwd_time, costs.fwd_nograd_time, costs.bwd_time
    fd, fdw = (0,) + costs.fwd_drop, (0,) + costs.fwd_drop_whole
    # ways[i-1]: (s, fwd_tmp, bwd_tmp, fwd_time, bwd_time) of each way to record stage i,
    # option 0 (the base record) first
    rebuilt = costs.bwd_tmp_rebuilt   # (B(i) of a base-record a-bar^i made after Loss)
    ways = [((s[i], ft[i], bt[i], tf[i], tb[i]),) + tuple(
        (o.saved_bytes, o.fwd_tmp, o.bwd_tmp, o.fwd_time, o.bwd_time) for o in costs.options[i]) for i in range(n)]
    # state: (forward?, next_fwd, grad, alone bitmask, whole bitmask, previous op,
    # gone bitmask: a^j let go in the forward phase, rule 6 of Note [Accounting],
    # and the option each stage's held a-bar was recorded with, 0 where none is held, and
    # whether it was recorded after Loss)
    start = (True, 1, -1, 1, 0, None, 0, ((0, False),) * (n + 1))
    if x[0] + costs.held_bytes > budget:
        return math.inf, None
    dist = {start: 0.0}
    back = {}
    heap = [(0.0, 0, start)]
    counter = 1
    while heap:
        d, _, st = heapq.heappop(heap)
        if d > dist.get(st, math.inf):
            continue
        forward, nf, grad, alone, whole, prev, gone, rec = st
        if not forward and grad == 0:
            ops = []
            while st in back:
                st, op = back[st]
                ops.append(op)
            return d, tuple(reversed(ops))
        held_s = [ways[j - 1][rec[j][0]][0] + (x[j] if j == held and rec[j][1] else 0) for j in range(1, n + 1)]
        mem = _held(x, xa, held_s, alone, whole, grad) - sum(fd[j] for j in range(n + 1) if (gone >> j) & 1) \
            + costs.held_bytes
        moves = []
        if forward and nf == n + 1 and mem + x[n] <= budget:
            moves.append((Loss, 0.0, (False, nf, n, alone, whole, None, gone, rec)))
        stages = [nf] if forward and nf <= n else ([] if forward else range(1, grad + 1))
        for i in stages:
            if costs.tail and i == n and not forward:
                continue   # (the tail runs once: Fall(n) in the forward phase)
            have_in = (alone >> (i - 1)) & 1 or (whole >> (i - 1)) & 1
            have_out = (alone >> i) & 1 or (whole >> i) & 1
            if not have_in or have_out:
                continue
            nf2 = nf + 1 if forward else nf
            copy = x[i] if i == held and not forward else 0
            for q, (sq, ftq, _, tfq, _) in enumerate(ways[i - 1]):
                if mem + max(sq + copy, (copy or xa[i]) + ftq) > budget:
                    continue
                g2 = gone   # (rule 9: an option lets nothing go, nor does an a-bar of one)
                if forward and i > 1 and q == 0 and (
                        (fdw[i - 1] if rec[i - 1][0] == 0 else 0) if (whole >> (i - 1)) & 1 else fd[i - 1]):
                    g2 |= 1 << (i - 1)
                rec2 = rec[:i] + ((q, not forward),) + rec[i + 1:]
                moves.append((Fall(i, option=q), tfq, (forward, nf2, grad, alone, whole | (1 << i), "all", g2, rec2)))
            if mem + (copy or xa[i]) + (ft if forward else ftn)[i - 1] <= budget and not (costs.tail and i == n):
                t = tf[i - 1] if forward else tn[i - 1]
                moves.append((Fck(i), t, (forward, nf2, grad, alone | (1 << i), whole, ("f", i), gone, rec)))
                if not persistent or prev == ("f", i - 1):
                    moves.append((Fn(i), t, (forward, nf2, grad, (alone | (1 << i)) & ~(1 << (i - 1)), whole,
                                             ("f", i), gone, rec)))
        if not forward and grad >= 1:
            i = grad
            have_in = (alone >> (i - 1)) & 1 or (whole >> (i - 1)) & 1
            back_in = fd[i] if (gone >> i) & 1 else 0   # rule 6: B(i)'s peak adds it back
            _, _, btq, _, tbq = ways[i - 1][rec[i][0]]
            if rec[i] == (0, True):
                btq = rebuilt[i - 1]
            if (whole >> i) & 1 and have_in and mem + back_in + x[i - 1] + btq <= budget:
                a2 = alone & ~(1 << i) & ~(1 << (i - 1))
                w2 = whole & ~(1 << i)
                rec2 = rec[:i] + ((0, False),) + rec[i + 1:]
                moves.append((B(i), tbq, (False, nf, i - 1, a2, w2, "b", gone & (a2 | w2), rec2)))
        for op, cost, nxt in moves:
            nd = d + cost
            if nd < dist.get(nxt, math.inf):
                dist[nxt] = nd
                back[nxt] = (st, op)
                heapq.heappush(heap, (nd, counter, nxt))
                counter += 1
    return math.inf, None


def _held(x, xa, s, alone, whole, grad):
    mem = 0
    for j in range(len(x)):
        if (whole >> j) & 1:
            mem += s[j - 1]
        elif (alone >> j) & 1:
            mem += xa[j]
    if grad >= 0:
        mem += x[grad]
    return mem
