"""Option 1 of a stage (remat/runtime/option_modes.py Note [Running an option],
remat/measure/options.py Note [Measuring an option]) against plain PyTorch:
the same bits wherever the solver records stages with it, the bytes measured
are those the runtime holds, and ``options=False`` plans as before."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

import remat
from remat import Option
from remat.measure.chain_record import ChainRecord
from remat.solver.schedule import Fall
from remat.solver.solve import minimum_budget, solve
from chains import (Net, Stage, assert_same, budget_for, make_input, measured_costs, physical_peak, plain_and_budgeted,
                    random_chains, train)


@pytest.fixture(autouse=True)
def _options_on_cpu(monkeypatch):
    """These tests run option 1 on CPU, where ``options="auto"`` (the default)
    measures and plans none: chains made here take ``options=True`` for it."""
    real = remat.chain.__init__

    def init(self, *args, options="auto", **kwargs):
        real(self, *args, options=True if options == "auto" else options, **kwargs)

    monkeypatch.setattr(remat.chain, "__init__", init)


_planning = ChainRecord.planning_costs


def _every_stage_option(which=1):
    """``planning_costs`` where every stage that saves more than its output has
    options keeping only the output, option ``which`` twice as fast as its record
    and the other slower than it: the solver records with option ``which``
    wherever it records (what the runtime keeps is its own)."""
    def planning(self, output=None, options=True):
        c = _planning(self, output, options)
        if c is None or not options:
            return c
        n = c.length - (1 if c.tail else 0)

        def option(k, speed):
            return Option(c.out_bytes[k - 1], c.fwd_time[k - 1] * speed, c.bwd_time[k - 1] * speed,
                          c.fwd_tmp[k - 1], c.bwd_tmp[k - 1])

        return c.with_options({k: [option(k, 0.5 if o == which else 2.0) for o in range(1, which + 1)]
                               for k in range(1, n + 1) if c.saved_bytes[k - 1] > c.out_bytes[k - 1]})
    return planning


def _measured_options_cheap(which):
    """``planning_costs`` with the measured option keeping as ``which`` says (1: every
    expensive output, 2: those autograd saves) made faster than the records (its
    bytes as measured; any other as measured): the solver takes it wherever it
    fits ("rung": a stage's first rung). ``planning.chosen`` collects (stage, option number) of those made so."""
    def planning(self, output=None, options=True):
        c = _planning(self, output, options)
        if c is None or not c.has_options:
            return c
        made = {}
        for k in range(1, c.length + 1):
            policies = self.stages[k - 1].costs.policies if k <= len(self.stages) else ()
            q = next((q for q, p in enumerate(policies) if p == which or which == "rung" and isinstance(p, frozenset)),
                     None)
            if q is not None:
                planning.chosen.add((k, q + 1))
                made[k] = [dataclasses.replace(o, fwd_time=c.fwd_time[k - 1] / 2, bwd_time=c.bwd_time[k - 1] / 2)
                           if p == q else o for p, o in enumerate(c.options[k - 1])]
        return c.with_options(made)
    planning.chosen = set()
    return planning


def _uses_options(schedule, which=None):
    return any(type(op) is Fall and op.option and op.option == (which or op.option) for op in schedule.ops)


@settings(max_examples=10 if settings.default.max_examples <= 25 else settings.default.max_examples)   # (deep: its own)
@given(random_chains(), st.floats(0, 1), st.sampled_from(["sgd", "adam"]), st.sampled_from([1, 2]))
@example((["mlp", "attn", "bn", "dropout", "mlp", "ln", "relu"], False), 0.0, "sgd", 1)
# (a scaling stage's input let go above a stage rebuilt under its option, its backward-phase Fall after that)
@example((["conv", "conv", "dropout", "scale", "conv", "conv"], True), 0.0, "sgd", 1)
@example((["linear", "mlp", "mlp", "attn", "attn", "gelu", "mlp", "linear"], False), 0.1, "adam", 2)
@example((["tied", "linear", "relu", "tied", "mlp"], False), 0.0, "sgd", 2)
@example((["convblock", "conv", "bn2d", "dropout", "convblock"], True), 0.2, "sgd", 1)
@example((["attn", "mlp", "gelu", "attn", "ln"], False), 0.0, "sgd", 2)
def test_random_chains_with_options_match_plain_pytorch(chain, fraction, opt, which):
    """With option ``which`` (1: every expensive output kept; 2: those autograd
    saves) recorded on every stage the solver records (in the forward phase and
    in the backward phase), losses, gradients, BatchNorm statistics and
    parameters after three steps are bitwise those of plain PyTorch."""
    ref, net = plain_and_budgeted(*chain, opt, fraction)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChainRecord, "planning_costs", _every_stage_option(which))
        got = train(net, opt=opt)
        schedule = remat.explain().schedule
    assert_same(ref, got)
    assert schedule.peak <= net.budget


class _Sdpa(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention`` with dropout,
    and an MLP whose first linear's output a ReLU writes in place."""

    def __init__(self, d):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    @remat.stage
    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        x = x + F.dropout(self.proj(att.transpose(1, 2).reshape(b, t, d)), 0.1)
        return x + self.out(torch.relu_(self.fc(x)))


def _steps(blocks, budget, cast=None, options=True, steps=3):
    """``steps`` SGD steps of ``blocks`` (plain where ``budget`` is None), under CPU autocast
    to ``cast`` if given; every loss, gradient and parameter after."""
    torch.manual_seed(0)
    params = [p for b in blocks for p in b.parameters()]
    optim = torch.optim.SGD(params, lr=0.01)
    out = []
    for step in range(steps):
        x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with torch.autocast("cpu", dtype=cast or torch.bfloat16, enabled=cast is not None):
            if budget is None:
                h = x
                for b in blocks:
                    h = b(h)
            else:
                with remat.chain(budget=budget, options=options):
                    h = x
                    for b in blocks:
                        h = b(h)
            loss = h.float().sin().sum()
        optim.zero_grad()
        loss.backward()
        out += [loss.detach(), x.grad.clone()] + [p.grad.clone() for p in params]
        optim.step()
    return out + [p.detach().clone() for p in params]


@pytest.mark.parametrize("which", [1, 2])
@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_sdpa_dropout_inplace_and_autocast_with_options(cast, which):
    """Blocks with scaled_dot_product_attention and dropout, and a kept output a
    ReLU writes in place (made again in B(i), not handed back), plain or under
    CPU autocast to bfloat16, every stage the solver records recorded with
    option ``which`` at the least budget: bitwise plain PyTorch's."""
    torch.manual_seed(0)
    blocks = [_Sdpa(16) for _ in range(4)]
    ref = _steps(copy.deepcopy(blocks), None, cast)
    _steps(copy.deepcopy(blocks), remat.chain.NO_LIMIT, cast, steps=1)
    # (the least budget with autocast's casts held through the step, where the options' records fit:
    # rule 10 lets the least go lower, where only base records fit, remat/solver/casts.py)
    low = minimum_budget(remat.Costs.from_dict({k: v for k, v in remat.explain().costs.to_dict().items()
                                                if k != "cast_bytes"}))
    remat.clear_cache()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChainRecord, "planning_costs", _every_stage_option(which))
        got = _steps(blocks, low, cast)
        assert _uses_options(remat.explain().schedule, which), str(remat.explain().schedule)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    remat.clear_cache()


def test_kept_output_written_in_place_is_not_kept():
    """A matmul output an op writes in place (ReLU(inplace=True)) is not among the
    bytes option 1 keeps: the runtime makes it again in B(i)."""
    torch.manual_seed(0)
    inplace = Stage("mlp", nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 8)))
    plain = Stage("mlp", nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
    plain.load_state_dict(inplace.state_dict())
    x = torch.randn(4, 6, 8, requires_grad=True)
    with remat.chain(budget=remat.chain.NO_LIMIT, algorithm="store_all"):
        y = plain(inplace(plain(x)))
    y.sum().backward()
    costs = remat.explain().costs
    (kept,), (written,) = costs.options[0], costs.options[1]
    hidden = 4 * 6 * 16 * 4   # (the first linear's output)
    assert kept.saved_bytes - written.saved_bytes == hidden
    remat.clear_cache()


# (the MLP's expensive outputs are all saved, by its GELU and its output: no option 2;
# at width 8 the rebuild's transient decides B(i), which once counted a^(i-1)'s
# gradient as well and came out up to 7% over the measured peak; and option 2's
# forward and rebuild once counted every kept output it makes again as live at
# once, 9% over on the attention chain)
@pytest.mark.parametrize("kinds, which, d", [(["mlp"] * 6, 1, 32), (["attn", "mlp"] * 3, 1, 32),
                                             (["attn", "mlp"] * 3, 2, 32), (["mlp"] * 3, 1, 8),
                                             (["attn", "linear", "linear"], 2, 8)])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7])
def test_measured_option_bytes_are_what_the_runtime_holds(kinds, fraction, which, d):
    """With the measured option ``which`` chosen wherever it fits (made faster than
    the records, its bytes as measured), a later step's metered peak is under the
    budget and within 3% of explain()'s predicted peak: the option keeps the bytes
    the measuring call says it keeps, and its B(i) needs what the costs say."""
    torch.manual_seed(0)
    net = Net(kinds, d=d)
    with pytest.MonkeyPatch.context() as mp:
        planning = _measured_options_cheap(which)
        mp.setattr(ChainRecord, "planning_costs", planning)
        net.budget = budget_for(measured_costs(net), "optimal", fraction)
        train(net, steps=1, hold=False)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        peak = physical_peak(net, hold=False)
        explanation = remat.explain()
    assert any(type(op) is Fall and (op.stage, op.option) in planning.chosen for op in explanation.schedule.ops), (
        str(explanation.schedule))
    predicted = explanation.predicted_peak
    assert peak <= net.budget and peak <= predicted
    assert peak >= 0.97 * predicted, (peak, predicted)
    remat.clear_cache()


def test_options_false_plans_as_before():
    """``options=False`` measures no options and plans as the costs without them
    would; the default measures option 1 of the blocks that have matmuls."""
    torch.manual_seed(0)
    blocks = [_Sdpa(16) for _ in range(4)]
    _steps(copy.deepcopy(blocks), remat.chain.NO_LIMIT, steps=1)
    with_options = remat.explain().costs
    assert with_options.has_options
    low = minimum_budget(with_options.without_options())
    remat.clear_cache()
    _steps(copy.deepcopy(blocks), low, options=False, steps=2)
    explanation = remat.explain()
    assert not explanation.costs.has_options and not _uses_options(explanation.schedule)
    assert explanation.schedule.ops == solve(explanation.costs, low).ops
    remat.clear_cache()


def test_explain_shows_the_option():
    """explain() shows "Fall:o1" in the forward column of a stage recorded with
    option 1, the option's own costs on an "o1" line with what it keeps, and the schedule's ops."""
    torch.manual_seed(0)
    net = Net(["mlp", "attn", "mlp", "ln"])
    net.budget = remat.chain.NO_LIMIT
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChainRecord, "planning_costs", _every_stage_option())
        train(net, steps=2)
        text = str(remat.explain())
    assert "Fall:o1" in text and "Fall1:o1" in text
    assert any(line.split()[:1] == ["o1"] and line.endswith("keeps its expensive ops' outputs")
               for line in text.splitlines()), text
    remat.clear_cache()


def test_gpt_blocks_measure_options_keeping_less():
    """Each block of the GPT (remat/models/gpt.py) measures an option 1 that keeps
    less than its record and costs more in its backward, and an option 2 that keeps
    less again (not the projections summed into the residual stream, which
    autograd does not save) and costs more again."""
    from remat.models.gpt import GPT
    torch.manual_seed(0)
    model = GPT(n_layer=3, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.1)
    model.budget = remat.chain.NO_LIMIT
    data = torch.randint(0, 64, (4, 16))
    F.cross_entropy(model(data).flatten(0, 1), data.flatten()).backward()
    costs = remat.explain().costs
    for i in range(3):
        one, two = costs.options[i][:2]   # (then its rungs, if any)
        assert two.saved_bytes < one.saved_bytes < costs.saved_bytes[i]
        assert costs.bwd_time[i] < one.bwd_time < two.bwd_time
        # at least the two projections (4 x 16 x 32 floats each; with them the fused
        # q, k, v projection, whose views attention copies, and attention's own matmuls)
        assert one.saved_bytes - two.saved_bytes >= 2 * 4 * 16 * 32 * 4
    remat.clear_cache()


@pytest.mark.parametrize("which", [1, 2])
def test_costs_file_keeps_measured_options(tmp_path, which):
    """A costs file written by a measuring call holds the options measured (both:
    the first linear's output is read by a tanh, which saves its own output);
    read back, they are planned (no warning) and run to plain PyTorch's bits."""
    import warnings

    path = str(tmp_path / "costs.json")
    torch.manual_seed(0)
    blocks = [Stage("mlp", nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 16)))
              for _ in range(4)]

    def step(budget):
        x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with remat.chain(budget=budget, costs=path):
            h = x
            for b in blocks:
                h = b(h)
        h.sin().sum().backward()
        grads = [x.grad] + [p.grad.clone() for b in blocks for p in b.parameters()]
        for b in blocks:
            b.zero_grad()
        return grads

    want = step(remat.chain.NO_LIMIT)
    assert all(len(o) == 2 for o in remat.solver.costs.Costs.load(path).options)
    low = budget_for(remat.explain().costs, "optimal", 0.5)
    remat.clear_cache()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        planning = _measured_options_cheap(which)
        mp.setattr(ChainRecord, "planning_costs", planning)
        warnings.filterwarnings("ignore", "remat: budget")
        step(low)
        got = step(low)
        assert remat.explain().costs.has_options and any(
            type(op) is Fall and (op.stage, op.option) in planning.chosen for op in remat.explain().schedule.ops)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    remat.clear_cache()


@pytest.mark.parametrize("cached", [False, True])
def test_parametrized_weights_with_options(cached):
    """Stages whose weights are parametrized (orthogonal, through matmuls of the
    parameters, and weight norm), every one recorded with option 1, inside
    ``parametrize.cached()`` or not (a recomputation there skips the weight's own
    matmuls, which must not shift the cache onto others): plain PyTorch's bits."""
    import contextlib

    import torch.nn.utils.parametrize as P
    from torch.nn.utils.parametrizations import orthogonal, weight_norm

    torch.manual_seed(0)
    blocks = [Stage("mlp", nn.Sequential(orthogonal(nn.Linear(8, 8)), nn.GELU(), weight_norm(nn.Linear(8, 8))))
              for _ in range(4)]

    def run(bs, budget):
        out = []
        for step in range(3):
            x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(step), requires_grad=True)
            with P.cached() if cached else contextlib.nullcontext():
                h = x
                with remat.chain(budget=budget) if budget is not None else contextlib.nullcontext():
                    for b in bs:
                        h = b(h)
                h.sin().sum().backward()
            out += [x.grad] + [p.grad.clone() for b in bs for p in b.parameters()]
            for b in bs:
                b.zero_grad()
        return out

    ref = run(copy.deepcopy(blocks), None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChainRecord, "planning_costs", _every_stage_option())
        got = run(blocks, remat.chain.NO_LIMIT)
        assert _uses_options(remat.explain().schedule)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    remat.clear_cache()


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_second_backward_over_a_kept_graph_with_options(fraction):
    """Two backwards through one graph (``retain_graph=True`` on the first) with
    option 1 recorded on every stage the solver records: the second reads what
    the first rebuilt (the cache read once), and the gradients are plain PyTorch's."""
    torch.manual_seed(0)
    base = Net(["mlp", "attn", "bn", "mlp", "ln"])

    def steps(net):
        torch.manual_seed(0)
        out = []
        for s in range(3):
            x, mask = make_input(net, seed=s)
            y = net(x, mask)
            y.sin().sum().backward(retain_graph=True)
            y.cos().sum().backward()
            out += [x.grad] + [p.grad.clone() for p in net.parameters() if p.grad is not None]
            net.zero_grad()
        return out

    ref = steps(copy.deepcopy(base))
    net = copy.deepcopy(base)
    net.budget = budget_for(measured_costs(base), "optimal", fraction)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChainRecord, "planning_costs", _every_stage_option())
        got = steps(net)
        assert _uses_options(remat.explain().schedule)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    remat.clear_cache()
