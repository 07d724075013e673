"""A chain's measuring call, stage by stage (Note [Measuring a stage] in
remat/measure/profile.py): the forward that counts, metered and backwarded
(``instrumented_run``), the forward without recording that Fn and Fck cost, run
4 for a stage whose gradient arrives in another layout, and which stages keep
their saved tensors for the call's own backward. ``ChainCall`` (remat/runtime/chain_call.py)
takes these methods; what it records for later calls to be checked against is
read by remat/runtime/stage_check.py.

Note [Saved tensors held elsewhere]
-----------------------------------
A stage may save a tensor for its backward and keep it some other way too:
a hook collecting attention maps (transformers' ``output_attentions=True``),
``self.maps = att.detach()``. Dropped with the stage, it stays all the same,
and a plan that counted it gone went over the budget by those bytes (18% on
a 4-layer toy Llama at its minimum), without a word. Nothing holds a saved
tensor's storage after the forward but autograd (here remat's hooks, one
``detach()`` each), what the stage returned (and a view's base) and the
storage's own Python object, so a storage the stage made whose use count is
above that is held elsewhere (``Instrument.held_elsewhere``): it counts as
held through the step, like what a stage keeps outside autograd, and the
measuring call warns; its bytes leave a-bar^i (where the stage runs ``Fall``,
the one copy is the held one; where it is recomputed, the copy made then
replaces the one held, or comes while the cache that held it is gone). So,
silently, with what a cache holds that the stage made from parameters and
buffers alone: autocast's casts of the weights and of a leaf input, kept to
the end of the autocast region, and ``parametrize.cached()``'s weights (a
stage dropped with its saved tensors went up to 2x over the budget under
autocast before, as the plan counted those freed with it).

Note [Twin stages]
------------------
Chains are mostly copies of one block (a transformer's layers, a ResNet
stage's bottlenecks). A stage whose run 1 shows it to be a twin of a stage
measured before in the call skips runs 2 and 3 and takes that stage's
backward time and peak, time without recording and grad-mode verdict: the
most of a first call's work (run 2 is metered op by op). Twins have the same
code (the function, or the module's class and forward), the same tree of
submodules with the same configuration (``extra_repr``), training flags,
parameter and buffer shapes; like inputs (shape, strides, dtype, device,
requires_grad; side inputs by ``signature``); and, from run 1, the same
output, saved and transient bytes, saved tensors' shapes, RNG use, in-place
writes, held gradients, parameters to differentiate and backward graph (node
types and edges, from the output to the inputs). Same ops on like tensors
allocate alike, so nothing the budget relies on is guessed. On CPU the
next two calls' own times then replace the shared ones (remat/measure/refine.py).
"""

import warnings

import torch
from torch.utils._pytree import tree_leaves

from .leaves import GradPool, Upstream, grad_side_inputs, stage_leaves
from .meter import Instrument, storage_key
from .profile import instrumented_run, saved_storages
from .stage_backward import backward_again
from .timing import Timer, timed_step, warm_cuda
from ..runtime.replay import Replay, capture_rng, cuda_devices, restore_tensors
from ..runtime.executor import _Saved
from ..runtime.stage_call import first
from ..runtime.stage_check import check_output, input_signature, module_dicts, module_structure, signature
from ..runtime.tensor_slots import param_flags, state_plan
from ..units import format_bytes

__all__ = ["StageMeasuring", "shared_grad_transients", "side_grads"]


class StageMeasuring:
    """The measuring half of ``ChainCall``: its state is set up by ``ChainCall``."""

    def _measure_stage(self, call, ident, x):
        run, new, k = self.run, self.new, call.index
        cuda = x.is_cuda
        devices = cuda_devices([x] + [a for a in call.args if isinstance(a, torch.Tensor)])
        if cuda:
            warm_cuda(devices)
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
        anchor.versions = []

        def pack(t):
            # through the anchor, not the list: autograd keeps this function with each
            # tensor it packs, and ``kept`` must go when the anchor lets it go
            saved = anchor.saved
            i = len(saved)
            saved.append(t.detach())
            anchor.versions.append(t._version)
            return _Saved(anchor, i)

        if self.upstream is None:
            self.upstream = Upstream()
        self.upstream.add(tree_leaves((x, call.args, call.kwargs)))
        twin = None
        if self.given is None:
            if self.grad_pool is None:
                self.grad_pool = GradPool()
            twin = _Twin(self.twins, ident, call, x)
            out, row, originals, uses_rng, reads_state = instrumented_run(
                call, ident, x, cuda, rng0, check_output, run.hooks(pack), kept, self.grad_pool, self.upstream,
                anchor, twin)
            twin.keep(row)
        else:
            # costs come from a file: learn only what replay needs, from this forward
            detector = Instrument(exclude=[x], sources=[x])
            buffers = [(b, b.detach().clone()) for b in ident.buffers()] if isinstance(ident, torch.nn.Module) else []
            with detector, run.hooks(pack):
                out = call.invoke(x)
            detector.note_changed(buffers)
            originals = list(detector.mutated.values())
            reads_state = detector.reads_state()
            rng0.extra = list(detector.generators.values())
            uses_rng = rng0.changed()
            act = out[0] if isinstance(out, tuple) else out
            row = {"out_bytes": act.untyped_storage().nbytes()} if isinstance(act, torch.Tensor) else None
            if row is not None and act.requires_grad:
                stop = {a.grad_fn for a in (x, *call.args) if isinstance(a, torch.Tensor) and a.grad_fn is not None}
                side = grad_side_inputs(call, x)
                row["held_grads"] = self.upstream.held_grads(
                    p for p in stage_leaves(act, stop) if p is not x and not any(p is s for s in side))
            if row is not None:
                returned = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                row["held_outside"] = detector.alive_bytes(kept + returned)
                elsewhere, cached = detector.held_elsewhere(kept, returned, besides=[act])
                row["saved_elsewhere"], row["saved_cached"] = sum(elsewhere.values()), sum(cached.values())
                # saved_bytes as the measuring run counts it, for costs_source._check_given
                seen = saved_storages(detector, kept, act, [*elsewhere, *cached])
                row["saved_seen"] = max(sum(seen.values()), row["out_bytes"])
        held = row.pop("held_grads", {}) if row is not None else {}
        if row is not None and first(out).requires_grad:
            held.update(side_grads(call, x))
        pop = row.pop if row is not None else (lambda _key, default: default)
        cached = pop("saved_cached", 0)
        if cached:   # (Note [Saved tensors held elsewhere]: a cache's, nothing to say)
            held[("cached", k)] = cached
        elsewhere = pop("saved_elsewhere", 0)
        if elsewhere and _held_first(new, held, "elsewhere", k, elsewhere):
            warnings.warn(
                f"remat: stage {k} ({call.name}) saves tensors for its backward that something else "
                f"keeps too ({format_bytes(elsewhere)}): attention maps a hook collects (transformers' "
                f"output_attentions=True), a tensor stored on a module. Dropping them with the stage "
                f"would free nothing, so remat counts them, for this stage and any other that does the "
                f"same, as held through the step; stop keeping them while training to have that "
                f"memory back", RuntimeWarning, stacklevel=2)
        outside = pop("held_outside", 0)
        if outside and _held_first(new, held, "outside", k, outside):
            warnings.warn(
                f"remat: stage {k} ({call.name}) still holds {format_bytes(outside)} it made after its "
                f"forward, outside what autograd saves (tensors stored as attributes of a custom "
                f"autograd.Function's ctx, or cached on a module). remat can neither drop nor "
                f"recompute them and counts them, for this stage and any other that does the same, "
                f"as held through the step; save them with ctx.save_for_backward to have them "
                f"managed", RuntimeWarning, stacklevel=2)
        if self.given is None and row is not None:
            # a recomputation holds a copy of the state the stage writes in place
            # (remat/runtime/replay.py, restore_tensors) on top of what its forward holds
            row["fwd_tmp"] += sum(t.numel() * t.element_size() for t, _ in originals)
            # run 4 of the Note: the gradient reaching the previous stage is laid
            # out as this stage's backward made it, not as the ones it was measured with
            layout, seen = row.pop("grad_layout", None), row.pop("input_grad_layout", None)
            last = self.measured.get(k - 1)
            if last is not None and last[6] is not None and seen not in (None, last[6]):
                self.relayout = (last, seen)
            # (the leaves behind it as they were: later stages add this one's own)
            self.measured[k] = (k, call, x, cuda, rng0, list(originals), layout, frozenset(self.upstream.leaves))
        state = [t for t, _ in originals]
        for t, old in originals:
            self.originals.setdefault(storage_key(t), (t, old))
        meta = tuple((t.shape, t.dtype, t.device) for t in kept)
        call.meta = meta
        call.state = state
        call.before = [old for _, old in originals] if reads_state else None
        if reads_state:
            # each call keeps the values the stage started from (remat/runtime/replay.py Note
            # [Replaying a stage] 3) through its step: held on top of the activations
            held[("state", k)] = sum(old.untyped_storage().nbytes() for old in call.before)
        call.rng = rng0 if uses_rng else None
        run.settle(anchor, len(kept), x)
        if kept:
            run.watch(anchor, first(out))
        if twin is not None and twin.of is not None:
            # Note [Twin stages]: runs 2 and 3 are the twin's
            j = twin.of
            row["fwd_nograd_time"] = new.rows[j - 1]["fwd_nograd_time"]
            if cuda:   # timed_step's, not run 2's (launch time on CUDA), which ``twin`` kept
                row["fwd_time"] = new.rows[j - 1]["fwd_time"]
                row["bwd_time"] = new.rows[j - 1]["bwd_time"]
            call.grad_replay = new.grad_replay[j - 1]
        else:
            self._measure_nograd(call, x, out, row, rng0, originals, cuda)
            if twin is not None:
                twin.register(k)
        if k == 1:
            new.input_bytes = x.untyped_storage().nbytes()
        new.add_ident(ident)
        new.names.append(call.name)
        dicts = module_dicts(ident)
        new.dicts.append(dicts)
        new.structures.append(module_structure(ident))
        new.in_sigs.append(input_signature(x, call, dicts))
        new.meta.append(meta)
        new.uses_rng.append(uses_rng)
        new.generators.append([g for g, _ in rng0.extra])
        new.grad_replay.append(call.grad_replay)
        new.state.append(state_plan(state, call.tensors or ()))
        new.slots.append(call.slots)
        new.autocasts.append(call.autocast)
        call.flags = param_flags(call.tensors or (), call.slots[1])
        new.grads.append(call.flags)
        new.reads_state.append(reads_state)
        new.rows.append(row)
        new.held.append(held)
        return out

    def _measure_nograd(self, call, x, out, row, rng0, originals, cuda):
        """Run 3 of Note [Measuring a stage]: without recording, from the state the
        stage started in, replayed as a recomputation is (what it costs is what Fn
        and Fck cost); and whether that forward gives the recorded output."""
        state = [t for t, _ in originals]
        with rng0.replayed(), torch.no_grad(), restore_tensors(state):
            for t, old in originals:
                t.copy_(old)
            with Timer(cuda) as timer, Replay(call, self.autocast):
                nograd_out = call.call(x).detach()
        if self.given is None:
            row["fwd_nograd_time"] = timer.seconds
            if cuda:
                row["fwd_time"], row["bwd_time"] = timed_step(call, x, cuda, rng0, state)
        # Note [Replaying a stage] 4: a stage whose forward without recording
        # differs from the recorded one is recomputed with grad mode on
        act = first(out)
        call.grad_replay = not (isinstance(act, torch.Tensor) and _bitwise_equal(nograd_out, act))
        if call.grad_replay and self.given is None:
            row["fwd_nograd_time"] = row["fwd_time"]

    def _measure_backward_again(self):
        """Run 4 of Note [Measuring a stage] for the stage due (if any), after the
        saved tensors of the stage past it have gone or been kept."""
        due, self.relayout = self.relayout, None
        while due is not None:
            (i, call, x, cuda, rng0, originals, _, leaves), layout = due
            row = self.new.rows[i - 1]
            if i < self.diverged or row is None or "bwd_tmp" not in row:
                return
            again = backward_again(call, x, cuda, rng0, originals, layout, row.get("out_freed", 0),
                                   self.grad_pool, leaves)
            if again is None:
                return
            seconds, row["bwd_tmp"], seen = again
            if not cuda:   # on CUDA it ran under the meter, whose Python is in the wall time:
                row["bwd_time"] = seconds   # timed_step's unmetered time stands
            # a stage that passes the layout on (an elementwise one) hands it further down
            last = self.measured.get(i - 1)
            due = (last, seen) if last is not None and last[6] is not None and seen not in (None, last[6]) else None

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


class _Twin:
    """The twin lookup of one stage (Note [Twin stages]): ``instrumented_run`` hands
    ``find`` what run 1 showed and gets the twin's run 2 results, or None; ``of`` is
    then the twin's stage number. Those results are kept as run 2 gave them, before
    run 4 (another gradient layout) may change the twin's row."""

    RUN2 = ("bwd_time", "bwd_tmp", "grad_layout", "input_grad_layout")

    def __init__(self, twins, ident, call, x):
        self.twins, self.key, self.of, self.run2 = twins, None, None, None
        try:
            base = (_structure(ident, call.fn), tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad,
                    signature((call.args, call.kwargs)))
            hash(base)
        except TypeError:   # an unhashable stage function: no twins
            base = None
        self.base = base

    def find(self, seen):
        if self.base is None:
            return None
        self.key = (self.base, seen)
        found = self.twins.get(self.key)
        if found is None:
            return None
        self.of, run2 = found
        return run2

    def keep(self, row):
        """Note the stage's own run 2 results (``row`` as ``instrumented_run`` made it)."""
        if row is not None:
            self.run2 = {f: row[f] for f in self.RUN2 if f in row}

    def register(self, k):
        """Stage ``k``, measured in full, is the one its twins take after."""
        if self.key is not None and self.run2 is not None:
            self.twins.setdefault(self.key, (k, self.run2))


def _structure(ident, fn):
    """The code a stage runs and, for a module, its submodules' classes, configuration
    and training flags and its parameters' and buffers' shapes."""
    code = getattr(fn, "__func__", fn)
    if not isinstance(ident, torch.nn.Module):
        return (code,)
    return (code,
            tuple((name, type(m), m.extra_repr(), m.training) for name, m in ident.named_modules()),
            tuple((name, p.shape, p.dtype, p.device, p.requires_grad) for name, p in ident.named_parameters()),
            tuple((name, b.shape, b.dtype, b.device) for name, b in ident.named_buffers()))


def _bitwise_equal(a, b):
    """Same shape, dtype and bits (NaNs included)."""
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and torch.equal(a.reshape(-1).view(torch.uint8) if a.is_contiguous() and b.is_contiguous()
                            else a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def _held_first(recording, held, kind, k, nbytes):
    """Count ``nbytes`` of ``kind`` as held through the step for stage ``k`` (its
    ``held``); True if no stage of ``recording`` held any of that kind before
    (the measuring call says so once)."""
    held[(kind, k)] = nbytes
    return not any(isinstance(key, tuple) and key[0] == kind for h in recording.held for key in h)


def side_grads(call, x):
    """{("side", id): gradient bytes} of ``grad_side_inputs``. The engine sums
    each one's gradient into a buffer it holds from the backward of the last stage
    using it until it runs the node that made it (or accumulates it into a leaf's
    ``.grad``), after the chain's: held through the chain's backward, like a shared
    parameter's, counted once in held_bytes. What each stage adds into it is in that
    stage's bwd_tmp: the measured backward takes it at the side input's edge
    (``run_backward``, remat/measure/stage_backward.py), as it comes out of the stage, summed
    over the stage's own uses of it (two in an attention: keys and values)."""
    return {("side", id(a)): a.numel() * a.element_size() for a in grad_side_inputs(call, x)}


def shared_grad_transients(held):
    """Per stage, the bytes to add to its bwd_tmp for the parameters it shares with
    stages before it (``held``: per stage, {id: bytes} of ``Upstream.held_grads``)
    and also with one after it. Such a stage's measured backward leaves them out,
    but B(i) makes its share of their gradient all the same, alive until the engine
    adds it into the sum it holds (counted in held_bytes); the share of the last
    stage using one is that sum's first term, no extra."""
    out = []
    for i, h in enumerate(held):
        later = set()
        for g in held[i + 1:]:
            later.update(key for key in g if not isinstance(key, tuple))
        out.append(sum(v for key, v in h.items() if not isinstance(key, tuple) and key in later))
    return out
