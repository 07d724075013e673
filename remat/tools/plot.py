"""Pictures of a schedule (needs matplotlib: ``missing()`` says how to install it).

``timeline``: the memory a schedule holds, op by op, against the budget.
``tradeoff``: predicted step time against budget, for the optimal schedule and
for periodic checkpointing (what ``checkpoint_sequential`` does).
``bench_plot``: a trade-off bench's measured step time against peak, every method's.
"""

import sys

from ..solver.schedule import B, Fall, Fck, Fn, Loss, simulate
from ..solver.solve import minimum_budget, periodic, solve, store_all
from ..errors import BudgetError, UsageError
from ..units import format_bytes

__all__ = ["timeline", "tradeoff", "bench_plot", "missing"]

_COLOURS = {Fn: "#9ecae1", Fck: "#3182bd", Fall: "#31a354", B: "#e6550d"}


def missing():
    """None if matplotlib can be imported; else what to run to install it, into the
    Python running this (remat is installed from its repository, not an index)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return None
    return (f"remat: plots need matplotlib, which this Python does not have; install it with "
            f"`{sys.executable} -m pip install matplotlib`")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(missing() or "remat: plots need matplotlib, which failed to import") from None
    return plt


def _mib(n):
    return n / 2**20


def timeline(costs, schedule, path, budget=None, title=None):
    """Save the memory timeline of ``schedule`` on ``costs`` to ``path`` (PNG).

    Each op is a bar up to its peak; the line is what is held after it.
    """
    plt = _pyplot()
    trace = []
    simulate(costs, schedule, trace)
    fig, ax = plt.subplots(figsize=(max(6.0, min(18.0, len(trace) * 0.12)), 4.0))
    xs = range(len(trace))
    ax.bar(xs, [_mib(d) for _, d, _ in trace], width=0.9,
           color=[_COLOURS.get(type(op), "#999999") for op, _, _ in trace])
    ax.step(xs, [_mib(m) for _, _, m in trace], where="mid", color="black", linewidth=1, label="held after the op")
    if budget is None:
        budget = schedule.budget
    if budget is not None:
        ax.axhline(_mib(budget), color="red", linestyle="--", label=f"budget {format_bytes(budget)}")
    loss = next(i for i, (op, _, _) in enumerate(trace) if op is Loss)
    ax.axvline(loss, color="grey", linewidth=0.8)
    ax.text(loss, ax.get_ylim()[1] * 0.97, " backward", va="top", fontsize=8, color="grey")
    ax.text(loss, ax.get_ylim()[1] * 0.97, "forward ", va="top", ha="right", fontsize=8, color="grey")
    for kind, colour in _COLOURS.items():
        ax.bar([0], [0], color=colour, label=kind.__name__)
    ax.set_xlabel("op")
    ax.set_ylabel("MiB")
    ax.set_title(title or f"{schedule.algorithm} schedule: peak {format_bytes(schedule.peak)}, "
                 f"{schedule.recomputations()} recomputations")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def tradeoff(costs, path, points=40, title=None):
    """Save predicted step time against peak memory: optimal for budgets from the
    minimum to storing everything, and periodic checkpointing for every period."""
    if not isinstance(points, int) or isinstance(points, bool) or points < 1:
        raise UsageError(f"remat: tradeoff samples a whole number of points, at least 1, not {points!r}")
    plt = _pyplot()
    n = costs.length
    low = minimum_budget(costs)
    high = simulate(costs, store_all(n)).peak
    opt = []
    for i in range(points + 1):
        budget = max(int(low + (high - low) * i / points), low, 1)
        try:
            s = solve(costs, budget)
        except BudgetError as exc:   # (a long chain is solved on groups, whose least is above the exact one)
            s = solve(costs, max(budget, exc.minimum))
        opt.append((_mib(s.peak), s.time * 1e3))
    per = []
    for k in range(1, costs.stages + 1):
        sim = simulate(costs, periodic(n, k, costs.tail))
        per.append((_mib(sim.peak), sim.time * 1e3, k))
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    ax.step([p for p, _ in opt], [t for _, t in opt], where="post", label="remat optimal", color="#31a354")
    ax.scatter([p for p, _, _ in per], [t for _, t, _ in per], label="periodic (checkpoint_sequential)",
               color="#3182bd", zorder=3, s=14)
    ax.set_xlabel("peak activation memory (MiB)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title or f"time against memory, {costs.stages} stages")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bench_plot(result, path):
    """Step time against peak memory for every method (needs matplotlib)."""
    from .bench import overhead

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
    for kind, label, style in (("per_block", "per-block checkpointing", "D"), ("sac", "per-block SAC (matmuls kept)", "v")):
        series([r for r in runs if r.get("baseline") == kind], label, style, "#e6550d")
    series([r for r in runs if r.get("algorithm") == "optimal"], "remat optimal", "s-", "#31a354")
    series([r for r in runs if str(r.get("algorithm", "")).startswith("periodic")], "remat periodic",
           "^:", "#756bb1")
    ax.plot([plain["peak_bytes"] / 2**20], [1.0], "k*", markersize=10, label="plain PyTorch")
    # (the baselines' range, a margin above: remat at its least budget may run several times plain)
    top = 1.25 * max(overhead(r) + 1 for r in runs if r["method"] != "remat")
    off = [r for r in runs if r["method"] == "remat" and overhead(r) + 1 > top]
    if off:
        ax.set_ylim(top=top)
        least = min(off, key=lambda r: r["peak_bytes"])
        ax.annotate(f"remat at {least['peak_bytes'] / 2**20:.1f} MiB: {overhead(least) + 1:.1f}x (off the chart)",
                    (least["peak_bytes"] / 2**20, top), xytext=(0, -14), textcoords="offset points", fontsize=7)
    ax.set_xlabel("peak memory of the step from the chain's opening (MiB)")
    ax.set_ylabel("median step time / plain PyTorch's")
    ax.set_title(f"{result['model']}: {result['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

