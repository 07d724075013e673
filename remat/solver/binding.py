"""Python face of the C solver (src_c/solver.c, bound by cffi as ``remat.solver._solver``).

Arguments are checked here first; any status the C side still returns
becomes a typed exception: ``Infeasible`` when no schedule fits, and
``SolverError`` for everything else (invalid input, tables too large, no
memory).
"""

import math

from ..errors import RematError, SolverError
from .checks import MAX_BYTES, MAX_SECONDS, least_bytes, where
from .costs import SIZE_FIELDS, TIME_FIELDS
from .option import MAX_OPTIONS
from .progress import run as _in_worker
from .schedule import op_from_code

try:
    from ._solver import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "remat: the C solver (remat.solver._solver) is not built; run `pip install -e .` "
        f"in the remat source tree to compile it ({exc})"
    ) from exc

__all__ = ["Infeasible", "optimal", "least_memory", "MAX_TABLE_BYTES"]

# The solver refuses tables larger than this.
MAX_TABLE_BYTES = 2 * 2**30
# First guess at the op count; the C side says the exact need if it is short.
_FIRST_CAPACITY = 1 << 16


class Infeasible(RematError):
    """No persistent schedule fits the budget at this slot size."""


def _check_costs(costs):
    """The solver's bounds, which ``Costs`` enforces on creation, checked again here
    (as a ``SolverError``) on what reaches C without them: costs whose fields were
    set after creation, or an object that only looks like ``Costs``."""
    n = costs.length
    if n < 1:
        raise SolverError("remat: the chain has no stages; the solver needs at least one")
    for name in TIME_FIELDS:
        for i, v in enumerate(getattr(costs, name)):
            if not (math.isfinite(v) and 0 <= v <= MAX_SECONDS):
                raise SolverError(
                    f"remat: {where(name, i)} is {v}; the solver needs finite, "
                    f"non-negative times below 1e18 seconds"
                )
    for name in SIZE_FIELDS:
        leasts = least_bytes(name, costs.out_bytes)
        for i, v in enumerate(getattr(costs, name)):
            least = 0 if leasts is None else leasts[i]
            if not least <= v < MAX_BYTES:
                raise SolverError(
                    f"remat: {where(name, i)} is {v}; the solver needs sizes in "
                    f"{'-out_bytes' if least else '0'}..2^62"
                )
    for i, v in enumerate(getattr(costs, "bwd_rebuilt_less", None) or ()):
        if not 0 <= v <= costs.bwd_tmp[i] + costs.out_bytes[i]:
            raise SolverError(f"remat: {where('bwd_rebuilt_less', i)} is {v}; the solver needs 0..bwd_tmp + out_bytes")
    for i, v in enumerate(getattr(costs, "fwd_nograd_less", None) or ()):
        if not 0 <= v <= costs.fwd_tmp[i]:
            raise SolverError(f"remat: {where('fwd_nograd_less', i)} is {v}; the solver needs 0..fwd_tmp")
    if not 0 <= costs.input_bytes < MAX_BYTES:
        raise SolverError(f"remat: {where('input_bytes', None)} is {costs.input_bytes}; the solver needs 0..2^62")
    options = _options(costs)
    if len(options) != n:
        raise SolverError(f"remat: Costs.options has {len(options)} entries for {n} stages")
    for i, listed in enumerate(options):
        if len(listed) > MAX_OPTIONS:
            raise SolverError(f"remat: {where('options', i)} lists {len(listed)} options; the solver takes "
                              f"at most {MAX_OPTIONS} a stage")
        for q, o in enumerate(listed):
            for name, least, most, needs in (
                    ("fwd_time", 0, MAX_SECONDS, "finite, non-negative times below 1e18 seconds"),
                    ("bwd_time", 0, MAX_SECONDS, "finite, non-negative times below 1e18 seconds"),
                    ("saved_bytes", 0, MAX_BYTES - 1, "sizes in 0..2^62"),
                    ("fwd_tmp", 0, MAX_BYTES - 1, "sizes in 0..2^62"),
                    ("bwd_tmp", -costs.out_bytes[i], MAX_BYTES - 1, "sizes in -out_bytes..2^62")):
                v = getattr(o, name, None)
                if not (isinstance(v, (int, float)) and least <= v <= most):   # (False for NaN too)
                    raise SolverError(f"remat: {where(name, i, q)} is {v!r}; the solver needs {needs}")


def _options(costs):
    """``costs.options``, or none anywhere for an object that only looks like ``Costs``."""
    options = getattr(costs, "options", None)
    return ((),) * costs.length if options is None else options


def _chain(costs):
    """A remat_chain for ``costs``, with the arrays it points to kept alive."""
    keep = [
        ffi.new("double[]", list(costs.fwd_time)),
        ffi.new("double[]", list(costs.fwd_nograd_time)),
        ffi.new("double[]", list(costs.bwd_time)),
        ffi.new("long long[]", list(costs.out_bytes)),
        ffi.new("long long[]", list(costs.saved_bytes)),
        ffi.new("long long[]", list(costs.fwd_tmp)),
        ffi.new("long long[]", list(costs.bwd_tmp)),
    ]
    chain = ffi.new("remat_chain *")
    chain.length = costs.length
    (chain.fwd_time, chain.fwd_nograd_time, chain.bwd_time, chain.out_bytes,
     chain.saved_bytes, chain.fwd_tmp, chain.bwd_tmp) = keep
    chain.input_bytes = costs.input_bytes
    chain.output_held = costs.stages if getattr(costs, "output_held", False) else 0
    if any(costs.fwd_drop):   # NULL otherwise: nothing is dropped (solver.h)
        keep.append(ffi.new("long long[]", list(costs.fwd_drop)))
        keep.append(ffi.new("long long[]", list(costs.fwd_drop_whole)))
        chain.fwd_drop, chain.fwd_drop_whole = keep[-2:]
    for name in ("bwd_rebuilt_less", "fwd_nograd_less"):
        less = getattr(costs, name, None)
        if less and any(less):   # NULL otherwise: 0 everywhere (solver.h)
            keep.append(ffi.new("long long[]", list(less)))
            setattr(chain, name, keep[-1])
    options = _options(costs)
    if any(options):   # NULL otherwise: no stage has options (solver.h)
        first, listed = [0], [o for stage in options for o in stage]
        for stage in options:
            first.append(first[-1] + len(stage))
        keep.append(ffi.new("long long[]", first))
        keep += [ffi.new(kind + "[]", [getattr(o, name) for o in listed])
                 for kind, name in (("double", "fwd_time"), ("double", "bwd_time"), ("long long", "saved_bytes"),
                                    ("long long", "fwd_tmp"), ("long long", "bwd_tmp"))]
        (chain.option_first, chain.option_fwd_time, chain.option_bwd_time, chain.option_saved_bytes,
         chain.option_fwd_tmp, chain.option_bwd_tmp) = keep[-6:]
    return chain, keep


def _run(costs, budget, slots, mode, max_table_bytes):
    chain, keep = _chain(costs)
    n = costs.length
    capacity = min(_FIRST_CAPACITY, n * (n + 1) // 2 + 2 * n + 1)
    work = float(n) ** 3 * (slots if mode != lib.REMAT_MIN_MEMORY else 1)
    phase = "least memory" if mode == lib.REMAT_MIN_MEMORY else f"table of {n} stages x {slots} slots"
    control = ffi.new("remat_control *")
    for _ in range(2):
        codes = ffi.new("int[]", capacity)
        stages = ffi.new("int[]", capacity)
        options = ffi.new("int[]", capacity)
        plan = ffi.new("remat_plan *")
        plan.capacity, plan.codes, plan.stages, plan.options = capacity, codes, stages, options
        plan.control = control
        # (on a worker thread, stopped by Ctrl-C: remat/solver/progress.py Note [Stopping a solve])
        status = _in_worker(lambda: lib.remat_solve(chain, budget, slots, mode, max_table_bytes, plan),
                            control, work, phase)
        if status != lib.REMAT_E_CAPACITY:
            break
        capacity = plan.n_ops
    del keep
    if status == lib.REMAT_E_CANCELLED:   # (only when asked: the KeyboardInterrupt is on its way)
        raise KeyboardInterrupt
    if status == lib.REMAT_INFEASIBLE:
        raise Infeasible(f"remat: no persistent schedule fits {budget} bytes with {slots} slots")
    if status != lib.REMAT_OK:
        raise SolverError(_message(status, plan))
    ops = tuple(op_from_code(codes[i], stages[i], options[i]) for i in range(plan.n_ops))
    return ops, plan


def _message(status, plan):
    text = ffi.string(lib.remat_strerror(status)).decode()
    where = ""
    if status in (lib.REMAT_E_TIME, lib.REMAT_E_SIZE, lib.REMAT_E_OPTIONS) and plan.bad_stage >= 0:
        where = " (input_bytes)" if plan.bad_stage == 0 else f" (stage {plan.bad_stage})"
    return f"remat: the C solver failed: {text}{where} [status {status}]"


def optimal(costs, budget, slots, max_table_bytes=MAX_TABLE_BYTES):
    """Least-time persistent schedule of ``costs`` within ``budget`` bytes.

    Sizes are rounded up to slots of ``ceil(budget / slots)`` bytes and the
    budget down (remat/solver/solve.py Note [The recurrence]).

    Returns:
        (ops, dp_time, slot_bytes).

    Raises:
        Infeasible: no persistent schedule fits at this slot size.
        SolverError: invalid input, or the tables would be too large.
    """
    _check_costs(costs)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= MAX_BYTES:
        raise SolverError(f"remat: the solver's budget must be an int of bytes in 0..2^62, got {budget!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise SolverError(f"remat: slots must be a positive int, got {slots!r}")
    ops, plan = _run(costs, budget, slots, lib.REMAT_MIN_TIME, max_table_bytes)
    return ops, plan.time, plan.slot_bytes


def least_memory(costs, max_table_bytes=MAX_TABLE_BYTES):
    """The persistent schedule of ``costs`` that needs the least memory, exactly in bytes.

    Returns:
        (ops, min_budget_bytes).

    Raises:
        SolverError: invalid input, or the table would be too large.
    """
    _check_costs(costs)
    ops, plan = _run(costs, 0, 1, lib.REMAT_MIN_MEMORY, max_table_bytes)
    return ops, plan.min_budget
