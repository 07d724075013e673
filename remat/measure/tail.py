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
2. Its backward: the nodes of the graph the window made (reached from the
   tensors its ops returned that are alive as the block ends, the loss and
   the logits, down to the chain's output) get hooks that run the same
   meter while each runs, and count the gradients handed to them (made by
   code after the block). So the meter's peak covers the tail's forward and
   backward, but what runs between those nodes (the engine adding up
   gradients) and code after the block.
3. As ``B(L)`` starts (a pre-hook on the node that made a^L), the storages
   the tail made that are still alive, but the gradient it hands the chain
   and the ``.grad`` a first step gives the head's parameters (resident
   from then on, as the budget counts gradients; the leaves are found in
   the tail's graph, or after the block among the ops' arguments), are what
   the code after the block keeps through the backward (``kept``). Where
   the tail took a tensor from before the chain that needs grad (a residual
   around the chain, ``head(chain(x) + x)``), the gradient it hands the
   chain is kept too: an add hands that tensor the same one, which waits
   with its node for the chain's backward to end.
   Where a^L needs no gradient and the tail's graph does (linear probing: a
   head trained on a frozen chain), no ``B(L)`` comes: the tail's backward is
   the step's, and the figures are taken as it ends (a callback queued on the
   engine as its first node runs; before, the tail's forward alone was
   counted, and such steps peaked at 2.5 times the least budget named).
   Until a backward has shown them, the tail counts as its forward's peak,
   kept by no one: the least it can need. The measuring call's plan, made
   as its block ends, is for a later call: it is solved again once the
   call's backward has run (and ``explain()`` shows that plan), and a budget
   it does not fit could not hold the tail's forward.
4. The chain's output a^L is under the meter from the window's start: the
   chain's end counts it (in a-bar^L, or on its own as the tail's input),
   but a head that copies it (a linear layer on a transposed activation)
   and saves the copy lets it go before its peak, and the chain's end is
   then that much lower. The meter's figures less a^L's bytes (as it
   starts) are the tail's; a^L alive as ``B(L)`` starts is not kept. In the
   tail's backward, though, a^L's bytes come off only where the meter
   counts them or plans count them in a-bar^L for nothing: where a^L went
   while metered (the measuring call kept none of the last stage's saved
   tensors) but the last stage's own backward reads it (``_Output.read``),
   later calls hold it in a-bar^L beside the tail, and taken off there its
   backward's peak came out one output under theirs (16% over a small
   chain's budget). So where an option of the last stage keeps a^L (a kept
   op made it, ``output_held_later``): plans recording it whole then count
   it one output high at the tail (an option's ran one output over).

5. The meter stays past the block (remat/measure/linger.py): the head and
   the loss may come after it (``return self.head(x)``, or a base model's
   final norm inside the block and the caller's head and loss after it: a
   tail taken to end with the block put such steps up to 3.4 times over the
   budget). It meters the code after the block, the tail's forward and its
   backward, until ``B(L)`` starts, and its figures then are the tail's as
   in 3, its forward and backward as one: its forward's own peak is the
   meter's at the first op run inside a backward (``_Backward.watch``),
   which ``TailSeen.costs`` charges apart from the backward's where
   autocast's casts go at the loss (remat/solver/casts.py: in bf16 the one
   peak read a logits tensor high with every cast alive). Where a^L needs no
   gradient, it meters to the backward's end, as in 3 (it stayed only where a^L
   needed one: a frozen chain's head after the block went 367% over). It stays
   only on a dispatch-mode stack of remat's own meters,
   and not under torch.distributed (every rank runs rank 0's
   schedule, and each rank's code after the block is its own): elsewhere
   the tail is what ran inside the block, as in 1-3, and code after the
   block is not metered.

6. A chain opened before the backward reached this one (the same chain run
   twice in one forward, a siamese encoder's two views; an encoder chain,
   then a decoder chain) cuts the tail short (``TailSeen.cut``): what came
   after, the next call and the head, went unmetered. The record's later
   calls then meter their own tail, as a measuring call does (``TAIL_TRIES``
   of them at most): the second call of the same chain meters the head and
   the loss, which both calls' plans then count (before, they counted
   nothing of it: a 6-block chain run twice peaked at 5 times its budget).
   One whose tail is cut short every time (a decoder follows) keeps what it saw.

No window is opened where Dynamo runs the frame (what follows may run compiled).
Modes the caller entered before stay under the meter, and see what it lets
through. One of them left inside a window pops the meter instead (torch pops
the top mode), and the meter's exit pops that one: the stack ends as it
began, and the meter missed the rest of the window. What the tail measured,
and what was not seen, ``remat.explain().tail`` says.
"""

import time
import warnings
import weakref

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..dynamo import enter_eager, exit_eager, in_compiled_frame
from ..runtime.executor import distributed
from ..runtime.replay import weight_caches
from ..errors import RematError
from .leaves import stop_nodes, walk
from .linger import alone, downstream, linger, release
from .meter import Instrument, storage_key
from .record import TailSeen   # (what it saw: re-exported, as before)

__all__ = ["TAIL_TRIES", "TailMeter", "TailSeen", "abandoned", "backward_seen", "output_held_later"]

TAIL_TRIES = 2   # running calls whose tail was cut short after which a record keeps what it saw (6 of the Note)


class TailMeter:
    """The windows between a measuring call's stages, and the last one, its tail
    (Note [The chain's tail])."""

    def __init__(self):
        self.meter = None
        self.why = "nothing ran after the last stage inside the chain's block"
        self.after = None   # the _Backward of a tail to meter past the block (Note [The chain's tail] 5)

    def open(self, act, compiled=False):
        """A stage returned ``act``: meter what runs until the next stage or the block's
        end (not where the chain opened in a frame Dynamo runs: ``compiled``), and
        ``act`` from now on (Note [The chain's tail] 4)."""
        self.close()
        if compiled or in_compiled_frame():
            self.why = "the code after the last stage runs in a frame torch.compile compiled"
            return
        self.meter = Instrument(writes=False)
        self.meter.made, self.meter.grad_reads, self.meter.leaves = [], {}, {}
        self.meter.count(act)
        enter_eager(self.meter)   # (compiled code in the window, a compiled head, runs eagerly: remat/dynamo.py)

    def close(self):
        """The window ends (the next stage is called, or the block ended with an
        error); what it metered is let go."""
        meter, self.meter = self.meter, None
        if meter is not None:
            exit_eager(meter)

    def seen(self, act, outputs, on_kept, read=False):
        """The block ended after the last stage returned ``act`` (a^L; ``outputs`` are
        the activations every stage returned): what the last window saw
        (``TailSeen``); its backward is metered (Note [The chain's tail] 2), and
        ``on_kept(seen)`` is called as ``B(L)`` starts, the backward's figures set;
        ``read``: later calls may hold a^L (``output_held_later``)."""
        meter, self.meter = self.meter, None
        if meter is None:
            return TailSeen(why=self.why)
        stayed = any(m is meter for m in _get_current_dispatch_mode_stack())   # (not popped by another's exit)
        exit_eager(meter)
        made, meter.made = meter.made, None
        node = act.grad_fn if isinstance(act, torch.Tensor) else None
        free = isinstance(act, torch.Tensor) and not act.requires_grad   # (a^L needing no gradient: 3 of the Note)
        if stayed and (node is not None or free) and alone() and not distributed():   # (5 of the Note)
            out = _Output(meter, act, read)   # (what ran inside the block so far: the call's end holds it)
            seen = meter.seen = TailSeen(True, max(0, meter.peak - out.bytes), meter.live - out.alive(),
                                         after_block=True)   # (``settle`` marks it cut short)
            self.after = back = _Backward(meter, out, seen, on_kept, outputs)
            back.prev, meter.watch = meter.watch, _watching(weakref.ref(back), meter.watch)   # (``watch``)
            if free:   # (to the backward's end, ``watch``; no graph's hook holds it: the meter does)
                back.queued, meter.back = False, back
            else:   # (a hook on a^L's gradient runs before its node's, the rebuilds of the measuring call's backward)
                act.register_hook(lambda g: back.begin((g,)))
            return seen
        if not made:   # (a tail of nothing, known as such)
            return TailSeen(kept=0, backward_peak=0, backward_seconds=0.0,
                            why="nothing ran after the last stage inside the chain's block, and the code "
                                "after the block was not metered (a dispatch mode of another's was active, "
                                "or torch.distributed): have the head and loss "
                                "inside it")
        out = _Output(meter, act, read)
        seen = TailSeen(True, meter.peak - out.bytes, meter.live - out.alive(), None, None, meter.op_seconds)
        roots = {t.grad_fn for ref in made if (t := ref()) is not None and t.grad_fn is not None}
        if roots and isinstance(act, torch.Tensor) and not act.requires_grad:
            # (a^L needs no gradient, the tail's graph does (linear probing, its head trained): its backward is
            # the step's, metered to its end, the engine's callback (it was not: every call 148% over))
            _Backward(meter, out, seen, on_kept, outputs).hook(walk(roots, stop_nodes(outputs)), None)
            return seen
        if node is None or not roots:
            seen.kept, seen.backward_peak, seen.backward_seconds = seen.alive, seen.peak, 0.0
            return seen
        _Backward(meter, out, seen, on_kept, outputs).hook(walk(roots, stop_nodes(outputs)), node)
        return seen

    def linger(self, record=None):
        """The measuring call of ``record`` is over: meter the code after the block
        until ``B(L)`` starts (Note [The chain's tail] 5). Where the call's graph goes
        with no backward (an output dropped unused), the tail's backward is unseen and
        the record's next call measures again (else a plan on its forward alone ran 63%
        over the budget)."""
        after, self.after = self.after, None
        if after is not None:
            after.t0 = time.perf_counter()
            after.meter.leaves = {} if after.meter.leaves is None else after.meter.leaves
            linger(after.meter)
            after.meter.record = weakref.ref(record) if record is not None else None
            weakref.finalize(after, release, after.meter, abandoned)   # (the hooks on the graph hold ``after``)


def abandoned(meter, entry=None, x=None):
    """The measuring call that left ``meter`` past its block will see no backward: its
    graph is gone, or (``entry`` its record, opened again on ``x``) a new step began
    that ``x`` was not made from (linger.py ``downstream``; the same forward opening
    the chain again goes on to the backward). Its tail's backward unseen, the
    record's next call measures again."""
    record = getattr(meter, "record", None)
    record = record() if record is not None else None
    if record is None or record.tail is None or record.tail.kept is not None or record.abandoned:
        return   # (once: a loop of forwards with no backward would measure every call)
    if entry is None or (record is entry and not downstream(x)):
        record.remeasure = record.abandoned = True


def output_held_later(stages, options):
    """Whether later calls may hold a^L beside the tail (4 of Note [The chain's tail]): the
    last stage's backward reads it, or a kept op made it, which its ``options`` keep."""
    costs = stages[-1].costs if stages else None
    return costs is not None and (costs.out_freed == 0 or bool(options and costs.kept and costs.kept.out_kept))


def _watching(back, prev):
    """The meter's watch calling ``back().watch``: by a weak reference (the meter holding its
    ``_Backward`` would keep a record whose backward never comes alive, and the meter on)."""
    def watch(func, args, kwargs, ran):
        live = back()
        if live is not None:
            live.watch(func, args, kwargs, ran)
        elif prev is not None:
            prev(func, args, kwargs, ran)
    return watch


class _Output:
    """a^L under the tail's meter, counted from the window's start (Note [The chain's
    tail] 4): the meter's figures, less ``bytes``, are the tail's above the chain's end."""

    def __init__(self, meter, act, read=False):
        self.meter, self.read = meter, read   # (read: later calls may hold a^L: 4 of the Note)
        self.key = storage_key(act)
        self.bytes = meter.created.get(self.key, 0)
        self.storage = weakref.ref(act.untyped_storage())

    def alive(self):
        """a^L's bytes if it is still alive. By its storage, not by the meter's key alone:
        a storage made where a^L's was (its gradient, in 1 of 10 measuring calls of a
        small chain) would count as a^L, and the tail's kept bytes come out that much
        under what the caller keeps, by which later calls went over the budget."""
        return self.meter.created.get(self.key, 0) if self.storage() is not None else 0


class _Backward:
    """The tail's backward under the meter, node by node, to ``B(L)``'s start
    (Note [The chain's tail] 2-3). The hooks hold it, and it the meter, while
    the graph lives: a backward that never comes lets them go."""

    def __init__(self, meter, out, seen, on_kept, outputs=()):
        self.meter, self.out, self.seen, self.on_kept = meter, out, seen, on_kept
        # (the stages' outputs: a tensor the tail takes needing grad, none of these nor its own, is from before)
        self.chain = {storage_key(t) for t in outputs if isinstance(t, torch.Tensor)}
        self.leaves = []   # (weak references to the leaves whose gradients the tail makes)
        self.done = False
        self.t0 = None
        self.seconds = 0.0
        self.forward = None   # the meter's peak before the backward, and the backward's above a^L so far
        self.most, self.prev, self.queued = 0, None, None

    def watch(self, func, args, kwargs, ran):
        """(After the block, no node hooked) the first op of a backward: the forward's peak is over."""
        if self.prev is not None:
            self.prev(func, args, kwargs, ran)
        if not ran and self.forward is None and torch._C._current_graph_task_id() >= 0:
            self.forward, self.meter.peak = self.meter.peak, self.meter.live
            self._queue()

    def hook(self, nodes, last):
        for node in nodes:
            node.register_prehook(self.enter)
            node.register_hook(self.leave)
            variable = getattr(node, "variable", None)   # (an AccumulateGrad's leaf)
            if isinstance(variable, torch.Tensor):
                self.leaves.append(weakref.ref(variable))
        if last is not None:
            last.register_prehook(self.begin)
        else:   # (no B(L): the backward's end is the tail's, ``enter``)
            self.queued = False

    def enter(self, grads):
        if self.done:
            return
        # each node's peak taken apart, a^L's bytes off where plans count them at BTail in a-bar^L
        # and the meter does not: a^L gone here (a head that copied a transposed a^L saves only the
        # copy) but kept by the last stage's saved tensors in later calls (``read``) is not taken
        # off twice (it put later calls one output over the budget)
        if self.forward is None:
            self.forward = self.meter.peak
        self.meter.peak = self.meter.live
        for g in grads:
            if isinstance(g, torch.Tensor):
                self.meter.count(g)   # (made by code after the block, which is not metered)
        self.meter.__enter__()
        self.t0 = time.perf_counter()
        self._queue()

    def _queue(self):
        """No ``B(L)`` comes (a^L needs no gradient): the backward's end is the tail's."""
        if self.queued is False:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.begin(()))

    def leave(self, _grad_inputs, _grad_outputs):
        if self.t0 is None:
            return
        self.meter.__exit__(None, None, None)
        self.seconds += time.perf_counter() - self.t0
        self.t0 = None
        out = self.out
        self.most = max(self.most, self.meter.peak - (out.bytes if out.alive() or not out.read else 0))

    def begin(self, grads):
        """``B(L)`` starts: the tail's backward is over. What it made that is alive
        but the gradient it hands the chain (which ``Loss`` counts) is kept."""
        if self.done:
            return
        self.done = True
        meter, seen = self.meter, self.seen
        if seen.casts:   # (solver/casts.py; an engine thread's state is that of the thread that called backward)
            seen.casts = "freed" if weight_caches() == (False, False) else "held"
        if seen.after_block:   # (5 of the Note: the meter's work is over; remat's next entry takes it off)
            seen.cut, meter.off = seen.cut or meter.cut, True
            if self.t0 is None:   # (the call raised before the meter could stay)
                return
        try:   # (not one expanded from less, a loss's seed: its maker, backward(), holds that to the end)
            handed = sum(meter.created.get(storage_key(g), 0) for g in grads if isinstance(g, torch.Tensor)
                         and g.untyped_storage().nbytes() >= g.numel() * g.element_size())
        except (NotImplementedError, RuntimeError):   # (a gradient batched by vmap: is_grads_batched)
            seen.metered, seen.why = False, "its backward ran under torch.func.vmap (batched gradients)"
            return
        shapes = {g.shape for g in grads if isinstance(g, torch.Tensor)}
        if any(shape in shapes for key, shape in (meter.grad_reads or {}).items() if key not in self.chain):
            # the tail took a tensor from before the chain that needs grad, shaped as the gradient it
            # hands the chain (a residual around the chain): it may hand it that very gradient (an add
            # hands on the same), which then waits with that tensor's node for the chain's backward to
            # end, kept (4% over a budget before); where it does not, one gradient more is counted
            handed = 0
        out = self.out
        # a leaf's .grad made here (the first step's) is resident from then on, as the chain's parameters' are
        leaves = self.leaves + list((meter.leaves or {}).values())   # (those the code after the block took)
        grads = {storage_key(v.grad) for v in (r() for r in leaves) if v is not None and v.grad is not None}
        made = sum(meter.created.get(key, 0) for key in grads)
        # (at least 0: a full-suite run once gave a negative kept, which Costs refuses; not reproduced since)
        seen.kept = max(0, meter.live - handed - made - out.alive())
        if seen.after_block and self.forward is not None:   # (``watch`` saw the backward start: the whole
            off = out.bytes if out.alive() or not out.read else 0   # peak as one meter's, and the forward's)
            forward, whole, meter.watch = self.forward - off, max(self.forward, meter.peak) - off, self.prev
        else:
            forward = meter.peak if self.forward is None else self.forward   # (a^L's off as in ``leave``)
            forward -= out.bytes if out.alive() or not out.read or self.forward is not None else 0
            whole = max(forward, self.most)
        seen.backward_peak, seen.backward_seconds = max(0, whole), self.seconds
        if seen.after_block:   # (its forward's own peak where ``watch`` saw the backward start)
            seen.peak, seen.alive = max(0, forward), seen.kept
            seen.backward_seconds = time.perf_counter() - self.t0
        self.on_kept(seen)


def backward_seen(new, spec, budget, published, plan_for, seen):
    """A measuring call's backward reached its chain (``spec``): the chain's record
    ``new`` learns what the tail's backward needed and what the caller keeps (Note
    [The chain's tail], remat/measure/tail.py); ``explain()``, if it still shows
    that call (``published[0]``), shows the plan the next call will run (its
    error, that call raises; ``plan_for`` solves it, remat/runtime/chain_call.py)."""
    if new is None:
        return
    new.tail_seen(seen)
    if published[0] is None or spec.last is not published[0]:
        return
    try:
        plan = plan_for(new, budget, spec)
    except RematError as exc:   # (this call's plan was made before its tail's backward showed what it needs)
        warnings.warn(f"{exc}. The chain's first call learnt it as its backward reached the chain (the head and "
                      f"loss needed more than their forward showed): this call runs on, maybe over the budget, "
                      f"and the next one raises this error", RuntimeWarning)
        return
    spec.explained(plan.costs, plan.schedule, budget, new.names, new.costs, new)
