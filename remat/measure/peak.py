"""``remat.measure_peak()``: a training step's peak, measured as users measure it,
and each chain's beside its predicted one (``explain().measured_peak``).

Note [Measuring the peak]
-------------------------
The budget is the whole step's peak above what was resident when the chain
opened (docs/how-it-works.md, "The tail"). Checking it takes a meter no later
call should pay for, so it is the user's to open around a step:

    with remat.measure_peak() as m:
        loss_fn(model(x)).backward()
    m.peak, remat.explain().measured_peak, remat.explain().predicted_peak

On CUDA the meter is the caching allocator's statistics (the peak statistics
are reset where the block opens and where each chain opens: a caller's own
``max_memory_allocated`` reads from there; what remat's own measurements
reset is carried over, Note [Carrying the peak over] in
remat/measure/cuda_peak.py); elsewhere it is the exact meter of
live tensor storages the measuring call uses (remat/measure/meter.py), a
dispatch mode that slows every op while it is open. The block's peak counts
from its start; a chain's from where it opened to the block's end, its
backward included, and counts the chain's input as the budget does (made
before or not); it goes to the ``Explanation`` that chain's call
published (the latest, if the step called it more than once). The budget
leaves out the parameters' gradients, counting them resident: a step that
makes them (a model's first, or every step after
``zero_grad(set_to_none=True)``, PyTorch's default) measures them on top, so
compare with the budget a step whose gradients were there before it
(``zero_grad(set_to_none=False)``).
"""

import torch

from ..dynamo import eager_under_meter
from ..runtime.chain_call import measuring_peaks
from .cuda_peak import peak_allocated, reset_reader
from .linger import settle
from .meter import Instrument

__all__ = ["measure_peak"]


class measure_peak:
    """Measure the peak of the code inside the block, and of each chain it opens.

    Args:
        device: where to measure: a CUDA device measures with the allocator's
            statistics, anything else with the meter of live CPU tensor
            storages. Default: the current CUDA device if CUDA is initialised,
            else the CPU.

    Attributes:
        peak: after the block, the most bytes the block had allocated at once
            beyond what was allocated as it began.

    Example:
        >>> import torch, remat
        >>> lin = remat.stage(torch.nn.Linear(4, 4))
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with remat.measure_peak() as m:
        ...     with remat.chain(budget="1MiB"):
        ...         y = lin(lin(x))
        ...     y.sum().backward()
        >>> m.peak > 0 and remat.explain().measured_peak > 0
        True
    """

    def __init__(self, device=None):
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_initialized() else torch.device("cpu")
        self.device = torch.device(device)
        self.peak = None
        self._meter = None
        self._chains = []   # [base, the most since, the Explanations it published] per chain opened

    def __enter__(self):
        self._base = self._segment()
        self._most = self._base
        self._chains = []
        if self.device.type != "cuda":   # (compiled code inside runs eagerly: remat/dynamo.py)
            self._meter = Instrument(writes=False).__enter__()
            self._meter.eager = eager_under_meter(True)
            self._base = self._most = 0
        measuring_peaks.append(self)
        return self

    def __exit__(self, *exc):
        settle()   # (a meter a chain left after its block: remat/measure/linger.py)
        if measuring_peaks and measuring_peaks[-1] is self:
            measuring_peaks.pop()
        try:
            self._close_segment()
        finally:
            if self._meter is not None:
                self._meter.__exit__(*exc)
                self._meter.eager = self._meter.eager and eager_under_meter(False)
                self._meter = None
        self.peak = max(0, self._most - self._base)
        for base, most, explanations in self._chains:
            for explanation in explanations:
                explanation.measured_peak = max(0, most - base)
        return False

    # the chains' hooks (remat/chain.py, remat/runtime/chain_call.py) -----

    def chain_opened(self, x):
        """A chain opened on input ``x``: its peak counts from what is allocated now,
        its input counted (as the budget counts it)."""
        now = self._close_segment()
        self._chains.append([now - x.untyped_storage().nbytes(), now, []])

    def published(self, explanation):
        """A chain made ``explanation`` what ``explain()`` shows: the chain opened last,
        or one opened before whose backward has shown its tail (the same record's)."""
        record = getattr(explanation, "_record", None)
        for entry in reversed(self._chains):
            if not entry[2] or record is not None and any(getattr(e, "_record", None) is record for e in entry[2]):
                entry[2].append(explanation)
                return

    # ---------------------------------------------------------------------

    def _segment(self):
        """What is allocated now (and, on CUDA, the peak statistics reset here)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = torch.cuda.memory_allocated(self.device)
            reset_reader(self.device)
            return now
        return self._meter.live if self._meter is not None else 0

    def _close_segment(self):
        """The peak since the last segment began goes to the block and every open
        chain; a new segment begins at what is allocated now, which is returned."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            most = peak_allocated(self.device)   # (remat's own resets carried over: Note [Carrying the peak over])
        else:
            most = self._meter.peak
        self._most = max(self._most, most)
        for entry in self._chains:
            entry[1] = max(entry[1], most)
        now = self._segment()
        if self._meter is not None:
            self._meter.peak = now
        return now
