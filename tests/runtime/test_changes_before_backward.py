"""What changes between a chain's forward and its backward (remat/runtime/replay.py Note
[Replaying a stage] 5): a parameter, a side input or the chain's input changed
in place, or a stage frozen or unfrozen, is a clear error that names it and
leaves the next call exact; an optimizer stepping each parameter inside the
backward steps it once, and BatchNorm's version counters show none of the
writes a recomputation puts back. Each against plain PyTorch, bit for bit."""

import pytest
import torch
from torch.func import functional_call

import remat
from blocks import assert_grads_equal, grads_of, pos_pair


def _loss(model, x, pos=None):
    torch.manual_seed(7)
    return model(x, pos).square().mean()


def _next_call_exact(ref, net):
    x = torch.randn(4, 8, 16)
    for model in (ref, net):
        model.zero_grad(set_to_none=True)
        _loss(model, x).backward()
    assert_grads_equal(grads_of(ref), grads_of(net))


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_parameter_changed_in_place_before_the_backward_is_an_error(which):
    """A parameter changed in place between the forward and the backward: plain
    PyTorch raises where autograd saved it (a weight) and gives the forward's
    gradients where it did not (a bias); remat, which recomputes from the
    parameter, cannot give those and says so, naming it. The next call is exact."""
    ref, net = pos_pair()
    for _ in range(2):   # measuring, then running the schedule
        loss = _loss(net, torch.randn(4, 8, 16))
        with torch.no_grad():
            getattr(net.blocks[1].l1, which).add_(0.01)
        with pytest.raises(remat.StageError, match=rf"parameter 'l1\.{which}' of stage 2 .*modified in place"):
            loss.backward()
        with torch.no_grad():
            getattr(ref.blocks[1].l1, which).add_(0.01)
    _next_call_exact(ref, net)


def test_error_for_a_parameter_changed_in_place_leaves_the_slots_alone():
    """The recomputation that finds ``l2.weight`` changed in place had already put the
    forward's ``l1.weight`` (a ``functional_call`` tensor) in its slot: the error must
    leave the module's own there."""
    ref, net = pos_pair()
    block = net.blocks[1]
    own = block.l1.weight
    for _ in range(2):   # measuring, then running the schedule
        fast = {"blocks.1.l1.weight": (own * 1.5).detach().requires_grad_()}
        torch.manual_seed(7)
        loss = functional_call(net, fast, (torch.randn(4, 8, 16),)).square().mean()
        with torch.no_grad():
            block.l2.weight.add_(0.01)
        with pytest.raises(remat.StageError, match=r"parameter 'l2\.weight' of stage 2 .*modified in place"):
            loss.backward()
        assert block.l1.weight is own
        with torch.no_grad():
            ref.blocks[1].l2.weight.add_(0.01)
    _next_call_exact(ref, net)


def test_side_input_changed_in_place_before_the_backward_is_an_error():
    ref, net = pos_pair()
    pos = torch.randn(8, 16)
    loss = _loss(net, torch.randn(4, 8, 16), pos)   # measuring: keeps every stage input
    loss.backward()
    loss = _loss(net, torch.randn(4, 8, 16), pos)
    pos.add_(1)
    with pytest.raises(remat.StageError, match="side input of stage .* modified in place"):
        loss.backward()
    _next_call_exact(ref, net)


def test_chain_input_changed_in_place_before_the_backward_is_an_error():
    ref, net = pos_pair()
    _loss(net, torch.randn(4, 8, 16)).backward()
    x = torch.randn(4, 8, 16)
    loss = _loss(net, x)
    assert remat.explain().schedule.ops[0] == remat.Fck(1)
    x.mul_(2)
    with pytest.raises(remat.StageError, match="the chain's input was modified in place"):
        loss.backward()
    _next_call_exact(ref, net)


def test_recomputation_leaves_batchnorm_version_counters_alone():
    """BatchNorm's backward saves its running statistics, and autograd checks their
    version counters: the writes remat puts back after a recomputation must not show
    (a Fall stage of the same module would fail its backward otherwise)."""
    ref, net = pos_pair(bn=True)
    for step in range(3):
        x = torch.randn(4, 8, 16)
        for model in (ref, net):
            model.zero_grad()
            torch.manual_seed(step)
            model(x).square().mean().backward()
        assert_grads_equal(grads_of(ref), grads_of(net))
        for a, b in zip(ref.buffers(), net.buffers()):
            assert torch.equal(a, b) and a._version == b._version


def test_optimizer_step_in_backward_runs_once_per_parameter():
    """PyTorch's recipe for fusing the optimizer step into the backward (a
    post-accumulate-grad hook per parameter): the measuring call's own stage
    backwards are measurements and must not step; parameters stay plain's."""
    ref, net = pos_pair()
    counts = {}
    for tag, model in (("ref", ref), ("net", net)):
        opts = {p: torch.optim.Adam([p], lr=1e-2) for p in model.parameters()}

        def hook(p, opts=opts, tag=tag):
            opts[p].step()
            opts[p].zero_grad()
            counts[tag] = counts.get(tag, 0) + 1

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
    for step in range(3):
        x = torch.randn(4, 8, 16)
        for model in (ref, net):
            _loss(model, x).backward()
        assert counts["ref"] == counts["net"]
        for (name, a), b in zip(ref.named_parameters(), net.parameters()):
            assert torch.equal(a, b), name


def test_freezing_between_the_forward_and_the_backward_is_named():
    ref, net = pos_pair()
    loss = _loss(net, torch.randn(4, 8, 16))
    loss.backward()                       # (the measuring call)
    loss = _loss(net, torch.randn(4, 8, 16))
    net.blocks[1].requires_grad_(False)
    with pytest.raises(remat.StageError, match=r"stage 2 .* frozen or unfrozen .*between the forward and the backward"):
        loss.backward()
    net.blocks[1].requires_grad_(True)
    _next_call_exact(ref, net)
