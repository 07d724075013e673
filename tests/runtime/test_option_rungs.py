"""Rungs (6 of Note [Measuring an option], remat/measure/options.py): options
that keep the outputs of the expensive calls of most time per byte, and make the
others again in B(i). Measured bytes are exactly those calls' outputs, the
runtime holds what was measured, and every choice is plain PyTorch's bit for bit."""

import copy
import dataclasses
import gc

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, settings, strategies as st

import remat
from remat.measure import options as measured_options
from remat.measure.chain_record import ChainRecord
from remat.runtime.option_modes import Calls, keep_only, kept_flops, option_contexts
from remat.solver.schedule import Fall
from chains import assert_same, budget_for, physical_peak, plain_and_budgeted, random_chains, train
from test_option_runs import _measured_options_cheap, _options_on_cpu  # noqa: F401 (the fixture: options on CPU)

ROWS, WIDTH, DEEP, WIDE = 1024, 8, 2048, 512   # (rows of a batch; the two matmuls' inner and outer sizes)


class Mixed(nn.Module):
    """A stage with two expensive calls far apart in time per byte: a matmul over a
    deep inner dimension into a narrow output (costly, small) and an outer product
    into a wide one (cheap, large), then cheap ops that autograd saves from."""

    def __init__(self):
        super().__init__()
        self.deep = nn.Linear(DEEP, WIDTH)
        self.wide = nn.Linear(1, WIDE)

    @remat.stage
    def forward(self, x):
        z = self.deep(x.repeat(1, DEEP // WIDTH)).sigmoid()
        return x + self.wide(x[:, :1]).tanh().mean(-1, keepdim=True) * z


def _steps(blocks, budget, steps=2):
    """``steps`` SGD steps over ``blocks`` (plain where ``budget`` is None): losses,
    input and parameter gradients, and the parameters after."""
    params = [p for b in blocks for p in b.parameters()]
    optim = torch.optim.SGD(params, lr=0.01)
    out = []
    for step in range(steps):
        x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with remat.chain(budget=budget) if budget is not None else torch.enable_grad():
            h = x
            for b in blocks:
                h = b(h)
        loss = h.square().mean()
        optim.zero_grad()
        loss.backward()
        out += [loss.detach(), x.grad.clone()] + [p.grad.clone() for p in params]
        optim.step()
    return out + [p.detach().clone() for p in params]


def test_a_rung_keeps_the_costly_small_output_and_runs_bitwise():
    """The deep matmul's output (of far more time per byte than the wide one's) is
    a rung of its own: an option keeping exactly the output a^i and that call's
    bytes, less than option 1, run as the set of that call. Chosen wherever it
    fits, the steps are plain PyTorch's bit for bit and stay under the budget."""
    torch.manual_seed(0)
    blocks = [Mixed() for _ in range(4)]
    ref = _steps(copy.deepcopy(blocks), None)
    _steps(copy.deepcopy(blocks), remat.chain.NO_LIMIT, steps=1)
    costs = remat.explain().costs
    out, deep = ROWS * WIDTH * 4, ROWS * WIDTH * 4
    for i, stage in enumerate(remat.explain()._record.stages):
        listed, policies = costs.options[i], stage.costs.policies
        held = out if i < 3 else 0   # (a^L counts as held after the chain, in no record)
        rungs = [o for o, p in zip(listed, policies) if isinstance(p, frozenset)]
        assert rungs and rungs[0].saved_bytes == held + deep, (listed, policies)
        assert rungs[0].saved_bytes < listed[0].saved_bytes < costs.saved_bytes[i]
    remat.clear_cache()
    with pytest.MonkeyPatch.context() as mp:
        planning = _measured_options_cheap("rung")
        mp.setattr(ChainRecord, "planning_costs", planning)
        budget = budget_for(costs, "optimal", 0.3)
        got = _steps(blocks, budget)
        ops = remat.explain().schedule.ops
    assert any(type(op) is Fall and (op.stage, op.option) in planning.chosen for op in ops), ops
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    remat.clear_cache()


@settings(max_examples=10 if settings.default.max_examples <= 25 else settings.default.max_examples)   # (deep: its own)
@given(random_chains(), st.floats(0, 1), st.sampled_from(["sgd", "adam"]))
@example((["mlp", "attn", "bn", "dropout", "mlp", "ln", "relu"], False), 0.0, "sgd")
@example((["attn", "mlp", "attn", "tied", "linear"], False), 0.3, "adam")
@example((["convblock", "conv", "bn2d", "dropout", "convblock"], True), 0.2, "sgd")
def test_random_chains_with_rungs_match_plain_pytorch(chain, fraction, opt):
    """Every expensive call a step of its own (``RUNG_STEP`` just over 1, so that
    every stage with two such calls has rungs, whatever the timings), a stage's
    first rung made cheap so that the solver takes it wherever it fits: losses,
    gradients, BatchNorm statistics and parameters after three steps are bitwise
    plain PyTorch's, and a later step's peak is under the budget and at most its
    prediction."""
    ref, net = plain_and_budgeted(*chain, opt, fraction)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measured_options, "RUNG_STEP", 1.0 + 1e-9)
        mp.setattr(ChainRecord, "planning_costs", _measured_options_cheap("rung"))
        got = train(net, opt=opt)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        peak = physical_peak(net)
        predicted = remat.explain().predicted_peak
    assert_same(ref, got)
    assert peak <= net.budget and peak <= predicted, (peak, net.budget, predicted)
    remat.clear_cache()


def test_kept_flops_counts_matmuls_and_attention_and_says_none_elsewhere():
    """The FLOPs that rank a stage's calls (torch's formulas): 2mkn for a matmul,
    CPU attention counted as flash attention is, None for an op torch has none for
    (its calls are then ranked by time)."""
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    assert kept_flops(torch.ops.aten.mm.default, (a, b), {}, a @ b) == 2 * 16 * 32 * 8
    q = torch.randn(1, 2, 16, 8)
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)
        assert kept_flops(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {}, out) \
            == 2 * (2 * 2 * 16 * 16 * 8)   # (q k^T and its product with v, each 2 x b h s s d)
    assert kept_flops(torch.ops.aten.add.Tensor, (a, a), {}, a + a) is None


def test_a_rung_keeps_its_calls_only_where_the_forward_made_as_many_as_measured():
    """``keep_only`` with a rung's ``Calls``: the outputs of the calls it numbers where
    the forward made as many kept calls as the measured one; none where it made
    another number (a parametrization cached in one call and not the next), so that
    the stage holds fewer bytes than planned, never more; the rebuild still hands
    back what is kept and makes the rest again, bitwise."""
    a, b = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)

    def forward():
        return (a @ b).relu() @ b

    for total, kept in ((2, [True, False]), (3, [False, False])):
        keeping, handing = option_contexts()
        with keeping:
            out = forward()
        keep_only(handing, Calls([0], total), [], out)
        assert [entry[0] is not None for listed in handing.cache.values() for entry in listed] == kept
        with handing:
            again = forward()
        assert torch.equal(out, again)


class _EndsInMatmul(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.25), nn.Linear(2 * d, d))

    @remat.stage
    def forward(self, x):
        return self.body(x)   # (a^i is a kept op's output: option 1's cache holds it until B(i))


class _CutTail(nn.Module):
    def __init__(self, after):
        super().__init__()
        self.blocks, self.head, self.budget = nn.ModuleList(_EndsInMatmul() for _ in range(3)), nn.Linear(8, 24), None
        self.cut = nn.ReLU() if after == "relu" else nn.Dropout(0.5)

    def forward(self, x, t):
        with remat.chain(budget=self.budget, options=True) if self.budget else torch.enable_grad():
            for b in self.blocks:
                x = b(x)
        return nn.functional.cross_entropy(self.head(self.cut(x)).flatten(0, 1), t.flatten())


@pytest.mark.parametrize("after", ["relu", "dropout"])
def test_a_tail_letting_the_output_go_beside_an_option_keeping_it(after, monkeypatch):
    """The tail lets a^L go (``head(relu(a^L))``) where an option of the last stage keeps
    it (its last op is a matmul): the measuring call saw a^L gone at the tail's peak,
    and plans recording the last stage with that option ran one output (768 bytes)
    over their prediction, 4.3% over the budget, on every call after the first. No
    call goes over now, nor over its prediction, and every step is plain PyTorch's."""
    def step(net, seed):
        g = torch.Generator().manual_seed(seed)
        x, t = torch.randn(4, 6, 8, generator=g).requires_grad_(), torch.randint(0, 24, (4, 6), generator=g)
        for p in net.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        torch.manual_seed(seed)
        gc.disable()   # (Python's collector, run now and then, frees what a cycle held: the peak moves)
        try:
            with remat.measure_peak():   # (the chain's, its input counted as the budget counts it)
                net(x, t).backward()
        finally:
            gc.enable()
        return remat.explain().measured_peak, [x.grad] + [p.grad.clone() for p in net.parameters()]

    monkeypatch.setattr(ChainRecord, "planning_costs", _measured_options_cheap(1))   # (option 1 wherever it fits)
    torch.manual_seed(0)
    base = _CutTail(after)
    probe = copy.deepcopy(base)
    probe.budget = 2**40
    step(probe, 0)
    step(probe, 1)
    e = remat.explain()
    low, high, last = e.least_budget, e.schedule.peak, set()
    for fraction in (0.1, 0.25, 0.4, 0.6, 0.8):
        remat.clear_cache()
        ref, net = copy.deepcopy(base), copy.deepcopy(base)
        net.budget = int(low + fraction * (high - low))
        for seed in range(4):
            want = step(ref, seed)[1]
            peak, got = step(net, seed)
            e = remat.explain()
            assert peak <= net.budget and (seed == 0 or peak <= e.predicted_peak), (fraction, seed, peak, e)
            last.update(op.option for op in e.schedule.ops if type(op) is Fall and op.stage == 3)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert 1 in last   # (the case: the last stage recorded with the option)


def test_options_asked_for_after_a_call_without_them_are_measured():
    """A chain measured without options, then called with ``options=True``: that
    call measures them (they were left out silently, until ``clear_cache()``); then
    ``options=False`` plans without them on the same record."""
    torch.manual_seed(0)
    blocks = [_EndsInMatmul() for _ in range(3)]
    x = torch.randn(4, 6, 8, requires_grad=True)
    remat.clear_cache()
    said = []
    for options in (False, True, True, False):
        with remat.chain(budget=2**30, options=options):
            h = x
            for b in blocks:
                h = b(h)
        h.sum().backward()
        said.append((remat.explain().measured.has_options, remat.explain().costs.has_options))
    assert said == [(False, False), (True, True), (True, True), (True, False)], said


# a plan's times for the chain below (measured in a run whose plan kept a^1 alive to its end, ms)
_FWD = [1.03, 0.119, 0.0828, 0.106, 0.246, 0.0695, 0.0339, 0.137, 0.0]
_NOGRAD = [1.02, 0.167, 0.0835, 0.118, 0.0663, 0.524, 0.0656, 0.293, 0.0]
_BWD = [0.490, 0.0264, 0.0148, 0.0124, 0.108, 0.342, 0.0053, 0.177, 1.64]
_OPTIONS = {1: [(0.727, 0.773), (0.727, 0.823), (0.270, 0.114)], 6: [(0.376, 0.664), (0.376, 0.704), (0.0949, 0.0914)]}


def test_a_stage_saving_nothing_lets_its_input_go_before_a_rebuild_below_it():
    """Attention recorded with a rung in the backward phase before the scaling stage
    after it (which saves nothing: its anchor is the run's, ``Run.settle``) is made
    again: the scaling stage's input a^1 came from a forward without recording, whose
    missing node never told the run that B(2) had passed, so the run held it to the
    step's end, and the rebuild of stage 1 before B(1) made a^1 again beside it: 184
    bytes (1.9%) over the plan's prediction (found by the deep profile, on timings
    that chose this plan). ``Run._materialize`` lets such inputs above a rebuilt
    stage go; the step is at most its prediction, and plain PyTorch's bit for bit."""
    kinds = ["attn", "scale", "relu", "dropout", "tied", "attn", "relu", "gelu"]
    ref, net = plain_and_budgeted(kinds, False, "adam", 0.0)
    cheap = _measured_options_cheap("rung")

    def planning(self, output=None, options=True):
        c = cheap(self, output, options)
        if c is None or not c.has_options or c.stages != len(kinds):
            return c
        timed = remat.Costs.from_dict({**c.to_dict(), "fwd_time": [t / 1e3 for t in _FWD],
                                       "fwd_nograd_time": [t / 1e3 for t in _NOGRAD],
                                       "bwd_time": [t / 1e3 for t in _BWD]})
        return timed.with_options({k: [dataclasses.replace(o, fwd_time=f / 1e3, bwd_time=b / 1e3)
                                       for o, (f, b) in zip(c.options[k - 1], times)]
                                   for k, times in _OPTIONS.items() if len(c.options[k - 1]) == len(times)})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measured_options, "RUNG_STEP", 1.0 + 1e-9)
        mp.setattr(ChainRecord, "planning_costs", planning)
        got = train(net, opt="adam")
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        peak = physical_peak(net)
        schedule, predicted = remat.explain().schedule, remat.explain().predicted_peak
    backward = schedule.ops[schedule.ops.index(remat.Loss) + 1:]
    stage_one = next(j for j, op in enumerate(backward) if type(op) is Fall and op.stage == 1)
    assert backward[stage_one].option and stage_one < next(
        j for j, op in enumerate(backward) if type(op) is Fall and op.stage == 2), schedule
    assert_same(ref, got)
    assert peak <= predicted <= net.budget, (peak, predicted, net.budget)
    remat.clear_cache()
