"""The exception family: every error remat raises is a ``RematError``."""

__all__ = [
    "RematError",
    "BudgetError",
    "CostsError",
    "InvalidScheduleError",
    "SolverError",
    "StageError",
    "RecomputeMismatchError",
]


class RematError(Exception):
    """Base class of every error raised by remat."""


class BudgetError(RematError, ValueError):
    """The memory budget is malformed or below what the chain needs."""


class CostsError(RematError, ValueError):
    """A ``Costs`` record is malformed (names the field and the stage)."""


class InvalidScheduleError(RematError, ValueError):
    """A schedule breaks the op rules (a value used before it exists, ...)."""


class SolverError(RematError, RuntimeError):
    """The C solver refused the input or could not allocate its tables."""


class StageError(RematError, RuntimeError):
    """A stage or a chain was misused (names the stage and the fix)."""


class RecomputeMismatchError(RematError, RuntimeError):
    """A recomputation did not save what the first forward saved."""


def input_modified(index, name):
    """The StageError for stage ``index`` (``name``) writing its input in place."""
    return StageError(
        f"remat: stage {index} ({name}) modified its input in place (e.g. a ReLU(inplace=True) as "
        f"its first op); remat needs the input unchanged to recompute the stage. Make that op out of "
        f"place or move it to the end of stage {index - 1}")
