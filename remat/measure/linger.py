"""A meter left on the dispatch-mode stack after a chain's block, metering the
code after it until the backward reaches the chain (Note [The chain's tail] 5,
remat/measure/tail.py), and taken off at remat's next entry on that thread.

A mode pushed inside a backward and popped there is back as the backward
returns (the engine runs the graph under the thread state it began with), so
the meter is not taken off where its metering ends, at ``B(L)``'s start: it
turns itself off there (``off``: every op passes straight through) and is
taken off as the backward call returns (``torch.autograd._engine_run_backward``
wrapped until then), at the next optimizer step (a global step pre-hook), the
next chain's opening, the next exit of one of remat's meters (``measure_peak``'s,
say) or ``remat.clear_cache()``, outside any backward. (Left on the stack, a
mode breaks a ``torch.compile``d step: its backward hits the Python dispatch
key on ops with no tensor argument.)
The modes pushed above it keep their order. Not inside inference mode either,
which puts back as it ends the dispatch keys it found (the mode's with them:
with the mode gone, every op would then hit a Python dispatch key with no
mode to take it). It stays only on a stack of
remat's meters (``alone``): a mode of the caller's entered before the block
and exited after it would pop the meter in its place (torch pops the top
mode) and stay on the stack for good.
"""

import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

__all__ = ["LINGERING", "alone", "linger", "settle"]

LINGERING = []   # (thread id, meter) of the meters left after a chain's block


def alone():
    """Whether the dispatch-mode stack holds nothing but remat's meters (and no meter
    lingers already): a meter may stay there past the block."""
    return not LINGERING and all(getattr(m, "remat_meter", False) for m in _get_current_dispatch_mode_stack())


_hooked = []   # the optimizer step pre-hook that settles, once registered


def linger(meter):
    """Push ``meter`` (an ``Instrument``) and leave it there past the chain's block."""
    if not _hooked:   # (a training loop's next remat-free point outside the backward: the optimizer's step)
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hooked.append(register_optimizer_step_pre_hook(lambda *_: settle()))
    _until_backward_returns()
    meter.__enter__()
    LINGERING.append((threading.get_ident(), meter))


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


def settle():
    """Take off the stack the meters this thread left lingering, turned off (not inside
    a backward, whose end would push them back)."""
    if not LINGERING or torch._C._current_graph_task_id() != -1 or torch.is_inference_mode_enabled():
        return   # (inference mode puts back, as it ends, the dispatch keys it found: the mode's with them)
    me = threading.get_ident()
    mine = [m for t, m in LINGERING if t == me]
    LINGERING[:] = [(t, m) for t, m in LINGERING if t != me]
    for meter in mine:
        meter.off = True
        _take_off(meter)


def _take_off(mode):
    """Pop ``mode`` from wherever it is on the stack, the modes above it put back in order."""
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
