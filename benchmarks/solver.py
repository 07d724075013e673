"""Time the C solver (MIN_TIME) on random heterogeneous chains, fast vs naive;
and with three options a stage (remat.Option: other ways to record it); and
``remat.solve`` itself on long chains, up to 100,000 stages (solved on groups
of stages past the exact table: remat/solver/group.py Note [Groups]).

Each case runs in its own subprocess that loads only the compiled cffi
module (not torch); its peak RSS (VmHWM, which unlike ru_maxrss starts
afresh at exec) less the RSS before the first solve is the solver's memory. Writes benchmarks/results/solver.json
and benchmarks/results/solver.md.

    python benchmarks/solver.py                 # the full table
    python benchmarks/solver.py --quick         # L <= 200 only
    python benchmarks/solver.py --long-only     # the long chains' rows again, the rest kept
"""

import argparse
import glob
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
LENGTHS = (20, 50, 100, 200, 500, 1000)
SLOTS = (500, 1000)
# (L, slots) solved again with OPTIONS options a stage
OPTION_CASES = ((200, 500), (200, 1000), (500, 500))
OPTIONS = 3
# remat.solve end to end (Costs built, grouping, simulate): (L, options a stage)
LONG_CASES = ((200, 0), (1000, 0), (2000, 0), (5000, 0), (5000, 3), (20000, 0), (100000, 0))
# The naive table is O(L^3 slots) time and L^2 slots doubles: run it only below this.
NAIVE_MAX_WORK = 1e10
REPEATS = 3
MIB = 2**20


def _load():
    """The compiled module alone, without importing remat (and torch)."""
    import importlib.util

    paths = glob.glob(os.path.join(ROOT, "remat", "solver", "_solver*.so"))
    if not paths:
        sys.exit("benchmarks/solver.py: remat/solver/_solver is not built; run `pip install -e .`")
    spec = importlib.util.spec_from_file_location("_solver", paths[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffi, module.lib


def make_chain(length, seed=0, options=0):
    """Times and sizes drawn log-uniformly over a 10x range per stage, fixed seed;
    with ``options``, that many options a stage (``Costs.options`` as dicts), each
    keeping a share of what the stage saves beyond its output and rebuilding the
    rest in a backward longer by a share of its forward."""
    rng = random.Random(1000 * seed + length)
    logu = lambda lo, hi: math.exp(rng.uniform(math.log(lo), math.log(hi)))
    fwd = [logu(1e-3, 1e-2) for _ in range(length)]
    chain = {
        "fwd_time": fwd,
        "fwd_nograd_time": [f * rng.uniform(0.8, 1.0) for f in fwd],
        "bwd_time": [2 * f * rng.uniform(0.8, 1.2) for f in fwd],
        "out_bytes": [int(logu(1, 10) * MIB) for _ in range(length)],
        "saved_bytes": [int(logu(2, 20) * MIB) for _ in range(length)],
        "fwd_tmp": [int(logu(0.1, 1) * MIB) for _ in range(length)],
        "bwd_tmp": [int(logu(0.2, 2) * MIB) for _ in range(length)],
        "input_bytes": int(logu(1, 10) * MIB),
    }
    if options:
        rng = random.Random(7 + length)   # (the chain itself as without options)
        chain["options"] = [[_option(chain, i, rng.uniform(0.05, 0.8), rng.uniform(0.1, 1.0))
                             for _ in range(options)] for i in range(length)]
    return chain


def _option(chain, i, keep, rebuild):
    """Stage i's option keeping ``keep`` of its saved bytes beyond its output; its
    backward rebuilds the rest in ``rebuild`` of the stage's forward time."""
    out, saved = chain["out_bytes"][i], max(chain["saved_bytes"][i], chain["out_bytes"][i])
    return {"saved_bytes": out + int(keep * (saved - out)), "fwd_time": chain["fwd_time"][i],
            "bwd_time": chain["bwd_time"][i] + rebuild * chain["fwd_time"][i], "fwd_tmp": chain["fwd_tmp"][i],
            "bwd_tmp": chain["bwd_tmp"][i] + int((1 - keep) * (saved - out))}


def _solve(ffi, lib, c, budget, slots, mode):
    n = len(c["fwd_time"])
    keep = [ffi.new("double[]", c[k]) for k in ("fwd_time", "fwd_nograd_time", "bwd_time")]
    keep += [ffi.new("long long[]", c[k]) for k in ("out_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp")]
    chain = ffi.new("remat_chain *")
    chain.length = n
    (chain.fwd_time, chain.fwd_nograd_time, chain.bwd_time, chain.out_bytes,
     chain.saved_bytes, chain.fwd_tmp, chain.bwd_tmp) = keep
    chain.input_bytes = c["input_bytes"]
    if c.get("options"):
        flat = [o for stage in c["options"] for o in stage]
        first = [0]
        for stage in c["options"]:
            first.append(first[-1] + len(stage))
        keep.append(ffi.new("long long[]", first))
        keep += [ffi.new(kind + "[]", [o[name] for o in flat])
                 for kind, name in (("double", "fwd_time"), ("double", "bwd_time"), ("long long", "saved_bytes"),
                                    ("long long", "fwd_tmp"), ("long long", "bwd_tmp"))]
        (chain.option_first, chain.option_fwd_time, chain.option_bwd_time, chain.option_saved_bytes,
         chain.option_fwd_tmp, chain.option_bwd_tmp) = keep[-6:]
    cap = n * (n + 1) // 2 + 2 * n + 1
    plan = ffi.new("remat_plan *")
    codes, stages, options = ffi.new("int[]", cap), ffi.new("int[]", cap), ffi.new("int[]", cap)
    plan.capacity, plan.codes, plan.stages, plan.options = cap, codes, stages, options
    status = lib.remat_solve(chain, budget, slots, mode, 2**62, plan)
    return status, plan


def budget_of(length):
    """Halfway (geometric mean) between the chain's minimum and its store-all peak
    (without options: the chain with options is solved at the same budget)."""
    from remat.solver.costs import Costs
    from remat.solver.schedule import simulate
    from remat.solver.solve import minimum_budget, store_all

    costs = Costs(**make_chain(length))
    least, peak = minimum_budget(costs), simulate(costs, store_all(length)).peak
    return int(math.sqrt(least * peak)), least, peak


def run_case(length, slots, mode_name, budget, options=0):
    """In this process: REPEATS solves of one case; prints one JSON line."""
    ffi, lib = _load()
    mode = {"fast": lib.REMAT_MIN_TIME, "naive": lib.REMAT_MIN_TIME_NAIVE}[mode_name]
    c = make_chain(length, options=options)
    base = _rss("VmRSS")
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        status, plan = _solve(ffi, lib, c, budget, slots, mode)
        times.append(time.perf_counter() - t0)
        assert status == 0, ffi.string(lib.remat_strerror(status))
    rss = _rss("VmHWM")
    print(json.dumps({
        "length": length, "slots": slots, "options": options, "solver": mode_name, "seconds": statistics.median(times),
        "all_seconds": times, "peak_rss_bytes": rss, "solver_bytes": rss - base,
        "dp_time": plan.time, "n_ops": plan.n_ops, "budget": budget,
    }))


def run_long(length, options):
    """In this process: ``remat.solve`` on a chain of ``length`` stages at a mid budget,
    once; prints one JSON line."""
    sys.path.insert(0, ROOT)
    from remat.solver.costs import Costs
    from remat.solver.group import least_planned
    from remat.solver.schedule import simulate
    from remat.solver.solve import DEFAULT_SLOTS, best_periodic, solve, store_all

    t0 = time.perf_counter()
    costs = Costs(**make_chain(length, options=options))
    built = time.perf_counter() - t0
    plain = Costs(**make_chain(length))
    least = least_planned(plain, DEFAULT_SLOTS)   # (past the exact table: its finest coarse chain's)
    everything = simulate(costs, store_all(length))
    budget = int(math.sqrt(least * everything.peak))
    t0 = time.perf_counter()
    schedule = solve(costs, budget)
    seconds = time.perf_counter() - t0
    sim = simulate(costs, schedule)
    assert sim.peak <= budget and sim.time == schedule.time
    k = max(1, round(math.sqrt(length)))
    sqrt = best_periodic(costs, budget, [k])
    print(json.dumps({
        "length": length, "options": options, "seconds": seconds, "build_seconds": built, "budget": budget,
        "least": least, "store_all_peak": everything.peak, "store_all_time": everything.time,
        "time": schedule.time, "peak": schedule.peak, "recomputations": schedule.recomputations(),
        "groups": len(schedule.grouping.sizes) if schedule.grouping else None,
        "group_sizes": [min(schedule.grouping.sizes), max(schedule.grouping.sizes)] if schedule.grouping else None,
        "exact_seconds_estimate": schedule.grouping.exact_seconds if schedule.grouping else None,
        "sqrt_time": sqrt[2].time if sqrt else None,
    }))


def _rss(field):
    """Bytes of /proc/self/status's ``field`` (VmRSS now, VmHWM the peak)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _spawn(length, slots, mode, budget, options=0):
    out = subprocess.run([sys.executable, __file__, "--case", str(length), str(slots), mode, str(budget), str(options)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=5, metavar=("L", "SLOTS", "SOLVER", "BUDGET", "OPTIONS"))
    parser.add_argument("--long", nargs=2, metavar=("L", "OPTIONS"))
    parser.add_argument("--quick", action="store_true", help="only L <= 200")
    parser.add_argument("--long-only", action="store_true", help="only the long chains (remat.solve)")
    args = parser.parse_args()
    if args.case:
        run_case(int(args.case[0]), int(args.case[1]), args.case[2], int(args.case[3]), int(args.case[4]))
        return
    if args.long:
        run_long(int(args.long[0]), int(args.long[1]))
        return
    sys.path.insert(0, ROOT)
    if args.long_only:
        with open(os.path.join(RESULTS, "solver.json")) as fh:
            rows = json.load(fh)["cases"]
    else:
        rows = _table_rows(args.quick)
    long_rows = []
    for length, options in LONG_CASES:
        if args.quick and length > 200:
            continue
        out = subprocess.run([sys.executable, __file__, "--long", str(length), str(options)],
                             capture_output=True, text=True, check=True)
        long_rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(_long_line(long_rows[-1]), flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "solver.json"), "w") as fh:
        json.dump({"machine": _machine(), "repeats": REPEATS, "cases": rows, "long": long_rows}, fh, indent=1)
    with open(os.path.join(RESULTS, "solver.md"), "w") as fh:
        fh.write(_table(rows) + "\n" + _long_table(long_rows))
    print(_table(rows) + "\n" + _long_table(long_rows))


def _table_rows(quick):
    """The C solver's rows: fast and naive tables, in subprocesses."""
    rows = []
    cases = [(length, slots, 0) for length in LENGTHS for slots in SLOTS]
    for length, slots, options in cases + [(length, slots, OPTIONS) for length, slots in OPTION_CASES]:
        if quick and length > 200:
            continue
        budget, least, peak = budget_of(length)
        fast = _spawn(length, slots, "fast", budget, options)
        naive = _spawn(length, slots, "naive", budget, options) if length**3 / 6 * slots <= NAIVE_MAX_WORK else None
        if naive is not None and abs(naive["dp_time"] - fast["dp_time"]) > 1e-9 * naive["dp_time"]:
            print(f"warning: L={length} slots={slots}: fast {fast['dp_time']} != naive {naive['dp_time']}")
        row = {"fast": fast, "naive": naive, "min_budget": least, "store_all_peak": peak}
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _long_line(r):
    grouped = f"{r['groups']} groups of {r['group_sizes'][0]}-{r['group_sizes'][1]}" if r["groups"] else "exact"
    return (f"L={r['length']} options={r['options']}: solve {r['seconds']:.2f} s ({grouped}), "
            f"{r['time'] / r['store_all_time']:.3f} x store-all time")


def _long_table(rows):
    out = [
        "# remat.solve on long chains",
        "",
        "One run each (`--long-only` runs them again); the chains as above, `Costs` built beforehand (the build "
        "column); budget = geometric mean of the least schedule remat finds (the exact minimum up to L = 1,000, "
        "else that of the finest coarse chain, 4 x 300 groups) and the store-all peak. Past the exact table "
        "(L^3 x slots > 1,000^3 x 500) remat solves on groups of adjacent stages (docs/how-it-works.md, "
        "\"Long chains\"); \"exact would take\" is its estimate of the table's time. Times relative to storing "
        "everything; √L periodic is checkpoint_sequential's schedule at that budget (- where it does not fit). "
        f"Machine: {os.cpu_count()} CPUs, shared with other jobs.",
        "",
        "| L | options | solve (s) | build (s) | grouped | exact would take | time / store-all | "
        "√L periodic / store-all | recomputed stages |",
        "| ---: | ---: | ---: | ---: | :--- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        grouped = f"{r['groups']} groups of {r['group_sizes'][0]}-{r['group_sizes'][1]}" if r["groups"] else "no"
        est = f"{r['exact_seconds_estimate']:,.0f} s" if r["groups"] else "-"
        sqrt = f"{r['sqrt_time'] / r['store_all_time']:.3f}" if r["sqrt_time"] else "-"
        out.append(f"| {r['length']:,} | {r['options']} | {r['seconds']:.2f} | {r['build_seconds']:.2f} | {grouped} | "
                   f"{est} | {r['time'] / r['store_all_time']:.3f} | {sqrt} | {r['recomputations']:,} |")
    return "\n".join(out) + "\n"


def _line(row):
    f, n = row["fast"], row["naive"]
    extra = f", naive {n['seconds']:.3f} s ({n['seconds'] / f['seconds']:.1f}x)" if n else ""
    options = f" options={f['options']}" if f["options"] else ""
    return (f"L={f['length']} slots={f['slots']}{options}: fast {f['seconds']:.3f} s, "
            f"{f['solver_bytes'] / MIB:.0f} MiB{extra}")


def _machine():
    import platform

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def _table(rows):
    out = [
        "# C solver (MIN_TIME), random heterogeneous chains",
        "",
        f"Median of {REPEATS} runs; budget = geometric mean of the chain's minimum and its store-all "
        f"peak; memory = peak RSS growth of a process that only loads the solver "
        f"(Python baseline excluded; VmHWM). Naive = the plain O(L^3 slots) double table, run only where "
        f"L^3/6 * slots <= {NAIVE_MAX_WORK:.0e}. Options: that many a stage (remat.Option), each keeping "
        f"5-80% of what the stage saves beyond its output, at the budget of the chain without them. "
        f"Machine: {os.cpu_count()} CPUs.",
        "",
        "| L | slots | options | fast (s) | fast memory (MiB) | naive (s) | naive memory (MiB) | speed-up |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        f, n = row["fast"], row["naive"]
        naive = (f"{n['seconds']:.3f} | {n['solver_bytes'] / MIB:.0f} | {n['seconds'] / f['seconds']:.1f}x"
                 if n else "- | - | -")
        out.append(f"| {f['length']} | {f['slots']} | {f.get('options', 0)} | {f['seconds']:.3f} | "
                   f"{f['solver_bytes'] / MIB:.0f} | {naive} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
