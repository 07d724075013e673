"""One call of a chain (the user's forward, from the ``with remat.chain`` to its
end): its stage calls checked and handed to the measuring half (remat/measure/measuring.py)
or the running half (remat/runtime/runner.py), and the recordings of the chains, per key
(Note [Chain keys], remat/chain.py), in a bounded cache.
"""

import collections
import threading
import time
import warnings
import weakref

import torch
import torch.autograd.forward_ad as forward_ad
from torch.nn.modules import module as nn_module
from torch.nn.parameter import is_lazy
from torch.utils._pytree import tree_leaves

from ..budget import resolve_budget
from ..measure.costs_source import chain_costs, distributed, read_costs, write_costs
from ..errors import RematError, StageError, not_handed_on
from ..explanation import Explanation, publish
from ..measure.measuring import StageMeasuring, shared_grad_transients
from ..measure.recording import Recording
from ..measure.refine import ATTEMPTS, StageTimes
from .replay import capture_autocast, capture_rng, cuda_devices
from .runner import StageRunning, site_text
from .recompute import replaying
from .executor import Run
from .stage_call import StageCall
from .stage_check import check_hooks_enabled, check_output, find_activation, handed_on, signature
from .tensor_slots import module_slots, take

__all__ = ["ChainCall", "CACHE_SIZE", "clear_cache"]

CACHE_SIZE = 64
_cache = collections.OrderedDict()   # chain key -> Recording, least recently used first
_cache_lock = threading.Lock()


def clear_cache():
    """Forget every recorded chain (the next call of each measures again)."""
    with _cache_lock:
        _cache.clear()


_warned_transforms = []
_warned_sizes = set()   # costs files whose input size differed from a call's (warned once each)
_warned_empty = set()   # chain sites warned of by ``_no_stage``


def _no_stage(spec, site):
    """Warn, once per chain site, that a chain called under grad mode saw no stage call."""
    if site in _warned_empty:
        return
    _warned_empty.add(site)
    hint = getattr(spec, "empty_hint", None) or (
        "mark the blocks with remat.stage and call them inside the `with remat.chain(...)` block")
    warnings.warn(f"remat: the chain at {site_text(site)} ran no stage, so nothing in it is under its budget; {hint}",
                  RuntimeWarning, stacklevel=4)


def _hooks_between(before, after):
    """For an error about code between two stages: a sentence on the module hooks
    that run there, around the stages' forwards (``before``'s forward hooks,
    ``after``'s forward pre-hooks, global ones), or ""."""
    hooks = []
    if getattr(before, "_forward_hooks", None) or nn_module._global_forward_hooks:
        hooks.append("forward hooks")
    if getattr(after, "_forward_pre_hooks", None) or nn_module._global_forward_pre_hooks:
        hooks.append("forward pre-hooks")
    if not hooks:
        return ""
    return (f". The stage modules' {' and '.join(hooks)} run there, around the stages' forwards: if one "
            f"changes the activation, register it on a submodule inside the stage instead, or do its work "
            f"in the forward")


def _transformed(x):
    """True if ``x`` is a torch.func transform's wrapped tensor (vmap's, grad's)."""
    check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return check is not None and check(x)


def _dual(x, args, kwargs):
    """True if a forward-mode AD level is open and the chain's input or a tensor side
    input of its first stage carries a tangent."""
    if forward_ad._current_level < 0:
        return False
    return any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
               for t in [x, *tree_leaves((args, kwargs))])


class ChainCall(StageMeasuring, StageRunning):
    """One open chain on one thread (one call of the user's forward)."""

    def __init__(self, spec, site):
        self.spec = spec
        self.site = site
        self.k = 0
        self.called = False     # a stage was called inside the chain (recorded or not)
        self.prev = None
        self.prev_version = 0
        self.prev_name = None
        self.prev_ident = None
        self.mode = None
        self.in_stage = False
        self.entry = None
        self.key = None
        self.run = None
        self.plan = None
        self.budget = None
        self.new = None
        self.diverged = 0
        self.rng_start = None
        self.originals = {}
        self.given = None
        self.grad_pool = None
        self.upstream = None
        self.held_bytes = 0
        self.measured = {}      # stage -> what run 4 of Note [Measuring a stage] needs of it
        self.relayout = None    # (that of the stage before, the layout its gradient has) due for run 4
        self.twins = {}         # Note [Twin stages] (remat/measure/measuring.py): key -> stage
        self.outs = {}          # measuring: stage -> weak reference to the activation it returned
        self.dropped = []       # running: (i, weak reference to a^i's storage) the plan lets go
        self.acts = []          # running: (i, weak reference to a^i's storage), each stage
        self.source = None      # a^0's storage
        self.skipped = None     # a stage called under no_grad after stage 1
        self.costs_path = None  # the costs file this measuring call reads or writes
        self.seen = {}          # id of each stage's object -> the first stage it was
        self.stale = False      # running: a stage saved other tensors than the recording says
        self.unchecked = []     # running: stages whose module is checked at the end (remat/runtime/runner.py)

    # stage calls ---------------------------------------------------------

    def call(self, ident, name, fn, args, kwargs, start):
        self.called = True
        if self.in_stage or replaying():
            return fn(*args, **kwargs)
        if not torch.is_grad_enabled():
            if self.k:
                self.skipped = name   # (named if a stage follows, which cannot take its output)
            return fn(*args, **kwargs)
        t0 = time.perf_counter()   # (a stamped call's forward time: remat's checks included)
        pos, in_kw, x = find_activation(args, kwargs, start, fn)
        if x is None:
            raise StageError(
                f"remat: stage {self.k + 1} ({name}) got no tensor argument; the first tensor "
                f"argument of a stage is the activation that flows along the chain"
            )
        k = self.k + 1
        if k == 1 and (_transformed(x) or _dual(x, args, kwargs)):
            # inside torch.func.vmap / grad: remat's hooks and meter cannot see through
            # the transforms' wrapped tensors; dual tensors of forward-mode AD carry
            # tangents whose formulas save tensors for the backward that a recomputation
            # (of the primal) cannot make again. The chain runs plainly this call
            if not _warned_transforms:
                _warned_transforms.append(True)
                warnings.warn("remat: a chain called inside a torch.func transform (vmap, grad, ...) or on "
                              "forward-mode AD's dual tensors runs its stages plainly, without a budget",
                              RuntimeWarning, stacklevel=3)
            self.in_stage = True   # (every stage of this call: the chain is never entered)
            return fn(*args, **kwargs)
        if k == 1:
            if x.is_inference():
                raise StageError(
                    f"remat: the chain's input (to stage 1, {name}) was made under torch.inference_mode(), "
                    f"and autograd can neither save it nor track changes to it; make it outside "
                    f"inference mode, or pass a copy made outside it (x.clone())")
            check_hooks_enabled(name)
            self._begin(ident, args, kwargs, x)
            self.source = x.untyped_storage()
        elif not handed_on(x, self.prev):
            raise not_handed_on(k, name, self.prev_name, self.skipped, self.seen.get(id(ident)),
                                _hooks_between(self.prev_ident, ident) + getattr(self.spec, "split_hint", ""))
        elif x._version != self.prev_version:
            raise StageError(
                f"remat: the output of stage {k - 1} ({self.prev_name}) was modified in place before "
                f"stage {k} ({name}); move the in-place code into one of the stages"
                f"{_hooks_between(self.prev_ident, ident)}"
            )
        self.k = k
        self.seen.setdefault(id(ident), k)
        call = StageCall(k, name, fn, args, kwargs, pos, in_kw, x.requires_grad)
        call.autocast = self.autocast if k == 1 else capture_autocast(self.autocast)
        if self.mode == "run" and not self._matches(k, ident, x, call):
            self._diverge(k)
        if self.mode == "measure":
            call.slots = module_slots(ident)
            call.tensors = take(call.slots[0]) if call.slots[0] else None
            if call.tensors and any(is_lazy(t) for t in call.tensors if t is not None):
                raise StageError(
                    f"remat: stage {k} ({name}) has lazy parameters or buffers not initialized yet "
                    f"(nn.LazyLinear, ...), which remat cannot measure; run the model once first, e.g. "
                    f"under torch.no_grad() (the dry run PyTorch asks for before building an optimizer)")
        version = x._version
        self.in_stage = True
        try:
            if self.mode == "run":
                out = self._run_stage(call, x)
            else:
                out = self._measure_stage(call, ident, x)
        except BaseException as exc:
            if hasattr(exc, "add_note") and not isinstance(exc, RematError):
                exc.add_note(f"(raised in remat stage {k}: {name})")
            raise
        finally:
            self.in_stage = False
        act = check_output(call, out, x, version)
        call.seal()
        if self.mode == "measure":
            self.outs[k] = weakref.ref(act)
        elif k not in self.entry.caller:
            self.acts.append((k, weakref.ref(act.untyped_storage()), act.grad_fn if k == 1 else None))
        self.prev = act
        self.prev_version = act._version
        self.prev_name = name
        self.prev_ident = ident
        if self.mode == "run" and self.run.clock is not None:
            self.run.clock.ran(k, time.perf_counter() - t0, act, [x, *tree_leaves((call.args, call.kwargs))])
        return out

    def _begin(self, ident, args, kwargs, x):
        autocast = capture_autocast()
        training = getattr(ident, "training", None)
        self.key = (self.site, id(ident), signature((args[1:] if args and args[0] is ident else args, kwargs)),
                    training, autocast)
        self.autocast = autocast
        with _cache_lock:
            entry = _cache.get(self.key)
            if entry is not None:
                if entry.idents[0]() is not ident:
                    entry = None
                    del _cache[self.key]
                else:
                    _cache.move_to_end(self.key)
        self.entry = entry
        self.budget = resolve_budget(self.spec.budget, x.device)
        if entry is not None and entry.costs is not None:
            if entry.samples and entry.attempts == 0:
                entry.refine()   # the last call that could be stamped was not (no whole backward)
            if entry.unsaved:
                entry.unsaved = False
                write_costs(entry.costs, entry.costs_file)
            try:
                self.plan = entry.plan(self.budget, self.spec.algorithm, self.spec.slots)
            except RematError:   # explain() shows this call's budget, with no schedule, as a first call's
                publish(Explanation(entry.costs, None, self.budget, entry.names, entry.costs))
                raise
            schedule, modes, back, fall_at, _ = self.plan
            self.mode = "run"
            self.run = Run(back, fall_at, autocast)
            if entry.attempts > 0:
                entry.attempts -= 1
                self.run.clock = StageTimes(entry)
        else:
            self.mode = "measure"
            self.new = Recording()
            self.run = Run(None, {}, autocast)
            self.rng_start = capture_rng(cuda_devices([x]))
            self.given = read_costs(self.spec.costs_path)
            self.costs_path = self.spec.costs_path
            size = x.untyped_storage().nbytes()
            if self.given is not None and self.given.input_bytes != size:
                # another input size (the last, smaller batch; another sequence length):
                # measured as without a file, which keeps the costs it holds
                if self.costs_path not in _warned_sizes:
                    _warned_sizes.add(self.costs_path)
                    warnings.warn(
                        f"remat: the costs in {self.costs_path} are for an input of {self.given.input_bytes} "
                        f"bytes; this call's is {size} (another batch size or sequence length?): it is "
                        f"measured, and the file keeps the costs it has", RuntimeWarning, stacklevel=4)
                self.given = None
                self.costs_path = None
            if self.given is None and not x.is_cuda and not distributed():
                # the next two calls time the stages again (Note [Timing the second call])
                self.new.attempts = ATTEMPTS
                self.new.costs_file = self.costs_path

    # end of the chain ----------------------------------------------------

    def finish(self):
        if self.k == 0:
            if not self.called and torch.is_grad_enabled():
                _no_stage(self.spec, self.site)
            return
        if self.mode == "run":
            t0 = time.perf_counter()
            if self._finish_run():
                with _cache_lock:
                    _cache.pop(self.key, None)
            publish(Explanation(self.plan[4], self.plan[0], self.budget, self.entry.names,
                                 self.entry.costs))
            if self.run.clock is not None:   # (the call's end is charged to its last stage)
                self.run.clock.ran_more(self.k, time.perf_counter() - t0)
            return
        new = self.new
        try:
            self.in_stage = True   # stages inside the stage measured again run plainly
            try:
                self._measure_backward_again()
            finally:
                self.in_stage = False
                self.measured, self.grad_pool, self.upstream = {}, None, None
            new.caller_holds(self.outs, self.k)
            if self.given is None:
                for i, extra in enumerate(shared_grad_transients(new.held)):
                    row = new.rows[i]
                    if extra and i + 1 >= self.diverged and row is not None and "bwd_tmp" in row:
                        row["bwd_tmp"] += extra
            new.costs = chain_costs(new.rows, new.input_bytes, new.held_bytes(), self.costs_path, self.given)
        except BaseException:
            self._undo()
            raise
        with _cache_lock:
            _cache[self.key] = new
            _cache.move_to_end(self.key)
            if len(_cache) > CACHE_SIZE:
                # recordings of models that are gone can never match again: they go first
                for key in [k for k, e in _cache.items() if e.idents[0]() is None]:
                    del _cache[key]
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
        new.watch_output(self.prev)
        try:
            # (this call's own backward may yet show its output let go: Note [The
            # chain's output], remat/measure/recording.py; only a budget under the measured
            # costs' minimum fails now)
            plan = new.plan(self.budget, self.spec.algorithm, self.spec.slots)
        except Exception as exc:
            self._undo()
            if isinstance(exc, RematError):
                publish(Explanation(new.costs, None, self.budget, new.names, new.costs))
            raise
        publish(Explanation(plan[4], plan[0], self.budget, new.names, new.costs))

    def _undo(self):
        """Put RNG and in-place state back as before this call (a failed first call leaves no trace)."""
        if self.rng_start is not None:
            torch.set_rng_state(self.rng_start.cpu)
            for d, s in self.rng_start.cuda:
                torch.cuda.set_rng_state(s, d)
        with torch.no_grad():
            for t, old in self.originals.values():
                t.copy_(old)
