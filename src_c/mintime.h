/* Private to the MIN_TIME files: mintime_table.c (the table, Note [Tables]),
 * mintime_row.c (the fast row kernels) and mintime.c (the entry point). The
 * accessors run inside the kernels' loops, so they are static inline here. */
#ifndef REMAT_MINTIME_H
#define REMAT_MINTIME_H

#include "internal.h"

/* Relative slack of the whole-chain lower bound: the same positive terms
 * summed in another order differ by far less than this. */
#define BOUND_SLACK (1.0 - 1e-7)
/* Summary stride and block length (mintime_row.c Note [Skipping]). */
#define SKIP 16
/* Sweeps interleaved by remat_fill (mintime_table.c Note [Threads]). */
#define LANES 8

typedef struct {
    ll lb, top;   /* stored headrooms [lb, top]; empty if top < lb */
    ll lo;        /* first finite headroom, LLONG_MAX if none */
    ll off;       /* index of headroom lb in the pool */
    ll soff;      /* index of the row's summary in the summary pool (mintime_row.c Note [Skipping]) */
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
    remat_control *ctl;   /* the caller's progress and cancellation, or NULL */
} table;

/* One sweep's rows (a, a..n), kept close while the sweep runs. */
typedef struct {
    double *scratch;  /* their values, as doubles */
    ll *soff;         /* soff[t]: offset of (a, t) in scratch */
    void *summary;    /* their summaries, one after another (same type as the pool) */
    ll *sumoff;       /* sumoff[t]: offset of (a, t)'s summary there */
    row *sweep;       /* sweep[t]: a copy of row (a, t) */
} lane;

/* Row D(a) of mintime.c Note [Drops], after the triangle. */
static inline ll didx(const problem *p, ll a) { return pidx(1, p->n + 1) + (a - 1); }

static inline double cell(const table *T, const row *r, ll m)
{
    ll i;
    if (m < r->lo)
        return INF;
    if (m > r->top)
        m = r->top;
    i = r->off + (m - r->lb);
    return T->use_float ? (double)((const float *)T->pool)[i] : ((const double *)T->pool)[i];
}

static inline double value(const table *T, ll a, ll t, ll m)
{
    return cell(T, &T->rows[pidx(a, t)], m);
}

static inline const void *at(const table *T, const row *r, ll m)
{
    ll i = r->off + (m - r->lb);
    return T->use_float ? (const void *)((const float *)T->pool + i) : (const void *)((const double *)T->pool + i);
}

/* Row (a, t) of a sweep in its scratch, from headroom m. */
static inline const double *sat(const lane *L, const row *r, ll t, ll m)
{
    return L->scratch + L->soff[t] + (m - r->lb);
}

/* mintime_table.c: lays out the rows (-1 past `limit`), then computes them. */
ll remat_layout(table *T, int full, ll limit, ll *scratch, ll *summaries, ll *sweep_summaries);
void remat_fill(table *T, lane *all_lanes, int naive, double *bufs, ll buflen, int threads, ll *progress);

/* mintime_row.c: P(a, t, m) for m in [lb, top] into buf. */
void remat_compute_row(const table *T, const lane *ln, ll a, ll t, double *buf);

#endif
