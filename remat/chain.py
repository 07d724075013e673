"""``remat.chain``: stage calls inside it form a chain that is measured once,
solved for the budget and then run on the schedule (docs/how-it-works.md, "The life of a chain").

Note [Chain keys]
-----------------
A chain is keyed by its call site (code object and line of the ``with``, or
the decorated function), the identity of its first stage (so two models of
one class do not share measurements), the signature of the first stage's
arguments (shape, dtype, device and requires_grad of every tensor, value of
small Python values), the first stage module's training flag and the
autocast state. A key seen before runs its schedule; a new budget re-solves
from the cached costs; a new key measures. While running, each stage is
checked against the chain's record (same stage object, input shape, side inputs
by signature, training flags of its module and submodules, autocast state,
parameters' dtypes and requires_grad; the module of a stage the plan records
whole at the call's end, Note [Stages recorded whole] in remat/runtime/runner.py): if
the chain takes another path, the rest of it is measured again and the
record replaced (a path changing from call to call is measured on every
call: warned of, remat/runtime/runner.py ``_path_changed``). At most ``CACHE_SIZE``
keys are kept (least recently used first out).
"""

import functools
import os
import sys
import threading
from typing import NamedTuple

from .budget import parse_budget
from .runtime.chain_call import CACHE_SIZE, ChainCall, clear_cache
from .dynamo import skip_for_dynamo
from .errors import StageError
from .explanation import LatestExplanation, explain
from .solver.solve import DEFAULT_SLOTS, _parse_algorithm, check_slots

__all__ = ["chain", "ChainHints", "explain", "CACHE_SIZE", "clear_cache"]

_local = threading.local()


def active():
    """The chain being recorded or run on this thread, or None."""
    return getattr(_local, "active", None)


class ChainHints(NamedTuple):
    """What a chain opened by ``remat.wrap`` or ``remat.Sequential`` adds to its
    messages, where the user did not write the ``with remat.chain`` block."""
    empty: str = None    # to the warning that the chain ran no stage
    split: str = None    # to the error that a stage's input is not the stage before's output
    nested: str = None   # to the error that chains cannot be nested


class chain:
    """Stage calls inside form a chain run under a memory budget.

    Use it as a context manager around the loop that calls the stages, or
    as a decorator of a function that calls them.

    Args:
        budget: activation memory allowed, as an int of bytes, a string
            with a unit ("900MB", "1.5GiB") or "auto" (free device memory
            less 10%).
        algorithm: "optimal" (default), "store_all", "min_memory", "sqrt"
            or "periodic(k)".
        slots: memory resolution of the optimal solver.
        costs: path of a JSON file of measured costs. If it exists, the first
            call uses those costs instead of timing the stages (it still runs
            each stage once to learn what to replay); if not, the measured
            costs are written there. Under torch.distributed every rank uses
            rank 0's costs, so all ranks run the same schedule.
        hints: a ``ChainHints`` (for ``remat.wrap`` and ``remat.Sequential``).

    Raises:
        BudgetError: malformed budget (at once), or a budget below the
            chain's minimum (at the end of the first call; the message gives
            the minimum). Nothing is lost: the model, RNG and BatchNorm state
            are as before the call and the next call re-solves without
            measuring again.
        StageError: misuse inside the chain (the message names the stage).

    Example:
        >>> import torch, remat
        >>> lin = remat.stage(torch.nn.Linear(4, 4))
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with remat.chain(budget="1MiB"):
        ...     y = lin(lin(x))
        >>> y.sum().backward()
    """

    last = LatestExplanation()   # (read on the class: remat.chain.last)

    def __init__(self, budget="auto", algorithm="optimal", slots=DEFAULT_SLOTS, costs=None, *, hints=None):
        self.settings = (budget, algorithm, slots, costs)   # as given
        self.hints = hints if hints is not None else ChainHints()
        self.budget = parse_budget(budget)
        if costs is not None and not isinstance(costs, (str, os.PathLike)):
            raise TypeError(f"remat: costs must be a path to a JSON file, got {type(costs).__name__}")
        self.costs_path = costs
        _parse_algorithm(algorithm, 1)
        check_slots(slots)
        self.algorithm = algorithm
        self.slots = slots
        self._site = None

    def __enter__(self):
        skip_for_dynamo()
        current = active()
        if current is not None:
            where = (f"inside stage {current.k} of the open chain, whose inner stages "
                     f"then run as its plain code (mark the inner blocks as the outer chain's stages "
                     f"instead, to have them managed)" if current.in_stage else
                     "between the open chain's stages, whose stages then join it" if current.k else
                     "before the open chain's first stage, whose stages then join it")
            nested = self.hints.nested or current.spec.hints.nested
            raise StageError(
                f"remat: chains cannot be nested; a chain is already open on this thread. Remove the "
                f"inner remat.chain ({where}) or close the outer one first" + (f". {nested}" if nested else "")
            )
        site = self._site
        if site is None:
            frame = sys._getframe(1)
            site = (frame.f_code, frame.f_lineno)
        _local.active = ChainCall(self, site)
        return self

    def __exit__(self, exc_type, exc, tb):
        current = _local.active
        _local.active = None
        if exc_type is None:
            current.finish()
        return False

    def __call__(self, fn):
        spec = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            inner = chain.__new__(chain)
            inner.__dict__.update(spec.__dict__)
            inner._site = (fn.__code__ if hasattr(fn, "__code__") else fn, 0)
            with inner:
                return fn(*args, **kwargs)

        return wrapper
