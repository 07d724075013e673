"""State a recomputation must replay exactly: RNG streams, autocast, and
tensors a stage updates in place (BatchNorm running statistics).

Note [Replaying a stage]
------------------------
A recomputed stage must compute bit for bit what its first forward did and
leave no trace:

1. RNG: the CPU generator and the generator of every CUDA device the stage's
   inputs live on are captured before the stage's first forward, set to that
   state for each recomputation, and put back afterwards, so the stream the
   rest of the program sees is untouched. Stages measured not to draw random
   numbers skip this.
2. Autocast: the enabled flag and dtype of every device type, and the cache
   flag, are captured with the stage and re-entered around a recomputation.
3. In-place state: while measuring, remat records every tensor that existed
   before the stage and that the stage writes in place (BatchNorm's
   ``running_mean``, ``running_var``, ``num_batches_tracked``, any EMA
   buffer). A recomputation snapshots those tensors and restores them after,
   so one step updates them exactly once, as plain PyTorch does.
4. Grad mode: a recomputation that only rebuilds an activation runs without
   recording, which is cheaper, unless the stage computes something else
   that way: some kernels are chosen by grad mode (scaled_dot_product_attention
   on CPU draws its dropout differently with and without grad). Measuring
   compares the stage's output with and without recording, bit for bit; a
   stage that differs is recomputed with grad mode on, its saved tensors
   dropped as they are made.
"""

import contextlib

import torch

__all__ = ["RngState", "capture_rng", "AutocastState", "capture_autocast", "restore_tensors"]


class RngState:
    """CPU and CUDA generator states captured at one point."""

    __slots__ = ("cpu", "cuda")

    def __init__(self, cpu, cuda):
        self.cpu = cpu
        self.cuda = cuda

    def changed(self):
        """True if a stream has moved since it was captured (something drew from it)."""
        return not torch.equal(torch.get_rng_state(), self.cpu) or any(
            not torch.equal(torch.cuda.get_rng_state(d), s) for d, s in self.cuda)

    @contextlib.contextmanager
    def replayed(self):
        """Run the body with the captured streams, then put the current ones back."""
        cpu_now = torch.get_rng_state()
        cuda_now = [(d, torch.cuda.get_rng_state(d)) for d, _ in self.cuda]
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda:
            torch.cuda.set_rng_state(state, d)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            for d, state in cuda_now:
                torch.cuda.set_rng_state(state, d)


def cuda_devices(tensors):
    """Indices of the CUDA devices among ``tensors`` (an iterable)."""
    return sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                   for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})


def capture_rng(devices=()):
    """Capture the CPU stream and the streams of the given CUDA devices."""
    return RngState(torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices])


class AutocastState:
    """Autocast flags of the CPU and CUDA device types, as a hashable value."""

    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key

    def context(self):
        """A context manager that re-enters this autocast state."""
        stack = contextlib.ExitStack()
        for device_type, enabled, dtype, cache in self.key:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        return stack

    def __eq__(self, other):
        return isinstance(other, AutocastState) and self.key == other.key

    def __hash__(self):
        return hash(self.key)


def capture_autocast():
    """The autocast state now, for CPU and (if available) CUDA."""
    cache = torch.is_autocast_cache_enabled()
    key = []
    for device_type in ("cpu", "cuda"):
        if device_type == "cuda" and not torch.cuda.is_available():
            continue
        key.append((device_type, torch.is_autocast_enabled(device_type),
                    torch.get_autocast_dtype(device_type), cache))
    return AutocastState(tuple(key))


@contextlib.contextmanager
def restore_tensors(tensors):
    """Run the body, then write back the values ``tensors`` had before it (Note 3)."""
    saved = [(t, t.detach().clone()) for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, old in saved:
                t.copy_(old)
