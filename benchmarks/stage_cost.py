"""remat's own time per step on CPU, measured in place: with a budget that fits
everything, the time a chain call spends in remat's code around the stages
(each stage call less the stage's own code, and the chain's end), against a
plain step of the same model, in one process.

    python benchmarks/stage_cost.py [--calls 100] [--models gpt12 resnet101]

Writes benchmarks/results/stage_cost.json and prints a table.

Step times on a shared 2-core machine drift by 10-30% from minute to minute,
so the step-time ratio of runtime_overhead.py (a) needs many pairs to resolve
a 1% difference. This measures remat's share directly instead: timers wrap
``StageCall.invoke`` (the stage's own code), ``ChainCall.call`` (one stage call
inside a chain, remat's checks included) and ``ChainCall.finish`` (the chain's
end), and remat's time in a call is the calls less the invokes, plus the end.
The timers add about 1 µs a stage of their own. What this leaves out: the
``with remat.chain`` entry (``_begin``, once per call) and remat's work in the
backward (none when everything is stored: no hooks are set).
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from remat.tools.trials import MODELS, Clock, device_name, run_step  # noqa: E402

# (the modules whose functions are timed)
_chain = importlib.import_module("remat.runtime.chain_call")
_stage_call = importlib.import_module("remat.runtime.stage_call")


class _Timers:
    """Nanoseconds spent in the wrapped functions since ``reset``."""

    def __init__(self):
        self.invoke = self.call = self.finish = 0
        self.originals = []

    def wrap(self, owner, name, field):
        fn = getattr(owner, name)
        self.originals.append((owner, name, fn))
        timers = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(timers, field, getattr(timers, field) + time.perf_counter_ns() - t0)

        setattr(owner, name, timed)

    def unwrap(self):
        for owner, name, fn in reversed(self.originals):
            setattr(owner, name, fn)

    def reset(self):
        self.invoke = self.call = self.finish = 0


def run_case(name, calls):
    spec = MODELS[name][0]()
    torch.manual_seed(0)
    model = spec[0]()
    data = spec[1](0, torch.device("cpu"))
    stages = len(list(spec[3](model)))
    method = ("remat", (2**50, "optimal"))

    def step(how):
        t0 = time.perf_counter()
        run_step(model, spec, how, data, Clock(None, torch.device("cpu")))
        return time.perf_counter() - t0

    for _ in range(2):
        step(("plain", None))
    for _ in range(4):   # the measuring call and the two that refine its times
        step(method)
    timers = _Timers()
    timers.wrap(_stage_call.StageCall, "invoke", "invoke")
    timers.wrap(_chain.ChainCall, "call", "call")
    timers.wrap(_chain.ChainCall, "finish", "finish")
    forward, end, plain = [], [], []
    try:
        for _ in range(calls):
            timers.reset()
            step(method)
            forward.append((timers.call - timers.invoke) / 1e9)
            end.append(timers.finish / 1e9)
            plain.append(step(("plain", None)))
    finally:
        timers.unwrap()
    own = [f + e for f, e in zip(forward, end)]
    return {
        "model": name, "stages": stages, "calls": calls,
        "plain_step_seconds": statistics.median(plain),
        "forward_seconds_per_stage": statistics.median(forward) / stages,
        "end_seconds_per_stage": statistics.median(end) / stages,
        "own_seconds": statistics.median(own),
        "own_share_of_plain_step": statistics.median(o / p for o, p in zip(own, plain)),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--models", nargs="+", default=["gpt12", "resnet101"])
    args = parser.parse_args()
    out = {"machine": device_name(torch.device("cpu")), "torch": torch.__version__,
           "cases": [run_case(m, args.calls) for m in args.models]}
    with open(os.path.join(ROOT, "benchmarks", "results", "stage_cost.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"remat's own time, everything fits, on {out['machine']} (torch {out['torch']}), "
          f"medians of {args.calls} calls\n")
    print("| model | stages | plain step ms | in the forward, per stage µs | at the end, per stage µs "
          "| remat's time / plain step |")
    print("|---|---|---|---|---|---|")
    for c in out["cases"]:
        print(f"| {c['model']} | {c['stages']} | {c['plain_step_seconds'] * 1e3:.1f} "
              f"| {c['forward_seconds_per_stage'] * 1e6:.1f} | {c['end_seconds_per_stage'] * 1e6:.1f} "
              f"| {c['own_share_of_plain_step']:.2%} |")


if __name__ == "__main__":
    main()
