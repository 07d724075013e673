"""Refining a chain's backward times with the first call's own backward.

Note [Timing the first backward]
--------------------------------
The measuring call times each stage's backward under the storage meter (run 2
of Note [Measuring a stage], remat/profile.py). On CPU the meter is a
TorchDispatchMode, and entering Python for every op costs more than the meter
leaves out of its timer: on ResNet-101's small convolutions that run came out
10-35% slower, stage by stage, than the same backward inside a training
step, and the predictions of every schedule with it. The call's own backward,
the one the user runs after the chain, is not metered: it takes what a
training step takes. ``BackwardTimes`` stamps it:

1. A pre-hook on the node that made stage k's output notes when stage k's
   backward begins. On CPU the engine runs a graph on the calling thread,
   always the ready node made last first, so stage k's nodes run between
   that mark and the mark of stage k-1 (whose output node waits for all of
   stage k's gradient). Stage 1 ends with the last of its own nodes (a post
   hook on each).
2. Recomputations in that backward (the stages whose saved tensors did not fit
   the budget, rebuilt by ``Run.materialize``) are timed there and taken out
   of whichever interval they fall in.
3. At the end of the backward (an engine callback) the times replace
   ``bwd_time`` in the recording's costs if the backward went through every
   stage once, in chain order, and every interval is positive. Anything else
   (a backward that stops inside the chain, none at all) leaves the measured
   times. The next call solves again; a costs file this process wrote is
   written again with them (``Recording.take_refined``).

Not done on CUDA (``timed_step`` already times an unmetered backward there, and
stamps of asynchronous work would need a synchronisation per stage), under
torch.distributed (every rank keeps rank 0's costs and so the same schedule),
nor for costs read from a file.
"""

import time
import weakref

import torch

__all__ = ["BackwardTimes"]


class BackwardTimes:
    """The stamps of Note [Timing the first backward] for one measuring call."""

    def __init__(self, recording):
        self.recording = weakref.ref(recording)
        self.starts = {}      # stage -> when its backward began
        self.end = None       # when the last node of stage 1 ran
        self.rebuilds = []    # (start, end) of each recomputation
        self.stages = 0
        self.queued = False
        self.done = False

    def watch(self, k, act, stop):
        """Stamp stage ``k`` (output ``act``) in the backward; ``stop`` holds the
        nodes of the stage's inputs, where its own graph ends."""
        node = act.grad_fn
        if node is None:
            return
        self.stages = k
        node.register_prehook(self._start(k))
        if k == 1:
            for n in _stage_nodes(node, stop):
                # not on a leaf's AccumulateGrad: one also used behind the chain
                # (a tied weight) runs only once that use is backwarded
                if not hasattr(n, "variable"):
                    n.register_hook(self._end)

    def rebuilt(self, t0, t1):
        """A recomputation ran from ``t0`` to ``t1`` (perf_counter seconds)."""
        if not self.done:
            self.rebuilds.append((t0, t1))

    def _start(self, k):
        def start(_grads):
            if self.done or k in self.starts:
                return
            self.starts[k] = time.perf_counter()
            if not self.queued:
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)

        return start

    def _end(self, _grad_inputs, _grad_outputs):
        if not self.done:
            self.end = time.perf_counter()

    def _finish(self):
        self.done = True
        recording = self.recording()
        times = self.times()
        if recording is not None and times is not None:
            recording.refine_bwd(times)

    def times(self):
        """Each stage's backward seconds, or None if the backward did not go
        through the whole chain once in order (Note [Timing the first backward], 3)."""
        n = self.stages
        if n == 0 or self.end is None or sorted(self.starts) != list(range(1, n + 1)):
            return None
        bounds = [self.starts[k] for k in range(1, n + 1)]   # stage order: latest first
        ends = [self.end] + bounds[:-1]
        times = []
        for a, b in zip(bounds, ends):
            inside = sum(max(0.0, min(b, t1) - max(a, t0)) for t0, t1 in self.rebuilds)
            seconds = b - a - inside
            if seconds <= 0:
                return None
            times.append(seconds)
        return times


def _stage_nodes(node, stop):
    """The nodes of a stage's backward graph: from the node of its output down to
    (not into) the nodes in ``stop``, those of its inputs."""
    seen = {node}
    todo = [node]
    while todo:
        n = todo.pop()
        for nxt, _ in n.next_functions:
            if nxt is not None and nxt not in seen and nxt not in stop:
                seen.add(nxt)
                todo.append(nxt)
    return seen
