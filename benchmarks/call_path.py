"""The modules of remat a training step runs code in, in the order it first
enters each, for a chain's first (measuring) call and for a later call; and
how many lines of code the functions it runs there span.

    python benchmarks/call_path.py [--json]

The model is the GPT of remat/models/gpt.py (4 blocks, dropout on) at a
budget between its minimum and storing everything, so that the later call
recomputes. remat/models/ is left out of the count: it is the model, the
code a user would have written. The later call is the sixth step, past the two that refine the
times (remat/measure/refine.py). docs/how-it-works.md ("The life of a
training step") names the modules this prints.

The line counts bound how few modules any layout could have: the functions a
call runs must live somewhere, so with no module over 400 lines a path
passes through at least (lines of those functions) / 400 modules. A layout
that keeps the code readable needs more room than that: at least one blank
line between two functions (PEP 8 asks two between top-level ones), and the
Notes that say why those functions do what they do (the modules' Notes,
which stay with the code: docs/how-it-works.md holds the measurements
behind them). ``floor`` counts those too, and ``at_least_with_notes`` the
modules they need.
"""

import argparse
import ast
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import remat  # noqa: E402
from remat.models import GPT  # noqa: E402

PACKAGE = os.path.join(ROOT, "remat") + os.sep
MODELS = os.path.join(PACKAGE, "models") + os.sep
MAX_LINES = 400


def _spans(path, cache={}):
    """{first line of each function: its last line} of a source file."""
    if path not in cache:
        tree = ast.parse(open(path).read())
        cache[path] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                cache[path][node.lineno] = (first, node.end_lineno)
    return cache[path]


def _outermost(path, run):
    """How many of the functions of ``path`` that ran (their lines in ``run``) lie in no other
    function: each needs a blank line apart from the code before it."""
    spans = [s for s in _spans(path).values() if s[0] in run]
    return sum(1 for a, b in spans if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in spans))


def _note_lines(path, cache={}):
    """Lines of the Notes (``Note [Name]`` over a dashed line, to the next Note or
    the end of their docstring) in the docstrings of a source file."""
    if path not in cache:
        tree, count = ast.parse(open(path).read()), 0
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False) or ""
                lines = text.splitlines()
                starts = [i for i in range(len(lines) - 1)
                          if lines[i].strip().startswith("Note [") and set(lines[i + 1].strip()) == {"-"}]
                for a, b in zip(starts, starts[1:] + [len(lines)]):
                    count += b - a
        cache[path] = count
    return cache[path]


def trace(step):
    """Run ``step()``; return ([module paths in the order first entered], {path: set of lines of the
    functions run there})."""
    order, lines = [], {}

    def profile(frame, event, _arg):
        if event != "call":
            return
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(PACKAGE) or path.startswith(MODELS):
            return
        if path not in lines:
            order.append(path)
            lines[path] = set()
        span = _spans(path).get(code.co_firstlineno)
        if span is not None:
            lines[path].update(range(span[0], span[1] + 1))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return order, lines


def paths():
    """{"first call": trace of a GPT chain's first call, "later call": that of its
    sixth}, each (modules in order, {module: lines of the functions run})."""
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.1)
    data = torch.randint(0, 64, (4, 16))

    def step():
        logits = model(data)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), data.flatten()).backward()

    remat.clear_cache()
    model.budget = remat.chain.NO_LIMIT
    step()
    costs = remat.explain().costs
    remat.clear_cache()
    low, high = remat.solver.solve.minimum_budget(costs), costs.held_bytes + sum(costs.saved_bytes) * 2
    model.budget = low + (high - low) // 8   # (near the minimum: the plan recomputes, whatever the timings)
    out = {"first call": trace(step)}
    for _ in range(4):
        step()
    out["later call"] = trace(step)
    schedule = remat.explain().schedule
    assert schedule.recomputations() > 0 or any(getattr(op, "option", 0) for op in schedule.ops), \
        "the later call recomputes nothing"
    return out


def summary(order, lines):
    """What ``main`` prints of one call's trace (``order``, ``lines``): its modules, the lines of
    the functions it runs, and the fewest modules of at most 400 lines that could hold them,
    alone and with a blank line after each and their modules' Notes (``floor``)."""
    code = sum(len(v) for v in lines.values())
    functions = sum(_outermost(p, lines[p]) for p in order)
    notes = sum(_note_lines(p) for p in order)
    floor = code + functions + notes
    return {"modules": [os.path.relpath(p, ROOT) for p in order], "function_lines": code,
            "functions": functions, "note_lines": notes, "floor": floor,
            "at_least": math.ceil(code / MAX_LINES), "at_least_with_notes": math.ceil(floor / MAX_LINES)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    out = {name: summary(order, lines) for name, (order, lines) in paths().items()}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for name, row in out.items():
        print(f"{name}: {len(row['modules'])} modules; the functions it runs span {row['function_lines']} lines "
              f"(at least {row['at_least']} modules of at most {MAX_LINES} lines); with a blank line after each "
              f"of its {row['functions']} functions and the {row['note_lines']} lines of its modules' Notes, "
              f"{row['floor']} lines: at least {row['at_least_with_notes']} modules")
        for m in row["modules"]:
            print(f"  {m}")


if __name__ == "__main__":
    main()
