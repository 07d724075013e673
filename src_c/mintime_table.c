/* MIN_TIME's table: which headrooms each pair stores and where (remat_layout),
 * how a computed row is stored (finish_row), and in which order and on which
 * thread the rows are computed (remat_fill). The fast rows come from
 * mintime_row.c, the entry point is remat_solve_time (mintime.c).
 *
 * Note [Tables]
 * -------------
 * P(a, t, m) is the least time to backpropagate stages a..t with headroom m
 * (sizes in slots, remat/solver/solve.py Note [The recurrence]). For one pair it is
 * a non-increasing step function of m: infinite below lo(a, t) and constant
 * from hi(a, t) on, hi being the headroom that recording every stage of a..t
 * needs, whichever of its ways (remat/solver/option.py Note [Options]) each
 * stage is recorded with (nothing beats recording each with its fastest way:
 * every stage is recorded and backwarded once in any schedule; that time,
 * summed, is the row's `all`, a bound below its every value). So a pair
 * stores only m in [lb, top], lb the least of x[a] + fwd_tmp[a] less
 * fwd_nograd_less[a] (what the split branch needs after Loss, and no more
 * than before it) and the needs of a's ways, and top = min(hi, M); a read
 * above top returns the value at top.
 *
 * Order and layout: sweeps a = n..1, each over t = a..n (Note [Threads]). P(a, t) reads
 * P(a+1, t) and P(j, t), j > a (earlier sweeps), and P(a, j-1), j-1 < t
 * (this sweep). The pool is column-major (column t holds rows (1, t) ..
 * (t, t) in order), so the rows P(j, t) a split loop reads are one stream.
 * With double tables this sweep's rows are also copied to a scratch that
 * stays in cache; float tables read them from the pool, which moves half the
 * bytes of a double scratch (the loops are bound by memory traffic).
 *
 * Once a row is computed its top is lowered to the start of its plateau
 * (the first m whose value is the row's least): reads above return that
 * value without touching memory, and the values are unchanged.
 *
 * Inside a pair, the Fall branch and each split point j are shifted min-plus
 * vector operations over m, most of which cannot win (mintime_row.c Note
 * [Skipping]); the loop over j stops once fsum + (time of recording a..t)
 * cannot beat the current best anywhere a later j applies. Values are summed
 * in the order of tests/reference_solver.py, and skipped work provably cannot
 * win, so in double precision the result is the reference's, bit for bit.
 *
 * Tables above REMAT_DOUBLE_TABLE_BYTES (mintime.c) store float32 values
 * (sums stay double; float rounding is monotone, so every row stays
 * non-increasing); the schedule's time is then summed again along the
 * schedule, in double.
 *
 * Note [Threads]
 * --------------
 * remat_fill takes sweeps LANES at a time (a block) and runs them interleaved
 * by t, so the column rows P(j, t) that one pair streams in are still in
 * cache for the next pair of the block. Built with OpenMP, threads take
 * blocks in order; a block computes column t only once the block above it
 * (larger a) has finished column t, which is all P(a, t) needs from other
 * blocks. Each thread has its own lanes and buffer. Without OpenMP the same
 * code runs the blocks one after another.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "mintime.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Fills the rows' ranges and offsets. Returns the number of stored values,
 * or -1 past `limit`; *scratch gets the longest sweep's. `full` stores every
 * m in 0..M (the naive table). */
ll remat_layout(table *T, int full, ll limit, ll *scratch, ll *summaries, ll *sweep_summaries)
{
    const problem *p = T->p;
    ll n = p->n, M = T->M, a, t, total = 0, nsum = 0, *sweep, *ssweep;
    sweep = (ll *)calloc((size_t)(2 * (n + 1)), sizeof(ll));
    if (!sweep)
        return -2;
    ssweep = sweep + (n + 1);
    for (t = 1; t <= n; t++) {
        ll hi = 0;
        double all = 0.0;
        for (a = t; a >= 1; a--) {
            row *r = &T->rows[pidx(a, t)];
            ll h = 0, q, best = p->first[a];
            /* hi: what recording a..t needs with any of the ways; all: the time of the
             * fastest ways (Note [Tables]) */
            for (q = p->first[a]; q < p->first[a + 1]; q++) {
                const way *w = &p->ways[q];
                h = smax(h, fall_need(p, w, t));
                if (a < t)
                    h = smax(h, sadd(hi, w->s));
                if (w->tf + w->tb < p->ways[best].tf + p->ways[best].tb)
                    best = q;
            }
            all = a < t ? (p->ways[best].tf + all) + p->ways[best].tb : p->ways[best].tf + p->ways[best].tb;
            hi = smin(h, sadd(M, 1));
            r->all = all;
            r->lb = full ? 0 : p->lb[a];
            r->top = full ? M : smin(hi, M);
            r->lo = LLONG_MAX;
            r->least = INF;
        }
        for (a = 1; a <= t; a++) {
            row *r = &T->rows[pidx(a, t)];
            r->off = total;
            r->soff = nsum;
            if (r->top >= r->lb) {
                ll len = r->top - r->lb + 1, ns = full ? 0 : (len - 1) / SKIP + 2;
                if (len > limit - total - nsum || ns > limit - total - nsum - len) {
                    free(sweep);
                    return -1;
                }
                total += len;
                nsum += ns;
                sweep[a] += len;
                ssweep[a] += ns;
            }
        }
    }
    for (a = 1; p->drops && a <= n; a++) {   /* mintime.c Note [Drops]: laid out as P(a, n) */
        row *d = &T->rows[didx(p, a)];
        *d = T->rows[pidx(a, n)];
        d->off = total;
        d->soff = 0;
        if (a == 1 || p->fd[a - 1] == 0) {
            d->top = d->lb - 1;   /* never read */
        } else if (d->top >= d->lb) {
            ll len = d->top - d->lb + 1;
            if (len > limit - total - nsum) {
                free(sweep);
                return -1;
            }
            total += len;
        }
    }
    *scratch = 1;
    *summaries = nsum;
    *sweep_summaries = 1;
    for (a = 1; a <= n; a++) {
        *scratch = smax(*scratch, sweep[a]);
        *sweep_summaries = smax(*sweep_summaries, ssweep[a]);
    }
    free(sweep);
    return total;
}

/* The plain table: every m in 0..M, every split, scalar (the benchmarks' baseline). */
static void compute_row_naive(const table *T, ll a, ll t, double *buf)
{
    const problem *p = T->p;
    ll m, j, g = grad(p, t), M = T->M;
    const double *f = (t == p->n) ? p->tf : p->tn;
    for (m = 0; m <= M; m++) {
        double best = INF, fsum = 0.0;
        ll q;
        for (q = p->first[a]; q < p->first[a + 1]; q++) {   /* Fall branch, each way */
            const way *w = &p->ways[q];
            double c = a < t ? value(T, a + 1, t, m - w->s) : 0.0;
            if (m >= fall_need(p, w, t) && c < INF && (w->tf + c) + w->tb < best)
                best = (w->tf + c) + w->tb;
        }
        if (a < t && fwd_need(p, a, t) <= m) {
            for (j = a + 1; j <= t; j++) {
                ll k = j - 1, xj = p->x[j - 1], xa = p->xa[j - 1];
                double c1, c2;
                if (k > a && fwd_cond(p, k, t) > m)
                    break;
                fsum += f[k];
                c1 = value(T, j, t, m - xa);
                if (c1 == INF)
                    continue;
                c2 = value(T, a, j - 1, smin(m - xj + g, M));
                if (c2 == INF)
                    continue;
                if ((fsum + c1) + c2 < best)
                    best = (fsum + c1) + c2;
            }
        }
        buf[m] = best;
    }
}

/* Computes row (a, t) and stores it in the pool and the sweep's lane. */
static void finish_row(table *T, lane *ln, int naive, ll a, ll t, double *buf)
{
    row *r = &T->rows[pidx(a, t)];
    ll len = r->top - r->lb + 1, m;
    ln->sweep[t] = *r;
    if (len <= 0)
        return;
    if (naive)
        compute_row_naive(T, a, t, buf);
    else
        remat_compute_row(T, ln, a, t, buf);
    if (T->use_float) {
        float *dst = (float *)T->pool + r->off, *sum = (float *)T->summary + r->soff;
        for (m = 0; m < len; m++) {
            dst[m] = (float)buf[m];
            buf[m] = (double)dst[m];   /* the scratch holds the stored values */
        }
        for (m = 0; !naive && m < len; m += SKIP)
            sum[m / SKIP] = dst[m];
        if (!naive)
            sum[(len - 1) / SKIP + 1] = dst[len - 1];
    } else {
        double *sum = (double *)T->summary + r->soff;
        memcpy((double *)T->pool + r->off, buf, (size_t)len * sizeof(double));
        for (m = 0; !naive && m < len; m += SKIP)
            sum[m / SKIP] = buf[m];
        if (!naive)
            sum[(len - 1) / SKIP + 1] = buf[len - 1];
    }
    if (!T->use_float)
        memcpy(ln->scratch + ln->soff[t], buf, (size_t)len * sizeof(double));
    for (m = 0; m < len && buf[m] == INF; m++)
        ;
    r->lo = m < len ? r->lb + m : LLONG_MAX;
    r->least = buf[len - 1];
    if (m < len) {   /* the plateau: reads past its start return least (Note [Tables]) */
        ll p = len - 1;
        while (p > m && buf[p - 1] == r->least)
            p--;
        r->top = r->lb + p;
    }
    ln->sweep[t] = *r;
    if (!naive) {   /* the lane's copy reads its summary from the lane */
        size_t w = T->use_float ? sizeof(float) : sizeof(double);
        ln->sweep[t].soff = ln->sumoff[t];
        memcpy((char *)ln->summary + (size_t)ln->sumoff[t] * w, (const char *)T->summary + (size_t)r->soff * w,
               (size_t)((len - 1) / SKIP + 2) * w);
    }
}

/* Computes every row (Note [Tables], Note [Threads]), or stops between columns
 * once the caller cancels (T->ctl): the table is then unusable. */
void remat_fill(table *T, lane *all_lanes, int naive, double *bufs, ll buflen, int threads, ll *progress)
{
    const problem *p = T->p;
    ll n = p->n, blocks = (n + LANES - 1) / LANES, next = 0, b;
    for (b = 0; b < blocks; b++)
        progress[b] = smax(1, n - b * LANES - LANES + 1) - 1;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        int id = 0;
        lane *lanes;
        double *buf;
#ifdef _OPENMP
        id = omp_get_thread_num();
#endif
        lanes = all_lanes + (ll)id * LANES;
        buf = bufs + (ll)id * buflen;
        for (;;) {
            ll mine, hi, lo, a, t;
#ifdef _OPENMP
#pragma omp atomic capture
#endif
            mine = next++;
            if (mine >= blocks)
                break;
            hi = n - mine * LANES;
            lo = smax(1, hi - LANES + 1);
            for (a = lo; a <= hi; a++) {
                lane *ln = &lanes[a - lo];
                ll off = 0, soff = 0;
                for (t = a; t <= n; t++) {
                    const row *r = &T->rows[pidx(a, t)];
                    ln->soff[t] = off;
                    ln->sumoff[t] = soff;
                    if (r->top >= r->lb) {
                        off += r->top - r->lb + 1;
                        soff += (r->top - r->lb) / SKIP + 2;
                    }
                }
            }
            for (t = lo; t <= n; t++) {
                ll work = 0;
                if (mine > 0) {   /* wait for the block above to finish column t */
                    ll done;
                    do {
#ifdef _OPENMP
#pragma omp atomic read seq_cst
#endif
                        done = progress[mine - 1];
                    } while (done < t && !cancelled(T->ctl));
                }
                if (cancelled(T->ctl))
                    break;   /* (the block below stops waiting on this one: it sees the flag too) */
                for (a = smin(hi, t); a >= lo && !(p->drops && t == n); a--) {
                    finish_row(T, &lanes[a - lo], naive, a, t, buf);   /* mintime.c Note [Drops]: fill_last */
                    work += t - a + 1;
                }
                advance(T->ctl, work);
#ifdef _OPENMP
#pragma omp atomic write seq_cst
#endif
                progress[mine] = t;
            }
        }
    }
}
