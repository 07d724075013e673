"""Long solves (docs/how-it-works.md, "Long chains"): Ctrl-C stops one within a
second and leaves nothing behind; one that runs long shows its progress."""

import _thread
import os
import random
import sys
import threading
import time

import pytest

from remat.solver import progress
from remat.solver.costs import Costs
from remat.solver.schedule import simulate
from remat.solver.solve import minimum_budget, solve, store_all

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from solver import make_chain  # noqa: E402  (benchmarks/solver.py: random realistic chains)


def _mid_budget(costs):
    """Halfway (geometric mean) between the chain's minimum and storing everything."""
    return int((minimum_budget(costs) * simulate(costs, store_all(costs.length)).peak) ** 0.5)


def test_ctrl_c_stops_a_solve_within_a_second():
    """A KeyboardInterrupt during a long table stops the C solve within 1 s, reaches
    the caller, leaves no solver thread behind, and the next solve runs as usual."""
    costs = Costs(**make_chain(700))
    budget = _mid_budget(costs)   # (the 700-stage table runs for seconds)
    sent = []
    timer = threading.Timer(0.7, lambda: (sent.append(time.monotonic()), _thread.interrupt_main()))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            solve(costs, budget)
            time.sleep(5)   # (finished first: the interrupt lands here, and the check below fails)
        stopped = time.monotonic()
    finally:
        timer.cancel()
        timer.join()
    assert sent and stopped - sent[0] < 1.0
    assert not [t for t in threading.enumerate() if t.name == "remat-solver" and t.is_alive()]
    small = Costs(**make_chain(30))
    assert solve(small, _mid_budget(small)).peak <= _mid_budget(small)


def test_a_long_solve_shows_progress(monkeypatch, capsys):
    """Past SHOW_AFTER seconds a solve shows a bar on stderr naming its table."""
    monkeypatch.setattr(progress, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(progress, "INLINE_WORK", 0)
    monkeypatch.setattr(progress, "POLL", 0.005)
    costs = Costs(**make_chain(250))
    solve(costs, _mid_budget(costs))
    assert "remat: solving" in capsys.readouterr().err


def test_a_short_solve_shows_nothing(capsys):
    """A solve that ends within SHOW_AFTER prints nothing."""
    costs = Costs(**make_chain(100))
    solve(costs, _mid_budget(costs))
    assert capsys.readouterr().err == ""
