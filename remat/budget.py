"""Budgets: what a user may write (an int of bytes, "1.5GiB", "auto") and
what it means in bytes on a device."""

import torch

from .errors import BudgetError
from .units import parse_bytes

__all__ = ["parse_budget", "resolve_budget", "AUTO_MARGIN"]

# "auto" keeps this fraction of the free memory for everything that is not
# chain activations (parameters, gradients, optimizer state, the allocator).
AUTO_MARGIN = 0.10


def parse_budget(budget):
    """Check a budget as written: returns an int of bytes or the string "auto".

    Raises:
        BudgetError: not an int, a size string or "auto", or not positive.
    """
    if isinstance(budget, str):
        if budget.strip().lower() == "auto":
            return "auto"
        try:
            value = parse_bytes(budget)
        except ValueError as exc:
            raise BudgetError(f"remat: budget {budget!r}: {exc}") from None
    elif isinstance(budget, bool) or not isinstance(budget, int):
        if isinstance(budget, float):
            raise BudgetError(
                f"remat: budget {budget!r} is a float; give an int of bytes or a string with a unit, e.g. '1.5GiB'"
            )
        raise BudgetError(
            f"remat: budget must be an int of bytes, a string such as '900MB' or '1.5GiB', or 'auto'; "
            f"got {type(budget).__name__} {budget!r}"
        )
    else:
        value = budget
    if value <= 0:
        raise BudgetError(f"remat: budget must be positive, got {budget!r}; give the activation memory to allow")
    if value >= 2**62:
        raise BudgetError(f"remat: budget {budget!r} is beyond any device; check the unit")
    return value


def free_memory(device):
    """Bytes free on ``device`` now (CUDA: the driver's count; CPU: available RAM)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def resolve_budget(budget, device):
    """Bytes for a parsed budget; "auto" is the free memory of ``device`` less AUTO_MARGIN."""
    if budget != "auto":
        return budget
    return max(1, int(free_memory(device) * (1 - AUTO_MARGIN)))
