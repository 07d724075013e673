"""What ``remat.stage``, ``remat.wrap`` and ``remat.Sequential`` accept as stages,
and what they refuse or warn of: a class, TorchScript code, containers that are
never called, chains that run no stage. Stages of unusual kinds (a static method,
a builtin) give plain PyTorch's gradients, bit for bit."""

import warnings

import pytest
import torch
import torch.nn as nn

import remat


def _grads_equal(fn, budget="1MiB"):
    """Gradients of ``fn`` as two stages after a Linear, in a chain at ``budget``
    (measuring, then running the schedule) against plain PyTorch."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    staged = remat.stage(nn.Linear(8, 8))
    staged.load_state_dict(lin.state_dict())
    x = torch.randn(4, 8)
    for _ in range(2):
        a = x.clone().requires_grad_()
        fn(fn(lin(a))).sum().backward()
        b = x.clone().requires_grad_()
        with remat.chain(budget=budget):
            y = fn(fn(staged(b)))
        y.sum().backward()
        assert remat.explain().schedule.stages == 3
        assert torch.equal(a.grad, b.grad)
        assert torch.equal(lin.weight.grad, staged.weight.grad)


def test_static_method_stage():
    class Ops:
        @remat.stage
        @staticmethod
        def act(x):
            return torch.tanh(x) * 2

    assert isinstance(Ops.__dict__["act"], staticmethod)
    _grads_equal(Ops.act)
    _grads_equal(Ops().act)


def test_class_method_stage():
    class Ops:
        scale = 2.0

        @remat.stage
        @classmethod
        def act(cls, x):
            return torch.tanh(x) * cls.scale

    assert isinstance(Ops.__dict__["act"], classmethod)
    _grads_equal(Ops.act)
    _grads_equal(Ops().act)


def test_builtin_stage():
    """A builtin cannot be weakly referenced (a chain's record keys its stages so):
    remat.stage wraps it in a function."""
    _grads_equal(remat.stage(torch.Tensor.exp))
    _grads_equal(remat.stage(torch.tanh))


def test_class_is_refused():
    with pytest.raises(TypeError, match=r"not the class Block: decorate its forward .*remat.stage\(Block\(...\)\)"):
        @remat.stage
        class Block(nn.Module):
            def forward(self, x):
                return x


@pytest.mark.parametrize("how", ["script", "trace"])
def test_torchscript_is_refused(how):
    lin = nn.Linear(8, 8)
    code = torch.jit.script(lin) if how == "script" else torch.jit.trace(lin, torch.randn(2, 8))
    with pytest.raises(TypeError, match="cannot mark TorchScript code .*Mark the eager module"):
        remat.stage(code)
    if how == "script":
        with pytest.raises(TypeError, match="cannot mark TorchScript code .ScriptFunction"):
            remat.stage(torch.jit.script(_double))


def _double(x):
    return x * 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def test_wrap_refuses_a_container_block_and_no_iterable():
    net = _Net()
    with pytest.raises(TypeError, match=r"block 0 is a ModuleList, a container that is never called.*not \[model.layers\]"):
        remat.wrap(net, [net.layers], budget="1MiB")
    with pytest.raises(TypeError, match="needs an iterable of blocks, e.g. model.layers, got NoneType"):
        remat.wrap(net, None, budget="1MiB")
    assert "forward" not in net.__dict__ and "forward" not in net.layers[0].__dict__
    remat.wrap(net, net.layers, budget="1MiB")
    net(torch.randn(4, 8)).backward()
    assert remat.explain().schedule.stages == 3


def test_wrap_with_blocks_the_forward_never_calls_warns():
    net = _Net()
    remat.wrap(net, [net.head], budget=10)
    net.forward.original = lambda x: net.layers[0](x).sum()   # (a forward that skips the head)
    with pytest.warns(RuntimeWarning, match=r"ran no stage.*remat.wrap: the forward of this _Net called none of "
                                            r"the 1 blocks given"):
        net(torch.randn(4, 8)).backward()


def test_chain_that_runs_no_stage_warns_once():
    lin = nn.Linear(8, 8)   # not marked
    x = torch.randn(4, 8, requires_grad=True)

    def step():
        with remat.chain(budget="1MiB"):
            return lin(x)

    with pytest.warns(RuntimeWarning, match=r"the chain at .*test_stage_marking.py:\d+ ran no stage.*mark the blocks "
                                            r"with remat.stage"):
        step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step()                       # once per site
        with torch.no_grad():        # a chain under no_grad runs its stages plainly: nothing to say
            with remat.chain(budget="1MiB"):
                remat.stage(lin)(x)


def test_empty_sequential_measures_nothing():
    """With no stage (every layer in place), a Sequential has nothing to measure: it
    must not hand back the costs of whichever chain ran last."""
    other = remat.Sequential(*[nn.Linear(16, 16) for _ in range(3)], budget="1MiB")
    other(torch.randn(2, 16, requires_grad=True)).sum().backward()
    seq = remat.Sequential(nn.ReLU(inplace=True), budget="1MiB")
    with pytest.raises(remat.RematError, match="no stage to measure: it is empty or all its layers work in place"), \
            pytest.warns(RuntimeWarning, match="ran no stage.*this remat.Sequential has no stage"):
        seq.measure(torch.randn(2, 16))
    with pytest.raises(remat.RematError, match="has measured nothing yet"):
        seq.solve()


def test_forward_taken_from_a_marked_module_that_is_gone_says_so():
    """A marked module's instance forward holds the module weakly (so that the chain's cached
    record, which holds the module's __dict__, does not keep it alive): called
    after the module is gone, it says so instead of failing somewhere inside."""
    import gc

    forward = remat.stage(torch.nn.Linear(4, 4)).forward
    gc.collect()
    with pytest.raises(remat.StageError, match="the module whose forward this was is gone"):
        forward(torch.randn(2, 4))
