"""Smoke test of the trade-off benchmark (``python -m remat bench``) on a tiny model."""

import json

import pytest

from remat.solver.costs import Costs
from remat.tools.bench import write_bench

KEYS = {"model", "device", "machine", "torch", "stages", "steps", "min_budget", "store_all_peak", "costs",
        "run_costs", "runs", "summary"}
RUN_KEYS = {"method", "peak_bytes", "step_seconds", "chain_seconds", "losses"}


def test_bench_writes_its_results_and_keeps_remat_under_budget(tmp_path):
    """The JSON has its schema, every remat run stays under its budget and within 10%
    of its predicted peak, and every method computes plain PyTorch's losses and gradients."""
    write_bench("tiny", "cpu", steps=2, budgets=2, out_dir=str(tmp_path), progress=False)
    result = json.loads((tmp_path / "tiny-cpu.json").read_text())
    assert KEYS <= set(result)
    methods = [r["method"] for r in result["runs"]]
    assert methods[0] == "plain"
    assert [m for m in methods if m.startswith("checkpoint_sequential")] == [
        f"checkpoint_sequential({s})" for s in range(1, result["stages"] + 1)]
    remat_runs = [r for r in result["runs"] if r["method"] == "remat"]
    assert len([r for r in remat_runs if r["algorithm"] == "optimal" and "at_segments" not in r]) == 2
    # remat also runs at the peak of every checkpoint_sequential point above its minimum
    cs_peaks = {r["peak_bytes"] for r in result["runs"] if r["method"].startswith("checkpoint_sequential")
                and r["peak_bytes"] >= result["min_budget"]}
    assert cs_peaks <= {r["budget"] for r in remat_runs if r["algorithm"] == "optimal"}
    assert all("plain_step_seconds" in r for r in result["runs"])
    for r in result["runs"]:
        assert RUN_KEYS <= set(r)
    for r in remat_runs:
        assert {"budget", "predicted_seconds", "predicted_seconds_run_costs", "predicted_peak", "algorithm"} <= set(r)
        assert r["peak_bytes"] <= r["budget"]
        assert r["predicted_peak"] <= r["budget"]
        # the storage meter's peak of a whole training step is simulate's (within 10%)
        assert r["peak_bytes"] >= 0.9 * r["predicted_peak"], (r["peak_bytes"], r["predicted_peak"])
    # the run's costs: the same sizes as the planning costs, times from first calls in the run
    # (the tail, the head and the loss each first call's backward showed, within a few bytes)
    n = result["stages"]
    for field in ("out_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp"):
        assert result["run_costs"][field][:n] == result["costs"][field][:n]
        assert result["run_costs"][field][n:] == pytest.approx(result["costs"][field][n:], rel=0.01)
    assert result["run_costs"]["input_bytes"] == result["costs"]["input_bytes"]
    assert result["summary"]["max_time_error_run_costs"] >= 0
    # the model's view of each checkpoint_sequential point: its schedule on the run's costs
    points = [p for p in result["summary"]["points"] if "cs_overhead_predicted" in p]
    one = next(p for p in points if p["segments"] == 1)
    assert abs(one["cs_overhead_predicted"]) < 1e-9   # one segment: plain PyTorch's schedule
    peaks = {r.get("segments", r.get("baseline")): r["peak_bytes"] for r in result["runs"]
             if "segments" in r or "baseline" in r}
    # per-block checkpointing and per-block SAC run beside them, and remat at their peaks
    assert {r["baseline"] for r in result["runs"] if "baseline" in r} == {"per_block", "sac"}
    assert {p["baseline"] for p in result["summary"]["points"]} == {"checkpoint_sequential", "per_block", "sac"}
    for kind in ("per_block", "sac"):
        if peaks[kind] >= result["min_budget"]:
            assert peaks[kind] in {r["budget"] for r in remat_runs}, kind
    assert any(p["baseline"] == "per_block" for p in points)   # (its schedule predicted, as remat's ops)
    for p in points:   # where the model fits checkpoint_sequential's schedule in its peak,
        if p["cs_peak_predicted"] <= peaks[p["segments"] if p["segments"] else p["baseline"]]:   # the optimal one is no slower
            assert p["remat_overhead_predicted"] <= p["cs_overhead_predicted"] + 1e-9, p
        # no schedule is faster than the bound (Note [A bound on any schedule])
        assert p["bound_overhead"] <= p["remat_overhead_predicted"] + 1e-9, p
    assert "repeat_noise" in result["summary"] and "mean_overhead_reduction_bound" in result["summary"]
    # where the planning costs have options, remat also runs without them at the baselines' peaks
    if Costs.from_dict(result["costs"]).has_options:
        assert any(r.get("options") is False for r in remat_runs)
        assert result["summary"]["mean_overhead_reduction_without_options"] is not None
    assert result["summary"]["all_under_budget"]
    assert result["summary"]["losses_equal"]
    assert result["summary"]["grads_equal"] and all(r["grads_equal"] for r in result["runs"])
    assert (tmp_path / "tiny-cpu.md").read_text().startswith("### tiny")
    # each baseline point: remat given its peak, paired round by round with it
    for p in result["summary"]["points"]:
        if p.get("remat_over_baseline"):
            median, low, high = p["remat_over_baseline"]
            assert low <= median <= high and p["given_peak"] >= 0
            fits = p["given_peak"] <= peaks[p["segments"] or p["baseline"]]
            assert p["remat_not_slower"] == (fits and median <= 1.01)
            assert p["slower_beyond_noise"] == (not fits or low > 1.01)


def test_paired_ratio_takes_the_rounds_side_by_side():
    """A machine slowing down through the run weighs on both methods of a round alike: the
    ratio is taken round by round, not of the medians (which a drift can cross)."""
    from remat.tools.bench import paired_ratio

    base = {"step_times": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "step_seconds": 3.5}
    run = {"step_times": [1.01, 2.02, 3.03, 4.04, 5.05, 6.06], "step_seconds": 3.535}
    assert paired_ratio(run, base) == pytest.approx((1.01, 1.01, 1.01))
    # the same steps, met in rounds of another speed: the medians would say equal
    late = {"step_times": [3.03, 1.01, 5.05, 2.02, 6.06, 4.04], "step_seconds": 3.535}
    median, low, high = paired_ratio(late, base)
    assert low < 1.0 < high and median != pytest.approx(1.01)
    # the interval of the median: of 15 pairs, the 4th and the 12th ratios (a miss of 3.5%)
    many = {"step_times": [1.0] * 15, "step_seconds": 1.0}
    ratios = {"step_times": [1 + k / 100 for k in range(15)], "step_seconds": 1.07}
    assert paired_ratio(ratios, many) == pytest.approx((1.07, 1.03, 1.11))
    # results without step times (written before they were kept): the ratio of the medians
    assert paired_ratio({"step_seconds": 2.2}, {"step_seconds": 2.0}) == pytest.approx((1.1, 1.1, 1.1))


def test_checkpoint_sequential_ops_are_torchs_segments():
    """checkpoint_sequential(s) as remat's ops: s - 1 kept segments of L // s stages, the
    rest plain; one segment is plain PyTorch, and each kept stage is recomputed once."""
    from remat import Costs, simulate
    from remat.tools.bench import checkpoint_sequential_ops
    from remat.solver.schedule import Fall, Fck, Fn, Loss
    from remat.solver.solve import store_all

    assert checkpoint_sequential_ops(5, 1) == list(store_all(5))
    ops = checkpoint_sequential_ops(12, 5)   # segments of 2: stages 1-8 kept, 9-12 plain
    forward = ops[:ops.index(Loss)]
    assert [type(op) for op in forward] == [Fck, Fn] * 4 + [Fall] * 4
    assert sum(1 for op in ops[ops.index(Loss):] if isinstance(op, Fall)) == 8
    costs = Costs.uniform(12, time=1.0, size=10)
    for s in range(1, 13):
        sim = simulate(costs, checkpoint_sequential_ops(12, s))   # a valid schedule
        assert sim.time == 36 + (s - 1) * (12 // s)   # plain, plus each kept stage once more


class FakeAllocator:
    """torch.cuda's allocator statistics, driven by hand."""

    def __init__(self, allocated):
        self.allocated = self.peak = allocated

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch):
        import torch

        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                            lambda *a: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_cuda_chain_meter_leaves_out_memory_that_is_not_the_chains(monkeypatch):
    """The CUDA meter's peak is the chain's: its input, what it allocates while the gate is
    open, its output's gradient, and not what the model allocated around it (memory
    before the chain, or a tied weight's gradient the head leaves to autograd through
    the chain's backward), nor what comes after the gate closes for good."""
    import torch

    from remat.tools.trials import ChainMeter

    alloc = FakeAllocator(1000)          # parameters, gradients: before the step
    alloc.install(monkeypatch)
    meter = ChainMeter(torch.device("cuda"))
    with meter:
        alloc.alloc(50)                   # the embedding's dropout mask: not the chain's
        alloc.alloc(10)                   # the chain input
        meter.held = 10
        meter.gate(True)
        alloc.alloc(300)                  # the forward keeps 300
        alloc.alloc(40)
        alloc.alloc(-40)                  # a transient of 40: the chain at 350
        meter.gate(False)
        alloc.alloc(500)                  # the head's tied weight gradient, held by autograd
        alloc.alloc(20)                   # the chain output's gradient, which the budget counts
        meter.gate(True, grad_bytes=20)
        alloc.alloc(100)                  # a backward transient on top of all 330: peak 430
        alloc.alloc(-100 - 300 - 20)
        meter.gate(False)
        meter.gate(False)                 # closed again at the end of the step: no change
        alloc.alloc(2000)                 # the embedding's backward, after the chain
        meter.gate(False)
    assert meter.peak == 430


def test_readers_of_the_whole_step_carry_a_measuring_calls_resets_over(monkeypatch):
    """A call that measures resets the allocator's peak statistic before each stage's
    forward and backward (Note [Carrying the peak over]): the bench's meter and
    ``remat.measure_peak`` still read the step's peak, not the peak since remat's last
    reset, which a raw ``max_memory_allocated`` reads."""
    import torch

    import remat
    from remat.measure.cuda_peak import reset_own
    from remat.tools.trials import ChainMeter

    alloc = FakeAllocator(1000)
    alloc.install(monkeypatch)
    meter = ChainMeter(torch.device("cuda"))
    with remat.measure_peak("cuda") as whole, meter:
        meter.gate(True)
        alloc.alloc(400)    # the forward's peak, 400 over the step's start
        alloc.alloc(-300)
        reset_own()         # a stage's backward measured: the statistic starts again at 100
        alloc.alloc(50)
        alloc.alloc(-150)
        meter.gate(False)
        assert torch.cuda.max_memory_allocated() - 1000 == 150   # (what a raw reading says)
    assert meter.peak == 400 and whole.peak == 400
    # a reader's own start forgets what was carried before it
    with remat.measure_peak("cuda") as later:
        alloc.alloc(20)
        alloc.alloc(-20)
    assert later.peak == 20


def test_stage_cost_times_remat_alone_and_unwraps_its_timers():
    """benchmarks/stage_cost.py on the tiny model: remat's own time is positive and
    less than the step, and the timers it wraps around remat's functions are gone
    after it."""
    import importlib.util
    import os

    from remat.runtime import stage_call

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository
    path = os.path.join(root, "benchmarks", "stage_cost.py")
    module_spec = importlib.util.spec_from_file_location("stage_cost", path)
    stage_cost = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(stage_cost)
    invoke = stage_call.StageCall.invoke
    case = stage_cost.run_case("tiny", calls=3)
    assert stage_call.StageCall.invoke is invoke
    assert case["stages"] == 4
    assert 0 < case["forward_seconds_per_stage"] * case["stages"] < case["plain_step_seconds"]
    assert 0 < case["own_share_of_plain_step"] < 1


def test_a_job_at_a_budget_runs_the_schedule_it_solves_on_its_refined_costs():
    """``trials.job`` (runtime_overhead.py's (b)): a fresh copy measures, refines and then
    runs the schedule remat solved for the budget, which fits it and recomputes; the
    model it copied is left untouched, and its costs' sizes are store-all's."""
    import torch

    from remat.solver.schedule import simulate
    from remat.solver.solve import minimum_budget, store_all
    from remat.tools.trials import MODELS, job, measure_costs

    spec = MODELS["tiny"][0]()
    torch.manual_seed(0)
    base = spec[0]()
    before = [p.detach().clone() for p in base.parameters()]
    cpu = torch.device("cpu")
    whole = measure_costs(base, spec, 0, cpu)
    low = minimum_budget(whole)
    budget = int(low + 0.1 * (simulate(whole, store_all(whole.length)).peak - low))
    costs, schedule, times = job(base, spec, 0, cpu, budget, steps=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert schedule.budget == budget and schedule.peak <= budget
    assert schedule.recomputations() >= 1
    for field in ("out_bytes", "saved_bytes"):
        assert getattr(costs, field) == getattr(whole, field)
    assert all(p.grad is None for p in base.parameters())
    assert all(torch.equal(p, b) for p, b in zip(base.parameters(), before))


def test_given_per_block_checkpointings_own_peak_remat_runs_its_schedule():
    """Per-block checkpointing's whole-step peak, as the bench meters it, is remat's
    prediction for that schedule to the byte, and remat given exactly that peak fits
    it, so its plan there is no slower on its costs. Before, a rebuilt block's backward was counted
    as autograd's own (its saved tensors past the engine's sum of a bias gradient):
    one width-sized vector over, and remat ran a slower plan (Costs.bwd_rebuilt_less)."""
    import torch

    import remat
    from remat.solver.schedule import simulate
    from remat.solver.solve import min_memory
    from remat.tools.trials import MODELS, measure_all

    spec = MODELS["tiny"][0]()
    torch.manual_seed(0)
    base = spec[0]()
    cpu = torch.device("cpu")
    (per_block, planned), _ = measure_all(base, spec, [("per_block", None), ("remat", (2**40, "min_memory"))], 0, cpu)
    assert planned["predicted_peak"] == per_block["peak_bytes"] == planned["peak_bytes"]
    budget = per_block["peak_bytes"]
    (at_its_peak,), (schedule,) = measure_all(base, spec, [("remat", (budget, "optimal"))], 0, cpu)
    assert at_its_peak["peak_bytes"] <= budget
    costs = remat.explain().costs
    blockwise = simulate(costs, min_memory(costs.length))
    assert blockwise.peak <= budget and schedule.time <= blockwise.time
