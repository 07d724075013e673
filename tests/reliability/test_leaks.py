"""Leaks: a thousand training steps hold constant live tensor memory, and remat's own
bookkeeping (chain cache, Run objects, solved plans) stays bounded."""

import gc
import sys
import weakref

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

import remat
from remat.measure.meter import Instrument
from remat.solver.solve import minimum_budget

from chains import SEQ_KINDS, Net, make_input, tracked_runs, under_budget

_chain_module = sys.modules["remat.runtime.chain_call"]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    @remat.stage
    def forward(self, x, mask=None):
        return self.drop(torch.tanh(self.lin(x)))


class Model(nn.Module):
    def __init__(self, n=6, d=8, budget=None, algorithm="optimal"):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.BatchNorm1d(d)
        self.budget = budget
        self.algorithm = algorithm

    def forward(self, x):
        x = self.norm(x)
        with remat.chain(budget=self.budget, algorithm=self.algorithm):
            for b in self.blocks:
                x = b(x)
        return x


pytestmark = pytest.mark.usefixtures("one_thread")   # (tests/conftest.py)


@pytest.fixture
def runs(monkeypatch):
    """Every ``Run`` the chains make, weakly."""
    made = tracked_runs(monkeypatch)
    return made


def _tensor_count():
    # type(), not isinstance: the latter trips deprecation shims among gc's objects
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_thousand_steps_hold_constant_memory(runs):
    """Over 1,000 steps (recomputing, with dropout and BatchNorm) the live tensor bytes after
    each step, the number of Python tensors, the chain cache, the plans and the live Run
    objects are the same as after the warm-up steps."""
    torch.manual_seed(0)
    remat.clear_cache()
    # the least budget this chain runs in: the most recomputation per step
    model = Model(n=4, budget=2**40, algorithm="store_all")
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    model.budget, model.algorithm = minimum_budget(remat.explain().costs), "optimal"
    model.zero_grad(set_to_none=True)
    remat.clear_cache()

    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(4, 8)
    target = torch.randn(4, 8)
    live, counts, cache, plans, alive = [], [], [], [], []
    with Instrument() as inst:
        for step in range(1000):
            x = data.clone().requires_grad_()
            loss = (model(x) * target).sum()
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            del x, loss
            live.append(inst.live)
            if step % 100 == 0 or step == 999:
                gc.collect()
                counts.append(_tensor_count())
                cache.append(len(_chain_module._cache))
                plans.append(sum(len(e.plans) for e in _chain_module._cache.values()))
                alive.append(len(runs))
    assert remat.explain().schedule.recomputations() > 0
    assert len(set(live[5:])) == 1, f"live bytes after warm-up vary: {sorted(set(live[5:]))[:5]} ..."
    assert len(set(counts[1:])) == 1, f"Python tensor counts grow: {counts}"
    assert cache == [1] * len(cache)
    # (the measuring call's plan goes when its backward shows the chain's output let
    # go: remat/measure/chain_record.py Note [The chain's output]; step 1 solves the one kept)
    assert plans[1:] == [1] * (len(plans) - 1)
    assert alive == [0] * len(alive), f"Run objects alive: {alive}"


def test_cache_is_bounded_and_evicted_entries_are_freed():
    """More input shapes than CACHE_SIZE keep at most CACHE_SIZE records, and an evicted
    record (and the model it measured, once dropped) is freed."""
    remat.clear_cache()
    torch.manual_seed(0)
    model = Model(n=2, d=4, budget=2**30)
    first = None
    for batch in range(2, _chain_module.CACHE_SIZE + 10):
        model(torch.randn(batch, 4, requires_grad=True)).sum().backward()
        if first is None:
            first = weakref.ref(next(iter(_chain_module._cache.values())))
    assert len(_chain_module._cache) == _chain_module.CACHE_SIZE
    gc.collect()
    assert first() is None, "the least recently used record is still alive"
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "remat's cache keeps the model alive"
    remat.clear_cache()


def test_records_of_dropped_models_are_evicted_first():
    """When the cache is full, records of models that are gone (they can never match
    again) go before the least recently used live ones."""
    remat.clear_cache()
    torch.manual_seed(0)
    keep = Model(n=2, d=4, budget=2**30)
    keep(torch.randn(2, 4, requires_grad=True)).sum().backward()   # the least recently used
    gone = [Model(n=2, d=4, budget=2**30) for _ in range(_chain_module.CACHE_SIZE - 1)]
    for model in gone:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    del gone, model
    gc.collect()
    fresh = Model(n=2, d=4, budget=2**30)
    fresh(torch.randn(2, 4, requires_grad=True)).sum().backward()   # the cache overflows
    alive = [e for e in _chain_module._cache.values() if e.ident(1) is not None]
    assert {id(e.ident(1)) for e in alive} == {id(keep.blocks[0]), id(fresh.blocks[0])}, \
        "a live model's record was evicted before those of dropped models"
    assert len(_chain_module._cache) <= _chain_module.CACHE_SIZE
    remat.clear_cache()


class _Chained(nn.Sequential):
    def forward(self, x):
        with remat.chain(budget=2**30):
            return super().forward(x)


@pytest.mark.parametrize("marking", ["method", "instance", "wrap"])
def test_deleted_models_weights_are_freed_while_their_record_is_cached(marking):
    """A model deleted after training frees its parameters at once (two garbage
    collections), though its chain's record is still cached: the record held
    each stage module's dicts, and with them its weights (a stage marked in place
    held the module too, from its __dict__), until evicted or the cache cleared."""
    remat.clear_cache()
    torch.manual_seed(0)
    if marking == "method":
        model = Model(n=3, d=16, budget=2**30)
    else:
        plain = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)]
        if marking == "instance":
            for block in plain:
                remat.stage(block)
            del block
            model = _Chained(*plain)
        else:
            model = nn.Sequential(*plain)
            remat.wrap(model, list(model), budget=2**30)
    for _ in range(2):
        model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    weights = [weakref.ref(p) for p in model.parameters()]
    assert len(_chain_module._cache) == 1
    del model
    if marking != "method":
        del plain
    gc.collect()
    gc.collect()   # (what a weak reference's callback let go of, in cycles)
    assert len(_chain_module._cache) == 1 and all(w() is None for w in weights), \
        f"{sum(w() is not None for w in weights)} of {len(weights)} parameters kept by remat's cache"
    remat.clear_cache()


def test_many_budgets_keep_few_plans():
    """Solving one chain for many budgets keeps a bounded number of plans."""
    remat.clear_cache()
    torch.manual_seed(0)
    model = Model(n=4, d=4, budget=2**30)
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    costs = remat.explain().costs
    low = minimum_budget(costs)
    for i in range(60):
        model.budget = low + i * 8
        model(x).sum().backward()
    (entry,) = _chain_module._cache.values()
    assert len(entry.plans) <= 17
    remat.clear_cache()


def _cyclic_garbage():
    """(bytes of tensor storages, remat objects) that only Python's cycle collector
    would free, found by collecting with the collector's save-all flag."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    tensors = {o.untyped_storage()._cdata: o.untyped_storage().nbytes() for o in found if isinstance(o, torch.Tensor)}
    ours = sorted({type(o).__name__ for o in found if type(o).__module__.startswith("remat")})
    return sum(tensors.values()), ours


@given(st.lists(st.sampled_from(SEQ_KINDS), min_size=1, max_size=6))
def test_no_step_leaves_a_reference_cycle(kinds):
    """Neither a measuring call nor a later one leaves a reference cycle holding
    tensors or remat's objects: what such a cycle holds stays alive until Python's
    cycle collector runs, on top of the budget (run 4's meter held its copies of
    BatchNorm's statistics so, 48 bytes over a first call)."""
    torch.manual_seed(0)
    net = Net(kinds)
    net.budget = 2**40
    gc.collect()
    gc.disable()
    try:
        for label in ("store-all", "least"):
            if label == "least":
                net.budget, bound = remat.explain().least_budget, max(remat.explain().costs.out_bytes)
                remat.clear_cache()
            for seed in range(2):
                under_budget(net, _square_step, seed, bound if label == "least" else 0)
                assert _cyclic_garbage() == (0, []), (label, seed)
    finally:
        gc.enable()
        remat.clear_cache()


def _square_step(net, seed):
    x, mask = make_input(net, seed=seed)
    net(x, mask).square().sum().backward()
