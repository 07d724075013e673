"""Smoke test of benchmarks/hf_checkpointing.py (the whole-step comparison with Hugging
Face's checkpointing) on a tiny GPT-2: the acceptance figures of the whole-step budget
come from it, and a GPU session runs it once (benchmarks/gpu.sh) with no time to debug it."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "hf_checkpointing.py")
TINY = ["--layers", "2", "--width", "64", "--vocab", "500", "--batch", "2", "--length", "32", "--rounds", "1"]


def test_every_remat_call_is_under_its_budget_and_at_its_prediction(tmp_path):
    out = tmp_path / "hf.json"
    subprocess.run([sys.executable, SCRIPT, *TINY, "--out", str(out)], check=True, capture_output=True,
                   timeout=600)
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert {"plain", "hf_checkpointing", "hf_checkpointing_sac"} <= set(rows)
    remat_rows = [r for r in result["rows"] if r["budget"] is not None]
    assert remat_rows, result["refused"]
    for r in remat_rows:
        assert r["under_budget"] and r["first_calls_under_budget"], r
        assert r["scoped_peak_bytes"] == r["predicted_peak"], r
        # no schedule is faster than the bound; the plan is the optimal one on its costs
        assert r["bound_chain_seconds"] <= r["predicted_chain_seconds"] * (1 + 1e-9), r
    # a budget refused names the chain's least
    for why in result["refused"].values():
        assert "minimum" in why
    assert "remat at HF's peak" in rows
    assert rows["remat at HF's peak"]["scoped_peak_bytes"] <= rows["hf_checkpointing"]["scoped_peak_bytes"]


def test_compile_is_refused_on_cpu_with_the_reason(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, *TINY, "--compile", "0.5", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "--compile needs --device cuda" in done.stderr
    assert not (tmp_path / "x.json").exists()
