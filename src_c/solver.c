/* The persistent dynamic program of remat (remat/solver/solve.py Note [The recurrence]).
 *
 * The entry point checks every argument, then hands MIN_TIME to mintime.c
 * (mintime_table.c Note [Tables]) and MIN_MEMORY to minmemory.c, which read
 * the chain as problem.c sets it up (remat_problem_init). Both modes
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

/* ---- the schedule writer (shared by every mode) -------------------------- */

enum { TASK = 5 };

typedef struct {
    int kind, drop;
    ll a, t, m;   /* for a pending B(a), t is the way it backwards */
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

/* Writes op `code` on `stage`; a Fall or B with the way of index q in p->ways. */
static void put(emitter *e, int code, ll stage, ll q)
{
    const problem *p = e->p;
    if (e->n < e->cap) {
        e->out->codes[e->n] = code;
        e->out->stages[e->n] = (int)stage;
        if (e->out->options)
            e->out->options[e->n] = (code == REMAT_OP_FALL) ? (int)(q - p->first[stage]) : 0;
    }
    e->n++;
    if (code == REMAT_OP_LOSS)
        e->forward = 0;
    else if (code == REMAT_OP_B)
        e->time += p->ways[q].tb;
    else if (code == REMAT_OP_FALL)
        e->time += p->ways[q].tf;
    else if (e->forward)
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
            put(&e, it.kind, a, t);
            continue;
        }
        r = choose(ctx, a, t, m, it.drop, &j);
        if (r < 0 || (r == 1 && (j <= a || j > t)) || (r == 0 && (j < p->first[a] || j >= p->first[a + 1]))) {
            st = REMAT_E_INTERNAL;
            break;
        }
        if (r == 0) {
            ll m1 = m - p->ways[j].s + fall_drop(p, a, j, it.drop);
            put(&e, REMAT_OP_FALL, a, j);
            st = push(&e, REMAT_OP_B, a, j, 0, 0);
            if (st == REMAT_OK && a == t && t == p->n)
                st = push(&e, REMAT_OP_LOSS, 0, 0, 0, 0);
            else if (st == REMAT_OK && a < t)
                st = push(&e, TASK, a + 1, t, smin(m1, mcap), drop_after_fall(p, a, t, j));
        } else {
            ll m2 = m - p->x[j - 1] + grad(p, t);
            put(&e, REMAT_OP_FCK, a, 0);
            for (k = a + 1; k < j; k++)
                put(&e, REMAT_OP_FN, k, 0);
            st = push(&e, TASK, a, j - 1, smin(m2, mcap), 0);
            if (st == REMAT_OK)
                st = push(&e, TASK, j, t, m - p->xa[j - 1], drop_after_split(p, j, t));
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

/* The options (remat_chain.option_first), as check_chain checks the stages' own
 * fields; run after it (out_bytes are checked). */
static int check_options(const remat_chain *c, remat_plan *out)
{
    const long long *first = c->option_first;
    ll n = c->length, k, o;
    if (!first)
        return REMAT_OK;
    if (first[0] != 0) {
        out->bad_stage = 1;
        return REMAT_E_OPTIONS;
    }
    for (k = 1; k <= n; k++) {
        /* first[k - 1] is in 0..(k - 1) * REMAT_MAX_OPTIONS here: no overflow */
        if (first[k] < first[k - 1] || first[k] - first[k - 1] > REMAT_MAX_OPTIONS) {
            out->bad_stage = k;
            return REMAT_E_OPTIONS;
        }
    }
    if (first[n] > 0 && (!c->option_fwd_time || !c->option_bwd_time || !c->option_saved_bytes
                         || !c->option_fwd_tmp || !c->option_bwd_tmp || !out->options))
        return REMAT_E_NULL;
    for (k = 1; k <= n; k++) {
        for (o = first[k - 1]; o < first[k]; o++) {
            double tf = c->option_fwd_time[o], tb = c->option_bwd_time[o];
            ll s = c->option_saved_bytes[o], ft = c->option_fwd_tmp[o], bt = c->option_bwd_tmp[o];
            if (!(tf >= 0.0 && tf <= REMAT_MAX_TIME && tb >= 0.0 && tb <= REMAT_MAX_TIME)) {
                out->bad_stage = k;
                return REMAT_E_TIME;
            }
            if (s < 0 || s >= REMAT_MAX_BYTES || ft < 0 || ft >= REMAT_MAX_BYTES
                || bt < -c->out_bytes[k - 1] || bt >= REMAT_MAX_BYTES) {
                out->bad_stage = k;
                return REMAT_E_SIZE;
            }
        }
    }
    return REMAT_OK;
}

static int check_chain(const remat_chain *c, remat_plan *out)
{
    ll n = c->length, k;
    const double *times[3] = {c->fwd_time, c->fwd_nograd_time, c->bwd_time};
    const long long *sizes[4] = {c->out_bytes, c->saved_bytes, c->fwd_tmp, c->bwd_tmp};
    int i;
    if (n < 1 || n > REMAT_MAX_LENGTH)
        return REMAT_E_LENGTH;
    for (i = 0; i < 3; i++)
        if (!times[i])
            return REMAT_E_NULL;
    for (i = 0; i < 4; i++)
        if (!sizes[i])
            return REMAT_E_NULL;
    if (c->input_bytes < 0 || c->input_bytes >= REMAT_MAX_BYTES || c->output_held < 0 || c->output_held > n) {
        out->bad_stage = 0;
        return REMAT_E_SIZE;
    }
    for (k = 0; k < n; k++) {
        long long drop = chain_drop(c->fwd_drop, k), whole = chain_drop(c->fwd_drop_whole, k);
        long long less = c->bwd_rebuilt_less ? c->bwd_rebuilt_less[k] : 0;
        long long nless = c->fwd_nograd_less ? c->fwd_nograd_less[k] : 0;
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
        /* what the forward phase drops of a^k: at most a^k, whole 0 or the same, none of a^L;
         * what a rebuilt B(k) needs less: 0 .. bwd_tmp + out_bytes (both checked above);
         * what a forward without recording needs less: 0 .. fwd_tmp */
        if (drop < 0 || drop > sizes[0][k] || (whole != 0 && whole != drop) || (k == n - 1 && drop != 0)
            || less < 0 || less > sizes[3][k] + sizes[0][k] || nless < 0 || nless > sizes[2][k]) {
            out->bad_stage = k + 1;
            return REMAT_E_SIZE;
        }
    }
    return check_options(c, out);
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
    if (out->control) {
        out->control->done = 0;
        out->control->total = 0;
        if (out->control->cancel)
            return REMAT_E_CANCELLED;
    }
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
        return "a required pointer (chain, plan, one of the chain's arrays, or the plan's options where a stage has options) is NULL";
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
    case REMAT_E_OPTIONS:
        return "option_first must count up from 0, by at most 64 options a stage";
    case REMAT_E_INTERNAL:
        return "internal error in the solver; please report this bug with the chain's costs";
    case REMAT_E_CANCELLED:
        return "the solve was cancelled (remat_control.cancel)";
    default:
        return "unknown status code";
    }
}
