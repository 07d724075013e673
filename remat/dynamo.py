"""How remat meets Dynamo (``torch.compile``): what it keeps Dynamo away from,
and when. Nothing here imports Dynamo: it is loaded only by a program that
compiles (importing it takes a second), so each measure applies once
``torch._dynamo`` is in ``sys.modules``. Note [Compiling around a stage] in
remat/stage.py covers ``torch.compile(remat.stage(block))``.

Note [Compiled code in a stage]
-------------------------------
A stage may be or call code compiled with torch.compile (remat.stage(
torch.compile(block)), a compiled function inside a stage). Inside a chain
remat runs every stage with Dynamo's stance ``force_eager`` (``StageCall.invoke``
in remat/runtime/stage_call.py): compiled code runs eagerly, unseen by Dynamo. Run
otherwise, Dynamo met the compiled frame first under the measuring call's
storage meter, a dispatch mode it does not support, and gave up on that
frame's code for good: the block, and every block of its class, was never
compiled again in the process, in a chain or out (torch 2.13;
``torch.compiler.disable`` does not stop a compiled function). Nor could a
stage run eagerly while measured and compiled later: compiled, it saves other
tensors than eager code (the determinism guard compares them with the
measured ones), and the costs would be another code's. Outside chains compiled
blocks run compiled. Each stage call pays the stance (some microseconds) only
once Dynamo is loaded; torch 2.5 has no stances and keeps the old behaviour.

Note [Compiling a model around a chain]
---------------------------------------
torch.compile of a model whose forward opens a chain: Dynamo breaks its graph
at the chain and runs the rest frame by frame, and compiling the frame of a
stage method's binding (``_StageFunction.__get__``, remat/stage.py) recursed
without end (RecursionError, torch 2.13). So did the checks a chain makes as
it ends (remat/runtime/runner.py, ``watch_caller``), another way: traced, the weak
references they read came back as their referents. Functions in
``DYNAMO_SKIPS`` are marked for Dynamo to skip when a chain first opens with
Dynamo loaded (``remat.chain``).
"""


import os
import sys

import torch

__all__ = ["STANCES", "DYNAMO_SKIPS", "eager_under_meter", "enter_eager", "exit_eager", "in_compiled_frame",
           "in_dynamo_callback"]

STANCES = hasattr(torch.compiler, "set_stance")   # (torch >= 2.6)
DYNAMO_SKIPS = []


# Dynamo's frame callback, read by a C function (no Python frame on a stage's every call)
eval_frame_callback = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                              "get_eval_frame_callback", None)


def in_dynamo_callback():
    """True while Dynamo's frame callback is set: code here runs inside a torch.compile
    region (a compiled model run under a TorchDispatchMode keeps it set around the
    frames it skips, remat's among them), where ``set_stance`` is refused."""
    return eval_frame_callback is not None and eval_frame_callback() not in (None, False)


def in_compiled_frame():
    """True while a frame Dynamo compiles or runs is on the stack (a compiled model
    whose graph broke at a chain, a compiled stage module handing its call to
    the chain): what follows may run compiled. Seen by Dynamo's frame callback,
    or, in the frames it skips (remat's), by its wrapper or a resumed frame on
    the stack."""
    if "torch._dynamo" not in sys.modules:
        return False
    if in_dynamo_callback():
        return True
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_EVAL_FRAME) or code.co_name.startswith("torch_dynamo_resume_in_"):
            return True
        frame = frame.f_back
    return False


_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")


_held = []   # (the stance before, meters on) while remat's meters over the caller's code are on the stack


def enter_eager(meter):
    """Push ``meter``, a storage meter of remat's over the caller's code (a measuring call's
    window between stages, the head and loss inside the block among them: remat/measure/tail.py),
    compiled code running eagerly while it is on (``eager_under_meter``)."""
    meter.__enter__()
    meter.eager = eager_under_meter(True)


def exit_eager(meter):
    """Pop ``meter``, pushed by ``enter_eager``."""
    meter.__exit__(None, None, None)
    if getattr(meter, "eager", False):
        meter.eager = eager_under_meter(False)


def eager_under_meter(on):
    """A meter of remat's goes on (``on``) or off the dispatch-mode stack over the caller's
    code: the tail's after a chain's block (remat/measure/linger.py), a measuring call's
    windows inside it (``enter_eager``), ``remat.measure_peak``'s on CPU. While one is on,
    compiled code runs eagerly (Dynamo's stance ``force_eager``): Dynamo met a compiled
    loss there under the meter, a dispatch mode it does not support, and gave up on its
    code for good, in the process, in a chain or out (and on every compiled ``nn.Linear``
    with a compiled head). Returns whether it counted this meter."""
    if on:
        if not STANCES or "torch._dynamo" not in sys.modules or in_dynamo_callback():
            return False
        from torch._dynamo import eval_frame

        if not _held:
            _held[:] = [eval_frame._stance, 0]
            torch.compiler.set_stance("force_eager")
        _held[1] += 1
        return True
    if _held:
        _held[1] -= 1
        if _held[1] == 0:   # (set back as it was, in a torch.compile region too, where set_stance refuses)
            from torch._dynamo import eval_frame

            eval_frame._stance = _held.pop(0)
            _held.clear()
    return False

