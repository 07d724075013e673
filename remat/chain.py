"""``remat.chain``: stage calls inside it form a chain that is measured once,
solved for the budget and then run on the schedule (docs/how-it-works.md, "The
life of a chain"). Here too: budgets, as a user writes them (an int of bytes,
"1.5GiB", "auto") and what they mean in bytes on a device; and what remat
knows about a chain after a call (``remat.explain()``, ``remat.chain.last``).

Note [Chain keys]
-----------------
A chain is keyed by its call site (code object and line of the ``with``, or the
decorated function), the identity of its first stage (so two models of one class
do not share measurements), the signature of the first stage's arguments (shape,
dtype, device, requires_grad and layout of every tensor, value of small Python
values), the first stage module's training flag and the autocast state. A key
seen before runs its schedule; a new budget re-solves from the cached costs; a
new key measures. While running, each stage is checked against the chain's
record (same stage object, input shape and layout, side inputs by signature,
training flags of its module and submodules, autocast state, parameters' dtypes
and requires_grad; the module of a stage the plan records whole as the call
opens, Note [Stages recorded whole] in remat/runtime/runner.py): if the chain
takes another path, the rest of it is measured again and the record replaced,
unless a record of that path is kept or the call skipped stages (a path changing
to new ones on every call is warned of: remat/runtime/paths.py, and
remat/runtime/skips.py). A call that stops short of the recorded stages (a depth
that alternates, an early exit) runs the plan's prefix and keeps the record:
alternating depths are measured once, on the longer path; a second call in a row
that stops at the same stage (or a fourth that stops short anywhere) drops it,
for the shorter path to be measured and planned on its own (three depths in turn
are measured once too). At most ``CACHE_SIZE`` keys are kept (least recently
used first out).
"""

import functools
import os
import sys
import threading
import warnings
from typing import NamedTuple

import torch

from .dynamo import DYNAMO_SKIPS
from .errors import BudgetError, StageError, UsageError
from .measure.holding import least_budget
from .measure.options import keeps_said
from .runtime.chain_call import CACHE_SIZE, ChainCall, clear_cache, measuring_peaks
from .runtime.paths import path_lines
from .solver.schedule import Loss
from .solver.solve import DEFAULT_SLOTS, _parse_algorithm, check_slots
from .units import format_bytes, free_memory, parse_bytes

__all__ = ["chain", "ChainHints", "Explanation", "explain", "CACHE_SIZE", "clear_cache", "parse_budget",
           "resolve_budget", "AUTO_MARGIN"]

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
    elif not isinstance(budget, bool) and hasattr(type(budget), "__index__"):   # (an int, numpy's int64)
        value = budget.__index__()
    else:
        if isinstance(budget, float):
            raise BudgetError(f"remat: budget {budget!r} is a float; give an int of bytes or a string with a unit, "
                              f"e.g. '1.5GiB'")
        bare = ("; as a decorator, remat.chain takes its settings first: @remat.chain(budget='2GiB'), or "
                "@remat.chain() for 'auto'" if callable(budget) else "")
        raise BudgetError(f"remat: budget must be an int of bytes, a string such as '900MB' or '1.5GiB', or 'auto'; "
                          f"got {type(budget).__name__} {budget!r}{bare}")
    if value <= 0:
        raise BudgetError(f"remat: budget must be positive, got {budget!r}; give the activation memory to allow")
    if value >= 2**62:
        raise BudgetError(f"remat: budget {budget!r} is beyond any device; check the unit")
    return value


def total_memory(device):
    """Bytes of memory ``device`` has in all (CUDA: the device's; CPU: the machine's RAM)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil
    return int(psutil.virtual_memory().total)


_warned_over = set()   # (budget, device) pairs warned of as beyond the device
NO_LIMIT = 2**60         # a budget this large or larger means "no limit" (remat's own probes): not warned of


def resolve_budget(budget, device):
    """Bytes for a parsed budget; "auto" is the free memory of ``device`` less AUTO_MARGIN.
    A budget beyond the device's memory in all is warned of, once per device, but
    one of ``NO_LIMIT`` or more."""
    if budget != "auto":
        key = (budget, str(device))
        if key not in _warned_over and budget < NO_LIMIT:
            if len(_warned_over) > 64:
                _warned_over.clear()
            _warned_over.add(key)
            total = total_memory(device)
            if budget > total:
                warnings.warn(
                    f"remat: budget {format_bytes(budget)} is more than the {format_bytes(total)} the "
                    f"{torch.device(device).type} device has in all, so it bounds nothing: check the unit "
                    f"('900MB', not '900GB'), or give 'auto' for what is free", RuntimeWarning, stacklevel=4)
        return budget
    return max(1, int(free_memory(device) * (1 - AUTO_MARGIN)))


_last = [None]   # the Explanation of the latest chain call


class Explanation:
    """What remat knows about one chain: costs, budget, schedule.

    ``costs`` are those the schedule was solved on, the chain's tail (the head and loss
    after its last stage) their last stage (``Costs.tail``); ``measured`` those the
    chain measured (or read), as its costs file holds them. They differ by the tail and
    by the chain's output, counted in ``held_bytes`` while the code around the chain may
    hold it through the backward (Note [The chain's output],
    remat/measure/chain_record.py). ``tail`` is what the measuring call saw of the tail
    (``TailSeen``, Note [The chain's tail] in remat/measure/tail.py) or None,
    ``predicted_peak`` the schedule's whole-step peak in bytes, the backward of the code
    before the chain included (Note [The code before the chain],
    remat/measure/linger.py; None without a schedule), ``times`` where the stages' times
    come from (first-call estimates, or how many calls refined them), ``held`` what
    ``held_bytes`` is, {words: bytes}, as the chain's record (``record``) says, and
    ``least_budget`` the least budget."""

    def __init__(self, costs, schedule, budget, names, measured=None, record=None):
        self.costs, self.schedule, self.budget, self.names = costs, schedule, budget, names
        self.measured = costs if measured is None else measured
        self.tail = record.tail if record is not None else None
        self._record = record   # (``times`` and ``held`` are asked of it when read: not on every call)
        self.measured_peak = None   # set by a ``remat.measure_peak`` block around the step

    times = property(lambda self: self._record.times_said(self.measured) if self._record is not None else None,
                     doc="Where the stages' times come from, in words, or None.")

    @property
    def held(self):
        """What ``held_bytes`` counts, {words: bytes}."""
        return self._record.held_parts() if self._record is not None else {}

    @property
    def least_budget(self):
        """The least budget in bytes every call runs under, the measuring one too (remat/measure/holding.py)."""
        return max(least_budget(self.costs, self.measured, self._record), self._end)

    predicted_peak = property(lambda self: max(self.schedule.peak, self._end) if self.schedule is not None else None,
                              doc="The schedule's predicted whole-step peak in bytes, or None.")
    # (the step's need after the chain's backward: ``ChainRecord.step_end``)
    _end = property(lambda self: self._record.step_end(self.costs) if self._record is not None else 0)

    def table(self):
        """Per-stage costs and the op each stage gets in the forward phase ("Fall:o1"
        for a ``Fall`` recording with option 1, Note [Options]), each option of a
        stage on a line of its own below it ("o1"), with what it keeps."""
        ops = self.schedule.ops[:self.schedule.ops.index(Loss)] if self.schedule is not None else []
        policies = self._record.policies() if self._record is not None else []
        modes = [f"Fall:o{op.option}" if getattr(op, "option", 0) else type(op).__name__ for op in ops]
        lines = self.costs.table().splitlines()
        out, i = [lines[0] + "  forward   name"], 0
        for line in lines[1:]:
            first = line.split()[0]
            if first == "tail":   # (Note [The chain's tail], remat/measure/tail.py)
                out.append(f"{line}  {'Fall':<8}  (after the last stage: head, loss)")
                continue
            if first == "kept" and self.held:   # (the tail's kept bytes: listed under held)
                continue
            if not first.isdigit():   # the input's, the held bytes' and the options' lines
                q = int(first[1:]) if first[0] == "o" and first[1:].isdigit() else 0
                listed = policies[i] if q and i < len(policies) else ()
                out.append(line if not q else f"{line}  {'':<8}  {keeps_said(listed[q - 1] if q <= len(listed) else q)}")
                if first == "held":
                    out.extend(f"{'':>5}  -{format_bytes(n):>11} {what}" for what, n in self.held.items())
                continue
            i = int(first) - 1
            mode = modes[i] if i < len(modes) else "-"
            out.append(f"{line}  {mode:<8}  {self.names[i] if i < len(self.names) else ''}")
        return "\n".join(out)

    def __str__(self):
        head = f"remat chain of {self.costs.stages} stages, budget {format_bytes(self.budget)}"
        if self.times is not None:
            head += f"\n{self.times}"
        if self.tail is not None:
            head += f"\n{self.tail}"
        if self.schedule is None:
            return head + "\n" + self.table()
        summary = self.schedule.summary()
        if getattr(self.schedule, "grouping", None) is not None:   # (remat/solver/group.py Note [Groups])
            summary += f"\n{self.schedule.grouping}"
        if self._end > self.schedule.peak:   # (Note [The code before the chain], remat/measure/linger.py)
            summary += f"\nthe step peaks at {format_bytes(self._end)} after the chain's backward, in the code " \
                "before it"
        if self.measured_peak is not None:
            summary += f"\nmeasured peak {format_bytes(self.measured_peak)} (remat.measure_peak)"
        if self._record is not None:   # (Note [Paths of a chain], remat/runtime/paths.py; [Skipped stages], skips.py)
            summary += path_lines(self._record, self.schedule, self.budget)
        return f"{head}\n{summary}\n{self.table()}\nschedule:\n{self.schedule}"


def explain():
    """The ``Explanation`` of the latest chain call, or None before any.

    Example:
        >>> import remat
        >>> remat.explain() is None or hasattr(remat.explain(), "schedule")
        True
    """
    return _last[0]


def publish(explanation):
    """Make ``explanation`` the latest chain call's."""
    _last[0] = explanation
    if measuring_peaks:
        measuring_peaks[-1].published(explanation)


class LatestExplanation:
    """``remat.chain.last``: the ``Explanation`` of the latest chain call, read on
    the class or an instance (as ``explain()``)."""

    def __get__(self, obj, owner=None):
        return _last[0]


_local = threading.local()
_skips_done = [False]


def _skip_for_dynamo():
    """Mark ``DYNAMO_SKIPS`` for Dynamo to skip, once, if Dynamo is loaded (Note
    [Compiling a model around a chain], remat/dynamo.py)."""
    if _skips_done[0] or "torch._dynamo" not in sys.modules:
        return
    _skips_done[0] = True
    from torch._dynamo.decorators import skip
    for fn in DYNAMO_SKIPS:
        skip(fn)


def active():
    """The chain being recorded or run on this thread, or None."""
    return getattr(_local, "active", None)


_checked = set()   # (algorithm, slots) pairs found valid: a model opens a chain every forward


def _check_settings(algorithm, slots):
    """Raise unless ``algorithm`` and ``slots`` are what the solver takes (once per pair)."""
    key = (algorithm, slots) if type(algorithm) is str and type(slots) is int else None
    if key is not None and key in _checked:
        return
    _parse_algorithm(algorithm, 1)
    check_slots(slots)
    if key is not None:
        if len(_checked) > 64:
            _checked.clear()
        _checked.add(key)


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
        options: True: plan each stage's options where they pay, recording it
            with the outputs of its matmuls, convolutions and attention kernels
            (all, those autograd saves, or the costliest per byte) and the rest
            recomputed in its backward (docs/how-it-works.md, "Options"); False:
            each stage recorded whole or not at all; "auto" (default): True on CUDA.
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
    NO_LIMIT = NO_LIMIT          # (remat.chain.NO_LIMIT: a budget meaning "no limit")

    def bytes_on(self, device):
        """This chain's budget in bytes on ``device`` ("auto": its free memory less ``AUTO_MARGIN``)."""
        return resolve_budget(self.budget, device)

    @staticmethod
    def explained(costs, schedule, budget, names, measured, record=None):
        """Make what a call of a chain knows (``Explanation``'s arguments) what ``explain()`` shows."""
        publish(Explanation(costs, schedule, budget, names, measured, record))

    def __init__(self, budget="auto", algorithm="optimal", slots=DEFAULT_SLOTS, costs=None, *, options="auto",
                 hints=None):
        self.settings = (budget, algorithm, slots, costs, options)   # as given
        if type(options) is not bool and options != "auto":
            raise UsageError(f"remat: options must be True (plan each stage's option 1, the outputs of matmuls, "
                            f"convolutions and attention kept and the rest recomputed, where it pays), False "
                            f"(each stage recorded whole or not at all) or 'auto' (True on CUDA, False "
                            f"elsewhere), got {options!r}")
        self.options = options
        self.hints = hints if hints is not None else ChainHints()
        self.budget = parse_budget(budget)
        if costs is not None and not isinstance(costs, (str, os.PathLike)):
            raise UsageError(f"remat: costs must be a path to a JSON file, got {type(costs).__name__}")
        self.costs_path = costs
        _check_settings(algorithm, slots)
        self.algorithm = algorithm
        self.slots = slots
        self._site = None

    def __enter__(self):
        _skip_for_dynamo()
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
        else:
            current.abort(exc)
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
