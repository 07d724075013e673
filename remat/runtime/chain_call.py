"""One call of a chain (the user's forward, from the ``with remat.chain`` to its end): its stage calls
checked and handed to its measuring part (``Measurer``, remat/measure/measuring.py) or its running part
(``Runner``, remat/runtime/runner.py), and the chains' records, per key (Note [Chain keys]), in a bounded cache."""

import collections
import threading
import time
import warnings

import torch
import torch.autograd.forward_ad as forward_ad
from torch.utils._pytree import tree_leaves

from ..dynamo import in_compiled_frame
from ..errors import BudgetError, RematError, StageError, not_handed_on, tail_unseen
from ..measure.chain_record import NO_HINT, write_costs
from ..measure.measuring import Measurer
from ..measure.overlap import other_chains, overlapping_plan
from ..measure.refine import StageTimes, refine
from ..measure.linger import LINGERING, Before, ends, settle
from ..measure.tail import TAIL_TRIES, TailMeter, abandoned, backward_seen, output_held_later
from ..solver.plan import Plan
from ..solver.group import least_planned
from ..solver.solve import minimum_budget, solve
from ..units import format_bytes
from .recompute import replaying, take_slots
from .replay import capture_autocast, weight_caches
from .paths import keep_path, new_shape, path_room, shorter_path, switch_path, unfrozen
from .executor import distributed, in_flight
from .runner import Runner, site_text, watch_output
from .stage_call import (StageCall, check_hooks_enabled, check_output, find_activation, handed_on, hooks_between,
                         packed_hint, signature)

__all__ = ["ChainCall", "CACHE_SIZE", "clear_cache"]

CACHE_SIZE = 64
_cache = collections.OrderedDict()   # chain key -> ChainRecord, least recently used first
_cache_lock, measuring_peaks = threading.Lock(), []   # (the open ``remat.measure_peak`` blocks, innermost last)


def clear_cache():
    """Forget every recorded chain (the next call of each measures again)."""
    settle()   # (and end a meter left after a block: remat/measure/linger.py)
    with _cache_lock:
        _cache.clear()


_warned_transforms, _warned_empty = [], set()   # (chain sites warned of by ``_no_stage``)


def _no_stage(spec, site):
    """Warn, once per chain site, that a chain called under grad mode saw no stage call."""
    if site in _warned_empty:
        return
    _warned_empty.add(site)
    hint = spec.hints.empty or "mark the blocks with remat.stage and call them inside the `with remat.chain(...)` block"
    warnings.warn(f"remat: the chain at {site_text(site)} ran no stage, so nothing in it is under its budget; {hint}",
                  RuntimeWarning, stacklevel=4)


def _transformed(x):
    """True if ``x`` is a torch.func transform's wrapped tensor (vmap's, grad's)."""
    check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return check is not None and check(x)


def _dual(x, args, kwargs):
    """True if a forward-mode AD level is open and the chain's input or a side input carries a tangent."""
    dual = forward_ad.unpack_dual   # (no level open: no tangent anywhere, nothing walked)
    return forward_ad._current_level >= 0 and any(
        isinstance(t, torch.Tensor) and dual(t).tangent is not None for t in [x, *tree_leaves((args, kwargs))])


class ChainCall:
    """One open chain on one thread (one call of the user's forward): the stage calls checked as they come
    and handed to its part, a ``Measurer`` or a ``Runner``; a call that leaves its recorded path hands the
    runner's record so far to a new measurer (``Runner.diverge``)."""

    def __init__(self, spec, site):
        # (a meter left after the last block goes; a chain run plainly, under no_grad, is the tail's: linger.py)
        self.cut_short = (settle(cut=True) or ()) if LINGERING and torch.is_grad_enabled() else ()
        self.spec, self.site, self.k = spec, site, 0
        self.called = False     # a stage was called inside the chain (recorded or not)
        self.prev = None        # the activation the last stage returned
        self.prev_version, self.prev_name, self.prev_ident, self.in_stage = 0, None, None, False
        self.key = self.budget = self.autocast = None
        self.part = None        # a Measurer or a Runner, from stage 1 on
        self.source = None      # a^0's storage
        self.skipped = None     # a stage called under no_grad after stage 1
        self.seen = {}          # id of each stage's object -> the first stage it was
        self.tail = None        # a measuring call's TailMeter (remat/measure/tail.py)
        self.tail_due = None    # the record whose tail this running call meters (Note [The chain's tail] 6)
        self.before = None      # a measuring call's Before (remat/measure/linger.py)
        self.compiled = None    # whether a frame Dynamo runs is on the stack (no TailMeter): asked once

    @property
    def measuring(self):
        """Whether this call measures (from the stage it left its recorded path at, if so)."""
        return isinstance(self.part, Measurer)

    # stage calls ---------------------------------------------------------

    def call(self, ident, name, fn, args, kwargs):
        """Stage ``ident`` (named ``name``) is called as ``fn(*args, **kwargs)``
        inside the chain: checked, and run by the call's part; returns what it returned."""
        self.called = True
        if self.in_stage or replaying():
            return fn(*args, **kwargs)
        if self.tail is not None:
            self.tail.close()   # (the code since the last stage was not the tail)
        if not torch.is_grad_enabled():
            if self.k:
                self.skipped = name   # (named if a stage follows, which cannot take its output)
            return fn(*args, **kwargs)
        t0 = time.perf_counter()   # (a stamped call's forward time: remat's checks included)
        pos, in_kw, x = find_activation(args, kwargs, 0, fn)
        if x is None:
            raise StageError(f"remat: stage {self.k + 1} ({name}) got no tensor argument; the first tensor argument "
                             f"of a stage is the activation that flows along the chain{packed_hint(args, kwargs)}")
        k = self.k + 1
        if k == 1:
            if self._plainly(x, args, kwargs):
                return fn(*args, **kwargs)
            if x.is_inference():
                raise StageError(
                    f"remat: the chain's input (to stage 1, {name}) was made under torch.inference_mode(), "
                    f"and autograd can neither save it nor track changes to it; make it outside "
                    f"inference mode, or pass a copy made outside it (x.clone())")
            check_hooks_enabled(name)
            self._begin(ident, args, kwargs, x)
            self.source = x.untyped_storage()
        else:
            self._check_handed_on(k, ident, name, x, (args, kwargs, in_kw))
        self.k = k
        self.seen.setdefault(id(ident), k)
        call = StageCall(k, name, fn, args, kwargs, pos, in_kw, x.requires_grad)
        call.autocast = self.autocast if k == 1 else capture_autocast(self.autocast)
        if not self.measuring and not self.part.matches(k, ident, x, call):
            runner = self.part   # (the record of the path it left tells of the tail and of storing all)
            if switch_path(runner, k, ident, x, call, self.budget, self.spec):
                _remember(self.key, runner.base)
            else:
                self.part = Measurer(self.budget, self.autocast, runner.diverge(k), runner.run,
                                     runner.entry.hint(self.budget))
        if self.measuring:
            take_slots(call, ident)
            if not x.is_cuda and not distributed():   # (the code before the chain, remat/measure/linger.py)
                self.before = Before.reach(self.before, self.part.new, self.budget, call, x, k)
        version = x._version
        self.in_stage = True
        try:
            out = self.part.stage(call, ident, x)
        except BaseException as exc:
            if hasattr(exc, "add_note") and not isinstance(exc, RematError):
                exc.add_note(f"(raised in remat stage {k}: {name})")
            raise
        finally:
            self.in_stage = False
        act = check_output(call, out, x, version)
        call.seal()
        self.part.returned(k, act)
        self.prev, self.prev_version, self.prev_name, self.prev_ident = act, act._version, name, ident
        if self.measuring or self.tail_due is not None:   # (what runs until the next stage, or the block's end)
            if self.tail is None:
                self.tail, self.compiled = TailMeter(), in_compiled_frame()
            self.tail.open(act, self.compiled)
            if self.measuring:
                return out
        clock = self.part.run.clock
        if clock is not None:
            clock.ran(k, time.perf_counter() - t0, act, [x, *tree_leaves((call.args, call.kwargs))],
                      self.part.run.option[k])
        return out

    def _plainly(self, x, args, kwargs):
        """Inside torch.func.vmap / grad: remat's hooks and meter cannot see through the transforms'
        wrapped tensors; dual tensors of forward-mode AD carry tangents whose formulas save tensors for
        the backward that a recomputation (of the primal) cannot make again. True if so: the chain
        runs plainly this call (every stage: the chain is never entered)."""
        if not (_transformed(x) or _dual(x, args, kwargs)):
            return False
        if not _warned_transforms:
            _warned_transforms.append(True)
            warnings.warn("remat: a chain called inside a torch.func transform (vmap, grad, ...) or on "
                          "forward-mode AD's dual tensors runs its stages plainly, without a budget",
                          RuntimeWarning, stacklevel=4)
        self.in_stage = True
        return True

    def _check_handed_on(self, k, ident, name, x, given=None):
        """Stage k's activation ``x`` is what stage k-1 returned, as it returned it."""
        if not handed_on(x, self.prev):
            raise not_handed_on(k, name, self.prev_name, self.skipped, self.seen.get(id(ident)),
                                hooks_between(self.prev_ident, ident) + (self.spec.hints.split or ""), x, self.prev,
                                given)
        if x._version != self.prev_version:
            raise StageError(f"remat: the output of stage {k - 1} ({self.prev_name}) was modified in place before "
                             f"stage {k} ({name}); move the in-place code into one of the stages"
                             f"{hooks_between(self.prev_ident, ident)}")

    def _begin(self, ident, args, kwargs, x):
        """Stage 1: the chain's key, and its part: a runner if the key is recorded."""
        if measuring_peaks:   # (Note [Measuring the peak], remat/measure/peak.py)
            measuring_peaks[-1].chain_opened(x)
        autocast = capture_autocast()
        training = getattr(ident, "training", None)
        self.key = (self.site, id(ident), signature((args[1:] if args and args[0] is ident else args, kwargs)),
                    training, autocast)
        self.autocast = autocast
        with _cache_lock:
            entry = _cache.get(self.key)
            if entry is not None:
                if entry.stages[0].ident() is not ident:
                    entry = None
                    del _cache[self.key]
                else:
                    _cache.move_to_end(self.key)
        for meter in self.cut_short:   # (its measuring call's backward did not come: a new step)
            abandoned(meter, entry, x)
        if entry is not None and self.spec.options is True and not entry.options:
            entry = None   # (measured without options, which this call asks for: measured again)
        if others := set(in_flight()) - set(in_flight(ident)):   # (another chain's call: remat/measure/overlap.py)
            other_chains(others, self.site)
        self.budget, thawed = self.spec.bytes_on(x.device), False
        if entry is None or entry.costs is None or entry.remeasure or entry.suspects and (thawed := unfrozen(entry)):
            given = entry.costs if entry is not None and entry.remeasure == "given" else None   # (measure()'s)
            self.part = Measurer.first(self.spec, self.budget, autocast, x, NO_HINT if thawed else
                                       _hint(self.key, ident, self.budget, x.untyped_storage().nbytes()), given)
            if entry is not None and given is None:   # (Note [Paths of a chain], remat/runtime/paths.py)
                keep_path(self.part.new, entry)
            return
        if entry.samples and entry.attempts == 0:
            refine(entry)   # the last call that could be stamped was not (no whole backward)
        if entry.unsaved:
            entry.unsaved = False
            write_costs(entry.costs, entry.costs_file)
        try:   # (a call opened while another of the chain is in flight: remat/measure/overlap.py)
            entry.overlapping = 0
            plan = overlapping_plan(entry, alive, lambda held: plan_for(entry, self.budget, self.spec, held)) \
                if (alive := in_flight(ident)) else plan_for(entry, self.budget, self.spec)
        except RematError:   # explain() shows this call's budget, with no schedule, as a first call's
            self.spec.explained(entry.costs, None, self.budget, entry.names, entry.costs, entry)
            raise
        self.part = Runner(self.key, self.site, entry, plan, autocast)
        tail = entry.tail   # (one cut short: a running call meters its own, Note [The chain's tail] 6)
        self.tail_due = entry if tail is not None and tail.cut and entry.tail_tries < TAIL_TRIES else None
        if entry.attempts > 0:
            entry.attempts -= 1
            self.part.run.clock = StageTimes(entry)

    # end of the chain ----------------------------------------------------

    def finish(self):
        """The chain's ``with`` block ended without an exception."""
        node = getattr(self.prev, "grad_fn", None)
        if node is not None:   # (Note [The code before the chain], remat/measure/linger.py)
            ends.seq = node._sequence_nr()
        if self.k == 0:
            if not self.called and torch.is_grad_enabled():
                _no_stage(self.spec, self.site)
            return
        if not self.measuring:
            self._finish_run()
            return
        measurer = self.part
        # (what the tail's backward hooks hold: no activation, so not self, whose prev is a^L)
        record, published, spec, budget = [None], [None], self.spec, self.budget
        tail = self.tail.seen(self.prev, [ref() for ref in measurer.outs.values()],
                              lambda seen: backward_seen(record[0], spec, budget, published, plan_for, seen),
                              output_held_later(measurer.new.stages, measurer.options))
        self.in_stage = True   # stages inside the stage measured again run plainly
        try:
            new = measurer.finish(self.k, tail.alive)
        finally:
            self.in_stage = False
        # (autocast's casts presumed let go before the backward, run after its block, until it tells)
        tail.casts, new.tail, record[0] = "forward" if weight_caches() == (True, False) else "", tail, new
        _remember(self.key, new)
        watch_output(new, self.prev)
        try:
            # (its backward may show its output let go, Note [The chain's output]: a budget under the least fails)
            def fits(held):   # (beside run 4's copies of written state, else they go: 264 B over on BatchNorm)
                try:
                    return plan_for(new, self.budget, self.spec, held) is not None
                except BudgetError:
                    return False
            plan = plan_for(new, self.budget, self.spec, measurer.run4.copies(fits))
        except Exception as exc:
            measurer.undo()
            if isinstance(exc, RematError):
                self.spec.explained(new.costs, None, self.budget, new.names, new.costs, new)
            raise tail_unseen(exc, tail)
        measurer.originals.clear()   # (nothing to undo now: the copies of written state go)
        self.spec.explained(plan.costs, plan.schedule, self.budget, new.names, new.costs, new)
        published[0] = self.spec.last
        self.tail.linger(new)   # (a tail after the block: Note [The chain's tail] 5, remat/measure/tail.py)

    def abort(self, exc=None):
        """The block ended with ``exc``: a measuring call remat failed leaves no trace (a stage's error: plain's)."""
        if self.tail is not None:
            self.tail.close()
        if isinstance(exc, RematError):   # (a refused stage left those before it with their writes)
            getattr(self.part, "undo", lambda: None)()

    def _finish_run(self):
        runner = self.part
        t0 = time.perf_counter()
        if runner.finish(self.k, self.prev, self.source):   # (the next measures, or runs that path's record)
            shorter_path(self.key, runner.base, runner.at(self.k), _remember)
        plan, entry = runner.plan, runner.entry
        self.spec.explained(plan.costs, plan.schedule, self.budget, entry.names, entry.costs, entry)
        if runner.run.clock is not None:   # (the call's end is charged to its last stage)
            runner.run.clock.ran_more(self.k, time.perf_counter() - t0)
        entry = self.tail_due
        if entry is not None and self.tail is not None and runner.entry is entry:   # (Note [The chain's tail] 6)
            spec, budget, published = self.spec, self.budget, [self.spec.last]
            read = output_held_later(entry.stages, entry.costs.has_options)
            entry.tail = self.tail.seen(self.prev, [self.prev], lambda seen: backward_seen(
                entry, spec, budget, published, plan_for, seen), read)
            self.tail.linger()


def _hint(this, ident, budget, input_bytes):
    """What a measuring call of the chain key ``this`` whose first stage is ``ident`` can take from its
    latest record (its ``hint``): one of this model's, whose stages include ``ident`` (every
    ``remat.Sequential`` opens its chain at one site: another model's record put a first call up to 118%
    over its budget), at its site, training mode and autocast state (a bf16 record's: 19% over)."""
    with _cache_lock:
        mine = [(key, record) for key, record in _cache.items()
                if key[0] == this[0] and key[3:] == this[3:] and any(s.ident() is ident for s in record.stages)]
    if mine and mine[-1][0][1] == this[1] and mine[-1][0][2] != this[2]:   # (a shape not measured: paths.py)
        new_shape(this[0], ident, len({key[2] for key, _ in mine if key[1] == this[1]}))
    return mine[-1][1].hint(budget, input_bytes) if mine else NO_HINT


def _remember(key, chain_record):
    """Cache ``chain_record`` under ``key``; records of models that are gone go first."""
    with _cache_lock:
        _cache[key] = chain_record
        _cache.move_to_end(key)
        if len(_cache) > CACHE_SIZE:
            for old in [k for k, e in _cache.items() if e.ident(1) is None]:
                del _cache[old]
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)


def plan_for(entry, budget, spec, overlap=0):
    """The plan for ``budget`` (bytes) and the settings of ``spec`` (a ``remat.chain``),
    solved from the chain record ``entry``'s planning costs and kept (``entry.plans``); a
    ``BudgetError`` where none fits, naming the least (Note [The chain's output], chain_record.py).
    ``overlap``: bytes held for a call alive with another (remat/measure/overlap.py)."""
    algorithm, slots, options = spec.algorithm, spec.slots, spec.options
    key = (budget, algorithm, slots, options, *map(id, entry.others)) + ((("overlap", overlap),) if overlap else ())
    plan = entry.plans.get(key)
    if plan is None:
        costs = entry.planning_costs(options=options).with_held(overlap)
        end = entry.step_end(costs)
        if end > budget:   # (Note [The code before the chain], remat/measure/linger.py)
            raise BudgetError(
                f"remat: budget {format_bytes(budget)} is below this step's minimum of {format_bytes(end)} "
                f"({end} bytes): after the chain's backward, the backward of the code before the chain (an "
                f"embedding whose weight the head shares, say) needs {format_bytes(entry.before)} beside the "
                f"{format_bytes(end - entry.before)} the chain leaves held, under any plan; raise the budget",
                max(end, minimum_budget(costs)))
        try:
            schedule = solve(costs, budget, algorithm, slots)
        except BudgetError as exc:
            if not entry.counts_output():
                raise
            if entry.output_held:
                raise BudgetError(
                    f"{exc}. That counts the chain's output ({format_bytes(entry.costs.out_bytes[-1])}) "
                    f"as held through the backward: the code around the chain kept it "
                    f"(remat/measure/chain_record.py Note [The chain's output])", exc.minimum) from None
            schedule = None
        if schedule is None:
            # no backward has told yet whether the code around the chain lets a^L go: as the
            # measuring call does, plan on the costs as measured and let this call's backward
            # tell (the minimum a first call's error names must run: retrying with it is what it asks)
            costs = entry.planning_costs(output=False, options=options).with_held(overlap)
            failed = None
            try:
                schedule = solve(costs, budget, algorithm, slots)
            except BudgetError as exc:
                failed, least = str(exc), exc.minimum
            if failed is not None:   # (raised here: no "during handling" chain)
                # (the optimal algorithm's least budget, a long chain's on groups; the others' errors say their own)
                held = algorithm == "optimal" and least_planned(entry.planning_costs().with_held(overlap), slots)
                note = (f"; {format_bytes(held)} ({held} bytes) where the code around the chain keeps "
                        f"its output through the backward (y = net(x); loss(y).backward())") if held else ""
                raise BudgetError(failed + note, least)
        plan = Plan.of(schedule, costs, entry.policies())
        if entry.others:   # (Note [Paths of a chain])
            plan = path_room(entry, plan, budget, spec,
                             lambda b: Plan.of(solve(costs, b, algorithm, slots), costs, entry.policies()))
        entry.plans = entry.plans if len(entry.plans) <= 16 else {}
        entry.plans[key] = plan
    return plan
