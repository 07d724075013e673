"""A chain's measuring call, stage by stage (Note [Measuring a stage] in
remat/measure/profile.py): the forward that counts, metered and backwarded
(``instrumented_run``), the forward without recording that Fn and Fck cost, run
4 for a stage whose gradient arrives in another layout, and which stages keep
their saved tensors for the call's own backward: the measuring part
(``Measurer``) of a ``ChainCall`` (remat/runtime/chain_call.py). What it records
of each stage is a ``StageRecord`` (remat/measure/record.py); later calls are
checked against it by remat/runtime/stage_call.py.

Note [Saved tensors held elsewhere]
-----------------------------------
A stage may save a tensor for its backward and keep it some other way too: a
hook collecting attention maps (transformers' ``output_attentions=True``),
``self.maps = att.detach()``. Dropped with the stage, it stays all the same,
and a plan that counted it gone went over the budget by those bytes, without a
word (figures: docs/how-it-works.md, "Measured while building remat"). Nothing
holds a saved tensor's storage after the forward but autograd (here remat's
hooks, one ``detach()`` each), what the stage returned (and a view's base) and
the storage's own Python object, so a storage the stage made whose use count
is above that is held elsewhere (``Instrument.held_elsewhere``): it counts as
held through the step, like what a stage keeps outside autograd, and the
measuring call warns; its bytes leave a-bar^i (where the stage runs ``Fall``,
the one copy is the held one; where it is recomputed, the copy made then
replaces the one held, or comes while the cache that held it is gone). So,
silently, with what a cache holds that the stage made from parameters and
buffers alone: autocast's casts of the weights and of a leaf input, kept to
the end of the autocast region, and ``parametrize.cached()``'s weights (a plan
that counted those freed with the stage's saved tensors went over the budget
under autocast).
"""

import dataclasses
import functools
import warnings
import weakref

import torch
from torch.utils._pytree import tree_leaves

from ..runtime.executor import Run, _Saved
from ..runtime.recompute import state_plan
from ..runtime.replay import capture_rng, cuda_devices, param_flags
from ..runtime.stage_call import first, input_signature, module_dicts, module_structure
from ..errors import BudgetError
from ..units import format_bytes
from .costs_source import chain_costs, distributed, read_costs
from .leaves import GradPool, Upstream, side_grads, sums_started, with_sums
from .meter import Instrument, storage_key
from .profile import instrumented_run, observed_forward
from .record import StageRecord
from .chain_record import NO_HINT, ChainRecord
from .holding import Holding
from .refine import ATTEMPTS
from .stage_backward import Run4
from .twins import Twin
from .timing import nograd_less, nograd_run, timed_rebuild, timed_step, warm_cuda

__all__ = ["Measurer"]

_warned_sizes = set()   # costs files whose input size differed from a call's (warned once each)


@dataclasses.dataclass(slots=True, eq=False)
class _Measured:
    """What run 4 of Note [Measuring a stage] needs of a measured stage."""
    index: int
    call: object
    x: object          # a weak reference to its input (held by its anchor, if at all: remat/measure/holding.py)
    cuda: bool
    rng0: object
    writes: list
    layout: tuple      # strides of its output's gradient in run 2
    leaves: frozenset  # the leaves behind it as they were (later stages add this one's own)


class Measurer:
    """The measuring part of a chain call: each stage measured as it is called,
    into a new ``ChainRecord``.

    Args:
        budget: the call's budget in bytes; ``autocast`` the state it opened in.
        chain_record: the record of the stages already run on a plan, when a
            call left its recorded path (``Runner.diverge``); else None.
        run: that call's ``Run``; else None (a new one).
        hint: what a record of the chain (another shape's, or that of the path
            the call left) shows of it (``ChainRecord.hint``).
    """

    def __init__(self, budget, autocast, chain_record=None, run=None, hint=NO_HINT):
        self.budget, self.autocast = budget, autocast
        self.new = chain_record if chain_record is not None else ChainRecord()
        self.run = run if run is not None else Run(None, autocast)
        self.diverged = len(self.new.stages) + 1 if chain_record is not None else 0
        self.given = None        # costs read from a file (or ``from_record``: ``first``)
        self.from_record = False
        self.options = self.new.options   # measure the stages' options (``remat.chain(options=...)``; ``first``)
        self.costs_path = None   # the costs file this call reads or writes
        self.rng_start = None    # the RNG state as the call began (put back if it fails)
        self.originals = {}      # storage -> (tensor, value before the call) of the state stages wrote
        self.grad_pool = None
        self.upstream = Upstream()   # (the leaves behind the stages, as they come)
        self.measured = {}       # stage -> its ``_Measured``
        self.relayout = None     # (the ``_Measured`` of the stage before, the layout its gradient has) due for run 4
        self.run4 = Run4(self.new, self.measured, self.run)   # (run 4, now or in the call's own backward)
        self.twins = {}          # Note [Twin stages]: key -> stage
        self.outs = {}           # stage -> weak reference to the activation it returned
        # what it holds (Note [Measuring within the budget], remat/measure/holding.py)
        self.holding = Holding(budget, hint, self.diverged, self.new, self.run.held_before)
        self.run.holds = self.holding.rebuild_holds   # (the backward's rebuilds hold inputs again where they fit)

    @classmethod
    def first(cls, spec, budget, autocast, x, hint=NO_HINT, given=None):
        """The measuring part of a chain's first call on input ``x``, with the
        costs of ``spec.costs_path`` if that file exists (and fits the input), or
        ``given`` (``Sequential.measure``'s, which ran no tail: measured as with a
        file, the tail metered, the times refined as a first call's would be);
        ``hint``: what a record of the chain at another shape showed (``ChainRecord.hint``)."""
        self = cls(budget, autocast, hint=hint)
        self.rng_start = capture_rng(cuda_devices([x]))
        self.given, self.from_record = read_costs(spec.costs_path) if given is None else given, given is not None
        # ("auto": on CUDA, or as a costs file lists them; on CPU the recomputed ops cost
        # about what whole stages do per byte, and option 1's first-call time came out
        # low: docs/limitations.md)
        self.options = spec.options if spec.options != "auto" else \
            x.is_cuda or (self.given is not None and self.given.has_options)
        self.costs_path = spec.costs_path
        size = x.untyped_storage().nbytes()
        if self.given is not None and self.given.input_bytes != size:
            # another input size (the last, smaller batch; another sequence length):
            # measured as without a file, which keeps the costs it holds
            if self.costs_path not in _warned_sizes:
                _warned_sizes.add(self.costs_path)
                warnings.warn(
                    f"remat: the costs in {self.costs_path} are for an input of {self.given.input_bytes} "
                    f"bytes; this call's is {size} (another batch size or sequence length?): it is "
                    f"measured, and the file keeps the costs it has", RuntimeWarning, stacklevel=5)
            self.given = None
            self.costs_path = None
        if (self.given is None or self.from_record) and not x.is_cuda and not distributed():
            # the next two calls time the stages again (Note [Timing the second call])
            self.new.attempts = ATTEMPTS
            self.new.costs_file = self.costs_path
        return self

    # a stage -------------------------------------------------------------

    def stage(self, call, ident, x):
        """Measure stage ``call`` on ``x`` (the forward that counts); return what it returned."""
        k = call.index
        cuda = x.is_cuda
        devices = cuda_devices([x] + [a for a in call.args if isinstance(a, torch.Tensor)])
        if cuda:
            warm_cuda(devices)
        rng0 = capture_rng(devices)
        self._measure_backward_again()
        anchor, kept, hooks = self._anchored(call, x)
        self.upstream.add(tree_leaves((x, call.args, call.kwargs)))
        twin = None
        if self.given is None:
            if self.grad_pool is None:
                self.grad_pool = GradPool()
            twin = Twin(self.twins, ident, call, x)
            release, pooled = not self.holding.keep_all, self.grad_pool.nbytes()   # (the pool's: stages before made it)
            probe = instrumented_run(call, ident, x, rng0, hooks, anchor, self.upstream, twin, release=release)
            twin.keep(probe)
        else:   # costs come from a file: learn only what replay needs, from this forward
            probe, *_ = observed_forward(call, ident, x, Instrument(exclude=[x], sources=[x]), hooks, kept, rng0,
                                         self.upstream)
        held = self._held(call, x, probe)
        if self.given is None and probe.costs is not None:
            if probe.costs.measure_peak is not None:   # (what this call holds outside the stage's meter)
                probe.costs.measure_peak += pooled + self._state_copies(probe.writes)
            self._due_for_run4(call, x, cuda, rng0, probe)
        self._replayable(call, probe, kept, rng0, held)
        self.run.settle(anchor, len(kept), x)
        if kept:
            self.run.watch(anchor, first(probe.out))
        holding = self.holding
        try:
            holding.fits(call, x, probe.costs, self.given, self.new.input_bytes)
        except BudgetError:
            self.undo()
            raise
        if not holding.keep_saved(k, probe.costs, self.given, self.new.input_bytes):   # (before run 3)
            anchor.saved = None
            kept.clear()
        holding.thin_inputs(k, anchor, x, self.new.input_bytes, self.run)
        if twin is not None and twin.of is not None:
            # Note [Twin stages]: runs 2 and 3 are the twin's
            theirs = self.new.stages[twin.of - 1]
            probe.costs.fwd_nograd_time = theirs.costs.fwd_nograd_time
            probe.costs.fwd_nograd_less = min(theirs.costs.fwd_nograd_less, probe.costs.fwd_tmp)
            if cuda:   # timed_step's, not run 2's (launch time on CUDA), which ``twin`` kept
                probe.costs.fwd_time, probe.costs.bwd_time = theirs.costs.fwd_time, theirs.costs.bwd_time
                if probe.costs.kept is not None and theirs.costs.kept is not None:
                    probe.costs.kept = probe.costs.kept._replace(rebuild_seconds=theirs.costs.kept.rebuild_seconds)
            call.grad_replay = theirs.grad_replay
        else:
            self._measure_nograd(call, x, probe, rng0, cuda)
            if twin is not None:
                twin.register(k)
        self._record(call, ident, x, probe, rng0, held)
        if k > 1 and x.grad_fn is not None and self.given is None:   # (run 4 of stage k-1, if left for later)
            x.register_hook(lambda grad, run4=self.run4, i=k - 1, o=self.options: run4.arrived(i, grad, o))
        return probe.out

    def _anchored(self, call, x):
        """The forward that counts checkpoints its input and keeps its saved tensors
        until the next stage starts, so that the last stage needs no recomputation:
        (its anchor, the list of what it saves, the saved-tensor hooks)."""
        anchor, _, _ = self.run.new_anchor(call, True, x)
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

        return anchor, kept, Run.hooks(pack)

    def _held(self, call, x, probe):
        """{key: bytes} the stage makes the chain hold through the step (Note [Saved
        tensors held elsewhere]); the measuring call warns of what a user can change."""
        k = call.index
        held = dict(probe.held_grads)
        if probe.costs is not None and first(probe.out).requires_grad:
            held.update(side_grads(call, x))
        cached = probe.saved_cached   # (under autocast its cache holds the casts not saved too: solver/casts.py)
        if call.autocast is not None and not call.autocast.off:
            cached = max(cached, sum(n for _, n in (probe.cached or {}).values()))
        if cached:   # (Note [Saved tensors held elsewhere]: a cache's, nothing to say)
            held[("cached", k)] = cached
        if probe.saved_elsewhere and self.new.held_first(held, "elsewhere", k, probe.saved_elsewhere):
            warnings.warn(
                f"remat: stage {k} ({call.name}) saves tensors for its backward that something else "
                f"keeps too ({format_bytes(probe.saved_elsewhere)}): attention maps a hook collects "
                f"(transformers' output_attentions=True), a tensor stored on a module. Dropping them with "
                f"the stage would free nothing, so remat counts them, for this stage and any other that "
                f"does the same, as held through the step; stop keeping them while training to have that "
                f"memory back", RuntimeWarning, stacklevel=3)
        if probe.held_outside and self.new.held_first(held, "outside", k, probe.held_outside):
            warnings.warn(
                f"remat: stage {k} ({call.name}) still holds {format_bytes(probe.held_outside)} it made "
                f"after its forward, outside what autograd saves (tensors stored as attributes of a custom "
                f"autograd.Function's ctx, or cached on a module). remat can neither drop nor "
                f"recompute them and counts them, for this stage and any other that does the same, "
                f"as held through the step; save them with ctx.save_for_backward to have them "
                f"managed", RuntimeWarning, stacklevel=3)
        return held

    def _due_for_run4(self, call, x, cuda, rng0, probe):
        """Note what run 4 of Note [Measuring a stage] needs of this stage; due now for
        the stage before if this stage's backward hands it another layout than
        the one it was measured with."""
        k = call.index
        # a recomputation holds a copy of the state the stage writes in place
        # (remat/runtime/replay.py, restore_tensors) on top of what its forward holds
        probe.costs.fwd_tmp += sum(t.numel() * t.element_size() for t, _ in probe.writes)
        last = self.measured.get(k - 1)
        seen = probe.input_grad_layout
        if last is not None and last.layout is not None and seen not in (None, last.layout):
            self.relayout = (last, seen)
        self.measured[k] = _Measured(k, call, weakref.ref(x), cuda, rng0, list(probe.writes), probe.grad_layout,
                                     frozenset(self.upstream.leaves))

    def _state_copies(self, writes):
        """Bytes of the values from before the call of the state stages wrote in
        place (``writes`` of this stage's, and those this call holds already: to
        undo the call, and for run 4), each storage once."""
        copies = [old for _, old in self.originals.values()] + [old for _, old in writes]
        copies += [old for m in self.measured.values() for _, old in m.writes]
        return sum({storage_key(old): old.untyped_storage().nbytes() for old in copies}.values())

    def _replayable(self, call, probe, kept, rng0, held):
        """What a recomputation of the stage replays and checks (Note [Replaying a
        stage], remat/runtime/replay.py), on ``call``."""
        state = [t for t, _ in probe.writes]
        for t, old in probe.writes:
            self.originals.setdefault(storage_key(t), (t, old))
        call.meta = probe.meta if probe.meta is not None else tuple((t.shape, t.dtype, t.device) for t in kept)
        call.state = state
        call.before = [old for _, old in probe.writes] if probe.reads_state else None
        if probe.reads_state:
            # each call keeps the values the stage started from (Note [Replaying a
            # stage] 3) through its step: held on top of the activations
            held[("state", call.index)] = sum(old.untyped_storage().nbytes() for old in call.before)
        call.rng = rng0 if probe.uses_rng else None

    def _record(self, call, ident, x, probe, rng0, held):
        """Append the stage's ``StageRecord`` to the chain's record."""
        if not first(probe.out).requires_grad:   # (a cut: the anchors so far kept, as ``runner._pin_if_cut`` does)
            self.run.pin()
        if call.index == 1:
            self.new.input_bytes = x.untyped_storage().nbytes()
        dicts = module_dicts(ident)
        call.flags = param_flags(call.tensors or (), call.slots[1])
        record = StageRecord(None, call.name, input_signature(x, call, dicts), dicts, module_structure(ident),
                             call.slots, call.flags, call.autocast, call.meta,
                             state_plan(call.state, call.tensors or (), call), probe.reads_state, probe.uses_rng,
                             [g for g, _ in rng0.extra], call.grad_replay, probe.costs, held, leaves=probe.leaves)
        self.new.add(record, ident)

    def _measure_nograd(self, call, x, probe, rng0, cuda):
        """Run 3 of Note [Measuring a stage]: without recording, from the state the
        stage started in, replayed as a recomputation is (what it costs is what Fn
        and Fck cost: time and, metered, ``fwd_nograd_less``, remat/measure/timing.py);
        and whether that forward gives the recorded output."""
        costs = probe.costs
        # (Note [Replaying a stage] 4: a stage whose forward without recording
        # differs from the recorded one is recomputed with grad mode on)
        same, seconds, metered = nograd_run(call, x, probe.writes, rng0, cuda, self.autocast, self.given is None,
                                            first(probe.out))
        if self.given is None:
            costs.fwd_nograd_time = seconds
            costs.fwd_nograd_less = nograd_less(costs, metered, probe.writes, probe.cached)
            state = [t for t, _ in probe.writes]
            if cuda:
                costs.fwd_time, costs.bwd_time = timed_step(call, x, cuda, rng0, state)
                if self.options and costs.kept is not None and costs.kept.any_kept:
                    costs.kept = costs.kept._replace(rebuild_seconds=timed_rebuild(call, x, cuda, rng0, state))
        call.grad_replay = not same
        if call.grad_replay and self.given is None:
            costs.fwd_nograd_time, costs.fwd_nograd_less = costs.fwd_time, 0

    def _measure_backward_again(self, tail=0):
        """Run 4 of Note [Measuring a stage] for the stage due (if any), after the
        saved tensors of the stage past it have gone or been kept (``tail``: the bytes
        the chain's tail holds, at the call's end). One that would not fit beside what
        the call holds is left to the call's own backward (``Run4.later``)."""
        due, self.relayout = self.relayout, None
        while due is not None:
            m, layout = due
            costs = self.new.stages[m.index - 1].costs
            if m.index < self.diverged or costs is None or not costs.backward_measured:
                return
            # (not under torch.distributed: ranks would measure, and share the costs, apart)
            # (with an output to spare: the estimate ran 256 bytes short on a chain ending in BatchNorm)
            if not distributed() and not self.holding.run4_fits(m.index, self.run, self.outs, tail + costs.out_bytes):
                self.run4.later[m.index] = layout
                return
            due = self.run4.again(m, layout, self.grad_pool)

    # the chain's end -----------------------------------------------------

    def returned(self, k, act):
        """Stage k returned the activation ``act``."""
        self.outs[k] = weakref.ref(act)

    def finish(self, last, tail=0):
        """The end of the measuring call, whose last stage was ``last`` (its tail
        holding ``tail`` bytes): the chain's record and its costs (on failure, the call
        undone)."""
        new = self.new
        try:
            new.state_copies = self._state_copies(())
            try:
                self._measure_backward_again(tail)
            finally:
                self.measured, self.grad_pool, self.upstream = {}, None, None
                act = self.outs[last]() if last in self.outs and self.given is None else None
                spare = tail + getattr(new.stages[-1].costs, "out_bytes", 0)   # (the last stage's run 4: an output
                self.run4.settle(last, act, self.options,                       # to spare)
                                 functools.partial(self.holding.run4_fits, last, self.run, dict(self.outs), spare),
                                 None if distributed() else self.holding.run4_fits_now)
            new.caller_holds(self.outs, last)
            if self.given is None:
                for i, started in enumerate(sums_started([s.held for s in new.stages])):
                    costs = new.stages[i].costs
                    if started[0] and i + 1 >= self.diverged and costs is not None and costs.backward_measured:
                        costs.bwd_tmp = with_sums(costs.bwd_tmp, costs.bwd_tmp_sums, started)
                        costs.bwd_rebuilt_less = min(costs.bwd_rebuilt_less, costs.bwd_tmp + costs.out_bytes)
                        self.run4.started[i + 1] = started   # (kept if run 4 comes later)
            new.costs = chain_costs([s.costs for s in new.stages], new.input_bytes, new.held_bytes(),
                                    self.costs_path, self.given, self.options)
            new.from_file, new.options, new.measured_at = self.given is not None and not self.from_record, \
                self.options, self.budget
            # a frozen stage is checked as it is called (Note [Stages recorded whole], remat/runtime/runner.py)
            new.suspects |= {i + 1 for i, s in enumerate(new.stages)
                             if (flags := [g[1] for g in s.grads if g is not None]) and not any(flags)}
        except BaseException:
            self.undo()
            raise
        return new

    def undo(self):
        """Put RNG and in-place state back as before this call (a failed first call leaves no trace)."""
        if self.rng_start is not None:
            torch.set_rng_state(self.rng_start.cpu)
            for d, s in self.rng_start.cuda:
                torch.cuda.set_rng_state(s, d)
        with torch.no_grad():
            for t, old in self.originals.values():
                t.copy_(old)

