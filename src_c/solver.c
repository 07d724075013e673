/* The persistent dynamic program of remat (remat/solver/solve.py Note [The recurrence]).
 *
 * The entry point checks every argument, then hands MIN_TIME to mintime.c
 * (mintime_table.c Note [Tables]) and MIN_MEMORY to minmemory.c. Both modes
 * write their schedule with remat_emit, which re-evaluates the branches along
 * the schedule's path only (no choice table), with an explicit stack.
 *
 * Note [Overflow]
 * ---------------
 * Sizes are below 2^62 and the budget at most 2^62, so a headroom plus a
 * size never overflows; every sum of sizes goes through sadd, which
 * saturates at LLONG_MAX. Times are at most 1e18, so no sum reaches inf.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* v / slot rounded up (C division truncates: up for v < 0, down for v > 0). */
static ll units(ll v, ll slot) { return v / slot + (v > 0 && v % slot != 0); }

int remat_problem_init(problem *p, const remat_chain *c, ll slot)
{
    ll n = c->length, k;
    p->n = n;
    p->mem = malloc((size_t)(n + 1) * (10 * sizeof(ll) + 3 * sizeof(double)));
    if (!p->mem)
        return REMAT_E_NOMEM;
    p->x = (ll *)p->mem;
    p->s = p->x + (n + 1);
    p->ft = p->s + (n + 1);
    p->bt = p->ft + (n + 1);
    p->fa = p->bt + (n + 1);
    p->cond = p->fa + (n + 1);
    p->fneed = p->cond + (n + 1);
    p->bneed = p->fneed + (n + 1);
    p->fd = p->bneed + (n + 1);
    p->fdw = p->fd + (n + 1);
    p->tf = (double *)(void *)(p->fdw + (n + 1));
    p->tn = p->tf + (n + 1);
    p->tb = p->tn + (n + 1);
    p->x[0] = units(c->input_bytes, slot);
    p->s[0] = p->ft[0] = p->bt[0] = p->fa[0] = p->cond[0] = p->fneed[0] = p->bneed[0] = 0;
    p->fd[0] = p->fdw[0] = 0;
    p->drops = 0;
    p->tf[0] = p->tn[0] = p->tb[0] = 0.0;
    for (k = 1; k <= n; k++) {
        p->x[k] = units(c->out_bytes[k - 1], slot);
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
        p->fa[k] = sadd(p->x[k], p->ft[k]);
        p->cond[k] = sadd(p->x[k - 1], p->fa[k]);
        p->fneed[k] = smax(p->s[k], p->fa[k]);
        /* bt[k] >= -x[k] (check_chain); at k = n, B(k) starts from the level Loss
         * reaches, a-bar^n and the gradient of a^n (remat/solver/solve.py Note [The
         * recurrence]) */
        p->bneed[k] = sadd(sadd(p->s[k], p->x[k]), p->x[k - 1]) + p->bt[k];
        if (k == n)
            p->bneed[k] = smax(p->bneed[k], sadd(p->s[k], p->x[k]));
    }
    return REMAT_OK;
}


/* ---- the schedule writer (shared by every mode) -------------------------- */

enum { TASK = 5 };

typedef struct {
    int kind, drop;
    ll a, t, m;
} item;

typedef struct {
    const problem *p;
    remat_plan *out;
    ll cap, n;
    int forward;
    double time;
    item *stack;
    ll depth, max_depth;
} emitter;

static void put(emitter *e, int code, ll stage)
{
    const problem *p = e->p;
    if (e->n < e->cap) {
        e->out->codes[e->n] = code;
        e->out->stages[e->n] = (int)stage;
    }
    e->n++;
    if (code == REMAT_OP_LOSS)
        e->forward = 0;
    else if (code == REMAT_OP_B)
        e->time += p->tb[stage];
    else if (code == REMAT_OP_FALL || e->forward)
        e->time += p->tf[stage];
    else
        e->time += p->tn[stage];
}

static int push(emitter *e, int kind, ll a, ll t, ll m, int drop)
{
    if (e->depth >= e->max_depth)
        return REMAT_E_INTERNAL;
    e->stack[e->depth].kind = kind;
    e->stack[e->depth].drop = drop;
    e->stack[e->depth].a = a;
    e->stack[e->depth].t = t;
    e->stack[e->depth].m = m;
    e->depth++;
    return REMAT_OK;
}

int remat_emit(const problem *p, remat_chooser choose, const void *ctx, ll m0, ll mcap, remat_plan *out)
{
    emitter e;
    int st = REMAT_OK;
    memset(&e, 0, sizeof e);
    e.p = p;
    e.out = out;
    e.cap = (out->codes && out->stages && out->capacity > 0) ? out->capacity : 0;
    e.forward = 1;
    /* Pending B ops and pending tasks (disjoint stage ranges) number <= n each. */
    e.max_depth = 2 * p->n + 4;
    e.stack = (item *)malloc((size_t)e.max_depth * sizeof(item));
    if (!e.stack)
        return REMAT_E_NOMEM;
    st = push(&e, TASK, 1, p->n, m0, 0);
    while (st == REMAT_OK && e.depth > 0) {
        item it = e.stack[--e.depth];
        ll a = it.a, t = it.t, m = it.m, j = 0, k;
        int r;
        if (it.kind != TASK) {
            put(&e, it.kind, a);
            continue;
        }
        r = choose(ctx, a, t, m, it.drop, &j);
        if (r < 0 || (r == 1 && (j <= a || j > t))) {
            st = REMAT_E_INTERNAL;
            break;
        }
        if (r == 0) {
            ll m1 = m - p->s[a] + (it.drop ? p->fd[a - 1] : 0);
            put(&e, REMAT_OP_FALL, a);
            st = push(&e, REMAT_OP_B, a, 0, 0, 0);
            if (st == REMAT_OK && a == t && t == p->n)
                st = push(&e, REMAT_OP_LOSS, 0, 0, 0, 0);
            else if (st == REMAT_OK && a < t)
                st = push(&e, TASK, a + 1, t, smin(m1, mcap), drop_after_fall(p, a, t));
        } else {
            ll m2 = m - p->x[j - 1] + grad(p, t);
            put(&e, REMAT_OP_FCK, a);
            for (k = a + 1; k < j; k++)
                put(&e, REMAT_OP_FN, k);
            st = push(&e, TASK, a, j - 1, smin(m2, mcap), 0);
            if (st == REMAT_OK)
                st = push(&e, TASK, j, t, m - p->x[j - 1], drop_after_split(p, j, t));
        }
    }
    free(e.stack);
    if (st != REMAT_OK)
        return st;
    out->n_ops = e.n;
    out->time = e.time;
    return e.n > e.cap ? REMAT_E_CAPACITY : REMAT_OK;
}

/* ---- the entry point ----------------------------------------------------- */

static long long chain_drop(const long long *v, ll k)
{
    return v ? v[k] : 0;
}

static int check_chain(const remat_chain *c, remat_plan *out)
{
    ll n = c->length, k;
    const double *times[3];
    const long long *sizes[4];
    int i;
    if (n < 1 || n > REMAT_MAX_LENGTH)
        return REMAT_E_LENGTH;
    times[0] = c->fwd_time;
    times[1] = c->fwd_nograd_time;
    times[2] = c->bwd_time;
    sizes[0] = c->out_bytes;
    sizes[1] = c->saved_bytes;
    sizes[2] = c->fwd_tmp;
    sizes[3] = c->bwd_tmp;
    for (i = 0; i < 3; i++)
        if (!times[i])
            return REMAT_E_NULL;
    for (i = 0; i < 4; i++)
        if (!sizes[i])
            return REMAT_E_NULL;
    if (c->input_bytes < 0 || c->input_bytes >= REMAT_MAX_BYTES) {
        out->bad_stage = 0;
        return REMAT_E_SIZE;
    }
    for (k = 0; k < n; k++) {
        long long drop = chain_drop(c->fwd_drop, k), whole = chain_drop(c->fwd_drop_whole, k);
        /* what the forward phase drops of a^k: at most a^k, whole 0 or the same, none of a^L */
        if (drop < 0 || drop > sizes[0][k] || (whole != 0 && whole != drop) || (k == n - 1 && drop != 0)) {
            out->bad_stage = k + 1;
            return REMAT_E_SIZE;
        }
        for (i = 0; i < 3; i++) {
            double v = times[i][k];
            if (!(v >= 0.0 && v <= REMAT_MAX_TIME)) {   /* false for NaN too */
                out->bad_stage = k + 1;
                return REMAT_E_TIME;
            }
        }
        for (i = 0; i < 4; i++) {
            ll v = sizes[i][k];
            /* bwd_tmp may give back the output's bytes (Costs.bwd_tmp) */
            ll least = i == 3 ? -sizes[0][k] : 0;
            if (v < least || v >= REMAT_MAX_BYTES) {
                out->bad_stage = k + 1;
                return REMAT_E_SIZE;
            }
        }
    }
    return REMAT_OK;
}

int remat_solve(const remat_chain *chain, long long budget, long long slots, int mode,
                long long max_table_bytes, remat_plan *out)
{
    int st;
    if (!out)
        return REMAT_E_NULL;
    out->n_ops = 0;
    out->time = 0.0;
    out->slot_bytes = 0;
    out->min_budget = -1;
    out->bad_stage = -1;
    if (!chain)
        return REMAT_E_NULL;
    if (mode != REMAT_MIN_TIME && mode != REMAT_MIN_MEMORY && mode != REMAT_MIN_TIME_NAIVE)
        return REMAT_E_MODE;
    if (max_table_bytes < 0)
        return REMAT_E_LIMIT;
    st = check_chain(chain, out);
    if (st != REMAT_OK)
        return st;
    if (mode == REMAT_MIN_MEMORY)
        return remat_solve_memory(chain, max_table_bytes, out);
    if (budget < 0 || budget > REMAT_MAX_BYTES)
        return REMAT_E_BUDGET;
    if (slots < 1)
        return REMAT_E_SLOTS;
    return remat_solve_time(chain, budget, slots, mode == REMAT_MIN_TIME_NAIVE, max_table_bytes, out);
}

const char *remat_strerror(int status)
{
    switch (status) {
    case REMAT_OK:
        return "success";
    case REMAT_INFEASIBLE:
        return "no persistent schedule fits in the budget";
    case REMAT_E_NULL:
        return "a required pointer (chain, plan or one of the chain's arrays) is NULL";
    case REMAT_E_LENGTH:
        return "the chain length must be between 1 and 10,000,000 stages";
    case REMAT_E_TIME:
        return "a time is NaN, infinite, negative or above 1e18 seconds";
    case REMAT_E_SIZE:
        return "a size is negative (a bwd_tmp below minus its stage's out_bytes) or not below 2^62 bytes";
    case REMAT_E_BUDGET:
        return "the budget must be between 0 and 2^62 bytes";
    case REMAT_E_SLOTS:
        return "the number of slots must be at least 1";
    case REMAT_E_MODE:
        return "unknown mode: use REMAT_MIN_TIME, REMAT_MIN_MEMORY or REMAT_MIN_TIME_NAIVE";
    case REMAT_E_LIMIT:
        return "max_table_bytes must not be negative";
    case REMAT_E_CAPACITY:
        return "the plan's arrays are too small; n_ops holds the capacity needed";
    case REMAT_E_TOO_LARGE:
        return "the solver's tables would exceed max_table_bytes; use fewer slots or fewer stages";
    case REMAT_E_NOMEM:
        return "out of memory while allocating the solver's tables";
    case REMAT_E_OVERFLOW:
        return "the chain needs more than 2^62 bytes; a size is far too large";
    case REMAT_E_INTERNAL:
        return "internal error in the solver; please report this bug with the chain's costs";
    default:
        return "unknown status code";
    }
}
