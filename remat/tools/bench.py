"""``python -m remat bench``: remat against plain PyTorch and
``checkpoint_sequential`` on one model, budget by budget, in one process.

For every method it records the peak of the chain's activations during a
training step (the storage meter on CPU, the CUDA allocator on GPU, gated to
the chain's forward and backward, remat/tools/trials.py), the median step time
and the median time of the chain alone (its forward plus its backward), and
for remat the schedule's predicted time and peak.
"""

import copy
import math
import os
import statistics
import tempfile

import torch

from ..solver.costs import Costs
from ..errors import BudgetError
from ..measure.refine import SAMPLES
from ..solver.schedule import B, Fall, Fck, Fn, Loss, simulate
from ..chain import NO_LIMIT, explain as remat_explain
from ..solver.solve import best_periodic, min_memory, minimum_budget, solve, store_all, time_bound
from .trials import MODELS, Clock, device_name, measure_all, measure_costs, median_costs, run_step
from ..units import format_bytes
from .plot import bench_plot

__all__ = ["MODELS", "run_bench", "write_bench", "device_name", "summarise", "checkpoint_sequential_ops",
           "BASELINES"]

# the baselines beside checkpoint_sequential's segment counts (remat/tools/trials.py):
# per-block checkpointing (Hugging Face's gradient_checkpointing) and per-block
# selective checkpointing keeping the expensive ops' outputs (torch SAC)
BASELINES = (("per_block", None), ("sac", None))
EQUAL = 0.01   # remat within 1% of a baseline's step time counts as equal (the issues' dominance targets)


def run_bench(model="gpt12", device="cpu", steps=10, budgets=8, progress=True, out=print):
    """Run every method on ``model``; return the result dict (see benchmarks/README.md)."""
    from tqdm.auto import tqdm

    device = torch.device(device)
    spec = MODELS[model][1 if device.type == "cuda" else 0]()
    torch.manual_seed(0)
    base = spec[0]().to(device)
    n = len(spec[3](base))
    folder = tempfile.TemporaryDirectory()
    path = os.path.join(folder.name, "costs.json")
    costs = _planning_costs(base, spec, device, path)
    low, high = minimum_budget(costs), simulate(costs, store_all(costs.length)).peak
    grid = [int(low + (high - low) * i / (budgets - 1)) for i in range(budgets)]
    # the peak of every checkpoint_sequential point first (a warm-up step and a
    # metered one: peaks do not drift), then every method in one run, taking the
    # steps in turn: remat on the grid and at each of those peaks (the comparison
    # of the targets), against the same plain steps
    cs = [("checkpoint_sequential", s) for s in range(1, n + 1)] + list(BASELINES)
    with tqdm(total=2, desc=f"bench {model} (peaks)", disable=not progress, leave=False) as bar:
        peaks = [r["peak_bytes"] for r in measure_all(base, spec, cs, 0, device, bar)[0]]
    methods, tags = _methods(costs, path, grid, low, cs, peaks)
    # a first call on a fresh copy after each step of the run: costs measured at the
    # machine's speed of the run, on which each schedule's time is predicted again
    # (the planning costs' single samples carry the speed of their own moment)
    window = []
    with tqdm(total=steps + 2, desc=f"bench {model} ({len(methods)} methods)", disable=not progress,
              leave=False) as bar:
        results, schedules = measure_all(base, spec, methods, steps, device, bar,
                                          probe=lambda i: window.append(measure_costs(base, spec, i, device)))
    run_costs = median_costs(window[1:])
    _label_runs(methods, tags, results, schedules, run_costs)
    result = {
        "model": model, "device": device.type, "machine": device_name(device), "torch": torch.__version__,
        "stages": n, "steps": steps, "min_budget": low, "store_all_peak": high,
        "costs": costs.to_dict(), "run_costs": run_costs.to_dict(), "runs": results,
    }
    result["summary"] = summarise(result)
    out(table(result))
    return result


def _planning_costs(base, spec, device, path):
    """The costs every remat run plans on: one measuring call through remat, in a
    process warmed by two plain steps (a cold first step runs slower and would skew
    the times remat plans on), saved to ``path`` (as a job reuses costs measured on
    a quiet machine): methods differ by their schedules only. As the chain plans on
    them: with the tail its first call's backward showed (the head and the loss)."""
    probe = copy.deepcopy(base)
    for i in range(2):
        run_step(probe, spec, ("plain", None), spec[1](i, device), Clock(None, device))
    for i in range(1 + SAMPLES):   # the calls after the first refine the times (remat/measure/refine.py)
        run_step(probe, spec, ("remat", (NO_LIMIT, "store_all", path)), spec[1](i, device), Clock(None, device))
    return remat_explain().costs


def _methods(costs, path, grid, low, cs, peaks):
    """The methods of the run and their tags: plain PyTorch and every
    checkpoint_sequential point ``cs`` (None); remat's optimal schedule and the
    fastest periodic one that fits, at every budget of ``grid`` ("grid"); remat's
    optimal schedule at every checkpoint_sequential peak off the grid (the segment
    counts that peak there)."""
    methods, tags = [("plain", None)] + cs, [None] * (len(cs) + 1)
    for b in grid:
        methods.append(("remat", (b, "optimal", path)))
        tags.append("grid")
        periodic = best_periodic(costs, b)
        if periodic is not None:
            methods.append(("remat", (b, f"periodic({periodic[0]})", path)))
            tags.append("grid")
    at = {}
    for (kind, segments), peak in zip(cs, peaks):
        if peak >= low and peak not in grid:
            at.setdefault(peak, []).append(segments if kind == "checkpoint_sequential" else kind)
    for b, segments in sorted(at.items()):
        methods.append(("remat", (b, "optimal", path)))
        tags.append(segments)
        if costs.has_options:   # (the same without options: what they buy, side by side)
            methods.append(("remat", (b, "optimal", path, False)))
            tags.append(segments)
    return methods, tags


def _label_runs(methods, tags, results, schedules, run_costs):
    """Add to each run's result its method, its tag, the plain step time and, for
    remat, its schedule's predicted time on ``run_costs``."""
    for method, r, s in zip(methods, results, schedules):
        if method[0] == "remat":
            # (solved with the chain's tail, which the run's costs leave out: a tail of nothing)
            costs = run_costs.with_tail(0.0, 0.0, 0, 0, 0, 0) if s.tail and not run_costs.tail else run_costs
            r["predicted_seconds_run_costs"] = simulate(costs, s).time
    for method, tag, r in zip(methods, tags, results):
        r["method"] = method[0] if method[0] != "checkpoint_sequential" else f"checkpoint_sequential({method[1]})"
        if method in BASELINES:
            r["baseline"] = method[0]
        if method[0] == "checkpoint_sequential":
            r["segments"] = method[1]
        if tag not in (None, "grid"):
            r["at_segments"] = tag
        r["plain_step_seconds"] = results[0]["step_seconds"]


def overhead(run):
    """Step time over the plain step of the same run, less one."""
    return run["step_seconds"] / run.get("plain_step_seconds", run["step_seconds"]) - 1


def checkpoint_sequential_ops(length, segments):
    """The schedule ``checkpoint_sequential(segments)`` runs on a chain of ``length``
    stages, as remat's ops: each of the first ``segments - 1`` segments of
    ``length // segments`` stages keeps its input and nothing else, the rest of the
    chain runs plainly; in the backward each kept segment is run again whole,
    recording, before its backward (non-reentrant checkpointing)."""
    size = length // segments
    ops, kept, start = [], [], 1
    for _ in range(segments - 1):
        kept.append((start, start + size - 1))
        ops += [Fck(start)] + [Fn(i) for i in range(start + 1, start + size)]
        start += size
    ops += [Fall(i) for i in range(start, length + 1)] + [Loss]
    ops += [B(i) for i in range(length, start - 1, -1)]
    for a, b in reversed(kept):
        ops += [Fall(i) for i in range(a, b + 1)] + [B(i) for i in range(b, a - 1, -1)]
    return ops


def summarise(result):
    """Targets of the trade-off benchmark, from one result dict.

    Beside the measured overheads, each ``checkpoint_sequential`` point gets the
    overheads the cost model predicts on the run's costs: of its schedule, and of
    the optimal schedule solved on those costs for its measured peak. That is the
    comparison without the machine's noise, whose size ``repeat_noise`` shows
    (``checkpoint_sequential(1)`` runs plain PyTorch's computation)."""
    runs = result["runs"]
    plain = next(r for r in runs if r["method"] == "plain")
    optimal = [r for r in runs if r.get("algorithm") == "optimal" and r.get("options", True)]
    whole = [r for r in runs if r.get("algorithm") == "optimal" and r.get("options") is False]
    cs = [r for r in runs if r["method"].startswith("checkpoint_sequential")]
    others = [r for r in runs if r.get("baseline")]
    costs = Costs.from_dict(result["run_costs"])
    plain_predicted = simulate(costs, store_all(costs.length)).time
    points = [_point(c, optimal, costs, plain_predicted) for c in cs + others]
    kinds = {}
    for p in points:
        if p.get("reduction") is not None:
            kinds.setdefault(p["baseline"], []).append(p["reduction"])
    # the same with remat planning without options (whole stages only), where the run has them
    without = [_point(c, whole, costs, plain_predicted, predict=False) for c in cs + others] if whole else []
    without = [p["reduction"] for p in without if p.get("reduction") is not None]
    reductions = [p["reduction"] for p in points if p.get("reduction") is not None]
    predicted = [p["reduction_predicted"] for p in points if p.get("reduction_predicted") is not None]
    bound = [p["reduction_bound"] for p in points if p.get("reduction_bound") is not None]
    remat = [r for r in runs if r["method"] == "remat"]
    return {
        "points": points,
        "dominates": all(p.get("remat_not_slower", False) for p in points),
        # points where even the low end of the median's 95% interval is over 1.01 (or no remat run fits)
        "slower_beyond_noise": sum(p.get("slower_beyond_noise", True) for p in points),
        "mean_overhead_reduction": statistics.mean(reductions) if reductions else None,
        # by baseline: checkpoint_sequential's points, per-block checkpointing, per-block SAC
        "mean_overhead_reduction_by_baseline": {k: statistics.mean(v) for k, v in kinds.items()},
        "mean_overhead_reduction_without_options": statistics.mean(without) if without else None,
        "mean_overhead_reduction_predicted": statistics.mean(predicted) if predicted else None,
        # the most any schedule could reduce it by, on the run's costs (Note [A bound on
        # any schedule] in remat/solver/bound.py)
        "mean_overhead_reduction_bound": statistics.mean(bound) if bound else None,
        # each remat run against the least time any schedule could take at its budget
        "bound_gaps": _bound_gaps(optimal, costs),
        "repeat_noise": overhead(cs[0]) if cs and cs[0]["segments"] == 1 else None,
        # the same computation as two methods, round by round: how far apart this run puts them
        "repeat_noise_paired": paired_ratio(cs[0], plain) if cs and cs[0]["segments"] == 1 else None,
        "all_under_budget": all(r["peak_bytes"] <= r["budget"] for r in remat),
        "max_time_error": max(abs(r["chain_seconds"] / r["predicted_seconds"] - 1) for r in remat),
        "max_time_error_run_costs": max(abs(r["chain_seconds"] / r["predicted_seconds_run_costs"] - 1)
                                        for r in remat if "predicted_seconds_run_costs" in r),
        "losses_equal": all(r["losses"] == plain["losses"] for r in remat + cs),
        "grads_equal": all(r.get("grads_equal", True) for r in runs),
        # where they differ (nondeterministic GPU kernels): remat's worst against
        # plain PyTorch's own computations' (plain and checkpoint_sequential(1))
        "grad_max_rel_diff": max((r.get("grad_max_rel_diff", 0.0) for r in remat), default=0.0),
        "grad_max_rel_diff_plain": max((r.get("grad_max_rel_diff", 0.0) for r in [plain] + cs[:1]), default=0.0),
    }


def _bound_gaps(runs, costs):
    """Each remat run's chain time, measured and predicted on the run's ``costs``, over
    the least time any schedule of them could take within its budget (``time_bound``,
    options included; Note [A bound on any schedule] in remat/solver/bound.py)."""
    tailed = costs if costs.tail else costs.with_tail(0.0, 0.0, 0, 0, 0, 0)   # (as the runs planned)
    gaps = []
    for r in runs:
        bound = time_bound(tailed, r["budget"])
        if 0 < bound < float("inf"):
            gaps.append({"budget": r["budget"], "measured_over_bound": r["chain_seconds"] / bound,
                         "predicted_over_bound": r.get("predicted_seconds_run_costs", float("nan")) / bound})
    return gaps


def paired_ratio(run, base):
    """``run``'s step time over ``base``'s, round by round (every method takes step i before any
    takes step i+1: a drift of the machine's speed weighs on both alike): (median, and the 95%
    interval of the median, from the order statistics, which assume nothing of the noise's
    shape); the ratio of the medians, thrice, where a result has no step times."""
    pairs = sorted(a / b for a, b in zip(run.get("step_times", ()), base.get("step_times", ())))
    if len(pairs) < 2:
        ratio = run["step_seconds"] / base["step_seconds"]
        return ratio, ratio, ratio
    n, j = len(pairs), 0   # (the interval [x_(j), x_(n+1-j)]: j as large as keeps its miss under 5%,
    while 2 * sum(math.comb(n, k) for k in range(j + 1)) / 2 ** n <= 0.05:   # the range if none does)
        j += 1
    j = max(j, 1)
    return statistics.median(pairs), pairs[j - 1], pairs[n - j]


def _point(c, optimal, costs, plain_predicted, predict=True):
    """The targets at one checkpoint_sequential run ``c``: against the fastest of the
    ``optimal`` remat runs within its peak, measured and predicted on ``costs``."""
    fits = [r for r in optimal if r["peak_bytes"] <= c["peak_bytes"]]
    kind = c.get("baseline", "checkpoint_sequential")
    if not fits:
        return {"segments": c.get("segments"), "baseline": kind, "remat": None}
    best = min(fits, key=overhead)
    oc, orr = overhead(c), overhead(best)
    # dominance: remat given the point's peak as its budget, step by step against it (the same rounds)
    given = next((r for r in optimal if r["budget"] == c["peak_bytes"]), best)
    paired = paired_ratio(given, c)
    point = {"segments": c.get("segments"), "baseline": kind, "cs_overhead": oc, "remat_overhead": orr,
             "remat_budget": best["budget"], "given_peak": given["peak_bytes"], "remat_over_baseline": paired,
             "remat_not_slower": given["peak_bytes"] <= c["peak_bytes"] and paired[0] <= 1 + EQUAL,
             "slower_beyond_noise": given["peak_bytes"] > c["peak_bytes"] or paired[1] > 1 + EQUAL,
             "reduction": (1 - orr / oc) if oc > 0.02 else None}
    if kind == "sac" or not predict:   # (SAC: no schedule of whole stages, the model predicts it only with options)
        return point
    if kind == "per_block":   # (as a plan with a tail, of nothing where the bench's costs have none)
        if not costs.tail:
            costs = costs.with_tail(0.0, 0.0, 0, 0, 0, 0)
            plain_predicted = simulate(costs, store_all(costs.length)).time
        ops = min_memory(costs.length)   # (with a tail: every stage of the chain checkpointed)
    else:
        ops = checkpoint_sequential_ops(costs.length, c["segments"])
    sim = simulate(costs, ops)
    try:
        optimal_there = simulate(costs, solve(costs, c["peak_bytes"], "optimal")).time
    except BudgetError:
        optimal_there = None
    if optimal_there is not None:
        pc, pr = sim.time / plain_predicted - 1, optimal_there / plain_predicted - 1
        pb = time_bound(costs, c["peak_bytes"]) / plain_predicted - 1
        point.update(cs_overhead_predicted=pc, cs_peak_predicted=sim.peak, remat_overhead_predicted=pr,
                     reduction_predicted=(1 - pr / pc) if pc > 0.02 else None,
                     bound_overhead=pb, reduction_bound=(1 - pb / pc) if pc > 0.02 else None)
    return point


def table(result):
    """A markdown table of one result."""
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
    pred = s.get("mean_overhead_reduction_predicted")
    bound = s.get("mean_overhead_reduction_bound")
    noise = s.get("repeat_noise")
    lines += ["", f"remat no slower at every baseline's peak (round by round, within {EQUAL:.0%}): "
                  f"{s['dominates']}; mean overhead reduction: "
                  f"{'n/a' if red is None else f'{red:.0%}'} (predicted on the run's costs: "
                  f"{'n/a' if pred is None else f'{pred:.0%}'}; at most, for any schedule: "
                  f"{'n/a' if bound is None else f'{bound:.0%}'}; checkpoint_sequential(1), plain PyTorch's "
                  f"computation, measured {'n/a' if noise is None else f'{noise:+.1%}'} against plain); "
                  f"every remat peak under its budget: "
                  f"{s['all_under_budget']}; worst |measured/predicted - 1| of chain time: {s['max_time_error']:.1%} "
                  f"(on costs measured during the run: {s['max_time_error_run_costs']:.1%}); "
                  f"losses equal to plain: {s['losses_equal']}; gradients equal: {s.get('grads_equal')}; "
                  f"mean overhead reduction by baseline: "
                  + (", ".join(f"{k} {v:.0%}" for k, v in s.get("mean_overhead_reduction_by_baseline", {}).items())
                     or "n/a")
                  + ("" if s.get("mean_overhead_reduction_without_options") is None else
                     f"; without options: {s['mean_overhead_reduction_without_options']:.0%}")
                  + _gap_text(s.get("bound_gaps"))
                  + ("" if s.get("grads_equal", True) else
                     f" (largest relative difference: remat {s.get('grad_max_rel_diff', 0):.1e}, plain PyTorch's "
                     f"own computations {s.get('grad_max_rel_diff_plain', 0):.1e}: nondeterministic kernels)")]
    given = [p for p in s["points"] if p.get("remat_over_baseline")]
    if given:
        lines += ["", "remat given each baseline's peak, its step time over the baseline's in the same rounds "
                      "(median, its 95% interval): " + "; ".join(
                          f"{_name(p)} {p['remat_over_baseline'][0]:.3f} ({p['remat_over_baseline'][1]:.3f}-"
                          f"{p['remat_over_baseline'][2]:.3f}){_verdict(p)}" for p in given),
                  f"slower beyond this run's noise at {s['slower_beyond_noise']} of {len(s['points'])} points"
                  + ("" if not s.get("repeat_noise_paired") else
                     "; plain PyTorch's computation as checkpoint_sequential(1), against plain, round by round: "
                     "{:.3f} ({:.3f}-{:.3f})".format(*s["repeat_noise_paired"]))]
    return "\n".join(lines)


def _verdict(point):
    return "" if point["remat_not_slower"] else " slower, beyond noise" if point["slower_beyond_noise"] else \
        " (within noise)"


def _name(point):
    return f"checkpoint_sequential({point['segments']})" if point["baseline"] == "checkpoint_sequential" \
        else point["baseline"]


def _gap_text(gaps):
    """The summary's words for ``bound_gaps``."""
    if not gaps:
        return ""
    measured = [g["measured_over_bound"] for g in gaps]
    predicted = [g["predicted_over_bound"] for g in gaps]
    return (f"; remat's chain time over the least any schedule could take at its budget (time_bound): "
            f"measured median {statistics.median(measured):.3f}, worst {max(measured):.3f}; its plan predicted "
            f"on the run's costs, worst {max(predicted):.3f}")


def _ms(run, field):
    return f"{run[field] * 1e3:.1f}" if field in run else ""


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
            bench_plot(result, stem + ".png")
        except ImportError as exc:
            print(exc)
    return result
