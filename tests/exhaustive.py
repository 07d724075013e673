"""Exhaustive search over every valid op sequence of a tiny chain (tests only).

Dijkstra over simulate's states (remat/solver/schedule.py Note [Accounting]): the
least time of any schedule whose peak stays within the budget. With
``persistent=True`` it keeps to persistent schedules: ``Fn(i)`` may only
follow ``Fn(i-1)`` or ``Fck(i-1)``, so a value that outlives the op after
the one that made it is kept until its last use.
"""

import heapq
import math

from remat.solver.schedule import B, Fall, Fck, Fn, Loss


def best_schedule(costs, budget, persistent):
    """(least time, ops) over all (or all persistent) schedules, or (inf, None)."""
    n = costs.length
    x = costs.sizes()
    s, ft, bt = costs.saved_bytes, costs.fwd_tmp, costs.bwd_tmp
    tf, tn, tb = costs.fwd_time, costs.fwd_nograd_time, costs.bwd_time
    fd, fdw = (0,) + costs.fwd_drop, (0,) + costs.fwd_drop_whole
    # state: (forward?, next_fwd, grad, alone bitmask, whole bitmask, previous op,
    # gone bitmask: a^j let go in the forward phase, rule 6 of Note [Accounting])
    start = (True, 1, -1, 1, 0, None, 0)
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
        forward, nf, grad, alone, whole, prev, gone = st
        if not forward and grad == 0:
            ops = []
            while st in back:
                st, op = back[st]
                ops.append(op)
            return d, tuple(reversed(ops))
        mem = _held(x, s, alone, whole, grad) - sum(fd[j] for j in range(n + 1) if (gone >> j) & 1) + costs.held_bytes
        moves = []
        if forward and nf == n + 1 and mem + x[n] <= budget:
            moves.append((Loss, 0.0, (False, nf, n, alone, whole, None, gone)))
        stages = [nf] if forward and nf <= n else ([] if forward else range(1, grad + 1))
        for i in stages:
            if costs.tail and i == n and not forward:
                continue   # (the tail runs once: Fall(n) in the forward phase)
            have_in = (alone >> (i - 1)) & 1 or (whole >> (i - 1)) & 1
            have_out = (alone >> i) & 1 or (whole >> i) & 1
            if not have_in or have_out:
                continue
            nf2 = nf + 1 if forward else nf
            if mem + max(s[i - 1], x[i] + ft[i - 1]) <= budget:
                g2 = gone
                if forward and i > 1 and (fdw[i - 1] if (whole >> (i - 1)) & 1 else fd[i - 1]):
                    g2 |= 1 << (i - 1)
                moves.append((Fall(i), tf[i - 1], (forward, nf2, grad, alone, whole | (1 << i), "all", g2)))
            if mem + x[i] + ft[i - 1] <= budget and not (costs.tail and i == n):
                t = tf[i - 1] if forward else tn[i - 1]
                moves.append((Fck(i), t, (forward, nf2, grad, alone | (1 << i), whole, ("f", i), gone)))
                if not persistent or prev == ("f", i - 1):
                    moves.append((Fn(i), t, (forward, nf2, grad, (alone | (1 << i)) & ~(1 << (i - 1)), whole,
                                             ("f", i), gone)))
        if not forward and grad >= 1:
            i = grad
            have_in = (alone >> (i - 1)) & 1 or (whole >> (i - 1)) & 1
            back_in = fd[i] if (gone >> i) & 1 else 0   # rule 6: B(i)'s peak adds it back
            if (whole >> i) & 1 and have_in and mem + back_in + x[i - 1] + bt[i - 1] <= budget:
                a2 = alone & ~(1 << i) & ~(1 << (i - 1))
                w2 = whole & ~(1 << i)
                moves.append((B(i), tb[i - 1], (False, nf, i - 1, a2, w2, "b", gone & (a2 | w2))))
        for op, cost, nxt in moves:
            nd = d + cost
            if nd < dist.get(nxt, math.inf):
                dist[nxt] = nd
                back[nxt] = (st, op)
                heapq.heappush(heap, (nd, counter, nxt))
                counter += 1
    return math.inf, None


def _held(x, s, alone, whole, grad):
    mem = 0
    for j in range(len(x)):
        if (whole >> j) & 1:
            mem += s[j - 1]
        elif (alone >> j) & 1:
            mem += x[j]
    if grad >= 0:
        mem += x[grad]
    return mem
