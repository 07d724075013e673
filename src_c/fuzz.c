/* Fuzz driver for remat_solve: hostile inputs from a seeded PRNG.
 *
 *     fuzz [iterations [seconds [seed]]]     (0 means no limit; default 2000 0 1)
 *
 * Built by .ci/fuzz.sh with AddressSanitizer and UBSan, which turn any out of
 * bounds access, leak or undefined behaviour into a non-zero exit. This file
 * checks the rest: every call returns a defined status, and a schedule that
 * comes back is well formed (codes, stages, one Loss, every B once, in order,
 * and an option each Fall's stage has, 0 on every other op). Half the chains
 * list options (remat_chain.option_first), a few of them malformed.
 */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "solver.h"

static unsigned long long state;
static unsigned long long option_falls;   /* Falls with an option in the schedules returned */

static unsigned long long next(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

static long long below(long long n) { return n > 0 ? (long long)(next() % (unsigned long long)n) : 0; }

static double hostile_time(void)
{
    switch (below(12)) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return -1.0;
    case 3: return 1e300;
    case 4: return 0.0;
    case 5: return 1e18;
    case 6: return 5e-324;
    default: return (double)below(1000) / 100.0;
    }
}

static long long hostile_size(long long scale)
{
    switch (below(14)) {
    case 0: return -1;
    case 1: return LLONG_MIN;
    case 2: return (1LL << 62) - 1;
    case 3: return 1LL << 62;
    case 4: return LLONG_MAX;
    case 5: return 0;
    case 6: return (1LL << 62) - below(1000) - 1;
    default: return below(scale + 1);
    }
}

static void fail(unsigned long long iter, const char *why)
{
    fprintf(stderr, "fuzz: iteration %llu: %s\n", iter, why);
    exit(1);
}

/* The schedule is well formed: a forward phase 1..n, Loss, then B(n)..B(1);
 * options (first: the chain's option_first, or NULL) only on Falls, in range. */
static void check_plan(unsigned long long iter, const remat_plan *p, long long n, const long long *first)
{
    long long i, losses = 0, next_b = n, next_f = 1;
    if (p->n_ops < 2 * n + 1 || p->n_ops > p->capacity)
        fail(iter, "n_ops out of range");
    for (i = 0; i < p->n_ops; i++) {
        int c = p->codes[i], s = p->stages[i], o = p->options ? p->options[i] : 0;
        if (c < 0 || c > 4)
            fail(iter, "op code out of range");
        if (o != 0 && (c != REMAT_OP_FALL || !first))
            fail(iter, "an option on an op other than a Fall, or without options");
        if (c == REMAT_OP_LOSS) {
            if (losses++ || next_f != n + 1)
                fail(iter, "Loss misplaced");
            continue;
        }
        if (s < 1 || s > n)
            fail(iter, "stage out of range");
        if (o < 0 || (o > 0 && o > first[s] - first[s - 1]))
            fail(iter, "option out of range");
        option_falls += o > 0;
        if (c == REMAT_OP_B) {
            if (!losses || s != next_b--)
                fail(iter, "backward out of order");
        } else if (!losses) {
            if (s != next_f++)
                fail(iter, "forward phase out of order");
        } else if (s > next_b) {
            fail(iter, "recomputation after the stage's backward");
        }
    }
    if (losses != 1 || next_b != 0)
        fail(iter, "schedule incomplete");
}

int main(int argc, char **argv)
{
    unsigned long long iters = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000, iter;
    double seconds = argc > 2 ? atof(argv[2]) : 0.0;
    time_t start = time(NULL);
    unsigned long long counts[REMAT_E_CANCELLED + 1] = {0};
    state = (argc > 3 ? strtoull(argv[3], NULL, 10) : 1) * 2654435761ULL + 88172645463325252ULL;
    for (iter = 0; iters == 0 || iter < iters; iter++) {
        long long n, alloc, k, scale, budget, slots, cap, limit;
        int mode, status, nulls;
        double *tf, *tn, *tb;
        long long *x, *s, *ft, *bt, *dr, *drw, *rl, *nl, *first, *os, *oft, *obt, n_opts;
        double *otf, *otb;
        int *codes, *stages, *options;
        remat_chain chain;
        remat_plan plan;
        remat_control control;
        if (seconds > 0 && difftime(time(NULL), start) >= seconds)
            break;
        switch (below(10)) {
        case 0: n = -below(5); break;
        case 1: n = 10000 + below(3); break;
        case 2: n = 40 + below(60); break;
        default: n = 1 + below(12);
        }
        alloc = n > 0 ? n : 1;
        scale = below(4) ? 1 + below(64) : (1LL << 40);
        tf = malloc(alloc * sizeof *tf);
        tn = malloc(alloc * sizeof *tn);
        tb = malloc(alloc * sizeof *tb);
        x = malloc(alloc * sizeof *x);
        s = malloc(alloc * sizeof *s);
        ft = malloc(alloc * sizeof *ft);
        bt = malloc(alloc * sizeof *bt);
        dr = malloc(alloc * sizeof *dr);
        drw = malloc(alloc * sizeof *drw);
        rl = malloc(alloc * sizeof *rl);
        nl = malloc(alloc * sizeof *nl);
        first = malloc((alloc + 1) * sizeof *first);
        if (!tf || !tn || !tb || !x || !s || !ft || !bt || !dr || !drw || !rl || !nl || !first)
            fail(iter, "the driver's own malloc failed");
        nulls = below(8) == 0;
        for (k = 0; k < alloc; k++) {
            int hostile = below(200 * alloc) == 0;
            tf[k] = hostile ? hostile_time() : (double)below(100) / 10.0;
            tn[k] = hostile ? hostile_time() : (double)below(100) / 10.0;
            tb[k] = hostile ? hostile_time() : (double)below(100) / 10.0;
            x[k] = hostile ? hostile_size(scale) : below(scale + 1);
            s[k] = hostile ? hostile_size(scale) : x[k] + below(scale + 1);
            ft[k] = hostile ? hostile_size(scale) : below(scale / 2 + 1);
            /* bwd_tmp may be as low as -x[k] (the output given back) */
            if (hostile)
                bt[k] = below(2) || x[k] < 0 || x[k] >= (1LL << 62) ? hostile_size(scale) : -x[k] - below(3);
            else
                bt[k] = below(scale / 2 + 1) - (below(3) ? 0 : below(x[k] + 1));
            /* what the forward phase drops of a^k: 0 or (up to) a^k, none of the last */
            dr[k] = hostile ? hostile_size(scale) : (k + 1 < alloc && below(2) ? x[k] - (below(4) ? 0 : below(x[k] + 1)) : 0);
            drw[k] = hostile && below(2) ? hostile_size(scale) : (below(2) ? dr[k] : 0);
            /* what a rebuilt B(k) needs less: 0 .. bwd_tmp + out_bytes */
            rl[k] = hostile && below(2) ? (below(2) ? hostile_size(scale) : -1 - below(3))
                  : (below(2) && x[k] >= 0 && x[k] < (1LL << 62) && bt[k] >= -x[k] && bt[k] < (1LL << 62)
                     ? below(bt[k] + x[k] + 1) : 0);
            /* what a forward without recording needs less: 0 .. fwd_tmp */
            nl[k] = hostile && below(2) ? (below(2) ? hostile_size(scale) : -1 - below(3))
                  : (below(2) && ft[k] >= 0 && ft[k] < (1LL << 62) ? below(ft[k] + 1) : 0);
        }
        chain.length = n;
        chain.fwd_time = nulls && below(2) ? NULL : tf;
        chain.fwd_nograd_time = nulls && below(2) ? NULL : tn;
        chain.bwd_time = tb;
        chain.out_bytes = x;
        chain.saved_bytes = nulls && below(2) ? NULL : s;
        chain.fwd_tmp = ft;
        chain.bwd_tmp = nulls && below(2) ? NULL : bt;
        chain.input_bytes = below(20) ? below(scale + 1) : hostile_size(scale);
        chain.fwd_drop = below(3) ? NULL : dr;
        chain.fwd_drop_whole = below(3) ? NULL : drw;
        chain.bwd_rebuilt_less = below(3) ? NULL : rl;
        chain.fwd_nograd_less = below(3) ? NULL : nl;
        /* the stage whose output the caller holds: none, the last, any, or out of range */
        chain.output_held = below(2) ? 0 : below(3) ? n : below(8) ? below(n + 1) : n + 1 - 2 * below(2) * (n + 2);
        /* options: 0..3 a stage (a few counts hostile), each keeping less than the
         * stage's record and rebuilding it in a longer backward, or hostile */
        first[0] = below(60) ? 0 : 1 + below(3);
        for (k = 0; k < alloc; k++)
            first[k + 1] = first[k] + (below(100 * alloc) ? below(4) : (below(2) ? -1 - below(3) : 65 + below(3)));
        n_opts = first[alloc] >= 0 && first[alloc] < 1000000 ? first[alloc] : 0;
        os = malloc((n_opts > 0 ? n_opts : 1) * sizeof *os);
        oft = malloc((n_opts > 0 ? n_opts : 1) * sizeof *oft);
        obt = malloc((n_opts > 0 ? n_opts : 1) * sizeof *obt);
        otf = malloc((n_opts > 0 ? n_opts : 1) * sizeof *otf);
        otb = malloc((n_opts > 0 ? n_opts : 1) * sizeof *otb);
        if (!os || !oft || !obt || !otf || !otb)
            fail(iter, "the driver's own malloc failed");
        for (k = 0; k < n_opts; k++) {
            int hostile = below(100 * (n_opts + 1)) == 0;
            long long base = below(scale + 1);
            otf[k] = hostile ? hostile_time() : (double)below(100) / 10.0;
            otb[k] = hostile ? hostile_time() : (double)below(200) / 10.0;
            os[k] = hostile ? hostile_size(scale) : base;
            oft[k] = hostile ? hostile_size(scale) : below(scale / 2 + 1);
            obt[k] = hostile ? (below(2) ? hostile_size(scale) : -scale - 2) : below(scale + 1);
        }
        chain.option_first = below(2) ? first : NULL;
        chain.option_fwd_time = below(30) ? otf : NULL;
        chain.option_bwd_time = otb;
        chain.option_saved_bytes = below(30) ? os : NULL;
        chain.option_fwd_tmp = oft;
        chain.option_bwd_tmp = below(30) ? obt : NULL;
        switch (below(8)) {
        case 0: budget = -below(3); break;
        case 1: budget = 1LL << 62; break;
        case 2: budget = LLONG_MAX; break;
        case 3: budget = 0; break;
        default: budget = below(scale * (n > 0 ? n : 1) * 3 + 1);
        }
        switch (below(8)) {
        case 0: slots = -below(3); break;
        case 1: slots = LLONG_MAX; break;
        case 2: slots = 1; break;
        default: slots = 1 + below(300);
        }
        mode = below(12) == 0 ? (int)below(7) - 3 : (int)below(3);
        limit = below(10) == 0 ? -1 : (below(3) ? (1LL << 26) : below(1 << 16));
        cap = below(6) == 0 ? below(4) : (n > 0 && n < 1000 ? n * (n + 1) / 2 + 2 * n + 1 : 64);
        codes = malloc((cap > 0 ? cap : 1) * sizeof *codes);
        stages = malloc((cap > 0 ? cap : 1) * sizeof *stages);
        options = malloc((cap > 0 ? cap : 1) * sizeof *options);
        if (!codes || !stages || !options)
            fail(iter, "the driver's own malloc failed");
        plan.capacity = cap;
        plan.codes = below(20) ? codes : NULL;
        plan.stages = stages;
        plan.options = below(30) ? options : NULL;
        /* progress and cancellation: none, watched, or cancelled before the call */
        control.cancel = below(6) == 0;
        control.done = control.total = -1;
        plan.control = below(2) ? &control : NULL;
        status = remat_solve(below(40) ? &chain : NULL, budget, slots, mode, limit, below(40) ? &plan : NULL);
        if (status < REMAT_OK || status > REMAT_E_CANCELLED || !remat_strerror(status))
            fail(iter, "undefined status");
        if (status == REMAT_E_INTERNAL)
            fail(iter, "internal error");
        if (status == REMAT_E_CANCELLED && !(plan.control && control.cancel))
            fail(iter, "cancelled without being asked");
        if (status == REMAT_OK && plan.control && control.cancel)
            fail(iter, "a plan despite a cancel");
        if (status == REMAT_OK && plan.control && control.done != control.total)
            fail(iter, "progress does not reach its total");
        if (status == REMAT_OK)
            check_plan(iter, &plan, n, chain.option_first);
        counts[status]++;
        free(tf); free(tn); free(tb); free(x); free(s); free(ft); free(bt); free(dr); free(drw); free(rl); free(nl);
        free(first); free(os); free(oft); free(obt); free(otf); free(otb);
        free(codes); free(stages); free(options);
    }
    printf("fuzz: %llu calls, %llu Falls with an option;", iter, option_falls);
    for (iter = 0; iter <= REMAT_E_CANCELLED; iter++)
        if (counts[iter])
            printf(" status %llu: %llu;", iter, counts[iter]);
    printf("\n");
    return 0;
}
