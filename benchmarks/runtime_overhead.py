"""Runtime overhead of remat on CPU, side by side in one process:

(a) with a budget that fits everything, remat's step time against plain
    PyTorch's: the median over 100 pairs of steps run back to back (the order
    alternating) of the pair's ratio, with its quartiles;
(b) at three budgets, the chain's measured time against the schedule's
    prediction;
(c) the first (measuring) call against a plain step (median of 5 first calls,
    the cache cleared before each, each timed beside a plain step).

    python benchmarks/runtime_overhead.py [--steps 12] [--fit-pairs 100] [--models gpt12 resnet101 resnet101-b16]
                                          [--out runtime_overhead.json]

Writes benchmarks/results/runtime_overhead.json (or --out) and prints a markdown table.
Targets: (a) at most 2% slower than plain, (b) within 5%, (c) at most 3x.

What the figures can and cannot show:

- (c) The first call runs each stage's forward metered, its backward on that
  graph, a forward without recording, and the real backward, which here
  (a budget that fits everything) rebuilds no stage (remat/measure/profile.py,
  Note [Measuring a stage]): about two plain steps of work plus the meter's
  Python per op, which weighs most on small stages (ResNet-101 at 32x32 on
  CPU).
- (b) The prediction comes from the costs of five first calls, each stage's
  times the median of the five, each as the two calls after the first
  refined them (their own wall times, remat/measure/refine.py), while the measured chain time
  is a median of later steps. What separates them: noise in the refining
  calls' samples; per-step work simulate does not charge (remat's
  hooks, see (a)); the machine's speed drifting between the first calls and
  later steps (on a shared 2-core VM a plain step varies by 10-30% from
  minute to minute), which scales every prediction alike and leaves the
  schedule unchanged (it depends on the costs' ratios only). Two columns
  divide that out: the error of measured/measured-store-all against
  predicted/predicted-store-all, the budgets run in turn within each step;
  and the error against each schedule's time on the run's costs (a
  measuring and a refining call on a fresh copy after each step, the
  median stage by stage), as the trade-off benchmark does. Those costs are
  refined at store-all, where remat's work for a stage it drops or
  recomputes does not show; the last column predicts on the costs a job at
  that budget gets (measured and refined likewise, running its schedule:
  remat/measure/refine.py), the prediction ``remat.explain()`` shows that job.
  Those columns divide medians taken over the whole run, so that a machine
  slowing between the early and the late steps still shows; the paired
  columns take each step's chain time against the costs measured seconds
  after it, in the same step, and report the median of those errors. The
  last column is what a user sees: each step, a job at each budget on a
  fresh copy (a measuring call, the two that refine its times, the schedule
  remat solves on those and runs from then on), its next three steps'
  median chain time against that schedule's prediction (``remat.explain()``);
  the median over the steps of those errors.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import remat  # noqa: E402
from remat.tools.trials import MODELS, Clock, device_name, job, measure_costs, median_costs, resnet_spec, run_step  # noqa: E402
from remat.measure.refine import SAMPLES  # noqa: E402
from remat.solver.schedule import simulate  # noqa: E402
from remat.solver.solve import minimum_budget, store_all  # noqa: E402

FIRST_CALLS = 5
JOB_STEPS = 3   # steps a job at a budget is timed for after its first calls (b)
# name: (description, spec); remat's own work is a fixed time per stage
# (stage_cost.py), so its share of a step falls as the stages' work grows: the
# second ResNet-101 case takes 16 images a step instead of 4
CASES = {
    "gpt12": ("12-block GPT-style model", MODELS["gpt12"][0]),
    "resnet101": ("ResNet-101 chain (34 stages)", MODELS["resnet101"][0]),
    "resnet101-b16": ("ResNet-101 chain (34 stages), 16 images a step", lambda: resnet_spec(101, 32, 16)),
}


def _quartiles(values):
    """First and third quartiles of sorted ``values``."""
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def timed(model, spec, method, data, device):
    clock = Clock(None, device)
    t0 = time.perf_counter()
    run_step(model, spec, method, data, clock)
    return time.perf_counter() - t0, clock.total


def run_case(name, steps, fit_pairs, device):
    spec = CASES[name][1]()
    torch.manual_seed(0)
    base = spec[0]().to(device)
    plain, rem = copy.deepcopy(base), copy.deepcopy(base)
    data = [spec[1](i, device) for i in range(steps + 2)]
    # warm the process (allocator, caches, lazy inits) with two plain steps, as a
    # job's first remat call would follow its data loading and model set-up;
    # then the first (measuring) remat call
    for _ in range(2):
        timed(plain, spec, ("plain", None), data[0], device)
    # (c) first calls (the cache cleared before each), each beside a plain step
    folder = tempfile.TemporaryDirectory()
    firsts, beside, measured = [], [], []
    for i in range(FIRST_CALLS):
        remat.clear_cache()
        first = os.path.join(folder.name, f"first{i}.json")
        firsts.append(timed(rem, spec, ("remat", (2**50, "optimal", first)), data[i % len(data)], device)[0])
        beside.append(timed(plain, spec, ("plain", None), data[i % len(data)], device)[0])
        # the calls after it refine the times (remat/measure/refine.py) and write them
        for _ in range(SAMPLES):
            timed(rem, spec, ("remat", (2**50, "optimal", first)), data[i % len(data)], device)
        measured.append(remat.Costs.load(first))
    # (b) plans on the median of those first calls' times, stage by stage (saved to
    # a file the chain loads, as a job reuses costs): one call's single samples
    # carry the machine's noise of that moment into every prediction
    costs = median_costs(measured)
    path = os.path.join(folder.name, "costs.json")
    costs.save(path)
    # (a) everything fits: pairs of steps, plain and remat back to back, which of
    # the two goes first alternating pair by pair (the second step of a pair runs
    # on the caches the first left); the overhead is the median of the pairs'
    # ratios, so that the machine's drift, slow against a pair, divides out. Both
    # run on the same modules (remat's copy; plain PyTorch outside a chain), so
    # that where their parameters lie in memory does not differ
    tp, tr = [], []
    for i in range(fit_pairs):
        d = data[1 + i % (len(data) - 1)]
        order = (("plain", tp), ("remat", tr)) if i % 2 == 0 else (("remat", tr), ("plain", tp))
        for which, times in order:
            method = ("plain", None) if which == "plain" else ("remat", (2**50, "optimal"))
            model = rem
            times.append(timed(model, spec, method, d, device)[0])
    ratios = sorted(r / p for p, r in zip(tp, tr))
    plain_step, remat_step = statistics.median(tp), statistics.median(tr)
    # (b) three budgets and store-all: measured chain time against the prediction,
    # the budgets taken in turn each step (a known budget only switches schedules)
    # so that the machine drifting over the run weighs on all of them alike
    low, high = minimum_budget(costs), simulate(costs, store_all(costs.length)).peak
    fracs = (0.1, 0.4, 0.7)
    chosen = [int(low + f * (high - low)) for f in fracs] + [2**50]
    chain_times = {b: [] for b in chosen}
    schedules = {}
    window, own, jobs = [], {b: [] for b in chosen[:-1]}, {b: [] for b in chosen[:-1]}
    for i in range(steps + 1):
        # the order rotates step by step: the call after the measuring one below
        # runs slower (on ResNet-101 the 10% budget, always first, read +16% against
        # store-all in one run and +2% when alternating with store-all alone)
        for budget in chosen[i % len(chosen):] + chosen[:i % len(chosen)]:
            _, chain_t = timed(rem, spec, ("remat", (budget, "optimal", path)), data[i % len(data)], device)
            schedules[budget] = remat.explain().schedule
            if i:
                chain_times[budget].append(chain_t)
        # costs measured (and refined) among the steps, on a fresh copy: the
        # machine's speed of the run, against which each schedule is predicted again;
        # and the costs a job at each budget gets (refined as its schedule runs), and
        # that job's next steps against the prediction of the schedule remat solves
        # on them and runs: what ``remat.explain()`` shows a user, beside what it
        # measures, seconds apart
        window.append(measure_costs(base, spec, i % len(data), device))
        for budget in chosen[:-1]:
            costs_b, schedule_b, times_b = job(base, spec, i % len(data), device, budget, JOB_STEPS)
            own[budget].append(costs_b)
            jobs[budget].append((statistics.median(times_b), schedule_b.time, schedule_b.recomputations()))
    run_costs = median_costs(window[1:])
    all_measured = statistics.median(chain_times[2**50])
    all_predicted = schedules[2**50].time
    all_run = simulate(run_costs, schedules[2**50]).time

    def paired(budget, costs):
        # step by step, the chain's time against its schedule on the costs measured
        # seconds after it (the same step's), the median of those errors: the
        # machine's drift over the run, which the medians above carry into the
        # ratio of a median time taken early to one taken late, divides out
        s = schedules[budget]
        return statistics.median(t / simulate(c, s).time - 1 for t, c in zip(chain_times[budget], costs[1:]))
    budgets = []
    for frac, budget in zip(fracs, chosen):
        s = schedules[budget]
        measured = statistics.median(chain_times[budget])
        run = simulate(run_costs, s).time
        at_budget = simulate(median_costs(own[budget][1:]), s).time
        budgets.append({"budget": budget, "fraction": frac, "predicted_seconds": s.time,
                        "measured_chain_seconds": measured, "recomputations": s.recomputations(),
                        "error": measured / s.time - 1,
                        "error_relative_to_store_all": (measured / all_measured) / (s.time / all_predicted) - 1,
                        "predicted_seconds_run_costs": run, "error_run_costs": measured / run - 1,
                        "predicted_seconds_budget_costs": at_budget,
                        "error_budget_costs": measured / at_budget - 1,
                        "error_run_costs_paired": paired(budget, window),
                        "error_budget_costs_paired": paired(budget, own[budget]),
                        "job_error": statistics.median(t / p - 1 for t, p, _ in jobs[budget][1:]),
                        "job_errors": [t / p - 1 for t, p, _ in jobs[budget][1:]],
                        "job_recomputations": [r for _, _, r in jobs[budget][1:]]})
    return {
        "model": name, "description": CASES[name][0], "stages": costs.length,
        "plain_step_seconds": plain_step, "remat_step_seconds": remat_step,
        "overhead": statistics.median(ratios) - 1,
        "overhead_quartiles": [q - 1 for q in _quartiles(ratios)],
        "overhead_of_medians": remat_step / plain_step - 1,
        "fit_pairs": fit_pairs,
        "first_call_seconds": statistics.median(firsts),
        "first_call_ratio": statistics.median(f / p for f, p in zip(firsts, beside)),
        "first_calls": FIRST_CALLS,
        "store_all_predicted_seconds": all_predicted, "store_all_measured_chain_seconds": all_measured,
        "store_all_predicted_seconds_run_costs": all_run,
        "store_all_error_run_costs_paired": paired(2**50, window),
        "budgets": budgets,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fit-pairs", type=int, default=100,
                        help="plain/remat step pairs for (a), everything fitting")
    parser.add_argument("--models", nargs="+", default=list(CASES))
    parser.add_argument("--out", default="runtime_overhead.json", help="file name in benchmarks/results/")
    args = parser.parse_args()
    device = torch.device("cpu")
    out = {"machine": device_name(device), "torch": torch.__version__, "steps": args.steps,
           "fit_pairs": args.fit_pairs,
           "cases": [run_case(m, args.steps, args.fit_pairs, device) for m in args.models]}
    path = os.path.join(ROOT, "benchmarks", "results", args.out)
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"runtime overhead on {out['machine']} (torch {out['torch']}), medians of {args.steps} steps\n")
    print(f"| model | plain step ms | remat step ms (fits) | overhead (median of {args.fit_pairs} pairs) "
          "| quartiles | first call / plain step |")
    print("|---|---|---|---|---|---|")
    for c in out["cases"]:
        q1, q3 = c["overhead_quartiles"]
        print(f"| {c['description']} | {c['plain_step_seconds'] * 1e3:.1f} | {c['remat_step_seconds'] * 1e3:.1f} "
              f"| {c['overhead']:+.1%} | {q1:+.1%} .. {q3:+.1%} | {c['first_call_ratio']:.2f}x |")
    print("\n| model | budget | recomputations | predicted chain ms | measured chain ms | error "
          "| error of the ratio to store-all | error on the run's costs | error on the costs of its budget "
          "| paired step by step: run's costs | its budget's costs | a job's own prediction |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in out["cases"]:
        m = c["store_all_measured_chain_seconds"]
        print(f"| {c['model']} | store-all | 0 | {c['store_all_predicted_seconds'] * 1e3:.1f} "
              f"| {m * 1e3:.1f} | {m / c['store_all_predicted_seconds'] - 1:+.1%} | - "
              f"| {m / c['store_all_predicted_seconds_run_costs'] - 1:+.1%} | - "
              f"| {c['store_all_error_run_costs_paired']:+.1%} | - | - |")
        for b in c["budgets"]:
            print(f"| {c['model']} | {b['fraction']:.0%} of min..store-all | {b['recomputations']} "
                  f"| {b['predicted_seconds'] * 1e3:.1f} | {b['measured_chain_seconds'] * 1e3:.1f} "
                  f"| {b['error']:+.1%} | {b['error_relative_to_store_all']:+.1%} | {b['error_run_costs']:+.1%} "
                  f"| {b['error_budget_costs']:+.1%} | {b['error_run_costs_paired']:+.1%} "
                  f"| {b['error_budget_costs_paired']:+.1%} | {b['job_error']:+.1%} |")

if __name__ == "__main__":
    main()
