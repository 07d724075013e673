"""The layout's promises (docs/how-it-works.md, "The life of a training step"): a
later call runs code in at most 8 of remat's modules, and no module is over 400
lines."""

import os
import sys

import remat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import call_path  # noqa: E402


def test_no_module_over_400_lines():
    long = []
    for folder, _, files in os.walk(os.path.join(ROOT, "remat")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    n = sum(1 for _ in f)
                if n > call_path.MAX_LINES:
                    long.append((os.path.relpath(path, ROOT), n))
    assert not long


def test_a_later_call_enters_at_most_8_modules():
    """The sixth step of a GPT chain that recomputes, past the calls that refine its
    times: the modules of remat it runs code in (benchmarks/call_path.py)."""
    order, _ = call_path.paths()["later call"]
    names = [os.path.relpath(p, ROOT) for p in order]
    assert len(names) <= 8, " ".join(names)
    remat.clear_cache()


def test_a_first_call_enters_no_more_modules_than_the_docs_say():
    """The first call's modules (33, docs/how-it-works.md) do not creep up unseen: a
    helper of a path only some chains take is not entered by a GPT's first call. And
    the bound the page gives holds: the functions a first call runs, a blank line
    after each and their modules' Notes fill more than 12 modules of at most 400
    lines, so that no layout with its Notes in the code could pass through 12."""
    order, lines = call_path.paths()["first call"]
    names = [os.path.relpath(p, ROOT) for p in order]
    assert len(names) <= 33, " ".join(names)
    assert "remat/runtime/paths.py" not in names and "remat/runtime/skips.py" not in names
    row = call_path.summary(order, lines)
    assert row["at_least_with_notes"] > 12 and row["floor"] > 12 * call_path.MAX_LINES, row
    remat.clear_cache()
