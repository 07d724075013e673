"""Command line: ``python -m remat demo | explain | bench``."""

import argparse
import os
import sys
import warnings

# torch warns once if NumPy is absent; remat does not need it
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def main(argv=None):
    """Run the command line; a remat error or a malformed value is one line on stderr
    (exit status 2), not a traceback."""
    try:
        return _main(argv)
    except (ValueError, OSError) as exc:   # (BudgetError and CostsError are ValueErrors)
        text = str(exc)
        print(text if text.startswith("remat") else f"remat: {text}", file=sys.stderr)
        return 2


def _folder(parser, path, flag):
    """Make ``flag``'s folder ``path`` now, before anything is measured, or a usage error."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        parser.error(f"{flag} {path!r}: cannot make that folder ({exc.strerror or exc})")


def _device(parser, text):
    """``--device`` as a torch.device, or a usage error that says what is wrong."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"--device {text!r} is not a device; use cpu or cuda (cuda:1, ...)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text}: this torch build has no usable CUDA (torch.cuda.is_available() is False)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {text}: remat's demo and benchmarks run on cpu or cuda")
    return device


def _main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m remat", description="remat: optimal activation recomputation")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a model under a budget; compare with plain PyTorch and checkpoint_sequential")
    demo.add_argument("--model", default="gpt", help="gpt (default), gpt-tiny or gpt-medium")
    demo.add_argument("--budget", default="40%", help="a size (6MiB), auto, or a share of storing everything (40%%)")
    demo.add_argument("--device", default="cpu", help="cpu (default) or cuda (cuda:1, ...)")
    demo.add_argument("--steps", type=int, default=12,
                      help="training steps of each method (default 12): a warm-up, the timed ones, a metered one")
    demo.add_argument("--no-progress", action="store_true")

    exp = sub.add_parser("explain", help="measure a model, print per-stage costs and the schedule, plot them")
    exp.add_argument("--model", default="gpt", help="gpt (default), gpt-tiny or gpt-medium")
    exp.add_argument("--budget", default="40%", help="a size (6MiB), auto, or a share of storing everything (40%%)")
    exp.add_argument("--device", default="cpu", help="cpu (default) or cuda (cuda:1, ...)")
    exp.add_argument("--plot", metavar="DIR", help="save timeline.png and tradeoff.png there (needs matplotlib)")

    bench = sub.add_parser("bench", help="remat vs plain PyTorch and checkpoint_sequential, budget by budget")
    bench.add_argument("--model", default="gpt12", help="gpt12 (default), gpt48, resnet101 or tiny")
    bench.add_argument("--device", default="cpu", help="cpu (default) or cuda (cuda:1, ...)")
    bench.add_argument("--steps", type=int, default=10, help="timed steps per point (after one warm-up)")
    bench.add_argument("--budgets", type=int, default=8, help="number of remat budgets, minimum to store-all")
    bench.add_argument("--out", metavar="DIR", help="write <model>-<device>.json, .md and .png there")

    args = parser.parse_args(argv)
    device = _device(parser, args.device)
    if args.command in ("demo", "explain"):
        from .tools.demo import parse_demo_budget

        parse_demo_budget(args.budget)   # (a malformed budget is said before measuring)
    if args.command == "bench":
        from .tools.bench import MODELS, write_bench

        if args.model not in MODELS:
            parser.error(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
        if args.budgets < 2:
            parser.error("--budgets must be at least 2 (the sweep runs from the minimum to store-all)")
        if args.steps < 1:
            parser.error("--steps must be at least 1")
        if args.out is not None:   # (before measuring, as --plot)
            _folder(parser, args.out, "--out")
        write_bench(args.model, device, args.steps, args.budgets, args.out)
        return 0
    if args.command == "explain":
        from .tools.demo import MODELS, explain_model

        if args.model not in MODELS:
            parser.error(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
        if args.plot is not None:   # (before measuring: matplotlib and the folder are checked first)
            from .tools.plot import missing

            why = missing()
            if why is not None:
                raise ValueError(why.replace("remat: plots need", "remat: --plot needs", 1))
            _folder(parser, args.plot, "--plot")
        explain_model(args.model, args.budget, device, args.plot)
        return 0
    if args.command == "demo":
        from .tools.demo import MODELS, run_demo

        if args.model not in MODELS:
            parser.error(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
        if args.steps < 3:
            parser.error("--steps must be at least 3 (a warm-up, a timed step and a metered one)")
        run_demo(args.model, args.budget, device, args.steps, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
