"""The measuring (first) call of a chain: what it runs, what it leaves, what it costs."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

import remat
from remat.measure import twins as twins_module
from remat.measure.measuring import Measurer
from remat.measure.meter import Instrument, storage_key
from chains import IMG_KINDS, SEQ_KINDS, Net, make_input, run_blocks
from remat.solver.solve import minimum_budget


class Counted(nn.Module):
    """A Linear stage that counts its forward calls."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0

    @remat.stage
    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


def _first_call_counts(budget, clear=True, stages=None, batch=32):
    if clear:
        remat.clear_cache()
    torch.manual_seed(0)
    stages = nn.ModuleList(Counted(64) for _ in range(12)) if stages is None else stages
    counts = []
    for _ in range(2):
        for s in stages:
            s.calls = 0
        x = torch.randn(batch, 64, requires_grad=True)
        with remat.chain(budget=budget):
            h = x
            for s in stages:
                h = s(h)
        h.sum().backward()
        counts.append([s.calls for s in stages])
    return counts, remat.explain().costs, stages


def test_first_call_holds_the_stage_inputs_and_one_stage():
    """The measuring call needs no more than every stage's input plus one stage's
    forward and backward (and the parameters' gradients): the saved tensors of the
    stages it lets go must go. (They did not: autograd keeps the pack hook with each
    tensor it packs, and the hook held the list; the call peaked above plain.)"""
    from remat.measure.meter import Instrument

    def make():
        torch.manual_seed(0)
        return nn.ModuleList(remat.stage(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)))
                             for _ in range(8))

    def peak(blocks, budget):
        x = torch.randn(32, 16, 64)
        with Instrument() as inst:
            h = run_blocks(blocks, x, budget)
            h.sum().backward()
        return inst.peak

    plain = peak(make(), None)
    peak(make(), 2**40)
    c = remat.explain().costs
    remat.clear_cache()
    blocks = make()
    first = peak(blocks, minimum_budget(c))
    params = sum(p.numel() * p.element_size() for p in blocks.parameters())
    one_stage = max(s + f + b for s, f, b in zip(c.saved_bytes, c.fwd_tmp, c.bwd_tmp))
    assert first <= c.input_bytes + sum(c.out_bytes[:-1]) + one_stage + params
    assert first < plain / 2


def test_first_call_rebuilds_only_what_the_budget_cannot_keep():
    """A first call runs the first stage's forward three times (metered, then
    without recording, timed and metered apart) and its eleven twins once (Note [Twin stages]); stages whose saved
    tensors it does not keep once more, rebuilt in the backward: all of them where
    no record of the chain has shown its tail yet (Note [Measuring within the
    budget]), and those before the last once more, as the backward's first rebuild
    (of the last stage, from the chain's input) holds their inputs again: the call
    held none while the tail, not known yet, ran; none where a record of the same
    model (at another batch size) has shown the tail and everything fits, but all
    of them after another model's record (no hint: Note [Measuring within the
    budget]); a later call runs each once when everything fits."""
    counts, costs, stages = _first_call_counts(2**50)
    assert counts == [[5] + [3] * 10 + [2], [1] * 12]
    # (the same model at another batch size: its tail seen; another model's record hints nothing)
    counts, costs, _ = _first_call_counts(2**50, clear=False, stages=stages, batch=16)
    assert counts == [[3] + [1] * 11, [1] * 12]
    assert _first_call_counts(2**50, clear=False)[0] == [[5] + [3] * 10 + [2], [1] * 12]
    least = minimum_budget(costs)
    assert least < costs.input_bytes + costs.held_bytes + sum(costs.saved_bytes)
    _first_call_counts(2**50, stages=stages)
    counts, _, _ = _first_call_counts(least, clear=False, stages=stages, batch=16)
    first = counts[0]
    # (at the minimum it holds few stage inputs, and rebuilds each stage from the nearest one held
    # below: at most from the chain's input, every stage before it, once per stage; the first stage
    # runs three times as it is measured, the others once. A smaller batch than the record's holds
    # as few as the record's own figures leave room for, unscaled: ``ChainRecord.hint``)
    assert first[-1] == 2 and sum(first) <= 3 + 12 + sum(1 + 13 - i for i in range(2, 13)), counts


@st.composite
def blocks(draw):
    image = draw(st.booleans())
    return draw(st.lists(st.sampled_from(IMG_KINDS if image else SEQ_KINDS), min_size=1, max_size=5)), image


@given(blocks(), st.integers(1, 3))
def test_twin_stages_cost_what_they_measure(block, repeats):
    """Note [Twin stages]: a chain of repeated blocks measured with twins gets the sizes,
    grad-mode verdicts and held gradients it gets with every stage measured in full,
    and copies of the block from the third on are twins."""
    kinds, image = block
    torch.manual_seed(0)
    net = Net(kinds * repeats, image=image)
    full, runs = [], []
    real = Measurer._measure_nograd

    def spy(self, *a, **k):
        runs.append(1)
        return real(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Measurer, "_measure_nograd", spy)
        twins = _measure(net)
        distinct = len(runs)
        mp.setattr(twins_module.Twin, "find", lambda self, seen: None)
        full = _measure(net)
    for field in ("out_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp"):
        assert getattr(twins[0], field) == getattr(full[0], field), field
    assert twins[0].input_bytes == full[0].input_bytes
    assert twins[1] == full[1]
    # the third copy of the block and later ones see what the second saw (the first
    # copy's input may be laid out otherwise): they are twins
    assert distinct <= 2 * len(kinds)


def _measure(net):
    remat.clear_cache()
    probe = copy.deepcopy(net)
    probe.budget, probe.algorithm = 2**50, "store_all"
    x, mask = make_input(probe)
    torch.manual_seed(1)
    probe(x, mask).sum().backward()
    entry = next(iter(sys.modules["remat.runtime.chain_call"]._cache.values()))
    return remat.explain().costs, [s.grad_replay for s in entry.stages]


def test_hooks_on_activations_run_once_with_tied_weights():
    """In a first call whose stages share a weight with stages before them, a hook on
    every activation runs once, and gradients are plain PyTorch's."""
    torch.manual_seed(0)
    net = Net(["tied", "linear", "tied", "mlp", "tied"])
    ref = copy.deepcopy(net)
    x, mask = make_input(net)
    x_ref = x.detach().clone().requires_grad_()
    calls = []
    torch.manual_seed(1)
    with remat.chain(budget=2**50):
        h = x
        for i, s in enumerate(net.stages):
            h = s(h, mask)
            h.register_hook(lambda g, i=i: calls.append(i))
    h.sum().backward()
    assert sorted(calls) == list(range(5))
    h_ref = x_ref
    torch.manual_seed(1)
    for s in ref.stages:
        h_ref = s(h_ref, mask)
    h_ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_first_call_imports_neither_dynamo_nor_sympy():
    """Importing remat and measuring load neither torch._dynamo nor sympy (over a second
    of a first call) where the program had not loaded them."""
    code = textwrap.dedent("""
        import sys
        import torch
        before = {m for m in ("torch._dynamo", "sympy") if m in sys.modules}
        import remat
        layers = [remat.stage(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)))
                  for _ in range(3)]
        x = torch.randn(4, 8, requires_grad=True)
        with remat.chain(budget=2**50):
            for layer in layers:
                x = layer(x)
        x.sum().backward()
        print(sorted({m for m in ("torch._dynamo", "sympy") if m in sys.modules} - before))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _measured(kinds):
    torch.manual_seed(0)
    net = Net(kinds, image=False)
    x, mask = make_input(net, 4, 6, seed=1)
    net.budget = 1 << 30
    net(x, mask).sum().backward()
    return remat.explain().costs


def test_backward_is_measured_again_with_the_gradient_layout_it_gets(monkeypatch):
    """The attention stage's gradient comes contiguous from a Linear stage and
    transposed from a BatchNorm1d stage (which runs on x.transpose(1, 2)): only
    the second measures its backward again, with the transposed layout."""
    measuring = sys.modules["remat.measure.stage_backward"]   # (where run 4 looks it up)
    calls = []

    def spy(call, x, cuda, rng0, originals, layout, *rest, **kw):
        calls.append((call.index, layout))
        return real(call, x, cuda, rng0, originals, layout, *rest, **kw)

    real = measuring.backward_again
    monkeypatch.setattr(measuring, "backward_again", spy)
    _measured(["attn", "linear"])
    assert calls == []
    _measured(["attn", "bn"])
    assert calls == [(1, (48, 1, 6))]   # (4, 6, 8) laid out as the transpose of (4, 8, 6)


def test_gradients_held_across_stages_are_counted_as_held():
    """A weight used by stages 1 and 4: its gradient from stage 4 waits for stage 1's,
    held through the step (held_bytes; the input's own size is unchanged)."""
    tied, untied = _measured(["tied", "linear", "relu", "tied"]), _measured(["linear", "linear", "relu", "linear"])
    weight = 8 * 8 * 4 + 8 * 4
    assert untied.held_bytes + weight == tied.held_bytes and untied.input_bytes == tied.input_bytes


def test_meter_counts_a_tensor_made_outside_its_gate():
    """``Instrument.count``: a gradient made while the gate was shut is metered
    from then on, and let go when it dies."""
    from remat.measure.meter import Instrument

    with Instrument() as inst:
        inst.set_gate(False)
        g = torch.ones(256) * 2
        assert inst.live == 0
        inst.count(g)
        inst.count(g)                     # once per storage
        assert inst.live == inst.peak == 1024
        inst.set_gate(True)
        h = g + 1
        assert inst.live == inst.peak == 2048
        del g, h
        assert inst.live == 0


@pytest.mark.parametrize("use", ["loss", "side"])
def test_first_call_is_bitwise_where_an_activation_has_several_users(use):
    """The measuring call runs each stage on its input itself, so the gradients reaching
    an activation used by a stage twice (a residual) and outside it too (an auxiliary
    loss, a skip handed to a later stage as a side input) are summed in plain
    PyTorch's order (a copy in between summed them otherwise: 3e-8 apart)."""

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        @remat.stage
        def forward(self, x, skip=None):
            h = x + torch.tanh(self.lin(x))
            return h if skip is None else h + 0.5 * skip

    torch.manual_seed(0)
    ref = nn.ModuleList(Res() for _ in range(4))
    net = copy.deepcopy(ref)
    x0 = torch.randn(8, 16)
    grads = []
    for model, chained in ((ref, False), (net, True)):
        x = x0.clone().requires_grad_()
        hs = []

        def body(h):
            for i, blk in enumerate(model):
                h = blk(h, hs[0] if use == "side" and i == 3 else None)
                hs.append(h)
            return h

        if chained:
            with remat.chain(budget=2**40):
                y = body(x)
        else:
            y = body(x)
        loss = y.square().mean() + (hs[1].sin().mean() if use == "loss" else 0)
        loss.backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_signature_check_agrees_with_the_signature():
    """``signature_matches``, the check every stage of every later call makes, says
    exactly what comparing ``input_signature``s says: activation alone (its fast
    path), passed by keyword, with tensor, tuple and Python side inputs, and with
    a submodule switched to eval."""
    from remat.runtime.stage_call import input_signature, module_dicts, signature_matches
    from remat.runtime.stage_call import StageCall

    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    dicts = module_dicts(block)
    x, y = torch.randn(2, 4), torch.randn(3, 4)
    mask, other = torch.ones(2, 2), torch.ones(2, 3)

    def call(x, *side, kw=False, **kwargs):
        if kw:
            return x, StageCall(1, "b", block, side, {"x": x, **kwargs}, None, "x", False)
        return x, StageCall(1, "b", block, (x, *side), kwargs, 0, None, False)

    variants = [lambda: call(x), lambda: call(y), lambda: call(x.double()), lambda: call(x, kw=True),
                lambda: call(x, mask), lambda: call(x, other), lambda: call(x, (mask, 3)), lambda: call(x, (mask, 4)),
                lambda: call(x, scale=2.0), lambda: call(x, None), lambda: call(x, mask=mask),
                lambda: call(x, mask=other)]
    for train in (True, False):
        block[1].train(train)
        for a in variants:
            xa, ca = a()
            sig = input_signature(xa, ca, dicts)
            for b in variants:
                xb, cb = b()
                assert signature_matches(sig, xb, cb, dicts) == (input_signature(xb, cb, dicts) == sig)
        block[1].train(not train)
        assert not signature_matches(sig, xb, cb, dicts)


def test_a_finished_meter_goes_with_its_last_user():
    """A meter holds no reference to itself through the storages it watches (their
    callbacks), so it and what it noted (copies of state written in place) go when
    its last user lets go of it, not when the cycle collector runs."""
    import gc
    import weakref

    state = torch.zeros(8)
    gc.disable()
    try:
        with Instrument() as inst:
            made = torch.randn(8) * 2
            state.add_(1)
        copy = weakref.ref(inst.mutated[storage_key(state)][1])
        gone = weakref.ref(inst)
        del inst
        assert gone() is None and copy() is None
        del made   # (its storage's callback finds no meter: nothing to count)
    finally:
        gc.enable()


def test_run_3_compares_outputs_bitwise_in_place():
    """Run 3's check that a forward without recording gives the recorded output
    (Note [Replaying a stage] 4) reads both where they lie: no copy of either (a
    transposed output was copied twice), NaNs equal to themselves, -0.0 not 0.0."""
    from remat.runtime.replay import bitwise_equal as _bitwise_equal

    a = torch.randn(64, 32).t()
    a[0, 0] = float("nan")
    b = a.clone()
    with Instrument(writes=False) as inst:
        same = _bitwise_equal(a, b)
    assert same and inst.peak == 0
    b[1, 1] = -b[1, 1] if b[1, 1] != 0 else 1.0
    assert not _bitwise_equal(a, b)
    assert not _bitwise_equal(torch.zeros(3), -torch.zeros(3)) and torch.equal(torch.zeros(3), -torch.zeros(3))
    z = torch.randn(4, 3, dtype=torch.complex64).t()
    assert _bitwise_equal(z, z.clone()) and _bitwise_equal(torch.tensor([True]), torch.tensor([True]))
    assert not _bitwise_equal(a, a[:, :-1])
