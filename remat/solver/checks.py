"""How ``Costs`` checks its numbers, and how its errors name an entry (a stage's,
or one of a stage's options'): shared by remat/solver/costs.py, option.py and
binding.py. And the checks of the solver's other arguments (costs, schedules,
budgets, Costs.uniform's and with_*'s), which say what was given and what to give."""

import collections.abc
import math
import numbers
import os
import reprlib

from ..errors import BudgetError, CostsError, InvalidScheduleError, UsageError

__all__ = ["MAX_SECONDS", "MAX_BYTES", "where", "least_bytes", "entries", "check_time", "check_size", "file_path",
           "check_costs", "schedule_ops", "check_schedule", "check_bound_budget", "check_uniform", "check_number",
           "check_numbers", "stage_options", "less_field", "drops_field"]

# The C solver's bounds (src_c/solver.c), which Costs enforces on creation and
# binding.py checks again: below them its sums of times stay finite and its
# sums of sizes fit a long long.
MAX_SECONDS = 1e18
MAX_BYTES = 2**62


def where(name, i, option=None):
    """How an error names a field's entry: ``Costs.name[i] (stage i+1)``, or
    ``Costs.name`` for a chain-wide field (i None); with ``option`` (0-based in
    the stage's list), the field of that option:
    ``Costs.options[i][option].name (stage i+1, option option+1)``."""
    if option is not None:
        return f"Costs.options[{i}][{option}].{name} (stage {i + 1}, option {option + 1})"
    return f"Costs.{name}" if i is None else f"Costs.{name}[{i}] (stage {i + 1})"


def least_bytes(name, out_bytes):
    """The least value of each entry of size field ``name``, stage by stage: a
    backward may give back its stage's output (``bwd_tmp`` down to
    ``-out_bytes``); None where it is 0 throughout (every other size)."""
    return [-o for o in out_bytes] if name == "bwd_tmp" else None


def entries(name, raw, length=None):
    """A per-stage field as a tuple: from a list, a tuple or another sequence of
    numbers (a NumPy array), not from a mapping, a set or a string; ``length``
    entries if given."""
    if isinstance(raw, (str, bytes, collections.abc.Mapping, collections.abc.Set)):
        raise CostsError(f"remat: Costs.{name} must be a list with one entry per stage, got {type(raw).__name__}")
    try:
        values = tuple(raw)
    except TypeError:
        raise CostsError(f"remat: Costs.{name} must be a list with one entry per stage, "
                         f"got {type(raw).__name__}") from None
    if length is not None and len(values) != length:
        raise CostsError(
            f"remat: Costs.{name} has {len(values)} entries but fwd_time has {length}; "
            f"every per-stage list needs one entry per stage"
        )
    return values


def check_time(name, i, v, option=None):
    """``v`` as a float of seconds, or a ``CostsError`` naming the entry."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise CostsError(f"remat: {where(name, i, option)} must be a number of seconds, got {v!r}")
    if isinstance(v, numbers.Integral) and v > MAX_SECONDS:   # (float() of a huge int overflows)
        raise CostsError(f"remat: {where(name, i, option)} is {len(str(v))} digits of seconds, beyond any real run; "
                         f"check the unit")
    v = float(v)
    if not math.isfinite(v) or v < 0:
        raise CostsError(f"remat: {where(name, i, option)} is {v}; times must be finite and non-negative")
    if v > MAX_SECONDS:
        raise CostsError(f"remat: {where(name, i, option)} is {v} seconds, beyond any real run; check the unit")
    return v


def check_size(name, i, v, least=0, option=None):
    """``v`` as an int of bytes, at least ``least`` (below 0 only for ``bwd_tmp``),
    or a ``CostsError`` naming the entry."""
    at = where(name, i, option)
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        v = int(v)   # (a NumPy integer)
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and v >= least:
            v = int(v)
        elif least:
            raise CostsError(f"remat: {at} must be an int of bytes, got {v!r}")
        else:
            raise CostsError(f"remat: {at} must be a non-negative int of bytes, got {v!r}")
    if v < least:
        if least:
            raise CostsError(f"remat: {at} is {v}; it may give back the stage's output "
                             f"({-least} bytes, out_bytes) but no more")
        raise CostsError(f"remat: {at} is {v}; sizes must be non-negative")
    if v >= MAX_BYTES:
        raise CostsError(f"remat: {at} is {v} bytes, beyond any real device; check the unit")
    return int(v)


def file_path(path):
    """``path`` if it is a file's path (open() takes an int for a file descriptor: 1, stdout, closed)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise CostsError(f"remat: a costs file is given by its path (a str or os.PathLike), not {type(path).__name__} "
                         f"{path!r}")
    return path


def _shown(value):
    """``value`` for a message: its type and a short repr."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def check_costs(costs, who):
    """``costs`` if it is a ``remat.Costs``; else a ``UsageError`` naming ``who`` (the
    function, "solve"), what was given and how to get costs."""
    from .costs import Costs   # (costs.py imports this module)
    if not isinstance(costs, Costs):
        made = "Costs.from_dict(d) for a dict of its fields, " if isinstance(costs, collections.abc.Mapping) else ""
        raise UsageError(f"remat: {who} needs a remat.Costs, got {_shown(costs)}; get one from remat.explain().costs "
                         f"after a chain's call, Costs.load(path), {made}or Costs.uniform(n) to try things")
    return costs


def schedule_ops(schedule, who, what="a Schedule or a list of ops"):
    """The ops of ``schedule`` (a ``Schedule``, or a list or other iterable of ops) as a
    tuple. Not a sequence (None, a string, a mapping, a set): a ``UsageError`` naming
    ``who`` (the argument) and ``what`` it must be; an entry that is not an op: an
    ``InvalidScheduleError``."""
    from .ops import _LossOp, _StageOp
    from .schedule import Schedule   # (schedule.py imports this module)
    if isinstance(schedule, Schedule):
        return schedule.ops
    if isinstance(schedule, (str, bytes, collections.abc.Mapping, collections.abc.Set)) or not isinstance(
            schedule, collections.abc.Iterable):
        names = " (ops are objects such as Fall(1), not their names)" if isinstance(schedule, (str, bytes)) else ""
        raise UsageError(f"remat: {who} must be {what}, got {_shown(schedule)}{names}; get a "
                         f"Schedule from remat.solve(costs, budget) or remat.explain().schedule, or list ops in "
                         f"order, e.g. [Fall(1), Loss, B(1)]")
    ops = tuple(schedule)
    for pos, op in enumerate(ops):
        if not isinstance(op, (_StageOp, _LossOp)):
            shown, fix = (op.__name__, f": write {op.__name__}(stage)") if isinstance(op, type) else (op, "")
            raise InvalidScheduleError(f"remat: op {pos} ({shown}) of the schedule is invalid: not an op (use Fn, Fck, "
                                       f"Fall, B or Loss){fix}")
    return ops


# Schedule's fields but its ops: (name, what it must be an instance of, what to give)
_SCHEDULE_FIELDS = (("time", numbers.Real, "a number of seconds"), ("peak", numbers.Integral, "an int of bytes"),
                    ("algorithm", str, "a str"), ("budget", (numbers.Integral, type(None)), "None or an int of bytes"),
                    ("slot_bytes", (numbers.Integral, type(None)), "None or an int of bytes"),
                    ("tail", bool, "True or False"))


def check_schedule(schedule):
    """A ``Schedule``'s ops as a tuple (``schedule_ops``), its other fields checked
    (a ``UsageError`` naming the field)."""
    for name, kinds, what in _SCHEDULE_FIELDS:
        value = getattr(schedule, name)
        if not isinstance(value, kinds) or (isinstance(value, bool) and name != "tail"):
            raise UsageError(f"remat: Schedule's {name} must be {what}, got {_shown(value)}")
    return schedule_ops(schedule.ops, "Schedule's ops", "a list of ops (Fn, Fck, Fall, B, Loss)")


def check_bound_budget(budget):
    """``time_bound``'s budget: a number of bytes (below what anything needs: inf),
    not NaN, inf, a string or None."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not math.isfinite(budget):
        raise BudgetError(f"remat: time_bound's budget must be a finite number of bytes (an int), got {_shown(budget)}")
    return budget


def check_number(value, name, what="a number of seconds", kinds=numbers.Real):
    """``value`` if it is a number (of ``kinds``, not a bool), else a ``CostsError`` naming
    ``name`` (the argument) and ``what`` to give; its range is for ``Costs`` to check."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise CostsError(f"remat: {name} must be {what}, got {_shown(value)}")
    return value


def check_uniform(length, time, nograd_time):
    """``Costs.uniform``'s number of stages and times (the times' range is for
    ``Costs`` to check, stage by stage)."""
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 0:
        raise CostsError(f"remat: Costs.uniform needs a number of stages (an int >= 0), got {length!r}")
    check_number(time, "Costs.uniform's time", "a number of seconds (each stage's forward)")
    if nograd_time is not None:
        check_number(nograd_time, "Costs.uniform's nograd_time", "None or a number of seconds")


def check_numbers(who, what, **values):
    """Each of ``values`` (an argument of ``who``, by name) checked by ``check_number``."""
    for name, value in values.items():
        check_number(value, f"{who}'s {name}", what)


def stage_options(options):
    """``Costs.with_options``'s argument as a dict (stage number -> its list of ``Option``)."""
    try:
        if isinstance(options, (str, bytes)):
            raise TypeError
        return dict(options)
    except (TypeError, ValueError):
        raise CostsError(f"remat: with_options takes a dict of stage numbers (1-based) to lists of remat.Option, "
                         f"e.g. {{2: [Option(...)]}}, got {_shown(options)}") from None


def less_field(name, raw, length, field, more):
    """``bwd_rebuilt_less`` (``field``: bwd_tmp, ``more``: out_bytes) or
    ``fwd_nograd_less`` (``field``: fwd_tmp) checked: 0 to ``field`` (plus ``more``:
    a rebuilt B(i)'s transient is still at least ``-out_bytes``); None: 0 everywhere."""
    if raw is None:
        return (0,) * length
    checked = tuple(check_size(name, i, v) for i, v in enumerate(entries(name, raw, length)))
    for i, v in enumerate(checked):
        most = field[i] + (more[i] if more else 0)
        if v > most:
            raise CostsError(
                f"remat: {where(name, i)} is {v}; it must be at most the stage's "
                f"{'bwd_tmp plus its out_bytes' if more else 'fwd_tmp'} ({most}): "
                f"{'a rebuilt B(i) holds at least that' if more else 'a transient is not negative'}")
    return checked


def drops_field(name, raw, length, bound):
    """``fwd_drop`` (``bound``: out_bytes) or ``fwd_drop_whole`` (``bound``:
    fwd_drop) checked; None: nothing dropped."""
    if raw is None:
        return (0,) * length
    checked = tuple(check_size(name, i, v) for i, v in enumerate(entries(name, raw, length)))
    for i, v in enumerate(checked):
        bad = v > bound[i] if name == "fwd_drop" else v not in (0, bound[i])
        if bad or (v and i == length - 1):
            what = "at most the stage's out_bytes" if name == "fwd_drop" else "0 or the stage's fwd_drop"
            raise CostsError(
                f"remat: {where(name, i)} is {v}; it must be {what} ({bound[i]}), and 0 for "
                f"the last stage (no stage after it lets a^L go)")
    return checked
