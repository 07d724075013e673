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

5. A stage the plan runs with an option (remat/measure/options.py): its
   forward-phase run is the option's forward, so the stage's own
   ``fwd_time`` is that less what the option's mode adds (the dispatch
   measured on the first call), and the rebuild before B(i), under the
   option's cache, is the option's recomputation: the option's
   ``bwd_time`` is the stage's backward plus that run. An option no stamped
   call ran keeps the first call's estimate of its recomputation, scaled by
   what the runs showed against the estimate on the stages that ran theirs
   (the estimate, the cheap ops' share of the metered ops' time, misses the
   stage's Python and remat's replay around the rebuild: about 25% low on GPT
   blocks on CPU, where before this the refined plans kept the estimate).

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
from typing import NamedTuple

import torch

from ..solver.costs import Costs
from .leaves import stop_nodes, walk

__all__ = ["ATTEMPTS", "SAMPLES", "Sample", "StageTimes", "combine", "refine", "take_sample"]

SAMPLES = 2    # stamped calls whose times are combined, stage by stage
ATTEMPTS = 4   # calls after the measuring one that may be stamped
OUTLIER = 1.5  # a sample this many times another is a busy machine's


class Sample(NamedTuple):
    """The stamps of one call, stage by stage (index i for stage i + 1)."""
    forward: list       # seconds of each stage's forward-phase run (the chain's end of call in the last)
    backward: list      # seconds of each stage's backward, its recomputations left out
    options: list       # the option each stage's forward-phase run ran with (0: none)
    nograd: dict        # stage -> least seconds of a recomputation without recording
    recorded: dict      # stage -> (seconds, option) of a recomputation that records
    cached: dict        # stage -> seconds of its rebuild under an option's cache (5 of the Note)


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
        self.options = {}     # stage -> the option that run ran with
        self.nograd = {}      # stage -> least seconds of a recomputation without recording
        self.recording_runs = {}   # stage -> (seconds, option) of its recomputation that records
        self.cached = {}      # stage -> seconds of its rebuild under an option's cache
        self.starts = {}      # stage -> when its backward began
        self.end = None       # when the last node of stage 1 ran
        self.rebuilds = []    # (start, end) of each recomputation in the backward
        self.stages = 0
        self.queued = False
        self.done = False

    def ran(self, k, seconds, act, inputs, option=0):
        """Stage ``k`` ran its forward phase in ``seconds`` (with ``option``) and
        returned ``act``; ``inputs`` are its tensor arguments, where its own graph ends."""
        self.forward[k] = seconds
        self.options[k] = option
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

    def recorded(self, k, seconds, option=0, cached=False):
        """Stage ``k`` was recomputed recording in ``seconds`` (3 of the Note), with
        ``option``, or ``cached``: under the cache of its option's run (5)."""
        if self.done:
            return
        if cached:
            self.cached[k] = seconds
        else:
            self.recording_runs[k] = (seconds, option)

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
        n = self.stages
        if chain_record is not None and backward is not None and sorted(self.forward) == list(range(1, n + 1)):
            take_sample(chain_record, Sample([self.forward[k] for k in range(1, n + 1)], backward,
                                             [self.options[k] for k in range(1, n + 1)], dict(self.nograd),
                                             dict(self.recording_runs), dict(self.cached)))

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


def take_sample(chain_record, sample):
    """A call after the measuring one of ``chain_record`` was stamped (Note [Timing
    the second call]): a ``Sample``. With ``SAMPLES`` such calls, or none left to
    try, the times replace the measured ones."""
    costs = chain_record.costs
    n = costs.length if costs is not None else -1
    if len(sample.backward) != n or len(sample.forward) != n:
        return
    chain_record.samples.append(sample)
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
    old = chain_record.costs
    n = old.length

    def mode_adds(i, o):   # what option o's forward mode adds to stage i + 1's forward (5 of the Note)
        return old.options[i][o - 1].fwd_time - old.fwd_time[i] if 0 < o <= len(old.options[i]) else 0.0

    forward, nograd, seen = [[] for _ in range(n)], {}, {}
    for s in samples:
        for i in range(n):
            k, o = i + 1, s.options[i]
            t = max(0.0, s.forward[i] - mode_adds(i, o))
            if k in s.recorded:   # (3 of the Note)
                again, option = s.recorded[k]
                t, o = (t + max(0.0, again - mode_adds(i, option))) / 2, o or option
            forward[i].append(t)
            if 0 < o <= len(old.options[i]) and k in s.cached:
                seen.setdefault((i, o), []).append(s.cached[k])
        for k, t in s.nograd.items():
            nograd.setdefault(k, []).append(t)
    nograd = {k: combine(ts) for k, ts in nograd.items()}
    data = old.to_dict()
    data["fwd_time"] = fwd = [combine(ts) for ts in forward]
    data["bwd_time"] = bwd = [combine([s.backward[i] for s in samples]) for i in range(n)]
    # (4 of the Note: a forward without recording does no more than one with it)
    data["fwd_nograd_time"] = [
        nograd.get(k, fwd[k - 1] if chain_record.stages[k - 1].grad_replay else min(t, fwd[k - 1]))
        for k, t in enumerate(data["fwd_nograd_time"], 1)]
    # options (5 of the Note): a recomputation seen is the option's; the others' estimates
    # scaled by what those seen showed against theirs
    seen = {at: combine(ts) for at, ts in seen.items()}
    estimated = sum(old.options[i][o - 1].bwd_time - old.bwd_time[i] for i, o in seen)
    scale = sum(seen.values()) / estimated if seen and estimated > 0 else 1.0
    for i, listed in enumerate(data.get("options", ())):
        for o, option in enumerate(listed, 1):
            option["fwd_time"] = max(0.0, option["fwd_time"] + fwd[i] - old.fwd_time[i])
            again = seen.get((i, o))
            if again is None:
                again = scale * max(0.0, option["bwd_time"] - old.bwd_time[i])
            option["bwd_time"] = bwd[i] + again
    chain_record.costs = Costs.from_dict(data)
    chain_record.refined = len(samples)
    chain_record.plans = {}
    chain_record.save()
