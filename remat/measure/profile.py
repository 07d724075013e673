"""Measuring a stage: times, sizes and transient peaks (docs/how-it-works.md, "How a stage is measured").

Note [Measuring a stage]
------------------------
On the first call of a chain key each stage runs, on its real input, in
this order:

1. The real forward, whose graph the user will backward through, under the
   hooks of a checkpointed stage (its input is kept) and under
   ``Instrument`` (remat/measure/meter.py), which meters the storages the stage
   allocates, notes the tensors it writes in place and times its ops. It
   gives out_bytes, saved_bytes (the distinct storages autograd saved,
   allocated by the stage, plus the output), fwd_tmp and fwd_time. The stage
   runs on its input itself, so that its graph is plain PyTorch's (through a
   copy, the gradients reaching an input with several users were summed in
   another order); the meter refuses an op about to write the input (a
   StageError, the input untouched).
2. The stage's backward on that graph (``retain_graph``), still metered:
   bwd_tmp and bwd_time. It runs as a training step runs it, but for the
   parameters' gradients, which are let go as they come: a step adds each into
   a resident ``.grad``, which the budget does not count, and buffers standing
   in for them would (Note [Measuring within the budget],
   remat/measure/holding.py); that add, the same in every schedule, is in the
   times the next calls refine (Note [Timing the second call]). Saved tensors
   the call keeps none of go once read for the last time; the gradient of the
   input is made and held to the end, not kept. The engine takes the gradients at the
   edges of the input and of the parameters (``edge_backward``, remat/measure/leaves.py), so the input's
   node, the previous stage's, does not run, nor do AccumulateGrad and its
   hooks (FSDP1's post-backward); the input's and parameters' own hooks are
   held back. A
   parameter also used behind the stage (tied weights, see ``Upstream``) has
   its share of the gradient made and dropped, the backward stopping before
   the graph behind the stage runs (Note [Shared leaves] in
   remat/measure/leaves.py). What this backward writes in place is put back.
3. A timed forward without recording, from the RNG and in-place state the
   stage started from (put back after), replayed as the runtime replays a
   recomputation (``Replay``, remat/runtime/recompute.py, whose per-call work is then in the time):
   fwd_nograd_time. Its output is compared, bit for bit, with the real
   forward's (Note [Replaying a stage] 4 in remat/runtime/replay.py). It is
   metered as run 1 is (on CPU, under ``Instrument``, run again untimed; on
   CUDA by the allocator's peak): fwd_nograd_less, what it needs less than
   fwd_tmp (Note [Metering the forward without recording], remat/measure/timing.py).
4. Only when the next stage's backward (run 2 of that stage) hands its
   input a gradient laid out otherwise than the ones run 2 fed this stage
   (a transpose, say): this stage's backward again, on a fresh forward of a
   copy of its input, with a gradient of that layout (``backward_again``, remat/measure/stage_backward.py):
   bwd_time and bwd_tmp. A layout can cost a copy (a ``reshape`` of a
   transposed gradient), which a training step pays. It runs once the next
   stage's saved tensors have gone or been kept, at the start of the stage
   after it or at the chain's end, and cascades: where this backward hands
   its own input yet another layout (an elementwise stage passes on the one
   it got), the stage before runs it too. Its output, where its backward
   reads it, is held to that backward's end, as run 2 holds it (whose
   window leaves it out: a-bar^i counts it through B(i)), so that run 4
   differs from run 2 by the layout alone, whichever of them the budget
   lets run. A step may let it go once the node reading it has run, but
   not where the loop keeps a^L or the caller a stage's output
   (``caller_holds``). Let go in run 4 alone, it put a tied linear stage
   before a BatchNorm 288 bytes under run 2 (its weight's gradient came
   once the output had gone), and a call at a budget with no room for run
   4, on run 2's figures, needed 88 bytes more than the least budget a
   roomy call had named: its next call raised ``BudgetError``. A stage
   whose gradient arrives in another layout where the call has no room for
   its run 4 takes a copy of that gradient more than run 2's
   (``Run4._unmeasured``, remat/measure/stage_backward.py): on run 2's
   figures, later calls went that copy over the budget (3.6-9%).

Run 1 is the one that counts, so RNG streams and BatchNorm statistics end
where one plain forward leaves them. The times of runs 1 and 2 are those of
the ops inside them, the meter's own work left out (it would double them on
small ops): a few per cent below a plain run's wall time, which also has the
model's and PyTorch's Python around the ops. A twin of a stage measured
before skips runs 2 and 3 (Note [Twin stages], remat/measure/twins.py).
Measuring the real forward and
its own backward, rather than separate timed runs, keeps a first call at
two to three plain steps (runs 1 to 3, then the backward, which rebuilds
the stages whose saved tensors did not fit the budget, never the last;
remat/measure/measuring.py ``_keep_saved``). On CUDA the ops run asynchronously and the time
inside the mode is launch time: there a forward and backward on a detached
copy of the input (``timed_step``, remat/measure/timing.py, the lesser of two) give fwd_time and
bwd_time, and the allocator's peak statistics replace the meter for the
peaks; before a chain's first stage is measured there, ``warm_cuda`` has
CUDA's once-per-process set-up done, which would count as that stage's. On CPU the
next two calls' own times replace these (Note [Timing the second call],
remat/measure/refine.py).

Note [An input needing no grad]
-------------------------------
``simulate`` adds x[i-1] at ``B(i)`` for the gradient of the stage's input,
and bwd_tmp is the measured backward's peak less the two gradients it counts
apart (run 2, and run 4 in ``backward_again``). A stage whose input needs no
grad (the chain's first, on data; the first trained stage after frozen ones)
makes no such gradient; its bwd_tmp is that peak less x[i-1] all the same
(never below ``-out_freed``), so that plans count B(i) at what it needs, not
one input's gradient more. The plans of a chain of eight convolution blocks
after a frozen stem, the first three blocks frozen, needed 8.43 MB at least
where 7.38 MB fits; now 7.38 MB.
"""

import torch

from ..errors import StageError, input_modified
from ..runtime.stage_call import check_output, first, out_tensors
from .leaves import grad_side_inputs, node_of, stage_leaves, stop_nodes
from .meter import Instrument, InputWritten, storage_key
from .timing import made_alone
from .cuda_peak import reset_own
from .options import kept_seen
from .record import Probe, StageCosts, StageGraph
from .stage_backward import run_backward

__all__ = ["instrumented_run", "observed_forward", "saved_storages"]


def saved_storages(inst, saved, act, held_elsewhere):
    """{storage: bytes} of the distinct storages among a stage's ``saved`` tensors and
    its output ``act`` that the meter ``inst`` saw it make, less those ``held_elsewhere``
    (counted as held through the step instead, remat/measure/measuring.py; the stage's backward
    lets none of them go, ``Releases`` in remat/measure/timing.py). saved_bytes is
    their sum, at least the output's."""
    keys = {}
    for t in saved + [act]:
        key = storage_key(t)
        if key in inst.created:
            keys[key] = inst.created[key]
    for key in held_elsewhere:
        keys.pop(key, None)
    return keys


def observed_forward(call, ident, x, inst, hooks, saved, rng0, upstream):
    """A stage's forward on ``x`` under the meter ``inst`` and the saved-tensor
    ``hooks`` (whose pack hook appends to ``saved``): what it returned and wrote,
    its RNG use, and what it holds that no schedule lets go (Note [Saved tensors
    held elsewhere], remat/measure/measuring.py). Run 1 of Note [Measuring a
    stage], and all a measuring call runs of a stage whose costs come from a file.

    Returns:
        (a ``Probe`` whose costs hold out_bytes and saved_seen, the stage's
        ``StageGraph``).
    """
    buffers = [(b, b.detach().clone()) for b in ident.buffers()] if isinstance(ident, torch.nn.Module) else []
    stop = stop_nodes((call.args, call.kwargs))
    if x.requires_grad:
        stop.add(node_of(x))
    with inst, torch.enable_grad(), hooks:
        out = call.invoke(x)
    rng0.extra = list(inst.generators.values())   # the stage's own generators, as they were
    uses_rng = rng0.used = rng0.changed()   # (a stage drawing nothing: its runs set no stream)
    inst.note_changed(buffers)
    probe = Probe(out, None, list(inst.mutated.values()), uses_rng, inst.reads_state())
    act = first(out)
    if not isinstance(act, torch.Tensor):
        return probe, StageGraph(stop, [], [], saved, {})
    out_bytes = act.untyped_storage().nbytes()
    # what the stage made and still holds after its forward, other than what autograd
    # saved (through the hooks) and what it returned: tensors on a custom Function's
    # ctx, a module's cache; no mode of the schedule lets them go before B(i). And what
    # autograd saved that something else holds too (Note [Saved tensors held
    # elsewhere], remat/measure/measuring.py)
    returned = out_tensors(out)
    probe.held_outside = inst.alive_bytes(saved + returned)
    probe.cached = made_alone(inst)
    elsewhere, cached = inst.held_elsewhere(saved, returned, besides=[act])
    probe.saved_elsewhere, probe.saved_cached = sum(elsewhere.values()), sum(cached.values())
    keys = saved_storages(inst, saved, act, [*elsewhere, *cached])
    # the output is part of a-bar^i (saved_bytes) for the forward phase, where the next stage
    # needs it; by B(i) the next stage's backward has let it go, unless this stage's own backward
    # reads it: if not, bwd_tmp gives its bytes back (below zero where its own transient is smaller)
    probe.costs = StageCosts(out_bytes, saved_seen=max(sum(keys.values()), out_bytes),
                             kept=kept_seen(inst, keys, storage_key(act), act.is_cuda),
                             out_freed=0 if storage_key(act) in {storage_key(t) for t in saved} else out_bytes,
                             out_of_input=storage_key(act) == storage_key(x))
    # side inputs needing grad (remat/measure/leaves.py grad_side_inputs): their gradients are
    # taken at their edges, as x's is, not as parameters'
    side = grad_side_inputs(call, x) if act.requires_grad else []
    params = [p for p in stage_leaves(act, stop) if p is not x and not any(p is s for s in side)] \
        if act.requires_grad else []
    probe.held_grads = upstream.held_grads(params)
    probe.leaves = {id(p): p.numel() * p.element_size() for p in params}
    return probe, StageGraph(stop, side, [p for p in params if id(p) not in upstream.leaves], saved, keys,
                             [p for p in params if id(p) in upstream.leaves], cached)


def instrumented_run(call, ident, x, rng0, hooks, anchor, upstream, twin=None, release=False):
    """Runs 1 and 2 of Note [Measuring a stage]: the stage's real forward under
    ``Instrument``, then its backward on that graph.

    Args:
        rng0: the RNG state the stage starts from (``capture_rng``).
        hooks: the saved-tensor hooks of the real forward, whose pack hook
            appends to ``anchor.saved`` and whose unpack hook reads it.
        upstream: an ``Upstream`` that has taken in ``x`` and the side inputs.
        anchor: the stage's anchor, whose unpacked tensors a backward that
            frees its graph lets go one by one (remat/runtime/executor.py); the
            backward here keeps the graph and meters as if it did not.
        twin: a ``Twin`` (Note [Twin stages], remat/measure/twins.py): given what
            run 1 showed, it may name a stage measured before whose run 2 this
            one takes instead of running its own.
        release: the call keeps none of the stage's saved tensors for its own
            backward: run 2 lets each go once the backward has read it for the
            last time, as a training step's does (Note [Measuring within the
            budget], remat/measure/holding.py).

    Returns:
        A ``Probe`` (remat/measure/record.py) with the stage's costs.
    """
    # the stage runs on x itself, so that its graph is the one a plain forward makes
    # (a copy in between would sum the gradients reaching x in another order where x
    # has several users: bits apart). The meter refuses an op writing x before it
    # runs (x untouched), and the backward below stops at x without running its node
    inst = Instrument(exclude=[x], sources=[x], protect=x, timeline=True)
    cuda, saved, version = x.is_cuda, anchor.saved, x._version
    inst.sync = cuda   # (options' shares of the time: kernels', not launches'; fwd_time is timed_step's there)
    if cuda:
        torch.cuda.synchronize()
        reset_own()
        base = torch.cuda.memory_allocated()
    try:
        probe, graph = observed_forward(call, ident, x, inst, hooks, saved, rng0, upstream)
        check_output(call, probe.out, x, version)
    except (InputWritten, StageError) as exc:   # (refused: what it wrote goes back, as the call's undo does the
        with torch.no_grad():                     # stages' before it; a stage's own error leaves plain PyTorch's)
            for t, old in inst.mutated.values():
                t.copy_(old)
        if isinstance(exc, InputWritten):
            raise input_modified(call.index, call.name) from None
        raise
    fwd_time = inst.op_seconds
    probe.meta = tuple((t.shape, t.dtype, t.device) for t in saved)
    act = first(probe.out)
    fwd_peak = inst.peak if not cuda else torch.cuda.max_memory_allocated() - base
    forward_writes = dict(inst.mutated)
    costs = probe.costs
    _forward_costs(costs, fwd_time, x, saved, probe.out)
    bwd_delta = in_grad = rebuilt_delta = cast_less = 0
    sums = None
    donor = None
    if twin is not None:
        donor = twin.find((costs.out_bytes, costs.saved_bytes, fwd_peak, costs.out_freed, probe.uses_rng,
                           tuple((t.shape, t.dtype, t.device) for t in saved),
                           tuple((t.shape, t.dtype) for t, _ in forward_writes.values()),
                           tuple(sorted(probe.held_grads.values())),
                           tuple((p.shape, p.dtype) for p in graph.params),
                           _graph_shape(act.grad_fn, graph.stop)))
    if donor is not None:
        probe.take_run2(donor)
    elif act.requires_grad and (x.requires_grad or graph.params or graph.shared):
        # (state the forward wrote, written again by run 2, goes back as the forward left it: a checkpoint
        # inside the stage runs its BatchNorm again in its backward, where only the real backward should)
        inst.again = dict.fromkeys(forward_writes)
        bwd_delta, in_grad, rebuilt_delta, sums, cast_less = run_backward(call, act, x, graph, inst, probe, anchor,
                                                                          release)
        with torch.no_grad():
            for t, value in filter(None, inst.again.values()):
                t.copy_(value)
        inst.again = None
        if not cuda:   # (run 2 holds the output, and the input beside its gradient: more than any B(i))
            # (and the gradient handed in, one element expanded, made outside the meter)
            costs.measure_peak = inst.peak + x.untyped_storage().nbytes() + act.element_size()
    del act
    # the real forward's writes stay (as one plain forward's); the backward's are undone
    with torch.no_grad():
        for key, (t, old) in inst.mutated.items():
            if key not in forward_writes:
                t.copy_(old)
    probe.writes = list(forward_writes.values())
    costs.fwd_tmp = max(0, fwd_peak - costs.out_bytes)
    if donor is None:   # (Note [An input needing no grad])
        costs.bwd_tmp = max(0, bwd_delta - in_grad) - costs.out_freed
        costs.bwd_rebuilt_less = costs.bwd_tmp - (max(0, rebuilt_delta - in_grad) - costs.out_freed)
        costs.bwd_cast_less = costs.bwd_tmp - (max(0, bwd_delta - cast_less - in_grad) - costs.out_freed)
        if sums is not None:
            costs.bwd_tmp_sums = max(0, sums - in_grad) - costs.out_freed
    return probe


def _forward_costs(costs, fwd_time, x, saved, out):
    """Set what run 1 tells of a stage's ``costs``: its forward time, its saved bytes and
    whether it keeps its input (whether its backward reads its output, ``out_freed``,
    is ``observed_forward``'s)."""
    # (saved_seen is what a forward with costs from a file checks them against)
    costs.fwd_time, costs.bwd_time = fwd_time, 0.0
    costs.saved_bytes, costs.saved_seen = costs.saved_seen, None
    # whether the stage, recorded, keeps its input's storage (saved, or returned as a
    # view): if not, the forward phase may let a^(i-1) go (Costs.fwd_drop)
    in_key = storage_key(x)
    returned = out_tensors(out)
    costs.input_kept = any(storage_key(t) == in_key for t in saved + returned)


def _graph_shape(node, stop):
    """The backward graph of a stage, from the node of its output down to the nodes
    in ``stop``, as node types and edges (Note [Twin stages] in remat/measure/measuring.py)."""
    if node is None:
        return None
    order, index, todo = [], {}, [node]
    while todo:
        n = todo.pop()
        if n in index:
            continue
        index[n] = len(order)
        order.append(n)
        todo.extend(m for m, _ in reversed(n.next_functions) if m is not None and m not in stop and m not in index)
    return tuple((type(n).__name__, tuple(-1 if m is None else -2 if m in stop else index[m]
                                          for m, _ in n.next_functions)) for n in order)
