"""What the forward phase lets go (remat/measure/chain_record.py Note [What the forward phase
drops]): a^i of a stage whose successor's recording keeps no part of it, unless
the code around the chain holds it."""

import contextlib
import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn

import remat
from chains import Net, assert_same, budget_for, measured_costs, physical_peak, train

KINDS = ["linear", "dropout", "scale", "dropout", "relu", "scale", "linear"]


class Keeping(Net):
    """A loop that keeps every activation (``how``: the tensor itself, as a list of
    hidden states does, or an alias of it, which no weak reference to it sees)."""

    def __init__(self, kinds, how):
        super().__init__(kinds)
        self.how = how
        self.kept = []

    def forward(self, x, mask):
        self.kept = []
        if self.budget is None:
            return self._loop(x, mask)
        with remat.chain(budget=self.budget, algorithm=self.algorithm):
            return self._loop(x, mask)

    def _loop(self, x, mask):
        for s in self.stages:
            x = s(x, mask)
            self.kept.append(x if self.how == "tensor" else x.detach())
        return x


def _quiet_and_under_budget(net):
    """Two more steps warn of nothing, and a step's real peak is under the budget."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(net, steps=2, hold=False)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    assert physical_peak(net, hold=False) <= net.budget


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_stages_keeping_nothing_of_their_input(fraction):
    """Dropout and scale stages keep nothing of their input: the plan counts it gone
    once the next stage has run, and the real peak stays under the budget and
    within 10% of the prediction; results are plain PyTorch's."""
    torch.manual_seed(0)
    base = Net(KINDS)
    costs = measured_costs(base)
    # a^1 (linear's output) goes: dropout keeps only its mask, and linear's backward
    # does not read its output
    assert costs.fwd_drop[0] == costs.fwd_drop_whole[0] == costs.out_bytes[0]
    # a^5 (relu's output) goes on its own (scale keeps nothing), but relu's backward
    # reads it: not inside a-bar^5; a^6 stays (linear saves its input)
    assert costs.fwd_drop[4] == costs.out_bytes[4] and costs.fwd_drop_whole[4] == 0
    assert costs.fwd_drop[5] == 0 and costs.fwd_drop[-1] == 0
    net = copy.deepcopy(base)
    net.budget = budget_for(costs, "optimal", fraction)
    assert_same(train(copy.deepcopy(base), hold=False), train(net, hold=False))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    peak = physical_peak(net, hold=False)
    predicted = remat.explain().schedule.peak
    assert 0.9 * predicted <= peak <= net.budget


def test_loop_keeping_its_activations_is_seen_while_measuring():
    """A loop that keeps every activation (a list of hidden states): the measuring
    call sees them alive as the chain ends, says so, and counts them as held
    through the step; nothing is counted as let go, and the budget holds."""
    torch.manual_seed(0)
    net = Keeping(KINDS, "tensor")
    with pytest.warns(RuntimeWarning, match=r"keeps the outputs of stages 1-6 \(4.50 KiB\)"):
        costs = measured_costs(net)
    assert not any(costs.fwd_drop)
    assert costs.held_bytes >= sum(costs.out_bytes[:-1])
    net.budget = budget_for(costs, "optimal", 0.3)
    with pytest.warns(RuntimeWarning, match="keeps the outputs"):   # net's own measuring call
        train(net, steps=1, hold=False)
    _quiet_and_under_budget(net)


def test_loop_keeping_aliases_is_caught_by_the_first_run():
    """A loop that keeps aliases of its activations (``detach()``): measuring cannot
    see them, the first call that runs the plan finds storages alive as the chain
    ends that its schedule let go, warns, and from then on counts them as held:
    later calls plan with them and stay under the budget, silently."""
    torch.manual_seed(0)
    net = Keeping(KINDS, "alias")
    costs = measured_costs(net)
    measured = remat.explain().measured   # (costs: as planned, with a^L held)
    assert any(costs.fwd_drop)
    net.budget = budget_for(costs, "optimal", 1.0)   # store-all: every stage records
    with pytest.warns(RuntimeWarning) as seen:
        train(net, steps=2, hold=False)
    said = " ".join(str(w.message) for w in seen)
    assert "kept the outputs of stages 1-4 after the next stage had run" in said
    assert "kept the outputs of stages 5-6 through its backward" in said
    cache = importlib.import_module("remat.runtime.chain_call")._cache
    entry = next(e for e in cache.values() if e.ident(1) is net.stages[0])
    now = entry.costs
    assert not any(now.fwd_drop) and now.held_bytes == measured.held_bytes + sum(measured.out_bytes[:-1])
    net.budget = budget_for(entry.planning_costs(), "optimal", 0.3)
    _quiet_and_under_budget(net)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_stages_returning_their_input(fraction):
    """Identity stages hand on their input as it is, so an activation can share the
    storage of a checkpoint remat holds: no stage output is taken for one the loop
    kept, results are plain PyTorch's and the peak stays under the budget."""
    from chains import Stage
    torch.manual_seed(0)
    base = Net(["linear", "scale", "linear", "scale", "scale", "relu"])
    for i in (1, 3, 4):
        base.stages[i] = Stage("identity", torch.nn.Identity())
    net = copy.deepcopy(base)
    net.budget = budget_for(measured_costs(base), "optimal", fraction)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(train(copy.deepcopy(base), hold=False), train(net, hold=False))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    assert physical_peak(net, hold=False) <= net.budget


@pytest.mark.parametrize("how", ["slice", "transpose"])
def test_first_stage_returning_a_view_of_the_input_is_not_a_caller_keep(how):
    """A first stage returning a view of the chain's input shares its storage, which
    the loop holds and the costs count already: not an activation the code around
    the chain kept (a false warning, and then a held count that refused the budget)."""

    @remat.stage
    def first(x):
        return x[:, :16] if how == "slice" else x.t().t()

    torch.manual_seed(0)
    layers = [remat.stage(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(8, 32 if how == "slice" else 16, requires_grad=True)
            with remat.chain(budget=12000):
                h = first(x)
                for layer in layers:
                    h = layer(h)
            h.sum().backward()
    assert not [w for w in caught if "kept" in str(w.message)]
    assert remat.explain().schedule.recomputations() > 0


def test_a_stage_returning_a_slice_of_its_input_inside_the_chain_is_not_a_caller_keep():
    """A stage inside the chain returning a slice of its input (``x[:, :6]``): its output
    shares the input's storage, which the plan may hold (inside the stage before's
    record), so it does not go when the next stage has run. The second call said the
    loop kept it, and from the third every call refused a budget plain PyTorch fits."""
    torch.manual_seed(0)
    lins = [remat.stage(nn.Sequential(nn.Linear(16, 16), nn.Tanh())) for _ in range(4)]
    odd = remat.stage(lambda x: x[:, :6])

    def step(budget, seed):
        x = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()
        with remat.measure_peak():
            with remat.chain(budget=budget):
                h = lins[3](lins[2](odd(lins[1](lins[0](x)))))
            h.sum().backward()
        return remat.explain()

    remat.clear_cache()
    step(2**40, 100)
    budget = step(2**40, 101).least_budget + 1000
    remat.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # (the false "kept the output of stage 3")
        for call in range(4):
            assert step(budget, call).measured_peak <= budget


class Collecting(nn.Module):
    """Attention whose probabilities, which autograd saves, are also kept: stored on the
    module (``how``: "detach", as a visualisation does), or collected by a forward hook
    on their softmax ("hook", as transformers' output_attentions=True does), or not
    kept at all ("none")."""

    def __init__(self, d, how):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.softmax = nn.Softmax(-1)
        self.how = how
        self.maps = None
        if how == "hook":
            self.softmax.register_forward_hook(lambda m, _args, out: m.collected.append(out))

    @remat.stage
    def forward(self, x, mask):
        self.softmax.collected = []   # (what one call collects)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = self.softmax((q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5 + mask)
        if self.how == "detach":
            self.maps = att.detach()
        return x + self.proj(att @ v)


def _collecting_net(how, n=6):
    torch.manual_seed(0)
    net = Net(["linear"] * n)
    net.stages = nn.ModuleList(Collecting(8, how) for _ in range(n))
    return net


@pytest.mark.parametrize("how", ["detach", "hook", "none"])
def test_saved_tensors_kept_elsewhere_count_as_held(how):
    """Attention maps a stage saves for its backward and also keeps (on the module, or
    through a hook): dropping them with the stage frees nothing. The measuring call
    sees it (Note [Saved tensors held elsewhere]), warns and counts them as held
    through the step: at the minimum budget and half way to store-all the real peak
    stays under the budget (it went 30% over before), and results are plain PyTorch's.
    A hook keeps the maps with their graph: a recomputation's graph lets go of its
    input all the same (it kept a^(i-1) past B(i): 13% over). Maps kept by no one are
    not counted."""
    base = _collecting_net(how)
    maps = 4 * 6 * 6 * 4   # (batch, length, length) float32, per stage
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        costs = measured_costs(base)
    said = [str(w.message) for w in seen if "keeps too" in str(w.message)]
    if how == "none":
        assert not said
        chain = costs.without_tail()   # (the chain's own: the tail's kept bytes aside)
        assert chain.held_bytes == chain.out_bytes[-1]   # (a^L, as planned: Note [The chain's output])
        return
    assert len(said) == 1 and "stage 1 (Collecting) saves tensors for its backward" in said[0]
    chain = costs.without_tail()
    assert chain.held_bytes == chain.out_bytes[-1] + 6 * maps
    for fraction in (0.0, 0.5):
        net = copy.deepcopy(base)
        net.budget = budget_for(costs, "optimal", fraction)
        with pytest.warns(RuntimeWarning, match="keeps too"):   # net's own measuring call
            got = train(net, hold=False)
        assert_same(train(copy.deepcopy(base), hold=False), got)
        assert remat.explain().schedule.recomputations() > 0
        _quiet_and_under_budget(net)
        # (the measured backward lets none of them go either: they were a map short)
        assert physical_peak(net, hold=False) <= 1.01 * remat.explain().schedule.peak


class Remembering(nn.Module):
    """A stage that keeps its input on the module (a debugging aid, a cache)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.last = None

    @remat.stage
    def forward(self, x, mask):
        self.last = x
        return torch.tanh(self.lin(x))


def test_stage_keeping_its_input_keeps_it_whole_after_a_recomputation():
    """A recomputation lets its copy of the input go once its graph is built (the
    graph's AccumulateGrad would hold it: recompute._let_go); a stage that kept that
    input still has it, with the values plain PyTorch's kept."""
    torch.manual_seed(0)
    base = Net(["linear"] * 5)
    base.stages = nn.ModuleList(Remembering(8) for _ in range(5))
    net = copy.deepcopy(base)
    net.budget = budget_for(measured_costs(base), "optimal", 0.0)
    ref = copy.deepcopy(base)
    assert_same(train(ref, hold=False), train(net, hold=False))
    assert remat.explain().schedule.recomputations() > 0
    for a, b in zip(ref.stages, net.stages):
        assert torch.equal(a.last, b.last)


class CastingNet(Net):
    """A chain run under a cache that holds what stages make from their weights:
    autocast's casts ("autocast", around the forward and, with ``both``, the
    backward) or a parametrization's weights (``parametrize.cached()``)."""

    def __init__(self, kinds, cache, both=False):
        super().__init__(kinds)
        self.cache, self.both = cache, both
        if cache == "parametrize":
            for s in self.stages:
                for m in s.modules():
                    if isinstance(m, nn.Linear):
                        nn.utils.parametrizations.weight_norm(m)

    def context(self):
        if self.cache == "autocast":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return nn.utils.parametrize.cached()

    def forward(self, x, mask):
        if self.both:   # (entered around the backward too: in train below)
            return super().forward(x, mask).float()
        with self.context():
            return super().forward(x, mask).float()


def _cached_step(net, seed=0):
    """A training step of ``net`` (its cache around the backward too if ``both``)
    under the storage meter, as ``physical_peak`` meters one."""
    from remat.measure.meter import Instrument

    x, mask = __import__("chains").make_input(net, seed=seed)
    target = torch.randn(x.shape)
    with (net.context() if net.both else contextlib.nullcontext()), Instrument() as inst:
        x.register_hook(lambda g: inst.set_gate(False))
        y = net(x, mask)
        inst.set_gate(False)
        y.register_hook(lambda g: (inst.set_gate(True), inst.count(g))[0])
        loss = (y * target).sum()
        del y
        loss.backward()
    return inst.peak + x.untyped_storage().nbytes()


@pytest.mark.parametrize("cache,both", [("autocast", False), ("autocast", True), ("parametrize", False)])
def test_weights_a_cache_holds_count_as_held(cache, both):
    """autocast's cache holds each weight's cast, and parametrize.cached() each
    parametrized weight, until the context ends: a stage dropped with its saved
    tensors frees neither. They count as held through the step, not in a-bar^i, and
    silently (Note [Saved tensors held elsewhere]); the real peak stays under the
    budget (up to 2x over before) and near the prediction."""
    torch.manual_seed(0)
    base = CastingNet(["mlp", "attn", "mlp", "attn", "mlp", "ln"], cache, both)
    probe = copy.deepcopy(base)
    probe.budget, probe.algorithm = remat.chain.NO_LIMIT, "store_all"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _cached_step(probe)
    costs = remat.explain().costs
    assert costs.held_bytes > costs.out_bytes[-1]   # (the casts, beside a^L as planned)
    for fraction in (0.0, 0.5):
        net = copy.deepcopy(base)
        net.budget = budget_for(costs, "optimal", fraction)
        for seed in range(3):
            _cached_step(net, seed)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        peak = _cached_step(net, 7)
        assert remat.explain().schedule.recomputations() > 0
        assert 0.9 * remat.explain().schedule.peak <= peak <= net.budget


def test_a_last_stage_returning_a_view_of_its_input_is_not_a_caller_keep():
    """A last stage returning a transpose of its input: the loop holds a^L, whose base
    is a^(L-1). The first call warned that the code around the chain keeps stage 3's
    output, and counted its storage, a^L's, as held through the step a second time."""
    torch.manual_seed(0)
    lins = [remat.stage(nn.Linear(8, 8)) for _ in range(2)]
    flip = remat.stage(lambda x: x.transpose(1, 2))
    x = torch.randn(2, 8, 8, requires_grad=True)
    remat.clear_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with remat.chain(budget="auto"):
                h = flip(lins[1](flip(lins[0](x))))
            h.sum().backward()
    assert not [w for w in caught if "keeps the" in str(w.message)]
    assert remat.explain().costs.held_bytes < 2 * x.nbytes   # (a^L once, 8 bytes more)
