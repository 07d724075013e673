"""remat against Hugging Face's own checkpointing on a GPT-2, the whole step
(docs/how-it-works.md, "The tail"): plain PyTorch, ``gradient_checkpointing_enable()``
(also with torch's selective checkpointing keeping matmul and attention outputs:
``hf_checkpointing_sac``), on a GPU ``torch.compile`` under the min-cut
partitioner's ``activation_memory_budget`` (``--compile 0.5,0.1``: one method per
value), and ``remat.wrap(model, model.transformer.h, budget=b)`` at several
budgets, side by side in one process.

    python benchmarks/hf_checkpointing.py [--rounds 7] [--layers 12] [--width 256] [--vocab 8000]
                                          [--batch 4] [--length 128] [--compile 0.5,0.1]
                                          [--autocast bfloat16] [--out hf_checkpointing-cpu.json]

For each method: the peak from the chain's opening (the budget's scope: what
the step allocates from the first block's call, its input counted, to the end
of the backward, over parameters and gradients already resident: an exact
meter of live tensor storages on CPU, the CUDA allocator's peak above what
was allocated on a GPU), the whole step's (from the model's forward: the
embeddings' output and dropout mask come on top), its step time
(the median over ``rounds`` rounds, each running every method once, in turn; on
CPU these steps run without the storage meter, whose dispatch would be in every
method's time, and one more metered round gives the peaks), its time over HF
checkpointing's round by round (the median of these paired ratios and their
quartiles), and for remat the whole-step peak ``remat.explain().predicted_peak``
predicts and the plan's chain time (its tail's included) on its own costs over
the least any schedule of them could take within the budget (``time_bound``).
Budgets: 0.95x and 1x HF checkpointing's peak, HF with SAC's peak, each compiled
method's whole-step peak, and 20%, 35% and 60% of plain's.
A compiled step's peak is its whole step's (a hook in the compiled model
would break its graph), so remat at that budget is held to the larger scope.
``--compile`` needs CUDA: under the CPU storage meter (a Python dispatch mode)
the compiled step runs uncompiled.
On a GPU (or with REMAT_BENCH_BOTH set) remat also runs without stage options
at HF's two peaks, and without rungs at HF+SAC's peak, each compiled method's
and 60% of plain's: what options and rungs buy.
Each remat run starts from a fresh copy: its first call measures, the next
two refine the times (remat/measure/refine.py), then the rounds run; every
call's peak is checked against the budget, the first ones included.

Writes benchmarks/results/hf_checkpointing-<device>.json and prints a markdown table.
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import remat  # noqa: E402
from remat.measure import options as measured_options  # noqa: E402
from remat.measure.meter import Instrument  # noqa: E402
from remat.solver.schedule import simulate  # noqa: E402
from remat.solver.solve import time_bound  # noqa: E402
from remat.tools.trials import _sac_contexts  # noqa: E402
from remat.measure.cuda_peak import peak_allocated, reset_reader  # noqa: E402


def build(layers, width, vocab, seed=0):
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_head=max(1, width // 64), n_embd=width, vocab_size=vocab,
                                     n_positions=1024, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).train()


class Step:
    """One method: a model, its training step (no optimizer) and its measures."""

    def __init__(self, name, model, device, budget=None, compiled=None):
        self.name, self.model, self.device, self.budget = name, model.to(device), device, budget
        self.compiled = compiled   # activation_memory_budget of a torch.compile'd step, or None
        self.forward = model if compiled is None else torch.compile(model)
        self.times, self.peaks, self.scoped, self.predicted = [], [], [], None
        self.outside, self.plan, self.chain = 0, None, None
        for p in self.model.parameters():   # resident gradients: every step adds into them
            p.grad = torch.zeros_like(p)

    def run(self, batch, metered=True):
        """One step: (seconds, whole-step peak, peak from the chain's opening), bytes
        above what was allocated before the step (parameters, gradients) and, for the
        second, above what was allocated as the first block was called, its input
        counted (the budget's scope: docs/how-it-works.md, "The tail"). On CPU a step
        not ``metered`` runs without the storage meter (whose dispatch would be in its
        time) and gives (seconds, None, None)."""
        ids = batch.to(self.device)
        for p in self.model.parameters():
            p.grad.zero_()
        cuda = self.device.type == "cuda"
        if not cuda and not metered:
            t0 = time.perf_counter()
            with _autocast(self.device):
                loss = self.forward(ids, labels=ids).loss
            loss.backward()
            del loss
            return time.perf_counter() - t0, None, None
        opened = []

        def open_scope(_module, args):
            if opened:
                return   # (a recomputation of the first block, in the backward)
            if cuda:
                torch.cuda.synchronize()
                opened.append((peak_allocated(), torch.cuda.memory_allocated()
                               - args[0].untyped_storage().nbytes()))
                reset_reader()
            else:
                scope.count(args[0])
                scope.set_gate(True)
                opened.append(True)

        hook = None if self.compiled is not None else \
            self.model.transformer.h[0].register_forward_pre_hook(open_scope)
        whole = scope = None
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            reset_reader()   # (remat's own resets in a measuring call carried over: remat/measure/cuda_peak.py)
        else:
            whole, scope = Instrument(writes=False).__enter__(), Instrument(writes=False)
            scope.set_gate(False)
            scope.__enter__()
        t0 = time.perf_counter()
        try:
            with _memory_budget(self.compiled), _autocast(self.device):   # (the backward after it, as torch advises)
                loss = self.forward(ids, labels=ids).loss
            loss.backward()
            del loss
        finally:
            if hook is not None:
                hook.remove()
            if not cuda:
                scope.__exit__(None, None, None)
                whole.__exit__(None, None, None)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if cuda and not opened:   # (a compiled step: its whole step is the scope)
            peak = scoped = peak_allocated() - base
        elif cuda:
            before, at_open = opened[0]
            self.outside = at_open - base   # (held from before the chain opens to the step's end)
            scoped = peak_allocated() - at_open
            peak = max(before, peak_allocated()) - base
        else:
            peak, scoped = whole.peak, scope.peak
        if self.budget is not None:
            seen = remat.explain()
            self.predicted = seen.predicted_peak
            self.plan = _forward_ops(seen.schedule)
            if seen.schedule is not None:   # (the chain's time, the tail's included, by the model)
                self.chain = (simulate(seen.costs, seen.schedule).time, time_bound(seen.costs, self.budget))
        return seconds, peak, scoped


def _memory_budget(value):
    """The context a compiled step runs in: the partitioner's ``activation_memory_budget``
    (read as the step's graphs are compiled, on its first call), or nothing."""
    if value is None:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config
    return functorch_config.patch(activation_memory_budget=value)


AUTOCAST = None   # (--autocast: the dtype every method's forward runs under torch.autocast in)


def _autocast(device):
    return contextlib.nullcontext() if AUTOCAST is None else torch.autocast(device.type, dtype=AUTOCAST)


_KINDS = {"auto": "", False: " (no options)", "no rungs": " (no rungs)"}   # (remat's runs: their names' ends)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", default="",
                        help="activation_memory_budget values of torch.compile'd steps, comma-separated (CUDA)")
    parser.add_argument("--autocast", default=None, choices=["bfloat16", "float16"],
                        help="run every method's forward under torch.autocast in this dtype (the backward after it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    global AUTOCAST
    AUTOCAST = getattr(torch, args.autocast) if args.autocast else None
    device = torch.device(args.device)
    compile_budgets = [float(v) for v in args.compile.split(",") if v.strip()]
    if compile_budgets and device.type != "cuda":
        parser.error("--compile needs --device cuda: under the CPU storage meter (a Python dispatch mode) "
                     "the compiled step would run uncompiled")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = build(args.layers, args.width, args.vocab)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.length), generator=g) for _ in range(4)]

    plain = Step("plain", copy.deepcopy(base), device)
    hf = Step("hf_checkpointing", copy.deepcopy(base), device)
    hf.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # HF's checkpointing with torch's selective checkpointing: matmul, convolution and
    # attention outputs kept, the rest recomputed (the policy of remat/tools/trials.py)
    sac = Step("hf_checkpointing_sac", copy.deepcopy(base), device)
    sac.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": _sac_contexts})
    for s in (plain, hf, sac):   # warm-up: a first step allocates what later steps reuse
        s.run(batches[0])
    compiled, failed = [], {}
    for v in compile_budgets:   # (a compiler that fails leaves the other methods to run)
        s = Step(f"compile({v})", copy.deepcopy(base), device, compiled=v)
        try:
            s.run(batches[0])
        except Exception as exc:
            failed[s.name] = f"{type(exc).__name__}: {exc}"[:400]
            continue
        compiled.append(s)
    plain_peak = max(plain.run(b)[2] for b in batches[:2])
    hf_peak = max(hf.run(b)[2] for b in batches[:2])
    sac_peak = max(sac.run(b)[2] for b in batches[:2])
    budgets = {"0.95x HF": int(0.95 * hf_peak), "HF's peak": hf_peak, "HF+SAC's peak": sac_peak}
    for s in compiled:   # (its whole step's peak, less what the eager steps hold from before the chain opens)
        budgets[f"{s.name}'s peak"] = max(s.run(b)[2] for b in batches[:2]) - hf.outside
    budgets.update({"20% of plain": int(0.2 * plain_peak), "35% of plain": int(0.35 * plain_peak),
                    "60% of plain": int(0.6 * plain_peak)})
    methods = [plain, hf, sac, *compiled]
    first_calls = {}
    # (and, at HF's peaks, with whole stages only: what options buy; on CPU they are off already)
    runs = [(label, budget, "auto") for label, budget in budgets.items()]
    # (and without rungs where options pay: what rungs buy, remat/measure/options.py Note [Measuring an option] 6)
    if device.type == "cuda" or os.environ.get("REMAT_BENCH_BOTH"):
        runs[2:2] = [(label, budgets[label], False) for label in ("HF's peak", "HF+SAC's peak")]
        runs += [(label, budgets[label], "no rungs") for label in budgets if label in ("HF+SAC's peak", "60% of plain")
                 or label.startswith("compile")]
    for label, budget, options in runs:
        model = copy.deepcopy(base)
        remat.wrap(model, model.transformer.h, budget=budget, options="auto" if options else False)
        s = Step(f"remat{_KINDS[options]} at {label}", model, device, budget)
        t0 = time.perf_counter()
        rungs = measured_options.MAX_RUNGS
        measured_options.MAX_RUNGS = 0 if options == "no rungs" else rungs   # (read by its measuring call)
        try:
            first_calls[s.name] = [s.run(b)[2] for b in batches[:3]]   # measuring, then two refining calls
        except remat.BudgetError as exc:
            first_calls[s.name] = str(exc)
            continue
        except Exception as exc:   # (reported with the rest, not the end of a device run)
            first_calls[s.name] = f"failed: {type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
            continue
        finally:
            measured_options.MAX_RUNGS = rungs
        print(f"{s.name}: first calls {[round(p / 2**20, 1) for p in first_calls[s.name]]} MiB "
              f"(budget {budget / 2**20:.1f}) in {time.perf_counter() - t0:.1f} s; {s.plan}", file=sys.stderr)
        methods.append(s)
    for r in range(args.rounds + 1):   # (timed rounds, unmetered on CPU, then one metered for the peaks)
        metered = device.type == "cuda" or r == args.rounds
        for s in (methods if r % 2 == 0 else methods[::-1]):
            seconds, peak, scoped = s.run(batches[r % len(batches)], metered)
            if r < args.rounds:
                s.times.append(seconds)
            if metered:
                s.peaks.append(peak)
                s.scoped.append(scoped)
    plain_time = statistics.median(plain.times)
    rows = []
    for s in methods:
        row = {"method": s.name, "budget": s.budget, "peak_bytes": max(s.peaks), "scoped_peak_bytes": max(s.scoped),
               "step_seconds": statistics.median(s.times), "over_plain": statistics.median(s.times) / plain_time}
        if s is not plain:   # (its time over HF checkpointing's in each round, both timed side by side)
            ratios = sorted(a / b for a, b in zip(s.times, hf.times))
            row["over_hf_rounds"] = ratios
            row["over_hf_median"] = statistics.median(ratios)
            row["over_hf_quartiles"] = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]
        if s.budget is not None:
            row["predicted_peak"] = s.predicted
            row["forward_ops"] = s.plan
            row["first_calls_peak_bytes"] = first_calls[s.name]
            row["under_budget"] = max(s.scoped) <= s.budget
            row["first_calls_under_budget"] = all(p <= s.budget for p in first_calls[s.name])
            if s.chain is not None:   # (the plan's chain time on its costs, and the least of any schedule's)
                row["predicted_chain_seconds"], row["bound_chain_seconds"] = s.chain
        rows.append(row)
    failed.update({k: v for k, v in first_calls.items() if isinstance(v, str)})
    result = {"device": device.type, "machine": _machine(device), "torch": torch.__version__,
              "model": vars(args), "plain_peak": plain_peak, "hf_peak": hf_peak, "hf_sac_peak": sac_peak,
              "budgets": budgets, "rows": rows,
              "refused": failed}
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"hf_checkpointing-{device.type}.json")
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(table(result))


def _forward_ops(schedule):
    """How the plan's forward phase runs the stages, counted: "Fall:o1 x4, Fck x8"."""
    from remat.solver.schedule import Loss
    ops = schedule.ops[:schedule.ops.index(Loss)] if schedule is not None else []
    modes = [f"Fall:o{op.option}" if getattr(op, "option", 0) else type(op).__name__ for op in ops]
    return ", ".join(f"{m} x{modes.count(m)}" for m in sorted(set(modes), key=modes.index))


def _machine(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def table(result):
    mib = lambda n: f"{n / 2**20:.1f}"
    lines = [f"GPT-2 {result['model']['layers']}x{result['model']['width']}, vocab {result['model']['vocab']}, "
             f"batch {result['model']['batch']}x{result['model']['length']} on {result['machine']} "
             f"(torch {result['torch']})", "",
             "| method | budget MiB | peak from the chain's opening MiB | predicted MiB | whole-step peak MiB | "
             "first calls' peaks MiB | step vs plain | vs HF, paired (quartiles) | plan over the bound | "
             "plan's forward |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        budget = mib(r["budget"]) if r["budget"] is not None else ""
        predicted = mib(r["predicted_peak"]) if r.get("predicted_peak") is not None else ""
        first = ", ".join(mib(p) for p in r.get("first_calls_peak_bytes", []))
        paired = f"{r['over_hf_median']:.3f} ({r['over_hf_quartiles'][0]:.3f}-{r['over_hf_quartiles'][1]:.3f})" \
            if "over_hf_median" in r else ""
        bound = f"{r['predicted_chain_seconds'] / r['bound_chain_seconds']:.3f}" \
            if 0 < r.get("bound_chain_seconds", 0) < float("inf") else ""
        lines.append(f"| {r['method']} | {budget} | {mib(r['scoped_peak_bytes'])} | {predicted} | "
                     f"{mib(r['peak_bytes'])} | {first} | {r['over_plain']:.2f}x | {paired} | {bound} | "
                     f"{r.get('forward_ops') or ''} |")
    if any(r["method"].startswith("compile(") for r in result["rows"]):
        lines.append("\ncompile(v): torch.compile under activation_memory_budget=v; its peak is the whole "
                     "step's, and remat's budget there is that less what HF's step holds from before the "
                     "chain opens (the embeddings' output)")
    for name, why in result["refused"].items():
        lines.append(f"\n{name}: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
