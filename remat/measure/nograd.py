"""Run 3 of Note [Measuring a stage] (remat/measure/profile.py): a stage's forward
without recording, replayed as a recomputation is, timed and metered.

Note [Metering the forward without recording]
---------------------------------------------
``fwd_tmp`` is the recording forward's peak, the tensors it saves included, so
it overstates a forward under ``torch.no_grad`` (``Fn``, ``Fck`` after ``Loss``),
which lets each go once the ops reading it are done: ``Costs.fwd_nograd_less``.
Run 3 meters its own forward with the conventions of run 1: above what was
allocated as it began (the input not counted), the output counted, then
taken out; plus the copy a recomputation holds of the state the stage writes
in place (``_due_for_run4``'s, which Replay makes before the metered part
starts); plus what run 1 made from parameters and buffers alone and left
alive, which run 3 finds made (autocast's casts of the weights, cached to
the end of the autocast region) and a recomputation after ``Loss``, in an
autocast region of its own, makes again: on CPU those run 3's ops read, on
CUDA all of them (a bound: the allocator does not say what ops read).

On CPU the meter is run 1's (``Instrument``), and the time is that of the
forward's ops, the meter's own work left out (as run 1's ``fwd_time``; the
time between a dispatch mode's calls is mostly the mode's: on a 32-wide GPT
block, wall time less the time inside the mode's handler was twice a plain
forward's), plus the replay's own work around them (``Replay``'s entry and
exit, timed apart). On CUDA the allocator's peak statistics meter it, reset
inside the timed region (microseconds, taken out of the time).
"""

import time

import torch

from ..runtime.recompute import Replay
from ..runtime.replay import restore_tensors
from .meter import Instrument
from .timing import Timer

__all__ = ["made_alone", "nograd_less", "nograd_run"]


def made_alone(inst):
    """{storage: (weak reference, bytes)} of the storages the meter ``inst`` saw made
    from parameters and buffers alone that are still alive (a cache's)."""
    return {key: (inst._refs[key], inst.created[key]) for key in inst._from_params
            if inst.created.get(key) and key in inst._refs}


def nograd_run(call, x, writes, rng0, cuda, autocast, meter):
    """Stage ``call``'s forward on ``x`` under ``torch.no_grad``, from the RNG
    state ``rng0`` and the state ``writes`` ((tensor, value before) pairs) it
    started from, replayed as a recomputation is (Note [Metering the forward
    without recording]).

    Returns:
        (its output, detached; its seconds; None if not ``meter``, else (its peak above
        what was allocated as it began, the output included; the storages its ops
        read that it did not make, or None on CUDA)).
    """
    state = [t for t, _ in writes]
    with rng0.replayed(), torch.no_grad(), restore_tensors(state):
        for t, old in writes:
            t.copy_(old)
        if not meter:
            with Timer(cuda) as timer, Replay(call, autocast):
                out = call.activation(x).detach()
            return out, timer.seconds, None
        if cuda:
            with Timer(cuda) as timer, Replay(call, autocast):
                t0 = time.perf_counter()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                own = time.perf_counter() - t0
                out = call.activation(x)
            return out.detach(), max(0.0, timer.seconds - own), (torch.cuda.max_memory_allocated() - base, None)
        inst = Instrument(writes=False)
        t0 = time.perf_counter()
        with Replay(call, autocast):
            t1 = time.perf_counter()
            with inst:
                out = call.activation(x)
            t2 = time.perf_counter()
        replay = (t1 - t0) + (time.perf_counter() - t2)
        return out.detach(), replay + inst.op_seconds, (inst.peak, inst.reads)


def nograd_less(costs, metered, writes, cached):
    """``fwd_nograd_less`` of a stage whose ``costs`` run 1 (and its state copies)
    gave, from what ``nograd_run`` ``metered``; ``writes`` as there, ``cached``:
    ``made_alone`` of run 1's meter."""
    peak, reads = metered
    more = sum(t.numel() * t.element_size() for t, _ in writes)
    more += sum(n for key, (ref, n) in (cached or {}).items()
                if ref() is not None and (reads is None or key in reads))
    return min(costs.fwd_tmp, max(0, costs.fwd_tmp - max(0, peak - costs.out_bytes) - more))
