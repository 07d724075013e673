"""Refining a chain's measured times with the calls after the measuring one.

Note [Timing the second call]
-----------------------------
The measuring call (Note [Measuring a stage], remat/measure/profile.py) times
each stage once, in a process that is not yet in its stride: its memory is
laid out for the measuring runs, fresh pages fault on first touch, caches hold
the other runs' data, and on CPU runs 1 and 2 go through the storage meter,
which enters Python for every op. On small stages the first call's times,
metered or not, come out slower than later steps', unevenly, and the
schedule's predicted time with them (figures: docs/how-it-works.md, "Measured
while building remat").

The next calls run the schedule as every later one does, and ``StageTimes``
stamps two of them (``SAMPLES``):

1. Forward phase: each stage's wall time, remat's own work around it included
   (a recording forward, with or without pack hooks, and the checks of Note
   [Chain keys] before it), the last stage's with the chain's end of call:
   ``fwd_time``. The per-stage checks are tens of µs, which on small stages
   left out put the chain above its prediction.
2. Backward: a pre-hook on the node that made stage k's output notes when
   stage k's backward begins. On CPU the engine runs a graph on the calling
   thread, always the ready node made last first, so stage k's nodes run
   between that mark and the mark of stage k-1 (whose output node waits for
   all of stage k's gradient). Stage 1 ends with the last of its own nodes (a
   post hook on each, a leaf's ``AccumulateGrad`` left out: a tied weight's
   runs only once its use behind the chain is backwarded). Recomputations in
   that backward are timed and taken out of whichever interval they fall in:
   ``bwd_time``.
3. A recomputation that records (``Fall`` in the backward phase) is a forward
   with recording too, with remat's work around it (the replay, a pack hook
   per saved tensor, the determinism guard): ``fwd_time`` of such a stage is
   the mean of that run and its forward-phase run, so that a schedule that
   runs the stage both ways is charged their sum. On small stages that work
   is a fair share of the stage's forward.
4. Recomputations without recording (``Fn``, ``Fck``, rebuilds) time a
   stage's forward without recording, replay included: ``fwd_nograd_time``
   of the stages recomputed so (the least of their runs); the others keep
   the measured one, but no more than their new ``fwd_time``: a forward
   without recording does the same work less the graph, while the measured
   run (run 3) was the stage's first without recording, cold, and twins
   (remat/measure/twins.py) copy the first one's. Those measured times can
   sum above the recording forward's, and the solver would then recompute
   with grad mode on rather than without.

At the end of the backward (an engine callback), if it went through every
stage once, in chain order, and every interval is positive, the call's
times are a sample. With two samples, their mean, stage by stage (the
lesser where one is 1.5x the other: ``combine``), replaces the measured
times, the next call solves again, and a costs file the measuring call
wrote is written again. One sample alone is a stage's wall time on
whatever the machine did at that moment: on a shared CPU a stage preempted
mid-run reads several times its time (a second sample is seldom hit at the
same stage). A call that gives no
sample (no backward, one that stops inside the chain) leaves the next one
to try, up to ``ATTEMPTS`` calls; if only one sample came of them, it is
used.

Not done on CUDA (``timed_step`` times an unmetered forward and backward
there, and stamps of asynchronous work would need a synchronisation per
stage), under torch.distributed (every rank keeps rank 0's costs and so the
same schedule), nor for costs read from a file.
"""

import time
import weakref

import torch

from ..solver.costs import Costs
from .leaves import stop_nodes, walk

__all__ = ["ATTEMPTS", "SAMPLES", "StageTimes", "combine", "refine", "take_sample"]

SAMPLES = 2    # stamped calls whose times are combined, stage by stage
ATTEMPTS = 4   # calls after the measuring one that may be stamped
OUTLIER = 1.5  # a sample this many times another is a busy machine's


def combine(samples):
    """One stage's time from its samples: their mean, or the least where one is
    ``OUTLIER`` times another (the stage was preempted in that call). The least
    of every pair would be biased low: on sub-millisecond stages a run's jitter
    is large, and the sum of the stages' minima predicts a chain below its
    measured time."""
    least = min(samples)
    if max(samples) > OUTLIER * least:
        return least
    return sum(samples) / len(samples)


class StageTimes:
    """The stamps of Note [Timing the second call] for one call of a chain."""

    def __init__(self, chain_record):
        self.chain_record = weakref.ref(chain_record)
        self.forward = {}     # stage -> seconds of its forward-phase run
        self.nograd = {}      # stage -> least seconds of a recomputation without recording
        self.recording_runs = {}   # stage -> seconds of its recomputation that records
        self.starts = {}      # stage -> when its backward began
        self.end = None       # when the last node of stage 1 ran
        self.rebuilds = []    # (start, end) of each recomputation in the backward
        self.stages = 0
        self.queued = False
        self.done = False

    def ran(self, k, seconds, act, inputs):
        """Stage ``k`` ran its forward phase in ``seconds`` and returned ``act``;
        ``inputs`` are its tensor arguments, where its own graph ends."""
        self.forward[k] = seconds
        node = act.grad_fn
        if node is None:
            return
        self.stages = k
        node.register_prehook(self._start(k))
        if k == 1:
            for n in walk([node], stop_nodes(inputs) - {node}):   # (the stage's own nodes)
                if not hasattr(n, "variable"):   # (AccumulateGrad: see the Note, 2)
                    n.register_hook(self._end)

    def ran_more(self, k, seconds):
        """Stage ``k``'s forward-phase time gets ``seconds`` more (the chain's end of call)."""
        if k in self.forward:
            self.forward[k] += seconds

    def recomputed(self, k, seconds):
        """Stage ``k`` ran without recording in ``seconds`` (a recomputation)."""
        if not self.done:
            self.nograd[k] = min(seconds, self.nograd.get(k, seconds))

    def recorded(self, k, seconds):
        """Stage ``k`` was recomputed recording in ``seconds`` (3 of the Note)."""
        if not self.done:
            self.recording_runs[k] = seconds

    def rebuilt(self, t0, t1):
        """The backward's recomputations ran from ``t0`` to ``t1`` (perf_counter seconds)."""
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
        chain_record = self.chain_record()
        backward = self.backward()
        if chain_record is not None and backward is not None:
            forward = {k: (t + self.recording_runs[k]) / 2 if k in self.recording_runs else t
                       for k, t in self.forward.items()}
            take_sample(chain_record, forward, backward, self.nograd)

    def backward(self):
        """Each stage's backward seconds, or None if the backward did not go
        through the whole chain once in order (Note [Timing the second call], 2)."""
        n = self.stages
        if n == 0 or self.end is None or sorted(self.starts) != list(range(1, n + 1)):
            return None
        bounds = [self.starts[k] for k in range(1, n + 1)]
        ends = [self.end] + bounds[:-1]
        times = []
        for a, b in zip(bounds, ends):
            inside = sum(max(0.0, min(b, t1) - max(a, t0)) for t0, t1 in self.rebuilds)
            seconds = b - a - inside
            if seconds <= 0:
                return None
            times.append(seconds)
        return times


def take_sample(chain_record, forward, backward, nograd):
    """A call after the measuring one of ``chain_record`` was stamped (Note [Timing
    the second call]): ``forward`` and ``nograd`` map stages to seconds,
    ``backward`` lists them. With ``SAMPLES`` such calls, or none left to try,
    the times replace the measured ones."""
    costs = chain_record.costs
    n = costs.length if costs is not None else -1
    if len(backward) != n or sorted(forward) != list(range(1, n + 1)):
        return
    chain_record.samples.append(([forward[k] for k in range(1, n + 1)], list(backward), dict(nograd)))
    if len(chain_record.samples) >= SAMPLES or chain_record.attempts == 0:
        refine(chain_record)

def refine(chain_record):
    """The samples' times of ``chain_record``, stage by stage (``combine``), replace
    the measured ones; plans are solved again and the costs file this process
    measured for is written again."""
    samples, chain_record.samples = chain_record.samples, []
    chain_record.attempts = 0
    if not samples:
        return
    n = chain_record.costs.length
    nograd = {}
    for _, _, times in samples:
        for k, t in times.items():
            nograd.setdefault(k, []).append(t)
    nograd = {k: combine(ts) for k, ts in nograd.items()}
    data = chain_record.costs.to_dict()
    data["fwd_time"] = [combine([f[i] for f, _, _ in samples]) for i in range(n)]
    data["bwd_time"] = [combine([b[i] for _, b, _ in samples]) for i in range(n)]
    # (4 of the Note: a forward without recording does no more than one with it)
    fwd = data["fwd_time"]
    data["fwd_nograd_time"] = [
        nograd.get(k, fwd[k - 1] if chain_record.stages[k - 1].grad_replay else min(t, fwd[k - 1]))
        for k, t in enumerate(data["fwd_nograd_time"], 1)]
    # an option keeps what it was measured to add to the stage's times (remat/measure/options.py)
    old = chain_record.costs
    for i, listed in enumerate(data.get("options", ())):
        for o in listed:
            o["fwd_time"] = max(0.0, o["fwd_time"] + fwd[i] - old.fwd_time[i])
            o["bwd_time"] = max(0.0, o["bwd_time"] + data["bwd_time"][i] - old.bwd_time[i])
    chain_record.costs = Costs.from_dict(data)
    chain_record.refined = len(samples)
    chain_record.plans = {}
    chain_record.save()
