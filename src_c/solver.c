/* The persistent dynamic program of remat (remat/solve.py Note [The recurrence]).
 *
 * Note [Tables]
 * -------------
 * P(a, t, m) is the least time to backpropagate stages a..t with headroom m
 * (sizes in slots). For one pair (a, t) it is a non-increasing step function
 * of m: infinite below lo(a, t), constant from hi(a, t) on, where hi is the
 * headroom recording every stage of a..t needs (nothing can beat that: every
 * stage is recorded and backwarded once whatever the schedule). So each pair
 * stores only m in [lb, top], lb = x[a] + fwd_tmp[a] (both branches need it)
 * and top = min(hi, M); a read above top returns the value at top.
 *
 * Pairs are computed by increasing length t - a: P(a, t) needs only shorter
 * pairs. Inside a pair, the Fall branch and each split point j are shifted
 * min-plus vector operations over m (the kernels below), and a split point
 * is skipped where its lower bound fsum + min P(j, t) + min P(a, j-1) cannot
 * beat the current best; as the best is non-increasing in m, that is a
 * prefix of m found by bisection. Values are summed in the same order as
 * tests/reference_solver.py, so in double precision the result is the
 * reference's, bit for bit. Tables above REMAT_DOUBLE_TABLE_BYTES store
 * float32 values (computation stays double); the schedule's time is then
 * summed again along the schedule in double.
 *
 * No choice table is kept: the schedule is rebuilt by evaluating the branches
 * again only along its path (emit), with an explicit stack, not recursion.
 *
 * Note [Overflow]
 * ---------------
 * Sizes are below 2^62 and the budget at most 2^62, so m + g never overflows;
 * every sum of sizes goes through sadd, which saturates at LLONG_MAX.
 */
#include "solver.h"

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define INF HUGE_VAL
/* Above this, tables hold float32 values (Note [Tables]). */
#define REMAT_DOUBLE_TABLE_BYTES (512LL << 20)
/* Relative slack of the whole-branch lower bound: float sums of positive
 * terms in another order may differ by far less than this. */
#define BOUND_SLACK (1.0 - 1e-7)

typedef long long ll;

static ll sadd(ll a, ll b) { return (b > LLONG_MAX - a) ? LLONG_MAX : a + b; }
static ll smax(ll a, ll b) { return a > b ? a : b; }
static ll smin(ll a, ll b) { return a < b ? a : b; }
static ll pidx(ll a, ll t) { return t * (t - 1) / 2 + (a - 1); }

/* ---- the chain, 1-based, sizes in units ---------------------------------- */

typedef struct {
    ll n;
    ll *x;      /* x[0..n] */
    ll *s, *ft, *bt;
    ll *fa;     /* x[k] + ft[k]: what Fn/Fck(k) need */
    ll *cond;   /* x[k-1] + x[k] + ft[k]: Fn(k) after Fck/Fn(k-1) */
    ll *fneed;  /* max(s[k], x[k] + ft[k]): Fall(k) */
    ll *bneed;  /* s[k] + x[k] + x[k-1] + bt[k]: B(k), before the gradient credit */
    double *tf, *tn, *tb;
    void *mem;
} problem;

static ll units(ll v, ll slot) { return v / slot + (v % slot != 0); }

static int problem_init(problem *p, const remat_chain *c, ll slot)
{
    ll n = c->length, k;
    p->n = n;
    p->mem = malloc((size_t)(n + 1) * (8 * sizeof(ll) + 3 * sizeof(double)));
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
    p->tf = (double *)(void *)(p->bneed + (n + 1));
    p->tn = p->tf + (n + 1);
    p->tb = p->tn + (n + 1);
    p->x[0] = units(c->input_bytes, slot);
    p->s[0] = p->ft[0] = p->bt[0] = p->fa[0] = p->cond[0] = p->fneed[0] = p->bneed[0] = 0;
    p->tf[0] = p->tn[0] = p->tb[0] = 0.0;
    for (k = 1; k <= n; k++) {
        p->x[k] = units(c->out_bytes[k - 1], slot);
        p->s[k] = units(c->saved_bytes[k - 1], slot);
        p->ft[k] = units(c->fwd_tmp[k - 1], slot);
        p->bt[k] = units(c->bwd_tmp[k - 1], slot);
        p->tf[k] = c->fwd_time[k - 1];
        p->tn[k] = c->fwd_nograd_time[k - 1];
        p->tb[k] = c->bwd_time[k - 1];
    }
    for (k = 1; k <= n; k++) {
        p->fa[k] = sadd(p->x[k], p->ft[k]);
        p->cond[k] = sadd(p->x[k - 1], p->fa[k]);
        p->fneed[k] = smax(p->s[k], p->fa[k]);
        p->bneed[k] = sadd(sadd(p->s[k], p->x[k]), sadd(p->x[k - 1], p->bt[k]));
    }
    return REMAT_OK;
}

static ll grad(const problem *p, ll t) { return t < p->n ? p->x[t] : 0; }

/* Least headroom for the Fall branch's own conditions at (a, t). */
static ll fall_need(const problem *p, ll a, ll t)
{
    return smax(p->fneed[a], p->bneed[a] - grad(p, t));
}

/* ---- the schedule writer (shared by every mode) -------------------------- */

enum { TASK = 5 };

typedef struct {
    int kind;
    ll a, t, m;
} item;

/* Picks the branch at (a, t, m): 0 for Fall, 1 for a split at *j, -1 if none fits. */
typedef int (*chooser)(const void *ctx, ll a, ll t, ll m, ll *j);

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

static int push(emitter *e, int kind, ll a, ll t, ll m)
{
    if (e->depth >= e->max_depth)
        return REMAT_E_INTERNAL;
    e->stack[e->depth].kind = kind;
    e->stack[e->depth].a = a;
    e->stack[e->depth].t = t;
    e->stack[e->depth].m = m;
    e->depth++;
    return REMAT_OK;
}

/* Writes the schedule of P(1, n, m0) into out; mcap bounds every headroom. */
static int emit(const problem *p, chooser choose, const void *ctx, ll m0, ll mcap, remat_plan *out)
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
    st = push(&e, TASK, 1, p->n, m0);
    while (st == REMAT_OK && e.depth > 0) {
        item it = e.stack[--e.depth];
        ll a = it.a, t = it.t, m = it.m, j = 0, k;
        int r;
        if (it.kind != TASK) {
            put(&e, it.kind, a);
            continue;
        }
        r = choose(ctx, a, t, m, &j);
        if (r < 0 || (r == 1 && (j <= a || j > t))) {
            st = REMAT_E_INTERNAL;
            break;
        }
        if (r == 0) {
            put(&e, REMAT_OP_FALL, a);
            st = push(&e, REMAT_OP_B, a, 0, 0);
            if (st == REMAT_OK && a == t && t == p->n)
                st = push(&e, REMAT_OP_LOSS, 0, 0, 0);
            else if (st == REMAT_OK && a < t)
                st = push(&e, TASK, a + 1, t, m - p->s[a]);
        } else {
            ll m2 = m - p->x[j - 1] + grad(p, t);
            put(&e, REMAT_OP_FCK, a);
            for (k = a + 1; k < j; k++)
                put(&e, REMAT_OP_FN, k);
            st = push(&e, TASK, a, j - 1, smin(m2, mcap));
            if (st == REMAT_OK)
                st = push(&e, TASK, j, t, m - p->x[j - 1]);
        }
    }
    free(e.stack);
    if (st != REMAT_OK)
        return st;
    out->n_ops = e.n;
    out->time = e.time;
    return e.n > e.cap ? REMAT_E_CAPACITY : REMAT_OK;
}

/* ---- MIN_TIME tables ------------------------------------------------------ */

typedef struct {
    ll lb, top;   /* stored headrooms [lb, top]; empty if top < lb */
    ll lo;        /* first finite headroom, LLONG_MAX if none */
    ll hi;        /* headroom at which recording everything fits, capped at M + 1 */
    ll off;       /* index of headroom lb in the pool */
    double all;   /* time of recording everything (the Fall chain) */
} row;

typedef struct {
    const problem *p;
    ll M;
    row *rows;
    void *pool;
    int use_float;
} table;

static double cell(const table *T, const row *r, ll m)
{
    ll i;
    if (m < r->lo)
        return INF;
    if (m > r->top)
        m = r->top;
    i = r->off + (m - r->lb);
    return T->use_float ? (double)((const float *)T->pool)[i] : ((const double *)T->pool)[i];
}

static double value(const table *T, ll a, ll t, ll m)
{
    return cell(T, &T->rows[pidx(a, t)], m);
}

/* Fills rows' ranges and offsets; returns the number of stored values, or -1
 * if they would exceed `limit` values. `full` stores every m in 0..M. */
static ll layout(table *T, int full, ll limit)
{
    const problem *p = T->p;
    ll n = p->n, M = T->M, d, a, total = 0;
    for (d = 0; d < n; d++) {
        for (a = 1; a + d <= n; a++) {
            ll t = a + d;
            row *r = &T->rows[pidx(a, t)];
            ll h = fall_need(p, a, t);
            double all = p->tf[a] + p->tb[a];
            if (a < t) {
                const row *c = &T->rows[pidx(a + 1, t)];
                h = smax(h, sadd(c->hi, p->s[a]));
                all = (p->tf[a] + c->all) + p->tb[a];
            }
            r->hi = smin(h, sadd(M, 1));
            r->all = all;
            r->lb = full ? 0 : p->fa[a];
            r->top = full ? M : smin(r->hi, M);
            r->lo = LLONG_MAX;
            r->off = total;
            if (r->top >= r->lb) {
                ll len = r->top - r->lb + 1;
                if (len > limit - total)
                    return -1;
                total += len;
            }
        }
    }
    return total;
}

#define DEFINE_KERNELS(T, SUF)                                                          \
    static void fall_##SUF(double *b, ll n, double tf, const T *c, double tb)          \
    {                                                                                   \
        ll i;                                                                           \
        for (i = 0; i < n; i++) {                                                       \
            double v = (tf + (double)c[i]) + tb;                                        \
            b[i] = v < b[i] ? v : b[i];                                                 \
        }                                                                               \
    }                                                                                   \
    static void split_aa_##SUF(double *b, ll n, double f, const T *c1, const T *c2)   \
    {                                                                                   \
        ll i;                                                                           \
        for (i = 0; i < n; i++) {                                                       \
            double v = (f + (double)c1[i]) + (double)c2[i];                             \
            b[i] = v < b[i] ? v : b[i];                                                 \
        }                                                                               \
    }                                                                                   \
    static void split_ac_##SUF(double *b, ll n, double f, const T *c1, double c2)     \
    {                                                                                   \
        ll i;                                                                           \
        for (i = 0; i < n; i++) {                                                       \
            double v = (f + (double)c1[i]) + c2;                                        \
            b[i] = v < b[i] ? v : b[i];                                                 \
        }                                                                               \
    }                                                                                   \
    static void split_ca_##SUF(double *b, ll n, double fc1, const T *c2)              \
    {                                                                                   \
        ll i;                                                                           \
        for (i = 0; i < n; i++) {                                                       \
            double v = fc1 + (double)c2[i];                                             \
            b[i] = v < b[i] ? v : b[i];                                                 \
        }                                                                               \
    }

DEFINE_KERNELS(double, d)
DEFINE_KERNELS(float, f)

static void const_min(double *b, ll n, double v)
{
    ll i;
    for (i = 0; i < n; i++)
        b[i] = v < b[i] ? v : b[i];
}

static const void *at(const table *T, const row *r, ll m)
{
    ll i = r->off + (m - r->lb);
    return T->use_float ? (const void *)((const float *)T->pool + i) : (const void *)((const double *)T->pool + i);
}

/* buf[m - lb] = min(buf, (f + P1(m - xj)) + P2(m - xj + g)) for m in [ms, me]. */
static void split_range(const table *T, double *buf, ll lb, ll ms, ll me, double f,
                        const row *r1, const row *r2, ll xj, ll g)
{
    ll e1 = r1->top + xj, e2 = r2->top + xj - g, cur = ms;
    double c1 = cell(T, r1, r1->top), c2 = cell(T, r2, r2->top);
    while (cur <= me) {
        int arr1 = cur <= e1, arr2 = cur <= e2;
        ll end = me, len;
        double *b = buf + (cur - lb);
        if (arr1)
            end = smin(end, e1);
        if (arr2)
            end = smin(end, e2);
        len = end - cur + 1;
        if (arr1 && arr2) {
            if (T->use_float)
                split_aa_f(b, len, f, (const float *)at(T, r1, cur - xj), (const float *)at(T, r2, cur - xj + g));
            else
                split_aa_d(b, len, f, (const double *)at(T, r1, cur - xj), (const double *)at(T, r2, cur - xj + g));
        } else if (arr1) {
            if (T->use_float)
                split_ac_f(b, len, f, (const float *)at(T, r1, cur - xj), c2);
            else
                split_ac_d(b, len, f, (const double *)at(T, r1, cur - xj), c2);
        } else if (arr2) {
            if (T->use_float)
                split_ca_f(b, len, f + c1, (const float *)at(T, r2, cur - xj + g));
            else
                split_ca_d(b, len, f + c1, (const double *)at(T, r2, cur - xj + g));
        } else {
            const_min(b, len, (f + c1) + c2);
        }
        cur = end + 1;
    }
}

/* Computes P(a, t, m) for m in [lb, top] into buf (Note [Tables]). */
static void compute_row(const table *T, ll a, ll t, double *buf)
{
    const problem *p = T->p;
    const row *r = &T->rows[pidx(a, t)];
    ll lb = r->lb, top = r->top, n = top - lb + 1, g = grad(p, t), j, m;
    const double *f = (t == p->n) ? p->tf : p->tn;
    double fsum = 0.0;
    ll mlow = lb;

    for (m = 0; m < n; m++)
        buf[m] = INF;
    /* Fall branch */
    {
        ll ms = smax(lb, fall_need(p, a, t));
        if (a == t) {
            if (ms <= top)
                const_min(buf + (ms - lb), top - ms + 1, p->tf[a] + p->tb[a]);
        } else {
            const row *c = &T->rows[pidx(a + 1, t)];
            if (c->lo != LLONG_MAX) {
                ll e = c->top + p->s[a];   /* last m read from c's array */
                ms = smax(ms, sadd(c->lo, p->s[a]));
                if (ms <= top && ms <= e) {
                    ll end = smin(top, e);
                    if (T->use_float)
                        fall_f(buf + (ms - lb), end - ms + 1, p->tf[a], (const float *)at(T, c, ms - p->s[a]), p->tb[a]);
                    else
                        fall_d(buf + (ms - lb), end - ms + 1, p->tf[a], (const double *)at(T, c, ms - p->s[a]), p->tb[a]);
                }
                ms = smax(ms, e + 1);
                if (ms <= top)
                    const_min(buf + (ms - lb), top - ms + 1, (p->tf[a] + cell(T, c, c->top)) + p->tb[a]);
            }
        }
    }
    /* Checkpoint branch: Fck(a), Fn(a+1..j-1), P(j, t), P(a, j-1) */
    for (j = a + 1; j <= t; j++) {
        ll k = j - 1, xj = p->x[j - 1], ms, me, lo_, hi_;
        const row *r1, *r2;
        double bound;
        if (k > a)
            mlow = smax(mlow, p->cond[k]);
        if (mlow > top)
            break;
        fsum += f[k];
        /* No later split beats buf anywhere it applies (its m >= mlow). */
        if (buf[mlow - lb] <= (fsum + r->all) * BOUND_SLACK)
            break;
        r1 = &T->rows[pidx(j, t)];
        r2 = &T->rows[pidx(a, j - 1)];
        if (r1->lo == LLONG_MAX || r2->lo == LLONG_MAX)
            continue;
        ms = smax(mlow, smax(sadd(r1->lo, xj), sadd(r2->lo, xj) - g));
        if (ms > top)
            continue;
        bound = (fsum + cell(T, r1, r1->top)) + cell(T, r2, r2->top);
        /* buf is non-increasing: find the first m with buf[m] <= bound */
        lo_ = ms;
        hi_ = top + 1;
        while (lo_ < hi_) {
            ll mid = lo_ + (hi_ - lo_) / 2;
            if (buf[mid - lb] <= bound)
                hi_ = mid;
            else
                lo_ = mid + 1;
        }
        me = lo_ - 1;
        if (me >= ms)
            split_range(T, buf, lb, ms, me, fsum, r1, r2, xj, g);
    }
}

/* The plain table: every m in 0..M, every split, scalar (benchmarks' baseline). */
static void compute_row_naive(const table *T, ll a, ll t, double *buf)
{
    const problem *p = T->p;
    ll m, j, g = grad(p, t), M = T->M;
    const double *f = (t == p->n) ? p->tf : p->tn;
    for (m = 0; m <= M; m++) {
        double best = INF, fsum = 0.0;
        if (m >= fall_need(p, a, t)) {
            if (a == t)
                best = p->tf[a] + p->tb[a];
            else {
                double c = m - p->s[a] >= 0 ? value(T, a + 1, t, m - p->s[a]) : INF;
                if (c < INF)
                    best = (p->tf[a] + c) + p->tb[a];
            }
        }
        if (a < t && p->fa[a] <= m) {
            for (j = a + 1; j <= t; j++) {
                ll k = j - 1, xj = p->x[j - 1];
                double c1, c2;
                if (k > a && p->cond[k] > m)
                    break;
                fsum += f[k];
                c1 = m - xj >= 0 ? value(T, j, t, m - xj) : INF;
                if (c1 == INF)
                    continue;
                c2 = m - xj + g >= 0 ? value(T, a, j - 1, smin(m - xj + g, M)) : INF;
                if (c2 == INF)
                    continue;
                if ((fsum + c1) + c2 < best)
                    best = (fsum + c1) + c2;
            }
        }
        buf[m] = best;
    }
}

/* Emit's chooser for MIN_TIME: the first branch of least value (as the DP). */
static int choose_time(const void *ctx, ll a, ll t, ll m, ll *jout)
{
    const table *T = (const table *)ctx;
    const problem *p = T->p;
    ll g = grad(p, t), j;
    const double *f = (t == p->n) ? p->tf : p->tn;
    double best = INF, fsum = 0.0;
    int choice = -1;
    if (m < 0)
        return -1;
    if (m >= fall_need(p, a, t)) {
        double v = p->tf[a] + p->tb[a];
        if (a < t)
            v = (p->tf[a] + (m - p->s[a] >= 0 ? value(T, a + 1, t, m - p->s[a]) : INF)) + p->tb[a];
        if (v < best) {
            best = v;
            choice = 0;
        }
    }
    if (a < t && p->fa[a] <= m) {
        for (j = a + 1; j <= t; j++) {
            ll k = j - 1, xj = p->x[j - 1];
            double v;
            if (k > a && p->cond[k] > m)
                break;
            fsum += f[k];
            if (m - xj < 0 || m - xj + g < 0)
                continue;
            v = (fsum + value(T, j, t, m - xj)) + value(T, a, j - 1, smin(m - xj + g, T->M));
            if (v < best) {
                best = v;
                choice = 1;
                *jout = j;
            }
        }
    }
    return best < INF ? choice : -1;
}

static int solve_time(const remat_chain *c, ll budget, ll slots, int naive, ll max_bytes, remat_plan *out)
{
    problem p;
    table T;
    ll slot = budget / slots + (budget % slots != 0), M, total, d, a, meta, buflen = 0;
    double *buf = NULL;
    int st;
    if (slot < 1)
        slot = 1;
    out->slot_bytes = slot;
    M = budget / slot;
    meta = (c->length * (c->length + 1) / 2) * (ll)sizeof(row);
    if (meta > max_bytes)
        return REMAT_E_TOO_LARGE;
    st = problem_init(&p, c, slot);
    if (st != REMAT_OK)
        return st;
    if (p.x[0] > M) {
        free(p.mem);
        return REMAT_INFEASIBLE;
    }
    memset(&T, 0, sizeof T);
    T.p = &p;
    T.M = M;
    T.rows = (row *)malloc((size_t)meta);
    if (!T.rows) {
        free(p.mem);
        return REMAT_E_NOMEM;
    }
    /* double if it fits the double threshold, else float32 (never in naive) */
    total = layout(&T, naive, (smin(max_bytes, naive ? max_bytes : REMAT_DOUBLE_TABLE_BYTES) - meta) / 8);
    if (total < 0 && !naive) {
        total = layout(&T, naive, (max_bytes - meta) / 4);
        T.use_float = 1;
    }
    if (total < 0) {
        st = REMAT_E_TOO_LARGE;
        goto done;
    }
    T.pool = malloc((size_t)(total > 0 ? total : 1) * (T.use_float ? sizeof(float) : sizeof(double)));
    for (d = 0; d < p.n * (p.n + 1) / 2; d++) {
        const row *r = &T.rows[d];
        if (r->top >= r->lb)
            buflen = smax(buflen, r->top - r->lb + 1);
    }
    buf = (double *)malloc((size_t)(buflen > 0 ? buflen : 1) * sizeof(double));
    if (!T.pool || !buf) {
        st = REMAT_E_NOMEM;
        goto done;
    }
    for (d = 0; d < p.n; d++) {
        for (a = 1; a + d <= p.n; a++) {
            ll t = a + d, m, len;
            row *r = &T.rows[pidx(a, t)];
            if (r->top < r->lb)
                continue;
            len = r->top - r->lb + 1;
            if (naive)
                compute_row_naive(&T, a, t, buf);
            else
                compute_row(&T, a, t, buf);
            for (m = 0; m < len && buf[m] == INF; m++)
                ;
            r->lo = m < len ? r->lb + m : LLONG_MAX;
            if (T.use_float) {
                float *dst = (float *)T.pool + r->off;
                for (m = 0; m < len; m++)
                    dst[m] = (float)buf[m];
            } else {
                memcpy((double *)T.pool + r->off, buf, (size_t)len * sizeof(double));
            }
        }
    }
    {
        ll m0 = M - p.x[0];
        double best = value(&T, 1, p.n, m0);
        if (best == INF) {
            st = REMAT_INFEASIBLE;
            goto done;
        }
        st = emit(&p, choose_time, &T, m0, M, out);
        if (!T.use_float && (st == REMAT_OK || st == REMAT_E_CAPACITY))
            out->time = best;
    }
done:
    free(buf);
    free(T.pool);
    free(T.rows);
    free(p.mem);
    return st;
}

/* ---- MIN_MEMORY: lo(a, t) exactly, in bytes ------------------------------ */

typedef struct {
    const problem *p;
    ll *lo;
} lotable;

static ll fall_lo(const lotable *L, ll a, ll t)
{
    ll need = fall_need(L->p, a, t);
    if (a < t)
        need = smax(need, sadd(L->lo[pidx(a + 1, t)], L->p->s[a]));
    return smax(need, 0);
}

static ll split_lo(const lotable *L, ll a, ll t, ll j)
{
    const problem *p = L->p;
    ll xj = p->x[j - 1];
    return smax(sadd(L->lo[pidx(j, t)], xj), sadd(L->lo[pidx(a, j - 1)], xj) - grad(p, t));
}

static int choose_memory(const void *ctx, ll a, ll t, ll m, ll *jout)
{
    const lotable *L = (const lotable *)ctx;
    const problem *p = L->p;
    ll j, need;
    if (m < 0)
        return -1;
    if (fall_lo(L, a, t) <= m)
        return 0;
    need = p->fa[a];
    for (j = a + 1; j <= t; j++) {
        if (j - 1 > a)
            need = smax(need, p->cond[j - 1]);
        if (need > m)
            break;
        if (split_lo(L, a, t, j) <= m) {
            *jout = j;
            return 1;
        }
    }
    return -1;
}

static int solve_memory(const remat_chain *c, ll max_bytes, remat_plan *out)
{
    problem p;
    lotable L;
    ll n = c->length, d, a, bytes = (n * (n + 1) / 2) * (ll)sizeof(ll), m0;
    int st;
    out->slot_bytes = 1;
    if (bytes > max_bytes)
        return REMAT_E_TOO_LARGE;
    st = problem_init(&p, c, 1);
    if (st != REMAT_OK)
        return st;
    L.p = &p;
    L.lo = (ll *)malloc((size_t)bytes);
    if (!L.lo) {
        free(p.mem);
        return REMAT_E_NOMEM;
    }
    for (d = 0; d < n; d++) {
        for (a = 1; a + d <= n; a++) {
            ll t = a + d, best = fall_lo(&L, a, t), need = p.fa[a], j;
            for (j = a + 1; j <= t; j++) {
                if (j - 1 > a)
                    need = smax(need, p.cond[j - 1]);
                if (need >= best)
                    break;
                best = smin(best, smax(need, split_lo(&L, a, t, j)));
            }
            L.lo[pidx(a, t)] = best;
        }
    }
    m0 = L.lo[pidx(1, n)];
    if (sadd(m0, p.x[0]) > REMAT_MAX_BYTES) {
        st = REMAT_E_OVERFLOW;
    } else {
        out->min_budget = m0 + p.x[0];
        st = emit(&p, choose_memory, &L, m0, REMAT_MAX_BYTES, out);
    }
    free(L.lo);
    free(p.mem);
    return st;
}

/* ---- the entry point ----------------------------------------------------- */

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
        for (i = 0; i < 3; i++) {
            double v = times[i][k];
            if (!(v >= 0.0 && v <= REMAT_MAX_TIME)) {   /* false for NaN too */
                out->bad_stage = k + 1;
                return REMAT_E_TIME;
            }
        }
        for (i = 0; i < 4; i++) {
            ll v = sizes[i][k];
            if (v < 0 || v >= REMAT_MAX_BYTES) {
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
        return solve_memory(chain, max_table_bytes, out);
    if (budget < 0 || budget > REMAT_MAX_BYTES)
        return REMAT_E_BUDGET;
    if (slots < 1)
        return REMAT_E_SLOTS;
    return solve_time(chain, budget, slots, mode == REMAT_MIN_TIME_NAIVE, max_table_bytes, out);
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
        return "a size is negative or not below 2^62 bytes";
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
