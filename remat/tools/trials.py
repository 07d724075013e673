"""Training steps of several methods side by side on one model: plain PyTorch,
``torch.utils.checkpoint.checkpoint_sequential`` and remat, for the demo
(remat/tools/demo.py) and the benchmarks (remat/tools/bench.py, benchmarks/).

A model is given as a spec, ``(build, data, pre, stages, post)``: ``build()``
makes it, ``data(step, device)`` the batch of a step, ``pre(model, input)`` the
chain's input, ``stages(model)`` its blocks, ``post(model, x, targets)`` the loss.
A method is ``("plain", None)``, ``("checkpoint_sequential", segments)``,
``("per_block", None)`` (``torch.utils.checkpoint.checkpoint`` around every
block, the last one too), ``("sac", None)`` (the same with torch's selective
checkpointing keeping the outputs of matmuls, convolutions and attention) or
``("remat", (budget, algorithm[, costs path[, options]]))`` (``options``: as
``remat.chain`` takes it, its default ``"auto"`` if not given).

Memory is the peak of a training step from the chain's opening until its
backward is done, the head and the loss after the blocks included, as the
budget counts it: the storage meter (remat/measure/meter.py) on CPU, the CUDA
allocator on GPU, plus the chain input. Time is the chain's alone: its blocks'
forward and their backward (from the gradient of the chain's output to that
of its input).
"""

import copy
import os
import platform
import random
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from ..chain import NO_LIMIT, chain
from ..solver.costs import Costs
from ..measure.cuda_peak import peak_allocated, reset_reader
from ..measure.meter import Instrument
from ..chain import explain
from ..measure.refine import SAMPLES
from ..runtime.option_modes import KEPT_OPS

__all__ = ["MODELS", "ChainMeter", "Clock", "Trial", "device_name", "gpt_spec", "job", "measure_all", "measure_costs",
           "median_costs", "resnet_spec", "run_step"]


class ChainMeter:
    """Peak bytes of a step from the chain's opening until its backward is done (the
    head and loss after the blocks included): on CPU, storages made while the gate
    is open plus the chain input ``held``; on CUDA, the allocator's peak while the
    gate is open, less what was allocated and not the chain's when it opened
    (``other``, taken as steady while it is open: what the model made before the
    chain, the embedding's dropout mask, say)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.inst = None if self.cuda else Instrument()
        self.peak = 0
        self.held = 0
        self.open = False
        self.chain_live = None   # CUDA: bytes of the chain's, as the gate last closed
        self.other = 0

    def __enter__(self):
        if not self.cuda:
            self.inst.__enter__()
            self.inst.set_gate(False)
        return self

    def gate(self, open_, grad_bytes=0):
        if self.cuda:
            if open_ == self.open:
                return
            torch.cuda.synchronize()
            now = torch.cuda.memory_allocated()
            if open_:
                if self.chain_live is None:
                    self.chain_live = self.held   # the chain input, which the budget counts
                self.other = now - self.chain_live - grad_bytes
                reset_reader()
            else:
                self.peak = max(self.peak, peak_allocated() - self.other)   # (a measuring call's resets carried)
                self.chain_live = now - self.other
        else:
            self.inst.set_gate(open_)
        self.open = open_

    def __exit__(self, *exc):
        if not self.cuda:
            self.inst.__exit__(*exc)
            self.peak = self.inst.peak + self.held
        return False


def gpt_spec(n_layer, n_embd, n_head, length, batch, vocab=256):
    """A GPT-style model (remat/models/gpt.py) on random tokens: its blocks are the chain."""
    def build():
        from ..models import GPT

        return GPT(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab, block_size=length, dropout=0.1)

    def data(step, device):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, vocab, (batch, length + 1), generator=g)
        return seq[:, :-1].to(device), seq[:, 1:].to(device)

    def pre(model, idx):
        tr = model.transformer
        return tr.drop(tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device)))

    def post(model, x, targets):
        logits = model.lm_head(model.transformer.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return build, data, pre, lambda m: list(m.transformer.h), post


def resnet_spec(depth, size, batch, classes=10):
    """A ResNet (remat/models/resnet.py) on random images: its stages are the chain."""
    def build():
        from .. import models

        return getattr(models, f"resnet{depth}")(num_classes=classes)

    def data(step, device):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch, 3, size, size, generator=g).to(device),
                torch.randint(0, classes, (batch,), generator=g).to(device))

    def post(model, x, targets):
        return F.cross_entropy(model.fc(torch.flatten(model.avgpool(x), 1)), targets)

    return build, data, lambda m, img: img, lambda m: m.stages(), post


# name: (cpu spec, gpu spec); each spec builds (build, data, pre, stages, post)
MODELS = {
    "gpt12": (lambda: gpt_spec(12, 128, 4, 128, 8), lambda: gpt_spec(12, 768, 12, 1024, 8, vocab=50257)),
    "gpt48": (lambda: gpt_spec(48, 64, 2, 64, 8), lambda: gpt_spec(48, 1024, 16, 1024, 4, vocab=50257)),
    "resnet101": (lambda: resnet_spec(101, 32, 4), lambda: resnet_spec(101, 224, 32, classes=1000)),
    "tiny": (lambda: gpt_spec(4, 32, 2, 32, 4, vocab=64), lambda: gpt_spec(4, 32, 2, 32, 4, vocab=64)),
}


def device_name(device):
    """The machine a figure came from, in words."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"


class Clock:
    """Time spent while the chain's gate is open (its forward and its backward)."""

    def __init__(self, meter, device):
        self.meter, self.device, self.total, self.t0 = meter, device, 0.0, None

    def gate(self, open_, memory=True):
        """Open or close the clock, and with ``memory`` the meter."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if open_:
            self.t0 = now
        elif self.t0 is not None:
            self.total += now - self.t0
            self.t0 = None
        if self.meter is not None and memory:
            self.meter.gate(open_)

    def enter_backward(self, grad):
        """The chain's backward starts: the clock runs again (the meter ran on)."""
        self.gate(True, memory=False)


def run_step(model, spec, method, batch, clock):
    _, _, pre, stages, post = spec
    x = pre(model, batch[0])
    if x.requires_grad:
        x.register_hook(lambda g: clock.gate(False))
    if clock.meter is not None:
        clock.meter.held = x.untyped_storage().nbytes()
    clock.gate(True)
    kind, arg = method
    blocks = stages(model)
    if kind == "plain":
        for b in blocks:
            x = b(x)
    elif kind == "checkpoint_sequential":
        x = checkpoint_sequential(blocks, arg, x, use_reentrant=False)
    elif kind == "per_block":   # (every block checkpointed, the last too: HF's gradient_checkpointing)
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=False)
    elif kind == "sac":   # (per-block selective checkpointing, keeping the expensive ops' outputs)
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=False, context_fn=_sac_contexts)
    else:
        with chain(budget=arg[0], algorithm=arg[1], costs=arg[2] if len(arg) > 2 else None,
                   options=arg[3] if len(arg) > 3 else "auto"):
            for b in blocks:
                x = b(x)
    clock.gate(False, memory=False)   # (the head and the loss: in the step's peak, not in the chain's time)
    x.register_hook(clock.enter_backward)
    loss = post(model, x, batch[1])
    del x
    loss.backward()
    clock.gate(False)
    return loss.item()


def _sac_contexts():
    """torch's selective checkpointing contexts keeping the outputs of the ops remat's
    option 1 keeps (``KEPT_OPS``: matmuls, convolutions, attention kernels), the
    policy of PyTorch's own SAC examples; the rest is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(_ctx, op, *_args, **_kwargs):
        return CheckpointPolicy.MUST_SAVE if op.overloadpacket in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def relative_difference(grads, reference):
    """The largest elementwise difference of ``grads`` from ``reference``, over the
    largest magnitude of the reference's tensor, across tensors (inf where one of
    them has a gradient and the other none)."""
    worst = 0.0
    for g, r in zip(grads, reference):
        if g is None or r is None:
            worst = worst if g is None and r is None else float("inf")
            continue
        scale = r.abs().max().item()
        diff = (g - r).abs().max().item()
        worst = max(worst, diff / scale if scale else (float("inf") if diff else 0.0))
    return worst


class Trial:
    """One method's figures while the methods take their steps in turn. Each has its own
    copy of the model's modules (so remat records each apart) sharing the one set of
    parameters and buffers: a copy each would hold every method's parameters and
    gradients at once, more than a GPU holds for a large model and a bench's dozens
    of methods. Every method computes the same gradients from the same parameters,
    so the optimizer steps once per round (``measure_all``)."""

    def __init__(self, base, method):
        self.method = method
        memo = {id(t): t for t in [*base.parameters(), *base.buffers()]}
        self.model = copy.deepcopy(base, memo)
        self.step_times, self.chain_times, self.losses, self.peak = [], [], [], 0
        self.grads_equal = True
        self.grad_diff = 0.0   # the largest relative difference where they were not
        self.schedule = None
        self.first_seconds = None

    def step(self, spec, i, steps, device, reference):
        """Step i: 0 is the warm-up, 1 to ``steps`` are timed, ``steps + 1`` is metered
        for the peak (the meter enters Python for every op: its step is not timed). ``reference``
        holds the first gradients of the round, which this step's must equal."""
        batch = spec[1](i, device)
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            p.grad.zero_()
        meter = ChainMeter(device) if i == steps + 1 else None
        clock = Clock(meter, device)
        torch.manual_seed(1000 + i)   # the same dropout draws for every method
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if meter is not None:
            with meter:
                self.losses.append(run_step(self.model, spec, self.method, batch, clock))
            self.peak = meter.peak
        else:
            self.losses.append(run_step(self.model, spec, self.method, batch, clock))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if 1 <= i <= steps:
            self.step_times.append(time.perf_counter() - t0)
            self.chain_times.append(clock.total)
        elif i == 0:
            self.first_seconds = time.perf_counter() - t0   # remat's measuring call
        if self.method[0] == "remat":
            self.schedule = explain().schedule
        grads = [p.grad for p in self.model.parameters()]
        if not reference:
            reference.extend(None if g is None else g.clone() for g in grads)
        elif not all((g is None and r is None) or (g is not None and r is not None and torch.equal(g, r))
                     for g, r in zip(grads, reference)):
            self.grads_equal = False
            self.grad_diff = max(self.grad_diff, relative_difference(grads, reference))

    def result(self):
        timed = bool(self.step_times)
        out = {"peak_bytes": self.peak, "step_seconds": statistics.median(self.step_times) if timed else None,
               "chain_seconds": statistics.median(self.chain_times) if timed else None, "losses": self.losses,
               "grads_equal": self.grads_equal, "grad_max_rel_diff": self.grad_diff,
               "step_times": list(self.step_times),
               "first_step_seconds": self.first_seconds}
        if self.method[0] == "remat":
            s = self.schedule
            out.update(predicted_seconds=s.time, predicted_peak=s.peak, budget=self.method[1][0],
                       algorithm=self.method[1][1], recomputations=s.recomputations(),
                       options=self.method[1][3] if len(self.method[1]) > 3 else True)
        return out


def measure_all(base, spec, methods, steps, device, bar=None, probe=None):
    """Median step and chain times of every method over ``steps`` timed steps after one
    warm-up, the methods taking each step in turn (a machine whose speed drifts over the
    run weighs on all of them alike), and each one's peak (metered on one more step,
    untimed; ``steps=0`` gives peaks only).
    ``probe(i)``, if given, runs once among the methods' step i."""
    from ..runtime import chain_call

    # every method's record stays cached (one evicted would measure again at its next step,
    # its first call's peak and time taken for the method's: 164 methods on gpt48's 48 stages)
    size, chain_call.CACHE_SIZE = chain_call.CACHE_SIZE, max(chain_call.CACHE_SIZE, 2 * len(methods) + 16)
    try:
        return _measure_all(base, spec, methods, steps, device, bar, probe)
    finally:
        chain_call.CACHE_SIZE = size


def _measure_all(base, spec, methods, steps, device, bar, probe):
    base = copy.deepcopy(base)
    trials = [Trial(base, m) for m in methods]
    opt = torch.optim.SGD(base.parameters(), lr=0.01)
    order = random.Random(0)
    for i in range(steps + 2):
        # in a new order each step: what one step leaves behind (the allocator's
        # free lists, caches, a probe's first call) weighs on no method steadily
        turn = list(trials) + ([None] if probe is not None else [])
        order.shuffle(turn)
        reference = []
        for trial in turn:
            if trial is None:
                probe(i)
            else:
                trial.step(spec, i, steps, device, reference)
        del reference
        opt.step()   # on the gradients of the round's last method (all are equal)
        if bar is not None:
            bar.update(1)
    return [t.result() for t in trials], [t.schedule for t in trials]


def measure_costs(base, spec, step, device, budget=None):
    """The costs remat measures on a fresh copy of ``base`` in a first call, times refined
    by the next two (remat/measure/refine.py), as the chain plans on them (its tail
    included): with
    ``budget``, the costs a job running the optimal schedule for it would get (the
    refining calls run that schedule: remat's work as it runs it is in the times),
    else those of store-all."""
    return job(base, spec, step, device, budget)[0]


def job(base, spec, step, device, budget=None, steps=0):
    """A job's start on a fresh copy of ``base``: (the costs of ``measure_costs``, the
    schedule remat solves on them and runs from then on, the chain's seconds in
    ``steps`` more steps of it), all on the batch of ``step``."""
    model = copy.deepcopy(base)
    method = ("remat", (NO_LIMIT, "store_all") if budget is None else (budget, "optimal"))
    batch = spec[1](step, device)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "costs.json")
        method = (method[0], method[1] + (path,))
        for _ in range(1 + SAMPLES):
            run_step(model, spec, method, batch, Clock(None, device))
        costs = explain().costs   # (as the chain plans on them: the head and loss its backward showed)
        times = []
        for _ in range(steps):
            clock = Clock(None, device)
            run_step(model, spec, method, batch, clock)
            times.append(clock.total)
        return costs, explain().schedule, times


def median_costs(measured):
    """Costs whose times are, stage by stage, the medians of ``measured``'s (their sizes agree)."""
    data = measured[0].to_dict()
    for field in ("fwd_time", "fwd_nograd_time", "bwd_time"):
        data[field] = [statistics.median(getattr(m, field)[i] for m in measured) for i in range(measured[0].length)]
    return Costs.from_dict(data)
