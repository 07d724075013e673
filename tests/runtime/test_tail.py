"""The chain's tail (remat/measure/tail.py, Note [The chain's tail]): the head and
the loss after the last stage count in the budget, which bounds the whole step."""

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, strategies as st

import remat
from remat.measure.meter import Instrument
from chains import SEQ_KINDS, Net, budget_for, make_input, minimum_budget, remember_least, under_budget


class HeadNet(Net):
    """``Net`` with a head (a linear layer to ``vocab`` classes) and a cross-entropy
    loss inside the chain's block, as ``remat.wrap`` runs a model's forward, or
    ``after`` it (``return self.head(x)`` after the block), on the chain's output or,
    ``around``, on it plus the chain's input; returns (loss, logits) where ``keep``,
    as a model output that holds its logits."""

    def __init__(self, kinds, vocab, keep, after=False, options="auto", around=False):
        super().__init__(kinds)
        self.head = nn.Linear(self.d, vocab) if vocab else None
        self.keep, self.after, self.options, self.around = keep, after, options, around

    def forward(self, x, mask, target=None):
        x0 = x
        if self.budget is None:
            return self._rest(super().forward(x, mask), target, x0)
        with remat.chain(budget=self.budget, algorithm=self.algorithm, options=self.options):
            for s in self.stages:
                x = s(x, mask)
            if not self.after:
                return self._rest(x, target, x0)
        return self._rest(x, target, x0)

    def _rest(self, y, target, x0):
        y = y + x0 if self.around else y   # (a residual around the chain: Note [The chain's tail] 3)
        if self.head is None:
            return y.square().mean(), None
        logits = self.head(y)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        return loss, (logits if self.keep else None)


def step(net, seed, metered=False):
    """One training step over resident gradients; (loss, input gradient, parameter
    gradients, whole-step peak: the storages the step made, and the chain's input,
    which the budget counts)."""
    x, mask = make_input(net, seed=seed)
    target = torch.randint(0, net.head.out_features if net.head is not None else 1, x.shape[:2],
                           generator=torch.Generator().manual_seed(seed))
    for p in net.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.zero_()
    with Instrument(writes=False) as inst:
        torch.manual_seed(seed)
        loss, logits = net(x, mask, target)
        loss.backward()
        del logits
    grads = [p.grad.clone() for p in net.parameters()]
    return loss.detach(), x.grad, grads, inst.peak + x.untyped_storage().nbytes()


@given(st.lists(st.sampled_from(SEQ_KINDS), min_size=1, max_size=8), st.sampled_from([0, 8, 24, 80]),
       st.booleans(), st.floats(0, 1), st.booleans(), st.booleans(), st.booleans())
# a head ten times a stage's output, kept: the plan checkpoints the last stage
@example(["mlp", "linear", "attn", "mlp"], 80, True, 0.0, False, False, False)
@example(["mlp", "linear", "attn", "mlp"], 80, True, 0.0, True, True, False)
@example(["relu", "dropout"], 0, False, 0.0, True, False, False)
# a transposed a^L the head copies, kept by the last stage's saved tensors (16% over before), or not (BatchNorm's)
@example(["linear", "bn", "relu"], 8, False, 0.0, False, False, False)
@example(["linear", "bn", "relu"], 8, False, 0.0, True, False, False)
@example(["bn"], 8, False, 0.0, False, False, False)
@example(["bn", "mlp", "mlp", "bn"], 8, False, 0.0, True, False, True)   # (a residual around the chain)
@example(["mlp", "mlp", "mlp"], 0, False, 0.0, False, False, True)
@example(["linear", "tied"], 0, False, 0.0, False, False, True)   # (B(L) the step's peak: one output high)
@example(["mlp"], 24, False, 0.25, False, True, True)   # (with options: an output over)
@example(["relu"], 0, False, 0.0, True, False, False)   # (a^L read by the tail: one output high)
@example(["tied"], 0, False, 0.0, False, False, False)
def test_whole_step_stays_under_budget(kinds, vocab, keep, fraction, after, options, around):
    """Random chains with a head and loss inside the chain's block or after it (none,
    or of 1 to 10 times a stage's output bytes), the logits kept or not, stage
    options measured or not, at random budgets: once the first call's backward has
    shown the tail, every step's whole-step peak is under the budget and within 10%
    of explain().predicted_peak, and losses and gradients are plain PyTorch's bitwise."""
    torch.manual_seed(0)
    base = HeadNet(kinds, vocab, keep, after, options, around)
    ref = copy.deepcopy(base)
    net = copy.deepcopy(base)
    net.budget = 2**40
    step(net, 0)   # measuring, and its backward shows the tail
    costs = remat.explain().costs
    assert costs.tail and costs.stages == len(kinds)
    net.budget = budget_for(costs, "optimal", fraction)
    for seed in range(1, 4):
        want, got = step(ref, seed), step(net, seed)
        for a, b in zip(want[:3], got[:3]):
            for u, v in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
                assert torch.equal(u, v), seed
        peak, predicted, out = got[3], remat.explain().predicted_peak, costs.out_bytes[len(kinds) - 1]
        # (docs/limitations.md: with options, a residual around the chain can run an output over;
        # on chains this small the model's safe-side approximations are a large share (the
        # benchmarks' models are within 3%): 10%, 20% with options, and an output where the tail
        # reads a^L, which the last stage saves too)
        assert peak <= net.budget + (out if options and around else 0), (seed, peak, net.budget, predicted)
        assert peak + out >= (0.8 if options else 0.9) * predicted, (seed, peak, predicted)


@given(st.lists(st.sampled_from(SEQ_KINDS), min_size=1, max_size=6), st.sampled_from([0, 8, 24, 80]),
       st.floats(0, 0.6), st.booleans(), st.booleans())
@example(["bn", "dropout", "mlp", "bn", "tied"], 8, 0.05, False, False)   # (run 4 in the call's backward)
@example(["bn"], 8, 0.1, False, False)   # (the copies of BatchNorm's statistics through the tail)
@example(["relu", "mlp", "mlp", "mlp", "relu", "bn"], 24, 0.0, False, False)   # (run 4 at the call's end: 256 over)
@example(["scale", "mlp", "dropout", "dropout", "bn", "bn"], 0, 0.0, False, False)   # (run 4 in the backward: 108 over)
@example(["bn", "mlp", "bn"], 0, 0.25, True, False)   # (a meter's cycle in run 4 held BatchNorm's statistics)
@example(["bn", "mlp", "mlp", "bn"], 8, 0.0, True, True)   # (a residual around the chain: its gradient held)
@example(["attn", "scale"], 8, 0.0, False, True)   # (stage 1 rebuilt beside a^1's gradient: 576 B over the least)
@example(["bn", "linear", "scale"], 8, 0.0, False, True)   # (BatchNorm rebuilt beside its state's copies: 72 B over)
def test_every_call_from_the_first_stays_under_the_budget(kinds, vocab, fraction, after, around):
    """Random chains with a head inside the chain's block or after it, at random budgets
    from ``least_budget`` up: every call's whole-step peak is under the budget, the first
    (measuring) call's included, on a fresh cache, and losses and gradients are plain
    PyTorch's bitwise. Python's cycle collector is off through the steps: what a reference
    cycle holds counts, as it may where it runs late (a meter's BatchNorm copies: 48 B over)."""
    torch.manual_seed(0)
    base = HeadNet(kinds, vocab, False, after, around=around)
    probe, ref, net = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    probe.budget = 2**40
    step(probe, 0)
    step(probe, 1)
    costs = remat.explain().costs
    remember_least(costs)
    net.budget = budget_for(costs, "optimal", fraction)
    remat.clear_cache()
    gc.collect()
    gc.disable()
    try:
        for seed in range(3):
            want, got = step(ref, seed), under_budget(net, step, seed, max(costs.out_bytes))
            for a, b in zip(want[:3], got[:3]):
                for u, v in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
                    assert torch.equal(u, v), seed
            assert got[3] <= net.budget, (seed, got[3], net.budget)
    finally:
        gc.enable()
    remat.clear_cache()


def test_a_large_head_checkpoints_the_last_stage_and_explain_says_what_it_saw():
    """A head whose logits dwarf the stages' activations: explain() names the tail and
    what it saw (its backward, the logits kept), and at the least budget the plan
    does not record the last stage in the forward phase, and the step stays under it."""
    torch.manual_seed(0)
    net = HeadNet(["mlp"] * 6, 200, True)
    net.budget = 2**40
    step(net, 0)
    explanation = remat.explain()
    seen = explanation.tail
    logits = 4 * 6 * 200 * 4
    assert seen.metered and seen.kept >= logits and seen.backward_peak >= 3 * logits
    assert "tail (the code after the last stage" in str(explanation) and "kept through" in str(explanation)
    net.budget = remat.solver.solve.minimum_budget(explanation.costs)
    peaks = [step(net, seed)[3] for seed in range(1, 3)]
    assert remat.explain().schedule.forward_modes()[5] is not remat.Fall
    assert max(peaks) <= net.budget


def test_a_head_after_the_block_is_metered_until_the_backward_reaches_the_chain():
    """The head and loss after the chain's block (``return self.head(x)``): the
    measuring call's meter stays past the block until B(L) starts (Note [The
    chain's tail] 5), explain() says what it saw, at the least budget the plan does
    not record the last stage in the forward phase, and the steps stay under it.
    The meter then leaves the dispatch stack as the backward returns (a mode left
    there breaks a torch.compile'd step), or as the meter around the step exits."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    torch.manual_seed(0)
    net = HeadNet(["mlp"] * 6, 200, True, after=True)
    net.budget = 2**40
    x, mask = make_input(net)
    target = torch.zeros(x.shape[:2], dtype=torch.long)
    loss, logits = net(x, mask, target)   # (the logits kept through the backward, as a model output)
    loss.backward()
    del logits
    assert not _get_current_dispatch_mode_stack()   # (the meter left as the backward returned)
    explanation = remat.explain()
    seen = explanation.tail
    logits = 4 * 6 * 200 * 4
    assert seen.metered and seen.after_block and seen.kept >= logits and seen.backward_peak >= 3 * logits
    assert "the code after the last stage" in str(explanation)
    net.budget = remat.solver.solve.minimum_budget(explanation.costs)
    peaks = [step(net, seed)[3] for seed in range(1, 3)]
    assert not _get_current_dispatch_mode_stack()
    assert remat.explain().schedule.forward_modes()[5] is not remat.Fall
    assert max(peaks) <= net.budget
    remat.clear_cache()
    net(x, mask, target)[0].backward()   # (measuring again; clear_cache takes the meter off)
    remat.clear_cache()
    assert not _get_current_dispatch_mode_stack()


def test_a_head_after_the_block_under_a_mode_of_the_callers_is_not_metered():
    """A dispatch mode of the caller's active as the block ends: the meter does not
    stay past the block (the mode's exit would pop it in its own place), and
    explain() says the code after the block was not metered."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    net = HeadNet(["mlp"] * 3, 24, False, after=True)
    net.budget = 2**40
    x, mask = make_input(net)
    target = torch.zeros(x.shape[:2], dtype=torch.long)
    with Passing():
        net(x, mask, target)[0].backward()
    assert torch._C._len_torch_dispatch_stack() == 0
    seen = remat.explain().tail
    assert not seen.metered and "not metered" in seen.why
    assert remat.explain().costs.tail_costs()["fwd_tmp"] == 0


@pytest.mark.parametrize("mode", ["outer", "inner"])
def test_the_tail_meter_leaves_dispatch_modes_as_it_found_them(mode):
    """A TorchDispatchMode around the whole step still sees every op (the tail's
    meter runs above it); one left inside the window pops the meter instead, and
    the stack ends as it began."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    net = HeadNet(["mlp"] * 3, 24, False)
    net.budget = 2**40
    x, mask = make_input(net)
    target = torch.zeros(x.shape[:2], dtype=torch.long)
    counting = Counting()
    if mode == "outer":
        with counting:
            net(x, mask, target)[0].backward()
        assert counting.ops > 0
    else:
        with remat.chain(budget=2**40):
            h = x
            counting.__enter__()
            for s in net.stages:
                h = s(h, mask)
            counting.__exit__(None, None, None)   # (inside the tail's window: pops the meter)
            loss = net.head(h).square().mean()
        loss.backward()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_compiled_step_after_a_first_call_with_a_head_after_the_block():
    """The meter left past the block is gone when the backward returns: a step of the
    model compiled after its first eager call runs (a mode left on the stack made its
    backward hit the Python dispatch key on ops with no tensor argument, an internal
    assert), and its gradients are plain PyTorch's."""
    torch.manual_seed(0)
    net = HeadNet(["mlp"] * 3, 24, False, after=True)
    ref = copy.deepcopy(net)
    net.budget = 2**40
    x, mask = make_input(net)
    target = torch.zeros(x.shape[:2], dtype=torch.long)
    net(x, mask, target)[0].backward()   # (eager: measuring, the meter past the block)
    compiled = torch.compile(net, backend="eager")
    for model in (ref, compiled):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)   # (the same dropout masks)
        model(x, mask, target)[0].backward()
    for a, b in zip(ref.parameters(), net.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)   # (None: the unused tied layer)
    assert any(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("after", [False, True])
def test_the_heads_gradients_made_by_a_first_step_are_not_kept_by_the_tail(after):
    """A first step makes the head's parameters' .grad (autograd takes the gradient it
    computed): resident from then on, as the budget counts gradients, not kept by the
    tail (before, a step over parameters without gradients saw the head's weight
    gradient kept through every later backward), inside the block or after it."""
    kept = []
    for resident in (True, False):
        torch.manual_seed(0)
        net = HeadNet(["mlp"] * 3, 200, False, after=after)
        net.budget = 2**40
        if resident:
            for p in net.parameters():
                p.grad = torch.zeros_like(p)
        x, mask = make_input(net)
        loss, _ = net(x, mask, torch.zeros(x.shape[:2], dtype=torch.long))
        loss.backward()
        kept.append(remat.explain().tail.kept)
        remat.clear_cache()
    assert kept[0] == kept[1] < 200 * net.d * 4   # (the head's weight gradient)


def test_the_output_gone_is_not_mistaken_for_a_storage_made_where_it_was():
    """The tail's kept bytes (the logits and the loss the caller holds through the
    backward) are the same on every measuring call. a^L was once judged alive by
    its storage's address, at which the allocator had often put its gradient (1 call
    in 10 here): the kept bytes came out one output short, and later calls planned
    on them went over the budget."""
    kept = set()
    for _ in range(40):
        remat.clear_cache()
        torch.manual_seed(0)
        net = HeadNet(["bn", "attn"], 24, True)
        net.budget = 2**40
        step(net, 0)
        kept.add(remat.explain().costs.tail_kept)
    logits = 4 * 6 * 24 * 4
    assert kept == {logits + 8}, kept   # (the logits, and the loss's 8 bytes)
    remat.clear_cache()


# (the second: the middle tied stage shares its weight with stages before and after it,
# whose gradient the call's end adds to its bwd_tmp: it stays when run 4 comes later)
@pytest.mark.parametrize("kinds", [["dropout", "ln", "gelu", "bn", "tied"], ["tied", "tied", "bn", "tied"]])
def test_run_4_that_does_not_fit_waits_for_the_backward(kinds):
    """A BatchNorm stage hands the stage before it a transposed gradient, so that stage's backward
    is measured again (run 4). At the chain's least budget with a^L held a fresh forward and backward
    of it beside the whole chain does not fit at the call's end: it runs in the call's own backward
    instead, as the gradient arrives. The costs are those of a call measured without a bound, and the
    first call stays within a stage's output of the budget (that of run 2, docs/limitations.md);
    run 4 at the call's end put it 41% over."""
    torch.manual_seed(0)
    base = HeadNet(kinds, 8, False)
    ref = copy.deepcopy(base)
    ref.budget = 2**40
    step(ref, 0)
    step(ref, 1)
    costs = remat.explain().costs
    remember_least(costs)
    held = minimum_budget(remat.explain()._record.planning_costs(output=True))   # (a^L held: below, run 4 never fits)
    remat.clear_cache()
    net = copy.deepcopy(base)
    net.budget = max(budget_for(costs, "optimal", 0.0), held)
    first = step(net, 0)[3]
    step(net, 1)
    again = remat.explain().costs
    for field in ("saved_bytes", "bwd_tmp", "fwd_tmp", "out_bytes", "bwd_rebuilt_less"):
        assert getattr(again, field) == getattr(costs, field), field
    assert first <= net.budget + max(costs.out_bytes), (first, net.budget)
    remat.clear_cache()


@pytest.mark.parametrize("kinds,vocab,after", [
    (["dropout", "mlp"], 8, False), (["mlp"], 0, False), (["ln", "mlp", "tied", "mlp"], 8, False),
    (["gelu", "linear", "bn"], 0, True), (["tied", "bn", "mlp"], 0, True),
    (["scale", "tied", "linear", "bn", "dropout", "relu"], 0, False)])
def test_first_call_at_the_least_budget_stays_under_it(kinds, vocab, after):
    """At ``remat.explain().least_budget`` the measuring call stays under the budget:
    measuring a stage's backward (run 2) holds its output and its input beside its
    input's gradient, and the chain's input beside them, which no plan's B(i) does.
    Before the least budget counted them, the first three first calls went 8.5%
    over it (9732 B against 8968), and the budget a plan needs raised no error. The
    last three went 13%, 2.4% and 10% over it: run 4 in the call's backward held
    the fresh output its backward does not read, run 2 the buffer earlier stages'
    parameter gradients went to, and stage meters the BatchNorm statistics' copies
    (a reference cycle)."""
    torch.manual_seed(0)
    base = HeadNet(kinds, vocab, False, after)
    ref = copy.deepcopy(base)
    ref.budget = 2**40
    step(ref, 0)
    step(ref, 1)
    least = remat.explain().least_budget
    plans = remat.solver.solve.minimum_budget(remat.explain().costs)
    assert least >= plans
    remat.clear_cache()
    net = copy.deepcopy(base)
    net.budget = least
    assert [step(net, seed)[3] <= least for seed in range(3)] == [True] * 3
    # one byte below, the first call raises naming at most the least, or stays under that budget
    # too (the least counts the first call's own plan with a^L held, a few bytes above what its
    # measuring needs where no call has shown a^L let go yet)
    remat.clear_cache()
    net.budget = least - 1
    try:
        assert step(net, 0)[3] <= least - 1
    except remat.BudgetError as e:
        assert e.minimum <= least

