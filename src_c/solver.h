/* remat solver: from a chain's costs and a memory budget to a schedule.
 *
 * Plain C99, no Python headers, no globals; the caller owns all memory.
 * The recurrence is remat/solver/solve.py Note [The recurrence]; the memory
 * accounting is remat/solver/schedule.py Note [Accounting]. Every failure is a
 * status code, and remat_strerror(status) says what went wrong.
 *
 * The block between "cdef begin" and "cdef end" is read by src_c/build.py
 * as the cffi declarations: keep it free of preprocessor lines.
 */
#ifndef REMAT_SOLVER_H
#define REMAT_SOLVER_H

/* cdef begin */
enum {
    REMAT_OK = 0,
    REMAT_INFEASIBLE = 1,    /* no persistent schedule fits the budget */
    REMAT_E_NULL = 2,        /* a required pointer is NULL */
    REMAT_E_LENGTH = 3,      /* the chain length is not in 1..REMAT_MAX_LENGTH */
    REMAT_E_TIME = 4,        /* a time is NaN, infinite, negative or absurd */
    REMAT_E_SIZE = 5,        /* a size is negative (a bwd_tmp below -out_bytes), not below 2^62, or a fwd_drop or a *_less out of range */
    REMAT_E_BUDGET = 6,      /* the budget is not in 0..2^62 */
    REMAT_E_SLOTS = 7,       /* slots is not positive */
    REMAT_E_MODE = 8,        /* unknown mode */
    REMAT_E_LIMIT = 9,       /* max_table_bytes is negative */
    REMAT_E_CAPACITY = 10,   /* the plan's arrays are too small: n_ops says how many are needed */
    REMAT_E_TOO_LARGE = 11,  /* the tables would exceed max_table_bytes */
    REMAT_E_NOMEM = 12,      /* an allocation failed */
    REMAT_E_OVERFLOW = 13,   /* the least memory exceeds 2^62 bytes */
    REMAT_E_OPTIONS = 14,    /* option_first does not count up from 0 by 0..REMAT_MAX_OPTIONS a stage */
    REMAT_E_INTERNAL = 15,   /* an impossibility: a bug */
    REMAT_E_CANCELLED = 16   /* remat_control.cancel was set: the solve stopped, no plan */
};

enum {
    REMAT_MIN_TIME = 0,        /* least time within a budget, sizes in slots */
    REMAT_MIN_MEMORY = 1,      /* least memory, exact in bytes */
    REMAT_MIN_TIME_NAIVE = 2   /* MIN_TIME by the plain O(L^3 slots) table (benchmarks) */
};

enum {
    REMAT_OP_FN = 0,
    REMAT_OP_FCK = 1,
    REMAT_OP_FALL = 2,
    REMAT_OP_B = 3,
    REMAT_OP_LOSS = 4
};

typedef struct {
    long long length;                 /* L */
    const double *fwd_time;           /* L entries each, stage 1 first */
    const double *fwd_nograd_time;
    const double *bwd_time;
    const long long *out_bytes;
    const long long *saved_bytes;
    const long long *fwd_tmp;
    const long long *bwd_tmp;         /* each at least -out_bytes of its stage */
    long long input_bytes;
    /* NULL, or L entries: bytes of a^i a forward-phase Fall(i+1) lets go when a^i
     * is held on its own (at most out_bytes, 0 for stage L), and when it is inside
     * a-bar^i (0 or fwd_drop); remat/solver/schedule.py Note [Accounting] 6 */
    const long long *fwd_drop;
    const long long *fwd_drop_whole;
    /* NULL, or L entries: bytes B(i) needs less where a-bar^i was rebuilt after
     * Loss with the base record (0 .. bwd_tmp + out_bytes of the stage;
     * remat/solver/schedule.py Note [Accounting] 5) */
    const long long *bwd_rebuilt_less;
    /* NULL, or L entries: bytes a forward without recording (Fn, Fck after Loss)
     * needs less than fwd_tmp (0 .. fwd_tmp of the stage; remat/solver/schedule.py
     * Note [Accounting] 2) */
    const long long *fwd_nograd_less;
    /* 0, or the stage k (1..L) whose output a^k the caller holds through the
     * step, counted in the budget outside the chain (remat/measure/chain_record.py
     * Note [The chain's output]): a^k held on its own takes nothing more */
    long long output_held;
    /* NULL, or L + 1 entries counting up from 0: the options of stage k (1-based),
     * other ways to record it (remat/solver/option.py Note [Options]), are entries
     * option_first[k-1] .. option_first[k] - 1 of the five arrays after it, option 1
     * first, at most REMAT_MAX_OPTIONS a stage; those arrays may be NULL where no
     * stage has options. Sizes and times as the stage's own (bwd_tmp down to
     * -out_bytes of the stage). */
    const long long *option_first;
    const double *option_fwd_time;
    const double *option_bwd_time;
    const long long *option_saved_bytes;
    const long long *option_fwd_tmp;
    const long long *option_bwd_tmp;
} remat_chain;

/* Progress and cancellation of a solve that runs on another thread (the caller's
 * thread polls `done`, and sets `cancel` to stop it). The solver checks `cancel`
 * between rows of its tables, so it stops within a row's time. */
typedef struct {
    volatile int cancel;       /* in: non-zero stops the solve with REMAT_E_CANCELLED */
    volatile long long done;   /* out: work done so far, of `total` */
    volatile long long total;  /* out: the table's work (0 until known, and for the plan's writing) */
} remat_control;

typedef struct {
    long long capacity;   /* in: entries in codes and stages */
    int *codes;           /* out: op codes (REMAT_OP_*) */
    int *stages;          /* out: 1-based stage of each op (0 for Loss) */
    int *options;         /* out: the option each op records with (0 but for a Fall with an
                             option); NULL only where no stage has options */
    long long n_ops;      /* out: ops written; with REMAT_E_CAPACITY, the capacity needed */
    double time;          /* out: predicted time of the schedule */
    long long slot_bytes; /* out: bytes per slot (MIN_TIME), 1 for MIN_MEMORY */
    long long min_budget; /* out: MIN_MEMORY: the least budget in bytes */
    long long bad_stage;  /* out: for E_TIME/E_SIZE, the 1-based stage at fault (0: input_bytes) */
    remat_control *control;  /* in: NULL, or where the solve reports progress and is asked to stop */
} remat_plan;

int remat_solve(const remat_chain *chain, long long budget, long long slots, int mode,
                long long max_table_bytes, remat_plan *out);
const char *remat_strerror(int status);
/* cdef end */

#define REMAT_MAX_BYTES (1LL << 62)
#define REMAT_MAX_LENGTH 10000000LL
#define REMAT_MAX_TIME 1e18
#define REMAT_MAX_OPTIONS 64   /* remat/solver/option.py MAX_OPTIONS */

#endif
