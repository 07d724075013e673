"""The measuring calls within the budget (Note [Measuring within the budget] in
remat/measure/measuring.py): a chain's first call, the first call of a new batch
size and the calls of a path that changes, the whole step metered."""

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

import remat
from remat.measure.holding import measuring_least
from remat.measure.meter import Instrument
from remat.solver.solve import minimum_budget, store_all
from chains import Net, budget_for, calls_at_least, make_input, measured_costs

torch.set_num_threads(1)


def _blocks(n=12, d=128):
    torch.manual_seed(0)
    blocks = [remat.stage(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))) for _ in range(n)]
    for b in blocks:
        for p in b.parameters():
            p.grad = torch.zeros_like(p)   # (resident gradients)
    return blocks


def _step(blocks, budget, batch=256, depth=None, head=None, costs=None):
    """One step of the chain (its first ``depth`` blocks, then ``head`` inside the block
    if given; its costs file ``costs``); the whole step's peak, the chain's input counted."""
    x = torch.randn(batch, blocks[0][0].in_features, generator=torch.Generator().manual_seed(batch))
    with Instrument(writes=False) as meter:
        with remat.chain(budget=budget, costs=costs):
            h = x
            for b in blocks[:depth]:
                h = b(h)
            loss = (head(h) if head is not None else h).square().mean()
        loss.backward()
    return meter.peak + x.untyped_storage().nbytes()


_record = None   # the ChainRecord of the chain _costs measured last


def _costs(blocks, **kwargs):
    remat.clear_cache()
    _step(blocks, 2**40, **kwargs)
    _step(blocks, 2**40, **kwargs)
    costs = remat.explain().costs
    global _record
    _record = remat.explain()._record
    remat.clear_cache()
    return costs


def test_first_call_a_new_batch_size_and_a_changing_path_keep_near_the_budget():
    """A 12-block MLP chain at twice its minimum: its first call, the first call of a
    larger batch and a depth alternating from call to call stay under the budget;
    before, the first call peaked at about 1.8 times it, measuring kept every stage's
    saved tensors up to the budget and every input."""
    blocks = _blocks()
    costs = _costs(blocks)
    budget = 2 * minimum_budget(costs)
    peaks = [_step(blocks, budget) for _ in range(3)]
    peaks += [_step(blocks, budget, batch=320) for _ in range(2)]
    peaks += [_step(blocks, budget, depth=d) for d in (12, 8, 12, 8, 12)]
    assert max(peaks) <= budget, (peaks, budget)


@given(st.integers(2, 12), st.floats(0.0, 1.0), st.sampled_from([0, 1, 4, 10]))
def test_first_call_within_reach_of_the_budget(n, fraction, head):
    """Chains of 2 to 12 blocks with a head of 0 to 10 times a block's output inside the
    chain's block, at budgets from the minimum to storing everything: the measuring
    call's whole-step peak stays under the budget, and so do the calls after it.
    Before, the tail, unknown while the stages ran, came on top of the stage inputs
    the call held (up to about 1.3 times the budget), and measuring a stage held its
    graph through its backward, a second gradient of its output and a buffer for
    each parameter."""
    blocks = _blocks(n, d=64)
    linear = nn.Linear(64, 64 * head) if head else None
    costs = _costs(blocks, head=linear)
    low, high = minimum_budget(costs), remat.simulate(costs, store_all(costs.length)).peak
    budget = int(low + fraction * (high - low))
    peaks = [_step(blocks, budget, head=linear) for _ in range(3)]
    assert max(peaks) <= budget, (peaks, budget, low, high)


def test_a_stage_that_cannot_fit_raises_before_the_stages_after_it():
    """A budget below what one stage needs on its own: BudgetError names the stage and
    the bytes, before the stages after it run, and leaves the model as it was."""
    blocks = _blocks(6)
    big = remat.stage(nn.Sequential(nn.Linear(128, 8192), nn.GELU(), nn.Linear(8192, 128)))
    chain = blocks[:2] + [big] + blocks[2:]
    calls = []
    for i, b in enumerate(chain):
        b.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    state = [p.detach().clone() for b in chain for p in b.parameters()]
    costs = _costs(blocks)
    remat.clear_cache()
    calls.clear()
    with pytest.raises(remat.BudgetError, match=r"stage 3 \(Sequential\) alone needs") as info:
        _step(chain, 3 * minimum_budget(costs))
    assert info.value.minimum > 3 * minimum_budget(costs)
    assert 2 in calls and not {3, 4, 5, 6} & set(calls)   # (the stages after it never ran)
    assert all(torch.equal(a, p) for a, p in zip(state, (p for b in chain for p in b.parameters())))
    # (the bytes it names are measuring_least's, the least a first call of this chain needs:
    # with options a plan may need less, and tests take the larger as the minimum)
    whole = _costs(chain)
    assert info.value.minimum == measuring_least(whole, _record) > measuring_least(costs)


def test_alternating_depths_are_measured_once(monkeypatch):
    """A depth alternating between 12 and 8 blocks: the record of the longer path
    serves the shorter (its plan's prefix), so only the first call measures (before,
    every return to the longer path measured it again); every call's gradients are
    plain PyTorch's and its peak under the budget. Two shorter calls in a row drop
    the record: the shorter path is measured, once, and has a plan of its own."""
    from remat.measure import measuring
    blocks = _blocks()
    costs = _costs(blocks)
    budget = 2 * minimum_budget(costs)
    made = []
    real = measuring.Measurer.__init__
    monkeypatch.setattr(measuring.Measurer, "__init__", lambda self, *a, **k: (made.append(1), real(self, *a, **k))[1])
    params = [p for b in blocks for p in b.parameters()]
    for depth in (12, 8, 12, 8, 12, 8):
        made_before = len(made)
        for p in params:
            p.grad = torch.zeros_like(p)
        peak = _step(blocks, budget, depth=depth)
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        x = torch.randn(256, 128, generator=torch.Generator().manual_seed(256))
        h = x
        for b in blocks[:depth]:
            h = b(h)   # (outside a chain: plainly)
        h.square().mean().backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(grads, params)), depth
        assert peak <= budget, (depth, peak, budget)
        assert len(made) - made_before == (1 if depth == 12 and made_before == 0 else 0), depth
    assert len(made) == 1
    for depth in (8, 8, 8):
        _step(blocks, budget, depth=depth)
    assert len(made) == 2   # (the second 8 in a row dropped the record: the third measured)


def test_first_call_with_a_costs_file_keeps_under_the_budget(tmp_path):
    """A first call that reads its costs from a file measures no stage, so the room
    it leaves for a stage's backward comes from the file: at the chain's least
    budget its whole-step peak stays under it (it went 27% over a GPT's, every
    rebuild of its backward holding inputs as if a stage needed nothing)."""
    path = str(tmp_path / "costs.json")
    blocks = _blocks(8, d=64)
    remat.clear_cache()
    for _ in range(3):
        _step(blocks, 2**40, costs=path)
    budget = minimum_budget(remat.explain().costs)
    remat.clear_cache()
    peaks = [_step(blocks, budget, costs=path) for _ in range(3)]
    assert max(peaks) <= budget, (peaks, budget)


def test_three_depths_in_turn_are_measured_once():
    """Depths 12, 8 and 10 in turn run the longest path's record (the shorter ones its
    plan's prefix) and stay under the budget; before, every return to 12 measured it
    again (two short calls in a row dropped the record). Depths that stay shorter
    still get a record of their own."""
    from remat.measure import measuring

    blocks = _blocks(12, d=64)
    budget = 2 * minimum_budget(_costs(blocks))
    made = []
    init = measuring.Measurer.__init__
    measuring.Measurer.__init__ = lambda self, *a, **k: made.append(1) or init(self, *a, **k)
    try:
        remat.clear_cache()
        peaks = [_step(blocks, budget, depth=d) for d in (12, 8, 10) * 3]
        assert len(made) == 1 and max(peaks) <= budget, (made, peaks, budget)
        peaks += [_step(blocks, budget, depth=8) for _ in range(3)]
        assert len(made) == 2 and max(peaks) <= budget   # (8 twice in a row: its own record)
    finally:
        measuring.Measurer.__init__ = init


def test_conv_batchnorm_stages_under_a_large_head_stay_under_the_least_budget():
    """Convolution + BatchNorm stages (each writes its running statistics in place)
    under a head whose weight's gradient dwarfs them, at ``least_budget``: the first
    call's whole-step peak is at most the budget. Before, each stage's meter sat in
    a reference cycle with the copies of the statistics it noted, so the last ones
    stayed alive into the head's backward until Python's cycle collector ran (VGG-11
    with BatchNorm: 4,104 bytes over its least budget)."""
    torch.manual_seed(0)
    stages = [remat.stage(nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()))
              for c in (3, 16, 16)]
    head = nn.Linear(16 * 16 * 16, 512)
    params = [p for s in stages for p in s.parameters()] + list(head.parameters())
    x = torch.randn(2, 3, 16, 16)

    def step(budget):
        for p in params:
            p.grad = torch.zeros_like(p)   # (resident gradients)
        with Instrument(writes=False) as meter:
            with remat.chain(budget=budget):
                h = x
                for s in stages:
                    h = s(h)
                loss = head(h.flatten(1)).square().mean()
            loss.backward()
        return meter.peak + x.untyped_storage().nbytes()

    import gc
    gc.disable()   # (what the cycle collector would find is not what a step holds)
    try:
        remat.clear_cache()
        step(2**40)
        step(2**40)
        budget = remat.explain().least_budget
        remat.clear_cache()
        peaks = [step(budget) for _ in range(2)]
    finally:
        gc.enable()
    assert max(peaks) <= budget, (peaks, budget)


def test_a_record_where_storing_everything_just_fits_keeps_no_saved_tensor_past_the_budget():
    """One attention stage measured once; a first call of it at another key (a
    record of the chain in the cache) at the least budget, where storing every
    stage just fits: it lets the stage's saved tensors go as its measured backward
    reads them, and stays under the budget. Before, the record's store-all peak
    fitting told it to keep them, and its measured backward, holding them to its
    end, needed 3.2 KiB more than the budget (BudgetError after the fact)."""
    torch.manual_seed(0)
    base = Net(["attn"])
    budget = budget_for(measured_costs(base), "optimal", 0.0)
    net = copy.deepcopy(base)
    net.budget = budget
    x, mask = make_input(net)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(100))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)   # (resident gradients)
    with Instrument(writes=False) as meter:   # (the step measured_costs runs)
        (net(x, mask) * target).sum().backward()
    assert meter.peak + x.untyped_storage().nbytes() <= budget
    remat.clear_cache()


def _cnn():
    torch.manual_seed(0)
    net = remat.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Dropout(0.1),
        nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True)),
        nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.Dropout2d(0.1),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10), budget=2**30)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    return net


def _cnn_step(net, batch):
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 3, 32, 32, generator=g, requires_grad=True)
    y = torch.randint(0, 10, (batch,), generator=g)
    for p in net.parameters():
        p.grad.zero_()
    with remat.measure_peak():
        nn.functional.cross_entropy(net(x), y).backward()
    return remat.explain()


@pytest.mark.parametrize("fraction", [0.1, 0.2])
def test_a_new_batch_size_after_others_measures_under_the_budget(fraction):
    """A CNN whose stages need the most to be measured late (a stage at 64 channels
    after the pooling): the first call of batch 12, after batches 8 and 4, held the
    stage inputs it could beside the most any stage measured so far needed, and
    went 15% (at a tenth of the way from the least budget to storing everything)
    and 4% over. The record of the other shape now tells it, scaled, from the
    start (``ChainRecord.hint``)."""
    remat.clear_cache()
    net = _cnn()
    _cnn_step(net, 12)
    e = _cnn_step(net, 12)
    budget = int(e.least_budget + fraction * (e.predicted_peak - e.least_budget))
    remat.clear_cache()
    net.budget = budget
    peaks = [_cnn_step(net, batch).measured_peak for batch in (8, 4, 12, 12)]
    assert max(peaks) <= budget, (peaks, budget)
    remat.clear_cache()


def _convs(widths):
    """A remat.Sequential CNN whose convolutions have ``widths`` output channels."""
    layers, c = [], 3
    for i, w in enumerate(widths):
        layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
        layers += [nn.MaxPool2d(2)] if i == 1 else []
        c = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * c, 10))


def _seq_step(net, size, batch=4):
    for p in net.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.zero_()
    with remat.measure_peak():
        net(torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(size[0]))).square().mean().backward()
    return remat.explain()


def _least(model, size):
    remat.clear_cache()
    e = _seq_step(remat.Sequential.from_module(copy.deepcopy(model), budget=2**30), size)
    remat.clear_cache()
    return e.least_budget


def test_a_first_call_takes_no_hint_from_another_models_record():
    """Every ``remat.Sequential`` opens its chain at one site: a wide model's first call
    took a narrow one's record as its hint (store everything), and went 27% over a
    budget a tenth above its least. Only a record holding the call's first stage
    (the same model) hints now."""
    torch.manual_seed(0)
    wide = _convs([32, 32, 32])
    budget = int(1.1 * _least(wide, (16, 16)))
    _seq_step(remat.Sequential.from_module(_convs([2, 2]), budget=2**30), (16, 16))
    e = _seq_step(remat.Sequential.from_module(copy.deepcopy(wide), budget=budget), (16, 16))
    assert e.measured_peak <= budget, (e.measured_peak, budget)
    remat.clear_cache()


def test_a_new_image_size_holds_inputs_beside_the_widest_stage_input():
    """A new image size's first call, guided by the record of another size: the stage
    inputs it held left room for what measuring a stage needs beyond its input, but
    not for a later, wider input alive as that stage is measured (a convolution
    doubling the channels): 5% over. The hint now carries the widest stage input."""
    torch.manual_seed(0)
    model = _convs([8, 16, 16])
    budget = int(1.06 * _least(model, (17, 17)))
    net = remat.Sequential.from_module(copy.deepcopy(model), budget=budget)
    peaks = [_seq_step(net, size).measured_peak for size in ((16, 16), (17, 17))]
    assert max(peaks) <= budget, (peaks, budget)
    remat.clear_cache()


def test_a_side_input_needing_grad_leaves_the_first_call_under_the_least_budget():
    """Stages of unlike widths (no twins: each measured) with a side input needing grad:
    each stage's measured backward took the side input's gradient at its edge, and the
    engine ran the backward of every stage before it to sum their shares too, rebuilding
    each in the forward phase: the first call went 55% over the least budget, and each
    stage's costs counted the backwards of those before it."""

    class Block(nn.Module):
        def __init__(self, h, d=16):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

        def forward(self, x, extra):
            return x + self.fc2(torch.tanh(self.fc1(x))) + extra

    torch.manual_seed(0)
    blocks = [remat.stage(Block(16 + i)) for i in range(6)]
    side = nn.Linear(16, 16)
    for p in (p for m in blocks + [side] for p in m.parameters()):
        p.grad = torch.zeros_like(p)

    def step(budget, seed):
        g = torch.Generator().manual_seed(seed)
        x, e = torch.randn(4, 12, 16, generator=g).requires_grad_(), torch.randn(4, 12, 16, generator=g)
        extra = side(e)
        with remat.measure_peak():
            with remat.chain(budget=budget):
                h = x
                for b in blocks:
                    h = b(h, extra)
            h.square().mean().backward()
        return remat.explain()

    least, calls = calls_at_least(step)
    assert max(e.measured_peak for e in calls) <= least, least

