"""How the stages of a chain are called and what they return, against plain
PyTorch bit for bit: the activation passed by keyword (after a side input, or
into ``**kwargs``), integer ids in and a sparse gradient out, outputs needing
no grad in the middle of a chain, nested tuples, later stages' side inputs and
submodule flags."""

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn

import chains
import remat
from remat.solver.solve import minimum_budget, store_all


def test_sparse_embedding_stage_matches_plain():
    """``nn.Embedding(sparse=True)`` gives a sparse gradient, whose memory the meter
    finds in its indices and values (it crashed reading a sparse tensor's storage)."""

    def make():
        torch.manual_seed(0)
        return nn.ModuleList([remat.stage(nn.Embedding(30, 16, sparse=True))] + [
            remat.stage(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))) for _ in range(3)])

    def run(stages, h):
        for s in stages:
            h = s(h)
        return h

    def train(stages, budget):
        opt = torch.optim.SGD(stages.parameters(), lr=0.1)
        for step in range(3):
            torch.manual_seed(step)
            ids = torch.randint(0, 30, (4, 7))
            if budget is None:
                h = run(stages, ids)
            else:
                with remat.chain(budget=budget):
                    h = run(stages, ids)
            opt.zero_grad()
            h.square().mean().backward()
            opt.step()
        return stages

    train(make(), 2**40)
    low = minimum_budget(remat.explain().costs)
    remat.clear_cache()
    ref, net = train(make(), None), train(make(), low)
    assert remat.explain().schedule.recomputations() > 0
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a, b)


def test_activation_passed_by_keyword_after_a_side_input():
    """``blk(mask=m, hidden_states=h)``: of the tensors passed by keyword, the
    activation is the one whose parameter comes first in the stage's signature."""

    class Masked(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = nn.Linear(d, d)

        @remat.stage
        def forward(self, hidden_states, mask=None):
            return torch.tanh(self.lin(hidden_states)) * mask

    torch.manual_seed(0)
    ref = nn.ModuleList(Masked(16) for _ in range(4))
    net = copy.deepcopy(ref)
    mask = (torch.rand(4, 8, 1) > 0.3).float()
    for budget in (2**40, 0):
        x = torch.randn(4, 8, 16)
        h, g = x, x
        if budget == 0:
            budget = minimum_budget(remat.explain().costs)
        with remat.chain(budget=budget):
            for blk in net:
                h = blk(mask=mask, hidden_states=h)
        for blk in ref:
            g = blk(mask=mask, hidden_states=g)
        h.square().sum().backward()
        g.square().sum().backward()
        for a, b in zip(ref.parameters(), net.parameters()):
            assert torch.equal(a.grad, b.grad)
    assert remat.explain().schedule.recomputations() > 0


@pytest.mark.parametrize("cut", ["detach", "argmax", "work-then-detach"])
def test_stage_output_needing_no_grad_mid_chain(cut):
    """A stage whose output needs no grad (a detach; an argmax feeding an embedding)
    cuts the graph: the stages before it are never backwarded and their graphs go,
    but recomputing a later stage still needs their inputs (it raised 'no longer
    held; please report this bug' from the second call; still, until the run kept
    them as the stage returned, where the cutting stage saved tensors before its
    detach, its graph holding its own input)."""

    class Proj(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        @remat.stage
        def forward(self, x):
            return torch.relu(self.fc(x))

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 16)

        @remat.stage
        def forward(self, i):
            return self.emb(i)

    @remat.stage
    def detach(x):
        return x.detach() * 2

    @remat.stage
    def argmax(x):
        return x.argmax(-1)

    class WorkThenDetach(Proj):
        @remat.stage
        def forward(self, x):
            return (x + torch.tanh(self.fc(x))).detach()

    torch.manual_seed(0)
    mods = nn.ModuleList({"argmax": [Proj(), Embed(), Proj(), Proj()], "detach": [Proj(), Proj(), Proj()],
                          "work-then-detach": [Proj(), WorkThenDetach(), Proj(), Proj(), Proj()]}[cut])
    ref = copy.deepcopy(mods)

    def stages(m):
        return {"argmax": [m[0], argmax, *m[1:]], "detach": [m[0], detach, *m[1:]]}.get(cut, list(m))

    x0 = torch.randn(8, 16)
    budget = 2**40
    for step in range(4):
        grads = []
        for m, chained in ((ref, False), (mods, True)):
            m.zero_grad()
            h = x0.clone().requires_grad_()
            if chained:
                with remat.chain(budget=budget):
                    for s in stages(m):
                        h = s(h)
            else:
                for s in stages(m):
                    h = s(h)
            h.square().mean().backward()
            grads.append([p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            assert (a is None and b is None) or torch.equal(a, b)
        budget = minimum_budget(remat.explain().costs)
    assert remat.explain().schedule.recomputations() > 0


def test_activation_by_keyword_into_kwargs_only_stage():
    """A stage taking ``**kwargs`` only (a wrapper passing them on), called
    ``blk(mask=m, hidden=h)``: with no signature to order them, the tensor needing
    grad is the activation (the mask was taken)."""

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        @remat.stage
        def forward(self, **kwargs):
            return torch.tanh(self.lin(kwargs["hidden"])) * kwargs["mask"]

    torch.manual_seed(0)
    mods = nn.ModuleList(Blk() for _ in range(3))
    x = torch.randn(8, 16, requires_grad=True)
    mask = torch.ones(8, 16)
    with remat.chain(budget=2**40):
        h = x
        for s in mods:
            h = s(mask=mask, hidden=h)
    h.sum().backward()
    assert remat.explain().costs.stages == 3


def test_nested_tuple_item_needing_grad_is_refused():
    @remat.stage
    def two(x):
        return x * 2, (x * 3,)

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(remat.StageError, match="item 1 requires grad"):
        with remat.chain(budget=2**40):
            two(x)


class _SelfAttn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(3)

    @remat.stage
    def forward(self, x):
        return x + torch.tanh(self.bn(self.lin(x)))


class _Cross(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d)

    @remat.stage
    def forward(self, x, mem):
        a = (self.q(x) @ mem.transpose(-1, -2)).softmax(-1)
        return x + a @ mem


def test_later_stage_side_input_and_submodule_flags_are_checked():
    """A chain's record holds for a later call only if every stage gets like side inputs
    (an encoder output of another length reaches the cross-attention stages, not the
    first one, which alone is in the chain's key) and its submodules have the same
    training flags (a BatchNorm inside a stage frozen with .eval()): otherwise the
    rest of the chain is measured again. Reusing the other record raised a false
    RecomputeMismatchError, or ran over the budget on the other shape's costs."""
    torch.manual_seed(0)
    base = nn.ModuleList([_SelfAttn(8)] + [_Cross(8) for _ in range(3)])
    plain, net = copy.deepcopy(base), copy.deepcopy(base)

    def step(blocks, length, budget, frozen):
        blocks[0].bn.train(not frozen)
        torch.manual_seed(length)
        x = torch.randn(2, 3, 8, requires_grad=True)
        mem = torch.randn(2, length, 8)
        if budget is None:
            h = x
            for b in blocks:
                h = b(h) if b is blocks[0] else b(h, mem)
        else:
            with remat.chain(budget=budget):
                h = blocks[0](x)
                for b in blocks[1:]:
                    h = b(h, mem)
        h.square().sum().backward()
        return [x.grad] + [p.grad.clone() for p in blocks.parameters()]

    remat.clear_cache()
    step(copy.deepcopy(base), 40, 1 << 30, False)
    low = minimum_budget(remat.explain().costs) + 512   # (the longer source's minimum)
    for length, frozen in [(40, False), (4, False), (4, False), (40, False), (40, True), (40, True), (4, False)]:
        want = step(plain, length, None, frozen)
        got = step(net, length, low, frozen)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert remat.explain().costs.input_bytes == 2 * 3 * 8 * 4
        plain.zero_grad()
        net.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), net.state_dict().values()))


@pytest.mark.parametrize("kind", ["dict", "dataclass"])
def test_stages_returning_a_dict_or_a_dataclass(kind):
    """A stage returning a dict or a dataclass (as a transformers ModelOutput) whose
    first value is the activation, the others needing no grad: accepted (a dict was
    refused), and at a budget that recomputes, gradients are plain PyTorch's; one
    whose second value needs grad is refused, naming it."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor
        extra: object = None

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.leak = False

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            other = h if self.leak else h.detach().sum()
            return {"hidden": h, "norm": other} if kind == "dict" else Out(h, other)

    torch.manual_seed(0)
    plain = nn.ModuleList(Blk() for _ in range(6))
    staged = copy.deepcopy(plain)
    for b in staged:
        remat.stage(b)
    x = torch.randn(4, 8, requires_grad=True)
    get = (lambda o: o["hidden"]) if kind == "dict" else (lambda o: o.hidden)
    budget = 2**40
    for step in range(3):
        h = x
        for b in plain:
            h = get(b(h))
        h.sum().backward()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with remat.chain(budget=budget):
                g = x
                for b in staged:
                    g = get(b(g))
            g.sum().backward()
        # (a dataclass's activation was taken for one the stage held outside autograd: warned of, and
        # counted as held through the step)
        assert not [w for w in seen if "outside what autograd saves" in str(w.message)], step
        assert not any("outside autograd" in k for k in remat.explain().held), remat.explain().held
        budget = remat.solver.solve.minimum_budget(remat.explain().costs)
    assert remat.explain().schedule.recomputations() > 0
    for p, q in zip(plain.parameters(), staged.parameters()):
        assert torch.equal(p.grad, q.grad)
    staged[0].leak = True
    with pytest.raises(remat.StageError, match="whose item 1 requires grad"):
        with remat.chain(budget=2**40):
            get(staged[0](x))


class _Discards(nn.Module):
    def __init__(self, d, returns_input):
        super().__init__()
        self.l1, self.l2, self.returns_input = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), returns_input

    @remat.stage
    def forward(self, x):
        h = x + self.l2(torch.relu(self.l1(x)))
        return x if self.returns_input else h


def test_a_stage_that_returns_its_input_after_computing_something_else():
    """A stage that computes a branch and returns its input (a block switched off by a
    flag): what autograd saved of the branch goes with it as the stage returns, and
    with it the stage's anchor and the input it held. Plans that run the stage again
    in the backward raised "no longer held; please report this bug" on every call
    after the first (12 of 42 budgets); its input is made again from below now."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Discards(16, k == 1) for k in range(4))
    head = nn.Linear(16, 4)
    step = functools.partial(chains.square_step, blocks, head, torch.randn(4, 6, 16))
    want = step(None)
    step(remat.chain.NO_LIMIT)
    least, top = remat.explain().least_budget, remat.simulate(remat.explain().costs, store_all(5)).peak
    ran_again = 0
    try:
        for budget in range(least, top, 512):
            remat.clear_cache()
            for _ in range(3):
                got = step(budget)
                assert all(torch.equal(a, b) for a, b in zip(want, got)), budget
                assert remat.explain().measured_peak <= budget, (budget, remat.explain().measured_peak)
            ran_again += "Fn2" in str(remat.explain().schedule).split("|")[1]
    finally:
        remat.clear_cache()
    assert ran_again
