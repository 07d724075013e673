"""The leaf tensors (parameters) a stage's backward reaches, and the gradient
buffers the measuring call's stage backwards add into (Note [Measuring a
stage] 2 in remat/measure/profile.py)."""

import functools

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["GradPool", "HeldHooks", "StepGrads", "Upstream", "edge_backward", "edge_roots", "grad_side_inputs",
           "node_of", "shared_grad_transients", "side_grads", "stage_leaves", "stop_nodes", "walk"]


def stop_nodes(tensors):
    """The nodes that made ``tensors`` (those that are tensors made by autograd):
    where a stage's own backward graph ends."""
    return {t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None}


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
    stage] 2) leaves such a parameter out: to reach it the engine would run the
    graph behind the stage."""

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
    parameter is (``Upstream.held_grads``, ``shared_grad_transients``)."""
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


def edge_backward(out, grad, x, params, grads, side=(), keep=True):
    """The stage's backward on the real forward's graph (kept for the real backward
    later, where ``keep``), for ``grad = ones_like(out)``, as a training step runs it, stopping at
    its input ``x`` (or None) without running x's node: that node is the stage
    before's (it would unpack that stage's saved tensors; FSDP's autograd Function
    on the root's inputs would reshard the parameters). So it takes the gradients
    at the edges of x and of ``params``, as ``torch.autograd.grad`` does (an input's
    node runs in ``backward``'s mode), x's held to the end as a training step holds
    it for the stage before; each parameter's is added into its buffer of ``grads``
    by a hook, as AccumulateGrad adds into an existing ``.grad`` (dropped where its
    buffer is None), and leaves a zero that takes no memory. The engine is called directly where PyTorch allows: the
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
    if side and x is not None and x.grad_fn is not None:
        # a side input's node is reached through x's too (a stage before used it): the engine would run
        # the backward of every stage before, to sum their shares of its gradient (rebuilding each in
        # a first call's forward phase: 55% over its budget). The stage's own nodes, made after x's,
        # all run before it (the engine runs the latest made first): the backward stops as x's gradient
        # is complete, its hooks run (a layout's, registered before) and not x's node's
        handles.append(x.register_hook(_stop_at_input))
    inputs = ([] if x is None else [x]) + list(side) + list(params)
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
