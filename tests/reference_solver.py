"""Pure-Python reference of the persistent dynamic program (tests only).

It is the readable twin of src_c/solver.c: same recurrence, same slot
rounding, no speed tricks. See remat/solver/solve.py Note [The recurrence].
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
    s = (0,) + costs.saved_bytes
    ft = (0,) + costs.fwd_tmp
    bt = (0,) + costs.bwd_tmp
    tf = (0.0,) + costs.fwd_time
    tn = (0.0,) + costs.fwd_nograd_time
    tb = (0.0,) + costs.bwd_time
    # a^k dropped by a forward-phase Fall(k+1) (Note [Accounting] 6 in remat/solver/schedule.py),
    # held on its own or (whole) inside a-bar^k; sizes here are already whole units
    fd = (0,) + costs.fwd_drop
    fdw = (0,) + costs.fwd_drop_whole
    sys.setrecursionlimit(max(10000, 50 * n * n))

    @functools.lru_cache(maxsize=None)
    def solve(a, t, m, drop=False):
        """(cost, choice) for backpropagating stages a..t with headroom m; with
        ``drop`` (forward phase only), a Fall(a) lets go of fd[a-1] of a^(a-1)."""
        if m < 0:
            return INF, None
        g = x[t] if t < n else 0
        r = fd[a - 1] if drop else 0
        best, choice = INF, None
        loss = s[a] + x[a] if a == n else 0   # the level Loss reaches, which B(L) starts from
        if max(s[a], x[a] + ft[a]) <= m and max(s[a] + x[a] + x[a - 1] + bt[a], loss) <= m + g + r:
            if a == t:
                best, choice = tf[a] + tb[a], ("all",)
            else:
                c = solve(a + 1, t, m - s[a] + r, t == n and fdw[a] > 0)[0]
                if c < INF:
                    best, choice = tf[a] + c + tb[a], ("all",)
        if a < t and x[a] + ft[a] <= m:
            fsum = 0.0
            for j in range(a + 1, t + 1):
                k = j - 1  # the last stage run forward before the sub-chain j..t
                if k > a and x[k - 1] + x[k] + ft[k] > m:
                    break
                fsum += tf[k] if t == n else tn[k]
                c1 = solve(j, t, m - x[j - 1], t == n and fd[j - 1] > 0)[0]
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
            out.append(Fall(a))
            if a == t:
                if t == n:
                    out.append(Loss)
            else:
                emit(a + 1, t, m - s[a] + (fd[a - 1] if drop else 0), out, t == n and fdw[a] > 0)
            out.append(B(a))
        else:
            j = choice[1]
            g = x[t] if t < n else 0
            out.append(Fck(a))
            out.extend(Fn(k) for k in range(a + 1, j))
            emit(j, t, m - x[j - 1], out, t == n and fd[j - 1] > 0)
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
