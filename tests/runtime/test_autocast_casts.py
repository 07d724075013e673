"""Autocast's cached casts of the weights, planned where they live (remat/solver/casts.py Note
[Casts freed at the Loss]): with the backward after the autocast block, as PyTorch advises,
the measuring call's backward tells the chain so, and plans count each stage's casts from its
first forward to the loss and in its records after; with the backward inside the block, through
the step, as before."""

import concurrent.futures
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, strategies as st

import chains
import remat
from chains import SEQ_KINDS
from remat.solver.solve import minimum_budget, store_all

D, STAGES = 64, 6


class Net(nn.Module):
    """Six MLP blocks as stages and a small head: the step's peak is in the backward, where
    only the records hold casts (a head whose logits dwarf the blocks peaks at the loss, while
    every cast is alive)."""

    def __init__(self, vocab=8):
        super().__init__()
        self.blocks = nn.ModuleList(
            remat.stage(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)))
            for _ in range(STAGES))
        self.head = nn.Linear(D, vocab)
        self.budget = 2**40

    def forward(self, x, target):
        with remat.chain(budget=self.budget):
            for block in self.blocks:
                x = block(x)
            return F.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


def _step(net, x, target, inside):
    """One bf16 step, the backward after the autocast block (or ``inside`` it): (the chain's
    measured whole-step peak, its prediction, the gradients)."""
    for p in net.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)   # (resident, as the budget counts them)
        p.grad.zero_()
    with remat.measure_peak() as meter:
        with torch.autocast("cpu", torch.bfloat16):
            loss = net(x, target)
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
    seen = remat.explain()
    assert meter.peak > 0
    return seen.measured_peak, seen.predicted_peak, [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("inside", [False, True])
def test_casts_planned_where_they_live(inside):
    torch.manual_seed(0)
    base = Net()
    x, target = torch.randn(4, 32, D), torch.randint(8, (4, 32))
    probe = copy.deepcopy(base)
    _step(probe, x, target, inside)
    _step(probe, x, target, inside)
    costs = remat.explain().costs
    casts = costs.cast_bytes
    if inside:   # (autocast's cache alive through the backward: held through the step)
        assert not any(casts)
        return
    assert all(c > 0 for c in casts[:STAGES]) and casts[-1] == 0
    assert sum(casts) == STAGES * (2 * 4 * D * D + 4 * D + D) * 2   # (the blocks' weights and biases, in bf16)
    through = remat.Costs.from_dict({k: v for k, v in costs.to_dict().items() if k != "cast_bytes"})
    least, top = minimum_budget(costs), remat.simulate(costs, store_all(costs.length)).peak
    assert least < minimum_budget(through)   # (13% less on this chain)
    want = _step(copy.deepcopy(base), x, target, inside)[2]
    for fraction in (0.0, 0.3, 0.6, 1.0):
        remat.clear_cache()
        net = copy.deepcopy(base)
        net.budget = max(int(least + fraction * (top - least)), remat.explain().least_budget)
        for call in range(3):   # the measuring call, then calls on the plan
            peak, predicted, grads = _step(net, x, target, inside)
            assert peak <= net.budget, (fraction, call, peak, net.budget)
            assert all(torch.equal(a, b) for a, b in zip(grads, want))
        # the plan's prediction within 2% of what it measured (it was 10-13% high, the casts through the
        # step; the casts autograd does not save, the biases', are counted in the records after Loss)
        assert predicted * 0.98 <= peak <= predicted, (fraction, peak, predicted)


@given(st.lists(st.sampled_from(SEQ_KINDS), min_size=2, max_size=6), st.floats(0, 1), st.booleans())
# (first calls over the least budget before: measuring stage 2 beside stage 1's casts, 144 B (4.8%);
# run 4's detached input, a leaf needing grad, its cast cached by autocast to the block's end, 384 B)
@example(["linear", "linear"], 0.0, False)
@example(["linear", "bn", "mlp"], 0.0, False)
# (tied stages: a least budget measured at no limit below what a fresh chain's second call planned with,
# 3,728 against 3,800 B: the C solver's least-memory plans tie, and rule 10 tells them apart, least_schedule)
@example(["linear", "tied", "tied", "bn", "tied"], 0.0, False)
# (the backward inside the block: a second cast of the leaf input, 312 B over: record_again)
@example(["tied", "relu", "linear", "bn"], 0.0, True)
# (the first call's run 4 in its backward, the one element of its stand-in gradient not counted: 1 B over)
@example(["linear", "mlp", "bn"], 0.5, True)
def test_random_chains_under_autocast_stay_under_the_budget(kinds, fraction, inside):
    """Random chains in bf16 (the backward after the autocast block, as PyTorch advises, or
    ``inside`` it) at random budgets from the least a first
    call and a plan need up: every call's whole step from the chain's opening, the
    first's included, is under the budget, and losses and gradients are plain
    PyTorch's bitwise (a BatchNorm stage after a linear one, run again in the first
    call's backward outside autocast, raised before)."""
    base, least, top = _least(kinds, inside)
    ref, net, bound = copy.deepcopy(base), copy.deepcopy(base), max(remat.explain().costs.out_bytes)
    net.budget = int(least + fraction * (max(least, top) - least))
    for seed in range(3):
        want = _chain_step(ref, seed, inside)
        got = chains.under_budget(net, lambda n, s: _chain_step(n, s, inside), seed, bound)
        assert all(torch.equal(a, b) for a, b in zip(want[1], got[1])), seed
        assert got[0] <= net.budget, (seed, got[0], net.budget)
    remat.clear_cache()


def test_a_first_call_under_autocast_stays_under_the_least_budget():
    """At the least budget the measuring call of these bf16 stages peaked 25% over it
    (12,876 bytes against 10,264): run 4 of a stage, at the call's end, did not count
    the casts autocast's cache held of the stages' weights (``Holding.run4_fits``).
    Counted, the first call is under the budget, as the calls after it are."""
    base, least, _ = _least(["bn", "attn", "attn", "attn", "mlp"], False)
    net = copy.deepcopy(base)
    net.budget = least
    peaks = [_chain_step(net, seed, False)[0] for seed in range(3)]
    remat.clear_cache()
    assert max(peaks[1:]) <= net.budget
    assert peaks[0] <= net.budget, (peaks, net.budget)


def _least(kinds, inside):
    """A ``chains.Net`` of ``kinds``, the least budget a chain of it run at no limit named (its first
    call's or any plan's, the more) and its store-all peak, the backward ``inside`` autocast or after."""
    torch.manual_seed(0)
    base = chains.Net(kinds)
    probe = copy.deepcopy(base)
    probe.budget = remat.chain.NO_LIMIT
    for seed in range(2):
        _chain_step(probe, seed, inside)
    seen, costs = remat.explain(), remat.explain().costs
    remat.clear_cache()
    return base, max(seen.least_budget, minimum_budget(costs)), remat.simulate(costs, store_all(costs.length)).peak


def _chain_step(net, seed, inside):
    """A bf16 step of a ``chains.Net`` (plain where its budget is None): (the chain's
    measured peak from its opening, the loss and every gradient)."""
    torch.manual_seed(1000 + seed)   # (the same dropout draws for both)
    x, mask = chains.make_input(net, seed=seed)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + seed))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    with remat.measure_peak() as meter:
        with torch.autocast("cpu", torch.bfloat16):
            loss = (net(x, mask).float() * target).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
    peak = remat.explain().measured_peak if net.budget is not None else meter.peak
    return peak, [loss.detach(), x.grad] + [p.grad for p in net.parameters()]


@pytest.mark.parametrize("kinds", [["linear", "linear"], ["tied", "relu", "linear", "bn"],
                                   ["mlp", "scale", "scale", "linear", "mlp"]])
def test_a_backward_inside_the_block_takes_a_leaf_inputs_cast_from_the_cache(kinds):
    """The chain's input a leaf needing grad, the backward inside the autocast block: the
    recomputation of the first stage ran on a view of a copy of that input and made a cast
    of it beside the one autocast's cache holds to the block's end, which the plan counts
    alone: 384 bytes over the prediction on later calls, 6 to 312 over the least budget
    (5 of 150 random chains). It takes the cached cast now (recompute.record_again)."""
    base, least, _ = _least(kinds, True)
    net = copy.deepcopy(base)
    net.budget = least
    try:
        for seed in range(3):
            peak = _chain_step(net, seed, True)[0]
            seen = remat.explain()
            assert peak <= net.budget, (seed, peak, net.budget)
            assert seed == 0 or peak <= seen.predicted_peak, (seed, peak, seen.predicted_peak)
        assert seen.schedule.recomputations() > 0
    finally:
        remat.clear_cache()


@pytest.mark.parametrize("kinds", [["linear"] * 4, ["attn", "mlp", "tied", "bn", "linear"]])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_a_backward_on_a_thread_of_its_own_inside_the_block(kinds, fraction):
    """On CUDA a backward called inside the autocast block runs on the autograd engine's
    thread, which has autocast on (the caller's thread-local state) and no block of its
    own; autocast's cache is one for all threads. Run so on CPU (a worker thread calls
    ``backward()`` with that state while the block is open), over steps with an optimizer
    between them: every call under its budget, with plain PyTorch's gradients (casts a
    recomputation cached there and no block cleared would be read by the next step's)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)   # (one thread for all the steps)

    def backward(loss):
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        try:
            loss.backward()
        finally:
            torch.set_autocast_enabled("cpu", False)

    def train(net):
        opt, out = torch.optim.SGD(net.parameters(), lr=0.5), []
        for seed in range(3):
            torch.manual_seed(1000 + seed)   # (the same dropout draws for both)
            x, mask = chains.make_input(net, seed=seed)
            for p in net.parameters():
                p.grad = torch.zeros_like(p)
            with remat.measure_peak():
                with torch.autocast("cpu", torch.bfloat16):
                    loss = (net(x, mask).float() ** 2).sum()
                    pool.submit(backward, loss).result()
            out.append([loss.detach(), x.grad] + [p.grad.clone() for p in net.parameters()])
            if net.budget is not None:
                assert remat.explain().measured_peak <= net.budget, (seed, remat.explain().measured_peak)
            opt.step()
        return out

    torch.manual_seed(0)
    base = chains.Net(kinds)
    probe, net = copy.deepcopy(base), copy.deepcopy(base)
    probe.budget = remat.chain.NO_LIMIT
    try:
        train(probe)
        seen = remat.explain()
        least = max(seen.least_budget, minimum_budget(seen.costs))
        net.budget = int(least + fraction * (remat.simulate(seen.costs, store_all(seen.costs.length)).peak - least))
        remat.clear_cache()
        want, got = train(copy.deepcopy(base)), train(net)
        assert remat.explain().schedule.recomputations() > 0
    finally:
        remat.clear_cache()
        pool.shutdown()
    for step, (a, b) in enumerate(zip(want, got)):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), step


@pytest.mark.xfail(strict=True, reason="tied stages recomputed after Loss each cast the shared weight; the costs "
                                       "count one cast (docs/limitations.md, stages sharing a weight)")
def test_tied_stages_recomputed_after_the_loss_each_cast_the_shared_weight():
    """Found by the deep profile: 44 bytes over on the calls after the first."""
    base, least, top = _least(["linear", "tied", "tied", "tied", "linear", "tied"], False)
    net = copy.deepcopy(base)
    net.budget = int(least + 0.28125 * (max(least, top) - least))
    try:
        peaks = [_chain_step(net, seed, False)[0] for seed in range(3)]
    finally:
        remat.clear_cache()
    assert max(peaks) <= net.budget, (peaks, net.budget)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_a_bf16_resnets_later_calls_peak_at_their_prediction(fraction):
    """ResNet-18 under bf16 autocast, the backward after the block: each stage's backward
    lets the casts of its weights go as it reads them for the last time (Note [Casts
    freed at the Loss] 2, remat/solver/casts.py). Before, plans counted them to the
    backward's end: predictions 11-15% above the measured peaks, at every budget. The
    calls after the measuring one peak under the budget and within 1% of the prediction."""
    import remat.models

    def step(net, seed):
        return chains.bf16_image_step(net, 32, seed)

    remat.clear_cache()
    try:
        torch.manual_seed(0)
        net = remat.models.resnet18(num_classes=10)
        probe = copy.deepcopy(net)
        probe.budget = remat.chain.NO_LIMIT
        step(probe, 0)
        seen = step(probe, 0)
        remat.clear_cache()
        net.budget = int(seen.least_budget + fraction * max(0, seen.predicted_peak - seen.least_budget))
        for seed in range(3):
            e = step(net, seed)
            assert e.measured_peak <= net.budget, (seed, e.measured_peak, net.budget)
            if seed:
                assert abs(e.predicted_peak / e.measured_peak - 1) <= 0.01, (seed, e.predicted_peak, e.measured_peak)
    finally:
        remat.clear_cache()


@pytest.mark.xfail(strict=True, reason="open: run 4's casts of a view of a leaf input (docs/limitations.md)")
def test_a_first_stage_measured_again_on_its_leaf_inputs_casts_stays_under_the_budget():
    """A SwiGLU stage first, on a chain input that is a leaf needing grad, then a
    BatchNorm stage (which hands it a transposed gradient), in bf16 with the backward
    inside the autocast block, at the store-all budget: the first call's run 4 of stage
    1, in its backward, runs on a view of its input, whose casts autocast does not cache
    as it cached run 1's cast of the leaf (one per op reading it), and which
    ``run4_fits_now`` does not count: 124 B (1.5%) over (the deep profile of the random
    chains above, seventh session of 2026-11-29, once SwiGLU was among the kinds).
    Counting the forward's transient instead of its saved tensors there made run 4 skip
    on a chain whose later calls need its figures (``test_runtime``'s attention and
    BatchNorm example went over on every later call)."""
    base, least, top = _least(["swiglu", "bn", "linear"], True)
    net = copy.deepcopy(base)
    net.budget = top
    try:
        for seed in range(2):
            assert _chain_step(net, seed, True)[0] <= net.budget, seed
    finally:
        remat.clear_cache()
