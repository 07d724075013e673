"""``python -m remat demo``: train a model under a memory budget and compare
it with plain PyTorch and ``torch.utils.checkpoint.checkpoint_sequential``,
all measured in one run.

Memory is the peak of the chain's activations during a training step: the
storage meter of remat/profile.py on CPU (the CUDA allocator on GPU), gated so
that it only looks while the blocks run forward and while their backward runs
(from the gradient of the chain's output to that of its input). Step time is
the median over the timed steps, after one warm-up (remat's first, measuring
call is reported on its own); the three methods take each step in turn, so
that a machine whose speed drifts weighs on all of them alike.
"""

import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint_sequential

from .chain import chain
from .errors import BudgetError
from .meter import Instrument
from .recording import explain
from .schedule import simulate
from .solve import minimum_budget, store_all
from .units import format_bytes, parse_bytes

__all__ = ["run_demo", "explain_model", "MODELS"]

MODELS = {
    # name: (constructor kwargs, batch, sequence length)
    "gpt": (dict(n_layer=8, n_head=4, n_embd=128, vocab_size=128, block_size=128, dropout=0.1), 8, 128),
    "gpt-tiny": (dict(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=32, dropout=0.1), 4, 32),
    "gpt-medium": (dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024, dropout=0.1), 8, 1024),
}


class _ChainMeter:
    """Peak bytes of the chain's tensors: on CPU, storages made while the gate is
    open (the chain's forward and backward) plus the chain input ``held``; on
    CUDA, the allocator's peak while the gate is open, everything included."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.inst = None if self.cuda else Instrument()
        self.peak = 0
        self.base = 0
        self.held = 0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.open = False
        else:
            self.inst.__enter__()
            self.inst.set_gate(False)
        return self

    def gate(self, open_):
        if self.cuda:
            if open_:
                torch.cuda.reset_peak_memory_stats()
            else:
                self.peak = max(self.peak, torch.cuda.max_memory_allocated() - self.base)
        else:
            self.inst.set_gate(open_)

    def enter_backward(self, grad):
        """The chain's backward starts with ``grad``, its output's gradient, made
        behind it (by the loss) and counted by the budget; then the gate opens."""
        if not self.cuda:
            self.inst.count(grad)
        self.gate(True)

    def __exit__(self, *exc):
        if not self.cuda:
            self.inst.__exit__(*exc)
            self.peak = self.inst.peak + self.held
        return False


def _loss(model, idx, targets, method, meter=None):
    """One forward of the GPT's pieces, the blocks run by ``method``."""
    tr = model.transformer
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = tr.drop(tr.wte(idx) + tr.wpe(pos))
    if meter is not None:
        x.register_hook(lambda g: meter.gate(False))
        meter.held = x.untyped_storage().nbytes()
        meter.gate(True)
    kind, arg = method
    if kind == "plain":
        for block in tr.h:
            x = block(x)
    elif kind == "checkpoint_sequential":
        x = checkpoint_sequential(list(tr.h), arg, x, use_reentrant=False)
    else:
        with chain(budget=arg[0], algorithm=arg[1]):
            for block in tr.h:
                x = block(x)
    if meter is not None:
        meter.gate(False)
        x.register_hook(meter.enter_backward)
    logits = model.lm_head(tr.ln_f(x))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def _data(vocab, batch, length, steps, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, vocab, (steps, batch, length + 1), generator=g)
    return [(s[:, :-1].to(device), s[:, 1:].to(device)) for s in seqs]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class _Trainer:
    """One method's model, optimizer and figures; ``step(i)`` trains on ``data[i]``."""

    def __init__(self, base, data, method, device):
        self.model = copy.deepcopy(base)
        self.data, self.method, self.device = data, method, device
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.losses, self.times, self.peak = [], [], 0

    def step(self, i):
        """Step ``i``; the last is metered for the chain's peak."""
        idx, targets = self.data[i]
        torch.manual_seed(1 + i)   # the same dropout draws for every method
        self.opt.zero_grad(set_to_none=False)
        _sync(self.device)
        t0 = time.perf_counter()
        if i == len(self.data) - 1:
            with _ChainMeter(self.device) as meter:
                loss = _loss(self.model, idx, targets, self.method, meter)
                loss.backward()
            self.peak = meter.peak
        else:
            loss = _loss(self.model, idx, targets, self.method)
            loss.backward()
        _sync(self.device)
        self.times.append(time.perf_counter() - t0)
        self.opt.step()
        self.losses.append(loss.item())

    def result(self):
        return self.losses, self.times, self.peak


def _train(trainers, steps, progress):
    """Train every one of ``trainers`` for ``steps`` steps, all taking step i before
    any takes step i+1 (a machine whose speed drifts weighs on all alike)."""
    for i in range(steps):
        for trainer in trainers:
            trainer.step(i)
            progress.update(1)
    return [t.result() for t in trainers]


def resolve_demo_budget(text, costs):
    """Bytes for a demo budget: a size ("6MiB"), or a share of storing everything ("50%")."""
    full = simulate(costs, store_all(costs.length)).peak
    least = minimum_budget(costs)
    text = str(text).strip()
    if text.endswith("%"):
        budget = int(float(text[:-1]) / 100 * full)
        if budget < least:
            raise BudgetError(
                f"remat: a budget of {text} of storing everything ({format_bytes(full)}) is "
                f"{format_bytes(budget)}, below this chain's minimum of {format_bytes(least)} "
                f"({100 * least / full:.0f}%); ask for more"
            )
        return budget
    return parse_bytes(text)


def run_demo(model="gpt", budget="40%", device="cpu", steps=12, out=print, progress=True):
    """Train ``model`` three ways and print the comparison table; return its rows.

    Args:
        model: a key of ``MODELS``.
        budget: remat's budget, a size ("6MiB") or a share of the chain's
            store-everything peak ("40%").
        device: "cpu" or "cuda".
        steps: training steps per method (the first is a warm-up).
    """
    from tqdm.auto import tqdm

    from .models import GPT

    kwargs, batch, length = MODELS[model]
    device = torch.device(device)
    torch.manual_seed(0)
    base = GPT(**kwargs).to(device)
    data = _data(kwargs["vocab_size"], batch, length, steps, device)
    n = kwargs["n_layer"]

    # remat's costs give the budget in bytes (a measuring call on a copy)
    probe = copy.deepcopy(base)
    _loss(probe, *data[0], ("remat", (2**50, "store_all"))).backward()
    costs = explain().costs
    budget_bytes = resolve_demo_budget(budget, costs)
    del probe

    bar = tqdm(total=steps * 3 + 2 * n, desc="remat demo", disable=not progress, leave=False)
    # checkpoint_sequential: its fastest segment count whose peak fits the budget
    best = None
    for segments in range(1, n + 1):
        trial = _train([_Trainer(base, data[:2], ("checkpoint_sequential", segments), device)], 2, bar)[0]
        if trial[2] <= budget_bytes and (best is None or segments < best):
            best = segments
    chosen = best if best is not None else n
    note = "" if best is not None else " (none fits the budget)"

    # the three methods train side by side, each step in turn
    plain, seq, rem = _train([_Trainer(base, data, ("plain", None), device),
                              _Trainer(base, data, ("checkpoint_sequential", chosen), device),
                              _Trainer(base, data, ("remat", (budget_bytes, "optimal")), device)], steps, bar)
    schedule = explain().schedule
    losses, first_seconds = rem[0], rem[1][0]
    rows = [_row("plain PyTorch", plain, None),
            _row(f"checkpoint_sequential, {chosen} segments{note}", seq, None),
            _row("remat (optimal)", rem, schedule)]
    bar.close()

    base_time = rows[0]["step_seconds"]
    lines = [
        f"remat demo: GPT ({n} blocks, width {kwargs['n_embd']}), batch {batch} x {length} tokens, "
        f"{steps} steps on {device.type}",
        f"budget: {format_bytes(budget_bytes)} ({budget} of storing everything, "
        f"{format_bytes(simulate(costs, store_all(n)).peak)}; chain minimum {format_bytes(minimum_budget(costs))})",
        "",
        f"{'method':<44} {'peak chain memory':>18} {'step time':>16} {'final loss':>11}",
    ]
    for row in rows:
        ratio = row["step_seconds"] / base_time
        lines.append(f"{row['method']:<44} {format_bytes(row['peak_bytes']):>18} "
                     f"{row['step_seconds'] * 1e3:9.1f} ms {ratio:4.2f}x {row['final_loss']:11.5f}")
    same = plain[0] == losses
    lines += [
        "",
        f"remat's schedule: {schedule.recomputations()} stage recomputations per step, predicted peak "
        f"{format_bytes(schedule.peak)}; its first (measuring) step took {first_seconds * 1e3:.0f} ms",
        f"losses of plain PyTorch and remat are {'identical at every step' if same else 'DIFFERENT'}",
    ]
    out("\n".join(lines))
    return {"budget_bytes": budget_bytes, "rows": rows, "losses_equal": same, "first_step_seconds": first_seconds}


def _row(name, result, schedule):
    losses, times, peak = result
    timed = times[1:] if len(times) > 1 else times
    return {
        "method": name,
        "peak_bytes": peak,
        "step_seconds": statistics.median(timed),
        "final_loss": losses[-1],
        "predicted_peak": None if schedule is None else schedule.peak,
    }


def explain_model(model="gpt", budget="40%", device="cpu", plot_dir=None, out=print):
    """Measure ``model``'s chain, solve for ``budget``, print ``remat.explain()``
    and, with ``plot_dir``, save its memory timeline and time-memory curve."""
    from .models import GPT

    kwargs, batch, length = MODELS[model]
    device = torch.device(device)
    torch.manual_seed(0)
    net = GPT(**kwargs).to(device)
    data = _data(kwargs["vocab_size"], batch, length, 2, device)
    _loss(net, *data[0], ("remat", (2**50, "store_all"))).backward()
    budget_bytes = resolve_demo_budget(budget, explain().costs)
    _loss(net, *data[1], ("remat", (budget_bytes, "optimal"))).backward()
    info = explain()
    out(str(info))
    if plot_dir is not None:
        import os

        from . import plot

        os.makedirs(plot_dir, exist_ok=True)
        paths = [plot.timeline(info.costs, info.schedule, os.path.join(plot_dir, "timeline.png")),
                 plot.tradeoff(info.costs, os.path.join(plot_dir, "tradeoff.png"))]
        out("saved " + " and ".join(paths))
    return info
