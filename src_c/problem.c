/* The chain as the tables read it (internal.h's problem): sizes in units of a
 * slot, and each stage's ways to be recorded with what their Fall and B need,
 * before Loss and after it (remat/solver/schedule.py Note [Accounting]). */
#include <stdlib.h>

#include "internal.h"

/* v / slot rounded up (C division truncates: up for v < 0, down for v > 0). */
static ll units(ll v, ll slot) { return v / slot + (v > 0 && v % slot != 0); }

/* What B(k) needs of a way keeping s with transient bt (bt >= -x[k], check_chain):
 * s + x[k] + x[k-1] + bt, and at k = n at least s + x[k], the level Loss reaches,
 * which B(n) starts from (remat/solver/solve.py Note [The recurrence]). */
static ll bneed(const problem *p, ll k, ll s, ll bt)
{
    ll need = sadd(sadd(s, p->x[k]), p->x[k - 1]);
    need = bt >= 0 ? sadd(need, bt) : need + bt;   /* (need may have saturated) */
    return k == p->n ? smax(need, sadd(s, p->x[k])) : need;
}

/* What way w of stage k needs where its Fall runs after Loss (t < n), rebuilding
 * a-bar^k, its B with transient bt. The output the caller holds (k = held) is then
 * made again, a copy beside the caller's: x[k] more from the Fall to the B
 * (remat/solver/schedule.py Note [Accounting] 1). */
static void set_rebuilt(const problem *p, way *w, ll k, ll held, ll ft, ll bt)
{
    ll copy = k == held ? p->x[k] : 0;
    w->fneed_rebuilt = smax(sadd(w->s, copy), sadd(copy ? copy : p->xa[k], ft));
    w->bneed_rebuilt = bneed(p, k, sadd(w->s, copy), bt);
}

/* Options of stage k (1-based) in the chain's option arrays: [*lo, *hi). */
static void option_range(const remat_chain *c, ll k, ll *lo, ll *hi)
{
    *lo = c->option_first ? c->option_first[k - 1] : 0;
    *hi = c->option_first ? c->option_first[k] : 0;
}

int remat_problem_init(problem *p, const remat_chain *c, ll slot)
{
    ll n = c->length, k, q, lo, hi, options = c->option_first ? c->option_first[n] : 0;
    p->n = n;
    /* (15 arrays of n + 1 ll, first's n + 2, 3 of doubles, then the ways: all 8-byte aligned) */
    p->mem = malloc((size_t)(n + 1) * (15 * sizeof(ll) + 3 * sizeof(double)) + sizeof(ll)
                    + (size_t)(n + 1 + options) * sizeof(way));
    if (!p->mem)
        return REMAT_E_NOMEM;
    p->x = (ll *)p->mem;
    p->xa = p->x + (n + 1);
    p->s = p->xa + (n + 1);
    p->ft = p->s + (n + 1);
    p->bt = p->ft + (n + 1);
    p->fa = p->bt + (n + 1);
    p->cond = p->fa + (n + 1);
    p->fan = p->cond + (n + 1);
    p->condn = p->fan + (n + 1);
    p->fneed = p->condn + (n + 1);
    p->bneed = p->fneed + (n + 1);
    p->fd = p->bneed + (n + 1);
    p->fdw = p->fd + (n + 1);
    p->tf = (double *)(void *)(p->fdw + (n + 1));
    p->tn = p->tf + (n + 1);
    p->tb = p->tn + (n + 1);
    p->lb = (ll *)(void *)(p->tb + (n + 1));
    p->first = p->lb + (n + 1);
    p->ways = (way *)(void *)(p->first + (n + 2));
    p->lb[0] = p->first[0] = 0;
    p->xa[0] = p->x[0] = units(c->input_bytes, slot);
    p->s[0] = p->ft[0] = p->bt[0] = p->fa[0] = p->cond[0] = p->fan[0] = p->condn[0] = p->fneed[0] = p->bneed[0] = 0;
    p->fd[0] = p->fdw[0] = 0;
    p->drops = 0;
    p->tf[0] = p->tn[0] = p->tb[0] = 0.0;
    for (k = 1; k <= n; k++) {
        p->x[k] = units(c->out_bytes[k - 1], slot);
        p->xa[k] = k == c->output_held ? 0 : p->x[k];
        p->s[k] = units(c->saved_bytes[k - 1], slot);
        p->ft[k] = units(c->fwd_tmp[k - 1], slot);
        p->bt[k] = units(c->bwd_tmp[k - 1], slot);
        p->tf[k] = c->fwd_time[k - 1];
        p->tn[k] = c->fwd_nograd_time[k - 1];
        p->tb[k] = c->bwd_time[k - 1];
        /* what is let go rounds down, so held less dropped stays at least the bytes */
        p->fd[k] = c->fwd_drop ? c->fwd_drop[k - 1] / slot : 0;
        p->fdw[k] = (c->fwd_drop_whole && c->fwd_drop_whole[k - 1]) ? p->fd[k] : 0;
        if (p->fd[k] > 0)
            p->drops = 1;
    }
    for (k = 1; k <= n; k++) {
        p->fa[k] = sadd(p->xa[k], p->ft[k]);
        p->cond[k] = sadd(p->xa[k - 1], p->fa[k]);
        p->fan[k] = sadd(p->xa[k], c->fwd_nograd_less
                                   ? units(c->fwd_tmp[k - 1] - c->fwd_nograd_less[k - 1], slot) : p->ft[k]);
        p->condn[k] = sadd(p->xa[k - 1], p->fan[k]);
        p->fneed[k] = smax(p->s[k], p->fa[k]);
        p->bneed[k] = bneed(p, k, p->s[k], p->bt[k]);
    }
    /* stage k's ways: the base record, then its options (remat/solver/option.py Note [Options]) */
    for (k = 1, q = 0; k <= n; k++) {
        way *w = &p->ways[q];
        p->first[k] = q;
        w->s = p->s[k];
        w->fneed = p->fneed[k];
        w->bneed = p->bneed[k];
        set_rebuilt(p, w, k, c->output_held, p->ft[k], c->bwd_rebuilt_less
                    ? units(c->bwd_tmp[k - 1] - c->bwd_rebuilt_less[k - 1], slot) : p->bt[k]);
        w->tf = p->tf[k];
        w->tb = p->tb[k];
        p->lb[k] = smin(p->fan[k], w->fneed);
        option_range(c, k, &lo, &hi);
        for (q++; lo < hi; lo++, q++) {
            w = &p->ways[q];
            w->s = units(c->option_saved_bytes[lo], slot);
            w->fneed = smax(w->s, sadd(p->xa[k], units(c->option_fwd_tmp[lo], slot)));
            w->bneed = bneed(p, k, w->s, units(c->option_bwd_tmp[lo], slot));
            set_rebuilt(p, w, k, c->output_held, units(c->option_fwd_tmp[lo], slot),
                        units(c->option_bwd_tmp[lo], slot));
            w->tf = c->option_fwd_time[lo];
            w->tb = c->option_bwd_time[lo];
            p->lb[k] = smin(p->lb[k], w->fneed);
        }
    }
    p->first[n + 1] = n + options;
    return REMAT_OK;
}
