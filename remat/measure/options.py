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
   On CUDA no call refines them, and the meter's op times carry a
   synchronisation each (launches alone would say nothing of the kernels),
   so option 1's rebuild is timed instead (``timed_rebuild``, with run 3):
   its bwd_time is the base's plus that rebuild, option 2's plus the share
   of the kept ops it makes again. On an H200 the share put GPT-2 blocks'
   option 1 at 1.7 ms over the base backward, where plans using it ran about
   0.6 ms a block over.
4. ``fwd_tmp``: the peak of the forward with the kept outputs cached (those
   autograd did not save outlive the ops that used them; option 2 lets them go
   at the stage's end): run 1's live bytes at each storage made, with the kept
   ones gone by then (``timeline`` of the meter); on CUDA the base's plus all
   kept storages autograd did not save.
   ``bwd_tmp``: the base's plus what the rebuild makes again (the base record
   less the option's), held through B(i); at least the rebuild's own
   transient, less the gradient of a^(i-1) that rule 5 adds (the rebuild runs
   before it exists). That transient is the peak, over run 1's forward, of
   the storages it made other than the kept ops' outputs (the cache hands
   those back), with the kept outputs option 2 makes again as they were
   live, and those written in place (``timeline`` of the meter), less a^i
   where B(i) does not read it and the cache does not hold it (it went with
   the next stage's backward: ``out_freed``). On CUDA, where the allocator rounds what the meter
   counts, it is the forward's transient less what the cache hands back
   instead, which assumes every kept output alive at the forward's peak.
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
6. Rungs: options between option 1 and keeping nothing, for stages whose
   expensive ops differ in what they cost to make again per byte they keep (an
   attention kernel's output against the MLP's matmuls; a 3x3 convolution's
   against the 1x1 ones around it). The meter numbers each call of a kept op
   in the forward's order, with its seconds, FLOPs and the bytes it made. Ranked
   by FLOPs per byte (torch's formulas, where they count every call: the same
   rungs on every run and in a costs file, where timings would move them;
   seconds per byte otherwise), the calls fall into steps wherever the ratio
   drops below the step's first over ``RUNG_STEP``, and keeping the calls up to
   each step (at most ``MAX_RUNGS`` of them; the output's call always) is an
   option, a ``Rung``: its saved_bytes are the output and those calls' bytes,
   its fwd_tmp is option 1's, its rebuild makes the other calls' outputs again
   (their spans in the timeline) and its bwd_time adds their share of the op
   time. It runs with that set of calls as its policy: the forward mode
   numbers its kept calls the same way and lets the others go at the stage's
   end (``keep_only``, remat/runtime/option_modes.py), all of them where the
   forward made another number of such calls than run 1 (``Calls.total``).
   Offered where it keeps less than option 1 and the record, and bytes no
   other option keeps.
"""

import contextlib
import time
from typing import NamedTuple

import torch

from ..runtime.option_modes import KEEP_EXPENSIVE, KEEP_SAVED, Calls, option_contexts
from ..solver.option import Option

__all__ = ["KeptSeen", "Rung", "kept_seen", "keeps_said", "stage_options", "dispatch_overhead"]

RUNG_STEP = 2.0   # a rung ends where the next call's FLOPs (or seconds) per byte fall below its first's by this
MAX_RUNGS = 2     # rungs a stage offers at most (each an option the solver weighs at every stage)


class KeptSeen(NamedTuple):
    """What run 1's meter saw of the ops options keep."""
    kept: int            # bytes of the storages kept ops made, the output's aside
    kept_saved: int      # those of them autograd saved
    any_kept: bool       # a kept op ran
    written: int         # bytes of kept outputs an op then wrote in place (made again, not kept)
    ops: int             # ops the forward dispatched
    cheap_share: float   # share of the forward's op time in the ops not kept
    unsaved_share: float = 0.0   # and in the kept ops whose outputs autograd did not save (nor returned)
    rebuild: tuple = None  # the peak of what the rebuild makes, options 1 and 2 (the meter's, on CPU; None on CUDA)
    out_kept: bool = False  # a kept op made the output (the cache holds a^i until B(i))
    forward: int = None     # the peak of a forward that caches the kept outputs (CPU; None on CUDA)
    rebuild_seconds: float = None   # a rebuild under option 1's cache, timed (CUDA: ``timed_rebuild``)
    ladder: tuple = ()      # ``Rung``s: fewer kept outputs, those of most FLOPs per byte (6 of the Note)


class Rung(NamedTuple):
    """An option keeping the outputs of some of the kept ops' calls (6 of Note [Measuring an option])."""
    calls: frozenset     # the calls kept, numbered in the forward's order of kept ops (the output's included)
    kept: int            # bytes they made, the output's aside
    unkept_share: float  # share of the forward's op time in the kept ops' calls it makes again
    rebuild: int = None  # the peak of what the rebuild makes (the meter's, on CPU; None on CUDA)


def kept_seen(inst, keys, out_key, cuda=False):
    """``KeptSeen`` of a forward the meter ``inst`` has just run (on CUDA if ``cuda``),
    whose saved storages are ``keys`` ({storage: bytes}) and output storage ``out_key``."""
    out_call = inst.kept.get(out_key)
    total = sum(c[1] for c in inst.kept_calls) - inst.kept_written - \
        (inst.created.get(out_key, 0) if out_call is not None else 0)
    saved = sum(n for key, n in keys.items() if key != out_key and key in inst.kept)
    spent = inst.op_seconds
    share = inst.cheap_seconds / spent if spent > 0 else 1.0
    # (the time of the kept ops whose outputs stay: saved, or the output; live ones only)
    staying = sum(inst.kept_calls[j][0] for j in {j for key, j in inst.kept.items() if key in keys or key == out_key})
    unsaved = max(0.0, spent - inst.cheap_seconds - staying) / spent if spent > 0 else 0.0
    # (on CUDA the allocator's rounding is not the meter's: the forward's peak bounds it there)
    rebuild = None if cuda else tuple(_rebuild_peak(inst, keep) + inst.kept_written for keep in (
        (), [key for key in inst.kept if key in keys or key == out_key]))
    forward = None if cuda else _peak(inst, 1, [(last, None, n) for _, last, n in inst.spans.values()
                                                if last is not None])
    return KeptSeen(total, saved, bool(inst.kept_calls), inst.kept_written, inst.ops, min(1.0, share),
                    min(1.0, unsaved), rebuild, out_call is not None, forward, ladder=_ladder(inst, out_call, cuda))


def _ladder(inst, out_call, cuda):
    """The ``Rung``s of the forward ``inst`` metered (with ``timeline``), whose output a
    kept op's call ``out_call`` made (or None): 6 of Note [Measuring an option]."""
    calls, spent = inst.kept_calls, inst.op_seconds
    ranked = [j for j, (_, nbytes, written, _, _) in enumerate(calls) if nbytes and not written and j != out_call]
    cost = 4 if all(calls[j][4] is not None for j in ranked) else 0   # (FLOPs where torch counts them all)
    ranked.sort(key=lambda j: -calls[j][cost] / calls[j][1])
    rungs, start = [], None
    for at, j in enumerate(ranked):
        ratio = calls[j][cost] / calls[j][1]
        if start is not None and ratio < start / RUNG_STEP:   # (a step down: the calls so far are a rung)
            kept, left = ranked[:at], ranked[at:]
            made = [span for m in left for span in calls[m][3] if span is not None]   # (made again)
            rungs.append(Rung(Calls(kept + ([] if out_call is None else [out_call]), len(calls)),
                              sum(calls[m][1] for m in kept),
                              min(1.0, sum(calls[m][0] for m in left) / spent) if spent > 0 else 1.0,
                              None if cuda else _peak(inst, 0, made) + inst.kept_written))
            if len(rungs) == MAX_RUNGS:
                break
        start = ratio if start is None or ratio < start / RUNG_STEP else start
    return tuple(rungs)


def _rebuild_peak(inst, handed):
    """The peak of what a rebuild of the forward ``inst`` metered (with ``timeline``)
    makes where the cache hands back the kept ops' outputs, all of them (``handed``
    empty: option 1) or only those of storages ``handed`` (option 2): the others'
    live bytes at each storage made, and the kept ones made again that are live then."""
    return _peak(inst, 0, [span for key, span in inst.spans.items() if handed and key not in handed])


def _peak(inst, which, spans):
    """The peak over the events of the meter ``inst`` (``timeline``) of their
    ``which`` count (0: what kept ops did not make; 1: all) plus the bytes of the
    ``spans`` ([first event, event it ends at or None, bytes]) live at each."""
    delta = [0] * (len(inst.events) + 1)
    for first, last, n in spans:
        delta[first] += n
        delta[len(inst.events) if last is None else last] -= n
    peak = extra = 0
    for j, counts in enumerate(inst.events):
        extra += delta[j]
        peak = max(peak, counts[which] + extra)
    return peak


def stage_options(costs, in_bytes):
    """The options of a stage measured whole (a ``StageCosts`` with ``kept``), whose
    input a^(i-1) is ``in_bytes``, as far as they are offered (Note [Measuring an
    option] 5): (a list of ``Option``, the policy each runs with: ``KEEP_EXPENSIVE``
    or ``KEEP_SAVED``)."""
    seen = costs.kept
    if seen is None or not seen.any_kept or not costs.backward_measured:
        return [], ()
    forward, again = dispatch_overhead()

    def option(keeps, share, rebuild):
        # (what the rebuild makes: the outputs of kept ops it is not handed back, besides option 1's)
        rebuild = costs.fwd_tmp + costs.out_bytes - keeps if rebuild is None else \
            rebuild - (0 if seen.out_kept else costs.out_freed or 0)
        return Option(
            saved_bytes=costs.out_bytes + keeps,
            fwd_time=costs.fwd_time + seen.ops * forward,
            bwd_time=costs.bwd_time + (share * costs.fwd_time + seen.ops * again if seen.rebuild_seconds is None
                                       else seen.rebuild_seconds + (share - seen.cheap_share) * costs.fwd_time),
            fwd_tmp=costs.fwd_tmp + seen.kept - seen.kept_saved if seen.forward is None else
            max(seen.forward - costs.out_bytes, costs.fwd_tmp),
            bwd_tmp=max(costs.bwd_tmp + costs.saved_bytes - costs.out_bytes - keeps, rebuild - in_bytes))

    rebuilds = seen.rebuild or (None, None)
    listed, keeps = [], set()
    for kept, share, rebuild, policy in (
            (seen.kept, seen.cheap_share, rebuilds[0], KEEP_EXPENSIVE),
            (seen.kept_saved, seen.cheap_share + seen.unsaved_share, rebuilds[1], KEEP_SAVED),
            *((r.kept, seen.cheap_share + r.unkept_share, r.rebuild, r.calls) for r in seen.ladder)):
        if costs.out_bytes + kept < costs.saved_bytes and kept not in keeps and (
                kept < seen.kept or policy == KEEP_EXPENSIVE):
            keeps.add(kept)
            listed.append((option(kept, min(1.0, share), rebuild), policy))
    return [o for o, _ in listed], tuple(p for _, p in listed)


def keeps_said(policy):
    """What an option run with ``policy`` keeps, in words (``remat.explain()``)."""
    if isinstance(policy, frozenset):
        return f"keeps its {len(policy)} costliest expensive calls' outputs (FLOPs per byte)"
    return {KEEP_EXPENSIVE: "keeps its expensive ops' outputs", KEEP_SAVED: "keeps those of them autograd saves"}.get(
        policy, "")


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

