"""remat.Sequential against plain nn.Sequential: results, state dicts, stages, measure and solve."""

import collections
import copy
import json
import sys

import pytest
import torch
from torch import nn

import remat
from remat.solver.schedule import simulate
from remat.solver.solve import minimum_budget, solve, store_all
from chains import least_budget, remember_least


def make_layers(seed=0):
    """Conv, BatchNorm, in-place ReLUs, a nested Sequential and dropout: every case a stage split meets."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Dropout(0.25)),
        nn.Sequential(nn.Sequential(nn.Conv2d(8, 4, 3, padding=1)), nn.GELU()),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
    )


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 5, generator=g)


def train(model, steps=3, seed=1):
    """Losses, gradients, buffers and parameters of ``steps`` SGD steps."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record = []
    for step in range(steps):
        x, target = batch(step)
        loss = ((model(x) - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        record.append(loss.detach())
        record.extend(p.grad.clone() for p in model.parameters())
        opt.step()
    return record + [t.detach().clone() for t in model.state_dict().values()]


def assert_same(ref, got):
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"item {i}: {m}")


def costs_of(plain):
    probe = remat.Sequential.from_module(copy.deepcopy(plain), budget=2**50, algorithm="store_all")
    costs = probe.measure(batch(0)[0])
    remember_least(costs)
    return costs


def budget_for(costs, algorithm, fraction):
    low = least_budget(costs)
    high = simulate(costs, store_all(costs.length)).peak
    budget = int(low + fraction * (high - low))
    if algorithm != "optimal":
        budget = max(budget, solve(costs, 2**50, algorithm).peak)
    return budget


@pytest.mark.parametrize("algorithm,fraction", [
    ("optimal", 0.0), ("optimal", 0.4), ("optimal", 1.0), ("sqrt", 0.0), ("min_memory", 0.0)])
def test_matches_plain_sequential(algorithm, fraction):
    """Losses, gradients, BatchNorm statistics and parameters over three steps are bitwise nn.Sequential's."""
    plain = make_layers()
    budget = budget_for(costs_of(plain), algorithm, fraction)
    seq = remat.Sequential.from_module(copy.deepcopy(plain), budget=budget, algorithm=algorithm)
    assert_same(train(copy.deepcopy(plain)), train(seq))
    assert remat.explain().schedule.peak <= budget


def test_minimum_budget_recomputes():
    """At the chain's minimum budget the schedule recomputes, so the comparison above tests recomputation."""
    plain = make_layers()
    costs = costs_of(plain)
    seq = remat.Sequential.from_module(plain, budget=least_budget(costs))
    train(seq, steps=1)
    assert remat.explain().schedule.recomputations() > 0


def test_state_dict_keys_are_nn_sequentials():
    """The state dict has exactly nn.Sequential's keys, including nested and named layers."""
    plain = make_layers()
    named = nn.Sequential(collections.OrderedDict(conv=nn.Conv2d(3, 3, 1), act=nn.ReLU(), inner=plain))
    assert list(remat.Sequential.from_module(named).state_dict()) == list(named.state_dict())
    assert list(remat.Sequential(*make_layers()).state_dict()) == list(make_layers().state_dict())


def test_state_dict_loads_both_ways():
    """An nn.Sequential checkpoint loads into remat.Sequential and the reverse, strictly."""
    a, b = make_layers(seed=0), make_layers(seed=1)
    seq = remat.Sequential(*make_layers(seed=2), budget="1MiB")
    seq.load_state_dict(a.state_dict())
    assert_same(list(a.state_dict().values()), list(seq.state_dict().values()))
    b.load_state_dict(seq.state_dict())
    assert_same(list(a.state_dict().values()), list(b.state_dict().values()))


def test_every_layer_is_a_stage_and_inplace_layers_join_the_previous_one():
    """Nested containers are flattened, one layer per stage, with each in-place layer fused into the stage before it."""
    seq = remat.Sequential.from_module(make_layers(), budget=2**30)
    train(seq, steps=1)
    assert remat.explain().names == [
        "0:Conv2d", "1:BatchNorm2d+2:ReLU", "3.0:Conv2d+3.1:ReLU", "3.2:Dropout",
        "4.0.0:Conv2d", "4.1:GELU", "5:Flatten", "6:Linear"]


def test_leading_inplace_layer_runs_before_the_chain():
    """An in-place layer at the start modifies the caller's tensor as in plain PyTorch, and the rest matches."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    seq = remat.Sequential.from_module(copy.deepcopy(plain), budget="1MiB")
    for model in (plain, seq):
        x0 = torch.randn(3, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
        x = x0 * 1.0
        model(x).sum().backward()
        model.result = (x.detach().clone(), x0.grad.clone(), [p.grad.clone() for p in model.parameters()])
    assert_same([plain.result[0], plain.result[1], *plain.result[2]], [seq.result[0], seq.result[1], *seq.result[2]])
    assert remat.explain().names == ["1:Linear", "2:Tanh", "3:Linear"]


def test_budget_none_runs_plainly():
    """With budget=None no chain is opened and the results are nn.Sequential's."""
    plain = make_layers()
    seq = remat.Sequential.from_module(copy.deepcopy(plain), budget=None)
    before = remat.explain()
    assert_same(train(copy.deepcopy(plain)), train(seq))
    assert remat.explain() is before


def test_measure_leaves_no_trace():
    """measure() keeps parameter .grad, BatchNorm statistics and the RNG stream as they
    were, and leaves no meter on the dispatch-mode stack (the one its measuring call
    left after the block, for a backward that never comes, slowed a no-grad
    evaluation after it tenfold)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    seq = remat.Sequential.from_module(make_layers(), budget="1MiB")
    train(seq, steps=1)
    remat.clear_cache()
    grads = [p.grad for p in seq.parameters()]
    state = [t.clone() for t in seq.state_dict().values()]
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    seq.measure(batch(1)[0])
    assert torch.equal(torch.rand(3), expected)
    assert all(p.grad is g for p, g in zip(seq.parameters(), grads))
    assert_same(state, list(seq.state_dict().values()))
    assert not _get_current_dispatch_mode_stack()


def test_an_evaluation_after_a_forward_with_no_backward_runs_unmetered():
    """A first call whose backward never comes (a loss computed for a log) leaves
    its meter after the block; the next call under no_grad takes it off."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    remat.clear_cache()
    seq = remat.Sequential.from_module(make_layers(), budget="1MiB")
    x = batch(1)[0]
    loss = seq(x).sum()   # (kept: an output dropped takes the meter off as its graph goes)
    assert _get_current_dispatch_mode_stack()   # (else this test tests nothing)
    with torch.no_grad():
        seq(x)
    assert not _get_current_dispatch_mode_stack()
    del loss
    remat.clear_cache()


def test_measure_then_solve_then_train_matches_plain(monkeypatch):
    """Measuring and solving ahead: the calls give plain PyTorch's results with no second
    measurement; the first two refine the times (remat/measure/refine.py), and solve then gives
    the schedule the calls run."""
    plain = make_layers()
    seq = remat.Sequential.from_module(copy.deepcopy(plain), budget=None)
    costs = seq.measure(batch(0)[0])
    measured = remat.explain().measured
    schedule = seq.solve(minimum_budget(costs))
    assert seq.budget == minimum_budget(costs) and schedule.peak <= seq.budget
    runs = []
    measuring = sys.modules["remat.measure.measuring"]
    real = measuring.instrumented_run
    monkeypatch.setattr(measuring, "instrumented_run", lambda *a, **k: runs.append(1) or real(*a, **k))
    assert_same(train(copy.deepcopy(plain)), train(seq))
    assert runs == []
    assert remat.explain().measured.saved_bytes == measured.saved_bytes
    assert remat.explain().schedule.ops == seq.solve().ops


# Costs once measured for make_layers(): at this budget the schedule runs the Flatten stage
# (which saves nothing for backward) as Fn7 and recomputes it with Fall7.
_FLATTEN_COSTS = {
    "format": "remat.costs/1",
    "fwd_time": [9.5e-05, 3.1e-05, 8.7e-05, 1.9e-05, 5.5e-05, 1.5e-05, 3.6e-06, 1.6e-05],
    "fwd_nograd_time": [0.0085, 5.7e-05, 0.000165, 3.7e-05, 8.0e-05, 3.5e-05, 9.2e-06, 3.3e-05],
    "bwd_time": [0.0003, 6.5e-05, 0.00031, 4.1e-05, 0.0085, 8.3e-05, 2.7e-05, 7.1e-05],
    "out_bytes": [4608, 4608, 4608, 4608, 2304, 2304, 2304, 80],
    "saved_bytes": [4608, 4672, 4608, 9216, 2304, 2304, 2304, 80],
    "fwd_tmp": [0, 64, 0, 4608, 0, 0, 0, 0],
    "bwd_tmp": [896, 4672, 6944, 0, 1168, 0, 0, 2900],
    "input_bytes": 1728,
}


def test_stage_that_saves_nothing_is_recomputed(tmp_path):
    """A layer that saves no tensor (Flatten), dropped in the forward and recomputed later, matches plain PyTorch."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(_FLATTEN_COSTS))
    plain = make_layers()
    seq = remat.Sequential.from_module(copy.deepcopy(plain), budget=27136, costs=str(path))   # (the tail after it counted)
    assert_same(train(copy.deepcopy(plain)), train(seq))
    ops = [str(op) for op in remat.explain().schedule.ops]
    assert "Fn7" in ops[:ops.index("Loss")] and "Fall7" in ops[ops.index("Loss"):]


def test_solve_before_measuring_raises():
    """solve() without measured costs says what to call first."""
    with pytest.raises(remat.RematError, match="measure"):
        remat.Sequential(nn.Linear(2, 2)).solve("1MiB")


def test_budget_below_minimum_raises():
    """A budget below the chain's minimum raises BudgetError naming it."""
    seq = remat.Sequential.from_module(make_layers(), budget=64)
    with pytest.raises(remat.BudgetError, match="minimum"):
        train(seq, steps=1)


def test_from_module_shares_layers():
    """from_module keeps the layers themselves (not copies) and rejects anything but nn.Sequential."""
    plain = make_layers()
    seq = remat.Sequential.from_module(plain)
    assert all(a is b for a, b in zip(plain.modules(), seq.modules()) if not isinstance(a, nn.Sequential))
    with pytest.raises(TypeError, match="nn.Sequential"):
        remat.Sequential.from_module(nn.Linear(2, 2))


def test_train_eval_switch_matches_plain():
    """Training, then eval mode with grad, then training again each match nn.Sequential."""
    plain = make_layers()
    seq = remat.Sequential.from_module(copy.deepcopy(plain), budget=budget_for(costs_of(plain), "optimal", 0.0))
    ref = copy.deepcopy(plain)
    for mode in (True, False, True):
        assert_same(train(ref.train(mode), steps=2), train(seq.train(mode), steps=2))


def test_changed_layers_are_staged_anew():
    """Appending a layer or turning off an in-place flag changes the stages accordingly."""
    seq = remat.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), budget="1MiB")
    x = torch.randn(2, 4)
    seq(x).sum().backward()
    assert remat.explain().names == ["0:Linear+1:ReLU"]
    seq[1].inplace = False
    seq.append(nn.Linear(4, 1))
    seq(x).sum().backward()
    assert remat.explain().names == ["0:Linear", "1:ReLU", "2:Linear"]


def test_integer_input_to_an_embedding():
    """A first layer taking token ids (no grad) works and matches plain PyTorch."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    seq = remat.Sequential.from_module(copy.deepcopy(plain), budget="1MiB", algorithm="min_memory")
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    out = []
    for model in (plain, seq):
        model(ids).square().sum().backward()
        out.append([p.grad for p in model.parameters()])
    assert_same(*out)


def test_slice_and_deepcopy_keep_the_budget():
    """A slice, a deep copy, a sum and a product are remat.Sequentials with the same budget
    and algorithm (nn.Sequential's ``+`` and ``*`` made plain nn.Sequentials)."""
    seq = remat.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2), budget="2MiB", algorithm="sqrt")
    for other in (seq[1:], copy.deepcopy(seq), seq + nn.Sequential(nn.Tanh()), seq * 2, 2 * seq):
        assert isinstance(other, remat.Sequential)
        assert (other.budget, other.algorithm) == ("2MiB", "sqrt")
    assert len(seq * 2) == 6 and (seq + seq)[3] is seq[0]
    copy.deepcopy(seq)(torch.randn(3, 2)).sum().backward()


def test_a_trained_sequential_pickles_and_trains_on():
    """After a step, ``pickle`` and ``torch.save`` copy a remat.Sequential as they do an
    nn.Sequential (before, the last call's explanation went with it and could not be
    pickled), and the copy trains as the original does."""
    import io
    import pickle

    seq = remat.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), budget="1MiB")
    x = torch.randn(4, 8)
    seq(x).sum().backward()
    buffer = io.BytesIO()
    torch.save(seq, buffer)
    buffer.seek(0)
    for other in (pickle.loads(pickle.dumps(seq)), torch.load(buffer, weights_only=False)):
        assert isinstance(other, remat.Sequential) and other.budget == "1MiB"
        other.zero_grad()
        seq.zero_grad()
        other(x).sum().backward()
        seq(x).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(seq.parameters(), other.parameters()))


@pytest.mark.parametrize("mid", ["identity", "dropout0", "dropout-eval", "leading"])
def test_an_inplace_layer_after_one_that_hands_on_its_input(mid):
    """``Identity``, or a ``Dropout`` at p=0 or in eval mode, returns its input itself:
    an in-place layer after it, joining its stage, wrote that stage's input
    (``StageError``, whose advice a Sequential's user cannot follow). It now joins the
    stage before them (Note [Stages of a Sequential] 2), and the results are plain
    PyTorch's."""
    torch.manual_seed(0)
    between = {"identity": nn.Identity(), "dropout0": nn.Dropout(0.0), "dropout-eval": nn.Dropout(0.3).eval(),
               "leading": nn.Identity()}[mid]
    layers = [nn.Linear(32, 64), between, nn.ReLU(inplace=True), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)]
    if mid == "leading":
        layers = [between, nn.ReLU(inplace=True)] + layers[3:]
    plain = nn.Sequential(*layers)
    seq = remat.Sequential.from_module(copy.deepcopy(plain), budget=2**30)
    for step in range(2):
        x = torch.randn(16, 32 if mid != "leading" else 64, generator=torch.Generator().manual_seed(step))
        for net in (plain, seq):
            net.zero_grad()
            net(x.clone()).square().sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), seq.parameters())), step


def test_measure_says_nothing_of_its_own_probe_budget():
    """``Sequential.measure`` runs a probe with no limit (remat.chain.NO_LIMIT): the
    warning for a budget beyond the device is for budgets users give, not that one."""
    import warnings

    seq = remat.Sequential(nn.Linear(8, 8), nn.Tanh(), budget="1MiB")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        seq.measure(torch.randn(4, 8))
    assert not [w for w in seen if "has in all" in str(w.message)]
    assert remat.chain.NO_LIMIT == 2**60


def test_the_code_after_a_measured_sequential_is_metered_by_its_first_call():
    """``measure`` runs no loss and no backward: the first call meters the code after the
    Sequential (its head, its loss), and the calls after it count that code. Before, no
    call metered it and every step ran 30% over the budget (a 1,024-class head); then the
    first call went 14% over, on a plan that could not count that code: it now runs as a
    measuring call on the costs ``measure`` gave, holding no layer's input while that
    code runs."""
    from remat.measure.meter import Instrument

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(6)]
    seq = remat.Sequential(*layers, nn.Linear(32, 1024), budget=2**40)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 32, generator=g), torch.randint(0, 1024, (64,), generator=g)) for _ in range(4)]
    for x, t in data[:2]:
        nn.functional.cross_entropy(seq(x), t).backward()
    e = remat.explain()
    seq.budget = e.least_budget + (e.predicted_peak - e.least_budget) // 10
    remat.clear_cache()
    for p in seq.parameters():
        p.grad = torch.zeros_like(p)
    seq.measure(data[0][0])
    for call, (x, t) in enumerate(data):
        with Instrument(writes=False) as meter:   # (the step's peak; as remat.measure_peak, but no chain's)
            nn.functional.cross_entropy(seq(x), t).backward()
        assert remat.explain().tail.kept is not None
        peak = meter.peak + x.untyped_storage().nbytes()
        assert peak <= seq.budget, (call, peak, seq.budget)
