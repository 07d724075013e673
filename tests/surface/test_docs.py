"""Every Python code block of README.md and docs/*.md runs, and so does every
example in remat's docstrings."""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import remat

ROOT = pathlib.Path(__file__).resolve().parents[2]   # the repository
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [
    pytest.param(block, id=f"{path.name}:{n}")
    for path in FILES
    for n, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S), 1)
]


@pytest.mark.parametrize("code", BLOCKS)
def test_code_block_runs(code, tmp_path, monkeypatch):
    """The block runs as written, in a fresh namespace and an empty directory."""
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_block__"})


MODULES = sorted(info.name for info in pkgutil.walk_packages(remat.__path__, "remat.")
                 if info.name != "remat.__main__")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    """A module's ``>>>`` examples give what they show (the project's docstring style: an example for
    every public name)."""
    monkeypatch.chdir(tmp_path)
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=False)
    assert result.failed == 0, f"{result.failed} of {name}'s {result.attempted} examples failed (run with -s)"
