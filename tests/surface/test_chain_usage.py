"""How a chain must be opened and fed, and the clear error, naming the fix, for
each way of getting it wrong: budgets (malformed, their units, below, at and
retried with the minimum named, RNG and buffers left as they were), nested
chains, a stage called with no tensor or outside a chain, stages whose lazy
parameters are not made yet, an input made in inference mode, a stage called
under no_grad, a model running its blocks twice, a costs file written for
another input size."""

import copy
import re
import sys

import pytest
import torch
import torch.nn as nn

import remat
from chains import Net, assert_same, costs_file_step, least_budget, make_input, measured_costs, run_blocks, train
from remat.solver.solve import minimum_budget


@pytest.mark.parametrize("budget", ["abc", "12 parsecs", -1, 0, 1.5, None, [1], "0MB", "-5GiB"])
def test_malformed_budget_is_rejected_at_once(budget):
    """A budget that is not a positive size is a BudgetError naming what to write."""
    with pytest.raises(remat.BudgetError, match="budget"):
        remat.chain(budget=budget)


@pytest.mark.parametrize("text", ["1.5", "0.5", "1.5B", " 2.25 b", "1e-3"])
def test_a_fraction_of_a_byte_is_refused_with_the_fix(text):
    """A size without a unit that is not a whole number of bytes ("1.5" became 1 byte,
    "0.5" 'must be positive') is refused, naming the fix: a unit or an int of bytes."""
    with pytest.raises(remat.BudgetError, match="a fraction of a byte; give a unit .* or an int of bytes"):
        remat.chain(budget=text)


def test_a_budget_beyond_the_device_is_warned_of_once():
    """A budget above the device's memory in all ("100GB" on a smaller machine) bounds
    nothing: the first call warns, once, and names the unit to check; one within it
    does not."""
    import warnings

    import psutil
    from remat.chain import _warned_over

    stage = remat.stage(nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    beyond = 10 * psutil.virtual_memory().total
    for budget, warned in ((beyond, True), (beyond, False), (2**20, False)):
        _warned_over.discard((budget, "cpu")) if warned else None
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with remat.chain(budget=budget):
                y = stage(stage(x))
            y.sum().backward()
        said = [str(w.message) for w in seen if "has in all" in str(w.message)]
        assert len(said) == warned and (not said or "check the unit" in said[0]), said


@pytest.mark.parametrize("text,expected", [("900MB", 900 * 10**6), ("1.5GiB", 3 * 2**29), ("512 KiB", 2**19),
                                           ("4096", 4096), (123, 123), ("2e3", 2000)])
def test_budget_units(text, expected):
    """Budgets with units parse to bytes."""
    from remat.chain import parse_budget

    assert parse_budget(text) == expected


def test_budget_below_minimum_names_the_minimum_and_leaves_state(monkeypatch):
    """A budget under the chain's minimum raises BudgetError giving the minimum in human
    units; RNG and BatchNorm statistics are as before the call, and so is the cache: a
    larger budget then measures every stage and is exact. (On this chain of small
    stages the first call's minimum is what measuring a stage holds, beside the
    chain's input, more than any plan needs on the costs as measured.)"""
    torch.manual_seed(0)
    base = Net(["mlp", "bn", "dropout", "attn", "bn"] * 3)
    costs = measured_costs(base)
    measured = remat.explain().measured
    net = copy.deepcopy(base)
    x, mask = make_input(net)
    # (the first call's least, as the errors of first calls name it: what measuring a stage
    # holds beside the chain's input, more than any plan needs on the costs as measured; a
    # measuring call under a larger budget, which lets go of less, may read more)
    probe = copy.deepcopy(base)
    probe.budget = 1
    for _ in range(len(base.stages) + 2):
        try:
            probe(x, mask)
            break
        except remat.BudgetError as exc:
            probe.budget = exc.minimum
    low = probe.budget
    assert minimum_budget(measured) < low <= least_budget(costs)
    remat.clear_cache()
    net.budget = low - 1
    rng = torch.get_rng_state()
    buffers = [b.clone() for b in net.buffers()]
    with pytest.raises(remat.BudgetError, match=r"minimum of [0-9.]+ (KiB|B|MiB)") as info:
        net(x, mask)
    assert str(low) in str(info.value)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(buffers, net.buffers()))
    with pytest.raises(remat.BudgetError, match=r"minimum of [0-9.]+ (KiB|B|MiB)") as again:
        net(x, mask)   # the same budget again: the same minimum (no backward has told of a^L)
    assert str(low) in str(again.value) and again.value.__context__ is None
    net.budget = least_budget(costs)   # (the loop holds the output: later calls need that too)
    runs = []
    measuring = sys.modules["remat.measure.measuring"]
    real = measuring.instrumented_run
    monkeypatch.setattr(measuring, "instrumented_run", lambda *a, **k: runs.append(1) or real(*a, **k))
    assert_same(train(copy.deepcopy(base)), train(net))
    # (a stage that did not fit was measured again: the failed call kept nothing of it)
    assert len(runs) == len(base.stages) and remat.explain().measured.saved_bytes == measured.saved_bytes


def test_retrying_with_the_minimum_named_runs():
    """The minimum a first call's BudgetError names runs on the next calls (where the
    loop lets the chain's output go), exact: it did once count the output as held
    because no backward had shown it let go, and no backward could then run."""
    torch.manual_seed(0)
    base = Net(["mlp", "attn", "mlp", "ln", "mlp"])
    net = copy.deepcopy(base)
    net.budget = 1
    x, mask = make_input(net)
    said = []
    for _ in range(4):   # (an error raised while measuring names the least the stages so far need)
        try:
            net(x, mask)
            break
        except remat.BudgetError as info:
            said.append(str(info))
            assert info.minimum == int(re.search(r"\((\d+) bytes", said[-1]).group(1)) > net.budget
            net.budget = info.minimum
    assert said and len(said) < 4
    assert_same(train(copy.deepcopy(base), hold=False), train(net, hold=False))
    assert remat.explain().schedule.peak <= net.budget


def test_budget_equal_to_minimum_runs():
    """A budget exactly at the minimum runs and stays under it."""
    torch.manual_seed(0)
    base = Net(["mlp", "attn", "mlp", "ln", "mlp"])
    net = copy.deepcopy(base)
    net.budget = minimum_budget(measured_costs(base))
    assert_same(train(copy.deepcopy(base)), train(net))
    assert remat.explain().schedule.peak <= net.budget


def test_nested_chains_are_refused():
    """A chain opened inside another one is a clear error, which says what removing the
    inner one gives: its stages join the outer chain between its stages, and run as
    plain code inside one of its stages."""
    with remat.chain(budget="1GiB"):
        with pytest.raises(remat.StageError, match="nested.*whose stages then join it"):
            with remat.chain(budget="1GiB"):
                pass

    @remat.stage
    def outer(x):
        with remat.chain(budget="1GiB"):
            return x * 2

    with pytest.raises(remat.StageError, match="nested.*inside stage 1 of the open chain"):
        with remat.chain(budget="1GiB"):
            outer(torch.randn(3, requires_grad=True))


def test_stage_without_tensor_argument():
    """A stage called with no tensor inside a chain says what the activation is."""
    @remat.stage
    def f(n):
        return n

    with remat.chain(budget="1GiB"):
        with pytest.raises(remat.StageError, match="no tensor argument"):
            f(3)


def test_stage_outside_chain_is_plain():
    """Outside a chain a stage is the undecorated code."""
    lin = nn.Linear(4, 4)
    staged = remat.stage(copy.deepcopy(lin))
    x = torch.randn(2, 4)
    assert torch.equal(lin(x), staged(x))
    assert list(lin.state_dict()) == list(staged.state_dict())


def test_lazy_stage_not_initialized_names_the_dry_run():
    """A stage with lazy parameters not initialized yet cannot be measured: the error
    says to run the model once first; after that dry run the chain is exact."""
    torch.manual_seed(0)
    stages = [remat.stage(nn.Sequential(nn.LazyLinear(16), nn.Tanh())) for _ in range(4)]
    x = torch.randn(6, 16)

    def call(budget):
        return run_blocks(stages, x, budget)

    with pytest.raises(remat.StageError, match=r"stage 1 .*lazy parameters.*run the model once first"):
        call(2**40)
    with torch.no_grad():
        call(None)
    ref = copy.deepcopy(stages)
    call(2**40).square().sum().backward()
    h = x
    for s in ref:
        h = s(h)
    h.square().sum().backward()
    for a, b in zip(stages, ref):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_input_made_in_inference_mode_is_named():
    torch.manual_seed(0)
    stages = [remat.stage(nn.Linear(8, 8)) for _ in range(3)]
    with torch.inference_mode():
        x = torch.randn(4, 8)

    def call(x):
        with remat.chain(budget=2**40):
            h = x
            for s in stages:
                h = s(h)
        return h

    with pytest.raises(remat.StageError, match=r"inference_mode\(\).*x\.clone\(\)"):
        call(x)
    call(x.clone()).sum().backward()
    assert all(s.weight.grad is not None for s in stages)


def test_stage_under_no_grad_mid_chain_is_named():
    """A stage called under torch.no_grad() between two others of an open chain is
    named, with the way to freeze it; the next call without it is exact."""
    torch.manual_seed(0)
    layers = [remat.stage(nn.Linear(16, 16)) for _ in range(4)]
    x = torch.randn(8, 16, requires_grad=True)

    def call(frozen):
        h = x
        with remat.chain(budget=2**40):
            for i, layer in enumerate(layers):
                if i == 2 and frozen:
                    with torch.no_grad():
                        h = layer(h)
                else:
                    h = layer(h)
        return h

    with pytest.raises(remat.StageError, match=r"Linear\) was called under torch.no_grad\(\) .*requires_grad_\(False\)"):
        call(True)
    call(False).sum().backward()
    ref = copy.deepcopy(layers)
    for layer in layers + ref:
        layer.zero_grad()
    call(False).sum().backward()
    h = x
    for layer in ref:
        h = torch.nn.functional.linear(h, layer.weight, layer.bias)
    h.sum().backward()
    for a, b in zip(layers, ref):
        assert torch.equal(a.weight.grad, b.weight.grad)


def test_costs_file_for_another_input_size_measures_this_one(tmp_path):
    """A costs file written for one batch size, and a call with another (an epoch's
    last, smaller batch): that call measures, warns once, and the file keeps its
    costs (it raised CostsError, whose 'delete the file' only moved the error)."""
    import warnings

    path = str(tmp_path / "costs.json")
    torch.manual_seed(0)
    layers = [remat.stage(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))) for _ in range(3)]

    costs_file_step(layers, path, 8)
    written = open(path).read()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        costs_file_step(layers, path, 5)
        costs_file_step(layers, path, 5)
    assert sum("are for an input of" in str(w.message) for w in caught) <= 1
    assert remat.explain().costs.input_bytes == 5 * 16 * 4
    assert open(path).read() == written
    costs_file_step(layers, path, 8)
    assert remat.explain().costs.input_bytes == 8 * 16 * 4


def test_second_pass_over_the_blocks_is_named():
    """A model whose forward runs its wrapped blocks twice (a siamese tower): the
    error names the block called again and says to run one chain per pass."""

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, a, b):
            for blk in self.blocks:
                a = blk(a)
            for blk in self.blocks:
                b = blk(b)
            return (a - b).square().sum()

    torch.manual_seed(0)
    model = Tower()
    remat.wrap(model, model.blocks, budget=2**40)
    with pytest.raises(remat.StageError, match=r"stage 1 of this chain, was called again as stage 4.*one remat.chain per"):
        model(torch.randn(2, 8), torch.randn(2, 8))


def test_a_block_reused_in_one_pass_with_code_between_its_calls_is_told_to_move_that_code():
    """A block called twice in one pass (shared weights) with plain code between its
    calls: the error says to move that code, not to open a chain per pass (what a
    second pass over the blocks is told)."""
    shared, norm = remat.stage(nn.Linear(8, 8)), nn.LayerNorm(8)
    with pytest.raises(remat.StageError, match=r"code between the two stages changed the activation"):
        with remat.chain(budget=2**40):
            shared(norm(shared(torch.randn(2, 8, requires_grad=True))))
    remat.clear_cache()


def test_options_auto_measures_them_on_cuda_only():
    """``options="auto"`` (the default) measures and plans no options on CPU, where
    option 1's recomputed ops cost about what whole stages do; ``options=True``
    measures them there too."""
    import torch.nn as nn

    torch.manual_seed(0)
    blocks = [remat.stage(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))) for _ in range(4)]
    x = torch.randn(8, 32)

    def measured(**kwargs):
        remat.clear_cache()
        with remat.chain(budget=remat.chain.NO_LIMIT, **kwargs):
            h = x
            for b in blocks:
                h = b(h)
        h.sum().backward()
        return remat.explain().measured

    assert not measured().has_options
    assert measured(options=True).has_options
    remat.clear_cache()
