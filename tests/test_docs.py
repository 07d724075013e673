"""Every Python code block of README.md and docs/*.md runs."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
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
