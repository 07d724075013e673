"""Calls of one chain alive together (Note [Calls alive together],
remat/measure/overlap.py): the same chain opened again before the backward has
reached the earlier call (a siamese pair), its stages' parameter gradients held
by the engine between the two calls' backwards."""

import contextlib
import copy
import gc

import pytest
import torch
import torch.nn as nn

import remat


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _siamese(budget, steps, seed=0, functions=False, alone=False):
    """Steps of a wrapped 4-block chain (or one of function stages calling the blocks)
    called on two views before one backward: each step's peak, and the gradients.
    With ``alone``, a step calling it once comes first (its measuring call)."""
    torch.manual_seed(seed)
    net = nn.Sequential(*(_Block(32) for _ in range(4)))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    if functions:
        stages = [remat.stage(lambda x, b=b: b(x)) for b in net]
        run = net

        def net(x):
            with remat.chain(budget=budget) if budget is not None else contextlib.nullcontext():
                for s in stages:
                    x = s(x)
            return x
        net.parameters = run.parameters
    elif budget is not None:
        remat.wrap(net, list(net), budget=budget)
    x1, x2 = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    if alone:
        net(x1).square().mean().backward()
    peaks = []
    for _ in range(steps):
        gc.collect()
        with remat.measure_peak() as m:
            (net(x1) * net(x2)).mean().backward()
        peaks.append(m.peak)
    return peaks, [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("functions", [False, True])
def test_a_chain_called_twice_before_one_backward_counts_the_parameter_gradients(functions):
    """The later call's backward runs first, and the engine holds its shares of every
    stage's parameter gradients until the earlier call's backward reaches the stage:
    steps went 1.9 times over the two calls' budgets, near plain PyTorch's peak. The
    second call warns and counts them; a budget under them is refused with the
    least that holds them, and at it every step from the second is under twice the
    budget (each call's), its gradients plain PyTorch's. Stages that are functions
    calling the blocks (no parameters of their own) count the leaves their backwards
    reach."""
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="opened again before the backward reached its earlier call"):
        _siamese(2**30, 2, functions=functions)
    least = remat.explain().least_budget
    params = sum(p.numel() * 4 for p in nn.Sequential(*(_Block(32) for _ in range(4))).parameters())
    assert least > params
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="opened again"):
        with pytest.raises(remat.BudgetError) as caught:
            _siamese(least - params // 2, 2, functions=functions)
    assert caught.value.minimum > params   # (it counts them)
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="opened again"):
        peaks, grads = _siamese(least, 4, functions=functions)
    assert all(peak <= 2 * least for peak in peaks), (peaks, least)   # (the first step's too)
    _, want = _siamese(None, 4)
    assert all(torch.equal(a, b) for a, b in zip(want, grads))
    held = remat.explain().held
    assert any("held between two calls' backwards" in k for k in held), held


def test_a_backward_between_the_calls_counts_nothing():
    """Gradient accumulation (each call's backward before the next forward) keeps no
    gradient between calls: nothing is counted, nothing warns."""
    torch.manual_seed(0)
    net = nn.Sequential(*(_Block(32) for _ in range(4)))
    remat.clear_cache()
    remat.wrap(net, list(net), budget=64 * 1024)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(4):
            net(torch.randn(4, 8, 32)).square().mean().backward()
    assert not any("two calls" in k for k in remat.explain().held)


def test_calls_of_the_same_stages_under_two_chain_keys_count_them():
    """A global and a local crop (inputs of two shapes: two chain keys, two records)
    through the same blocks before one backward: the engine holds the gradients all
    the same. The later call counts them (steps went 1.37 times over the two budgets),
    its gradients plain PyTorch's."""
    torch.manual_seed(0)
    net = nn.Sequential(*(_Block(32) for _ in range(4)))
    ref = copy.deepcopy(net)
    remat.clear_cache()
    remat.wrap(net, list(net), budget=2**30)
    big, small = torch.randn(4, 8, 32), torch.randn(4, 4, 32)
    said = []
    with pytest.warns(RuntimeWarning, match="opened again"):
        for _ in range(2):
            (net(big).mean() * net(small).mean()).backward()
            said.append(remat.explain().held)
    (ref(big).mean() * ref(small).mean()).backward()
    (ref(big).mean() * ref(small).mean()).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), net.parameters()))
    assert any("held between two calls' backwards" in k for k in said[-1]), said


def test_a_graph_kept_with_no_backward_counts_nothing_once_a_backward_passed_it_by():
    """A loss computed for a log and kept with its graph (no backward) is in flight
    for good. The next call, opened while it is, counts the parameters' gradients
    (no backward has told yet whether one reaches both) and warns of the graph kept;
    its backward passes the logged call by, and from then on nothing is counted (the
    steps were refused their budget when they were)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(_Block(32) for _ in range(4)))
    remat.clear_cache()
    remat.wrap(net, list(net), budget=2**30)
    net(torch.randn(4, 8, 32)).square().mean().backward()   # (measured: the next calls run plans)
    logged = [net(torch.randn(4, 8, 32)).mean()]
    held = []
    with pytest.warns(RuntimeWarning, match="a loss kept for a log"):
        for _ in range(3):
            net(torch.randn(4, 8, 32)).square().mean().backward()
            held.append(any("two calls" in k for k in remat.explain().held))
    assert logged and held == [True, False, False]


@pytest.mark.parametrize("room", [True, False])
def test_the_first_step_of_calls_alive_together_counts_the_gradients_where_it_can(room):
    """Calls that run plans (their chain measured alone first): the first step of two
    calls alive together counts the gradients the engine holds, before any backward
    has shown them held, and stays under twice the budget (it went 1.9 times over the
    two calls' budgets). A budget with no room for them is not refused until a backward
    has shown them held: the later call plans without them, as a call alone would."""
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="opened again"):
        _siamese(2**30, 2)
    least = remat.explain().least_budget
    params = sum(p.numel() * 4 for p in nn.Sequential(*(_Block(32) for _ in range(4))).parameters())
    budget = least if room else least - params // 2
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match="opened again"):
        peaks, grads = _siamese(budget, 1, alone=True)
    said = remat.explain().held
    _, want = _siamese(None, 1, alone=True)
    assert all(torch.equal(a, b) for a, b in zip(want, grads))
    assert any("held between two calls' backwards" in k for k in said) == room, said
    if room:
        assert peaks[0] <= 2 * budget, (peaks, budget)


def test_a_chain_opened_while_another_chains_call_is_in_flight_warns_once():
    """An encoder chain, then a decoder chain, one backward: each budget bounds its own
    call and the step holds both (a BART with both stacks wrapped went 1.47 times over
    the budget, from the encoder's opening). The decoder's opening says so, once; two
    chains each run to their backward before the next opens say nothing."""
    import warnings

    torch.manual_seed(0)
    enc, dec = nn.Sequential(*(_Block(16) for _ in range(3))), nn.Sequential(*(_Block(16) for _ in range(3)))
    remat.clear_cache()
    stages = [remat.stage(b) for b in (*enc, *dec)]

    def chain(blocks, x):
        with remat.chain(budget="1MiB"):
            for b in blocks:
                x = b(x)
        return x

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            chain(dec, chain(enc, torch.randn(4, 16))).square().mean().backward()
    said = [str(w.message) for w in seen if "in flight" in str(w.message)]
    assert len(said) == 1 and "the chain of _Block" in said[0] and "sum of their budgets" in said[0], said
    remat.clear_cache()

    def chain_apart(blocks, x):   # (a chain site of its own, not warned of yet)
        with remat.chain(budget="1MiB"):
            for b in blocks:
                x = b(x)
        return x

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            chain_apart(enc, torch.randn(4, 16)).square().mean().backward()
            chain_apart(dec, torch.randn(4, 16)).square().mean().backward()
    assert len(stages) == 6
