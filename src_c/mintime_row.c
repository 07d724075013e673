/* MIN_TIME's rows: P(a, t, m) for every stored m of one pair, as shifted
 * min-plus vector operations over m (mintime_table.c Note [Tables]) that skip
 * what cannot win.
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
 */
#include <stddef.h>

#include "mintime.h"

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
/* Splits ahead whose operands are prefetched, and how many 64-byte lines. */
#define AHEAD 4
#define PREFETCH_LINES 3

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

/* Float tables read the sweep's rows from the pool (mintime_table.c Note [Tables]). */
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

/* buf[m - lb] = min(buf, (f + P(j, t, m - xa)) + P(a, j-1, m - xj + g)) for m in [ms, me]. */
static void split_range(const table *T, const lane *ln, double *buf, ll lb, ll ms, ll me, double f,
                        const row *r1, const row *r2, ll j, ll xa, ll xj, ll g)
{
    ll e1 = r1->top + xa, e2 = r2->top + xj - g, cur = ms;
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
                split_aa_f(b, len, f, (const float *)at(T, r1, cur - xa), (const float *)at(T, r2, cur - xj + g));
            else
                split_aa_d(b, len, f, (const double *)at(T, r1, cur - xa), sat(ln, r2, j - 1, cur - xj + g));
        } else if (arr1) {
            if (T->use_float)
                split_ac_f(b, len, f, (const float *)at(T, r1, cur - xa), c2);
            else
                split_ac_d(b, len, f, (const double *)at(T, r1, cur - xa), c2);
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

/* P(a, t, m) for m in [lb, top] into buf (mintime_table.c Note [Tables]). */
void remat_compute_row(const table *T, const lane *ln, ll a, ll t, double *buf)
{
    const problem *p = T->p;
    const row *r = &T->rows[pidx(a, t)];
    ll lb = r->lb, top = r->top, n = top - lb + 1, g = grad(p, t), j, m, mlow, nb, b, q;
    const double *f = (t == p->n) ? p->tf : p->tn;
    double fsum = 0.0, *bmax = buf + T->buflen;   /* bmax[b]: buf at block b's start, its largest */
    unsigned char *live = (unsigned char *)(bmax + T->buflen / SKIP + 2);

    for (m = 0; m < n; m++)
        buf[m] = INF;
    /* Fall branch, for each way w of stage a: Fall(a), P(a+1, t, m - s_w), B(a) */
    for (q = p->first[a]; q < p->first[a + 1]; q++) {
        const way *w = &p->ways[q];
        ll ms = smax(lb, fall_need(p, w, t));
        if (a == t) {
            if (ms <= top)
                const_min(buf + (ms - lb), top - ms + 1, w->tf + w->tb);
        } else {
            const row *c = &T->rows[pidx(a + 1, t)];
            if (c->lo != LLONG_MAX) {
                ll e = c->top + w->s;   /* the last m read from c's values */
                ms = smax(ms, sadd(c->lo, w->s));
                if (ms <= top && ms <= e) {
                    ll end = smin(top, e);
                    if (T->use_float)
                        fall_f(buf + (ms - lb), end - ms + 1, w->tf, (const float *)at(T, c, ms - w->s), w->tb);
                    else
                        fall_d(buf + (ms - lb), end - ms + 1, w->tf, (const double *)at(T, c, ms - w->s), w->tb);
                }
                ms = smax(ms, e + 1);
                if (ms <= top)
                    const_min(buf + (ms - lb), top - ms + 1, (w->tf + c->least) + w->tb);
            }
        }
    }
    /* Split branch: Fck(a), Fn(a+1..j-1), P(j, t, m - x[j-1]), P(a, j-1, m + g - x[j-1]),
     * from what Fck(a) needs (fwd_need), which lb may be below (an option's need, or after Loss) */
    mlow = smax(lb, fwd_need(p, a, t));
    nb = (top - lb) / SKIP + 1;
    for (b = 0; b < nb; b++)
        bmax[b] = buf[SKIP * b];
    for (j = a + 1; j <= t; j++) {
        ll k = j - 1, xj = p->x[j - 1], xa = p->xa[j - 1], ms, b0, b1, k1, k2, e1, e2;
        const row *r1, *r2;
        double bound;
        if (k > a)
            mlow = smax(mlow, fwd_cond(p, k, t));
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
        ms = smax(mlow, smax(sadd(r1->lo, xa), sadd(r2->lo, xj) - g));
        if (ms > top)
            continue;
        bound = (fsum + r1->least) + r2->least;
        if (buf[ms - lb] <= bound)
            continue;
        b0 = (ms - lb) / SKIP;
        for (b1 = b0 + 1; b1 < nb && bmax[b1] > bound; b1++)
            ;   /* b1: the first block after b0 whose values are all <= bound */
        k1 = skey(r1, lb, b0, xa, &e1);
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
                        r1, r2, j, xa, xj, g);
            for (; b <= e; b++)
                bmax[b] = buf[SKIP * b];
        }
    }
}
