/* MIN_TIME: the least-time tables of the persistent dynamic program.
 *
 * Note [Tables]
 * -------------
 * P(a, t, m) is the least time to backpropagate stages a..t with headroom m
 * (sizes in slots, remat/solve.py Note [The recurrence]). For one pair it is
 * a non-increasing step function of m: infinite below lo(a, t) and constant
 * from hi(a, t) on, hi being the headroom that recording every stage of a..t
 * needs (nothing beats that: every stage is recorded and backwarded once in
 * any schedule). So a pair stores only m in [lb, top], lb = x[a] + fwd_tmp[a]
 * (both branches need it) and top = min(hi, M); a read above top returns the
 * value at top.
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
 * vector operations over m, most of which cannot win (Note [Skipping]); the
 * loop over j stops once fsum + (time of recording a..t) cannot beat the
 * current best anywhere a later j applies. Values are summed in the order of
 * tests/reference_solver.py, and skipped work provably cannot win, so in
 * double precision the result is the reference's, bit for bit.
 *
 * Tables above REMAT_DOUBLE_TABLE_BYTES store float32 values (sums stay
 * double; float rounding is monotone, so every row stays non-increasing);
 * the schedule's time is then summed again along the schedule, in double.
 *
 * Note [Skipping]
 * ---------------
 * Each row also keeps a summary: its value at every SKIP-th headroom from lb,
 * and its least after them. As values are non-increasing in m, the summary
 * entry at or above a headroom bounds the value there from below, and past
 * the row's top the least is exact. The pair's buffer (buf, the best so far,
 * also non-increasing) is cut into blocks of SKIP headrooms from lb; bmax[b]
 * is buf at the start of block b, the largest value in it. Split j's value
 * over block b is at least (fsum + S1) + S2, the summaries of its two
 * operands at the block's last headroom, which for consecutive blocks are
 * consecutive entries; float rounding is monotone, so the sum computed the
 * same way bounds the real one. A block whose bound is not below bmax[b]
 * cannot improve and is skipped. Before that, split j is dropped outright if
 * its least possible value (both rows' least) is not below buf where j first
 * applies, and the blocks from the first with bmax <= that value on are cut
 * off. Only the flagged blocks run the min-plus kernels: on random chains
 * about a fifth of all (j, m), of which a few per cent improve; finer blocks
 * flag fewer but cost more tests and a larger summary.
 *
 * What costs is reading the operands, rows far apart in the pool. The
 * sweep's own summaries are copied, one after another, to its lane, so the
 * summaries of rows (a, j-1) are read as one stream, like those of column t.
 * Nearly every flagged run starts within a block of both operands' first
 * finite headroom (lo), so the first lines from there are prefetched AHEAD
 * splits early: about 1.3x faster at L=1000.
 *
 * Note [Drops]
 * ------------
 * In the forward phase (column n) a Fall(a) may let go of a^(a-1)
 * (remat/schedule.py Note [Accounting] 6): P(a, n) then depends on how
 * the caller holds a^(a-1), so column n has a second row per a, D(a): P(a, n)
 * where Fall(a) drops fd[a-1], which frees that much headroom from there on
 * (its split branch is P(a, n)'s: Fck(a) keeps a^(a-1)). After Fall(a) the
 * rest reads D(a+1) if fdw[a], after Fck/Fn(j-1) it reads D(j) if fd[j-1].
 * When a chain has drops, fill leaves column n alone and fill_last computes
 * P(a, n) and D(a), a = n..1, every m and split j (the same bound on j as
 * compute_row): O(n^2 M) next to the table's O(n^3 M).
 *
 * Note [Threads]
 * --------------
 * fill takes sweeps LANES at a time (a block) and runs them interleaved by
 * t, so the column rows P(j, t) that one pair streams in are still in cache
 * for the next pair of the block. Built with OpenMP, threads take blocks in
 * order; a block computes column t only once the block above it (larger a)
 * has finished column t, which is all P(a, t) needs from other blocks. Each
 * thread has its own lanes and buffer. Without OpenMP the same code runs
 * the blocks one after another.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Above this, tables hold float32 values (Note [Tables]). */
#define REMAT_DOUBLE_TABLE_BYTES (512LL << 20)
#if defined(__GNUC__)
#define PREFETCH(r) __builtin_prefetch(r)
#else
#define PREFETCH(r) ((void)0)
#endif
/* The min-plus kernels, also built for AVX2 where the toolchain dispatches
 * on the running CPU (GCC on x86-64 Linux): twice the lanes of SSE2. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && __GNUC__ >= 6
#define KERNEL __attribute__((target_clones("avx2", "default"))) static
#else
#define KERNEL static
#endif
/* Relative slack of the whole-chain lower bound: the same positive terms
 * summed in another order differ by far less than this. */
#define BOUND_SLACK (1.0 - 1e-7)
/* Summary stride and block length (Note [Skipping]). */
#define SKIP 16
/* Splits ahead whose operands are prefetched, and how many 64-byte lines. */
#define AHEAD 4
#define PREFETCH_LINES 3
/* Sweeps interleaved by fill (Note [Threads]). */
#define LANES 8
#define REMAT_MAX_THREADS 8
/* Least L^3/6 * (M + 1) for which fill uses threads. */
#define REMAT_THREADS_FROM 2e9

typedef struct {
    ll lb, top;   /* stored headrooms [lb, top]; empty if top < lb */
    ll lo;        /* first finite headroom, LLONG_MAX if none */
    ll off;       /* index of headroom lb in the pool */
    ll soff;      /* index of the row's summary in the summary pool (Note [Skipping]) */
    double all;   /* time of recording every stage (the Fall chain) */
    double least; /* the value at top, the row's least */
} row;

typedef struct {
    const problem *p;
    ll M;
    row *rows;        /* by pidx(a, t) */
    void *pool;       /* column-major values, float or double */
    void *summary;    /* every SKIP-th value of each row, same type as pool */
    int use_float;
    ll buflen;        /* doubles of a row buffer; block maxima and flags follow it */
} table;

/* One sweep's rows (a, a..n), kept close while the sweep runs. */
typedef struct {
    double *scratch;  /* their values, as doubles */
    ll *soff;         /* soff[t]: offset of (a, t) in scratch */
    void *summary;    /* their summaries, one after another (same type as the pool) */
    ll *sumoff;       /* sumoff[t]: offset of (a, t)'s summary there */
    row *sweep;       /* sweep[t]: a copy of row (a, t) */
} lane;

/* Row D(a) of Note [Drops], after the triangle. */
static ll didx(const problem *p, ll a) { return pidx(1, p->n + 1) + (a - 1); }

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

static const void *at(const table *T, const row *r, ll m)
{
    ll i = r->off + (m - r->lb);
    return T->use_float ? (const void *)((const float *)T->pool + i) : (const void *)((const double *)T->pool + i);
}

/* Row (a, t) of a sweep in its scratch, from headroom m. */
static const double *sat(const lane *L, const row *r, ll t, ll m)
{
    return L->scratch + L->soff[t] + (m - r->lb);
}

/* Fills the rows' ranges and offsets. Returns the number of stored values,
 * or -1 past `limit`; *scratch gets the longest sweep's. `full` stores every
 * m in 0..M (the naive table). */
static ll layout(table *T, int full, ll limit, ll *scratch, ll *summaries, ll *sweep_summaries)
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
            ll h = fall_need(p, a, t);
            if (a < t) {
                h = smax(h, sadd(hi, p->s[a]));
                all = (p->tf[a] + all) + p->tb[a];
            } else {
                all = p->tf[a] + p->tb[a];
            }
            hi = smin(h, sadd(M, 1));
            r->all = all;
            r->lb = full ? 0 : p->fa[a];
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
    for (a = 1; p->drops && a <= n; a++) {   /* Note [Drops]: laid out as P(a, n) */
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

#define DEFINE_KERNELS(T, SUF)                                                          \
    KERNEL void fall_##SUF(double *b, ll n, double tf, const T *c, double tb)          \
    {                                                                                   \
        ll i;                                                                           \
        for (i = 0; i < n; i++) {                                                       \
            double v = (tf + (double)c[i]) + tb;                                        \
            b[i] = v < b[i] ? v : b[i];                                                 \
        }                                                                               \
    }                                                                                   \
    KERNEL void split_aa_##SUF(double *b, ll n, double f, const T *c1, const T *c2)   \
    {                                                                                   \
        ll i;                                                                           \
        for (i = 0; i < n; i++) {                                                       \
            double v = (f + (double)c1[i]) + (double)c2[i];                             \
            b[i] = v < b[i] ? v : b[i];                                                 \
        }                                                                               \
    }                                                                                   \
    KERNEL void split_ac_##SUF(double *b, ll n, double f, const T *c1, double c2)     \
    {                                                                                   \
        ll i;                                                                           \
        for (i = 0; i < n; i++) {                                                       \
            double v = (f + (double)c1[i]) + c2;                                        \
            b[i] = v < b[i] ? v : b[i];                                                 \
        }                                                                               \
    }

DEFINE_KERNELS(double, d)
DEFINE_KERNELS(float, f)

/* Float tables read the sweep's rows from the pool (Note [Tables]). */
KERNEL void split_ca_f(double *b, ll n, double fc1, const float *c2)
{
    ll i;
    for (i = 0; i < n; i++) {
        double v = fc1 + (double)c2[i];
        b[i] = v < b[i] ? v : b[i];
    }
}

KERNEL void split_ca(double *b, ll n, double fc1, const double *c2)
{
    ll i;
    for (i = 0; i < n; i++) {
        double v = fc1 + c2[i];
        b[i] = v < b[i] ? v : b[i];
    }
}

KERNEL void const_min(double *b, ll n, double v)
{
    ll i;
    for (i = 0; i < n; i++)
        b[i] = v < b[i] ? v : b[i];
}

/* buf[m - lb] = min(buf, (f + P(j, t, m - xj)) + P(a, j-1, m - xj + g)) for m in [ms, me]. */
static void split_range(const table *T, const lane *ln, double *buf, ll lb, ll ms, ll me, double f,
                        const row *r1, const row *r2, ll j, ll xj, ll g)
{
    ll e1 = r1->top + xj, e2 = r2->top + xj - g, cur = ms;
    double c1 = r1->least, c2 = r2->least;
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
                split_aa_d(b, len, f, (const double *)at(T, r1, cur - xj), sat(ln, r2, j - 1, cur - xj + g));
        } else if (arr1) {
            if (T->use_float)
                split_ac_f(b, len, f, (const float *)at(T, r1, cur - xj), c2);
            else
                split_ac_d(b, len, f, (const double *)at(T, r1, cur - xj), c2);
        } else if (arr2) {
            if (T->use_float)
                split_ca_f(b, len, f + c1, (const float *)at(T, r2, cur - xj + g));
            else
                split_ca(b, len, f + c1, sat(ln, r2, j - 1, cur - xj + g));
        } else {
            const_min(b, len, (f + c1) + c2);
        }
        cur = end + 1;
    }
}

/* Flags the blocks b in [b0, b1) that a split may improve: those whose
 * bound (f + S1[k1 + b]) + S2[k2 + b] is below bmax[b], the indices capped
 * at e1, e2, the rows' trailing least (Note [Skipping]). */
#define DEFINE_TEST(T, SUF)                                                                     \
    static void test_##SUF(unsigned char *live, ll b0, ll b1, double f, const T *s1, ll k1,    \
                           ll e1, const T *s2, ll k2, ll e2, const double *bmax)                \
    {                                                                                           \
        ll b, both = smin(b1, smin(e1 - k1, e2 - k2) + 1);                                      \
        for (b = b0; b < both; b++)                                                             \
            live[b] = (f + (double)s1[k1 + b]) + (double)s2[k2 + b] < bmax[b];                  \
        for (; b < b1; b++)                                                                     \
            live[b] = (f + (double)s1[smin(k1 + b, e1)]) + (double)s2[smin(k2 + b, e2)] < bmax[b]; \
    }

DEFINE_TEST(double, d)
DEFINE_TEST(float, f)

/* The offset k with summary index k + b bounding row r from below over
 * block b >= b0 of a row starting at lb, read at headroom m - shift; and
 * the index of r's trailing least. */
static ll skey(const row *r, ll lb, ll b0, ll shift, ll *last)
{
    ll m = lb + SKIP * b0 + SKIP - 1 - shift;   /* >= r->lo >= r->lb */
    *last = (r->top - r->lb) / SKIP + 1;
    return (m - r->lb + SKIP - 1) / SKIP - b0;
}

/* Where split j of column t starts reading its operands, NULL for an empty
 * row: their first finite headroom, where on random chains nearly every run
 * of a split loop starts (Note [Skipping]). The caller prefetches: GCC drops
 * a function whose only effect is a prefetch. */
static void operand_starts(const table *T, const lane *ln, ll t, ll j, const char **c1, const char **c2)
{
    const row *r1 = &T->rows[pidx(j, t)], *r2 = &ln->sweep[j - 1];
    *c1 = r1->lo == LLONG_MAX ? NULL : (const char *)at(T, r1, r1->lo);
    *c2 = r2->lo == LLONG_MAX ? NULL
          : T->use_float      ? (const char *)at(T, r2, r2->lo)
                              : (const char *)sat(ln, r2, j - 1, r2->lo);
}

/* P(a, t, m) for m in [lb, top] into buf (Note [Tables]). */
static void compute_row(const table *T, const lane *ln, ll a, ll t, double *buf)
{
    const problem *p = T->p;
    const row *r = &T->rows[pidx(a, t)];
    ll lb = r->lb, top = r->top, n = top - lb + 1, g = grad(p, t), j, m, mlow = lb, nb, b;
    const double *f = (t == p->n) ? p->tf : p->tn;
    double fsum = 0.0, *bmax = buf + T->buflen;   /* bmax[b]: buf at block b's start, its largest */
    unsigned char *live = (unsigned char *)(bmax + T->buflen / SKIP + 2);

    for (m = 0; m < n; m++)
        buf[m] = INF;
    /* Fall branch: Fall(a), P(a+1, t, m - s[a]), B(a) */
    {
        ll ms = smax(lb, fall_need(p, a, t));
        if (a == t) {
            if (ms <= top)
                const_min(buf + (ms - lb), top - ms + 1, p->tf[a] + p->tb[a]);
        } else {
            const row *c = &T->rows[pidx(a + 1, t)];
            if (c->lo != LLONG_MAX) {
                ll e = c->top + p->s[a];   /* the last m read from c's values */
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
                    const_min(buf + (ms - lb), top - ms + 1, (p->tf[a] + c->least) + p->tb[a]);
            }
        }
    }
    /* Split branch: Fck(a), Fn(a+1..j-1), P(j, t, m - x[j-1]), P(a, j-1, m + g - x[j-1]) */
    nb = (top - lb) / SKIP + 1;
    for (b = 0; b < nb; b++)
        bmax[b] = buf[SKIP * b];
    for (j = a + 1; j <= t; j++) {
        ll k = j - 1, xj = p->x[j - 1], ms, b0, b1, k1, k2, e1, e2;
        const row *r1, *r2;
        double bound;
        if (k > a)
            mlow = smax(mlow, p->cond[k]);
        if (mlow > top)
            break;
        fsum += f[k];
        if (buf[mlow - lb] <= (fsum + r->all) * BOUND_SLACK)
            break;
        r1 = &T->rows[pidx(j, t)];
        r2 = &ln->sweep[j - 1];
        if (r1->lo == LLONG_MAX || r2->lo == LLONG_MAX)
            continue;
        if (j + AHEAD <= t) {
            const char *c1, *c2;
            int i;
            operand_starts(T, ln, t, j + AHEAD, &c1, &c2);
            for (i = 0; i < PREFETCH_LINES; i++) {
                if (c1)
                    PREFETCH(c1 + 64 * i);
                if (c2)
                    PREFETCH(c2 + 64 * i);
            }
        }
        PREFETCH(r1 + 1);
        ms = smax(mlow, smax(sadd(r1->lo, xj), sadd(r2->lo, xj) - g));
        if (ms > top)
            continue;
        bound = (fsum + r1->least) + r2->least;
        if (buf[ms - lb] <= bound)
            continue;
        b0 = (ms - lb) / SKIP;
        for (b1 = b0 + 1; b1 < nb && bmax[b1] > bound; b1++)
            ;   /* b1: the first block after b0 whose values are all <= bound */
        k1 = skey(r1, lb, b0, xj, &e1);
        k2 = skey(r2, lb, b0, xj - g, &e2);
        if (T->use_float)
            test_f(live, b0, b1, fsum, (const float *)T->summary + r1->soff, k1, e1,
                   (const float *)ln->summary + r2->soff, k2, e2, bmax);
        else
            test_d(live, b0, b1, fsum, (const double *)T->summary + r1->soff, k1, e1,
                   (const double *)ln->summary + r2->soff, k2, e2, bmax);
        for (b = b0; b < b1; b++) {
            ll e = b;
            if (!live[b])
                continue;
            while (e + 1 < b1 && live[e + 1])
                e++;
            split_range(T, ln, buf, lb, smax(ms, lb + SKIP * b), smin(top, lb + SKIP * e + SKIP - 1), fsum,
                        r1, r2, j, xj, g);
            for (; b <= e; b++)
                bmax[b] = buf[SKIP * b];
        }
    }
}

/* The plain table: every m in 0..M, every split, scalar (the benchmarks' baseline). */
static void compute_row_naive(const table *T, ll a, ll t, double *buf)
{
    const problem *p = T->p;
    ll m, j, g = grad(p, t), M = T->M;
    const double *f = (t == p->n) ? p->tf : p->tn;
    for (m = 0; m <= M; m++) {
        double best = INF, fsum = 0.0;
        if (m >= fall_need(p, a, t)) {
            if (a == t) {
                best = p->tf[a] + p->tb[a];
            } else {
                double c = value(T, a + 1, t, m - p->s[a]);
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
                c1 = value(T, j, t, m - xj);
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

/* P(a, t, m), or D(a, m) with `drop` (Note [Drops]). */
static double dvalue(const table *T, ll a, ll t, int drop, ll m)
{
    return drop ? cell(T, &T->rows[didx(T->p, a)], m) : value(T, a, t, m);
}

/* The value of branch choices at (a, t, m) for fill_last and remat_emit's chooser:
 * the first of least value, as the DP finds it (0 Fall, 1 a split at *jout, -1 none). */
static int branch(const table *T, ll a, ll t, ll m, int drop, double bound, double *value_out, ll *jout)
{
    const problem *p = T->p;
    ll g = grad(p, t), j, r = drop ? p->fd[a - 1] : 0;
    const double *f = (t == p->n) ? p->tf : p->tn;
    double best = INF, fsum = 0.0;
    int choice = -1;
    if (m >= p->fneed[a] && sadd(m, g + r) >= p->bneed[a]) {
        double v = p->tf[a] + p->tb[a];
        if (a < t)
            v = (p->tf[a] + dvalue(T, a + 1, t, drop_after_fall(p, a, t), smin(m - p->s[a] + r, T->M))) + p->tb[a];
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
            if (best <= (fsum + bound) * BOUND_SLACK)
                break;   /* no later split can win (as in compute_row) */
            v = (fsum + dvalue(T, j, t, drop_after_split(p, j, t), m - xj)) + value(T, a, j - 1, smin(m - xj + g, T->M));
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
    for (a = n; a >= 1; a--) {
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
        compute_row(T, ln, a, t, buf);
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

/* Computes every row (Note [Tables], Note [Threads]). */
static void fill(table *T, lane *all_lanes, int naive, double *bufs, ll buflen, int threads, ll *progress)
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
                if (mine > 0) {   /* wait for the block above to finish column t */
                    ll done;
                    do {
#ifdef _OPENMP
#pragma omp atomic read seq_cst
#endif
                        done = progress[mine - 1];
                    } while (done < t);
                }
                for (a = smin(hi, t); a >= lo && !(p->drops && t == n); a--)
                    finish_row(T, &lanes[a - lo], naive, a, t, buf);   /* Note [Drops]: fill_last */
#ifdef _OPENMP
#pragma omp atomic write seq_cst
#endif
                progress[mine] = t;
            }
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
            total = layout(&T, naive, limit / width, &scratch, &nsum, &ssum);
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
        sweep_len = 1;   /* float tables read the sweep from the pool (split_range) */
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
    fill(&T, lanes, naive, bufs, buflen, threads, progress);
    if (p.drops)
        fill_last(&T, bufs);
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
