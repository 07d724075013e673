/* MIN_MEMORY: lo(a, t), the least headroom with which P(a, t) is feasible
 * (remat/solver/solve.py Note [The recurrence]), exactly in bytes. It follows the same
 * recurrence as the least-time table, a min over branches of the max of their
 * conditions; column n has the drop rows of mintime.c Note [Drops] (lod). The
 * schedule comes from remat_emit (solver.c), which re-evaluates the branches
 * along its path. */
#include <stdlib.h>

#include "internal.h"

typedef struct {
    const problem *p;
    ll *lo;
    ll *lod;   /* lod[a]: lo(a, n) where a Fall(a) drops a^(a-1) (mintime.c Note [Drops]) */
} lotable;

static ll lo_of(const lotable *L, ll a, ll t, int drop)
{
    return drop ? L->lod[a] : L->lo[pidx(a, t)];
}

/* The least headroom of the Fall branch with way q of stage a. */
static ll way_lo(const lotable *L, ll a, ll t, int drop, ll q)
{
    const problem *p = L->p;
    const way *w = &p->ways[q];
    ll r = fall_drop(p, a, q, drop), need = smax(way_fneed(p, w, t), way_bneed(p, w, t) - grad(p, t) - r);
    if (a < t) {
        ll after = lo_of(L, a + 1, t, drop_after_fall(p, a, t, q));
        if (after != LLONG_MAX)
            after = smax(0, sadd(after, w->s) - r);
        need = smax(need, after);
    }
    return smax(need, 0);
}

/* The least headroom of the Fall branch, over stage a's ways; the way in *qout. */
static ll fall_lo(const lotable *L, ll a, ll t, int drop, ll *qout)
{
    const problem *p = L->p;
    ll q, best = LLONG_MAX;
    for (q = p->first[a]; q < p->first[a + 1]; q++) {
        ll lo = way_lo(L, a, t, drop, q);
        if (lo < best) {
            best = lo;
            *qout = q;
        }
    }
    return best;
}

static ll split_lo(const lotable *L, ll a, ll t, ll j)
{
    const problem *p = L->p;
    ll xj = p->x[j - 1], xa = p->xa[j - 1];
    return smax(sadd(lo_of(L, j, t, drop_after_split(p, j, t)), xa), sadd(L->lo[pidx(a, j - 1)], xj) - grad(p, t));
}

static int choose_memory(const void *ctx, ll a, ll t, ll m, int drop, ll *jout)
{
    const lotable *L = (const lotable *)ctx;
    const problem *p = L->p;
    ll j, need;
    if (m < 0)
        return -1;
    if (fall_lo(L, a, t, drop, jout) <= m)
        return 0;   /* (*jout: the way) */
    need = fwd_need(p, a, t);
    for (j = a + 1; j <= t; j++) {
        if (j - 1 > a)
            need = smax(need, fwd_cond(p, j - 1, t));
        if (need > m)
            break;
        if (split_lo(L, a, t, j) <= m) {
            *jout = j;
            return 1;
        }
    }
    return -1;
}

int remat_solve_memory(const remat_chain *c, ll max_bytes, remat_plan *out)
{
    problem p;
    lotable L;
    ll n = c->length, d, a, bytes = (n * (n + 1) / 2) * (ll)sizeof(ll), m0;
    int st;
    out->slot_bytes = 1;
    if (bytes > max_bytes)
        return REMAT_E_TOO_LARGE;
    st = remat_problem_init(&p, c, 1);
    if (st != REMAT_OK)
        return st;
    L.p = &p;
    L.lo = (ll *)malloc((size_t)bytes);
    L.lod = (ll *)malloc((size_t)(n + 1) * sizeof(ll));
    if (!L.lo || !L.lod) {
        free(L.lo);
        free(L.lod);
        free(p.mem);
        return REMAT_E_NOMEM;
    }
    if (out->control)
        out->control->total = table_work(n);
    for (d = 0; d < n && !cancelled(out->control); d++) {
        advance(out->control, (d + 1) * (n - d));
        for (a = 1; a + d <= n; a++) {
            ll t = a + d, split = LLONG_MAX, need = fwd_need(&p, a, t), j, q;
            /* the split branch is the same with or without the drop: Fck(a) keeps a^(a-1) */
            for (j = a + 1; j <= t; j++) {
                if (j - 1 > a)
                    need = smax(need, fwd_cond(&p, j - 1, t));
                if (need >= split)
                    break;
                split = smin(split, smax(need, split_lo(&L, a, t, j)));
            }
            L.lo[pidx(a, t)] = smin(fall_lo(&L, a, t, 0, &q), split);
            if (t == n)
                L.lod[a] = (a > 1 && p.fd[a - 1] > 0) ? smin(fall_lo(&L, a, t, 1, &q), split) : LLONG_MAX;
        }
    }
    m0 = L.lo[pidx(1, n)];
    if (cancelled(out->control)) {   /* (the table may be unfinished) */
        st = REMAT_E_CANCELLED;
    } else if (sadd(m0, p.x[0]) > REMAT_MAX_BYTES) {
        st = REMAT_E_OVERFLOW;
    } else {
        out->min_budget = m0 + p.x[0];
        st = remat_emit(&p, choose_memory, &L, m0, REMAT_MAX_BYTES, out);
    }
    free(L.lo);
    free(L.lod);
    free(p.mem);
    return st;
}

