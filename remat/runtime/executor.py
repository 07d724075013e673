"""Executing a plan with saved-tensor hooks (docs/how-it-works.md, "The runtime").

Note [The life of a saved tensor]
---------------------------------
1. In the forward phase a stage whose op is ``Fall`` runs with no hooks at all: autograd
   keeps what it saves, exactly as in plain PyTorch. A stage run as ``Fn`` or ``Fck`` runs
   under a pack hook that hands autograd a small ``_Saved`` handle (stage anchor, index)
   instead of the tensor, so nothing it saves outlives the stage.
2. Each such stage has an ``_Anchor``: the stage's input a^(i-1) when it is held (``Fck``
   keeps it), and, once recomputed, the list of its saved tensors. Only the handles hold the
   anchor strongly; the ``Run`` holds it weakly. When the engine has run the last node of
   stage i it releases the handles, the anchor goes, and with it a^(i-1) and a-bar^i:
   exactly the moment ``B(i)`` frees them in ``simulate``. With ``retain_graph=True`` the
   handles stay, and so does what a second backward needs. Without it, each recomputed
   tensor is let go as soon as the engine has unpacked it, so it lives until the node that
   uses it has run, as what autograd saves itself does (``_unpack``; the measuring call
   meters a stage's backward so, remat/measure/stage_backward.py).
3. When the engine is about to run the last node of stage i (the first of its backward: a
   pre-hook, ``Run.watch``), or else the first time it unpacks a handle of stage i whose
   anchor holds no saved tensors, ``Run.materialize(i)`` executes the schedule's ops from
   its cursor up to the ``Fall(i)`` that makes a-bar^i: ``Fn``/``Fck`` under ``no_grad``,
   ``Fall`` with grad enabled under a collecting pack hook. ``B`` ops are the engine's own
   and are skipped. A recomputed a^k goes to the anchor of stage k+1, ``Fn(k+1)`` drops it
   again. Rebuilding before the stage's first node, not at its first unpack, keeps what the
   nodes ahead of that unpack allocate (a gradient copied to another layout, say) after the
   recomputation, where ``simulate`` counts it (in bwd_tmp).
4. If the cursor has already passed that ``Fall(i)`` (the engine visited
   stages out of chain order) or the run has no ops (a measuring call),
   stage i is rebuilt from the nearest held input below it. Slower, never
   wrong.
5. Every recomputation (remat/runtime/recompute.py) replays RNG, autocast and
   in-place state (remat/runtime/replay.py), and its saved tensors are checked
   against what the first forward saved (count, shape, dtype, device).
"""

import time
import weakref

import torch

from ..errors import StageError
from ..solver.schedule import B, Fall, Fn
from .recompute import record_again, run_again
from .option_modes import keep_only, option_contexts

__all__ = ["Run", "RELEASES", "distributed"]

# Whether the engine says if the graph it runs is kept (torch >= 2.5, which remat
# requires); without that, recomputed tensors would stay until their stage's backward ends.
_keep_graph = getattr(getattr(torch._C, "_autograd", None), "_get_current_graph_task_keep_graph", None)
RELEASES = _keep_graph is not None

class _Anchor:
    __slots__ = ("run", "stage", "input", "version", "saved", "versions", "observe", "live", "cache", "__weakref__")

    def __init__(self, run, stage):
        self.run, self.stage, self.input = run, stage, None
        self.version = 0      # the input's version counter when it was taken
        self.saved = None
        self.versions = None  # version counters of ``saved`` as packed, where they were not recomputed
        self.observe = None   # called with each unpacked index instead of releasing (measuring)
        self.live = None      # what the stage saved so far, while its forward-phase run lasts
        self.cache = None     # an option's recompute mode and its cache (remat/runtime/option_modes.py)


class _Saved:
    __slots__ = ("anchor", "index")

    def __init__(self, anchor, index):
        self.anchor, self.index = anchor, index


def distributed():
    """True under an initialised process group of more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _releasing():
    """True in a backward that frees its graph as it goes (Note [The life of a saved tensor], 2)."""
    if _keep_graph is None:
        return False
    try:
        return not _keep_graph()
    except RuntimeError:   # not inside a backward (a saved tensor read directly)
        return False


def _unpack(handle):
    anchor = handle.anchor
    live = anchor.live
    if live is not None:   # (read inside the stage's own forward: a torch.autograd.grad there)
        return live[handle.index]
    saved = anchor.saved
    if saved is None or saved[handle.index] is None:
        anchor.saved = None   # (the second case: released, then asked for again)
        anchor.run.materialize(anchor.stage)
        saved = anchor.saved
    t = saved[handle.index]
    versions = anchor.versions
    if versions is not None and t._version != versions[handle.index]:
        raise StageError(
            f"remat: a tensor stage {anchor.stage} saved for its backward was modified in place after "
            f"its forward (version {versions[handle.index]}, now {t._version}), as plain PyTorch would "
            f"say; change a copy (.clone()), or change it after the backward")
    if anchor.observe is not None:
        anchor.observe(handle.index)
    elif _releasing():
        saved[handle.index] = None
    return t


def _unchanged(anchor, x):
    """``x``, the input ``anchor`` holds, if it was not modified in place since it was taken."""
    if x._version != anchor.version:
        k = anchor.stage
        what = "the chain's input" if k == 1 else f"the input of stage {k}"
        raise StageError(f"remat: {what} was modified in place between the forward and the backward; remat keeps it "
                         f"to recompute stage {k} in the backward, from the values its forward used. Change a copy "
                         f"(.clone()), or change it after the backward")
    return x


_FLIGHTS = weakref.WeakKeyDictionary()   # a first stage's object -> its calls in flight (``flying``)


class _InFlight:
    """A call in flight, until the backward reaches a^L (``end``); ``later``: the calls opened meanwhile."""
    __slots__ = ("ended", "task", "record", "later", "__weakref__")

    def __init__(self, record):
        self.ended, self.task, self.record, self.later = False, None, weakref.ref(record), []

    def end(self, _grad):
        self.ended, self.task = True, torch._C._current_graph_task_id()
        for f in (r() for r in self.later):
            if f is not None and f.ended and f.task == self.task and (record := f.record()) is not None:
                record.overlap_seen, record.plans = True, {}


def flying(ident, act, record):
    """A call of ``record`` whose first stage is ``ident`` ended its forward with ``act`` (a^L): in flight
    until the backward reaches a^L (a hook on its gradient, run before its node's pre-hooks, which may
    raise) or its graph goes (Note [Calls alive together], remat/measure/overlap.py)."""
    flight, alive = _InFlight(record), in_flight(ident)
    act.register_hook(flight.end)
    _FLIGHTS[ident] = [*alive, weakref.ref(flight)]
    for r in alive:
        r().later.append(_FLIGHTS[ident][-1])
        record.overlap_probe = (flight, alive)


def in_flight(ident=None):
    """Weak references to the calls in flight whose first stage is ``ident`` (any chain key), or (None) any's."""
    return [r for key in ((ident,) if ident is not None else list(_FLIGHTS)) for r in _FLIGHTS.get(key, ())
            if (f := r()) is not None and not f.ended]


class Run:
    """One execution of a chain: the stage calls and the backward cursor."""

    def __init__(self, plan, autocast):
        self.ops = plan.backward if plan is not None else None   # the backward phase's ops, or None
        self.fall_at = plan.fall_at if plan is not None else {}   # stage -> index in ops of its Fall
        self.policy = plan.policy if plan is not None else None   # (k, option) -> what it keeps
        self.cursor, self.held_before = 0, 0   # (held_before: what stages before a measuring part hold, paths.py)
        self.calls, self.anchors = [None], [None]   # 1-based: StageCalls, weak references to anchors
        self.orphans = {}         # stage -> anchor of a stage autograd saved nothing of
        self.passed = set()       # such stages the engine has backwarded (``settle``)
        self.whole, self.option = [False], [0]   # recorded in the forward phase (Fall), and with what option
        self.autocast, self.clock = autocast, None   # (clock: StageTimes of a call that refines the times, refine.py)
        self.pinned, self.holds = [], None   # anchors the run keeps (``pin``); a measuring call's ``rebuild_holds``

    # forward phase ------------------------------------------------------

    def new_anchor(self, call, keep_input, x, option=0):
        """Register stage ``call.index`` as dropped by hooks (recorded with ``option``,
        if any); return (its anchor, the pack hook that hands autograd handles to
        it, a one-item list counting them)."""
        anchor = _Anchor(self, call.index)
        if keep_input:   # (a leaf needing grad itself: recompute.record_again)
            anchor.input, anchor.version = x if x.is_leaf and x.requires_grad else x.detach(), x._version
        self._register(call, weakref.ref(anchor), False, option)
        count = [0]

        def pack(tensor):
            count[0] = (i := count[0]) + 1
            live = anchor.live
            if live is not None:
                live.append(tensor)
            return _Saved(anchor, i)

        return anchor, pack, count

    def add_whole(self, call):
        """Register a stage run with no hooks (Fall in the forward phase)."""
        self._register(call, None, True, 0)

    def _register(self, call, anchor, whole, option):
        self.calls.append(call)
        self.anchors.append(anchor)
        self.whole.append(whole)
        self.option.append(option)

    def keeps_output(self, k):
        """Stage k's forward-phase record holds its output (recorded whole, or with an option)."""
        return self.whole[k] or self.option[k] > 0

    def settle(self, anchor, packed, x):
        """After a hooked forward: a stage autograd saved nothing of has no handle to
        keep its anchor alive, so the run keeps it (without a reference back, so no
        cycle) until the backward has passed below it: until the engine is about to
        run the node that made the stage's input ``x`` (the previous stage's
        backward starts, and B(i) has freed a^(i-1) in ``simulate``), or the
        cursor passes B(i), or the backward of a stage below it begins (``watch``)."""
        if packed == 0:
            anchor.run = None
            self.orphans[anchor.stage] = anchor
            node = x.grad_fn
            if node is not None:
                run, stage, held = weakref.ref(self), anchor.stage, weakref.ref(anchor)

                def passed(_grads):
                    r, a = run(), held()
                    if r is not None and a is not None and r.orphans.get(stage) is a:
                        del r.orphans[stage]
                        r.passed.add(stage)   # a rebuild of it the cursor has not reached is moot

                node.register_prehook(passed)

    def pin(self):
        """A stage returned an output that needs no grad (a detach, an argmax): the
        graphs of the stages before it, which held their anchors, are cut off and go,
        while recomputing a later stage may still need their inputs. The run keeps
        them from now on, as the plan does (their B(i) never comes)."""
        self.pinned = [a for a in (self._anchor(k) for k in range(1, len(self.anchors))) if a is not None]

    def held_storages(self):
        """The storages of the stage inputs the run's anchors hold (a list)."""
        anchors = [ref() for ref in self.anchors[1:] if ref is not None] + list(self.orphans.values())
        return [a.input.untyped_storage() for a in anchors if a is not None and a.input is not None]

    hooks = staticmethod(lambda pack: torch.autograd.graph.saved_tensors_hooks(pack, _unpack))

    @staticmethod
    def watch(anchor, act):
        """Rebuild stage ``anchor.stage`` as its backward starts, before any of its
        nodes runs (Note [The life of a saved tensor], 3): the weak reference lets
        the anchor go with the stage's handles, though the node and its hook stay."""
        node, ref = act.grad_fn if isinstance(act, torch.Tensor) else None, weakref.ref(anchor)
        if node is None:
            return

        def begin(_grads):
            a = ref()
            run = a.run if a is not None else None
            if run is not None and run.orphans:   # (the stages above passed B(i), where no node told ``settle``)
                run.passed.update(i for i in run.orphans if i > a.stage)
                run.orphans = {i: o for i, o in run.orphans.items() if i <= a.stage}
            if run is not None and a.saved is None:
                run.materialize(a.stage)

        node.register_prehook(begin)

    # backward phase -----------------------------------------------------

    def _anchor(self, k):
        ref = self.anchors[k] if k < len(self.anchors) else None
        anchor = ref() if ref is not None else None
        if anchor is None:
            anchor = self.orphans.get(k)
        return anchor

    def _input(self, k):
        anchor = self._anchor(k)
        if anchor is None:   # (what it saved went with a graph it let go, its input returned: made again)
            return self._rebuild(k, record=False)
        if anchor.input is None:
            raise StageError(f"remat: the input of stage {k} is needed to recompute it but is no longer held; "
                             f"please report this bug")
        return _unchanged(anchor, anchor.input)

    def _give(self, k, x):
        """Hand a^(k-1) = x to stage k's anchor, if that stage still needs it."""
        if k < len(self.anchors):
            anchor = self._anchor(k)
            if anchor is not None and anchor.input is None:
                anchor.input = x
                anchor.version = x._version

    def materialize(self, k):
        """Recompute what stage k's backward needs (Note [The life of a saved tensor], 3-4)."""
        clock = self.clock
        if clock is None:
            self._materialize(k)
            return
        t0 = time.perf_counter()
        try:
            self._materialize(k)
        finally:
            clock.rebuilt(t0, time.perf_counter())

    def _materialize(self, k):
        ops = self.ops
        pos = self.fall_at.get(k) if ops is not None else None
        if pos is not None and pos >= self.cursor:
            start, self.cursor = self.cursor, pos + 1
            for op in ops[start:pos + 1]:
                i = op.stage
                if type(op) is not B:
                    if i not in self.passed:
                        self._execute(op, i)
                elif i in self.orphans:
                    del self.orphans[i]   # B(i) is behind the cursor: its anchor can go
            anchor = self._anchor(k)
            if anchor is not None and anchor.saved is not None:
                return
        self._rebuild(k)

    def input_of(self, k):
        """Stage k's input: its anchor's, or else made again from the nearest input
        held below it, the stages between run without recording."""
        anchor = self._anchor(k)
        if anchor is not None and anchor.input is not None:
            return _unchanged(anchor, anchor.input)
        return self._rebuild(k, record=False)

    def _rebuild(self, k, record=True):
        j = k
        while j >= 1:
            anchor = self._anchor(j) if not self.whole[j] else None
            if anchor is not None and anchor.input is not None:
                break
            j -= 1
        if j < 1:
            raise StageError(f"remat: no held input to rebuild stage {k} from; please report this bug")
        if any(self.whole[j:k]):   # (Note [Stages recorded whole], remat/runtime/runner.py)
            raise StageError(f"remat: rebuilding stage {k} would run a stage recorded whole again; please "
                             f"report this bug")
        anchor = self._anchor(j)
        x = _unchanged(anchor, anchor.input)
        holds = self.holds(self, j, k) if self.holds is not None and k - j > 1 else ()
        for i in range(j, k):
            x = self._forward(self.calls[i], x)
            if i + 1 in holds:   # (a measuring call holds it again: remat/measure/holding.py)
                self._give(i + 1, x)
        if not record:
            return x
        self._record(k, x)

    def _execute(self, op, i):
        if type(op) is Fall:
            self._record(i, self._input(i), op.option)
            return
        anchor = self._anchor(i)
        out = self._forward(self.calls[i], self._input(i))
        if type(op) is Fn and anchor is not None and not (i > 1 and self.keeps_output(i - 1)):
            anchor.input = None
        self._give(i + 1, out)

    def _forward(self, call, x):
        """Run ``call`` again on ``x`` without recording, replaying its state; return its
        output (detached)."""
        clock = self.clock
        if clock is None:
            return run_again(call, x, False, self.autocast)
        t0 = time.perf_counter()
        out = run_again(call, x, False, self.autocast)
        clock.recomputed(call.index, time.perf_counter() - t0)
        return out

    def _record(self, k, x, option=0):
        """Fall(k): recompute stage k recording, collect what autograd saves (with an option, its cache)."""
        clock = self.clock
        anchor = self._anchor(k) if clock is not None and not option else None
        cached = anchor is not None and anchor.cache is not None   # (the rebuild of an option's record)
        t0 = time.perf_counter()
        self._recorded(k, x, option)
        if clock is not None:
            clock.recorded(k, time.perf_counter() - t0, option, cached)

    def _recorded(self, k, x, option):
        anchor = self._anchor(k)
        if option:
            forward, cache = option_contexts()
            out, saved = record_again(self.calls[k], x, self.autocast, forward)
            keep_only(cache, self.policy(k, option), saved, out)
            if anchor is not None:
                anchor.cache = cache
                self._give(k + 1, out)
            return
        if anchor is None:
            record_again(self.calls[k], x, self.autocast)
            return
        cache, anchor.cache = anchor.cache, None   # (read once: a later rebuild runs the whole stage)
        out, saved = record_again(self.calls[k], x, self.autocast, cache)
        anchor.saved = saved
        anchor.versions = None
        self._give(k + 1, out)
