"""A recorded chain's later calls, stage by stage: each stage checked against
the chain's record (Note [Chain keys], remat/chain.py) and run in its forward-phase
mode of the plan (``Fall`` records whole; ``Fck``, ``Fn`` and a ``Fall`` with an option
run under the pack hooks of remat/runtime/executor.py, keeping their input or not), and the record's
update at the end of the call: the running part (``Runner``) of a
``ChainCall`` (remat/runtime/chain_call.py), which hands a later call to this
part, as it hands a first call to the measuring part (``Measurer``,
remat/measure/measuring.py).

Note [Stages recorded whole]
----------------------------
A stage the plan runs as ``Fall`` in the forward phase is run once, with no
hooks, and never again: autograd keeps what it saves, and no recomputation
goes through it (one that must rebuild a later stage starts from a held input
above it: the stage after a whole one keeps its input). So its call needs
nothing to replay (its tensors, state, RNG), and the checks that its module is
still the one recorded (training flags, submodules, parameters) only keep the
costs true. Made one by one between the stages' forwards, each reads a
module's dicts and tensors that the stage before has pushed out of the CPU's
caches, and they were most of remat's own time in a forward that stores
everything. They run as the call opens instead (``Runner.__init__``), for all
those stages in one pass, where they cost about half as much, with nothing to
replay set up (figures: docs/how-it-works.md, "Measured while building
remat"). A stage that fails there is a suspect, checked as it is called, as
other stages are, and measured again in this very call if it has changed
(with the pass at the call's end, until 2026-11-29, the call that switched
dropout on ran on the old costs: 36% over a budget storing every stage). It
may not have: a wrapper may hold its module otherwise between its calls than
during them (FSDP frees the unsharded parameters after a forward). A frozen
stage (no parameter needing grad as measured) is a suspect from the start:
unfrozen, its call would run on costs without its backward (linear probing,
then fine-tuning: 3.2 times the budget). The stages recorded whole of another
path's record that a call adopts (Note [Paths of a chain],
remat/runtime/paths.py) are checked at the call's end (``_suspect_changed``);
a stage changed for good inside the chain's block, before its call, as the
next call opens. The call that ran such a stage as recorded is exact all the
same, its peak off by the change. Checked as it is called
still: the stage's identity and its input's signature, which decide what stage
this is, and the version counters of the buffers it did not write when
measured (few, if any): a stage that starts writing one (an observer switched
on) makes the next call measure again (``_new_writes``), before a budget that
recomputes it can replay it from the buffer's value after its forward. A
module changed inside the chain only around its own stage's call, and put back
before the chain ends, is not seen (docs/limitations.md).
"""

import warnings
import weakref

import torch

from ..dynamo import DYNAMO_SKIPS
from ..solver.schedule import Fall, Fn
from .executor import Run, _releasing, distributed, flying, in_flight
from .recompute import resolve_state, take
from .replay import capture_rng, cuda_devices, param_flags, snapshot
from .option_modes import keep_only, option_contexts
from .paths import STALE, held_before, keep_path, path_changed, path_changes, site_text
from .stage_call import first, same_structure, signature_matches, trained_as

__all__ = ["Runner", "watch_output", "site_text"]

_warned_writes = set()   # names of stages warned of by ``_new_writes``
_shorter = {}            # chain key -> (stage, calls in a row that stopped there, that stopped short at all)
SHORTER_AGAIN = 2        # calls in a row stopping at one stage before the shorter path is measured
SHORTER_ANY = 4          # calls in a row stopping short anywhere before it is


class Runner:
    """The running part of a chain call: the plan of its record, stage by stage.

    Args:
        key: the chain's key (Note [Chain keys]); ``site`` its site.
        entry: the ``ChainRecord`` of that key.
        plan: the ``Plan`` solved from it for this call's budget.
        autocast: the autocast state the chain opened in.
    """

    def __init__(self, key, site, entry, plan, autocast):
        self.key, self.site, self.entry, self.plan, self.run = key, site, entry, plan, Run(plan, autocast)
        self.base = entry     # the chain's record: ``entry``, or the one ``entry`` is a view of (Note [Skipped ...])
        self.dropped = []     # (i, weak reference to a^i's storage) the plan lets go
        self.acts = []        # (i, weak reference to a^i's storage, a^1's node for stage 1), each stage
        self.stale = False    # a stage saved other tensors than the record says
        self.unchecked = []   # stages whose module is checked at the end (Note [Stages recorded whole])
        self.opened = entry   # (its stages recorded whole are checked now, as the call opens)
        entry.suspects |= {k for k, record in enumerate(entry.stages, 1) if plan.modes[k] is Fall and
                           not plan.options[k] and k not in entry.suspects and _same_module(record) is False}

    def matches(self, k, ident, x, call):
        """Stage k is the one recorded, on a like input, made of the same submodules,
        parameters and buffers, with the same parameters to differentiate, of the same
        dtypes and shapes (a stage frozen or unfrozen since saves other tensors; one
        cast to another dtype, behind a first stage taking integer ids, keeps the key
        but not the costs; a pruned one saves smaller tensors). The module of a stage
        the plan records whole is checked as the call opens (Note [Stages recorded whole])."""
        entry = self.entry
        if k > len(entry.stages):
            return False
        record = entry.stages[k - 1]
        if record.ident() is not ident or not signature_matches(record.in_sig, x, call):
            return False
        if record.autocast != call.autocast:
            return False
        if self.plan.modes[k] is Fall and not self.plan.options[k] and k not in entry.suspects:
            if entry is not self.opened:   # (another path's record, adopted in this call)
                self.unchecked.append(k)
            return True
        tensors = _same_module(record)
        if tensors is False:
            return False
        if tensors is not None:
            call.slots, call.tensors, call.flags = record.slots, tensors, record.grads
        return True

    def _suspect_changed(self, chain_record, at=lambda k: k):
        """Note [Stages recorded whole]: add to ``chain_record.suspects`` the stages of
        this call left unchecked whose module is no longer as recorded (there stage
        ``at(k)``); True if any."""
        found = False
        for k in self.unchecked:
            if _same_module(self.entry.stages[k - 1]) is False:
                chain_record.suspects.add(at(k))
                found = True
        return found

    def diverge(self, k):
        """The chain left the recorded path at stage k: return the record of the
        stages before it, for the measuring part to measure the rest with this
        call's ``run`` (Note [Chain keys])."""
        new = self.entry.again(k - 1)
        keep_path(new, self.base)   # (Note [Paths of a chain], remat/runtime/paths.py)
        self._suspect_changed(new)
        path_changed(self.key, self.site)
        self.run.ops, self.run.held_before = None, held_before(self.plan, k)   # (holding.py)
        return new

    def adopt(self, entry, plan, base=None):
        """Go on with the record ``entry`` (a view of ``base``, if given) and its
        ``plan`` (Note [Paths of a chain], Note [Skipped stages] in remat/runtime/skips.py)."""
        self.entry, self.base, self.plan, self.run.ops, self.run.fall_at, self.run.policy = \
            entry, base or entry, plan, plan.backward, plan.fall_at, plan.policy

    def at(self, k):
        """The chain's record's stage that is this call's stage k (Note [Skipped stages])."""
        return self.entry.view[1][k - 1] if self.entry.view else k

    def stage(self, call, ident, x):
        """Run stage ``call`` on ``x`` as the plan says; return what it returned."""
        entry, tensors = self.entry, call.tensors
        quiet = _quiet(entry.stages[call.index - 1])
        if not quiet:
            return self._run_mode(call, x)
        if tensors is not None:
            buffers = [tensors[i] for i in quiet]
        else:   # (a stage recorded whole, whose slots are not taken: Note [Stages recorded whole])
            slots = entry.stages[call.index - 1].slots[0]
            buffers = take([slots[i] for i in quiet])
        versions = [-1 if b is None else b._version for b in buffers]
        out = self._run_mode(call, x)
        self._new_writes(call, buffers, versions)
        return out

    def _new_writes(self, call, buffers, versions):
        """Buffers the stage wrote in place that it did not write when measured (a
        quantisation observer switched on since): the next call measures again, and
        this call's recomputations of the stage put them back as its forward left
        them (their writes undone, as those of the measured state are). ``buffers``
        are those the stage did not write when measured (``ChainRecord.quiet``)."""
        state = call.state
        new = [b for b, v in zip(buffers, versions)
               if b is not None and b._version != v and not any(b is t for t in state)]
        if not new:
            return
        self.stale = True
        if self.plan.modes[call.index] is Fall and not self.plan.options[call.index]:
            return   # (a stage recorded whole in the forward phase is not run again this call)
        call.state = list(state) + new
        if call.before is not None:
            call.before = list(call.before) + [None] * len(new)
        if call.name not in _warned_writes:
            _warned_writes.add(call.name)
            warnings.warn(
                f"remat: stage {call.index} ({call.name}) wrote buffers in place that it did not write when "
                f"measured (an observer or a statistic switched on since?); the chain is measured again on "
                f"the next call. In this call its recomputations start from their values after its forward, "
                f"which is exact unless the stage reads them (a moving-average observer's range)",
                RuntimeWarning, stacklevel=5)

    def _run_mode(self, call, x):
        """Stage ``call`` in its forward-phase mode of the plan."""
        entry, run, k = self.entry, self.run, call.index
        mode = self.plan.modes[k]
        option = self.plan.options[k] if mode is Fall else 0
        record = entry.stages[k - 1]
        if mode is Fall and not option:   # (run once, never again: nothing to replay)
            run.add_whole(call)
            if k > 1 and not run.option[k - 1] and _drops_input(entry.costs, k, run.whole[k - 1]):
                self.dropped.append((k - 1, weakref.ref(x.untyped_storage())))
            out = call.invoke(x)
            _pin_if_cut(run, out)
            return out
        call.meta = record.meta
        call.state = resolve_state(record.state, call.tensors, call)
        if record.reads_state:
            call.before = snapshot(call.state)
        call.grad_replay = record.grad_replay
        # (a stage run again replays the RNG even if it drew no random numbers when
        # measured: dropout's p raised from 0 since, noise switched on)
        call.rng = capture_rng(cuda_devices([x] + [a for a in call.args if isinstance(a, torch.Tensor)]),
                               record.generators)
        keep = mode is not Fn or (k > 1 and run.keeps_output(k - 1))
        anchor, pack, count = run.new_anchor(call, keep, x, option)
        # what the stage saves stays while it runs: a stage may backward its own graph
        # inside its forward (forces as an energy's gradient), and its recording
        # forward's peak, which bounds this one's (fwd_tmp), held it all the same
        anchor.live = []
        try:
            if option:   # (Note [Running an option], remat/runtime/option_modes.py)
                forward, anchor.cache = option_contexts()
                with run.hooks(pack), forward:
                    out = call.invoke(x)
                keep_only(anchor.cache, self.plan.policy(k, option), anchor.live, first(out))
            else:
                with run.hooks(pack):
                    out = call.invoke(x)
        finally:
            anchor.live = None
        if not call.rng.changed():   # (it drew nothing: its recomputations set no stream, Note [Replaying a stage] 1)
            call.rng = None
        _pin_if_cut(run, out)   # (while ``anchor`` holds this stage's)
        if not keep and k > 1 and k - 1 not in entry.caller:   # Fn lets a^(k-1) go (Note [What the ...])
            storage = x.untyped_storage()
            if first(out).untyped_storage() is not storage:   # (unless its output is a view of it)
                self.dropped.append((k - 1, weakref.ref(storage)))
        run.settle(anchor, count[0], x)
        if call.meta is not None and count[0] != len(call.meta):
            # another path than the recorded one (fake quantization switched on, a
            # parametrization cache): its recomputations are checked against this
            # forward, and the next call measures again
            call.count, call.meta = count[0], None
            self.stale = True
        if count[0]:
            run.watch(anchor, first(out))
        return out

    def returned(self, k, act):
        """Stage k returned the activation ``act``."""
        if k not in self.entry.caller:
            self.acts.append((k, weakref.ref(act.untyped_storage()), act.grad_fn if k == 1 else None))

    def finish(self, k, act, source):
        """The end of the call, whose last stage was k and returned ``act`` (a^0's
        storage ``source``): the record learns what the call let go and kept;
        True if the chain stopped short of its recorded stages or a stage saved
        other tensors than recorded (the caller forgets the record)."""
        kc, k = k, self.at(k)   # (a call that skipped stages: Note [Skipped stages], remat/runtime/skips.py)
        if k != len(self.base.stages):
            # a shorter path (Note [Chain keys], remat/chain.py): the backward runs the
            # plan less the stages after it, or else rebuilds from the inputs the plan's
            # prefix held; the record serves it again, unless calls keep taking it (then
            # it is measured, for a plan of its own)
            from .skips import stopped_short   # (skips.py imports paths.py, which this imports)
            short = stopped_short(self, kc)
            self.run.ops, self.run.fall_at, self.run.policy = \
                (short.backward, short.fall_at, short.policy) if short is not None else (None, {}, self.run.policy)
            if len(_shorter) > 1000:
                _shorter.clear()
            last, same, any_ = _shorter.get(self.key, (k, 0, 0))
            same = same + 1 if last == k else 1
            _shorter[self.key] = (k, same, any_ + 1)
            # (depths in turn keep the longest; a chain seen skipping stages, LayerDrop's last
            # layer dropped now and then, four times as long: Note [Skipped stages], remat/runtime/skips.py)
            wait = 4 if self.base.skipped else 1
            if same < wait * SHORTER_AGAIN and any_ + 1 < wait * SHORTER_ANY:
                return False
            _shorter.pop(self.key, None)
            path_changed(self.key, self.site)
            return True
        _shorter.pop(self.key, None)
        if self.stale:
            return True
        path_changes.pop(self.key, None)
        entry = self.base
        entry.quiet += 1   # (after STALE calls in a row on its path, the others go: Note [Paths of a chain])
        if entry.others and entry.quiet > STALE:
            entry.others = []
        if entry is not self.entry:   # (its costs, not the view's, learn what the call kept: not from this one)
            self._suspect_changed(entry, self.at)
        elif not self._suspect_changed(entry):
            watch_caller(entry, act, self.dropped, self.acts, self.run.held_storages(), source)
        return False


def _same_module(record):
    """The tensors in the stage's slots now (None for a function stage) if its module
    is made and set as its ``record`` says (training flags, submodules, parameters'
    dtypes, requires_grad and shapes); else False."""
    if not trained_as(record.in_sig, record.dicts) or not same_structure(record.structure):
        return False
    slots = record.slots
    if not slots[0]:
        return None
    tensors = take(slots[0])
    return tensors if param_flags(tensors, slots[1]) == record.grads else False


def _pin_if_cut(run, out):
    """A stage returned an activation that needs no grad: the run keeps the anchors
    of the stages so far (``Run.pin``) now, while they are alive; this stage's graph,
    which held its own, went as it returned."""
    act = first(out)
    if isinstance(act, torch.Tensor) and not act.requires_grad:
        run.pin()


# what the code around the chain holds (Note [The chain's output] and Note [What
# the forward phase drops], remat/measure/chain_record.py) ------------------------

def _quiet(record):
    """The indices, among a stage's slots (its ``record``'s), of the buffers it did not
    write in place when measured: those a later call watches for new writes
    (``Runner._new_writes``); its state's are written every call."""
    quiet = record.quiet
    if quiet is None:
        slots, n, _ = record.slots
        written = {p for p in record.state if type(p) is int}
        quiet = record.quiet = tuple(i for i in range(n, len(slots)) if i not in written)
    return quiet


def _drops_input(costs, k, whole):
    """Whether the plan counts a^(k-1) as gone once stage k (``Fall``) has run
    (``whole``: a^(k-1) is inside a-bar^(k-1)); Note [What the forward phase drops]."""
    return (costs.fwd_drop_whole if whole else costs.fwd_drop)[k - 2] > 0


def watch_caller(entry, act, dropped, acts, ours, source=None):
    """A call of the chain recorded as ``entry`` (a ``ChainRecord``) ran the plan to
    its end with ``act`` its a^L; ``dropped`` and ``acts`` are (i, weak reference to
    a^i's storage) of the a^i its forward phase let go and of every stage (``acts``
    with the node that made a^1 for stage 1): check them as the chain ends and as
    the backward ends. ``ours`` are the storages remat itself holds (checkpoints,
    which stages returning their input as it is share); ``source`` is a^0's, counted
    in the costs already (a first stage returning a view of its input shares it)."""
    first = acts[0][2] if acts and acts[0][0] == 1 else None
    last = act.untyped_storage() if isinstance(act, torch.Tensor) else None
    # (a last stage returning a view of its input shares a^(L-1)'s storage with a^L)
    watch_output(entry, act, [(i, ref) for i, ref, _ in acts[:-1] if (st := ref()) is not last and st is not source],
                 first)
    ours = [*ours, source]
    kept = [i for i, ref in dropped if (st := ref()) is not None and not any(st is o for o in ours)]
    if kept and not distributed():
        entry.caller_kept(kept)


def watch_output(entry, act, inner=(), first=None):
    """Have ``act``, a^L of a call of the chain recorded as ``entry``, tell at the end
    of its backward whether it is still held, and ``inner``, (i, weak reference to
    the storage of a^i), which of them are, if that backward went through every
    stage (it ran ``first``, the node that made a^1) and let go of its graph; the
    call is in flight until then (``flying``, remat/runtime/executor.py)."""
    if getattr(act, "grad_fn", None) is not None and entry.stages and (stage1 := entry.stages[0].ident()) is not None:
        flying(stage1, act, entry)
    if not isinstance(act, torch.Tensor) or act.grad_fn is None or distributed():
        return
    storage = None if entry.output_held else weakref.ref(act.untyped_storage())
    inner = inner if first is not None else ()
    if storage is None and not inner:
        return
    entry, queued, reached = weakref.ref(entry), [False], [False]

    def seen():
        e = entry()
        if e is None:
            return
        if storage is not None:
            held, was = storage() is not None, e.output_held
            if not was and was is not held:
                e.output_held = held
                e.plans = {}   # (plans made before either knew nothing of it)
                if held:   # (this call's plan counted it let go, or it measured, not knowing)
                    e.output_kept(was is None)
        alive = [i for i, ref in inner if ref() is not None]
        if alive and reached[0] and _releasing():
            e.caller_kept(alive, "through its backward")

    if inner:
        first.register_prehook(lambda _grads: reached.__setitem__(0, True))

    def started(_grads):
        if not queued[0]:
            queued[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(seen)

    act.grad_fn.register_prehook(started)


# weak references Dynamo would trace into their referents (remat/dynamo.py)
DYNAMO_SKIPS.extend([watch_caller, watch_output, flying, in_flight])
