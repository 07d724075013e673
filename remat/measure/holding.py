"""What a chain's measuring call holds, within the budget: the stage inputs, the
saved tensors it keeps, and a check that each stage fits (the ``Holding`` of a
``Measurer``, remat/measure/measuring.py).

Note [Measuring within the budget]
----------------------------------
The measuring call's own peak counts: it is a training step (docs/how-it-works.md,
"The tail"). It holds stage inputs (a checkpoint each), runs a stage's forward
and its backward on that graph, and lets the stage's saved tensors go as
soon as the stage is measured (before its forward without recording),
unless it can keep them: they save the
backward a recomputation, but what comes after the last stage, the chain's
tail, is not known yet, and in a model whose head dwarfs a block (a language
model's logits) saved tensors kept up to the budget put the step at about
twice it. So stages keep them only where a record of this chain (at
another shape, scaled, or the path it left) stores everything within the
budget with a stage's record to spare (a kept stage's measured backward holds
its saved tensors to its end: ``keep_all``), and while they fit beside what
the call holds, room to measure the next stage and the tail (``keep_saved``:
the record of a path left for dropout switched on tells sizes this call's
stages exceed); else the backward rebuilds every stage
from its input, the last one too: one more forward, once. A stage whose own forward and backward cannot fit the budget
(the least any schedule needs, ``fits``) stops the call with a
``BudgetError`` naming it, the call undone, before the stages after it run.
Where the tail is not known (a chain's first call), the call holds no stage
input at all: the tail runs on what any schedule holds at least, the chain's
input and output, so that a large head (a language model's logits and their
gradient) cannot put the step over the budget on top of inputs held for the
chain's backward (at a GPT's minimum it did, by about 30%). (But an input
needing no grad, where a stage cut the graph: rebuilds start there, unless
every stage below it saved nothing, whose anchors the run keeps down to the
chain's input.) That backward's
first rebuild, of the last stage from the chain's input, holds the inputs
of the stages it runs again, evenly spaced, as many as the budget has room
for beside what the backward needs now (``rebuild_holds``; the rebuilds
below do the same within their stretch): one more forward of the chain,
once. The last stage's forward then runs beside the chain's output, which
the code after the block may keep, and its gradient: its output made again
beside the caller's, which no plan storing that stage holds: ``least_budget``
counts it (``rebuild_least``; on a chain of two small stages under a
one-output head, 19% above the least any plan needs), and each stage's
rebuild beside its output's gradient, after the forwards below it (an
attention stage under a scaling went 6.7% over before). Below that, a first
call whose caller keeps the output goes over, and says so once its backward
has shown the output kept (``ChainRecord.output_kept``): as the block ends,
whether the caller keeps it is not known, and a check counting it refused
budgets that first calls letting it go run under. (Not under
torch.distributed: FSDP may have sharded a stage's parameters between its
forward and its backward, and a stage is run again
only in its own backward; the call then holds inputs as where the tail is
known, the tail counted as nothing.) Where the tail is known the stage inputs held must fit beside the
saved tensors kept, room to measure a stage like the largest so far (or, as
the record that showed the tail tells, like its largest), an input more (a
rebuild's) and the tail: past that only every ``spacing``-th
stage's is held, the spacing doubling as often as needed (``thin_inputs``),
and the backward rebuilds a stage from the nearest input held below it. What
the first call cannot hold to the budget is measuring a stage itself. Its
measured backward runs on the real forward's graph (retain_graph, for the
real backward), but where the call keeps none of the saved tensors it lets
each go once read for the last time, as a step's backward does
(``Releases``, remat/measure/timing.py; on CPU), the gradient it
hands the stage is the engine's only, and the parameters' gradients are let
go as they come (a step adds them into resident ones, which the budget does
not count: buffers standing in for those would count). So the first call
stays under the budget (tests/measure/test_first_call_budget.py), but near
a chain's least budget, where a stage met for the first time is measured
with its output alive, which can go over it (docs/limitations.md). Run 4
(a stage measured again for its gradient's layout) runs at the call's end
where ``run4_fits``, else in the call's own backward where
``run4_fits_now``, else not at all (run 2's figures stand). On CUDA,
where the saved tensors are held through that backward, the first call
stays within a stage's saved bytes of the budget.
"""

import itertools
import weakref

import torch

from ..errors import BudgetError
from ..solver.solve import minimum_budget
from ..units import format_bytes
from .record import stage_casts

__all__ = ["Holding", "least_budget", "measuring_least"]


def _sharded():
    """Whether a process group is up: FSDP may have sharded the stages' parameters
    between their forward and their backward, so that a stage runs again only in
    its own backward (Note [Measuring within the budget])."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def stage_least(x_in, out, saved, fwd_tmp, bwd_tmp):
    """What measuring a stage needs, its input ``x_in`` bytes and its record as
    measured: its forward holds its input; its backward makes its input's gradient
    (a schedule may have let the input go by then: Costs.fwd_drop)."""
    return max(x_in + max(saved, out + fwd_tmp), saved + out + x_in + bwd_tmp)


def measuring_least(costs, record=None):
    """The least budget a first call that measures the chain of ``costs`` runs under: its most demanding
    stage's ``stage_least``, or what measuring a stage held at once (``StageCosts.measure_peak``) where
    ``record``, the chain's ``ChainRecord``, has it; the chain's input beside a later stage's. A plan may
    need less: measuring runs each stage whole (not under an option) and its backward beside the stage's
    input and output, where B(i) may have let them go; and the caches' copies of the weights of the stages
    below it (autocast's casts, alive to the block's end: two bf16 linear stages' first call 4.8% over)."""
    costs = costs.without_tail()
    x = costs.sizes()
    stages = record.stages if record is not None else []
    peaks = [(s.costs.measure_peak or 0) if s.costs is not None else 0 for s in stages]
    casts = [0, *itertools.accumulate(map(stage_casts, stages))]   # (those of the stages below, in their caches)
    return max(max(stage_least(x[i], costs.out_bytes[i], costs.saved_bytes[i], costs.fwd_tmp[i], costs.bwd_tmp[i]),
                   peaks[i] if i < len(peaks) else 0) + (x[0] if i else 0) + (casts[i] if i < len(casts) else 0)
               for i in range(costs.length))


def rebuild_least(input_bytes, held, x_in, out, fwd_tmp):
    """What the measuring call's backward holds as it rebuilds a stage (of output ``out`` bytes) from that
    stage's input (``x_in`` bytes, 0 for the chain's): the chain's input and what the step holds (``held``,
    the chain's output among it where the caller keeps it), the output's gradient, and the stage's forward,
    its output made again (the last stage's beside the caller's: Note [Measuring within the budget])."""
    return input_bytes + held + out + x_in + out + fwd_tmp


def _rebuilds(costs, record):
    """The most the measuring call's backward holds rebuilding a stage from the chain's input, holding no
    input between (at the least budget), on the planning ``costs`` (the caller's output held where it counts)
    and the copies of written state it holds to its end (BatchNorm's statistics: 72 bytes over before): for
    each stage of ``record`` that saved something (the others are not rebuilt), its recording (``rebuild_least``:
    its output's gradient beside it, as the output the caller keeps is beside the last stage's), and the
    forwards without recording of the stages below it, beside that gradient."""
    stages = record.stages if record is not None else []
    chain = costs.without_tail()
    x, ftn, most, below = chain.sizes(), chain.fwd_tmp_nograd, 0, 0
    held = costs.held_bytes + (record.state_copies if record is not None else 0)
    for k in range(1, min(chain.length, len(stages)) + 1):
        if stages[k - 1].meta:
            most = max(most, rebuild_least(chain.input_bytes, held, x[k - 1] if k > 1 else 0, x[k],
                                           chain.fwd_tmp[k - 1]),
                       chain.input_bytes + held + x[k] + below if k > 1 else 0)
        below = max(below, (x[k - 1] if k > 1 else 0) + x[k] + ftn[k - 1])   # (Fn(k) of a later rebuild)
    return most


def least_budget(costs, measured, record=None):
    """The least budget every call of a chain runs under, the one that measures it
    included: the least any plan of its ``costs`` needs (``minimum_budget``); that
    of the measuring call's own plan (its ``record``'s costs with a^L held, as no
    backward has shown it gone yet: Note [The chain's output]; once one has, the
    measuring call's plan where none holding it fits did not hold it, and ran so)
    with the copies of written state it held through its tail (to undo itself, and
    for run 4); what measuring its most demanding stage held beside the chain's
    input (``measuring_least`` of the costs it ``measured``); and its backward's
    rebuilds (``rebuild_least``: of the last stage, beside the caller's output)."""
    first = minimum_budget(record.planning_costs()) + record.state_copies \
        if record is not None and record.costs is not None else 0
    return max(minimum_budget(costs), first, measuring_least(measured, record), _rebuilds(costs, record))


class Holding:
    """What a measuring call holds (Note [Measuring within the budget]).

    Args:
        budget: the call's budget in bytes.
        hint: (bytes the chain's tail needed, whether storing everything fits the
            budget, the most measuring a stage needs beyond its input, the largest
            stage input) as a record of the chain showed them
            (``ChainRecord.hint``); ``NO_HINT`` where none has.
        diverged: the stage the call left its recorded path at (0: a first call);
            the stages before it are the schedule's.
        held: bytes those stages hold (``held_before``, remat/runtime/paths.py).
    """

    def __init__(self, budget, hint, diverged, record=None, held=0):
        self.budget, self.diverged, self.record = budget, diverged, record
        self.tail_hint, self.keep_all, hinted, self.widest = hint
        self.held_bytes = self.before = held   # bytes of the saved tensors kept so far (and what stages before hold)
        self.inputs = []         # (stage, weak reference to its anchor, bytes) of the stage inputs held
        self.inputs_bytes = 0
        self.spacing = 1         # the stages whose input is held: every spacing-th (``thin_inputs``)
        self.largest = hinted    # the most measuring a stage needed beyond its input so far (or, hinted, will)
        self._casts = self._counted = 0   # (``_cached``: the casts of the first ``_counted`` stages)
        # (widest: the largest stage input so far, or, hinted, to come: alive as that stage is measured)

    def keep_saved(self, i, costs, given, input_bytes=0):
        """Whether measured stage i (its ``costs`` as measured, None if they come
        from a file) keeps its saved tensors for this call's backward (Note
        [Measuring within the budget]).

        Yes where a record of the chain (at another shape, scaled; or the path
        this call left) stores everything within the budget (``keep_all``), so
        that such a budget makes the first backward rebuild nothing, and while they
        fit beside what the call holds (the chain's input, ``input_bytes``), room
        to measure a stage like the largest and the tail: a record whose stages
        save less than this call's (its dropout off, this call's on) said everything
        fits, and the call went 18% over keeping them all. A stage run by a
        schedule before the chain diverged is left to it.
        """
        if i < self.diverged:
            return False
        saved = costs.saved_bytes if costs is not None else None
        if saved is None and given is not None and i <= given.length:
            saved = given.saved_bytes[i - 1]
        if saved is None or not self.keep_all or input_bytes + self.held_bytes + saved + self.inputs_bytes \
                + self.largest + self.widest + (self.tail_hint or 0) + self._cached() > self.budget:
            return False
        self.held_bytes += saved
        return True

    def thin_inputs(self, k, anchor, x, input_bytes, run=None):
        """Hold stage k's input (its anchor's) while the inputs held fit the budget
        beside the saved tensors kept, room to measure a stage like the largest so
        far and the tail, as far as it is known; past that, hold only every
        ``spacing``-th stage's, the spacing doubling as often as needed (the
        backward rebuilds a stage from the nearest input held below it: Note
        [Measuring within the budget]). ``run``: the call's ``Run``."""
        if k < 2 or k < self.diverged or anchor.input is None or k == self.diverged and not _below(run, k):
            # (the caller's; a schedule's; the first stage measured after them, where no rebuild can start below
            # it (``_below``): else it may go (held, a stage frozen between steps went 10% over as it measured))
            return
        nbytes = x.untyped_storage().nbytes()
        # the tail unknown, or off the spacing: let go (but an input needing no grad, where a stage cut the
        # graph: rebuilds start there, unless every stage below saved nothing, whose anchors the run keeps
        # (``Run.settle``) down to the chain's input: held through the tail, a leading ``x * 2`` on an input
        # needing no grad put a first call 14% over)
        pinned = {a.stage for a in run.pinned} if run is not None else ()   # (kept below a cut: ``Run.pin``)
        below = not self.diverged and run is not None and all(j in run.orphans or j in pinned for j in range(1, k))
        unknown = self.tail_hint is None and not _sharded() and (x.requires_grad or below)
        if unknown or (k - 1) % self.spacing:
            anchor.input = None
            return
        self.inputs.append((k, weakref.ref(anchor), nbytes))
        self.inputs_bytes += nbytes
        # (and an input more, the largest: a stage measured has its own alive beside the inputs held
        # (a CNN's later, wider one put a new shape's first call 5% over), and a rebuild from a held
        # input below a stage runs the stages between without recording, each output made while the
        # one before it is alive)
        room = self.budget - input_bytes - self.held_bytes - self.largest - max(nbytes, self.widest) \
            - (self.tail_hint or 0) - self._cached()
        while self.inputs_bytes > room and self.inputs:
            self.spacing *= 2
            kept = []
            for i, ref, n in self.inputs:
                a = ref()
                if a is None or a.input is None:
                    continue
                if (i - 1) % self.spacing:
                    a.input = None
                    self.inputs_bytes -= n
                else:
                    kept.append((i, ref, n))
            self.inputs = kept

    def fits(self, call, x, costs, given=None, chain_input=0):
        """Raise ``BudgetError`` if the budget cannot hold stage ``call`` alone: its
        input, its forward and its backward (Note [Measuring within the budget]),
        and the chain's input (``chain_input`` bytes, which the caller holds)
        beside them; note the most a stage's measuring needed so far (``largest``).
        Its ``costs`` as measured, or as the costs file ``given`` says (its own not
        measured)."""
        fields = None if costs is None else (costs.out_bytes, costs.saved_bytes, costs.fwd_tmp, costs.bwd_tmp)
        if (fields is None or None in fields) and given is not None and call.index <= given.length:
            i = call.index - 1
            fields = (given.out_bytes[i], given.saved_bytes[i], given.fwd_tmp[i], given.bwd_tmp[i])
        if fields is None or None in fields:
            return
        x_in = x.untyped_storage().nbytes()
        least = max(stage_least(x_in, *fields), (costs.measure_peak or 0) if costs is not None else 0)
        self.largest, self.widest = max(self.largest, least - x_in), max(self.widest, x_in)
        least += (chain_input if call.index > 1 else 0) + self._cached()
        if least > self.budget:
            raise BudgetError(
                f"remat: budget {format_bytes(self.budget)} is below this chain's minimum of "
                f"{format_bytes(least)} or more ({least} bytes) for its first call: stage {call.index} ({call.name}) "
                f"alone needs that to be measured, its forward and its backward beside its input and output "
                f"(the stages after it were not measured, which may need more); raise the budget, split "
                f"the stage, or measure at a larger budget once and keep the costs (remat.chain(costs=...))", least)

    def _cached(self):
        """Bytes of the caches' copies of the weights the stages measured so far made
        (autocast's casts: alive as the stages after them are measured), added up as
        stages come (the record only grows)."""
        stages = self.record.stages if self.record is not None else ()
        for stage in stages[self._counted:]:
            self._casts += stage_casts(stage)
        self._counted = len(stages)
        return self._casts

    def run4_fits(self, k, run, outs, tail=0):
        """Whether run 4 of stage k (Note [Measuring a stage] in
        remat/measure/profile.py: a fresh forward and backward of it) fits the budget
        beside what the call holds now, as far as it knows: the chain's input, the
        stage inputs ``run`` holds, the saved tensors kept, the stage outputs alive
        (``outs``: stage -> weak reference), ``tail`` (bytes) and the caches' copies of
        the weights (autocast's casts, alive to the autocast block's end). Beside a chain
        stored whole, run 4 once put a first call 41% over the budget; beside the casts
        of five bf16 stages, 25%."""
        record = self.record
        costs = record.stages[k - 1].costs
        alive = {j: ref() for j, ref in outs.items()}
        storages = run.held_storages() + [t.untyped_storage() for t in alive.values() if t is not None]
        held = record.input_bytes + self.held_bytes + tail + sum({st._cdata: st.nbytes() for st in storages}.values())
        held += self._cached()
        x_in = record.input_bytes if k == 1 else record.stages[k - 2].costs.out_bytes
        # its input (made again if let go) and its gradient, a fresh forward's saved tensors (its
        # output among them), the output's gradient and a copy of it, and the backward's transient
        again = x_in if k > 1 and alive.get(k - 1) is None else 0
        out = alive.get(k)   # (and the one element of the gradient it stands in, 16 bytes at most)
        stand_in = out.element_size() if out is not None else 16
        return held + again + x_in + costs.saved_bytes + 2 * costs.out_bytes + max(0, costs.bwd_tmp) + stand_in \
            <= self.budget

    def run4_fits_now(self, run, k, grad, again, copies):
        """Whether run 4 of stage k fits the budget in the call's backward, as the
        stage's gradient ``grad`` arrives and before the stage is rebuilt, beside
        what the call holds then: the chain's input, the gradients held through the
        step, what the tail keeps, the stage inputs and saved tensors ``run``'s
        anchors hold (each storage once, ``grad``'s too) and ``copies`` (bytes of
        the values written state had before the call). ``again``: the stage's input
        is to be made again. Run 4 there once put a first call 1.1% over."""
        record = self.record
        costs = record.stages[k - 1].costs
        live = {**_anchored(run), grad.untyped_storage()._cdata: grad.untyped_storage().nbytes()}
        held = record.input_bytes + record.held_bytes() + _tail_kept(record) + copies + sum(live.values())
        x_in = record.input_bytes if k == 1 else record.stages[k - 2].costs.out_bytes
        # its input if made again and its gradient, a fresh forward's saved tensors (its output
        # among them), the gradient's copy the stage may make, the backward's transient and the
        # one element its stand-in gradient is made of (2 bytes over the budget in bf16)
        need = (x_in if again else 0) + x_in + costs.saved_bytes + costs.out_bytes + max(0, costs.bwd_tmp) \
            + grad.element_size()
        return held + need <= self.budget

    def rebuild_holds(self, run, j, k):
        """The stages strictly between j and k whose input a rebuild of stage k from
        stage j's input (``Run._rebuild``) holds again: evenly spaced, as many as
        the budget has room for beside what the backward needs now (Note
        [Measuring within the budget])."""
        record = self.record
        if record is None or record.costs is None:
            return ()
        sizes = {}
        for i in range(j + 1, k):
            costs = record.stages[i - 2].costs if i - 2 < len(record.stages) else None
            if costs is None or costs.out_bytes is None:
                return ()
            sizes[i] = costs.out_bytes
        kept = _tail_kept(record)
        # (the saved tensors kept too: 14% over where a new shape's hint kept some, a CNN's batch of 3 after 4)
        live = sum(_anchored(run).values())
        # what B(k) needs beside the inputs held: measuring a stage like the largest, the
        # gradient flowing down, the output of a stage rebuilt beside its input
        reserve = self.largest + 2 * max(record.costs.out_bytes) + max(   # (and the rebuild's own forwards' transient:
            (c.fwd_tmp - c.fwd_nograd_less for s in record.stages[j - 1:k - 1]   # a frozen chain's, which ``largest``
             if (c := s.costs) is not None and c.fwd_tmp is not None), default=0)   # misses, put a first call 8% over)
        room = self.budget - record.input_bytes - record.held_bytes() - kept - reserve - live - self.before \
            - record.state_copies
        if room <= 0:
            return ()
        if sum(sizes.values()) <= room:
            return set(sizes)
        count = int(room // max(sizes.values()))
        if count <= 0:
            return ()
        spacing = -(-(k - j) // (count + 1))
        holds, total = set(), 0
        for i in range(j + spacing, k, spacing):
            if total + sizes[i] > room:
                break
            holds.add(i)
            total += sizes[i]
        return holds


def _tail_kept(record):
    """Bytes the chain's tail keeps through its backward, as ``record`` knows them (what
    it left alive as the block ended where no backward has shown them yet)."""
    tail = record.tail
    return 0 if tail is None else tail.kept if tail.kept is not None else tail.alive or 0


def _anchored(run):
    """{storage: bytes} of what ``run``'s anchors hold, each storage once: the inputs of the
    stages after the first (the chain's is the caller's) and the saved tensors kept."""
    anchors = [ref() for ref in run.anchors[1:] if ref is not None] + list(run.orphans.values())
    anchors = [a for a in anchors if a is not None]
    tensors = [t for a in anchors for t in ([a.input] if a.stage > 1 else []) + list(a.saved or ()) if t is not None]
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def _below(run, k):
    """Whether ``run`` holds an input below stage k to rebuild it from, none whole between (``Run._rebuild``)."""
    for j in range(k - 1, 0, -1) if run is not None else ():
        if run.whole[j] or (a := run._anchor(j)) is not None and a.input is not None:
            return not run.whole[j]
    return False
