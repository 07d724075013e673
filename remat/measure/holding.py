"""What a chain's measuring call holds, within the budget: the stage inputs, the
saved tensors it keeps, and a check that each stage fits (the ``Holding`` of a
``Measurer``, remat/measure/measuring.py).

Note [Measuring within the budget]
----------------------------------
The measuring call's own peak counts: it is a training step (docs/how-it-works.md,
"The tail"). It holds stage inputs (a checkpoint each), runs a stage's forward
and its backward on that graph, and lets the stage's saved tensors go as
soon as the stage is measured (before its forward without recording),
unless it can keep them: they save the
backward a recomputation, but what comes after the last stage, the chain's
tail, is not known yet, and in a model whose head dwarfs a block (a language
model's logits) saved tensors kept up to the budget put the step at about
twice it. So stages keep them only where a record of this chain (at
another shape, scaled, or the path it left) stores everything within the
budget (``keep_all``, ``keep_saved``); else the backward rebuilds every stage
from its input, the last one too: one more forward, once. A stage whose own forward and backward cannot fit the budget
(the least any schedule needs, ``fits``) stops the call with a
``BudgetError`` naming it, the call undone, before the stages after it run.
The stage inputs held must fit too, beside the saved tensors kept, room to
measure a stage like the largest so far, an input more (a rebuild's) and
the tail where known: past that only every ``spacing``-th stage's is held,
the spacing doubling as often as needed (``thin_inputs``), and the backward
rebuilds a stage from the nearest input held below it. At a chain's minimum
that is up to every stage before it, once per stage (quadratic in the
chain's length, once), and the first call comes out near the budget, not
under it for sure: measuring a stage holds its whole graph while its
backward runs (retain_graph, for the real backward), which a training
step's backward lets go as it goes, and the tail of a chain not seen before
is not known while the stages run.
"""

import weakref

from ..errors import BudgetError
from ..units import format_bytes

__all__ = ["Holding"]


class Holding:
    """What a measuring call holds (Note [Measuring within the budget]).

    Args:
        budget: the call's budget in bytes.
        hint: (bytes the chain's tail needed, whether storing everything fits the
            budget) as a record of the chain showed them (``ChainRecord.hint``);
            (None, False) where none has.
        diverged: the stage the call left its recorded path at (0: a first call);
            the stages before it are the schedule's.
    """

    def __init__(self, budget, hint, diverged):
        self.budget, self.diverged = budget, diverged
        self.tail_hint, self.keep_all = hint
        self.held_bytes = 0      # bytes of the saved tensors kept so far
        self.inputs = []         # (stage, weak reference to its anchor, bytes) of the stage inputs held
        self.inputs_bytes = 0
        self.spacing = 1         # the stages whose input is held: every spacing-th (``thin_inputs``)
        self.largest = 0         # the most measuring a stage needed beyond its input so far

    def keep_saved(self, i, costs, given):
        """Whether measured stage i (its ``costs`` as measured, None if they come
        from a file) keeps its saved tensors for this call's backward (Note
        [Measuring within the budget]).

        Yes where a record of the chain (at another shape, scaled; or the path
        this call left) stores everything within the budget (``keep_all``), so
        that such a budget makes the first backward rebuild nothing. A stage run
        by a schedule before the chain diverged is left to it.
        """
        if i < self.diverged:
            return False
        saved = costs.saved_bytes if costs is not None else None
        if saved is None and given is not None and i <= given.length:
            saved = given.saved_bytes[i - 1]
        if saved is None or not self.keep_all:
            return False
        self.held_bytes += saved
        return True

    def thin_inputs(self, k, anchor, x, input_bytes):
        """Hold stage k's input (its anchor's) while the inputs held fit the budget
        beside the saved tensors kept, room to measure a stage like the largest so
        far and the tail, as far as it is known; past that, hold only every
        ``spacing``-th stage's, the spacing doubling as often as needed (the
        backward rebuilds a stage from the nearest input held below it: Note
        [Measuring within the budget])."""
        if k < 2 or k < self.diverged or anchor.input is None:
            return   # (the chain's input is the caller's; a stage run by a schedule, the schedule's)
        nbytes = x.untyped_storage().nbytes()
        if (k - 1) % self.spacing:   # (off the spacing: let go at once)
            anchor.input = None
            return
        self.inputs.append((k, weakref.ref(anchor), nbytes))
        self.inputs_bytes += nbytes
        # (and an input more: a rebuild from a held input below a stage runs the stages between
        # without recording, each output made while the one before it is alive)
        room = self.budget - input_bytes - self.held_bytes - self.largest - nbytes - (self.tail_hint or 0)
        while self.inputs_bytes > room and self.inputs:
            self.spacing *= 2
            kept = []
            for i, ref, n in self.inputs:
                a = ref()
                if a is None or a.input is None:
                    continue
                if (i - 1) % self.spacing:
                    a.input = None
                    self.inputs_bytes -= n
                else:
                    kept.append((i, ref, n))
            self.inputs = kept

    def fits(self, call, x, costs, input_bytes):
        """Raise ``BudgetError`` if the budget cannot hold stage ``call`` alone: its
        input, its forward and its backward (Note [Measuring within the budget]);
        note the most a stage's measuring needed so far (``largest``)."""
        if costs is None or None in (costs.out_bytes, costs.saved_bytes, costs.fwd_tmp, costs.bwd_tmp):
            return   # (costs from a file: what a stage needs is the file's)
        x_in, out, saved = x.untyped_storage().nbytes(), costs.out_bytes, costs.saved_bytes
        # its forward holds its input; its backward makes its input's gradient, and a
        # schedule may have let the input go by then (Costs.fwd_drop)
        least = max(x_in + max(saved, out + costs.fwd_tmp), saved + out + x_in + costs.bwd_tmp)
        self.largest = max(self.largest, least - x_in)
        if least > self.budget:
            raise BudgetError(
                f"remat: budget {format_bytes(self.budget)} is below this chain's minimum of "
                f"{format_bytes(least)} or more ({least} bytes): stage {call.index} ({call.name}) alone needs "
                f"that, its forward with its input and its backward, and no schedule needs less "
                f"(the stages after it were not measured, which may need more); raise the budget or split "
                f"the stage", least)
