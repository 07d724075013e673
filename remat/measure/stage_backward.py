"""A stage's backward run by itself while it is measured: on the real
forward's graph (run 2 of Note [Measuring a stage], remat/measure/profile.py), metered
as a backward that frees its graph runs it, and again on a fresh forward with
another layout of its output's gradient (run 4)."""

import contextlib

import torch

from ..errors import backward_failed
from .costs_source import chain_costs
from .leaves import HeldHooks, Shares, with_sums, edge_backward, edge_roots, stage_leaves, stop_nodes
from .meter import Instrument, storage_key
from ..runtime.replay import restore_tensors
from ..runtime.recompute import uncached
from .timing import Releases, Timer
from .cuda_peak import reset_own

__all__ = ["backward_again", "run_backward"]


def run_backward(call, act, x, graph, inst, probe, anchor=None, release=False):
    """Run 2 of Note [Measuring a stage] (remat/measure/profile.py): the stage's backward on
    the real forward's graph, kept for the real backward, metered as one that frees its
    graph runs it (``Releases``). Sets ``probe``'s bwd_time, grad_layout and input_grad_layout.

    Args: ``act`` the stage's output, ``x`` its input; ``graph`` its ``StageGraph``
    (remat/measure/record.py); ``inst`` the forward's meter; ``anchor`` the stage's anchor
    (``instrumented_run``); ``release``: let each saved tensor go once read for the last time.

    Returns (the backward's peak above its start, the bytes of the gradients of the output and
    of the input, which simulate counts apart from bwd_tmp, the peak of the stage rebuilt
    (``Releases.rebuilt_peak``), the peak where the stage starts the sums of its shared
    leaves' gradients, less theirs, or None (Note [Shared leaves], remat/measure/leaves.py),
    and how much lower the peak is where its casts go as last read, ``Releases``).
    """
    cuda, side, params = act.is_cuda, graph.side, graph.params
    # the meter is off between the two runs: what is made here is no stage's (the gradient handed
    # in takes no memory: the one the engine holds, below, is the step's; two were an output over)
    grad_out = torch.ones((), dtype=act.dtype, device=act.device).expand(act.shape)
    probe.grad_layout = torch.empty_like(act, device="meta").stride()
    # side inputs needing grad: their gradients are taken at their edges as x's is (what the stage adds into
    # the sum the engine holds: measuring.py side_grads), their nodes (before the chain, AccumulateGrad) not run
    own = HeldHooks(([x] if x.requires_grad else []) + side)   # their hooks held back (x's .grad kept)
    own.__enter__()
    # a training step hands the stage a gradient only the engine holds, which it may add into in place
    relay = act.register_hook(lambda _g, like=act: torch.ones_like(like))   # (laid out as the output)
    # (after the relay: a stage returning its input (an identity) hands it what the relay made, not the
    # expanded stand-in, whose strides no step hands: run 4 of the stage before ran for them, 9% over)
    hook = x.register_hook(lambda g: setattr(probe, "input_grad_layout", g.stride())) if x.requires_grad else None
    # (the parameters' gradients are not added anywhere: Note [Measuring within the budget], holding.py)
    with HeldHooks(params):
        grads = [None] * len(params)
        if cuda:
            torch.cuda.synchronize()
            reset_own()
            base_b = torch.cuda.memory_allocated()
        released = None
        if not cuda:
            released = Releases(act, graph.stop, graph.saved, graph.keys, storage_key(act), inst, anchor, release,
                                 graph.casts)
            inst.open_window(released.held)
        ops_before = inst.op_seconds
        shares = Shares(act, graph.stop, graph.shared, inst, cuda, window=True)
        try:
            with inst:
                edge_backward(act, grad_out, x if x.requires_grad else None, params, grads, side,
                              shared=graph.shared, stops=(call.args, call.kwargs))
        except BaseException as exc:
            backward_failed(call, exc)
            raise
        finally:
            peak, held_peak = shares.figures()
            if released is not None:
                released.close()
            if hook is not None:
                hook.remove()
            own.__exit__(None, None, None)
            relay.remove()
        probe.costs.bwd_time = inst.op_seconds - ops_before
        rebuilt = None
        base = base_b if cuda else released.held
        bwd_delta = peak - base
        if not cuda and released.rebuilt_peak is not None:
            rebuilt = min(bwd_delta, released.rebuilt_peak - released.held)
    # the output's gradient stands for the one simulate holds (x[i]), the input's for the one B(i) adds (x[i-1], made
    # or not: Note [An input needing no grad], profile.py); the rest is bwd_tmp (the shared leaves' sums: held_bytes)
    in_grad = x.untyped_storage().nbytes() + act.numel() * act.element_size()
    held = held_peak - base - shares.acc if graph.shared else None   # (the shares it made: not one behind a cast)
    return bwd_delta, in_grad, bwd_delta if rebuilt is None else rebuilt, held, \
        released.plain - released.cast_peak if released is not None else 0


class Run4:
    """Run 4 of Note [Measuring a stage] (remat/measure/profile.py) of a measuring call's stages,
    into their costs in the chain's record ``new``. One that would not fit beside what the call
    holds (``later``: stage -> layout) runs in the call's own backward, as the stage's gradient
    arrives (``arrived``), before the stage is rebuilt there; the record's costs then take its
    figures and its plans go. Only this object, not the measuring call, stays with the graph."""

    def __init__(self, new, measured, run):
        self.new, self.measured, self.run = new, measured, run   # (measured: stage -> ``_Measured``)
        self.later, self.started = {}, {}   # (started: stage -> its ``sums_started``, as the call's end found)
        self.room = self.options = None   # (room: run, stage, gradient, input made again, bytes of state
        # copies -> run 4 fits now)
        self.layouts = {}   # stage -> the gradient layout its costs are measured for (run 2's, or run 4's)

    def again(self, m, layout, pool=None, grad=None):
        """Run 4 of the stage of ``m`` for its gradient laid out so (``grad``, the
        one that arrived, or None); the stage before it and its layout where that
        stage is due in turn (one that passes the layout on hands it further down),
        else None."""
        costs = self.new.stages[m.index - 1].costs
        if (x := m.x()) is None:   # (let go, remat/measure/holding.py: made again from an input held below)
            x = self.run.input_of(m.index)
        again = backward_again(m.call, x, m.cuda, m.rng0, m.writes, layout, costs.out_freed or 0, pool,
                               m.leaves, grad)
        if again is None:
            return None
        self.layouts[m.index] = tuple(layout)
        (seconds, costs.bwd_tmp, seen, costs.bwd_tmp_sums), costs.bwd_cast_less = again, 0   # (run 2's, not its)
        costs.bwd_tmp = with_sums(costs.bwd_tmp, costs.bwd_tmp_sums, self.started.get(m.index, (0, 0)))
        # (run 4 frees as autograd does: what a rebuilt backward needs less is run 2's)
        costs.bwd_rebuilt_less = min(costs.bwd_rebuilt_less, costs.bwd_tmp + costs.out_bytes)
        if not m.cuda:   # on CUDA it ran under the meter, whose Python is in the wall time:
            costs.bwd_time = seconds   # timed_step's unmetered time stands
        last = self.measured.get(m.index - 1)
        return (last, seen) if last is not None and last.layout is not None and seen not in (None, last.layout) \
            else None

    def settle(self, last, act, options, fits, room):
        """The measuring call ends: what the graph's hooks keep of it is what run 4 may
        yet need (a run 4 cascades down only: the stages above hold their state copies
        no more), the last stage's where its tail may hand it another layout (a^L
        ``act``, or None: ``watch_last``). ``room``: whether a run 4 fits in the call's
        backward (``Holding.run4_fits_now``), or None where each runs regardless."""
        self.layouts = {i: m.layout for i, m in self.measured.items() if m.layout is not None} | self.layouts
        top = max([last if act is not None and self.watch_last(last, act, options, fits) else 0, *self.later])
        self.measured = {i: m for i, m in self.measured.items() if i <= top} if top else None
        (self.run, self.room), self.options = (self.run, room) if top else (None, None), options

    def watch_last(self, i, act, options, fits):
        """Stage i, the last, gets its gradient from the chain's tail: where that comes in
        another layout than run 2's (a head that flattens a transposed a^L), its run 4
        runs in the call's backward as it arrives, where it ``fits()`` beside what the call
        holds (a call at a budget that leaves no room for it keeps run 2's figures, as
        before: a copy of the gradient off, at most). True if it is watched."""
        m = self.measured.get(i)
        if m is None or m.layout is None or not isinstance(act, torch.Tensor) or not act.requires_grad:
            return False
        if not fits():   # (kept for it, it would hold its input through the tail; else what it costs)
            act.register_hook(lambda grad: self.arrived(i, grad, options))
            return False
        layout = tuple(m.layout)   # (not ``m``, whose copies of written state go with ``_done``: 264 B held before)

        def arrived(grad):   # (an expanded gradient, a sum's, needs less than run 2's: left so)
            if grad.stride() == layout or 0 in grad.stride() or not self.measured or i not in self.measured:
                if not self.later:
                    self._done()
            else:
                self.later[i] = grad.stride()
                self.arrived(i, grad, options)

        act.register_hook(arrived)
        return True

    def _remade(self, options):
        """The record's costs made again from its stages' (one's changed), its plans gone."""
        new = self.new
        new.costs, new.plans = chain_costs([s.costs for s in new.stages], new.input_bytes, new.held_bytes(), None,
                                           None, options), {}

    def arrived(self, i, grad, options):
        """Stage i's gradient ``grad`` arrived in the measuring call's backward."""
        if (layout := self.later.pop(i, None)) is None:
            if _costlier(self.layouts.get(i), grad):
                self._unmeasured([i], options)   # (another layout, and no run 4 due)
            return
        m = self.measured[i]
        if self.room is None or self.room(self.run, i, grad, m.x() is None, self.copies()):
            due = self.again(m, layout, None, grad)
            if due is not None:   # (when its own gradient arrives)
                self.later[due[0].index] = due[1]
            self._remade(options)
        else:   # (no room: run 4 there put a first call 1.1% over)
            self._unmeasured([i], options)
        if not self.later:
            self._done()

    def copies(self, keep=None):
        """Bytes of the values from before the call of the state the stages left to run 4
        wrote (each storage once), held through the call's backward for it where ``keep(bytes)``
        (else let go, run 4 with them: run 2's figures stand)."""
        n = sum({storage_key(old): old.untyped_storage().nbytes()
                 for m in (self.measured or {}).values() for _, old in m.writes}.values())
        if n and keep is not None and not keep(n):
            self._done()
        return n if self.measured else 0

    def _unmeasured(self, stages, options):
        """Stages whose gradient comes (or is to come) laid out otherwise than run 2's where run 4 cannot run
        (no room): their backward takes a copy of it more than run 2's, what a reshape of it costs. On run 2's
        figures, later calls went a gradient's copy over the budget (a linear stage before a transposing one,
        or an MLP-Mixer's token MLPs with their transposes as stages: 3.6-9%)."""
        stages = [i for i in stages if self.layouts.pop(i, None) and not self.new.stages[i - 1].costs.out_of_input]
        for c in (self.new.stages[i - 1].costs for i in stages):   # (a view's backward is a view: no copy)
            c.bwd_tmp += c.out_bytes
            c.bwd_tmp_sums = None if c.bwd_tmp_sums is None else c.bwd_tmp_sums + c.out_bytes
        if stages:
            self._remade(options)

    def _done(self):
        self._unmeasured([i for i in self.later if _costlier(self.layouts.get(i), self.later[i])], self.options)
        self.measured = self.run = self.room = None
        self.later = {}


def _costlier(layout, grad):
    """Whether a gradient ``grad`` (or, where it has not arrived, its strides) may cost a backward measured
    for gradients laid out ``layout`` a copy more (made contiguous): neither contiguous nor expanded where
    ``layout`` is (strides alone: laid out otherwise, not expanded)."""
    if layout is None or 0 in tuple(grad.stride() if isinstance(grad, torch.Tensor) else grad):
        return False
    if not isinstance(grad, torch.Tensor):
        return tuple(layout) != tuple(grad)
    return not grad.is_contiguous() and tuple(layout) == torch.empty(grad.shape, device="meta").stride()


def backward_again(call, x, cuda, rng0, originals, layout, out_freed, pool=None, leaves=(), given=None):
    """Run 4 of Note [Measuring a stage] (remat/measure/profile.py): bwd_time and bwd_tmp of a stage measured
    again, its output's gradient laid out with strides ``layout``, on a fresh
    forward of a detached copy of its input from the RNG and in-place state it
    started from (put back after). This backward frees the graph as it goes, as
    a training step's does.

    Args:
        originals: [(tensor, value before the stage)] of the state the stage writes.
        out_freed: the output's bytes if the stage's backward does not read it.
        pool: a ``GradPool`` for the parameters' gradients, or None.
        leaves: ids of tensors also used behind the stage (``Upstream.leaves``).
        given: the gradient to hand the stage, laid out so (one in a backward), or None.

    Returns:
        (bwd_time, bwd_tmp, strides of the gradient it hands its input or None,
        bwd_tmp where it starts the sums of its shared leaves' gradients or None:
        Note [Shared leaves], remat/measure/leaves.py), or None when the stage's
        output needs no gradient.
    """
    xin = x.detach().requires_grad_(call.input_requires_grad)   # (``x`` may be a detached copy)
    stop = stop_nodes((call.args, call.kwargs))
    inst = Instrument(exclude=[x, xin], sources=[xin])
    state = [t for t, _ in originals]
    with rng0.replayed(), restore_tensors(state), torch.enable_grad():
        with torch.no_grad():
            for t, old in originals:
                t.copy_(old)
        cast = call.autocast   # (in the call's backward, run again in the autocast state its forward ran in)
        with inst, cast.context() if cast is not None and not cast.current() else contextlib.nullcontext():
            act = call.activation(uncached(xin, cast))
        reached = [p for p in stage_leaves(act, stop) if p is not xin]
        params = [p for p in reached if id(p) not in leaves]
        shared = [p for p in reached if id(p) in leaves]
        inputs = [xin] if xin.requires_grad else []
        if not act.requires_grad or not (inputs or params or shared):
            return None
        shape, dtype, device, out_bytes = act.shape, act.dtype, act.device, act.numel() * act.element_size()
        grad = torch.ones((), dtype=dtype, device=device).expand(shape)   # (handed in as no memory)
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if given is not None and not cuda and use_count is not None:
            # the engine's is an alias of the call's own gradient (held by its backward anyway), metered
            # as a copy would be: made as it comes in, gone once nothing but what held it before does
            key, base = storage_key(given), use_count(given.untyped_storage()._cdata)
            inst.watch = lambda *_: key in inst.created and use_count(key) <= base and \
                inst._free(key, inst.created[key])
            relay = act.register_hook(lambda _: inst.count(alias := given.detach()) or alias)
        else:   # the engine's own, laid out so, made as it comes in (as in run_backward)
            layout = layout if given is None else given.stride()
            relay = act.register_hook(lambda _: torch.empty_strided(shape, layout, dtype=dtype, device=device).fill_(1))
        handed = []
        hook = xin.register_hook(lambda g: handed.append(g.stride())) if xin.requires_grad else None
        # the output goes where its backward does not read it, as in a step's B(i) (held, run 4 in the call's
        # backward went one output over the budget): from its edge; the start below is taken without it.
        # Where it reads it, it stays to the backward's end, as in run 2 (Note [Measuring a stage] 4)
        shares = Shares(act, stop, shared, inst, cuda, window=False)
        out_kept = act if not out_freed else None
        if not torch.overrides.has_torch_function((act,)) and edge_roots():
            act = torch.autograd.graph.get_gradient_edge(act)
        # each parameter's gradient is added into the pool's buffer standing in for its resident ``.grad``,
        # or, with no pool (in the call's backward, where a step's B(i) holds no such buffer), let go, the
        # add's time then not counted; the input's is held to the end, as for the stage before
        with HeldHooks(params):
            grads = pool.grads(params) if pool is not None else [None] * len(params)
            inst.ignore_writes([g for g in grads if g is not None])
            if cuda:
                torch.cuda.synchronize()
                reset_own()
            start = torch.cuda.memory_allocated() if cuda else inst.live
            inst.peak = inst.live
            ops_before = inst.op_seconds
            try:
                with Timer(cuda) as timer, inst:
                    edge_backward(act, grad, xin if xin.requires_grad else None, params, grads, keep=False,
                                  shared=shared, stops=(call.args, call.kwargs))
            finally:
                peak, held_peak = shares.figures()
                inst.watch = None   # (a cycle through it kept the meter's copies of written state alive)
        relay.remove()
        if hook is not None:
            hook.remove()
        seconds = timer.seconds if cuda else inst.op_seconds - ops_before
        in_grad = x.untyped_storage().nbytes() + out_bytes   # (Note [An input needing no grad], profile.py)
        held = max(0, held_peak - start - in_grad - shares.acc) - out_freed if shared else None
        del out_kept
        return seconds, max(0, peak - start - in_grad) - out_freed, handed[0] if handed else None, held
