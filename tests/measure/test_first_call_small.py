"""First calls of small chains within the budget (Note [Measuring within the
budget] in remat/measure/holding.py): stages that save nothing or return their
input, and a last stage rebuilt in the call's backward beside the caller's
output, the whole step metered from the chain's opening."""

import functools

import pytest
import torch
import torch.nn as nn

import chains
import remat
from remat.measure.meter import Instrument
from remat.solver.solve import minimum_budget


def _mlp(d=8):
    return remat.stage(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)))


def _params(stages, head=None):
    mods = [s for s in stages if isinstance(s, nn.Module)] + ([head] if head is not None else [])
    return [p for m in mods for p in m.parameters()]


def _step(stages, budget, batch, head=None, grad=True):
    """One step (the loss after the chain's block, the output held by the caller); its whole-step peak,
    the chain's input counted, and its gradients."""
    params = _params(stages, head)
    for p in params:
        p.grad = torch.zeros_like(p)   # (resident gradients)
    x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch)).requires_grad_(grad)
    with Instrument(writes=False) as meter:
        with remat.chain(budget=budget):
            h = x
            for s in stages:
                h = s(h)
        loss = (head(h) if head is not None else h).square().mean()
        loss.backward()
    return meter.peak + x.untyped_storage().nbytes(), [x.grad] + [p.grad for p in params]


def _plain(stages, batch, head=None, grad=True):
    """The gradients of plain PyTorch's step."""
    params = _params(stages, head)
    for p in params:
        p.grad = torch.zeros_like(p)
    x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch)).requires_grad_(grad)
    h = x
    for s in stages:
        h = s(h)
    ((head(h) if head is not None else h).square().mean()).backward()
    return [x.grad] + [p.grad for p in params]


def _probe(stages, batch, head=None, grad=True):
    """(least_budget, the store-all peak) of the chain, from two calls at no limit."""
    remat.clear_cache()
    _step(stages, remat.chain.NO_LIMIT, batch, head, grad)
    _step(stages, remat.chain.NO_LIMIT, batch, head, grad)
    e = remat.explain()
    remat.clear_cache()
    return e.least_budget, e.predicted_peak


def test_an_identity_stage_hands_its_input_the_gradient_a_step_does():
    """An identity stage between MLP blocks, at budgets a little above the least: the
    first call stays under the budget, and its gradients are plain PyTorch's. Its
    measured backward took the strides of the expanded stand-in for its output's
    gradient for those it hands its input (a hook on the input ran before the one on
    the output, the same tensor), and the stage before it was measured again for that
    layout, which no step hands it: 9% over."""
    torch.manual_seed(0)
    stages = [_mlp(), remat.stage(lambda x: x), _mlp(), _mlp()]
    least, top = _probe(stages, 4)
    want = _plain(stages, 4)
    for fraction in (0.0, 0.2, 0.5):
        budget = int(least + fraction * (top - least))
        remat.clear_cache()
        peaks = []
        for _ in range(2):
            peak, grads = _step(stages, budget, 4)
            peaks.append(peak)
            assert all(torch.equal(a, b) for a, b in zip(grads, want))
        assert max(peaks) <= budget, (fraction, peaks, budget)
    remat.clear_cache()


def test_a_leading_stage_saving_nothing_on_an_input_needing_no_grad_holds_no_input_through_the_tail():
    """A leading ``x * 2`` on an input that needs no grad, then blocks of 8-wide
    activations under a head after the block: the first call stays under the budget
    and its gradients are plain PyTorch's. It held the blocks' input (needing no grad:
    where a stage cut the graph, rebuilds started there) through the tail, which any
    plan at the least budget lets go: 14% over it. The leading stage saved nothing,
    and the run keeps its anchor: the rebuilds start from the chain's input."""
    torch.manual_seed(0)
    stages = [remat.stage(lambda x: x * 2)] + [remat.stage(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
                                               for _ in range(2)]
    head = nn.Linear(8, 8)
    least, top = _probe(stages, 64, head, grad=False)
    want = _plain(stages, 64, head, grad=False)
    for fraction in (0.0, 0.5):
        budget = int(least + fraction * (top - least))
        remat.clear_cache()
        peaks = []
        for _ in range(2):
            peak, grads = _step(stages, budget, 64, head, grad=False)
            peaks.append(peak)
            assert all(torch.equal(a, b) for a, b in zip(grads[1:], want[1:]))
        assert max(peaks) <= budget, (fraction, peaks, budget)
    remat.clear_cache()


def _last_tanh():
    torch.manual_seed(0)
    return [remat.stage(nn.Sequential(nn.Linear(8, 8), nn.Tanh())), remat.stage(lambda x: torch.tanh(x * 2))], \
        nn.Linear(8, 1)


def test_the_rebuild_of_the_last_stage_beside_the_callers_output_is_in_the_least_budget():
    """A last stage ``tanh(x * 2)`` under a one-output head after the block (the caller
    holds the chain's output through the backward): at ``least_budget`` the first call
    stays under it, and its gradients are plain PyTorch's. Its backward rebuilds the
    last stage beside the caller's output and that output's gradient, its temporary
    and its output made again at once, which no plan at the least any plan needs (the
    store-all peak here) does: 19% over it."""
    stages, head = _last_tanh()
    least, top = _probe(stages, 128, head)
    want = _plain(stages, 128, head)
    peaks = []
    for _ in range(2):
        peak, grads = _step(stages, least, 128, head)
        peaks.append(peak)
        assert all(torch.equal(a, b) for a, b in zip(grads, want))
    assert max(peaks) <= least, (peaks, least, top)
    remat.clear_cache()


def test_a_first_call_under_that_least_says_it_may_have_gone_over():
    """At the store-all peak, below what the first call's rebuild of its last stage
    needs beside the caller's output: the call's backward, which shows the output
    kept, warns that the first call may have gone over the budget (it went 19% over,
    silently); the calls after it run under it, on a plan storing everything."""
    stages, head = _last_tanh()
    least, top = _probe(stages, 128, head)
    assert top < least
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="the first call may have gone over it"):
        _step(stages, top, 128, head)
    peaks = [_step(stages, top, 128, head)[0] for _ in range(2)]
    assert max(peaks) <= top, (peaks, top)
    remat.clear_cache()


class _Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.drop = nn.LayerNorm(d), nn.Dropout(0.1)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    @remat.stage
    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)))))


class _BnBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    @remat.stage
    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


@pytest.mark.parametrize("above", [0, 136, 263])
def test_a_first_call_lets_go_of_state_copies_its_plan_has_no_room_for(above):
    """MLP and BatchNorm blocks, the last a BatchNorm one: the first call kept the copies of
    the statistics its stages wrote (for run 4 in its backward) and planned as if they
    were gone, 264 bytes (one BatchNorm's) over budgets just above the least later calls
    need (a helper's find). Now it plans beside them where it can, else lets them go with
    run 4 (``Run4.copies``), and the hook on the last stage's output holds none."""
    torch.manual_seed(0)
    blocks = [_BnBlock(32) if i % 2 else _Mlp(32) for i in range(6)]
    head, inp = nn.Linear(32, 10), nn.Linear(16, 32)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    params = [p for m in (*blocks, head, inp) for p in m.parameters()]

    def forward(budget):
        h = inp(x)
        with remat.chain(budget=budget):
            for b in blocks:
                h = b(h)
        return head(h)   # (the chain's output let go before the backward)

    def step(budget):
        for p in params:
            p.grad = torch.zeros_like(p)
        torch.manual_seed(100)
        with remat.measure_peak():
            torch.nn.functional.cross_entropy(forward(budget), y).backward()
        return remat.explain()

    try:
        step(remat.chain.NO_LIMIT)
        seen = step(remat.chain.NO_LIMIT)
        least = minimum_budget(seen.costs)   # (what later calls need: the first call's least is above it)
        assert least < seen.least_budget
        remat.clear_cache()
        budget = least + above
        for call in range(3):
            peak = step(budget).measured_peak
            assert peak <= budget, (call, peak, budget)
    finally:
        remat.clear_cache()


class _Cuts(nn.Module):
    def __init__(self, cut, wide=1, d=16):
        super().__init__()
        self.l1, self.l2, self.cut = nn.Linear(d, 2 * d * wide), nn.Linear(2 * d * wide, d), cut

    @remat.stage
    def forward(self, x):
        y = x + self.l2(torch.tanh(self.l1(x)))
        return y.detach() if self.cut else y


@pytest.mark.parametrize("n, cut, wide, grad", [(4, 1, None, False), (4, 2, None, False), (6, 3, None, False),
                                                 (6, 2, 4, False), (4, 1, None, True)])
def test_a_first_call_past_a_stage_whose_output_needs_no_grad(n, cut, wide, grad):
    """A stage returning a detached output cuts the graph: the anchors of the stages up to it
    went with it in a measuring call (a running one keeps them: ``Run.pin``), and the
    first call held the cut stage's output, needing no grad, as an input to rebuild from,
    beyond what measuring the later stages left room for: 10% over the least budget
    (42,248 against 38,412), or with it let go no input to rebuild from ("no held input";
    a helper's find and diagnosis). The measuring call pins them now and lets that
    input go as any other."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Cuts(i == cut, 2 if i == wide else 1) for i in range(n))
    head = nn.Linear(16, 3)
    x = torch.randn(12, 5, 16, requires_grad=grad)
    step = functools.partial(chains.square_step, blocks, head, x)
    want = step(None)
    try:
        step(remat.chain.NO_LIMIT)
        seen = step(remat.chain.NO_LIMIT) and remat.explain()
        for budget in (seen.least_budget, (seen.least_budget + seen.measured_peak) // 2):
            remat.clear_cache()
            for call in range(2):
                got = step(budget)
                assert remat.explain().measured_peak <= budget, (budget, call, remat.explain().measured_peak)
                assert all(torch.equal(a, b) for a, b in zip(want, got)), (budget, call)
    finally:
        remat.clear_cache()
