"""Unit tests of remat/runtime/recompute.py (a stage's slots) (Note [Replaying a stage] 5): where a
stage module's parameters, buffers and tensor attributes live (``module_slots``),
what is in those places now (``take``), the parameters' flags (``param_flags``),
and finding a stage's in-place state again on later calls (``state_plan``,
``resolve_state``)."""

import gc
import operator

import torch
import torch.nn as nn
from hypothesis import given, strategies as st

from remat.runtime.recompute import NO_SLOTS, module_slots, resolve_state, state_plan, take
from remat.runtime.replay import param_flags

LAYERS = {
    "linear": lambda: nn.Linear(3, 3),
    "linear_nobias": lambda: nn.Linear(3, 3, bias=False),
    "bn": lambda: nn.BatchNorm1d(3),
    "ln": lambda: nn.LayerNorm(3),
    "relu": nn.ReLU,
    "dropout": lambda: nn.Dropout(0.1),
}


def _net():
    """A Linear, a BatchNorm and a plain tensor attribute on the root."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    net.scale = torch.ones(1)
    return net


def test_a_function_has_no_slots():
    """A stage that is no module gets ``NO_SLOTS``, whose take and flags are empty."""
    assert module_slots(lambda x: x) is NO_SLOTS
    assert module_slots(torch.relu) is NO_SLOTS
    slots, n, names = NO_SLOTS
    assert take(slots) == [] and param_flags([], n) == [] and names == ()


def test_module_slots_list_parameters_first_then_buffers_and_tensor_attributes():
    """Parameters come first (``n`` of them), then per module its buffers and its plain
    tensor attributes, each named by its dotted path."""
    net = _net()
    slots, n, names = module_slots(net)
    assert n == 4
    assert names == ("0.weight", "0.bias", "1.weight", "1.bias",
                     "scale", "1.running_mean", "1.running_var", "1.num_batches_tracked")
    assert len(slots) == len(names)
    assert slots[0] == (net[0]._parameters, "weight")
    assert slots[4] == (net.__dict__, "scale")


@given(kinds=st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=6))
def test_take_of_fresh_slots_is_the_module_parameters_then_buffers(kinds):
    """For any stack of layers, ``take`` of its slots is its parameters in
    ``named_parameters`` order (the first ``n``, a parameter registered as None, a
    Linear's missing bias, giving None) and then its buffers, the same objects."""
    torch.manual_seed(0)
    net = nn.Sequential(*[LAYERS[k]() for k in kinds])
    slots, n, names = module_slots(net)
    tensors = take(slots)
    params, buffers = list(net.named_parameters()), list(net.named_buffers())
    present = [(name, t) for name, t in zip(names[:n], tensors[:n]) if t is not None]
    assert [name for name, _ in present] == [name for name, _ in params]
    assert all(t is p for (_, t), (_, p) in zip(present, params))
    assert all(operator.attrgetter(name)(net) is None for name, t in zip(names[:n], tensors[:n]) if t is None)
    assert n - len(present) == kinds.count("linear_nobias")
    assert sorted(names[n:]) == sorted(name for name, _ in buffers)
    by_name = dict(buffers)
    assert all(t is by_name[name] for t, name in zip(tensors[n:], names[n:]))


def test_take_returns_the_tensors_now_in_the_slots():
    """Slots found once give, on a later ``take``, the tensors that replaced the old ones
    (a parameter assigned anew, a buffer loaded with ``assign=True``, a new attribute)."""
    net = _net()
    slots, n, names = module_slots(net)
    before = take(slots)
    net[0].weight = nn.Parameter(torch.zeros(3, 2))
    state = {k: v.clone() for k, v in net[1].state_dict().items()}
    net[1].load_state_dict(state, assign=True)
    net.scale = torch.full((1,), 2.0)
    now = take(slots)
    changed = {names[i] for i in range(len(slots)) if now[i] is not before[i]}
    assert changed == {"0.weight", "scale", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                       "1.num_batches_tracked"}
    assert now[0] is net[0].weight and now[names.index("1.running_mean")] is net[1].running_mean
    assert now[names.index("0.bias")] is before[names.index("0.bias")]


def test_take_gives_none_for_an_empty_or_gone_slot():
    """A parameter set to None or removed from its dict is None in ``take``."""
    net = _net()
    slots, _, names = module_slots(net)
    net[0].bias = None
    del net[1]._buffers["running_var"]
    now = take(slots)
    assert [names[i] for i, t in enumerate(now) if t is None] == ["0.bias", "1.running_var"]


def test_take_reads_a_mapping_that_is_no_dict():
    """Slots in a mapping that is not a ``dict`` (but has ``get``) are read too."""

    class Store:
        def __init__(self, **items):
            self.items = items

        def get(self, name, default=None):
            return self.items.get(name, default)

    a, b = torch.ones(1), torch.zeros(1)
    store = Store(a=a, b=b)
    assert take([(store, "b"), (store, "a"), (store, "c")]) == [b, a, None]


def test_param_flags_change_when_requires_grad_flips():
    """Freezing a parameter changes its flags (and only its), unfreezing gives the old flags back."""
    net = _net()
    slots, n, names = module_slots(net)
    flags = param_flags(take(slots), n)
    assert len(flags) == n
    net[0].weight.requires_grad_(False)
    frozen = param_flags(take(slots), n)
    assert frozen != flags
    assert [i for i in range(n) if frozen[i] != flags[i]] == [names.index("0.weight")]
    assert frozen[0] == (torch.float32, False, torch.Size([3, 2]))
    net[0].weight.requires_grad_(True)
    assert param_flags(take(slots), n) == flags


def test_param_flags_change_when_a_module_is_cast_and_ignore_buffers():
    """Casting the module in place (the same parameter objects) changes every parameter's
    flags; a buffer's dtype is not part of them."""
    net = _net()
    slots, n, _ = module_slots(net)
    flags = param_flags(take(slots), n)
    net.double()
    assert all(t is u for t, u in zip(take(slots)[:n], [p for p in net.parameters()]))
    assert [f[0] for f in param_flags(take(slots), n)] == [torch.float64] * n
    assert [f[1:] for f in param_flags(take(slots), n)] == [f[1:] for f in flags]
    net.float()
    net[1].running_mean.data = net[1].running_mean.data.half()
    assert param_flags(take(slots), n) == flags


def test_param_flags_of_an_empty_slot_is_none():
    """A parameter slot holding None has None as its flags."""
    net = _net()
    slots, n, names = module_slots(net)
    net[0].bias = None
    assert param_flags(take(slots), n)[names.index("0.bias")] is None


def test_state_plan_and_resolve_state_round_trip_a_buffer_and_an_outside_tensor():
    """A module buffer is planned as its slot's index and a tensor outside the module as a
    weak reference; resolving the plan gives both tensors back, in order."""
    net = _net()
    outside = torch.zeros(3)
    tensors = take(module_slots(net)[0])
    plan = state_plan([net[1].running_mean, outside], tensors)
    assert plan[0] == module_slots(net)[2].index("1.running_mean")
    assert callable(plan[1]) and plan[1]() is outside
    got = resolve_state(plan, tensors)
    assert len(got) == 2 and got[0] is net[1].running_mean and got[1] is outside


def test_resolve_state_follows_a_buffer_replaced_in_its_slot():
    """Resolved on a later call's ``take``, the plan gives the buffer now in the slot,
    not the one the plan was made with."""
    net = _net()
    slots = module_slots(net)[0]
    plan = state_plan([net[1].running_var], take(slots))
    old = net[1].running_var
    net[1].load_state_dict({k: v.clone() for k, v in net[1].state_dict().items()}, assign=True)
    (now,) = resolve_state(plan, take(slots))
    assert now is net[1].running_var and now is not old


def test_state_plan_finds_a_buffer_written_through_an_alias():
    """State written through a view made in the call (``buf.view(-1)``) is planned as the
    buffer's slot, listed once even with the buffer itself, and resolves to the buffer."""
    net = _net()
    tensors = take(module_slots(net)[0])
    buf = net[1].running_mean
    plan = state_plan([buf.view(-1), buf[1:], buf], tensors)
    assert plan == [module_slots(net)[2].index("1.running_mean")]
    (got,) = resolve_state(plan, tensors)
    assert got is buf


def test_state_plan_refers_to_the_base_of_an_outside_view():
    """A view of a tensor outside the module is planned as a weak reference to its base."""
    net = _net()
    base = torch.zeros(4, 2)
    plan = state_plan([base[1:].view(-1)], take(module_slots(net)[0]))
    got = resolve_state(plan, [])
    assert len(got) == 1 and got[0] is base


def test_resolve_state_leaves_out_an_outside_tensor_that_is_gone():
    """A tensor outside the module that died since the plan is left out of the state."""
    net = _net()
    tensors = take(module_slots(net)[0])
    outside = torch.zeros(2)
    plan = state_plan([outside, net[1].num_batches_tracked], tensors)
    del outside
    gc.collect()
    got = resolve_state(plan, tensors)
    assert len(got) == 1 and got[0] is net[1].num_batches_tracked


@given(picks=st.lists(st.integers(0, 8), unique=True, max_size=9))
def test_state_plan_round_trips_any_mix_of_buffers_and_outside_tensors(picks):
    """Any list of distinct buffers, tensor attributes and outside tensors resolves to
    those tensors, in order."""
    net = _net()
    slots, n, _ = module_slots(net)
    tensors = take(slots)
    outside = [torch.zeros(2) for _ in range(5)]
    pool = tensors[n:] + outside   # 4 buffers and attributes, then 5 outside tensors
    state = [pool[i] for i in picks]
    got = resolve_state(state_plan(state, tensors), tensors)
    assert len(got) == len(state) and all(a is b for a, b in zip(got, state))
