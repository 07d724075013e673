"""remat: train PyTorch models that do not fit in memory by recomputing
activations on an optimal schedule for a memory budget you choose."""

import torch as _torch

from .torch_version import require_torch as _require_torch

_require_torch(_torch.__version__)

from .chain import chain, clear_cache, explain
from .solver.costs import Costs
from .solver.option import Option
from .errors import (BudgetError, CostsError, InvalidScheduleError, RecomputeMismatchError, RematError,
                     SolverError, StageError, UsageError)
from .solver.schedule import B, Fall, Fck, Fn, Loss, Schedule, simulate
from .measure.peak import measure_peak
from .sequential import Sequential
from .solver.solve import solve
from .stage import stage
from .wrap import unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "stage", "chain", "Sequential", "wrap", "unwrap",
    "explain", "measure_peak", "clear_cache", "solve", "simulate", "Costs", "Option", "Schedule",
    "Fn", "Fck", "Fall", "B", "Loss",
    "RematError", "BudgetError", "CostsError", "InvalidScheduleError", "SolverError", "StageError",
    "RecomputeMismatchError", "UsageError",
]
