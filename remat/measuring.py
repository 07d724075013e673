"""A chain's measuring call, stage by stage (Note [Measuring a stage] in
remat/profile.py): the forward that counts, metered and backwarded
(``instrumented_run``), the forward without recording that Fn and Fck cost, run
4 for a stage whose gradient arrives in another layout, and which stages keep
their saved tensors for the call's own backward. ``_Active`` (remat/chain.py)
takes these methods; the checks on what a stage returns live here too, as the
measuring runs them on every forward it makes.
"""

import weakref

import torch
from torch.utils._pytree import tree_leaves

from .errors import StageError
from .leaves import GradPool, Upstream, stage_leaves
from .meter import Instrument, storage_key
from .profile import Timer, backward_again, instrumented_run, timed_step
from .replay import capture_rng, cuda_devices, restore_tensors
from .runtime import _Replay, _Saved, first

__all__ = ["StageMeasuring", "check_output", "input_signature"]


class StageMeasuring:
    """The measuring half of ``_Active``: its state is set up by ``_Active``."""

    def _measure_stage(self, call, ident, x):
        run, new, k = self.run, self.new, call.index
        cuda = x.is_cuda
        devices = cuda_devices([x] + [a for a in call.args if isinstance(a, torch.Tensor)])
        rng0 = capture_rng(devices)
        # the previous stage kept its saved tensors in case it was the last one:
        # it is not, so they go before this stage is measured (DESIGN.md section 2),
        # unless they fit the budget, which spares rebuilding it in the backward
        prev_anchor = run._anchor(k - 1) if k > 1 else None
        if prev_anchor is not None and not self._keep_saved(k - 1):
            prev_anchor.saved = None
        self._measure_backward_again()
        # the forward that counts: checkpoint the input, keep the saved tensors
        # until the next stage starts so the last stage needs no recomputation
        anchor, _, count = run.new_anchor(call, True, x)
        kept = []
        anchor.saved = kept

        def pack(t):
            i = len(kept)
            kept.append(t.detach())
            return _Saved(anchor, i)

        if self.upstream is None:
            self.upstream = Upstream()
        self.upstream.add(tree_leaves((x, call.args, call.kwargs)))
        if self.given is None:
            if self.grad_pool is None:
                self.grad_pool = GradPool()
            out, row, originals, uses_rng = instrumented_run(call, ident, x, cuda, rng0, check_output, run.hooks(pack),
                                                             kept, self.grad_pool, self.upstream, anchor)
        else:
            # costs come from a file: learn only what replay needs, from this forward
            detector = Instrument(exclude=[x])
            buffers = [(b, b.detach().clone()) for b in ident.buffers()] if isinstance(ident, torch.nn.Module) else []
            with detector, run.hooks(pack):
                out = call.invoke(x)
            detector.note_changed(buffers)
            originals = list(detector.mutated.values())
            uses_rng = rng0.changed()
            act = out[0] if isinstance(out, tuple) else out
            row = {"out_bytes": act.untyped_storage().nbytes()} if isinstance(act, torch.Tensor) else None
            if row is not None and act.requires_grad:
                stop = {a.grad_fn for a in (x, *call.args) if isinstance(a, torch.Tensor) and a.grad_fn is not None}
                row["held_grads"] = self.upstream.held_grads(p for p in stage_leaves(act, stop) if p is not x)
        held = row.pop("held_grads", {}) if row is not None else {}
        if self.given is None and row is not None:
            # a recomputation holds a copy of the state the stage writes in place
            # (remat/replay.py, restore_tensors) on top of what its forward holds
            row["fwd_tmp"] += sum(t.numel() * t.element_size() for t, _ in originals)
            # run 4 of the Note: the gradient reaching the previous stage is laid
            # out as this stage's backward made it, not as the ones it was measured with
            layout, seen = row.pop("grad_layout", None), row.pop("input_grad_layout", None)
            last = self.measured
            if last is not None and last[0] == k - 1 and last[6] is not None and seen not in (None, last[6]):
                self.relayout = (last, seen)
            # (the leaves behind it as they were: later stages add this one's own)
            self.measured = (k, call, x, cuda, rng0, list(originals), layout, frozenset(self.upstream.leaves))
        state = [t for t, _ in originals]
        for t, old in originals:
            self.originals.setdefault(storage_key(t), (t, old))
        meta = tuple((t.shape, t.dtype, t.device) for t in kept)
        call.meta = meta
        call.state = [weakref.ref(t) for t in state]
        call.rng = rng0 if uses_rng else None
        run.settle(anchor, len(kept), x)
        if kept:
            run.watch(anchor, first(out))
        # run 3 of the Note: without recording, from the state the stage started in,
        # replayed as a recomputation is (what it costs is what Fn and Fck cost)
        with rng0.replayed(), torch.no_grad(), restore_tensors(state):
            for t, old in originals:
                t.copy_(old)
            with Timer(cuda) as timer, _Replay(call, self.autocast):
                nograd_out = call.call(x).detach()
        if self.given is None:
            row["fwd_nograd_time"] = timer.seconds
            if cuda:
                row["fwd_time"], row["bwd_time"] = timed_step(call, x, cuda, rng0, state)
        # Note [Replaying a stage] 4: a stage whose forward without recording
        # differs from the recorded one is recomputed with grad mode on
        act = out[0] if isinstance(out, tuple) else out
        call.grad_replay = not (isinstance(act, torch.Tensor) and _bitwise_equal(nograd_out, act))
        if call.grad_replay and self.given is None:
            row["fwd_nograd_time"] = row["fwd_time"]
        del nograd_out
        if k == 1:
            new.input_bytes = x.untyped_storage().nbytes()
        new.idents.append(weakref.ref(ident))
        new.names.append(call.name)
        new.in_sigs.append(input_signature(ident, x))
        new.meta.append(meta)
        new.uses_rng.append(uses_rng)
        new.grad_replay.append(call.grad_replay)
        new.state.append(call.state)
        new.rows.append(row)
        new.held.append(held)
        return out

    def _measure_backward_again(self):
        """Run 4 of Note [Measuring a stage] for the stage due (if any), after the
        saved tensors of the stage past it have gone or been kept."""
        due, self.relayout = self.relayout, None
        if due is None:
            return
        (i, call, x, cuda, rng0, originals, _, leaves), layout = due
        row = self.new.rows[i - 1]
        if i < self.diverged or row is None or "bwd_tmp" not in row:
            return
        again = backward_again(call, x, cuda, rng0, originals, layout, row.get("out_freed", 0),
                               self.grad_pool, leaves)
        if again is not None:
            row["bwd_time"], row["bwd_tmp"] = again

    def _keep_saved(self, i):
        """Whether measured stage i keeps its saved tensors for this call's backward.

        Yes while the inputs held so far and the saved tensors kept so far fit
        the budget (each stage's saved bytes include its output, the next
        stage's input), so that a budget that fits everything makes the first
        backward rebuild nothing. A stage run by a schedule before the chain
        diverged is left to it.
        """
        if i < self.diverged:
            return False
        rows, given = self.new.rows, self.given
        saved = rows[i - 1].get("saved_bytes") if rows[i - 1] is not None else None
        if saved is None and given is not None and i <= given.length:
            saved = given.saved_bytes[i - 1]
        out = rows[i - 1].get("out_bytes", 0) if rows[i - 1] is not None else 0
        if saved is None:
            return False
        if self.new.input_bytes + self.held_bytes + saved > self.budget:
            self.held_bytes += out   # dropped: its output stays, as the next stage's input
            return False
        self.held_bytes += saved
        return True


def _bitwise_equal(a, b):
    """Same shape, dtype and bits (NaNs included)."""
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and torch.equal(a.reshape(-1).view(torch.uint8) if a.is_contiguous() and b.is_contiguous()
                            else a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def input_signature(ident, x):
    """What each stage of a recording is checked against: input shape and dtype,
    and its module's training flag (a stage switched to eval is measured again)."""
    return (tuple(x.shape), x.dtype, getattr(ident, "training", None))


def check_output(call, out, x, version):
    """What a stage returned is an activation (or a tuple led by one, the rest needing
    no grad) and its input was not modified in place; returns the activation."""
    act = out[0] if isinstance(out, tuple) else out
    if not isinstance(act, torch.Tensor):
        raise StageError(
            f"remat: stage {call.index} ({call.name}) returned {type(act).__name__}; a stage must return "
            f"its output activation as a tensor, or a tuple whose first item is that tensor"
        )
    if isinstance(out, tuple):
        for j, item in enumerate(out[1:], 1):
            if isinstance(item, torch.Tensor) and item.requires_grad:
                raise StageError(
                    f"remat: stage {call.index} ({call.name}) returned a tuple whose item {j} requires "
                    f"grad; only the first item may carry gradient (detach the others)"
                )
    if x._version != version:
        raise StageError(
            f"remat: stage {call.index} ({call.name}) modified its input in place (e.g. a "
            f"ReLU(inplace=True) as its first op); remat needs the input unchanged to recompute the "
            f"stage. Make that op out of place or move it to the end of stage {call.index - 1}"
        )
    return act
