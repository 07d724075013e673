/* Shared between solver.c (entry point, schedule writer), minmemory.c (least
 * memory) and the least-time tables: mintime.c (their entry point),
 * mintime_table.c (layout and fill order) and mintime_row.c (the row kernels),
 * which also share mintime.h. Not part of the interface. */
#ifndef REMAT_INTERNAL_H
#define REMAT_INTERNAL_H

#include <limits.h>
#include <math.h>

#include "solver.h"

#define INF HUGE_VAL

typedef long long ll;

/* Sums of sizes saturate (solver.c Note [Overflow]). Arguments are >= 0
 * (bwd_tmp, which may be negative, is added once, without it). */
static inline ll sadd(ll a, ll b) { return (b > LLONG_MAX - a) ? LLONG_MAX : a + b; }
static inline ll smax(ll a, ll b) { return a > b ? a : b; }
static inline ll smin(ll a, ll b) { return a < b ? a : b; }
/* The caller asked the solve to stop (remat_control; ctl may be NULL). */
static inline int cancelled(const remat_control *ctl) { return ctl && ctl->cancel; }
/* Work done, reported to the caller (threads add to it at once). */
static inline void advance(remat_control *ctl, ll work)
{
    if (!ctl)
        return;
#ifdef _OPENMP
#pragma omp atomic
#endif
    ctl->done += work;
}
/* The work of a table over n stages, a row (a, t) weighing t - a + 1 (its split points). */
static inline ll table_work(ll n) { return n * (n + 1) / 6 * (n + 2) + (n * (n + 1) % 6) * (n + 2) / 6; }

/* Index of the pair (a, t), 1 <= a <= t, in triangular tables. */
static inline ll pidx(ll a, ll t) { return t * (t - 1) / 2 + (a - 1); }

/* One way to record stage k, a Fall(k) and the B(k) of what it keeps: way 0 the
 * base record, the others its options (remat/solver/option.py Note [Options]). */
typedef struct {
    ll s;       /* a-bar^k as it keeps it (a^k included) */
    ll fneed;   /* max(s, x[k] + its fwd_tmp): the Fall */
    ll fneed_rebuilt;   /* the same after Loss: a Fall of the output the caller holds makes a copy of it */
    ll bneed;   /* s + x[k] + x[k-1] + its bwd_tmp (at k = n at least s + x[k]): the B, before the gradient credit */
    ll bneed_rebuilt;   /* the same where a-bar^k was rebuilt after Loss (Costs.bwd_rebuilt_less) */
    double tf, tb;
} way;

/* The chain, 1-based, sizes in units (slots, or bytes for MIN_MEMORY). */
typedef struct {
    ll n;
    ll *x;      /* x[0..n] */
    ll *xa;     /* x[k] as held on its own: 0 for the output the caller holds (remat_chain.output_held) */
    ll *s, *ft, *bt;
    ll *fa;     /* xa[k] + ft[k]: what Fn/Fck(k) need before Loss (recording) */
    ll *cond;   /* xa[k-1] + xa[k] + ft[k]: Fn(k) after Fck/Fn(k-1), before Loss */
    ll *fan, *condn;   /* the same after Loss, without recording (fwd_nograd_less) */
    ll *fneed;  /* max(s[k], xa[k] + ft[k]): Fall(k) */
    ll *bneed;  /* s[k] + x[k] + x[k-1] + bt[k] (at k = n at least s[k] + x[k]): B(k), before the gradient credit */
    ll *fd;     /* fd[k]: slots of a^k a forward-phase Fall(k+1) lets go (rounded down) */
    ll *fdw;    /* fdw[k]: fd[k] if that also holds with a^k inside a-bar^k, else 0 */
    int drops;  /* some fd[k] > 0: column n has drop rows (mintime.c Note [Drops]) */
    double *tf, *tn, *tb;
    ll *first;  /* first[k] .. first[k+1] - 1: stage k's ways in `ways`, the base record first */
    way *ways;
    ll *lb;     /* min(fan[k], each way's fneed): below it no forward of stage k fits */
    void *mem;
} problem;

int remat_problem_init(problem *p, const remat_chain *c, ll slot);

/* The gradient of a^t held by the caller of P(a, t): none at the top. */
static inline ll grad(const problem *p, ll t) { return t < p->n ? p->x[t] : 0; }

/* What Fn/Fck(k) need in P(a, t): recording before Loss (t = n), not after. */
static inline ll fwd_need(const problem *p, ll k, ll t) { return t == p->n ? p->fa[k] : p->fan[k]; }
/* What Fn(k) needs after Fck/Fn(k-1) in P(a, t). */
static inline ll fwd_cond(const problem *p, ll k, ll t) { return t == p->n ? p->cond[k] : p->condn[k]; }

/* What B(k) of way w needs at (a, t): a Fall in P(a, n) runs before Loss, one
 * in P(a, t < n) after it, rebuilding a-bar^k. */
static inline ll way_bneed(const problem *p, const way *w, ll t) { return t == p->n ? w->bneed : w->bneed_rebuilt; }

/* What the Fall of way w needs at (a, t), before Loss or after it (way_bneed). */
static inline ll way_fneed(const problem *p, const way *w, ll t) { return t == p->n ? w->fneed : w->fneed_rebuilt; }

/* Least headroom for the conditions of the Fall branch with way w at (a, t). */
static inline ll fall_need(const problem *p, const way *w, ll t)
{
    return smax(way_fneed(p, w, t), way_bneed(p, w, t) - grad(p, t));
}

/* Picks the branch at (a, t, m): 0 for Fall with the way of index *j in p->ways,
 * 1 for a split at *j, -1 if none fits. `drop`: a Fall(a) of the base record
 * lets go of fd[a-1] of a^(a-1) (t = n only; mintime.c Note [Drops]). */
typedef int (*remat_chooser)(const void *ctx, ll a, ll t, ll m, int drop, ll *j);

/* What the Fall branch with way q of stage a lets go of a^(a-1) where `drop` (an
 * option lets go of nothing: remat/solver/option.py Note [Options] 3). */
static inline ll fall_drop(const problem *p, ll a, ll q, int drop) { return drop && q == p->first[a] ? p->fd[a - 1] : 0; }
/* Whether P(a+1, n) after Fall(a) with way q, and P(j, n) after Fn/Fck(j-1), drop their input. */
static inline int drop_after_fall(const problem *p, ll a, ll t, ll q) { return t == p->n && p->fdw[a] > 0 && q == p->first[a]; }
static inline int drop_after_split(const problem *p, ll j, ll t) { return t == p->n && p->fd[j - 1] > 0; }

/* Writes the schedule of P(1, n, m0) into out (headrooms capped at mcap). */
int remat_emit(const problem *p, remat_chooser choose, const void *ctx, ll m0, ll mcap, remat_plan *out);

/* MIN_MEMORY (minmemory.c). */
int remat_solve_memory(const remat_chain *c, ll max_bytes, remat_plan *out);

/* MIN_TIME and MIN_TIME_NAIVE (mintime.c). */
int remat_solve_time(const remat_chain *c, ll budget, ll slots, int naive, ll max_bytes, remat_plan *out);

#endif
