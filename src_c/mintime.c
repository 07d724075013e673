/* MIN_TIME: the least-time tables of the persistent dynamic program
 * (mintime_table.c Note [Tables]). remat_solve_time sizes the table, double
 * or float32, has it filled (remat_fill), computes column n of a chain with
 * drops (fill_last), and hands remat_emit the chooser that reads the table.
 *
 * Note [Drops]
 * ------------
 * In the forward phase (column n) a Fall(a) may let go of a^(a-1)
 * (remat/solver/schedule.py Note [Accounting] 6): P(a, n) then depends on how
 * the caller holds a^(a-1), so column n has a second row per a, D(a): P(a, n)
 * where a Fall(a) of the base record drops fd[a-1], which frees that much headroom from there on
 * (its split branch is P(a, n)'s: Fck(a) keeps a^(a-1)). After Fall(a) the
 * rest reads D(a+1) if fdw[a], after Fck/Fn(j-1) it reads D(j) if fd[j-1];
 * a Fall with an option drops nothing, and after one the rest reads P(a+1, n)
 * (remat/solver/option.py Note [Options] 3).
 * When a chain has drops, remat_fill leaves column n alone and fill_last
 * computes P(a, n) and D(a), a = n..1, every m and split j (the same bound on
 * j as remat_compute_row): O(n^2 M) next to the table's O(n^3 M).
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "mintime.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Above this, tables hold float32 values (mintime_table.c Note [Tables]). */
#define REMAT_DOUBLE_TABLE_BYTES (512LL << 20)
#define REMAT_MAX_THREADS 8
/* Least L^3/6 * (M + 1) for which remat_fill uses threads. */
#define REMAT_THREADS_FROM 2e9

/* P(a, t, m), or D(a, m) with `drop` (Note [Drops]). */
static double dvalue(const table *T, ll a, ll t, int drop, ll m)
{
    return drop ? cell(T, &T->rows[didx(T->p, a)], m) : value(T, a, t, m);
}

/* The value of branch choices at (a, t, m) for fill_last and remat_emit's chooser:
 * the first of least value, as the DP finds it (0 Fall with way *jout, 1 a split
 * at *jout, -1 none). */
static int branch(const table *T, ll a, ll t, ll m, int drop, double bound, double *value_out, ll *jout)
{
    const problem *p = T->p;
    ll g = grad(p, t), j, q;
    const double *f = (t == p->n) ? p->tf : p->tn;
    double best = INF, fsum = 0.0;
    int choice = -1;
    for (q = p->first[a]; q < p->first[a + 1]; q++) {
        const way *w = &p->ways[q];
        ll r = fall_drop(p, a, q, drop);
        double v = w->tf + w->tb;
        if (m < way_fneed(p, w, t) || sadd(m, g + r) < way_bneed(p, w, t))
            continue;
        if (a < t)
            v = (w->tf + dvalue(T, a + 1, t, drop_after_fall(p, a, t, q), smin(m - w->s + r, T->M))) + w->tb;
        if (v < best) {
            best = v;
            choice = 0;
            *jout = q;
        }
    }
    if (a < t && fwd_need(p, a, t) <= m) {
        for (j = a + 1; j <= t; j++) {
            ll k = j - 1, xj = p->x[j - 1], xa = p->xa[j - 1];
            double v;
            if (k > a && fwd_cond(p, k, t) > m)
                break;
            fsum += f[k];
            if (best <= (fsum + bound) * BOUND_SLACK)
                break;   /* no later split can win (as in remat_compute_row) */
            v = (fsum + dvalue(T, j, t, drop_after_split(p, j, t), m - xa)) + value(T, a, j - 1, smin(m - xj + g, T->M));
            if (v < best) {
                best = v;
                choice = 1;
                *jout = j;
            }
        }
    }
    *value_out = best;
    return best < INF ? choice : -1;
}

static int choose_time(const void *ctx, ll a, ll t, ll m, int drop, ll *jout)
{
    const table *T = (const table *)ctx;
    double v;
    if (m < 0)
        return -1;
    return branch(T, a, t, m, drop, -INF, &v, jout);
}

/* Stores buf as row r's values (the pool only: nothing reads column n's summaries). */
static void store_last(table *T, row *r, const double *buf)
{
    ll len = r->top - r->lb + 1, m;
    for (m = 0; m < len; m++) {
        if (T->use_float)
            ((float *)T->pool)[r->off + m] = (float)buf[m];
        else
            ((double *)T->pool)[r->off + m] = buf[m];
    }
    for (m = 0; m < len && buf[m] == INF; m++)
        ;
    r->lo = m < len ? r->lb + m : LLONG_MAX;
    r->least = len > 0 ? cell(T, r, r->top) : INF;
}

/* Column n with drops, and the drop rows D(a) (Note [Drops]). */
static void fill_last(table *T, double *buf)
{
    const problem *p = T->p;
    ll n = p->n, a, m, j;
    int drop;
    for (a = n; a >= 1 && !cancelled(T->ctl); a--) {
        advance(T->ctl, n - a + 1);
        for (drop = 0; drop <= 1; drop++) {
            row *r = drop ? &T->rows[didx(p, a)] : &T->rows[pidx(a, n)];
            double v;
            if (r->top < r->lb)
                continue;
            for (m = r->lb; m <= r->top; m++) {
                branch(T, a, n, m, drop, r->all, &v, &j);
                buf[m - r->lb] = v;
            }
            store_last(T, r, buf);
        }
    }
}

int remat_solve_time(const remat_chain *c, ll budget, ll slots, int naive, ll max_bytes, remat_plan *out)
{
    problem p;
    table T;
    ll slot = budget / slots + (budget % slots != 0), M, total = -1, meta, scratch = 0, buflen, i, n = c->length;
    ll nsum = 0, ssum = 0, sweep_len, per_thread, blocks = (n + LANES - 1) / LANES;
    double *bufs = NULL, *scratch_mem = NULL;
    void *lanes_mem = NULL, *lane_summaries = NULL;
    ll *progress = NULL;
    lane *lanes = NULL;
    int st, threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    if (slot < 1)
        slot = 1;
    out->slot_bytes = slot;
    M = budget / slot;
    /* Threads only pay off (and spin-waiting only costs nothing) on big tables. */
    if ((double)n * n * n / 6.0 * ((double)M + 1.0) < REMAT_THREADS_FROM)
        threads = 1;
    threads = (int)smax(1, smin(smin(threads, REMAT_MAX_THREADS), blocks));
    per_thread = LANES * ((n + 1) * (ll)(2 * sizeof(ll) + sizeof(row)) + (ll)sizeof(lane));
    meta = (n * (n + 1) / 2 + n) * (ll)sizeof(row) + threads * per_thread + blocks * (ll)sizeof(ll);
    if (meta > max_bytes)
        return REMAT_E_TOO_LARGE;
    st = remat_problem_init(&p, c, slot);
    if (st != REMAT_OK)
        return st;
    if (p.x[0] > M) {
        free(p.mem);
        return REMAT_INFEASIBLE;
    }
    memset(&T, 0, sizeof T);
    T.p = &p;
    T.M = M;
    T.rows = (row *)malloc((size_t)(n * (n + 1) / 2 + (p.drops ? n : 0)) * sizeof(row));
    lanes_mem = malloc((size_t)(threads * per_thread));
    progress = (ll *)malloc((size_t)blocks * sizeof(ll));
    if (!T.rows || !lanes_mem || !progress) {
        st = REMAT_E_NOMEM;
        goto done;
    }
    /* Values and summaries, plus per thread LANES scratches of one sweep
     * and a buffer of one row (all doubles) and LANES copies of one sweep's
     * summaries: double below the threshold, else float32 (never for the
     * naive table). */
    {
        ll room = max_bytes - meta, dbl = naive ? room : smin(room, REMAT_DOUBLE_TABLE_BYTES - meta), k;
        for (k = 0; k < 2 && total < 0; k++) {
            ll width = k ? 4 : 8, limit = k ? room : dbl;
            if (k && naive)
                break;
            T.use_float = (int)k;
            total = remat_layout(&T, naive, limit / width, &scratch, &nsum, &ssum);
            if (total == -2) {
                st = REMAT_E_NOMEM;
                goto done;
            }
            if (total >= 0) {
                ll left = limit - width * (total + nsum);
                if (scratch > left / 8 / (threads * (LANES + 1)))
                    total = -1;
                else if (ssum > (left - 8 * scratch * threads * (LANES + 1)) / width / (threads * LANES))
                    total = -1;
            }
        }
    }
    if (total < 0) {
        st = REMAT_E_TOO_LARGE;
        goto done;
    }
    buflen = smin(M, scratch) + 1;
    T.buflen = buflen;
    /* per thread: a row buffer, its block maxima and the blocks' flags */
    buflen += buflen / SKIP + 2 + (buflen / SKIP + 2) / (ll)sizeof(double) + 1;
    sweep_len = scratch;
    T.pool = malloc((size_t)(total > 0 ? total : 1) * (T.use_float ? sizeof(float) : sizeof(double)));
    T.summary = malloc((size_t)(nsum > 0 ? nsum : 1) * (T.use_float ? sizeof(float) : sizeof(double)));
    if (T.use_float)
        sweep_len = 1;   /* float tables read the sweep from the pool (mintime_row.c split_range) */
    scratch_mem = (double *)malloc((size_t)(threads * LANES) * (size_t)sweep_len * sizeof(double));
    bufs = (double *)malloc((size_t)threads * (size_t)buflen * sizeof(double));
    lane_summaries = malloc((size_t)(threads * LANES) * (size_t)ssum * (T.use_float ? sizeof(float) : sizeof(double)));
    if (!T.pool || !T.summary || !scratch_mem || !bufs || !lane_summaries) {
        st = REMAT_E_NOMEM;
        goto done;
    }
    lanes = (lane *)lanes_mem;
    for (i = 0; i < threads * LANES; i++) {
        char *base = (char *)lanes_mem + threads * LANES * (ll)sizeof(lane);
        lanes[i].scratch = scratch_mem + i * sweep_len;
        lanes[i].soff = (ll *)(void *)(base + i * (n + 1) * (ll)(2 * sizeof(ll) + sizeof(row)));
        lanes[i].sumoff = lanes[i].soff + (n + 1);
        lanes[i].sweep = (row *)(void *)(lanes[i].sumoff + (n + 1));
        lanes[i].summary = (char *)lane_summaries + (size_t)(i * ssum) * (T.use_float ? sizeof(float) : sizeof(double));
    }
    T.ctl = out->control;
    if (T.ctl)
        T.ctl->total = table_work(n);
    remat_fill(&T, lanes, naive, bufs, buflen, threads, progress);
    if (p.drops)
        fill_last(&T, bufs);
    if (cancelled(T.ctl)) {   /* (the table may be unfinished) */
        st = REMAT_E_CANCELLED;
        goto done;
    }
    {
        ll m0 = M - p.x[0];
        double best = value(&T, 1, p.n, m0);
        if (best == INF) {
            st = REMAT_INFEASIBLE;
            goto done;
        }
        st = remat_emit(&p, choose_time, &T, m0, M, out);
        if (!T.use_float && (st == REMAT_OK || st == REMAT_E_CAPACITY))
            out->time = best;
    }
done:
    free(bufs);
    free(scratch_mem);
    free(lane_summaries);
    free(T.pool);
    free(T.summary);
    free(progress);
    free(lanes_mem);
    free(T.rows);
    free(p.mem);
    return st;
}
