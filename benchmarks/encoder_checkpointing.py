"""remat at the whole-step peak of torch's own checkpointing, on a 12-layer
``nn.TransformerEncoderLayer`` chain (d=128, 4 heads, sequence 64, batch 8,
dropout 0.1, norm_first), CPU: is remat, given the very peak a method
measures, under it and no slower?

    python benchmarks/encoder_checkpointing.py [--pairs 15] [--options] [--out encoder_checkpointing-cpu.json]

The methods: ``checkpoint_sequential(k)`` for k = 2, 3, 4, 6 and per-block
checkpointing (``checkpoint`` around each layer). Each one's whole-step peak
(an exact meter of live tensor storages, from the step's start, over
resident gradients; the input counted) becomes remat's budget. Then, pair by
pair, the method's step and remat's run back to back, the order alternating,
``pairs`` times: the median of remat's time over the method's, with its
quartiles; remat's peak, its predicted peak (``remat.explain()``) and its
recomputations beside the method's. ``--options`` has remat measure and plan
stage options on CPU too (``options=True``; the default, ``"auto"``, plans
none there); the table then counts the stages its plan records with one.

Writes benchmarks/results/encoder_checkpointing-cpu.json and prints a markdown table.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # noqa: E402

import remat  # noqa: E402
from remat.measure.meter import Instrument  # noqa: E402

LAYERS, WIDTH = 12, 128


class Encoder(nn.Module):
    """The chain, run plainly, by ``checkpoint_sequential(k)``, per-block, or by remat."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, 0.1, batch_first=True,
                                                               norm_first=True) for _ in range(LAYERS))
        self.how, self.budget, self.options = ("plain", None), None, "auto"

    def forward(self, x):
        kind, k = self.how
        if kind == "checkpoint_sequential":
            return checkpoint_sequential(nn.Sequential(*self.layers), k, x, use_reentrant=False)
        if kind == "per_block":
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x
        if kind == "remat":
            with remat.chain(budget=self.budget, options=self.options):
                for layer in self.layers:
                    x = layer(x)
            return x
        for layer in self.layers:
            x = layer(x)
        return x


def step(model, x):
    """(seconds, whole-step peak bytes) of one training step over resident gradients."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.zero_()
    x = x.clone().requires_grad_()
    with Instrument(writes=False) as meter:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        seconds = time.perf_counter() - t0
    return seconds, meter.peak + x.untyped_storage().nbytes()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--options", action="store_true", help="options=True: stage options on CPU too")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "encoder_checkpointing-cpu.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    base = Encoder()
    x = torch.randn(8, 64, WIDTH)
    rows = []
    for how in [("checkpoint_sequential", k) for k in (2, 3, 4, 6)] + [("per_block", None)]:
        theirs = copy.deepcopy(base)
        theirs.how = how
        step(theirs, x)
        peak = max(step(theirs, x)[1] for _ in range(2))
        ours = copy.deepcopy(base)
        ours.how, ours.budget, ours.options = ("remat", None), peak, True if args.options else "auto"
        for layer in ours.layers:
            remat.stage(layer)
        for _ in range(3):   # measuring, then the two calls that refine the times
            step(ours, x)
        ratios, peaks = [], []
        for i in range(args.pairs):
            pair = (theirs, ours) if i % 2 == 0 else (ours, theirs)
            got = {id(m): step(m, x) for m in pair}
            ratios.append(got[id(ours)][0] / got[id(theirs)][0])
            peaks.append(got[id(ours)][1])
        q = statistics.quantiles(ratios, n=4)
        name = f"checkpoint_sequential({how[1]})" if how[1] else "per-block checkpointing"
        explanation = remat.explain()
        rows.append({"method": name, "method_peak": peak, "remat_peak": max(peaks),
                     "remat_predicted_peak": explanation.predicted_peak,
                     "remat_recomputations": explanation.schedule.recomputations(),
                     "remat_options": len({op.stage for op in explanation.schedule.ops
                                           if isinstance(op, remat.Fall) and op.option}),
                     "method_recomputations": LAYERS - (how[1] and -(-LAYERS // how[1])) if how[1] else LAYERS,
                     "time_ratio_median": statistics.median(ratios), "time_ratio_quartiles": [q[0], q[2]]})
    result = {"machine": f"{os.cpu_count()} CPUs", "torch": torch.__version__, "pairs": args.pairs,
              "options": bool(args.options), "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(table(result))


def table(result):
    mib = lambda n: f"{n / 2**20:.2f}"
    lines = [f"12 x TransformerEncoderLayer(128, 4 heads), batch 8 x 64, CPU ({result['machine']}, torch "
             f"{result['torch']}); {result['pairs']} alternating pairs"
             + ("; remat with options=True" if result.get("options") else ""), "",
             "| remat at the peak of | that peak MiB | remat's peak MiB | predicted MiB | recomputations (remat / it) "
             "| stages run with an option | remat's time over its (median, quartiles) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lo, hi = r["time_ratio_quartiles"]
        lines.append(f"| {r['method']} | {mib(r['method_peak'])} | {mib(r['remat_peak'])} | "
                     f"{mib(r['remat_predicted_peak'])} | {r['remat_recomputations']} / {r['method_recomputations']} | "
                     f"{r.get('remat_options', 0)} | {r['time_ratio_median']:.3f} ({lo:.3f}-{hi:.3f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
