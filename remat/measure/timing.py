"""Timing a stage's runs while it is measured: wall-clock regions that
synchronise CUDA, CUDA's once-per-process set-up done before the first stage,
and on CUDA a forward and backward timed on a copy of the input (Note
[Measuring a stage], remat/measure/profile.py).
"""

import time

import torch

from .leaves import StepGrads, stage_leaves, stop_nodes
from ..runtime.option_modes import option_contexts
from ..runtime.replay import restore_tensors

__all__ = ["Timer", "timed_rebuild", "timed_step", "warm_cuda"]

_warm = set()   # CUDA devices warm_cuda has set up


class Timer:
    """Wall time of a region, synchronising CUDA when the work runs there."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.seconds = 0.0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._t0
        return False



def warm_cuda(devices):
    """Make CUDA's lazy, once-per-process set-up happen before a stage is measured
    on ``devices``, not inside it (Note [Measuring a stage], remat/measure/profile.py):
    the cuBLAS handles and workspaces of the calling thread and of the engine's
    backward thread (32 MiB each on an H100, held for good, which the allocator's
    peak would count as the first stage's transient memory), and the loading of
    the GEMM kernels (seconds, which its time would count). A small Linear
    forward and backward, per device, once; it draws no random numbers."""
    for d in devices:
        if d in _warm:
            continue
        with torch.cuda.device(d), torch.enable_grad():
            w = torch.ones(64, 64, device="cuda", requires_grad=True)
            b = torch.zeros(64, device="cuda", requires_grad=True)
            a = torch.ones(64, 64, device="cuda", requires_grad=True)
            torch.nn.functional.linear(a @ w, w, b).sum().backward()
            torch.cuda.synchronize()
        _warm.add(d)


def timed_step(call, x, cuda, rng0, state):
    """Forward and backward times on a detached copy, on CUDA (Note [Measuring a
    stage], remat/measure/profile.py): the lesser of two runs, the first of which may
    still load kernels."""
    first = _timed_step(call, x, cuda, rng0, state)
    second = _timed_step(call, x, cuda, rng0, state)
    return min(first[0], second[0]), min(first[1], second[1])


def _timed_step(call, x, cuda, rng0, state):
    xin = x.detach().requires_grad_(x.requires_grad)
    stop = stop_nodes(call.args)
    with rng0.replayed(), restore_tensors(state), torch.enable_grad():
        with Timer(cuda) as tf:
            out = call.activation(xin)
        tb = 0.0
        if out.requires_grad:
            params = [v for v in stage_leaves(out, stop) if v is not xin]
            inputs = [xin] if xin.requires_grad else []
            if inputs or params:
                grad_out = torch.ones_like(out)
                with StepGrads(params), Timer(cuda) as timer:
                    torch.autograd.backward(out, grad_out, inputs=inputs + params)
                tb = timer.seconds
    return tf.seconds, tb


def timed_rebuild(call, x, cuda, rng0, state):
    """Seconds of a rebuild of the stage under option 1's cache (on CUDA: Note
    [Measuring an option] 3, remat/measure/options.py): the kept ops' outputs handed
    back, the other ops run again, recording, as B(i) runs it; the lesser of two,
    each after a recording forward that fills the cache. None where the rebuild
    fails (the estimate from the cheap ops' share stands)."""
    best = None
    for _ in range(2):
        keep, hand = option_contexts()
        xin = x.detach().requires_grad_(x.requires_grad)
        try:
            with rng0.replayed(), restore_tensors(state), torch.enable_grad():
                with keep:
                    call.activation(xin)
            with rng0.replayed(), restore_tensors(state), torch.enable_grad():
                with Timer(cuda) as timer, hand:
                    call.activation(xin)
        except Exception:   # (a timing, not the stage's result: the estimate stands)
            return None
        best = timer.seconds if best is None else min(best, timer.seconds)
    return best
