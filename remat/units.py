"""Byte counts for people: parsing "1.5GiB" and printing 1610612736 as "1.50 GiB";
and the bytes free on a device."""

import math
import re

import torch

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text):
    """Parse "900MB", "1.5GiB", "2e9" or "4096" into an int number of bytes (a
    budget's text: ``parse_budget`` in remat/chain.py reads "auto" first).

    Raises:
        ValueError: the text is not a number with a known unit (a percentage said as such).
    """
    if text.strip().endswith("%"):   # (the demo reads a share of storing everything: remat/tools/demo.py)
        raise ValueError(
            "a percentage is not a budget here; give the activation memory to allow: an int of bytes, a size such "
            "as '2GiB' or '900MB', or 'auto' (the device's free memory less a margin). A share of storing "
            "everything ('40%') is read only by remat's demo (python -m remat demo --budget 40%)")
    match = _PATTERN.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write an int of bytes or a number "
            f"with a unit such as '900MB', '1.5GiB' or '512MiB'"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"size {text!r} is not finite")
    if _UNITS[match.group(2).lower()] == 1 and not value.is_integer():
        raise ValueError(
            f"{text!r} is a fraction of a byte; give a unit ('{match.group(1)}GiB', '{match.group(1)}MB') "
            f"or an int of bytes")
    return int(value)


def format_bytes(n):
    """Format a byte count with a binary unit: 1536 -> '1.50 KiB'."""
    n = int(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def free_memory(device):
    """Bytes free on ``device`` now (CUDA: the driver's count; CPU: available RAM)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil
    return int(psutil.virtual_memory().available)
