"""The chain's tail: what runs after its last stage until the backward reaches
it (the model's head and the loss), as the measuring call sees it
(docs/how-it-works.md, "The tail").

Note [The chain's tail]
-----------------------
The budget is the whole step's peak, and after the chain's last stage come
the model's head and the loss (inside the chain's block under ``remat.wrap``,
whose block is the model's forward), then their backward, before the
engine reaches the chain again; the code after the block may keep some of
what they made (the logits in a model output) to the end of the step. The
solver sees them as a last stage that runs once (``Costs.with_tail``): its
peak above the level the chain ended at, and what the caller keeps of it
through the backward (held_bytes). So a plan can checkpoint the chain's last
stage when the head is large, and per-block checkpointing is a plan.

The measuring call meters the tail (``TailMeter``):

1. After each stage returns, a storage meter (``Instrument``, not noting
   writes) runs until the next stage is called or the block ends: the last
   of these windows is the tail's forward inside the block, its peak and
   the storages alive as the block ends.
2. Its backward runs in the engine before any of remat's hooks: it is taken
   to start from what was alive as the block ended and to add a gradient of
   the largest of those storages (a loss's gradient of the logits, made
   while the logits and what the loss saved are alive).
3. As ``B(L)`` starts (a pre-hook on the node that made a^L), the storages
   the tail made that are still alive are what the code after the block
   keeps through the backward (``kept``). Until a backward has shown it, all
   that was alive as the block ended counts as kept.

Code after the block is not metered (nothing of remat runs there), nor is a
window opened where Dynamo runs the frame (what follows may run compiled).
Modes the caller entered before stay under the meter, and see what it lets
through. One of them left inside a window pops the meter instead (torch pops
the top mode), and the meter's exit pops that one: the stack ends as it
began, and the meter missed the rest of the window. What the tail measured,
and what was not seen, ``remat.explain().tail`` says.
"""

import dataclasses

import torch

from ..dynamo import in_compiled_frame
from .meter import Instrument

__all__ = ["TailMeter", "TailSeen"]


@dataclasses.dataclass
class TailSeen:
    """What a measuring call saw of the chain's tail (Note [The chain's tail]).

    Attributes:
        metered: whether the tail inside the block was metered (else ``why``).
        peak: bytes its forward inside the block reached above the chain's end.
        alive: bytes of what it made that were alive as the block ended.
        largest: the largest of those storages.
        kept: bytes of them still alive as the chain's backward began (None
            before a backward has shown it).
        seconds: time inside its ops.
        why: why it was not metered ("" if it was).
    """

    metered: bool = False
    peak: int = 0
    alive: int = 0
    largest: int = 0
    kept: int = None
    seconds: float = 0.0
    why: str = ""

    def costs(self):
        """The tail as ``Costs.with_tail``'s arguments: its forward's peak or the
        level its backward starts from with a gradient of its largest tensor,
        less what the caller keeps, which held_bytes counts."""
        peak = max(self.peak, self.alive + self.largest)
        kept = self.alive if self.kept is None else self.kept
        return {"fwd_time": self.seconds, "bwd_time": 2 * self.seconds, "out_bytes": 0, "saved_bytes": 0,
                "fwd_tmp": max(0, peak - kept), "bwd_tmp": 0, "kept": kept}

    def __str__(self):
        if not self.metered:
            return f"tail not metered: {self.why}"
        kept = "not yet seen" if self.kept is None else _mib(self.kept)
        return (f"tail (after the last stage, inside the chain's block): peak {_mib(self.peak)} above the chain's "
                f"end, {_mib(self.alive)} alive as the block ended (largest {_mib(self.largest)}), "
                f"kept through the backward {kept}")


def _mib(n):
    return f"{n / 2**20:.2f} MiB"


class TailMeter:
    """The windows between a measuring call's stages, and the last one, its tail
    (Note [The chain's tail])."""

    def __init__(self):
        self.meter = None
        self.why = "the chain's block ended at its last stage"

    def open(self, compiled=False):
        """A stage returned: meter what runs until the next stage or the block's end
        (not where the chain opened in a frame Dynamo runs: ``compiled``)."""
        self.close()
        if compiled or in_compiled_frame():
            self.why = "the code after the last stage runs in a frame torch.compile compiled"
            return
        self.meter = Instrument(writes=False)
        self.meter.__enter__()

    def close(self):
        """The window ends (the next stage is called, or the block ended with an
        error); what it metered is let go."""
        meter, self.meter = self.meter, None
        if meter is not None:
            meter.__exit__(None, None, None)

    def seen(self, act, on_kept):
        """The block ended after the last stage returned ``act`` (a^L): what the last
        window saw (``TailSeen``); ``on_kept(seen)`` is called as ``B(L)`` starts,
        with ``seen.kept`` then set (Note [The chain's tail] 3)."""
        meter, self.meter = self.meter, None
        if meter is None:
            return TailSeen(why=self.why)
        meter.__exit__(None, None, None)
        sizes = list(meter.created.values())
        seen = TailSeen(True, meter.peak, meter.live, max(sizes, default=0), None, meter.op_seconds)
        node = act.grad_fn if isinstance(act, torch.Tensor) else None
        if node is None or not meter.live:
            seen.kept = meter.live
            return seen
        done = [False]

        def begin(_grads):
            # (the hook holds the meter, whose weak references count the tail's storages
            # as they go, while the graph lives: a backward that never comes lets it go)
            if not done[0]:
                done[0] = True
                seen.kept = meter.live
                on_kept(seen)

        node.register_prehook(begin)
        return seen
