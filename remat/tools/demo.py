"""``python -m remat demo``: train a model under a memory budget and compare
it with plain PyTorch, ``torch.utils.checkpoint.checkpoint_sequential`` (its
fastest segment count within the budget) and per-block checkpointing (every
block under ``torch.utils.checkpoint.checkpoint``, as Hugging Face's
``gradient_checkpointing_enable()`` does), all measured in one run
(remat/tools/trials.py): the methods take each step in turn, so that a machine
whose speed drifts weighs on all of them alike. One line states remat's gain
against the fastest other method within the budget, as measured.

Memory is the peak of the chain's activations during a training step, metered
on a last, untimed step. Step time is the median over the timed steps, after
one warm-up (remat's first, measuring call is reported on its own).
"""

import math
import statistics

import torch

from ..chain import explain, parse_budget, resolve_budget
from ..errors import BudgetError, UsageError
from ..solver.schedule import simulate
from ..solver.solve import minimum_budget, store_all
from .trials import Clock, gpt_spec, measure_all, measure_costs, run_step
from ..units import format_bytes

__all__ = ["run_demo", "explain_model", "MODELS"]

MODELS = {
    # name: gpt_spec's arguments
    "gpt": dict(n_layer=8, n_embd=128, n_head=4, length=128, batch=8, vocab=128),
    "gpt-tiny": dict(n_layer=4, n_embd=32, n_head=2, length=32, batch=4, vocab=64),
    "gpt-medium": dict(n_layer=24, n_embd=1024, n_head=16, length=1024, batch=8, vocab=50257),
}


def parse_demo_budget(text):
    """A demo budget's text as ("share", fraction of storing everything), or as
    ``remat.chain`` takes it ("bytes", an int of bytes or "auto"); a malformed one
    raises ``BudgetError`` (before anything is measured)."""
    text = str(text).strip()
    if not text.endswith("%"):
        return "bytes", parse_budget(text)
    try:
        share = float(text[:-1])
    except ValueError:
        share = math.nan
    if not 0 < share < math.inf:
        raise BudgetError(f"remat: a budget of {text!r}: a share of storing everything is a positive "
                          f"number of percent, e.g. 40%")
    if share > 100:
        raise BudgetError(f"remat: a budget of {text!r}: 100% already stores everything; ask for 100% or less")
    return "share", share / 100


def resolve_demo_budget(text, costs, device):
    """Bytes for a demo budget: a size ("6MiB"), "auto" (``device``'s free memory less
    a margin), or a share of storing everything ("50%")."""
    kind, value = parse_demo_budget(text)
    full = simulate(costs, store_all(costs.length)).peak
    least = minimum_budget(costs)
    budget = resolve_budget(value, device) if kind == "bytes" else int(value * full)
    if budget < least:   # (said now, before the other methods' steps: not as remat's first step fails)
        share = f" of storing everything ({format_bytes(full)}) is {format_bytes(budget)}" if kind != "bytes" else ""
        raise BudgetError(
            f"remat: a budget of {str(text).strip()}{share}, below this chain's minimum of {format_bytes(least)} "
            f"({100 * least / full:.0f}% of storing everything); ask for more", least)
    return budget


def run_demo(model="gpt", budget="40%", device="cpu", steps=12, out=print, progress=True):
    """Train ``model`` four ways and print the comparison table; return its rows.

    Args:
        model: a key of ``MODELS``.
        budget: remat's budget, a size ("6MiB") or a share of the chain's
            store-everything peak ("40%").
        device: "cpu" or "cuda".
        steps: training steps (the first is a warm-up, the last is metered for
            memory, at least one between them is timed).
    """
    from tqdm.auto import tqdm

    kw = MODELS[model]
    spec = gpt_spec(**kw)
    device = torch.device(device)
    torch.manual_seed(0)
    base = spec[0]().to(device)
    n = kw["n_layer"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 3:
        raise UsageError(f"remat demo: steps must be an int of at least 3 (a warm-up, a timed step and a metered "
                         f"one), got {steps!r}")
    timed = steps - 2

    # remat's costs give the budget in bytes (a measuring call on a copy)
    costs = measure_costs(base, spec, 0, device)
    budget_bytes = resolve_demo_budget(budget, costs, device)

    # (what it counts: the two runs that find checkpoint_sequential's segments, then each
    # step of the three methods; no ETA, which the measuring steps would skew)
    bar = tqdm(total=2 + timed + 2, desc=f"remat demo: 2 probes, then {timed + 2} steps of each method",
               unit=" run", disable=not progress, leave=True, bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}]")
    chosen, note = _segments_within(budget_bytes, base, spec, n, device, bar)

    # the methods train side by side, each step in turn
    methods = [("plain", None), ("checkpoint_sequential", chosen), ("per_block", None),
               ("remat", (budget_bytes, "optimal"))]
    (plain, seq, block, rem), schedules = measure_all(base, spec, methods, timed, device, bar)
    bar.close()
    schedule = schedules[3]
    rows = [_row("plain PyTorch", plain, None),
            _row(f"checkpoint_sequential, {chosen} segments{note}", seq, None),
            _row("per-block checkpointing", block, None),
            _row("remat (optimal)", rem, schedule)]

    base_time = rows[0]["step_seconds"]
    lines = [
        f"remat demo: GPT ({n} blocks, width {kw['n_embd']}), batch {kw['batch']} x {kw['length']} tokens, "
        f"{timed + 2} steps on {device.type}",
        f"budget: {format_bytes(budget_bytes)} ({f'{budget} of ' if str(budget).strip().endswith('%') else ''}"
        f"storing everything: {format_bytes(simulate(costs, store_all(costs.length)).peak)}; "
        f"chain minimum {format_bytes(minimum_budget(costs))})",
        "",
        f"{'method':<44} {'peak step memory':>18} {'step time':>16} {'final loss':>11}",
        f"{'':<44} {'(measured)':>18} {f'(median of {timed})':>16}",
    ]
    for row in rows:
        ratio = row["step_seconds"] / base_time
        lines.append(f"{row['method']:<44} {format_bytes(row['peak_bytes']):>18} "
                     f"{row['step_seconds'] * 1e3:9.1f} ms {ratio:4.2f}x {row['final_loss']:11.5f}")
    same = plain["losses"] == rem["losses"] and rem["grads_equal"]
    lines += [
        "",
        gain_line(rows, budget_bytes),
        f"remat's schedule: {schedule.recomputations()} stage recomputations per step, predicted peak "
        f"{format_bytes(schedule.peak)} (a prediction; the table's peaks are measured); its first (measuring) "
        f"step took {rem['first_step_seconds'] * 1e3:.0f} ms",
        f"losses and gradients of plain PyTorch and remat are {'identical at every step' if same else 'DIFFERENT'}",
    ]
    out("\n".join(lines))
    return {"budget_bytes": budget_bytes, "rows": rows, "losses_equal": same,
            "first_step_seconds": rem["first_step_seconds"]}


def gain_line(rows, budget_bytes):
    """The demo's claim, one line: remat's step time against the fastest of the other
    methods whose measured peak is within the budget (``rows``: plain PyTorch's first,
    remat's last), as overheads over plain PyTorch's step. Where the rows have the
    time of each step (``step_times``, the methods taking each step in turn), the
    verdict is step by step: remat is as fast where the middle half of its steps'
    differences from the other's straddles nothing (a busy machine's noise)."""
    plain, rem = rows[0], rows[-1]
    base = plain["step_seconds"]
    others = [r for r in rows[:-1] if r["peak_bytes"] <= budget_bytes]
    if not others:
        return (f"remat: the only method within the budget of {format_bytes(budget_bytes)}, at "
                f"{rem['step_seconds'] / base:.2f}x plain PyTorch's step time")
    best = min(others, key=lambda r: r["step_seconds"])
    if best is plain:
        return (f"remat: plain PyTorch fits the budget of {format_bytes(budget_bytes)} "
                f"({format_bytes(plain['peak_bytes'])}); remat runs at {rem['step_seconds'] / base:.2f}x its step time")
    theirs, ours = best["step_seconds"] / base - 1, rem["step_seconds"] / base - 1
    pairs = [(a - b) / base for a, b in zip(rem.get("step_times") or (), best.get("step_times") or ())]
    spread = statistics.quantiles(pairs, n=4)[::2] if len(pairs) >= 4 else None   # (first and third quartiles)
    held = sum(d < 0 for d in pairs) if ours < theirs else sum(d > 0 for d in pairs)
    steps = f" in {held} of {len(pairs)} steps" if pairs else ""
    if abs(ours - theirs) < 0.005:
        verdict = "as fast (within half a hundredth of a plain step)"
    elif spread is not None and spread[0] < 0 < spread[1]:
        verdict = (f"as fast, within this machine's noise (step by step, remat's time less theirs: "
                   f"{spread[0]:+.2f} to {spread[1]:+.2f} of a plain step in the middle half of {len(pairs)} steps)")
    elif ours < theirs:
        verdict = (f"{100 * (1 - ours / theirs):.0f}% less overhead" if theirs > 0 else "faster") + steps
    else:
        verdict = f"slower by {ours - theirs:.2f} of a plain step" + steps
    return (f"remat at {format_bytes(rem['peak_bytes'])}, {1 + ours:.2f}x plain PyTorch's step, against "
            f"{best['method'].split(' (')[0]} at {format_bytes(best['peak_bytes'])}, {1 + theirs:.2f}x, the fastest "
            f"other method within the budget: {verdict}")


def _segments_within(budget_bytes, base, spec, n, device, bar):
    """checkpoint_sequential's fastest segment count (the fewest) whose peak fits the
    budget, each count's peak measured; n if none does, with a note saying so."""
    segments = [("checkpoint_sequential", s) for s in range(1, n + 1)]
    peaks = [r["peak_bytes"] for r in measure_all(base, spec, segments, 0, device, bar)[0]]
    fits = [s for (_, s), peak in zip(segments, peaks) if peak <= budget_bytes]
    return (fits[0], "") if fits else (n, " (none fits the budget)")


def _row(name, result, schedule):
    return {
        "method": name,
        "peak_bytes": result["peak_bytes"],
        "step_seconds": result["step_seconds"],
        "final_loss": result["losses"][-1],
        "step_times": result.get("step_times"),
        "predicted_peak": None if schedule is None else schedule.peak,
    }


def explain_model(model="gpt", budget="40%", device="cpu", plot_dir=None, out=print):
    """Measure ``model``'s chain, solve for ``budget``, print ``remat.explain()``
    and, with ``plot_dir``, save its memory timeline and time-memory curve."""
    spec = gpt_spec(**MODELS[model])
    device = torch.device(device)
    torch.manual_seed(0)
    net = spec[0]().to(device)
    budget_bytes = resolve_demo_budget(budget, measure_costs(net, spec, 0, device), device)
    run_step(net, spec, ("remat", (budget_bytes, "optimal")), spec[1](1, device), Clock(None, device))
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
