"""What options 1 and 2 of a stage cost, from what its measured forward showed
(docs/how-it-works.md, "Options"; how they run: Note [Running an option] in
remat/runtime/option_modes.py).

Note [Measuring an option]
--------------------------
Option 1 (``KEEP_EXPENSIVE``) keeps the outputs of the expensive ops
(``KEPT_OPS``: matmuls, convolutions, attention kernels) and recomputes the
rest in B(i); option 2 (``KEEP_SAVED``) keeps only those of them autograd
saves (and the stage's output). The meter
of run 1 (``Instrument``, remat/measure/meter.py) sees every op of the
stage's forward, so it tags each storage a kept op made, with that op's time,
and adds up the time of the other ops; no run is added to the first call.

1. ``saved_bytes``: the output, plus every storage a kept op made, each once
   (the output's own aside). Option 1's cache keeps them all, those autograd
   does not save too (the matmul before a residual sum): that is what the
   runtime holds. Option 2's, those autograd saved.
2. ``fwd_time``: the base fwd_time plus the forward mode's dispatch through
   Python, per op, times the stage's ops. The overhead is measured once per
   process on a small op (``dispatch_overhead``): it does not depend on the
   tensors' sizes, and timing a whole extra forward per stage would make every
   first call slower for a figure known ahead.
3. ``bwd_time``: the base bwd_time, plus the share of the forward's op time
   spent in the ops not kept (the recomputation runs those again, and their
   autograd; for option 2 the kept ops whose outputs it lets go too), plus
   the recompute mode's dispatch per op. A share, not the meter's seconds, so
   that a forward timed otherwise (``timed_step`` on CUDA, the refined times)
   scales with it. It misses the stage's Python and remat's replay around the
   rebuild; on CPU the calls that refine the times measure the option where
   their plan runs it (Note [Timing the second call], 5, remat/measure/refine.py).
4. ``fwd_tmp``: the base's, plus the kept storages autograd did not save (they
   outlive the ops that used them; option 2 lets them go at the stage's end).
   ``bwd_tmp``: the base's plus what the rebuild makes again (the base record
   less the option's), held through B(i); at least the rebuild's own
   transient, the forward's less what the cache hands back, less the gradient
   of a^(i-1) that rule 5 adds (the rebuild runs before it exists: counting it
   put an option's B(i) up to 12% over the measured whole-step peak).
5. A kept output an op then writes in place (a ReLU(inplace=True) after a
   linear) is not kept: the cache would hand back the written tensor, which
   the recomputation writes again; the runtime drops it from the cache and
   makes it again (its op's time is not added to option 1's bwd_time). Each
   is offered only where the stage ran a kept op and it keeps strictly less
   than the base record, option 2 also strictly less than option 1. Where
   option 1 is not offered (an attention whose score matrix is a matmul's
   output), option 2 is the stage's first option: the stage's record says
   which policy each of its options runs with (``StageCosts.policies``, read
   through ``Plan.policy``).
"""

import contextlib
import time
from typing import NamedTuple

import torch

from ..runtime.option_modes import KEEP_EXPENSIVE, KEEP_SAVED, option_contexts
from ..solver.option import Option

__all__ = ["KeptSeen", "kept_seen", "stage_options", "dispatch_overhead"]


class KeptSeen(NamedTuple):
    """What run 1's meter saw of the ops options 1 and 2 keep."""
    kept: int            # bytes of the storages kept ops made, the output's aside
    kept_saved: int      # those of them autograd saved
    any_kept: bool       # a kept op ran
    written: int         # bytes of kept outputs an op then wrote in place (made again, not kept)
    ops: int             # ops the forward dispatched
    cheap_share: float   # share of the forward's op time in the ops not kept
    unsaved_share: float = 0.0   # and in the kept ops whose outputs autograd did not save (nor returned)


def kept_seen(inst, keys, out_key):
    """``KeptSeen`` of a forward the meter ``inst`` has just run, whose saved
    storages are ``keys`` ({storage: bytes}) and output storage ``out_key``."""
    total = inst.kept_bytes - inst.kept_written - (inst.kept.get(out_key, 0) or 0)
    saved = sum(n for key, n in keys.items() if key != out_key and key in inst.kept)
    spent = inst.op_seconds
    share = inst.cheap_seconds / spent if spent > 0 else 1.0
    # (the time of the kept ops whose outputs stay: saved, or the output; live ones only)
    staying = sum(inst.kept_seconds.get(key, 0.0) for key in inst.kept if key in keys or key == out_key)
    unsaved = max(0.0, spent - inst.cheap_seconds - staying) / spent if spent > 0 else 0.0
    return KeptSeen(total, saved, inst.kept_bytes > 0 or any(inst.kept), inst.kept_written, inst.ops,
                    min(1.0, share), min(1.0, unsaved))


def stage_options(costs, in_bytes):
    """The options of a stage measured whole (a ``StageCosts`` with ``kept``), whose
    input a^(i-1) is ``in_bytes``, as far as they are offered (Note [Measuring an
    option] 5): (a list of ``Option``, the policy each runs with: ``KEEP_EXPENSIVE``
    or ``KEEP_SAVED``)."""
    seen = costs.kept
    if seen is None or not seen.any_kept or not costs.backward_measured:
        return [], ()
    forward, again = dispatch_overhead()

    def option(keeps, share):
        return Option(
            saved_bytes=costs.out_bytes + keeps,
            fwd_time=costs.fwd_time + seen.ops * forward,
            bwd_time=costs.bwd_time + share * costs.fwd_time + seen.ops * again,
            fwd_tmp=costs.fwd_tmp + seen.kept - seen.kept_saved,
            bwd_tmp=max(costs.bwd_tmp + costs.saved_bytes - costs.out_bytes - keeps,
                        costs.fwd_tmp + costs.out_bytes - keeps - in_bytes))

    listed = []
    if costs.out_bytes + seen.kept < costs.saved_bytes:
        listed.append((option(seen.kept, seen.cheap_share), KEEP_EXPENSIVE))
    if seen.kept_saved < seen.kept and costs.out_bytes + seen.kept_saved < costs.saved_bytes:
        listed.append((option(seen.kept_saved, min(1.0, seen.cheap_share + seen.unsaved_share)), KEEP_SAVED))
    return [o for o, _ in listed], tuple(p for _, p in listed)


_overhead = []


def dispatch_overhead():
    """Seconds per op that an option's forward and recompute modes add, measured
    once per process (Note [Measuring an option] 2)."""
    if not _overhead:
        a = torch.zeros(())
        n = 200

        def best(make):
            times = []
            for _ in range(3):
                ctx = make()
                t0 = time.perf_counter()
                with ctx:
                    for _ in range(n):
                        a.add(a)
                times.append(time.perf_counter() - t0)
            return min(times) / n

        plain = best(contextlib.nullcontext)
        forward = best(lambda: option_contexts()[0])

        def recompute():
            fwd, again = option_contexts()
            with fwd:
                for _ in range(n):
                    a.add(a)
            return again

        _overhead[:] = [max(0.0, forward - plain), max(0.0, best(recompute) - plain)]
    return tuple(_overhead)

