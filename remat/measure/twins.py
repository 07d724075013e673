"""Twin stages: a stage measured like one measured before in the same call
takes that stage's results instead of being measured again.

Note [Twin stages]
------------------
Chains are mostly copies of one block (a transformer's layers, a ResNet
stage's bottlenecks). A stage whose run 1 shows it to be a twin of a stage
measured before in the call skips runs 2 and 3 and takes that stage's
backward time and peak, time and peak without recording (``fwd_nograd_less``,
clamped to its own fwd_tmp) and grad-mode verdict: the
most of a first call's work (run 2 is metered op by op). Twins have the same
code (the function, or the module's class and forward), the same tree of
submodules with the same configuration (``extra_repr``), training flags,
parameter and buffer shapes; like inputs (shape, strides, dtype, device,
requires_grad; side inputs by ``signature``); and, from run 1, the same
output, saved and transient bytes, saved tensors' shapes, RNG use, in-place
writes, held gradients, parameters to differentiate and backward graph (node
types and edges, from the output to the inputs). Same ops on like tensors
allocate alike, so nothing the budget relies on is guessed. On CPU the
next two calls' own times then replace the shared ones (remat/measure/refine.py).
"""

import torch

from ..runtime.stage_call import signature

__all__ = ["Twin"]


class Twin:
    """The twin lookup of one stage (Note [Twin stages]): ``instrumented_run`` hands
    ``find`` what run 1 showed and gets the twin's run 2 results, or None; ``of`` is
    then the twin's stage number. Those results are kept as run 2 gave them, before
    run 4 (another gradient layout) may change the twin's row."""

    def __init__(self, twins, ident, call, x):
        self.twins, self.key, self.of, self.run2 = twins, None, None, None
        try:
            base = (_structure(ident, call.fn), tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad,
                    signature((call.args, call.kwargs)))
            hash(base)
        except TypeError:   # an unhashable stage function: no twins
            base = None
        self.base = base

    def find(self, seen):
        if self.base is None:
            return None
        self.key = (self.base, seen)
        found = self.twins.get(self.key)
        if found is None:
            return None
        self.of, run2 = found
        return run2

    def keep(self, probe):
        """Note the stage's own run 2 results (``probe`` as ``instrumented_run`` made it)."""
        if probe.costs is not None:
            self.run2 = probe.run2()

    def register(self, k):
        """Stage ``k``, measured in full, is the one its twins take after."""
        if self.key is not None and self.run2 is not None:
            self.twins.setdefault(self.key, (k, self.run2))


def _structure(ident, fn):
    """The code a stage runs and, for a module, its submodules' classes, configuration
    and training flags and its parameters' and buffers' shapes."""
    code = getattr(fn, "__func__", fn)
    if not isinstance(ident, torch.nn.Module):
        return (code,)
    return (code,
            tuple((name, type(m), m.extra_repr(), m.training) for name, m in ident.named_modules()),
            tuple((name, p.shape, p.dtype, p.device, p.requires_grad) for name, p in ident.named_parameters()),
            tuple((name, b.shape, b.dtype, b.device) for name, b in ident.named_buffers()))
