"""remat under torch.distributed (gloo, two CPU processes): DDP gives plain DDP's
gradients, every rank runs rank 0's costs and schedule, a costs file replaces
timing, and FSDP works in the set-ups described in docs/hostile-input.md.

Each test spawns two ranks with ``torch.multiprocessing.spawn``; each rank
writes what it saw to ``rank{r}.pt`` and the parent compares.
"""

import copy
import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import remat
from chains import make_stage

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

KINDS = ["mlp", "attn", "bn", "dropout", "tied", "ln", "mlp"]
D, BATCH, LENGTH, STEPS = 8, 4, 6, 3


class Model(nn.Module):
    """A chain of chains.py stages; ``budget=None`` runs them plainly."""

    def __init__(self, kinds=KINDS):
        super().__init__()
        self.shared = nn.Linear(D, D)
        self.stages = nn.ModuleList(make_stage(k, D, 0.25, self.shared) for k in kinds)
        self.budget = None
        self.algorithm = "optimal"
        self.costs = None

    def forward(self, x, mask):
        if self.budget is None:
            for s in self.stages:
                x = s(x, mask)
            return x
        with remat.chain(budget=self.budget, algorithm=self.algorithm, costs=self.costs):
            for s in self.stages:
                x = s(x, mask)
        return x


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, port, timeout=60):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout))


def _shard(rank, step):
    """Rank ``rank``'s batch of step ``step``: its own data."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, LENGTH, D, generator=g, requires_grad=True)
    target = torch.randn(BATCH, LENGTH, D, generator=g)
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1)
    return x, mask, target


def _train(model, rank, params):
    """STEPS SGD steps on this rank's shard; per step the loss, input grad and
    parameter grads, then the parameters and buffers."""
    optim = torch.optim.SGD(params, lr=0.05)
    steps = []
    for step in range(STEPS):
        torch.manual_seed(10 * rank + step)       # dropout: same stream in plain and remat
        x, mask, target = _shard(rank, step)
        loss = (model(x, mask) * target).sum()
        optim.zero_grad()
        loss.backward()
        steps.append((loss.detach(), x.grad.clone(), [None if p.grad is None else p.grad.clone() for p in params]))
        optim.step()
    return {"steps": steps, "params": [p.detach().clone() for p in params],
            "buffers": [b.clone() for b in model.buffers()]}


def _budget(base):
    """A budget a third of the way from the chain's minimum to store-all (sizes only,
    so the same on every rank) that makes remat recompute."""
    from remat.solver.schedule import simulate
    from remat.solver.solve import minimum_budget, store_all

    probe = copy.deepcopy(base)
    probe.budget, probe.algorithm = 2**50, "store_all"
    x, mask, _ = _shard(0, 0)
    probe(x, mask).sum().backward()
    costs = remat.explain().costs
    remat.clear_cache()
    low, high = minimum_budget(costs), simulate(costs, store_all(costs.length)).peak
    return int(low + (high - low) / 3)


def _no_timing(*_args, **_kwargs):
    raise AssertionError("remat timed a stage although a costs file was given")


def _ddp_worker(rank, port, tmp):
    _init(rank, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    measuring = sys.modules["remat.measure.measuring"]   # where the measuring call looks up its timers
    torch.manual_seed(0)
    base = Model()
    budget = _budget(base)
    out = {"budget": budget}

    ref = DDP(copy.deepcopy(base))
    out["plain"] = _train(ref, rank, list(ref.parameters()))

    # run 1: measured here, rank 0's costs broadcast and written to the file
    path = os.path.join(tmp, "costs.json")
    net = copy.deepcopy(base)
    net.budget, net.costs = budget, path
    ddp = DDP(net)
    out["remat"] = _train(ddp, rank, list(ddp.parameters()))
    exp = remat.explain()
    out["costs"] = exp.costs.to_dict()
    out["ops"] = [str(op) for op in exp.schedule.ops]
    out["recomputations"] = exp.schedule.recomputations()
    dist.barrier()
    out["file_equals_costs"] = remat.Costs.load(path) == exp.measured

    # run 2: a fresh model and cache load the file and must not time anything
    remat.clear_cache()
    timed = (measuring.instrumented_run, measuring.timed_step)
    measuring.instrumented_run = measuring.timed_step = _no_timing
    try:
        net = copy.deepcopy(base)
        net.budget, net.costs = budget, path
        ddp = DDP(net)
        out["loaded"] = _train(ddp, rank, list(ddp.parameters()))
    finally:
        measuring.instrumented_run, measuring.timed_step = timed
    exp = remat.explain()
    out["loaded_costs_equal_file"] = exp.measured == remat.Costs.load(path)
    out["loaded_ops"] = [str(op) for op in exp.schedule.ops]
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _spawn(worker, tmp_path, *args):
    mp.spawn(worker, args=(_free_port(), str(tmp_path)) + args, nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_same(ref, got, what):
    for i, ((la, xa, ga), (lb, xb, gb)) in enumerate(zip(ref["steps"], got["steps"])):
        assert torch.equal(la, lb), f"{what}: loss of step {i}"
        assert torch.equal(xa, xb), f"{what}: input grad of step {i}"
        assert len(ga) == len(gb)
        for j, (a, b) in enumerate(zip(ga, gb)):
            assert (a is None and b is None) or torch.equal(a, b), f"{what}: grad of parameter {j} at step {i}"
    for j, (a, b) in enumerate(zip(ref["params"], got["params"])):
        assert torch.equal(a, b), f"{what}: parameter {j} after {STEPS} steps"
    for j, (a, b) in enumerate(zip(ref["buffers"], got["buffers"])):
        assert torch.equal(a, b), f"{what}: buffer {j} after {STEPS} steps"


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return _spawn(_ddp_worker, tmp_path_factory.mktemp("ddp"))


def test_ddp_matches_plain_ddp(ddp_results):
    """On each rank, remat under DDP gives plain DDP's losses, gradients, buffers and
    parameters bitwise over three steps, with a budget that makes it recompute."""
    for rank, out in enumerate(ddp_results):
        assert out["recomputations"] > 0
        _assert_same(out["plain"], out["remat"], f"rank {rank}")
    # DDP averaged the gradients: both ranks hold the same parameters
    for a, b in zip(ddp_results[0]["remat"]["params"], ddp_results[1]["remat"]["params"]):
        assert torch.equal(a, b)


def test_all_ranks_run_rank0_costs_and_schedule(ddp_results):
    """Rank 1's costs are rank 0's measured costs (times included) and both ranks run one schedule."""
    r0, r1 = ddp_results
    assert r0["costs"] == r1["costs"]
    assert r0["ops"] == r1["ops"]
    assert r0["budget"] == r1["budget"]


def test_costs_file_is_written_and_loaded_without_timing(ddp_results):
    """The costs file holds the costs the ranks ran on; a new run loads it without timing any
    stage, gets the same costs, the same schedule and plain DDP's gradients."""
    for rank, out in enumerate(ddp_results):
        assert out["file_equals_costs"]
        assert out["loaded_costs_equal_file"]
        assert out["loaded_ops"] == out["ops"]
        _assert_same(out["plain"], out["loaded"], f"rank {rank}, loaded costs")


# FSDP --------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    @remat.stage
    def forward(self, x, mask=None):
        return torch.tanh(self.lin(x))


def _fsdp_model(algorithm, costs):
    torch.manual_seed(0)
    model = Model([])
    del model.shared
    model.stages = nn.ModuleList(Block() for _ in range(5))
    if algorithm is not None:
        model.budget, model.algorithm, model.costs = 2**30, algorithm, costs
    return model


# FSDP2 runs on CPU from torch 2.7 (2.5: "FSDP requires CUDA for streams"; 2.6: a CPU
# stream has no record_event)
FSDP2_ON_CPU = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 7)


def _fsdp_worker(rank, port, tmp):
    _init(rank, port)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:   # torch 2.5: not yet public
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # a CPU mesh: with CUDA at hand fully_shard would take the GPU by default
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,)) if FSDP2_ON_CPU else None

    def full(params):
        return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in params]

    path = os.path.join(tmp, "fsdp_costs.json")
    # a costs file, measured on a model FSDP does not wrap (as one measured elsewhere)
    probe = _fsdp_model("periodic(2)", path)
    _train(probe, rank, list(probe.parameters()))
    remat.clear_cache()
    dist.barrier()
    out = {}
    setups = {
        # FSDP2 on the root module only: the stages are not FSDP units
        "fsdp2_root": lambda m: fully_shard(m, mesh=mesh),
        # FSDP1, one unit per stage, costs from the file
        "fsdp1_per_stage": lambda m: FSDP(m, device_id=torch.device("cpu"), use_orig_params=True,
                                          auto_wrap_policy=ModuleWrapPolicy({Block})),
        # the same, measured under FSDP1 (the measuring call's stage backwards run no
        # AccumulateGrad, whose hooks FSDP1 keeps its post-backward in)
        "fsdp1_measured": lambda m: FSDP(m, device_id=torch.device("cpu"), use_orig_params=True,
                                         auto_wrap_policy=ModuleWrapPolicy({Block})),
    }
    if not FSDP2_ON_CPU:
        del setups["fsdp2_root"]
    for name, wrap in setups.items():
        for algorithm in (None, "periodic(2)", "min_memory"):
            model = wrap(_fsdp_model(algorithm, path if name == "fsdp1_per_stage" else None))
            params = list(model.parameters())
            result = _train(model, rank, params)
            result["params"] = full(params)
            result["steps"] = [(loss, xg, []) for loss, xg, _ in result["steps"]]
            out[(name, algorithm)] = result
            remat.clear_cache()
    # set-ups that fail (last: FSDP's state may be left broken): the error each rank got
    failing = {
        "fsdp2_per_stage": lambda m: ([fully_shard(s, mesh=mesh) for s in m.stages], fully_shard(m, mesh=mesh))[1],
    }
    if not FSDP2_ON_CPU:
        del failing["fsdp2_per_stage"]
    for name, wrap in failing.items():
        model = wrap(_fsdp_model("periodic(2)", None))
        try:
            _train(model, rank, list(model.parameters()))
            out[name] = None
        except Exception as exc:
            out[name] = (type(exc).__name__, "\n".join([str(exc), *getattr(exc, "__notes__", [])]))
        remat.clear_cache()
        dist.barrier()
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return _spawn(_fsdp_worker, tmp_path_factory.mktemp("fsdp"))


def test_fsdp_matches_plain_fsdp(fsdp_results):
    """FSDP2 on the root module, and FSDP1 with one unit per stage (costs from a file, or
    measured under it), give plain FSDP's losses, input gradients and parameters bitwise."""
    for rank, out in enumerate(fsdp_results):
        for name in ("fsdp2_root", "fsdp1_per_stage", "fsdp1_measured") if FSDP2_ON_CPU else (
                "fsdp1_per_stage", "fsdp1_measured"):
            plain = out[("fsdp1_per_stage" if name.startswith("fsdp1") else name, None)]
            for algorithm in ("periodic(2)", "min_memory"):
                _assert_same(plain, out[(name, algorithm)], f"rank {rank}, {name}, {algorithm}")


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 runs on CPU from torch 2.7")
def test_fsdp2_unit_per_stage_is_a_clear_error(fsdp_results):
    """fully_shard on each stage replaces the tensor a stage returns (FSDP2's post-forward
    hook), which remat refuses with a StageError naming the two stages."""
    for out in fsdp_results:
        kind, message = out["fsdp2_per_stage"]
        assert kind == "StageError" and "stage 2" in message and "stage 1" in message


def _shapes_worker(rank, port, tmp):
    _init(rank, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Model()
    net.budget = 2**30
    ddp = DDP(net)
    out = []
    mask = torch.full((2 * LENGTH, 2 * LENGTH), float("-inf")).triu(1)
    for length in (LENGTH * (1 + rank), LENGTH):   # (ranks padded apart, then alike)
        x = torch.randn(BATCH, length, D, requires_grad=True)
        try:
            ddp(x, mask[:length, :length]).sum().backward()
            out.append("ran")
        except remat.UsageError as exc:
            out.append(str(exc))
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()   # (the exit docs/limitations.md gives: gloo's threads can abort an interpreter's exit)
    dist.destroy_process_group()
    os._exit(0)


def test_ranks_measuring_other_shapes_is_a_clear_error_on_every_rank(tmp_path):
    """Two DDP ranks whose batches are padded to other lengths: every rank plans rank 0's
    schedule, which fits rank 0's sizes alone. Before, rank 1 ran on rank 0's costs at
    71% over the budget, silently (a helper's find); now every rank raises, naming the
    fix, and a step on one shape after it runs."""
    for first, then in _spawn(_shapes_worker, tmp_path):
        assert "other sizes" in first and "give every rank inputs of one shape" in first, first
        assert then == "ran", then
