"""``python -m remat bench``: remat against plain PyTorch and
``checkpoint_sequential`` on one model, budget by budget, in one process.

For every method it records the peak of the chain's activations during a
training step (the storage meter on CPU, the CUDA allocator on GPU, gated to
the chain's forward and backward as in remat/demo.py), the median step time
and the median time of the chain alone (its forward plus its backward), and
for remat the schedule's predicted time and peak.
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
from torch.utils.checkpoint import checkpoint_sequential

from .chain import chain
from .costs import Costs
from .demo import _ChainMeter
from .recording import explain
from .schedule import simulate
from .solve import minimum_budget, solve, store_all
from .units import format_bytes

__all__ = ["MODELS", "run_bench", "write_bench", "device_name", "summarise"]


def _gpt(n_layer, n_embd, n_head, length, batch, vocab=256):
    def build():
        from .models import GPT

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


def _resnet(depth, size, batch, classes=10):
    def build():
        from . import models

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
    "gpt12": (lambda: _gpt(12, 128, 4, 128, 8), lambda: _gpt(12, 768, 12, 1024, 8, vocab=50257)),
    "gpt48": (lambda: _gpt(48, 64, 2, 64, 8), lambda: _gpt(48, 1024, 16, 1024, 4, vocab=50257)),
    "resnet101": (lambda: _resnet(101, 32, 4), lambda: _resnet(101, 224, 32, classes=1000)),
    "tiny": (lambda: _gpt(4, 32, 2, 32, 4, vocab=64), lambda: _gpt(4, 32, 2, 32, 4, vocab=64)),
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


class _Clock:
    """Time spent while the chain's gate is open (its forward and its backward)."""

    def __init__(self, meter, device):
        self.meter, self.device, self.total, self.t0 = meter, device, 0.0, None

    def gate(self, open_):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if open_:
            self.t0 = now
        elif self.t0 is not None:
            self.total += now - self.t0
            self.t0 = None
        if self.meter is not None:
            self.meter.gate(open_)

    def enter_backward(self, grad):
        """The chain's backward starts (``_ChainMeter.enter_backward``)."""
        if self.meter is not None and self.meter.inst is not None:
            self.meter.inst.count(grad)
        self.gate(True)


def _step(model, spec, method, batch, clock):
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
    else:
        with chain(budget=arg[0], algorithm=arg[1], costs=arg[2] if len(arg) > 2 else None):
            for b in blocks:
                x = b(x)
    clock.gate(False)
    x.register_hook(clock.enter_backward)
    loss = post(model, x, batch[1])
    del x
    loss.backward()
    clock.gate(False)
    return loss.item()


class _Trial:
    """One method's figures while the methods take their steps in turn. Each has its own
    copy of the model's modules (so remat records each apart) sharing the one set of
    parameters and buffers: a copy each would hold every method's parameters and
    gradients at once (ResNet-101 times 80 methods does not fit in 24 GiB). Every
    method computes the same gradients from the same parameters, so the optimizer
    steps once per round (``_measure_all``)."""

    def __init__(self, base, method):
        self.method = method
        memo = {id(t): t for t in [*base.parameters(), *base.buffers()]}
        self.model = copy.deepcopy(base, memo)
        self.step_times, self.chain_times, self.losses, self.peak = [], [], [], 0
        self.grads_equal = True
        self.schedule = None

    def step(self, spec, i, steps, device, reference):
        """Step i (0 is the warm-up; the last is metered for the peak). ``reference``
        holds the first gradients of the round, which this step's must equal."""
        batch = spec[1](i, device)
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            p.grad.zero_()
        meter = _ChainMeter(device) if i == steps else None
        clock = _Clock(meter, device)
        torch.manual_seed(1000 + i)   # the same dropout draws for every method
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if meter is not None:
            with meter:
                self.losses.append(_step(self.model, spec, self.method, batch, clock))
            self.peak = meter.peak
        else:
            self.losses.append(_step(self.model, spec, self.method, batch, clock))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i > 0:
            self.step_times.append(time.perf_counter() - t0)
            self.chain_times.append(clock.total)
        if self.method[0] == "remat":
            self.schedule = explain().schedule
        grads = [p.grad for p in self.model.parameters()]
        if not reference:
            reference.extend(None if g is None else g.clone() for g in grads)
        elif not all((g is None and r is None) or (g is not None and r is not None and torch.equal(g, r))
                     for g, r in zip(grads, reference)):
            self.grads_equal = False

    def result(self):
        out = {"peak_bytes": self.peak, "step_seconds": statistics.median(self.step_times),
               "chain_seconds": statistics.median(self.chain_times), "losses": self.losses,
               "grads_equal": self.grads_equal}
        if self.method[0] == "remat":
            s = self.schedule
            out.update(predicted_seconds=s.time, predicted_peak=s.peak, budget=self.method[1][0],
                       algorithm=self.method[1][1], recomputations=s.recomputations())
        return out


def _measure_all(base, spec, methods, steps, device, bar=None, probe=None):
    """Median step and chain times of every method over ``steps`` timed steps after one
    warm-up, the methods taking each step in turn (a machine whose speed drifts over the
    run weighs on all of them alike), and each one's peak (metered on its last step).
    ``probe(i)``, if given, runs once among the methods' step i."""
    base = copy.deepcopy(base)
    trials = [_Trial(base, m) for m in methods]
    opt = torch.optim.SGD(base.parameters(), lr=0.01)
    order = random.Random(0)
    for i in range(steps + 1):
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


def measure_costs(base, spec, step, device):
    """The costs remat's first call measures on a fresh copy of ``base``."""
    model = copy.deepcopy(base)
    _step(model, spec, ("remat", (2**50, "store_all")), spec[1](step, device), _Clock(None, device))
    return explain().costs


def median_costs(measured):
    """Costs whose times are, stage by stage, the medians of ``measured``'s (their sizes agree)."""
    data = measured[0].to_dict()
    for field in ("fwd_time", "fwd_nograd_time", "bwd_time"):
        data[field] = [statistics.median(getattr(m, field)[i] for m in measured) for i in range(measured[0].length)]
    return Costs.from_dict(data)


def run_bench(model="gpt12", device="cpu", steps=10, budgets=8, progress=True, out=print):
    """Run every method on ``model``; return the result dict (see benchmarks/README.md)."""
    from tqdm.auto import tqdm

    device = torch.device(device)
    spec = MODELS[model][1 if device.type == "cuda" else 0]()
    torch.manual_seed(0)
    base = spec[0]().to(device)
    n = len(spec[3](base))
    # costs: one measuring call through remat, in a process warmed by two plain
    # steps (a cold first step runs slower and would skew the times remat plans
    # on), saved to a file that every remat run plans on (as a job reuses costs
    # measured on a quiet machine): methods differ by their schedules only
    probe = copy.deepcopy(base)
    for i in range(2):
        _step(probe, spec, ("plain", None), spec[1](i, device), _Clock(None, device))
    folder = tempfile.TemporaryDirectory()
    path = os.path.join(folder.name, "costs.json")
    _step(probe, spec, ("remat", (2**50, "store_all", path)), spec[1](0, device), _Clock(None, device))
    costs = explain().costs
    del probe
    low, high = minimum_budget(costs), simulate(costs, store_all(n)).peak
    grid = [int(low + (high - low) * i / (budgets - 1)) for i in range(budgets)]
    # the peak of every checkpoint_sequential point first (a warm-up step and a
    # metered one: peaks do not drift), then every method in one run, taking the
    # steps in turn: remat on the grid and at each of those peaks (the comparison
    # of the targets), against the same plain steps
    cs = [("checkpoint_sequential", s) for s in range(1, n + 1)]
    with tqdm(total=2, desc=f"bench {model} (peaks)", disable=not progress, leave=False) as bar:
        peaks = [r["peak_bytes"] for r in _measure_all(base, spec, cs, 1, device, bar)[0]]
    methods, tags = [("plain", None)] + cs, [None] * (n + 1)
    for b in grid:
        methods.append(("remat", (b, "optimal", path)))
        tags.append("grid")
        periodic = _best_periodic(costs, b, n)
        if periodic is not None:
            methods.append(("remat", (b, periodic, path)))
            tags.append("grid")
    at = {}
    for (_, segments), peak in zip(cs, peaks):
        if peak >= low and peak not in grid:
            at.setdefault(peak, []).append(segments)
    for b, segments in sorted(at.items()):
        methods.append(("remat", (b, "optimal", path)))
        tags.append(segments)
    # a first call on a fresh copy after each step of the run: costs measured at the
    # machine's speed of the run, on which each schedule's time is predicted again
    # (the planning costs' single samples carry the speed of their own moment)
    window = []
    with tqdm(total=steps + 1, desc=f"bench {model} ({len(methods)} methods)", disable=not progress,
              leave=False) as bar:
        results, schedules = _measure_all(base, spec, methods, steps, device, bar,
                                          probe=lambda i: window.append(measure_costs(base, spec, i, device)))
    run_costs = median_costs(window[1:])
    for method, r, s in zip(methods, results, schedules):
        if method[0] == "remat":
            r["predicted_seconds_run_costs"] = simulate(run_costs, s).time
    for method, tag, r in zip(methods, tags, results):
        r["method"] = method[0] if method[0] != "checkpoint_sequential" else f"checkpoint_sequential({method[1]})"
        if method[0] == "checkpoint_sequential":
            r["segments"] = method[1]
        if tag not in (None, "grid"):
            r["at_segments"] = tag
        r["plain_step_seconds"] = results[0]["step_seconds"]
    result = {
        "model": model, "device": device.type, "machine": device_name(device), "torch": torch.__version__,
        "stages": n, "steps": steps, "min_budget": low, "store_all_peak": high,
        "costs": costs.to_dict(), "run_costs": run_costs.to_dict(), "runs": results,
    }
    result["summary"] = summarise(result)
    out(table(result))
    return result


def _best_periodic(costs, budget, n):
    """The fastest periodic(k) (checkpoint_sequential's schedule run by remat) fitting ``budget``."""
    best = None
    for k in range(1, n + 1):
        s = solve(costs, 2**50, f"periodic({k})")
        if s.peak <= budget and (best is None or s.time < best[0]):
            best = (s.time, f"periodic({k})")
    return None if best is None else best[1]


def overhead(run):
    """Step time over the plain step of the same run, less one."""
    return run["step_seconds"] / run.get("plain_step_seconds", run["step_seconds"]) - 1


def summarise(result):
    """Targets of the trade-off benchmark, from one result dict."""
    runs = result["runs"]
    plain = next(r for r in runs if r["method"] == "plain")
    optimal = [r for r in runs if r.get("algorithm") == "optimal"]
    cs = [r for r in runs if r["method"].startswith("checkpoint_sequential")]
    points = []
    for c in cs:
        fits = [r for r in optimal if r["peak_bytes"] <= c["peak_bytes"]]
        if not fits:
            points.append({"segments": c["segments"], "remat": None})
            continue
        best = min(fits, key=overhead)
        oc, orr = overhead(c), overhead(best)
        points.append({"segments": c["segments"], "cs_overhead": oc, "remat_overhead": orr,
                       "remat_budget": best["budget"], "remat_not_slower": orr <= oc,
                       "reduction": (1 - orr / oc) if oc > 0.02 else None})
    reductions = [p["reduction"] for p in points if p.get("reduction") is not None]
    remat = [r for r in runs if r["method"] == "remat"]
    return {
        "points": points,
        "dominates": all(p.get("remat_not_slower", False) for p in points),
        "mean_overhead_reduction": statistics.mean(reductions) if reductions else None,
        "all_under_budget": all(r["peak_bytes"] <= r["budget"] for r in remat),
        "max_time_error": max(abs(r["chain_seconds"] / r["predicted_seconds"] - 1) for r in remat),
        "max_time_error_run_costs": max(abs(r["chain_seconds"] / r["predicted_seconds_run_costs"] - 1)
                                        for r in remat if "predicted_seconds_run_costs" in r),
        "losses_equal": all(r["losses"] == plain["losses"] for r in remat + cs),
        "grads_equal": all(r.get("grads_equal", True) for r in runs),
    }


def table(result):
    """A markdown table of one result."""
    plain = next(r for r in result["runs"] if r["method"] == "plain")
    lines = [f"### {result['model']} on {result['machine']} (torch {result['torch']}, {result['stages']} stages)",
             "", "| method | budget | peak | step ms | x plain | chain ms | predicted ms | predicted ms (run's costs) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        name = r["method"] if r["method"] != "remat" else f"remat {r['algorithm']}"
        lines.append(
            f"| {name} | {format_bytes(r['budget']) if 'budget' in r else ''} | {format_bytes(r['peak_bytes'])} "
            f"| {r['step_seconds'] * 1e3:.1f} | {overhead(r) + 1:.2f} "
            f"| {r['chain_seconds'] * 1e3:.1f} | {_ms(r, 'predicted_seconds')} | {_ms(r, 'predicted_seconds_run_costs')} |")
    s = result["summary"]
    red = s["mean_overhead_reduction"]
    lines += ["", f"remat dominates checkpoint_sequential: {s['dominates']}; mean overhead reduction: "
                  f"{'n/a' if red is None else f'{red:.0%}'}; every remat peak under its budget: "
                  f"{s['all_under_budget']}; worst |measured/predicted - 1| of chain time: {s['max_time_error']:.1%} "
                  f"(on costs measured during the run: {s['max_time_error_run_costs']:.1%}); "
                  f"losses equal to plain: {s['losses_equal']}; gradients equal: {s.get('grads_equal')}"]
    return "\n".join(lines)


def _ms(run, field):
    return f"{run[field] * 1e3:.1f}" if field in run else ""


def plot(result, path):
    """Step time against peak memory for every method (needs matplotlib)."""
    from .plot import _pyplot

    plt = _pyplot()
    runs = result["runs"]
    plain = next(r for r in runs if r["method"] == "plain")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))

    def series(rs, label, style, colour):
        rs = sorted(rs, key=lambda r: r["peak_bytes"])
        ax.plot([r["peak_bytes"] / 2**20 for r in rs], [overhead(r) + 1 for r in rs], style,
                label=label, color=colour, markersize=4)

    series([r for r in runs if r["method"].startswith("checkpoint_sequential")], "checkpoint_sequential",
           "o--", "#3182bd")
    series([r for r in runs if r.get("algorithm") == "optimal"], "remat optimal", "s-", "#31a354")
    series([r for r in runs if str(r.get("algorithm", "")).startswith("periodic")], "remat periodic",
           "^:", "#756bb1")
    ax.plot([plain["peak_bytes"] / 2**20], [1.0], "k*", markersize=10, label="plain PyTorch")
    ax.set_xlabel("peak chain activation memory (MiB)")
    ax.set_ylabel("median step time / plain PyTorch's")
    ax.set_title(f"{result['model']}: {result['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_bench(model, device="cpu", steps=10, budgets=8, out_dir=None, progress=True):
    """Run the benchmark; with ``out_dir`` write its JSON, markdown table and plot there."""
    import json
    import os

    result = run_bench(model, device, steps, budgets, progress)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, f"{model}-{result['device']}")
        with open(stem + ".json", "w") as fh:
            json.dump(result, fh, indent=1)
        with open(stem + ".md", "w") as fh:
            fh.write(table(result) + "\n")
        try:
            plot(result, stem + ".png")
        except ImportError as exc:
            print(exc)
    return result
