"""Pure-Python reference of the persistent dynamic program (tests only).

It is the readable twin of src_c/solver.c: same recurrence, same slot
rounding, no speed tricks. See remat/solver/solve.py Note [The recurrence], and
remat/solver/option.py Note [Options] for the stages' other ways to record.
"""

import functools
import math
import sys

from remat.solver.schedule import B, Fall, Fck, Fn, Loss

INF = math.inf


def reference_optimal(costs, budget_units, units):
    """Optimal persistent schedule for ``costs`` already in slot ``units``.

    Args:
        costs: a Costs whose sizes are in slot units (see remat.solver.solve.discretise).
        budget_units: the budget in the same units.

    Returns:
        (time, ops) or (inf, None) if no persistent schedule fits.
    """
    n = costs.length
    x = costs.sizes()
    xa = costs.alone_sizes()   # (a^k held on its own)
    held = costs.stages if costs.output_held else -1   # (Note [Accounting] 1 in remat/solver/schedule.py)
    s = (0,) + costs.saved_bytes
    ft = (0,) + costs.fwd_tmp
    ftn = (0,) + costs.fwd_tmp_nograd   # (Fn/Fck after Loss run without recording: t < n)
    bt = (0,) + costs.bwd_tmp
    rebuilt = (0,) + costs.bwd_tmp_rebuilt   # (B(a) of an a-bar^a made after Loss: t < n)
    tf = (0.0,) + costs.fwd_time
    tn = (0.0,) + costs.fwd_nograd_time
    tb = (0.0,) + costs.bwd_time
    # a^k dropped by a forward-phase Fall(k+1) (Note [Accounting] 6 in remat/solver/schedule.py),
    # held on its own or (whole) inside a-bar^k; sizes here are already whole units
    fd = (0,) + costs.fwd_drop
    fdw = (0,) + costs.fwd_drop_whole
    # ways[k]: (option, s, fwd_tmp, bwd_tmp, fwd_time, bwd_time) of each way to record
    # stage k, option 0 (the base record) first
    ways = [()] + [((0, s[k], ft[k], bt[k], tf[k], tb[k]),) + tuple(
        (q, o.saved_bytes, o.fwd_tmp, o.bwd_tmp, o.fwd_time, o.bwd_time) for q, o in enumerate(costs.options[k - 1], 1))
        for k in range(1, n + 1)]
    sys.setrecursionlimit(max(10000, 50 * n * n))

    @functools.lru_cache(maxsize=None)
    def solve(a, t, m, drop=False):
        """(cost, choice) for backpropagating stages a..t with headroom m; with
        ``drop`` (forward phase only), a Fall(a) lets go of fd[a-1] of a^(a-1)."""
        if m < 0:
            return INF, None
        g = x[t] if t < n else 0
        best, choice = INF, None
        for q, sq, ftq, btq, tfq, tbq in ways[a]:
            r = fd[a - 1] if drop and q == 0 else 0   # (an option lets nothing go)
            loss = sq + x[a] if a == n else 0   # the level Loss reaches, which B(L) starts from
            xq = xa[a]
            if q == 0 and t < n:
                btq = rebuilt[a]
            if t < n and a == held:   # (a^L made again after Loss: a copy beside the caller's)
                sq, xq = sq + x[a], x[a]
            if max(sq, xq + ftq) <= m and max(sq + x[a] + x[a - 1] + btq, loss) <= m + g + r:
                if a == t:
                    c = 0.0
                else:
                    c = solve(a + 1, t, m - sq + r, t == n and fdw[a] > 0 and q == 0)[0]
                if c < INF and tfq + c + tbq < best:
                    best, choice = tfq + c + tbq, ("all", q)
        fwd = ft if t == n else ftn
        if a < t and xa[a] + fwd[a] <= m:
            fsum = 0.0
            for j in range(a + 1, t + 1):
                k = j - 1  # the last stage run forward before the sub-chain j..t
                if k > a and xa[k - 1] + xa[k] + fwd[k] > m:
                    break
                fsum += tf[k] if t == n else tn[k]
                c1 = solve(j, t, m - xa[j - 1], t == n and fd[j - 1] > 0)[0]
                if c1 == INF:
                    continue
                c2 = solve(a, j - 1, m + g - x[j - 1])[0]
                if c2 == INF:
                    continue
                if fsum + c1 + c2 < best:
                    best, choice = fsum + c1 + c2, ("ck", j)
        return best, choice

    def emit(a, t, m, out, drop=False):
        _, choice = solve(a, t, m, drop)
        if choice[0] == "all":
            q = choice[1]
            out.append(Fall(a, option=q))
            if a == t:
                if t == n:
                    out.append(Loss)
            else:
                r = fd[a - 1] if drop and q == 0 else 0
                emit(a + 1, t, m - ways[a][q][1] + r, out, t == n and fdw[a] > 0 and q == 0)
            out.append(B(a))
        else:
            j = choice[1]
            g = x[t] if t < n else 0
            out.append(Fck(a))
            out.extend(Fn(k) for k in range(a + 1, j))
            emit(j, t, m - xa[j - 1], out, t == n and fd[j - 1] > 0)
            emit(a, j - 1, m + g - x[j - 1], out)

    m0 = budget_units - x[0] - costs.held_bytes
    if n == 0:
        return INF, None
    best = solve(1, n, m0)[0]
    if best == INF:
        return INF, None
    ops = []
    emit(1, n, m0, ops)
    return best, tuple(ops)
