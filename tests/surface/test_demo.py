"""The README's main job, ``python -m remat demo``, end to end with tiny settings."""

import contextlib
import importlib
import io
import os
import subprocess
import sys

import pytest
import torch

import remat
from remat.tools.demo import run_demo
from remat.tools.plot import missing


def test_demo_keeps_remat_under_budget_with_plain_losses():
    """The demo's table shows remat's peak under the budget and its losses equal plain PyTorch's."""
    lines = []
    result = run_demo("gpt-tiny", "50%", "cpu", steps=3, out=lines.append, progress=False)
    remat_row = result["rows"][-1]
    assert remat_row["peak_bytes"] <= result["budget_bytes"]
    assert remat_row["predicted_peak"] <= result["budget_bytes"]
    assert result["losses_equal"]
    assert "remat (optimal)" in lines[0] and "checkpoint_sequential" in lines[0]
    assert "per-block checkpointing" in lines[0] and "the fastest other method within the budget" in lines[0]
    assert "(50% of storing everything: " in lines[0]   # (a size's header names no share: "6MiB of storing" before)


def test_gain_line_states_the_measured_comparison():
    """The demo's one-line claim compares remat with the fastest other method whose
    measured peak is within the budget, as overheads over plain PyTorch's step."""
    from remat.tools.demo import gain_line

    def row(name, peak, seconds):
        return {"method": name, "peak_bytes": peak, "step_seconds": seconds}

    rows = [row("plain PyTorch", 100, 1.0), row("checkpoint_sequential, 2 segments", 40, 1.3),
            row("per-block checkpointing", 30, 1.4), row("remat (optimal)", 45, 1.1)]
    line = gain_line(rows, 50)
    assert "checkpoint_sequential, 2 segments at" in line and "67% less overhead" in line, line
    assert "per-block checkpointing at" in gain_line(rows, 35)   # (checkpoint_sequential is over it)
    assert "slower by 0.10" in gain_line(rows[:3] + [row("remat (optimal)", 45, 1.4)], 50)
    assert "as fast" in gain_line(rows[:3] + [row("remat (optimal)", 45, 1.302)], 50)
    assert "plain PyTorch fits" in gain_line(rows, 200)
    assert "the only method" in gain_line(rows, 20)


def test_gain_line_weighs_the_steps_side_by_side():
    """With each step's time (the methods taking each step in turn), a median gain
    that the steps themselves do not bear out (the middle half of remat's per-step
    differences from the other method straddles nothing) is called as fast, within
    the machine's noise; a steady one is stated with the steps that show it."""
    from remat.tools.demo import gain_line

    def row(name, peak, times):
        return {"method": name, "peak_bytes": peak, "step_seconds": sorted(times)[len(times) // 2],
                "step_times": times}

    plain = row("plain PyTorch", 100, [1.0] * 8)
    cs = row("checkpoint_sequential, 4 segments", 40, [1.35, 1.65, 1.35, 1.75, 1.35, 1.65, 1.35, 1.75])
    noisy = row("remat (optimal)", 45, [1.6, 1.2, 1.7, 1.2, 1.6, 1.2, 1.7, 1.25])   # (median 1.6 against 1.65)
    line = gain_line([plain, cs, noisy], 50)
    assert "as fast, within this machine's noise" in line and "middle half of 8 steps" in line, line
    steady = row("remat (optimal)", 45, [t - 0.1 for t in cs["step_times"]])
    line = gain_line([plain, cs, steady], 50)
    assert "less overhead in 8 of 8 steps" in line, line
    slower = row("remat (optimal)", 45, [t + 0.1 for t in cs["step_times"]])
    assert "slower by 0.10 of a plain step in 8 of 8 steps" in gain_line([plain, cs, slower], 50)


def test_demo_command_line():
    """``python -m remat demo`` runs from the command line."""
    out = subprocess.run([sys.executable, "-m", "remat", "demo", "--model", "gpt-tiny", "--steps", "3",
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


def test_command_line_bad_flags_are_one_line(tmp_path):
    """Malformed shares, devices, sweep sizes and plot and output folders are refused
    in one line before anything is measured (usage errors exit 2 through argparse)."""
    from remat.__main__ import main

    blocked = tmp_path / "file"
    blocked.write_text("")
    cases = [
        (["demo", "--budget", "inf%"], "a share of storing everything is a positive number of percent"),
        (["demo", "--budget", "nan%"], "a share of storing everything is a positive number of percent"),
        (["explain", "--budget", "x%"], "a share of storing everything is a positive number of percent"),
        (["demo", "--device", "nope"], "--device 'nope' is not a device"),
        # (where matplotlib is missing, that is said first: no folder is made for nothing)
        (["explain", "--plot", str(blocked / "sub")], "Not a directory" if missing() is None else "needs matplotlib"),
        (["bench", "--model", "tiny", "--budgets", "1"], "--budgets must be at least 2"),
        (["bench", "--model", "tiny", "--steps", "0"], "--steps must be at least 1"),
        (["bench", "--model", "tiny", "--out", str(blocked)], "--out"),   # (a file: said before the benchmark runs)
        (["demo", "--budget", "1e300%"], "100% already stores everything"),
        (["demo", "--steps", "2"], "--steps must be at least 3"),   # (2 ran 3 steps, its header said so)
        (["explain", "--budget", "0.5"], "'0.5' is a fraction of a byte; give a unit"),   # (as remat.chain says it)
    ]
    for argv, says in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv[:1] + ["--model", "gpt-tiny"] * (argv[0] != "bench") + argv[1:])
            except SystemExit as exc:   # (argparse's usage errors)
                code = exc.code
        assert code == 2, argv
        assert says in err.getvalue() and "Traceback" not in err.getvalue(), (argv, err.getvalue())
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
            main(["demo", "--device", "cuda"])
        assert "no usable CUDA" in err.getvalue()


def test_demo_budget_auto_is_the_free_memory(monkeypatch):
    """The demo and explain take "auto" as remat.chain does: the device's free memory
    less its margin."""
    budget = importlib.import_module("remat.chain")   # (the module; remat.chain is the class)
    from remat.solver.costs import Costs
    from remat.tools.demo import resolve_demo_budget

    monkeypatch.setattr(budget, "free_memory", lambda device: 10**9)
    cpu = torch.device("cpu")
    assert resolve_demo_budget(" auto", Costs.uniform(3), cpu) == int(10**9 * (1 - budget.AUTO_MARGIN))
    assert resolve_demo_budget("2MiB", Costs.uniform(3), cpu) == 2**21
    # a size below the chain's minimum is said at once, as a share is (it was said as remat's
    # first step failed, after the other methods' steps)
    least = remat.solver.solve.minimum_budget(Costs.uniform(3))
    with pytest.raises(remat.BudgetError, match="below this chain's minimum") as err:
        resolve_demo_budget(f"{least - 1}B", Costs.uniform(3), cpu)
    assert err.value.minimum == least


def test_explain_plot_without_matplotlib_says_so_before_measuring(tmp_path, monkeypatch):
    """``explain --plot DIR`` where matplotlib cannot be imported: one line naming the
    command that installs it into this Python (remat is not on a package index, so
    not ``pip install remat[plot]``), exit status 2, before anything is measured and
    with no folder made (it used to measure, print the report and die with a traceback)."""
    import importlib.util
    import time

    import remat.__main__ as cli
    import remat.tools.demo as demo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(demo, "explain_model", lambda *a, **k: pytest.fail("it measured"))
    err = io.StringIO()
    folder = tmp_path / "plots"
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        status = cli.main(["explain", "--model", "gpt-tiny", "--plot", str(folder)])
    said = err.getvalue()
    assert status == 2 and said.count("\n") == 1 and time.perf_counter() - t0 < 5, said
    assert f"{sys.executable} -m pip install matplotlib" in said and "remat[plot]" not in said
    assert not folder.exists()


def test_demo_says_what_it_counts_and_what_is_measured(capsys):
    """The demo's progress bar counts what it says it counts (the two probes, then the
    steps), shows no ETA and stays; the table says its peaks are measured and its
    times medians, and the schedule's peak a prediction; --device and --steps have help."""
    lines = []
    run_demo("gpt-tiny", "50%", "cpu", steps=3, out=lines.append, progress=True)
    bar = capsys.readouterr().err.strip().splitlines()[-1].split("\r")[-1]
    assert bar.startswith("remat demo: 2 probes, then 3 steps of each method: 5/5") and "<" not in bar, bar
    assert "(measured)" in lines[0] and "(median of 1)" in lines[0] and "(a prediction;" in lines[0]
    out = subprocess.run([sys.executable, "-m", "remat", "demo", "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    assert "--device DEVICE  cpu (default) or cuda" in out and "--steps STEPS    training steps" in out


def test_the_tradeoff_plot_of_a_long_chain_and_its_points(tmp_path):
    """``remat.tools.plot.tradeoff`` of a 1,200-stage chain (solved on groups, whose least
    is above the exact minimum it started at: it raised BudgetError) draws; a number of
    points under 1 is refused by name (it raised ZeroDivisionError)."""
    pytest.importorskip("matplotlib")
    from remat.tools import plot

    costs = remat.Costs.uniform(1200)
    assert os.path.exists(plot.tradeoff(costs, str(tmp_path / "t.png"), points=1))
    with pytest.raises(remat.UsageError, match="at least 1"):
        plot.tradeoff(costs, str(tmp_path / "u.png"), points=0)
