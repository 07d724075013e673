"""Measuring a stage: times, sizes and transient peaks (DESIGN.md section 3).

Note [Measuring a stage]
------------------------
On the first call of a chain key each stage runs, on its real input, in
this order:

1. The real forward, whose graph the user will backward through, under the
   hooks of a checkpointed stage (its input is kept) and under
   ``Instrument`` (remat/meter.py), which meters the storages the stage
   allocates, notes the tensors it writes in place and times its ops. It
   gives out_bytes, saved_bytes (the distinct storages autograd saved,
   allocated by the stage, plus the output), fwd_tmp and fwd_time. The stage
   runs on its input itself, so that its graph is plain PyTorch's (through a
   copy, the gradients reaching an input with several users were summed in
   another order); the meter refuses an op about to write the input (a
   StageError, the input untouched).
2. The stage's backward on that graph (``retain_graph``), still metered:
   bwd_tmp and bwd_time. It runs as a training step runs it: parameter
   gradients are added into ``.grad`` buffers swapped in for the run and out
   after (``GradPool``, remat/leaves.py); the gradient of the input is made
   and held to the end, not kept. The engine takes the gradients at the
   edges of the input and of the parameters (``_backward``), so the input's
   node, the previous stage's, does not run, nor do AccumulateGrad and its
   hooks (FSDP1's post-backward); the input's and parameters' own hooks are
   held back. A
   parameter also used behind the stage (tied weights, see ``Upstream``) is
   left out, or the engine would run the graph behind the stage to reach
   it: its gradient's share of the time is not counted. What this backward
   writes in place is put back.
3. A timed forward without recording, from the RNG and in-place state the
   stage started from (put back after), replayed as the runtime replays a
   recomputation (``Replay``, remat/replay.py, whose per-call work is then in the time):
   fwd_nograd_time. Its output is compared, bit for bit, with the real
   forward's (Note [Replaying a stage] 4 in remat/replay.py).
4. Only when the next stage's backward (run 2 of that stage) hands its
   input a gradient laid out otherwise than the ones run 2 fed this stage
   (a transpose, say): this stage's backward again, on a fresh forward of a
   copy of its input, with a gradient of that layout (``backward_again``):
   bwd_time and bwd_tmp. A layout can cost a copy (a ``reshape`` of a
   transposed gradient), which a training step pays. It runs once the next
   stage's saved tensors have gone or been kept, at the start of the stage
   after it or at the chain's end, and cascades: where this backward hands
   its own input yet another layout (an elementwise stage passes on the one
   it got), the stage before runs it too.

Run 1 is the one that counts, so RNG streams and BatchNorm statistics end
where one plain forward leaves them. The times of runs 1 and 2 are those of
the ops inside them, the meter's own work left out (it would double them on
small ops): a few per cent below a plain run's wall time, which also has the
model's and PyTorch's Python around the ops. A twin of a stage measured
before skips runs 2 and 3 (Note [Twin stages], remat/measuring.py).
Measuring the real forward and
its own backward, rather than separate timed runs, keeps a first call at
two to three plain steps (runs 1 to 3, then the backward, which rebuilds
the stages whose saved tensors did not fit the budget, never the last;
remat/measuring.py ``_keep_saved``). On CUDA the ops run asynchronously and the time
inside the mode is launch time: there a forward and backward on a detached
copy of the input (``timed_step``, the lesser of two) give fwd_time and
bwd_time, and the allocator's peak statistics replace the meter for the
peaks; before a chain's first stage is measured there, ``warm_cuda`` has
CUDA's once-per-process set-up done, which would count as that stage's. On CPU the
next two calls' own times replace these (Note [Timing the second call],
remat/refine.py).
"""

import time

import torch
from torch.utils._pytree import tree_leaves

from .errors import StageError, input_modified
from .leaves import grad_side_inputs, held_hooks, stage_leaves, step_grads
from .meter import Instrument, InputWritten, storage_key
from .replay import restore_tensors
from .runtime import RELEASES

__all__ = ["Timer", "backward_again", "instrumented_run", "saved_storages", "timed_step", "warm_cuda"]


class Timer:
    """Wall time of a region, synchronising CUDA when the work runs there."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.seconds = 0.0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._t0
        return False


def saved_storages(inst, saved, act, held_elsewhere):
    """{storage: bytes} of the distinct storages among a stage's ``saved`` tensors and
    its output ``act`` that the meter ``inst`` saw it make, less those ``held_elsewhere``
    (counted as held through the step instead, remat/measuring.py; the stage's backward
    lets none of them go, ``_Releases``). saved_bytes is their sum, at least the output's."""
    keys = {}
    for t in saved + [act]:
        key = storage_key(t)
        if key in inst.created:
            keys[key] = inst.created[key]
    for key in held_elsewhere:
        keys.pop(key, None)
    return keys


def instrumented_run(call, ident, x, cuda, rng0, check, hooks, saved, pool=None, upstream=None, anchor=None,
                     twin=None):
    """Runs 1 and 2 of Note [Measuring a stage]: the stage's real forward under
    ``Instrument``, then its backward on that graph.

    Args:
        hooks: the saved-tensor hooks of the real forward; ``saved`` is the list
            its pack hook appends to, and its unpack hook reads.
        pool: a ``GradPool`` for the parameters' gradients, or None.
        upstream: an ``Upstream`` that has taken in ``x`` and the side inputs.
        anchor: the stage's anchor, whose unpacked tensors a backward that
            frees its graph lets go one by one (remat/runtime.py); the
            backward here keeps the graph and meters as if it did not.
        twin: a ``_Twin`` (remat/measuring.py, Note [Twin stages]): given what
            run 1 showed, it may name a stage measured before whose run 2 this
            one takes instead of running its own.

    Returns:
        (what the stage returned, cost row, [(tensor, value before)] of the
        state it updates in place, whether it draws random numbers, whether
        what it computes may depend on that state's values: ``Instrument.reads_state``).
    """
    # the stage runs on x itself, so that its graph is the one a plain forward makes
    # (a copy in between would sum the gradients reaching x in another order where x
    # has several users: bits apart). The meter refuses an op writing x before it
    # runs (x untouched), and the backward below stops at x without running its node
    inst = Instrument(exclude=[x], sources=[x], protect=x)
    buffers = [(b, b.detach().clone()) for b in ident.buffers()] if isinstance(ident, torch.nn.Module) else []
    version = x._version
    stop = {a.grad_fn for a in call.args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    if x.requires_grad:
        stop.add(_node_of(x))
    row = {"bwd_time": 0.0}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        with inst, torch.enable_grad(), hooks:
            out = call.invoke(x)
    except InputWritten:
        raise input_modified(call.index, call.name) from None
    row["fwd_time"] = inst.op_seconds
    check(call, out, x, version)
    act = out[0] if isinstance(out, tuple) else out
    fwd_peak = inst.peak if not cuda else torch.cuda.max_memory_allocated() - base
    rng0.extra = list(inst.generators.values())   # the stage's own generators, as they were
    uses_rng = rng0.changed()
    inst.note_changed(buffers)
    forward_writes = dict(inst.mutated)
    reads_state = inst.reads_state()
    out_bytes = act.untyped_storage().nbytes()
    # what the stage made and still holds after its forward, other than what autograd
    # saved (through the hooks) and what it returned: tensors on a custom Function's
    # ctx, a module's cache; no mode of the schedule lets them go before B(i). And what
    # autograd saved that something else holds too (Note [Saved tensors held
    # elsewhere], remat/measuring.py)
    returned = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    row["held_outside"] = inst.alive_bytes(saved + returned)
    elsewhere, cached = inst.held_elsewhere(saved, returned, besides=[act])
    row["saved_elsewhere"], row["saved_cached"] = sum(elsewhere.values()), sum(cached.values())
    # whether the stage, recorded, keeps its input's storage (saved, or returned as a
    # view): if not, the forward phase may let a^(i-1) go (Costs.fwd_drop)
    in_key = storage_key(x)
    row["input_kept"] = any(storage_key(t) == in_key for t in saved + returned)
    keys = saved_storages(inst, saved, act, [*elsewhere, *cached])
    saved_bytes = max(sum(keys.values()), out_bytes)
    # the output is part of a-bar^i (saved_bytes) for the forward phase, where the
    # next stage needs it; by B(i) the next stage's backward has let it go, unless
    # this stage's own backward reads it: if not, bwd_tmp gives its bytes back
    # (below zero where the backward's own transient is smaller)
    out_key = storage_key(act)
    row["out_freed"] = 0 if any(storage_key(t) == out_key for t in saved) else out_bytes
    bwd_delta = 0
    in_grad = 0
    # side inputs needing grad (remat/leaves.py grad_side_inputs): their gradients are
    # taken at their edges below, as x's is, not as parameters'
    side = grad_side_inputs(call, x) if act.requires_grad else []
    params = [p for p in stage_leaves(act, stop) if p is not x and not any(p is s for s in side)] \
        if act.requires_grad else []
    if upstream is not None:
        row["held_grads"] = upstream.held_grads(params)
        params = [p for p in params if id(p) not in upstream.leaves]
    donor = None
    if twin is not None:
        stops = stop
        donor = twin.find((out_bytes, saved_bytes, fwd_peak, row["out_freed"], uses_rng,
                           tuple((t.shape, t.dtype, t.device) for t in saved),
                           tuple((t.shape, t.dtype) for t, _ in forward_writes.values()),
                           tuple(sorted(row.get("held_grads", {}).values())),
                           tuple((p.shape, p.dtype) for p in params),
                           _graph_shape(act.grad_fn, stops)))
    if donor is not None:
        row.update(donor)
    elif act.requires_grad and (x.requires_grad or params):
        # the meter is off between the two runs: what is made here is no stage's
        grad_out = torch.ones_like(act)
        row["grad_layout"] = grad_out.stride()
        # side inputs needing grad: their gradients are taken at their edges as x's is
        # (what the stage adds into the sum the engine holds: remat/measuring.py
        # side_grads), their nodes (before the chain, or a leaf's AccumulateGrad) not run
        own = held_hooks(([x] if x.requires_grad else []) + side)   # their hooks held back (x's .grad kept)
        own.__enter__()
        hook = x.register_hook(lambda g: row.__setitem__("input_grad_layout", g.stride())) if x.requires_grad else None
        # a training step hands the stage a gradient only the engine holds, which
        # it may add into in place (a residual's sum): so does a copy made here
        relay = act.register_hook(_engine_owned)
        with step_grads(params, pool) as grads:
            inst.ignore_writes(grads)   # AccumulateGrad adds into them: no state to put back
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base_b = torch.cuda.memory_allocated()
            released = None
            if not cuda:
                released = _Releases(act, stop, saved, keys, storage_key(act), inst, anchor)
                inst.open_window(released.held)
            ops_before = inst.op_seconds
            try:
                with inst:
                    _backward(act, grad_out, x if x.requires_grad else None, params, grads, side)
            except BaseException as exc:
                if isinstance(exc, RuntimeError) and "use_reentrant=True" in str(exc):
                    raise StageError(
                        f"remat: stage {call.index} ({call.name}) runs torch.utils.checkpoint with "
                        f"use_reentrant=True inside, whose backward cannot be run on one stage alone, as "
                        f"remat's first call measures each stage. Pass use_reentrant=False (or drop the "
                        f"checkpoint: remat decides what to recompute), or measure the costs once that way "
                        f"and pass the file: remat.chain(..., costs=\"costs.json\")") from exc
                if hasattr(exc, "add_note") and not isinstance(exc, KeyboardInterrupt):
                    exc.add_note(_BACKWARD_FAILED)
                raise
            finally:
                if released is not None:
                    released.close()
                if hook is not None:
                    hook.remove()
                own.__exit__(None, None, None)
                relay.remove()
            row["bwd_time"] = inst.op_seconds - ops_before
            if cuda:
                bwd_delta = torch.cuda.max_memory_allocated() - base_b
            else:
                bwd_delta = inst.window_peak - released.held
        # the output's gradient stands for the one simulate holds (x[i]), and the
        # input's for the one B(i) adds (x[i-1]); what is left is bwd_tmp
        in_grad = (x.untyped_storage().nbytes() if x.requires_grad else 0) + act.numel() * act.element_size()
        del grad_out
    del act
    # the real forward's writes stay (as one plain forward's); the backward's are undone
    with torch.no_grad():
        for key, (t, old) in inst.mutated.items():
            if key not in forward_writes:
                t.copy_(old)
    row["out_bytes"] = out_bytes
    row["saved_bytes"] = saved_bytes
    row["fwd_tmp"] = max(0, fwd_peak - out_bytes)
    if donor is None:
        row["bwd_tmp"] = max(0, bwd_delta - in_grad) - row["out_freed"]
    return out, row, list(forward_writes.values()), uses_rng, reads_state


def _graph_shape(node, stop):
    """The backward graph of a stage, from the node of its output down to the nodes
    in ``stop``, as node types and edges (Note [Twin stages] in remat/measuring.py)."""
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


class _Releases:
    """Meters a stage's backward as one that frees its graph runs it: each saved
    storage the stage made (its output aside, which stays as the next input) is
    let go once the node unpacking its last handle has run, as ``_unpack`` and
    autograd do (Note [The life of a saved tensor] 2 in remat/runtime.py).
    ``held`` is their bytes at the start. Without the engine's keep-graph query
    (old PyTorch) the runtime keeps them to the stage's end, and so does this."""

    def __init__(self, act, stop, saved, sizes, out_key, inst, anchor):
        self.inst, self.anchor, self.saved = inst, anchor, saved
        self.left, self.pending, self.hooks = {}, [], []
        if not RELEASES or anchor is None or act.grad_fn is None:
            self.held = 0
            return
        for t in saved:
            key = storage_key(t)
            if key in sizes and key != out_key:
                self.left[key] = self.left.get(key, 0) + 1
        self.held = sum(sizes[k] for k in self.left)
        anchor.observe = self.pending.append
        seen, todo = set(), [act.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen or node in stop or type(node).__name__ == "AccumulateGrad":
                continue
            seen.add(node)
            self.hooks.append(node.register_hook(self._ran))
            todo.extend(n for n, _ in node.next_functions)
        self.sizes = sizes

    def _ran(self, *_):
        for i in self.pending:
            key = storage_key(self.saved[i])
            n = self.left.get(key)
            if n is not None:
                self.left[key] = n - 1
                if n == 1:
                    self.inst.release(self.sizes[key])
        self.pending.clear()

    def close(self):
        for h in self.hooks:
            h.remove()
        if self.anchor is not None:
            self.anchor.observe = None


_BACKWARD_FAILED = (
    "(raised by the backward that remat's first call runs on each stage to measure it, inside "
    "the chain's forward: hooks that expect a backward only after the forward may reject it. "
    "Measure the costs once without them and pass the file: remat.chain(..., costs=\"costs.json\"))")


def _node_of(x):
    """The node x's gradient goes to: its grad_fn, or a leaf's AccumulateGrad."""
    if x.grad_fn is not None:
        return x.grad_fn
    edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if edge is not None:
        return edge(x).node
    return x.view_as(x).grad_fn.next_functions[0][0]


def _engine_owned(grad):
    """A copy of ``grad`` that nothing but the autograd engine holds."""
    return grad.clone()


def _backward(out, grad, x, params, grads, side=()):
    """The stage's backward on the real forward's graph (kept for the real backward
    later), for ``grad = ones_like(out)``, as a training step runs it, stopping at
    its input ``x`` (or None) without running x's node: that node is the stage
    before's (it would unpack that stage's saved tensors; FSDP's autograd Function
    on the root's inputs would reshard the parameters). So it takes the gradients
    at the edges of x and of ``params``, as ``torch.autograd.grad`` does (an input's
    node runs in ``backward``'s mode), x's held to the end as a training step holds
    it for the stage before; each parameter's is added into its buffer of ``grads``
    by a hook, as AccumulateGrad adds into an existing ``.grad``, and leaves a zero
    that takes no memory. The engine is called directly where PyTorch allows: the
    public call checks grad's shape with sympy, imported on first use (half a
    second of a first call, for a check that cannot fail here)."""
    zeros = {}

    def adder(buf):
        def add(g):
            buf.add_(g)
            if g.layout != torch.strided:
                return g
            key = (g.dtype, g.device)
            if key not in zeros:
                zeros[key] = torch.zeros((), dtype=g.dtype, device=g.device)
            return zeros[key].expand(g.shape)
        return add

    handles = [p.register_hook(adder(b)) for p, b in zip(params, grads)]
    inputs = ([] if x is None else [x]) + list(side) + list(params)
    try:
        run = getattr(torch.autograd.graph, "_engine_run_backward", None)
        edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
        if run is None or edge is None or torch.overrides.has_torch_function((out, grad, *inputs)):
            torch.autograd.grad(out, inputs, grad, retain_graph=True, allow_unused=True)
        else:
            run((out,), (grad,), True, False, tuple(edge(t) for t in inputs), allow_unreachable=True,
                accumulate_grad=False)
    finally:
        for h in handles:
            h.remove()


def backward_again(call, x, cuda, rng0, originals, layout, out_freed, pool=None, leaves=()):
    """Run 4 of Note [Measuring a stage]: bwd_time and bwd_tmp of a stage measured
    again, its output's gradient laid out with strides ``layout``, on a fresh
    forward of a detached copy of its input from the RNG and in-place state it
    started from (put back after). This backward frees the graph as it goes, as
    a training step's does.

    Args:
        originals: [(tensor, value before the stage)] of the state the stage writes.
        out_freed: the output's bytes if the stage's backward does not read it.
        pool: a ``GradPool`` for the parameters' gradients, or None.
        leaves: ids of tensors also used behind the stage (``Upstream.leaves``).

    Returns:
        (bwd_time, bwd_tmp, strides of the gradient it hands its input or None),
        or None when the stage's output needs no gradient.
    """
    xin = x.detach().requires_grad_(x.requires_grad)
    stop = {a.grad_fn for a in call.args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    inst = Instrument(exclude=[x, xin], sources=[xin])
    state = [t for t, _ in originals]
    with rng0.replayed(), restore_tensors(state), torch.enable_grad():
        with torch.no_grad():
            for t, old in originals:
                t.copy_(old)
        with inst:
            act = call.call(xin)
        params = [p for p in stage_leaves(act, stop) if p is not xin and id(p) not in leaves]
        inputs = [xin] if xin.requires_grad else []
        if not act.requires_grad or not (inputs or params):
            return None
        grad = torch.empty_strided(act.shape, layout, dtype=act.dtype, device=act.device).fill_(1)
        relay = act.register_hook(_engine_owned)   # as in instrumented_run
        handed = []
        hook = xin.register_hook(lambda g: handed.append(g.stride())) if xin.requires_grad else None
        with step_grads(params, pool) as grads:
            inst.ignore_writes(grads)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated() if cuda else inst.live
            inst.peak = inst.live
            ops_before = inst.op_seconds
            with Timer(cuda) as timer, inst:
                torch.autograd.backward(act, grad, inputs=inputs + params)
            peak = torch.cuda.max_memory_allocated() if cuda else inst.peak
        relay.remove()
        if hook is not None:
            hook.remove()
        seconds = timer.seconds if cuda else inst.op_seconds - ops_before
        in_grad = (x.untyped_storage().nbytes() if x.requires_grad else 0) + act.numel() * act.element_size()
        return seconds, max(0, peak - start - in_grad) - out_freed, handed[0] if handed else None


_warm = set()


def warm_cuda(devices):
    """Make CUDA's lazy, once-per-process set-up happen before a stage is measured
    on ``devices``, not inside it (Note [Measuring a stage]): the cuBLAS handles and
    workspaces of the calling thread and of the engine's backward thread (32 MiB
    each on an H100, held for good, which the allocator's peak would count as the
    first stage's transient memory), and the loading of the GEMM kernels (seconds,
    which its time would count). A small Linear forward and backward, per device,
    once; it draws no random numbers."""
    for d in devices:
        if d in _warm:
            continue
        with torch.cuda.device(d), torch.enable_grad():
            w = torch.ones(64, 64, device="cuda", requires_grad=True)
            b = torch.zeros(64, device="cuda", requires_grad=True)
            a = torch.ones(64, 64, device="cuda", requires_grad=True)
            torch.nn.functional.linear(a @ w, w, b).sum().backward()
            torch.cuda.synchronize()
        _warm.add(d)


def timed_step(call, x, cuda, rng0, state):
    """Forward and backward times on a detached copy, on CUDA (Note [Measuring a stage]):
    the lesser of two runs, the first of which may still load kernels."""
    first = _timed_step(call, x, cuda, rng0, state)
    second = _timed_step(call, x, cuda, rng0, state)
    return min(first[0], second[0]), min(first[1], second[1])


def _timed_step(call, x, cuda, rng0, state):
    xin = x.detach().requires_grad_(x.requires_grad)
    stop = {a.grad_fn for a in call.args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    with rng0.replayed(), restore_tensors(state), torch.enable_grad():
        with Timer(cuda) as tf:
            out = call.call(xin)
        tb = 0.0
        if out.requires_grad:
            params = [v for v in stage_leaves(out, stop) if v is not xin]
            inputs = [xin] if xin.requires_grad else []
            if inputs or params:
                grad_out = torch.ones_like(out)
                with step_grads(params), Timer(cuda) as timer:
                    torch.autograd.backward(out, grad_out, inputs=inputs + params)
                tb = timer.seconds
    return tf.seconds, tb
