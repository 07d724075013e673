"""Trade-off benchmark (the same as ``python -m remat bench``) for the models
of the results table: writes benchmarks/results/<model>-<device>.json and .md,
and the step-time-against-memory plot to docs/tradeoff-<model>-<device>.png.

    python benchmarks/tradeoff.py [--device cpu|cuda] [--models gpt12 gpt48 resnet101] [--steps 10]
"""

import argparse
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remat.tools.bench import write_bench  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=["gpt12", "gpt48", "resnet101"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budgets", type=int, default=8)
    args = parser.parse_args()
    results = os.path.join(ROOT, "benchmarks", "results")
    for model in args.models:
        result = write_bench(model, args.device, args.steps, args.budgets, results)
        png = os.path.join(results, f"{model}-{result['device']}.png")
        if os.path.exists(png):
            shutil.move(png, os.path.join(ROOT, "docs", f"tradeoff-{model}-{result['device']}.png"))
        print()


if __name__ == "__main__":
    main()
