"""How ``Costs`` checks its numbers, and how its errors name an entry (a stage's,
or one of a stage's options'): shared by remat/solver/costs.py, option.py and
binding.py."""

import collections.abc
import math
import numbers
import os

from ..errors import CostsError

__all__ = ["MAX_SECONDS", "MAX_BYTES", "where", "least_bytes", "entries", "check_time", "check_size", "file_path"]

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
