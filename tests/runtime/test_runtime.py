"""The runtime against plain PyTorch: random chains, every algorithm, every budget."""

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, strategies as st

import remat
from remat.solver.solve import minimum_budget
from chains import (ALGORITHMS, Net, assert_same, budget_for, fresh_net, make_input, measured_costs, physical_peak,
                    random_chains, train, under_budget, with_budget)


@given(random_chains(), st.sampled_from(ALGORITHMS), st.floats(0, 1), st.sampled_from(["sgd", "adam"]))
# (the deep profile's: the tied stage measured again for BatchNorm's transposed gradient (run 4) freed its
# output there, not in run 2; the call at this budget, with no room for run 4, needed 88 bytes more)
@example((["tied", "bn"], False), "store_all", 0.0, "sgd")
# (a first call planning beside run 4's copies of written state where the least budget of any plan left room,
# not store_all's: BudgetError at store_all's own budget)
@example((["conv", "conv", "conv", "conv", "conv", "convblock"], True), "store_all", 0.0, "sgd")
def test_random_chains_match_plain_pytorch(chain, algorithm, fraction, opt):
    """Losses, input and parameter gradients, BatchNorm statistics and parameters after
    three optimizer steps are bitwise those of plain PyTorch (all ops here are
    deterministic on CPU), for every algorithm and budget."""
    kinds, image = chain
    torch.manual_seed(0)
    base = Net(kinds, image=image)
    ref = train(copy.deepcopy(base), opt=opt)
    net, costs = copy.deepcopy(base), measured_costs(base)
    net.budget = budget_for(costs, algorithm, fraction)
    net.algorithm = algorithm
    try:
        got = train(net, opt=opt)
    except remat.BudgetError as exc:   # (a gradient in another layout, no room to measure it: chains.under_budget)
        assert exc.minimum <= net.budget + max(costs.out_bytes), (exc.minimum, net.budget)
        net = copy.deepcopy(base)
        net.budget, net.algorithm = exc.minimum, algorithm
        got = train(net, opt=opt)
    assert_same(ref, got)
    assert remat.explain().schedule.peak <= net.budget


@given(random_chains(), st.floats(0, 1), st.booleans())
# the gradient reaches the attention stage transposed, and its first node copies
# it before any saved tensor is unpacked: measured with that layout, rebuilt first
@example((["attn", "bn"], False), 0.0, False)
@example((["linear", "dropout", "attn", "bn"] * 2 + ["attn", "bn"], False), 0.1, False)
# the tied weight's gradient from stage 4 is held until stage 1's backward
@example((["tied", "linear", "relu", "tied"], False), 0.0, False)
# the mlp's backward measured again for the transposed gradient, with its parameters
@example((["mlp", "bn"], False), 0.0, False)
# the scale stage saves nothing: its anchor (holding a^2) goes as stage 2's backward starts
@example((["linear", "mlp", "scale", "attn", "linear"], False), 0.0, False)
# the loop keeps the output of a stage that reads it (relu) through the whole backward
@example((["dropout", "gelu", "relu"], False), 0.5, True)
# bn hands scale a transposed gradient, which scale hands on to attn: run 4 cascades
@example((["attn", "scale", "bn"], False), 0.0, True)
# (the deep profile's: with a tail, the last entry of out_bytes is the tail's, not a^L's)
@example((["bn", "linear"], False), 0.0, True)
def test_measured_peak_stays_under_budget(chain, fraction, hold):
    """The storage meter's peak of a real training step never exceeds the budget,
    whether the loop keeps the chain's output through the backward or not
    (remat/measure/chain_record.py Note [The chain's output]), and is within 10% of
    simulate's: what the forward phase lets go (Costs.fwd_drop) and what the
    chain holds through the step (Costs.held_bytes) are counted apart from the
    activations. The output a loop keeps is counted in held_bytes from the
    start, and during Fall(L) also as the stage's output: up to its bytes more.
    (Not for chains with scale stages: one that saves nothing needs no
    recomputation for its backward, and the runtime skips the one a schedule
    gives it, which simulate charges; docs/limitations.md.)"""
    kinds, image = chain
    torch.manual_seed(0)
    net = Net(kinds, image=image)
    costs = measured_costs(net)
    net.budget = budget_for(costs, "optimal", fraction)
    train(net, steps=1, hold=hold)            # measuring call, then .grad exists
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    peak = under_budget(net, lambda n, _: physical_peak(n, hold=hold), 1, max(costs.out_bytes))
    explanation = remat.explain()
    predicted = explanation.schedule.peak
    assert peak <= net.budget
    assert peak <= predicted
    if "scale" not in kinds:
        held = explanation.costs.out_bytes[explanation.costs.stages - 1] if hold else 0   # (a^L: not the tail's)
        assert peak >= 0.9 * (predicted - held), (peak, predicted)


@pytest.mark.parametrize("kinds", [["mlp"] * 6, ["attn", "mlp"] * 4, ["convblock"] * 6, ["linear", "ln"] * 5])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 1.0])
@pytest.mark.parametrize("hold", [True, False])
def test_measured_peak_close_to_prediction(kinds, fraction, hold):
    """The real peak is within 10% under simulate's on chains of realistic blocks.
    (a-bar^i counts a^i, which a stage whose backward does not read it lets go by
    B(i): bwd_tmp gives it back; one the next stage's recording does not keep
    either goes in the forward phase: Costs.fwd_drop.)"""
    image = kinds[0].startswith("conv")
    torch.manual_seed(0)
    net = Net(kinds, d=16, image=image)
    net.budget = budget_for(measured_costs(net, 8, 16), "optimal", fraction)
    train(net, steps=1, batch=8, length=16, hold=hold)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    peak = physical_peak(net, 8, 16, hold=hold)
    explanation = remat.explain()
    predicted = explanation.schedule.peak
    assert peak <= net.budget
    if "scale" not in kinds:
        held = explanation.costs.out_bytes[explanation.costs.stages - 1] if hold else 0   # (a^L: not the tail's)
        assert peak >= 0.9 * (predicted - held), (peak, predicted)


def test_train_eval_switch():
    """Switching to eval mode (with grad) and back gives plain PyTorch's results each time."""
    base = fresh_net()
    ref, net = copy.deepcopy(base), with_budget(base)
    for mode in ("train", "eval", "train"):
        ref.train(mode == "train")
        net.train(mode == "train")
        assert_same(train(ref, steps=2), train(net, steps=2))


def test_autocast_bfloat16_on_cpu():
    """Under CPU autocast (bfloat16) results are bitwise those of plain PyTorch."""
    base = fresh_net(("mlp", "attn", "mlp", "ln"))
    ref, net = copy.deepcopy(base), with_budget(base)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = train(ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = train(net)
    assert_same(r, g)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_autocast_around_one_phase_only(where):
    """Autocast around the forward only (the backward outside it, as PyTorch advises), or
    around the backward only: recomputations run in the forward's autocast state either
    way (entered when it differs from the backward's, skipped when it is the same), and
    results are bitwise plain PyTorch's."""
    import contextlib

    def bf16(on):
        return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()

    def steps(net):
        out = []
        for step in range(2):
            x, mask = make_input(net, seed=step)
            with bf16(where == "forward"):
                y = net(x, mask)
            with bf16(where == "backward"):
                y.float().sum().backward()
            out.append((y.detach().clone(), x.grad.clone(), [p.grad for p in net.parameters()]))
            net.zero_grad(set_to_none=True)
        return out

    base = fresh_net(("mlp", "attn", "mlp", "ln", "bn"))
    ref, net = copy.deepcopy(base), with_budget(base)
    steps(net)   # the measuring call
    torch.manual_seed(0)
    r = steps(ref)
    torch.manual_seed(0)
    g = steps(net)
    assert remat.explain().schedule.recomputations() > 0
    for (ya, xa, ga), (yb, xb, gb) in zip(r, g):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ga, gb))


def test_new_batch_size_measures_again():
    """A new input shape is a new key: it is measured, and both shapes stay exact."""
    base = fresh_net()
    ref, net = copy.deepcopy(base), with_budget(base, 0.2)
    assert_same(train(ref, batch=4), train(net, batch=4))
    costs_4 = remat.explain().costs
    assert_same(train(ref, batch=2), train(net, batch=2))
    costs_2 = remat.explain().costs
    assert costs_2 is not costs_4 and costs_2.input_bytes == costs_4.input_bytes // 2


def test_new_budget_solves_again_without_measuring():
    """A new budget reuses the measured costs and gives a new schedule."""
    base = fresh_net()
    ref, net = copy.deepcopy(base), with_budget(base, 0.0)
    # (the measuring call, two that time it again, one on those times)
    assert_same(train(ref, steps=4), train(net, steps=4))
    before = remat.explain()
    net.budget = budget_for(before.costs, "optimal", 1.0)
    assert_same(train(ref), train(net))
    after = remat.explain()
    assert after.costs is before.costs
    assert after.schedule.recomputations() < before.schedule.recomputations()


def test_gradient_accumulation_over_two_forwards():
    """Two forwards then one backward of the summed loss equal plain PyTorch."""
    base = fresh_net()
    results = []
    for net in (copy.deepcopy(base), with_budget(base, 0.1)):
        torch.manual_seed(3)
        xs = [make_input(net, seed=s) for s in (1, 2)]
        loss = sum(net(x, m).square().sum() for x, m in xs)
        loss.backward()
        results.append([p.grad for p in net.parameters() if p.grad is not None] + [x.grad for x, _ in xs])
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_no_grad_runs_plainly():
    """Under torch.no_grad a chain runs its stages plainly and records nothing."""
    base = fresh_net()
    net = with_budget(base)
    x, mask = make_input(net)
    torch.manual_seed(0)
    with torch.no_grad():
        a = net(x, mask)
    torch.manual_seed(0)
    with torch.no_grad():
        b = copy.deepcopy(base)(x, mask)
    assert torch.equal(a, b)


def test_explain_shows_costs_and_schedule():
    """explain() names every stage with its costs and its forward-phase op, under the
    input's and the held bytes' lines (the first call counts the output as held),
    and prints the schedule."""
    net = with_budget(fresh_net(), 0.0)
    train(net, steps=1)
    explanation = remat.explain()
    assert explanation.costs.held_bytes > 0
    text = str(explanation)
    assert "budget" in text and "schedule" in text
    modes = explanation.schedule.forward_modes()
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(1, 6)) and explanation.costs.stages == 5
    assert [r[-2] for r in rows] == [m.__name__ for m in modes[:5]] and all(r[-1] == "Stage" for r in rows)
    assert any(line.split()[:1] == ["held"] for line in text.splitlines())
    assert any(line.split()[:1] == ["tail"] and "Fall" in line for line in text.splitlines())


def test_explain_after_a_budget_error_shows_that_budget():
    """A budget below the minimum on a chain measured before: explain() shows the
    failed call's budget and no schedule (as after a failed first call), not the
    schedule of the call before; the next call at a good budget shows its own."""
    net = with_budget(fresh_net(), 0.0)
    good = net.budget
    train(net, steps=1)
    net.budget = 100
    with pytest.raises(remat.BudgetError):
        train(net, steps=1)
    explanation = remat.explain()
    assert explanation.budget == 100 and explanation.schedule is None
    assert "budget 100" in str(explanation)
    net.budget = good
    train(net, steps=1)
    assert remat.explain().budget == good and remat.explain().schedule is not None


def test_chain_output_held_through_backward_is_counted():
    """Plans count the chain's output as held until a backward shows it let go; a loop
    that holds it once keeps it counted (remat/measure/chain_record.py Note [The chain's output]),
    and that call, which may have gone over the budget by it, says so."""
    torch.manual_seed(0)
    net = Net(["linear", "scale", "linear"])
    net.budget = 2**40

    def step(hold):
        x, mask = make_input(net)
        y = net(x, mask)
        loss = y.sum()
        if not hold:
            del y
        loss.backward()
        return remat.explain()

    first = step(hold=False)     # measuring call: planned before its backward
    measured = first.measured    # (the costs planned on have the tail too: Note [The chain's tail])
    assert first.costs.without_tail().held_bytes == measured.held_bytes + measured.out_bytes[-1]
    assert step(hold=False).costs.without_tail() == measured          # its backward showed a^L let go
    with pytest.warns(RuntimeWarning, match="kept the chain's output through its backward"):   # (it went over)
        assert step(hold=True).costs.without_tail() == measured       # solved before this call's backward...
    for hold in (True, False):                                         # ...which showed a^L held: for good
        assert step(hold).costs.without_tail().held_bytes == measured.held_bytes + measured.out_bytes[-1]


def test_one_module_as_every_stage_stays_under_budget():
    """One block used as every stage (ALBERT-style sharing): each B(i) makes its share
    of the shared parameters' gradient before the engine adds it into the sum it
    holds, a transient the stage's measured backward left out (the peak went 51% over
    the minimum budget)."""
    from remat.measure.meter import Instrument

    class Blk(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.l1, self.l2, self.ln = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)

        @remat.stage
        def forward(self, x):
            return x + self.l2(torch.tanh(self.l1(self.ln(x))))

    torch.manual_seed(0)
    blk = Blk(64)

    def peak(budget):
        x = torch.randn(8, 64, requires_grad=True)
        for p in blk.parameters():
            p.grad = torch.zeros_like(p)
        with Instrument() as inst:
            x.register_hook(lambda g: inst.set_gate(False))
            with remat.chain(budget=budget):
                h = x
                for _ in range(6):
                    h = blk(h)
            inst.set_gate(False)
            loss = h.square().mean()
            seed = torch.ones(())
            inst.set_gate(True)
            loss.backward(seed)
        return inst.peak + x.untyped_storage().nbytes()

    peak(2**40)
    peak(2**40)
    costs = remat.explain().costs
    low, high = minimum_budget(costs), remat.explain().schedule.peak
    for budget in (low, (low + high) // 2, high):
        peak(budget)
        assert peak(budget) <= budget


def test_explain_says_where_the_times_come_from_and_what_is_held():
    """explain() says whether the times are first-call estimates or how many calls
    refined them, and what the held bytes are (here autocast's cached casts of the
    weights, and the chain's output the loop keeps)."""
    torch.manual_seed(0)
    blocks = [remat.stage(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))) for _ in range(4)]
    x = torch.randn(128, 64, requires_grad=True)
    said = []
    for _ in range(4):
        with torch.autocast("cpu", torch.bfloat16):
            with remat.chain(budget="1MiB"):
                h = x
                for b in blocks:
                    h = b(h)
        out = h.float()   # (kept by the loop through the backward: the tail's kept bytes)
        out.sum().backward()
        said.append(str(remat.explain()))
    assert "times: first-call estimates" in said[0] and "calls after it refine them" in said[0]
    # (the third call's backward refined the times its plan had not: said so, not claimed for its costs)
    assert "first-call estimates in these costs; the means of 2 calls' own" in said[2]
    assert "times: the means of 2 calls' own, as training steps ran them" in said[-1]
    held = remat.explain().held
    assert held["caches' copies of the weights (autocast's casts, parametrize.cached)"] > 0
    assert any("keeps through the backward" in what for what in held)
    assert all(what in said[-1] for what in held)
    assert sum(held.values()) == remat.explain().costs.held_bytes   # (the tail's kept bytes were not listed)
