"""A stage that misbehaves inside a chain gets a clear error that names the
stage, the problem and the fix, and leaves the model, RNG and remat's cache
usable: code or a hook between two stages changing the activation, a stage
changing its input in place or returning what it may not, an exception in its
forward or while it is recomputed, a recomputation saving other tensors, a
chain opened where saved-tensor hooks are disabled. The next call gives plain
PyTorch's gradients."""

import copy

import pytest
import torch
import torch.nn as nn

import remat
from chains import head_step


class Toggle(nn.Module):
    """A stage whose behaviour tests switch from outside."""

    def __init__(self, d=8):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.mode = "ok"
        self.calls = 0

    @remat.stage
    def forward(self, x, mask=None):
        self.calls += 1
        if self.mode == "inplace":
            x.mul_(2)
        if self.mode == "raise":
            raise ValueError("boom")
        if self.mode == "raise_on_recompute" and self.calls % 2 == 0:
            raise ValueError("boom on recompute")
        if self.mode == "dict":
            return {"x": self.lin(x)}
        if self.mode == "tuple_grad":
            y = self.lin(x)
            return y, y * 2
        if self.mode == "unstable" and self.calls % 2 == 0:
            return torch.tanh(self.lin(x).exp())
        return torch.tanh(self.lin(x))


class Chain(nn.Module):
    def __init__(self, n=4, budget=None, between=None):
        super().__init__()
        self.stages = nn.ModuleList(Toggle() for _ in range(n))
        self.budget = budget
        self.between = between

    def forward(self, x):
        with remat.chain(budget=self.budget if self.budget is not None else 2**40,
                         algorithm="optimal" if self.budget is not None else "min_memory"):
            for i, s in enumerate(self.stages):
                x = s(x)
                if self.between is not None and i == 1:
                    x = self.between(x)
        return x


def _input(seed=0):
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _grads(net, seed=0):
    x = _input(seed)
    net(x).square().sum().backward()
    out = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    net.zero_grad()
    return out


def _assert_exact_next_call(net):
    """The next call gives plain PyTorch's gradients."""
    plain = copy.deepcopy(net)
    for s in plain.stages:
        s.mode = "ok"
    for s in net.stages:
        s.mode = "ok"
    net.zero_grad()
    ref = []
    x = _input(5)
    y = x
    for s in plain.stages:
        y = s(y)
    y.square().sum().backward()
    ref = [p.grad.clone() for p in plain.stages.parameters()] + [x.grad.clone()]
    got = _grads(net, 5)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_code_between_stages_is_named():
    """Transforming the activation between stages names both stages and the fix."""
    net = Chain(between=lambda x: x * 2)
    with pytest.raises(remat.StageError, match=r"stage 3 .*stage 2 .*Move that code"):
        _grads(net)
    net.between = None
    _assert_exact_next_call(net)


def test_in_place_between_stages_is_named():
    """Modifying the activation in place between stages is an error naming the stages."""
    net = Chain(between=lambda x: x.add_(1))
    with pytest.raises(remat.StageError, match="modified in place before"):
        _grads(net)
    net.between = None
    _assert_exact_next_call(net)


@pytest.mark.parametrize("hook", ["forward", "pre", "in_place"])
def test_hook_on_a_stage_module_changing_the_activation_is_named(hook):
    """A hook on a stage module runs around the stage's forward, between two stages:
    one that changes the activation (a steering vector added to a layer's output) is
    named with its fix, not blamed on code in the loop; without it the next call is
    exact, and plain code between stages gets no word of hooks."""
    net = Chain()
    if hook == "forward":
        handle = net.stages[1].register_forward_hook(lambda m, args, out: out * 2)
    elif hook == "pre":
        handle = net.stages[2].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    else:
        handle = net.stages[1].register_forward_hook(lambda m, args, out: out.add_(1))
    said = "modified in place before" if hook == "in_place" else "did not receive"
    kind = "forward pre-hooks" if hook == "pre" else "forward hooks"
    with pytest.raises(remat.StageError, match=f"{said}.*{kind} run there.*register it on a submodule"):
        _grads(net)
    handle.remove()
    _assert_exact_next_call(net)
    net.between = lambda x: x * 2
    with pytest.raises(remat.StageError, match="Move that code") as caught:
        _grads(net)
    assert "hooks" not in str(caught.value)


def test_in_place_first_op_on_stage_input():
    """A stage that modifies its input in place is caught through the version counter; the
    error names the stage before it, or for the first stage the code before the chain
    (it named a stage 0)."""
    from remat.errors import input_modified

    net = Chain()
    net.stages[2].mode = "inplace"
    with pytest.raises(remat.StageError, match="modified its input in place.*to the end of stage 2$"):
        _grads(net)
    _assert_exact_next_call(net)
    assert str(input_modified(1, "Toggle")).endswith("move it to the end of the code before the chain")


def test_stage_returning_a_non_tensor():
    """A stage returns a tensor, or a tuple, a dict or a dataclass led by one: a dict
    passed whole to the next stage is named there, with how to unpack it."""
    net = Chain()
    net.stages[1].mode = "dict"
    with pytest.raises(remat.StageError, match=r"stage 3 \(Toggle\) got no tensor argument.*got a dict of tensors"):
        _grads(net)
    _assert_exact_next_call(net)


def test_tuple_extra_that_requires_grad():
    """Only a stage's first output may carry gradient."""
    net = Chain()
    net.stages[1].mode = "tuple_grad"
    with pytest.raises(remat.StageError, match="requires grad"):
        _grads(net)
    _assert_exact_next_call(net)


def test_exception_in_stage_forward_propagates_and_recovers():
    """A stage's own exception reaches the caller with the stage named; the next call is exact."""
    net = Chain()
    net.stages[2].mode = "raise"
    with pytest.raises(ValueError, match="boom") as info:
        _grads(net)
    assert any("remat stage 3" in note for note in getattr(info.value, "__notes__", []))
    _assert_exact_next_call(net)


def test_exception_during_recomputation():
    """An exception while recomputing in backward is a StageError naming the stage."""
    net = Chain()
    _grads(net)   # measuring call
    for s in net.stages:
        s.calls = 0
    net.stages[1].mode = "raise_on_recompute"
    with pytest.raises(remat.StageError, match=r"stage 2 .*recomputed during backward"):
        _grads(net)
    _assert_exact_next_call(net)


def test_recompute_mismatch_is_detected():
    """A stage that saves different tensors when recomputed raises RecomputeMismatchError."""
    net = Chain()
    _grads(net)
    for s in net.stages:
        s.calls = 0
    net.stages[1].mode = "unstable"
    with pytest.raises(remat.RecomputeMismatchError, match="stage 2"):
        _grads(net)
    _assert_exact_next_call(net)


def test_chain_where_saved_tensor_hooks_are_disabled():
    """A chain opened under ``disable_saved_tensors_hooks`` (which some libraries use)
    says why it cannot run there, and the next call outside gives exact gradients."""
    net = Chain(budget=None)
    with torch.autograd.graph.disable_saved_tensors_hooks("hooks are off in this library"):
        with pytest.raises(remat.StageError, match=r"hooks are disabled .*'hooks are off in this library'.*Toggle"):
            net(_input())
    _assert_exact_next_call(net)


def test_budget_error_carries_the_minimum():
    """A budget below the chain's minimum: ``BudgetError.minimum`` is the least budget
    in bytes, and a chain given it runs (the first call's and the next's), the whole
    step, tail included, within it."""
    from remat.measure.meter import Instrument

    torch.manual_seed(0)
    blocks = [remat.stage(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))) for _ in range(6)]
    head = nn.Linear(16, 40)
    x = torch.randn(32, 16)

    def step(budget):
        with Instrument(writes=False) as inst:
            head_step(blocks, head, x, budget)
        return inst.peak + x.untyped_storage().nbytes()

    step(2**40)
    step(2**40)   # (its backward showed the tail)
    with pytest.raises(remat.BudgetError) as info:
        step(1000)
    least = info.value.minimum
    assert isinstance(least, int) and 1000 < least
    assert f"{least} bytes" in str(info.value)
    for _ in range(2):
        assert step(least) <= least
    with pytest.raises(remat.BudgetError) as info:
        remat.solve(remat.Costs.uniform(3, size=100), 10)
    assert info.value.minimum == remat.solver.solve.minimum_budget(remat.Costs.uniform(3, size=100))


@pytest.mark.parametrize("packed", ["tuple", "dict"])
def test_a_tuple_or_dict_passed_on_whole_is_named(packed):
    """A stage returning (activation, extra), its caller passing the whole tuple (or a
    dict of tensors) on to the next stage: the error says a tuple (dict) arrived and how
    to unpack it, not only that no tensor did."""

    class TB(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @remat.stage
        def forward(self, x):
            h = x if isinstance(x, torch.Tensor) else x[0] if isinstance(x, tuple) else x["h"]
            out = self.lin(h)
            return (out, None) if packed == "tuple" else out

    a, b = TB(), TB()
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(remat.StageError) as info:
        with remat.chain(budget="1MiB"):
            h = a(x)
            b(h if packed == "tuple" else {"h": h})
    said = str(info.value)
    assert "stage 2 (TB) got no tensor argument" in said
    if packed == "tuple":
        assert "got a tuple of 2 whose first item is a tensor" in said and "h = block(h)[0]" in said
    else:
        assert "got a dict of tensors ('h')" in said and "pass the activation itself" in said


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_options_value_is_refused(bad):
    """``options`` must be True, False or "auto", for chain, Sequential and wrap alike;
    the model given to wrap is left as it was."""
    with pytest.raises(TypeError, match="remat: options must be True"):
        remat.chain(budget="1MiB", options=bad)
    with pytest.raises(TypeError, match="remat: options must be True"):
        remat.Sequential(nn.Linear(2, 2), budget="1MiB", options=bad)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    forwards = [vars(m).get("forward") for m in [model, *model]]
    with pytest.raises(TypeError, match="remat: options must be True"):
        remat.wrap(model, list(model), budget="1MiB", options=bad)
    assert [vars(m).get("forward") for m in [model, *model]] == forwards


@pytest.mark.parametrize("by_keyword", [True, False])
def test_an_activation_passed_after_a_side_input_is_named(by_keyword):
    """A stage whose signature puts a mask before the hidden state, called with both: the
    mask, a tensor passed first, is its activation, and the next stage got the output of
    the one before as another argument. The error said code between the stages changed
    the activation; it names the argument and the rule."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @remat.stage
        def forward(self, mask=None, hidden=None):
            return self.lin(hidden) + mask

    blocks = [Block() for _ in range(3)]
    x, mask = torch.randn(2, 8, requires_grad=True), torch.zeros(2, 8)
    where = "as hidden=, but took its argument mask" if by_keyword else "as its argument 2, but took an argument"
    with pytest.raises(remat.StageError, match=rf"stage 2 \(Block\) got the tensor stage 1 \(Block\) returned {where}"):
        with remat.chain(budget="1MiB"):
            h = x
            for b in blocks:
                h = b(mask=mask, hidden=h) if by_keyword else b(mask, h)


def test_bare_chain_decorator_says_to_call_it():
    """``@remat.chain`` without its parentheses hands it the function as the budget:
    the error says to write ``@remat.chain(...)``."""
    with pytest.raises(remat.BudgetError, match=r"@remat.chain\(budget='2GiB'\)"):
        @remat.chain
        def body(x):
            return x


def test_every_argument_error_is_a_remat_error():
    """The API's errors for arguments of the wrong type or value are ``remat.UsageError``:
    a ``RematError`` (every error remat raises is one), and the ``TypeError`` or
    ``ValueError`` they were before."""
    costs = remat.Costs(fwd_time=[1.0], fwd_nograd_time=[1.0], bwd_time=[1.0], out_bytes=[4], saved_bytes=[4],
                        fwd_tmp=[0], bwd_tmp=[0], input_bytes=4)
    for make, was in ((lambda: remat.stage(42), TypeError), (lambda: remat.chain(costs=123), TypeError),
                      (lambda: remat.chain(options="yes"), TypeError), (lambda: remat.chain(slots=0), ValueError),
                      (lambda: remat.chain(algorithm="fastest"), ValueError), (lambda: remat.wrap(42, []), TypeError),
                      (lambda: remat.wrap(nn.Linear(2, 2), []), ValueError), (lambda: remat.solve({}, 100), TypeError),
                      (lambda: remat.solve(costs, 100, groups=0), ValueError),
                      (lambda: remat.unwrap(nn.Linear(2, 2)), ValueError),
                      (lambda: remat.Sequential.from_module(nn.Linear(2, 2)), TypeError),
                      (lambda: remat.simulate(costs, [], trace=5), TypeError)):
        with pytest.raises(remat.UsageError) as caught:
            make()
        assert isinstance(caught.value, remat.RematError) and isinstance(caught.value, was)


def test_a_budget_that_is_an_integer_of_another_type_is_taken():
    """numpy's int64 (a budget computed with numpy) and any other integer type, as
    ``operator.index`` takes them, are bytes like an int; a bool or a float is not."""
    from remat.chain import parse_budget

    class Bytes:
        def __index__(self):
            return 2**20

    assert parse_budget(Bytes()) == 2**20
    np = pytest.importorskip("numpy")
    assert parse_budget(np.int64(4096)) == 4096
    for bad in (True, 1.5, np.float64(2.0)):
        with pytest.raises(remat.BudgetError):
            parse_budget(bad)
