"""A meter left on the dispatch-mode stack after a chain's block, metering the
code after it until the backward reaches the chain (Note [The chain's tail] 5,
remat/measure/tail.py), and taken off at remat's next entry on that thread;
and the meter of the backward of the code before a chain (``Before``).

A mode pushed inside a backward and popped there is back as the backward
returns (the engine runs the graph under the thread state it began with), so
the meter is not taken off where its metering ends, at ``B(L)``'s start: it
turns itself off there (``off``: every op passes straight through) and is
taken off as the backward call returns (``torch.autograd._engine_run_backward``
wrapped until then), at the next optimizer step (a global step pre-hook), the
next chain's opening, the next exit of one of remat's meters (``measure_peak``'s,
say), a ``remat.Sequential`` called under no_grad or ``remat.clear_cache()``,
outside any backward; ``Sequential.measure``, whose call has no backward,
takes it off as it ends, and so does the going of a call's graph with no
backward (an output dropped unused: ``release``). (Left on the stack, a
mode breaks a ``torch.compile``d step: its backward hits the Python dispatch
key on ops with no tensor argument.)
The modes pushed above it keep their order. Not inside inference mode either,
which puts back as it ends the dispatch keys it found (the mode's with them:
with the mode gone, every op would then hit a Python dispatch key with no
mode to take it). It stays only on a stack of
remat's meters (``alone``): a mode of the caller's entered before the block
and exited after it would pop the meter in its place (torch pops the top
mode) and stay on the stack for good.

Note [The code before the chain]
--------------------------------
The step goes on after the chain's backward: the backward of the code before
the chain (the embedding, a stem) runs beside what the chain's backward
leaves (``held_bytes``, the tail's kept gradients among them, and a^0's
gradient). No plan of the chain changes either, but their sum is part of the
step's peak, and it can be the most of it: the gradient of a head's weight
tied to the embedding, held since the tail's backward, meets the embedding's
own there, and the engine adds the two into a third (a 4-block GPT with a
vocabulary of 8,000 and 36 tokens: 6.1 MB where its plan said 4.1 MB).

A chain's first call meters it (``Before``): hooks on the nodes below the
chain's input, node by node under a meter of their own, and, as a node is
handed a gradient no node metered made (the engine's sum of two), that sum
and its two parts. Nodes made before the previous chain on the thread ended
(``ends``) are another chain's and not metered. As the backward ends, the
peak above the level the chain's backward left is the record's ``before``:
plans then count ``held_bytes`` + a^0's gradient + it as the step's last
need (``ChainRecord.step_end``), in ``predicted_peak`` and in the least
budget (a budget below it fails with ``BudgetError`` from the next call on).
On CUDA it is not metered (docs/limitations.md).
"""

import threading
import warnings

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from ..dynamo import eager_under_meter
from ..units import format_bytes

__all__ = ["LINGERING", "Before", "alone", "downstream", "ends", "linger", "release", "settle"]

LINGERING = []   # (thread id, meter) of the meters left after a chain's block
ends = threading.local()   # ``seq``: the sequence number of the node that made the last chain's output on the thread


def alone():
    """Whether the dispatch-mode stack holds nothing but remat's meters (and no meter
    lingers already): a meter may stay there past the block."""
    return not LINGERING and all(getattr(m, "remat_meter", False) for m in _get_current_dispatch_mode_stack())


_hooked = []   # the optimizer step pre-hook that settles, once registered


def linger(meter):
    """Push ``meter`` (an ``Instrument``) and leave it there past the chain's block."""
    if not _hooked:   # (a training loop's next remat-free point outside the backward: the optimizer's step)
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hooked.append(register_optimizer_step_pre_hook(_settle_before_step))
    _until_backward_returns()
    meter.__enter__()
    meter.eager = eager_under_meter(True)   # (compiled code after the block runs eagerly: remat/dynamo.py)
    LINGERING.append((threading.get_ident(), meter))


def _settle_before_step(*_):
    settle()   # (an optimizer step pre-hook returns None)


def _until_backward_returns():
    """Have the next ``torch.autograd.backward`` or ``grad`` take the meter off as it
    returns, on its thread, outside the engine (torch >= 2.3 calls the engine
    through ``torch.autograd._engine_run_backward``; elsewhere the other points
    take it off)."""
    run = getattr(torch.autograd, "_engine_run_backward", None)
    if run is None or getattr(run, "remat_settles", False):
        return

    def settling(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        finally:
            if torch._C._current_graph_task_id() == -1:   # (not a backward inside a backward)
                if torch.autograd._engine_run_backward is settling:
                    torch.autograd._engine_run_backward = run
                settle()

    settling.remat_settles = True
    torch.autograd._engine_run_backward = settling


def settle(cut=False):
    """Take off the stack the meters this thread left lingering, turned off (not inside
    a backward, whose end would push them back); ``cut``: by a chain opening, which
    cuts short the tail of one still metering (the same chain opened twice in one
    forward: Note [The chain's tail] 6, remat/measure/tail.py)."""
    if not LINGERING or torch._C._current_graph_task_id() != -1 or torch.is_inference_mode_enabled():
        return   # (inference mode puts back, as it ends, the dispatch keys it found: the mode's with them)
    me = threading.get_ident()
    mine = [m for t, m in LINGERING if t == me]
    LINGERING[:] = [(t, m) for t, m in LINGERING if t != me]
    for meter in mine:
        _turn_off(meter, cut)
        _take_off(meter)
    return mine


def downstream(x):
    """Whether ``x`` was made from the output of the last chain that ended on this
    thread (``ends``), by its graph: only nodes made since are walked."""
    seq, todo, seen = getattr(ends, "seq", None), [getattr(x, "grad_fn", None)], set()
    while todo and seq is not None:
        node = todo.pop()
        if node is None or node in seen or node._sequence_nr() < seq:
            continue
        if node._sequence_nr() == seq:
            return True
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return False


def release(meter, gone=None):
    """The graph of the call that left ``meter`` is gone with no backward (an output
    dropped unused): its metering is cut short, as by a chain opening (``gone(meter)``
    called), and it leaves the stack now where that is safe (on its thread, outside a
    backward and inference mode, and on the stack: not popped for the while of a
    mode's own dispatch), else it passes ops straight through until one of the points
    above takes it off."""
    if meter.off:   # (the backward came: its return takes it off)
        return
    _turn_off(meter, True)
    if gone is not None:
        gone(meter)
    entry = (threading.get_ident(), meter)
    if (entry not in LINGERING or torch._C._current_graph_task_id() != -1 or torch.is_inference_mode_enabled()
            or not any(m is meter for m in _get_current_dispatch_mode_stack())):
        return
    LINGERING.remove(entry)
    _take_off(meter)


def _turn_off(meter, cut):
    meter.cut = cut and not meter.off
    if meter.cut and getattr(meter, "seen", None) is not None:   # (a tail's: remat/measure/tail.py)
        meter.seen.cut = True
    meter.off = True


def _take_off(mode):
    """Pop ``mode`` from wherever it is on the stack, the modes above it put back in order."""
    if getattr(mode, "eager", False):
        mode.eager = eager_under_meter(False)
    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return
    above = []
    while True:
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        _push_mode(m)


class Before:
    """The backward of the code before a chain (Note [The code before the chain]): of
    what the chain's input and the side inputs of its stages that need grad (an
    encoder's output into cross-attention stages) were made by, metered into
    ``record.before`` as the backward ends. The hooks hold it while the graph lives:
    a backward that never comes lets it go."""

    NODES = 4096   # (a longer graph below the chain is not metered)

    def __init__(self, record, budget):
        from .meter import Instrument, storage_key   # (meter.py imports this module)
        self.record, self.key, self.budget = record, storage_key, budget
        self.meter, self.most, self.state = Instrument(writes=False), 0, None   # (state: None, "on", "off")
        self.bound = getattr(ends, "seq", -1)   # (not into nodes made by the time the previous chain ended)

    @classmethod
    def reach(cls, before, record, budget, call, x, k):
        """``before`` (of ``record``, or None for a new one), metering also what stage k's
        call ``call`` on ``x`` takes from the code before the chain: its input, the
        chain's, where k is 1, and its side inputs that need grad."""
        from .leaves import grad_side_inputs
        roots = [t for t in ([x] if k == 1 else []) + grad_side_inputs(call, x) if t.grad_fn is not None]
        if roots:
            before = before if before is not None else cls(record, budget)
            before.add([t.grad_fn for t in roots])
        return before

    def add(self, roots):
        """Meter the nodes below ``roots`` not metered yet (the gradients handed to the roots,
        a^0's or a side input's, are in the level). A node is marked in its ``metadata``:
        a set of nodes would keep them, and a parameter's AccumulateGrad hooked, past the step."""
        todo, nodes, tops = list(roots), [], set(roots)
        while todo:
            node = todo.pop()
            if node is None or node._sequence_nr() <= self.bound or node.metadata.get("remat.before") is self:
                continue
            node.metadata["remat.before"] = self
            nodes.append(node)
            if len(nodes) > self.NODES:
                return
            todo.extend(n for n, _ in node.next_functions)
        for node in nodes:
            node.register_prehook(lambda grads, top=node in tops: self.enter(grads, top))
            node.register_hook(self.leave)

    def enter(self, grads, top):
        if self.state == "off":
            return
        if self.state is None:
            self.state = "on"
            torch.autograd.Variable._execution_engine.queue_callback(self.end)
        meter = self.meter
        for g in grads if not top else ():   # (a^0's gradient, at the top, is in the level)
            try:
                if isinstance(g, torch.Tensor) and self.key(g) not in meter.created:
                    n = g.untyped_storage().nbytes()
                    self.most = max(self.most, meter.live + 2 * n)   # (the engine's sum, made beside its parts)
                    meter.count(g)
            except (NotImplementedError, RuntimeError):   # (no storage: a sparse gradient, a batched one)
                continue
        meter.__enter__()

    def leave(self, _grad_inputs, _grad_outputs):
        if self.state != "on":
            return
        self.meter.__exit__(None, None, None)
        self.most = max(self.most, self.meter.peak)

    def end(self):
        """The backward is over: the record learns what the code before the chain needed."""
        if self.state != "on":
            return
        self.state, record = "off", self.record
        if record.before is None or self.most > record.before:
            record.before, record.plans = self.most, {}
        end = record.step_end(record.planning_costs()) if record.costs is not None else 0
        if end > self.budget:
            warnings.warn(
                f"remat: after the chain's backward, the backward of the code before the chain (an embedding "
                f"whose weight the head shares, say) needed {format_bytes(record.before)} beside what the chain "
                f"left held: this step's minimum is {format_bytes(end)} ({end} bytes), above the budget of "
                f"{format_bytes(self.budget)}, under any plan. This first call went over it; the next raises "
                f"BudgetError: raise the budget", RuntimeWarning)

