"""The README's main job, ``python -m remat demo``, end to end with tiny settings."""

import contextlib
import io
import subprocess
import sys

from remat.demo import run_demo


def test_demo_keeps_remat_under_budget_with_plain_losses():
    """The demo's table shows remat's peak under the budget and its losses equal plain PyTorch's."""
    lines = []
    result = run_demo("gpt-tiny", "50%", "cpu", steps=3, out=lines.append, progress=False)
    remat_row = result["rows"][-1]
    assert remat_row["peak_bytes"] <= result["budget_bytes"]
    assert remat_row["predicted_peak"] <= result["budget_bytes"]
    assert result["losses_equal"]
    assert "remat (optimal)" in lines[0] and "checkpoint_sequential" in lines[0]


def test_demo_command_line():
    """``python -m remat demo`` runs from the command line."""
    out = subprocess.run([sys.executable, "-m", "remat", "demo", "--model", "gpt-tiny", "--steps", "2",
                          "--no-progress"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "identical at every step" in out.stdout


def test_command_line_bad_budget_is_one_line():
    """A malformed or too small --budget is one line on stderr and exit status 2, not
    a traceback."""
    from remat.__main__ import main

    for budget, says in (("abc", "cannot read 'abc' as a size"), ("1%", "below this chain's minimum")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(["explain", "--model", "gpt-tiny", "--budget", budget]) == 2
        assert says in err.getvalue() and "Traceback" not in err.getvalue()
        assert err.getvalue().count("\n") == 1
