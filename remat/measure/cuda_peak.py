"""The CUDA allocator's peak statistic, shared between remat's own measurements
and those who read a step's peak.

Note [Carrying the peak over]
-----------------------------
A call that measures (remat/measure/measuring.py) takes each stage's peaks
from the caching allocator: it resets the peak statistic
(``torch.cuda.reset_peak_memory_stats``) before a stage's forward or
backward and reads ``max_memory_allocated`` after. The statistic has no
setter, so each reset loses the peak the step had reached before it: read
at the step's end, ``max_memory_allocated`` gives only the peak since
remat's last reset (its last stage's runs, or a stage's backward measured
again in the call's backward), and a first call reads lower than it was,
often by the whole tail: the head's logits at the loss.

So remat resets it through ``reset_own``, which first carries the peak so
far over, per device; a reader of the whole step (``remat.measure_peak``,
the benchmarks' meters) starts with ``reset_reader`` and reads
``peak_allocated``: the most of what was carried and what the statistic
says now, as if remat had reset nothing. A raw ``max_memory_allocated()``
after a call that measures still reads low; docs/api.md says so.
"""

import torch

__all__ = ["peak_allocated", "reset_own", "reset_reader"]

_carried = {}   # device index -> the most the statistic read before remat's resets since a reader's


def _index(device):
    if device is None:
        return torch.cuda.current_device()
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def reset_own(device=None):
    """Reset the peak statistic of ``device`` (default: the current one) for one of
    remat's own measurements, carrying the peak so far over."""
    i = _index(device)
    _carried[i] = max(_carried.get(i, 0), torch.cuda.max_memory_allocated(i))
    torch.cuda.reset_peak_memory_stats(i)


def reset_reader(device=None):
    """A reader of the whole step starts here: the statistic is reset and nothing is carried."""
    i = _index(device)
    _carried.pop(i, None)
    torch.cuda.reset_peak_memory_stats(i)


def peak_allocated(device=None):
    """``max_memory_allocated`` since the last ``reset_reader``, remat's resets carried over."""
    i = _index(device)
    return max(_carried.get(i, 0), torch.cuda.max_memory_allocated(i))
