"""The leaf tensors (parameters) a stage's backward reaches, and the gradient
buffers the measuring call's stage backwards add into (Note [Measuring a
stage] 2 in remat/measure/profile.py)."""

import functools

import torch
from torch.utils._pytree import tree_leaves

from .cuda_peak import reset_own

__all__ = ["GradPool", "HeldHooks", "StepGrads", "Upstream", "edge_backward", "edge_roots", "grad_side_inputs",
           "node_of", "Shares", "side_grads", "sums_started", "with_sums", "stage_leaves", "stop_nodes", "walk"]


def stop_nodes(tensors):
    """The nodes that made ``tensors`` (those that are tensors made by autograd):
    where a stage's own backward graph ends."""
    return {t.grad_fn for t in tree_leaves(tensors) if isinstance(t, torch.Tensor) and t.grad_fn is not None}


def walk(roots, stop=(), seen=None):
    """The nodes of the backward graph reachable from ``roots``, each once (depth
    first, in the engine's edge order), not entering the nodes in ``stop``;
    ``seen`` (a set, updated) carries what an earlier walk visited."""
    seen = set() if seen is None else seen
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        yield node
        todo.extend(n for n, _ in node.next_functions)


def stage_leaves(out, stop):
    """Leaf tensors requiring grad reachable from ``out``'s graph without
    passing the nodes in ``stop``: the parameters a stage's backward reaches."""
    return [node.variable for node in walk([out.grad_fn], stop) if hasattr(node, "variable")]


class Upstream:
    """The leaf tensors behind a chain's stages: reachable from the graphs of
    their activations and side inputs, which grow stage by stage (each node is
    visited once). A stage's backward on its real graph (Note [Measuring a
    stage] 2) makes its share of such a parameter's gradient, stopping before
    the graph behind the stage runs (Note [Shared leaves])."""

    def __init__(self):
        self._seen = set()
        self.leaves = set()   # ids

    def held_grads(self, leaves):
        """{id: gradient bytes} of those of a stage's ``leaves`` also used behind
        it. The engine sums a leaf's gradients before it accumulates them, so
        the share from this stage's backward waits, held, until the backward
        of the first use has run: memory no stage's costs show, which the chain
        counts in ``Costs.held_bytes`` (docs/how-it-works.md, "The cost model")."""
        return {id(p): p.numel() * p.element_size() for p in leaves if id(p) in self.leaves}

    def add(self, tensors):
        """Take in the graphs behind ``tensors``."""
        roots = []
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                if t.grad_fn is None:
                    self.leaves.add(id(t))
                else:
                    roots.append(t.grad_fn)
        for node in walk(roots, seen=self._seen):
            if hasattr(node, "variable"):
                self.leaves.add(id(node.variable))


class GradPool:
    """Buffers that stand in for parameters' ``.grad`` in the measuring backwards of
    one chain, reused from stage to stage: a gradient is added into one as
    AccumulateGrad adds it into a resident ``.grad`` (the time counts), and what
    is added is thrown away. So they are zeroed once, when made (fresh zeros for
    every stage cost a first call the allocation and page faults of all its
    parameters' size), and they all share one buffer the size of the largest
    parameter: a step adds into gradients that are resident, which the budget
    does not count, and buffers of all a stage's parameters at once were that
    much over it in the measuring call (Note [Measuring within the budget],
    remat/measure/holding.py)."""

    def __init__(self):
        self._flat = {}

    def nbytes(self):
        """The bytes its buffers hold."""
        return sum(flat.untyped_storage().nbytes() for flat in self._flat.values())

    def grads(self, params):
        """A buffer shaped like each of ``params``, all views of one (their values are
        garbage: only the time of adding into them counts)."""
        need = {}
        for p in params:
            if p.layout == torch.strided and p.is_contiguous():
                need[(p.dtype, p.device)] = max(need.get((p.dtype, p.device), 0), p.numel())
        for (dtype, device), n in need.items():
            flat = self._flat.get((dtype, device))
            if flat is None or flat.numel() < n:
                self._flat[(dtype, device)] = torch.zeros(n, dtype=dtype, device=device)
        out = []
        for p in params:
            key = (p.dtype, p.device)
            if key in need and p.layout == torch.strided and p.is_contiguous():
                out.append(self._flat[key][:p.numel()].view(p.shape))
            else:
                out.append(torch.zeros_like(p))
        return out


class HeldHooks:
    """Context: the Python hooks of ``tensors`` (``register_hook``,
    ``register_post_accumulate_grad_hook``: an optimizer stepping in the
    backward) held back, and their ``.grad`` put back after: for the measuring
    call's own backwards, which are measurements (the hooks run in the call's
    real backward)."""

    _HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")

    def __init__(self, tensors):
        self.tensors = tensors

    def __enter__(self):
        # (a non-leaf's .grad is read only where it keeps one: reading warns)
        self.old = [t.grad if t.is_leaf or t.retains_grad else None for t in self.tensors]
        self.hooks = []
        for t in self.tensors:
            for attr in self._HOOKS:
                hooks = getattr(t, attr, None)
                if hooks:
                    self.hooks.append((hooks, list(hooks.items())))
                    hooks.clear()
        return self

    def __exit__(self, *exc):
        for t, g in zip(self.tensors, self.old):
            if (t.is_leaf or t.retains_grad) and t.grad is not g:
                t.grad = g
        for hooks, items in self.hooks:
            hooks.update(items)
        return False


class StepGrads(HeldHooks):
    """Backward of one stage as a training step runs it: each parameter gradient is
    added into an existing ``.grad`` (and freed), and the stage's parameters get
    their own ``.grad`` back afterwards, untouched, their hooks held back meanwhile
    (``HeldHooks``)."""

    def __init__(self, params, pool=None):
        super().__init__(params)
        self.pool = pool

    def __enter__(self):
        super().__enter__()
        params = self.tensors
        grads = self.pool.grads(params) if self.pool is not None else [torch.zeros_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        return grads


def grad_side_inputs(call, x):
    """The side inputs of ``call`` (not its activation ``x``) whose gradients
    ``side_grads`` counts: those that need grad and are not parameters (an
    encoder's output into cross-attention stages, a skip from code before the
    chain, a tensor made with ``requires_grad=True`` and handed to every stage).
    A parameter passed as a side input (a tied weight) is counted as a shared
    parameter is (``Upstream.held_grads``, Note [Shared leaves])."""
    return [a for a in tree_leaves((call.args, call.kwargs))
            if isinstance(a, torch.Tensor) and a.requires_grad and a is not x
            and (a.grad_fn is not None or not isinstance(a, torch.nn.Parameter))]


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


def sums_started(held):
    """Per stage, (the bytes of the shared leaves whose gradients' sums its backward
    starts, those of all its shared leaves) (``held``: per stage, {id: bytes} of
    ``Upstream.held_grads``): it starts the sum of each it is the last stage to use
    (Note [Shared leaves])."""
    out = []
    for i, h in enumerate(held):
        later = set()
        for g in held[i + 1:]:
            later.update(key for key in g if not isinstance(key, tuple))
        mine = {key: v for key, v in h.items() if not isinstance(key, tuple)}
        out.append((sum(v for key, v in mine.items() if key not in later), sum(mine.values())))
    return out


def with_sums(bwd_tmp, bwd_tmp_sums, started):
    """A stage's bwd_tmp, given its two figures (``Shares``) and ``started``, its
    ``sums_started`` pair: that of a backward adding every share into a sum the
    engine holds already; that of one starting every sum; or, starting some, the
    first with those it starts held throughout (above what any moment holds)."""
    mine, shared = started
    if not mine or bwd_tmp_sums is None:
        return bwd_tmp
    return bwd_tmp_sums if mine == shared else bwd_tmp + mine


class Shares:
    """Note [Shared leaves]
    --------------------
    A leaf a stage uses that is also used behind it (a tied weight, a gate every
    stage takes as an argument, ALBERT's one layer as every stage) gets a share of
    its gradient from each stage using it, which the engine sums into a buffer it
    holds from the backward of the last stage using it (which starts the sum) to the
    first use's; that sum is in ``Costs.held_bytes``. A stage's measured backward
    makes its shares too (``edge_backward``, ``shared``), with what it makes on the
    way to them (a gate's product with an activation, summed to the gate's shape),
    and meters two figures, as the engine would run it: ``mid``, where the stage
    adds each share into a sum held already (the engine's add is out of place:
    the share and the new sum are alive together, then the old sum and the share
    go), and ``held``, where it starts them (each leaf's first share stays, the
    next ones are added into it). Which one a stage is, the chain's end knows
    (``sums_started``, ``with_sums``). Each share is dropped from the graph as it
    is made, so the engine sums nothing. The figures are absolute, on the meter
    (the window of ``run_backward``, the whole of ``backward_again``) or on
    CUDA's allocator statistics, whose peak is started again after each share
    there (its own bytes still counted there, which errs high)."""

    def __init__(self, act, stop, shared, inst, cuda, window):
        self.inst, self.cuda, self.window = inst, cuda, window
        self.mid = self.held = self.acc = 0
        self.started, self.handles, self.due, self.prev = set(), [], False, inst.watch
        ids = {id(p) for p in shared}
        if not ids or act.grad_fn is None:
            return
        for node in walk([act.grad_fn], stop):
            to = [(j, n.variable) for j, (n, _) in enumerate(node.next_functions)
                  if n is not None and id(getattr(n, "variable", None)) in ids]
            if to:
                self.handles.append(node.register_hook(functools.partial(self._made, to)))
        if self.handles:
            inst.watch = self._watch

    def _peak(self):
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        return self.inst.window_peak if self.window else self.inst.peak

    def _restart(self):
        if self.cuda:
            reset_own()
        elif self.window:
            self.inst.window_peak = self.inst.window_live
        else:
            self.inst.peak = self.inst.live

    def _made(self, to, grad_inputs, _grad_outputs):
        out = list(grad_inputs)
        for j, p in to:
            g = out[j]
            if g is None:
                continue
            first = id(p) not in self.started
            if first:
                self.held = max(self.held, self._peak() + self.acc)
            total = torch.empty_like(g)   # (the engine's new sum, beside the share)
            peak = self._peak()
            del total
            self.mid = max(self.mid, peak)
            if not first:
                self.held = max(self.held, peak + self.acc)
            else:
                self.acc += p.numel() * p.element_size()
                self.started.add(id(p))
            out[j] = None
        self.due = True   # (the peak starts again at the next op, the shares gone)
        return tuple(out)

    def _watch(self, func, args, kwargs, ran):
        if self.prev is not None:
            self.prev(func, args, kwargs, ran)
        if self.due and not ran:
            self.due = False
            self._restart()

    def figures(self):
        """(mid, held) as Note [Shared leaves] says, absolute; call after the backward."""
        for h in self.handles:
            h.remove()
        if self.handles:
            self.inst.watch = self.prev
        if self.due:   # (no op since the last share: the peak so far is what was before it)
            self._restart()
        peak = self._peak()
        return max(self.mid, peak), max(self.held, peak + self.acc)


@functools.cache
def edge_roots():
    """Whether the engine starts a backward from a ``GradientEdge`` (recent PyTorch's does: probed once)."""
    try:
        w = torch.zeros((), requires_grad=True)
        torch.autograd.graph._engine_run_backward((torch.autograd.graph.get_gradient_edge(w * 1),), (torch.ones(()),),
                                                  False, False, (w,), allow_unreachable=True, accumulate_grad=True)
        return w.grad is not None
    except Exception:
        return False


def edge_backward(out, grad, x, params, grads, side=(), keep=True, shared=(), stops=()):
    """The stage's backward on the real forward's graph (kept for the real backward
    later, where ``keep``), for ``grad = ones_like(out)``, as a training step runs it, stopping at
    its input ``x`` (or None) without running x's node: that node is the stage
    before's (it would unpack that stage's saved tensors; FSDP's autograd Function
    on the root's inputs would reshard the parameters). So it takes the gradients
    at the edges of x and of ``params``, as ``torch.autograd.grad`` does (an input's
    node runs in ``backward``'s mode), x's held to the end as a training step holds
    it for the stage before; each parameter's is added into its buffer of ``grads``
    by a hook, as AccumulateGrad adds into an existing ``.grad`` (dropped where its
    buffer is None), and leaves a zero that takes no memory. ``shared``: leaves also used
    behind the stage, whose shares of their gradients it makes (``Shares`` meters
    them); ``stops``: the stage's tensor arguments (x among them), whose nodes are the
    stages' before or the code before the chain. The engine is called directly where PyTorch allows: the
    public call checks grad's shape with sympy, imported on first use (half a
    second of a first call, for a check that cannot fail here)."""
    zeros = {}

    def adder(buf):
        def add(g):
            if buf is not None:
                buf.add_(g)
            if g.layout != torch.strided:
                return g
            key = (g.dtype, g.device)
            if key not in zeros:
                zeros[key] = torch.zeros((), dtype=g.dtype, device=g.device)
            return zeros[key].expand(g.shape)
        return add

    handles = [p.register_hook(adder(b)) for p, b in zip(params, grads)]
    if side or shared:
        # a side input's or a shared leaf's node is reached through x's too (a stage before used it), or
        # through another argument's: the engine would run the backward of every stage before (or of the
        # code before the chain), to sum their shares of its gradient (rebuilding each in a first call's
        # forward phase: 55% over its budget). The stage's own nodes, made after its arguments', all run
        # before theirs (the engine runs the latest made first): the backward stops as the first of those
        # is reached, its hooks run (a layout's, registered before) and not its node
        for t in {id(t): t for t in ([] if x is None else [x]) + tree_leaves(stops)}.values():
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                handles.append(t.register_hook(_stop_at_input))
    inputs = ([] if x is None else [x]) + list(side) + list(params) + list(shared)
    try:
        run = getattr(torch.autograd.graph, "_engine_run_backward", None)
        edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
        if run is None or edge is None or torch.overrides.has_torch_function((out, grad, *inputs)):
            torch.autograd.grad(out, inputs, grad, retain_graph=keep, allow_unused=True)
        else:
            run((out,), (grad,), keep, False, tuple(edge(t) for t in inputs), allow_unreachable=True,
                accumulate_grad=False)
    except _InputReached:
        pass
    finally:
        for h in handles:
            h.remove()


class _InputReached(Exception):
    """A stage's measured backward is done: its input's gradient is complete (``edge_backward``)."""


def _stop_at_input(_grad):
    raise _InputReached


def node_of(x):
    """The node x's gradient goes to: its grad_fn, or a leaf's AccumulateGrad."""
    if x.grad_fn is not None:
        return x.grad_fn
    edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if edge is not None:
        return edge(x).node
    return x.view_as(x).grad_fn.next_functions[0][0]
