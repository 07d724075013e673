"""What the measuring call of a chain learned (``ChainRecord``) and the plans
solved from it (shown to a person by ``explain()``, remat/chain.py).

Note [The chain's output]
-------------------------
The cost model lets a^L go at ``B(L)`` with a-bar^L, and where the last
stage's backward does not read a^L, ``bwd_tmp[L]`` gives its bytes back during
``B(L)`` itself (remat/measure/profile.py). That holds where the caller lets
the chain's output go once it is used (a head that saved it has released it by
``B(L)``), not where a training loop keeps it in a variable through
``loss.backward()``: then a^L stays to the end of the backward, and a step
goes up to one output over the budget (figures: docs/how-it-works.md,
"Measured while building remat").

So plans are solved as if the caller held a^L through the whole step (its
bytes added to ``held_bytes``, and taken out of a-bar^L and of what B(L)
gives back where measured: ``planning_costs``; ``Costs.output_held``, so
that a^L held on its own, after ``Fck(L)``, counts once), until a call shows
otherwise: each call (``watch_output``, remat/runtime/runner.py) puts a pre-hook on the node that made a^L which has
the engine ask, at the end of that backward, whether a^L's storage is still
alive (a weak reference: PyTorch keeps a storage's Python object as long as
the storage). Not as ``B(L)`` starts: a last stage whose backward reads its
output (a ReLU) holds it then whoever else does.
Gone: the next call solves on the costs as measured. Alive, once: the held
count comes back for good, since a loop that holds the output some of the
time would go over the budget the next time it does. The costs file keeps
the costs as measured. Under torch.distributed the held count stays (every
rank must solve the same plan).

Note [What the forward phase drops]
-----------------------------------
In the forward phase a stage run as ``Fall`` runs with no hooks, so its input
a^(i-1) lives on only if something keeps it: its own recording (it saved its
input, or returned a view of it), the previous stage's backward (a-bar^(i-1)
holds a^(i-1) only if B(i-1) reads it), or the code around the chain.
``Costs.fwd_drop`` counts a^(i-1) as gone once stage i has run where none does
(remat/solver/schedule.py Note [Accounting] 6): the measuring call sees the
first two in the stages' saved tensors (``input_kept``, ``out_freed``,
remat/measure/profile.py) and the third by weak references to the activations
the stages returned, read as the chain ends (``caller_holds``: a list of
hidden states, as transformers' ``output_hidden_states`` keeps, holds them
all). Without it, a chain of stages that keep nothing of their input (dropout,
scale) runs well under its predicted peak, and plans are slower than the
budget allows (figures: docs/how-it-works.md, "Measured while building
remat").

A loop could still keep an activation some other way (a view of it, a
tensor on a custom Function's ctx). So each call that runs a plan
(``watch_caller``, remat/runtime/runner.py) takes a
weak reference to the storage of each a^(i-1) the plan lets go (after a
``Fall`` that drops it, or an ``Fn``) and reads it as the chain ends, but
for storages remat's own checkpoints hold (an identity stage hands on its
input as it is); and one to each stage's output, read at the end of a
backward that went through every stage and freed its graph. Alive, the
costs count that activation as held through the step from then on
(``caller_kept``), the next call plans again, and a warning says that this
call may have gone over the budget by that much. Not under
torch.distributed, where every rank must keep rank 0's costs.
"""

import dataclasses
import itertools
import warnings
import weakref

from ..solver.costs import Costs
from ..solver.schedule import simulate
from ..solver.solve import store_all
from ..dynamo import DYNAMO_SKIPS
from ..errors import CostsError
from .holding import least_budget, stage_least
from .record import StageCosts, TailSeen, casts_freed, stage_casts
from ..units import format_bytes

__all__ = ["NO_HINT", "ChainRecord"]

NO_HINT = (None, False, 0, 0)   # (``ChainRecord.hint`` where no record has shown the chain's tail)

def _stage_gone(record):
    """The callback of the weak reference to a stage's object. Its ``record`` holds
    that stage module's ``__dict__``, ``_parameters`` and ``_buffers`` (to check them
    on later calls, remat/runtime/stage_call.py): a model deleted while its record stayed
    cached kept its weights, up to ``CACHE_SIZE`` models' of them. No call can match
    a stage that is gone (its object is checked first), so it lets them go."""
    def gone(_ref):
        rec = record()
        if rec is not None:
            rec.forget_module()
    return gone


def _ranges(stages):
    """'outputs of stages 1-3, 5' for stages {1, 2, 3, 5}."""
    out, run = [], []
    for i in sorted(stages):
        if run and i != run[-1] + 1:
            out.append(run)
            run = []
        run.append(i)
    out.append(run)
    what = "output of stage" if len(stages) == 1 else "outputs of stages"
    return what + " " + ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)


def write_costs(costs, path):
    """Save measured costs to ``path`` (a CostsError says why it could not)."""
    try:
        costs.save(path)
    except OSError as exc:
        raise CostsError(f"remat: cannot write the measured costs to {path}: {exc}") from None


class ChainRecord:
    """What the measuring call of one key learned, and the plans solved from it."""

    def __init__(self):
        self.stages = []      # a StageRecord per stage (remat/measure/record.py)
        self.names = []       # their names, stage 1 first
        self.caller = set()   # stages whose output the code around the chain holds (Note [What the ...])
        self.input_bytes, self.costs, self.plans = 0, None, {}
        self.attempts, self.samples = 0, []   # calls left to refine the times, theirs so far (measure/refine.py)
        self.costs_file, self.unsaved = None, False   # the costs file this process measured for; refined, unwritten
        self.output_held = None  # whether a call held a^L at B(L) (Note [The chain's output])
        self._held_costs = {}    # a^L counted held or not -> ((costs, tail, that), the planning costs)
        self.tail = None         # what the measuring call saw of the chain's tail (remat/measure/tail.py)
        self.refined = 0         # calls whose own times replaced the measured ones (remat/measure/refine.py)
        self.from_file = False   # the costs came from a costs file
        self.suspects = set()    # stages checked as they are called (Note [Stages recorded whole])
        self.state_copies = 0    # bytes of written state the measuring call held copies of to its end
        self.others = []         # records of other paths of the chain (Note [Paths of a chain], remat/runtime/paths.py)
        self.remeasure = False   # the next call measures (a shorter path, a stage changed; "given": on these costs)
        self.abandoned = False   # measured again as its measuring call's backward never came (remat/measure/tail.py)
        self.quiet = 0           # calls in a row that took its path to its end (``Runner.finish``)
        self.view = None         # (record, its stage of each of these): a view of it, stages skipped
        self.skips = {}          # such views and their plans (Note [Skipped stages], remat/runtime/skips.py)
        self.skipped = False     # a call ran on such a view
        self.before = None       # what the code before the chain's backward needed (remat/measure/linger.py)
        self.tail_tries = 0      # running calls' tails cut short (Note [The chain's tail] 6, remat/measure/tail.py)
        self.overlap, self.overlapping = None, 0   # held for calls alive together; by the latest call (overlap.py)
        self.overlap_seen = None    # a backward reached a call of it and one alive before it (True), or passed
        self.overlap_probe = None   # such a one by (False): (its latest such call, those before it; overlap.py)
        self.options = True      # its measuring call measured the stages' options (``remat.chain(options=...)``)
        self.measured_at = None  # the budget its measuring call ran under

    def add(self, record, ident):
        """Append the next stage's ``record``, of the stage object ``ident``, held
        weakly: once it is gone, so are its module's dicts from the record
        (``_stage_gone``)."""
        record.ident = weakref.ref(ident, _stage_gone(weakref.ref(record)))
        self.stages.append(record)
        self.names.append(record.name)

    def ident(self, k):
        """Stage k's object, or None if it is gone."""
        return self.stages[k - 1].ident()

    def held_first(self, held, kind, k, nbytes):
        """Count ``nbytes`` of ``kind`` as held through the step for stage ``k`` (its
        ``held``); True if no stage before held any of that kind (the measuring call
        says so once)."""
        held[(kind, k)] = nbytes
        return not any(isinstance(key, tuple) and key[0] == kind for s in self.stages for key in s.held)

    def policies(self):
        """What each stage's options keep (``Plan.policies``, remat/measure/options.py)."""
        return [s.costs.policies if s.costs is not None else () for s in self.stages]

    def again(self, count):
        """A record of this one's first ``count`` stages, for a call that left the
        recorded path after them (Note [Chain keys]): their costs as the costs
        tell (``StageCosts.of``), the rest to be measured."""
        new = ChainRecord()
        for i, s in enumerate(self.stages[:count]):
            new.add(s.again(StageCosts.of(self.costs, i, s.costs.policies if s.costs else ())), s.ident())
        new.input_bytes = self.input_bytes
        new.tail = self.tail   # (what the tail needed on the recorded path, until this call's shows)
        new.before, new.options = self.before, self.options
        return new

    def hint(self, budget, input_bytes=None):
        """What a measuring call of this chain (of chain input ``input_bytes``, or off this record's path)
        takes from it (Note [Measuring within the budget], holding.py): (the most its tail needed above the
        chain's end, whether storing all fits ``budget`` with a record more (a kept stage's backward lets
        none of its saved tensors go until it ends), the most measuring a stage needed beyond its input, the
        largest stage input), scaled as the input's square where larger (scaled linearly, a first call 4x as
        long went 37% over), not where smaller (scaled down, a ResNet's last batch went 6% over: a conv's
        weight gradient does not shrink); ``NO_HINT`` before a backward has shown the tail."""
        if self.tail is None or self.tail.kept is None or not self.input_bytes or self.costs is None \
                or not any(self.costs.bwd_time):   # (no backward through it: its stages all frozen, say)
            return NO_HINT
        scale = max(1.0, (1.0 if input_bytes is None else input_bytes / self.input_bytes) ** 2)
        tail, costs = self.tail.costs(), self.planning_costs()
        # the most measuring a stage needs beyond its input: the call holds inputs beside it from the
        # start (counted as the stages came, a CNN's later, larger one went 15% over the budget), and the
        # casts of the stages before it (a bf16 ResNet's smaller batch, 0.4% over, took only those so far)
        c, x = self.costs, self.costs.sizes()
        casts = list(itertools.accumulate((stage_casts(s) for s in self.stages[:c.length]), initial=0))
        largest = max(max(stage_least(x[i], c.out_bytes[i], c.saved_bytes[i], c.fwd_tmp[i], c.bwd_tmp[i]),
                          s.costs.measure_peak or 0 if s.costs is not None else 0) - x[i] + casts[i]
                      for i, s in enumerate(self.stages[:c.length]))
        return int((tail["fwd_tmp"] + tail["kept"]) * scale), \
            (simulate(costs, store_all(costs.length)).peak + max(costs.saved_bytes[:costs.stages])) * scale <= budget, \
            int(largest * scale), int(max(x[:c.length]) * scale)

    def counts_output(self):
        """Whether plans count a^L as held through the step (Note [The chain's output])."""
        return self.output_held is not False

    def planning_costs(self, output=None, options=True):
        """The costs plans are solved on: the measured ones with the chain's tail
        (Note [The chain's tail], remat/measure/tail.py), and with a^L held through the
        step unless calls showed it gone by B(L) (Note [The chain's output]), or
        (``output`` False) as measured; without their options unless ``options``."""
        if self.costs is None:
            return None
        held = self.counts_output() if output is None else output
        key = (self.costs, self.tail, held)
        cached = self._held_costs.get(held)
        if cached is None or any(a is not b for a, b in zip(cached[0], key)):
            casts = [stage_casts(s) for s in self.stages]
            freed = self.tail is not None and self.tail.casts in ("forward", "freed") and any(casts)   # (casts.py)
            handed = self.costs.out_bytes[-1] if freed else None   # (the tail's backward at B(L): tail.py)
            costs = (self._output_held() if held else self.costs).with_tail(**(self.tail or TailSeen()).costs(handed))
            if freed:
                costs = casts_freed(costs, self.stages)
            cached = self._held_costs[held] = (key, costs)
        if not options:
            return cached[1].without_options()
        return cached[1]

    def step_end(self, costs):
        """The step's need after the chain's backward, on ``costs`` (its planning costs):
        what that leaves held, a^0's gradient and what the backward of the code before
        the chain needed above them (Note [The code before the chain],
        remat/measure/linger.py); 0 where that was not metered."""
        return 0 if self.before is None else costs.held_bytes + costs.input_bytes + self.before

    def _output_held(self):
        """The measured costs with a^L held through the step (Note [The chain's output])."""
        data = self.costs.to_dict()
        out = data["out_bytes"][-1]
        data["held_bytes"] += out
        data["output_held"] = True
        last = self.stages[-1].costs if self.stages else None
        freed = last.out_freed if last is not None else None
        if freed is not None:
            # counted there, a^L is not also in a-bar^L, nor given back at B(L): under
            # its options too (remat/solver/option.py Note [Options]: they keep a^L)
            data["saved_bytes"][-1] -= out
            data["bwd_tmp"][-1] += freed
            # (a^L made again after Loss is a copy, which a rebuilt B(L) gives back: Note [Accounting] 1)
            data.setdefault("bwd_rebuilt_less", [0] * len(data["bwd_tmp"]))[-1] += freed
            for option in data.get("options", [[]])[-1]:
                option["saved_bytes"] = max(option["saved_bytes"] - out, 0)
                option["bwd_tmp"] += freed
        return Costs.from_dict(data)

    def tail_seen(self, seen):
        """A backward showed what the code after the chain keeps of its tail (``seen.kept``):
        plans made before counted all of it."""
        if seen is self.tail:
            self.tail = dataclasses.replace(seen)   # (a new object: the planning costs' key)
            self.plans = {}
            self.tail_tries += seen.cut

    def save(self):
        """Write the costs to the file this process measured for, if any; one that
        cannot be written now is left to the next call (``unsaved``), which writes
        it or says why it cannot."""
        if self.costs_file is not None:
            try:
                write_costs(self.costs, self.costs_file)
            except CostsError:
                self.unsaved = True

    def caller_holds(self, outs, last):
        """The measuring call's chain ends at stage ``last``; ``outs`` maps stages to
        weak references to the activations they returned. Those the code around the
        chain still holds (a^L aside: remat's) no schedule can let go: they count as
        held through the step (Note [What the forward phase drops]); not one alive as a later one's base
        (a transposing last stage's input, a^L's storage: it was warned of and counted twice)."""
        alive = {k: t for k, ref in outs.items() if (t := ref()) is not None}
        bases = {id(t._base) for t in alive.values() if t._base is not None}   # (one pass: chains of thousands)
        stages = [k for k, t in alive.items() if k < last and id(t) not in bases]
        for k in (k for k in outs if self.stages[k - 1].costs is not None):
            self.stages[k - 1].costs.caller_holds = k == last or k in stages
        if not stages:
            return
        for i in stages:
            self.stages[i - 1].held[("caller", i)] = self.stages[i - 1].costs.out_bytes
            self.caller.add(i)
        warnings.warn(
            f"remat: the code around the chain keeps the {_ranges(stages)} "
            f"({format_bytes(sum(self.stages[i - 1].costs.out_bytes for i in stages))}), a list of them say "
            f"(transformers' output_hidden_states): remat cannot drop those and counts them as held "
            f"through the step. Let them go inside the loop to have that memory back",
            RuntimeWarning, stacklevel=4)

    def caller_kept(self, stages, when="after the next stage had run"):
        """A call found the storage of a^i of each i in ``stages`` alive ``when`` its
        plan had let a^i go: from now on a^i counts as held through the step (Note
        [What the forward phase drops])."""
        stages = set(stages) - self.caller
        if not stages:
            return
        data = self.costs.to_dict()
        over = 0
        for i in sorted(stages):
            data["fwd_drop"][i - 1] = data["fwd_drop_whole"][i - 1] = 0
            data["held_bytes"] += data["out_bytes"][i - 1]
            over += data["out_bytes"][i - 1]
            self.caller.add(i)
        self.costs = Costs.from_dict(data)
        self.plans = {}
        warnings.warn(
            f"remat: the code around the chain kept the {_ranges(stages)} {when} "
            f"(an alias of them, say), which this call's schedule counted as let "
            f"go: it may have gone over the budget by up to {format_bytes(over)}. remat counts them as "
            f"held through the step from now on; let them go inside the loop to have that memory back",
            RuntimeWarning, stacklevel=4)
        self.save()

    def output_kept(self, first=False):
        """A call found a^L alive at the end of its backward, where its plan counted it let go
        (Note [The chain's output]), or (``first``) the measuring call did, under the least budget
        holding it (no plan may fit: the next call raises; or the first call's own): say so."""
        if first:
            if (least := least_budget(self.planning_costs(), self.costs, self)) > (self.measured_at or least):
                warnings.warn(
                    f"remat: the code around the chain kept the chain's output through the first call's backward "
                    f"(y = net(x); loss(y).backward()); with it, this chain needs at least {format_bytes(least)} "
                    f"({least} bytes), above this budget of {format_bytes(self.measured_at)}: the first call may have "
                    f"gone over it, and the next call raises BudgetError if no plan fits it. Raise the budget, or let "
                    f"the output go before the backward", RuntimeWarning, stacklevel=2)
            return
        warnings.warn(
            f"remat: the code around the chain kept the chain's output through its backward (a variable "
            f"holding it, or a tensor made from it), where the calls before had let it go and this call's "
            f"schedule counted it so: it may have gone over the budget by up to "
            f"{format_bytes(self.costs.out_bytes[-1])}. remat counts it as held through the step from now on; "
            f"let it go before the backward (del it) to have that memory back", RuntimeWarning, stacklevel=2)

    def held_parts(self):
        """What the costs count as held through the step, by what it is: {words: bytes}
        (what ``explain()`` shows beside the held bytes)."""
        held = {}
        for stage in self.stages:
            held.update(stage.held)
        parts = {}
        for key, nbytes in held.items():
            what = _HELD.get(key[0] if isinstance(key, tuple) and isinstance(key[0], str) else "grad", "other")
            parts[what] = parts.get(what, 0) + nbytes
        if self.counts_output() and self.costs is not None:
            what = ("the chain's output, which the code around the chain keeps through the backward"
                    if self.output_held else "the chain's output, until a backward shows it let go")
            parts[what] = self.costs.out_bytes[-1]
        parts["gradients of the stages' parameters, held between two calls' backwards (overlap.py)"] = self.overlapping
        if self.tail is not None and self.tail.kept:   # (Costs.tail_kept: remat/measure/tail.py)
            parts["the tail's, which the code after the last stage keeps through the chain's backward"] = self.tail.kept
        return {k: v for k, v in parts.items() if v}

    def times_said(self, shown=None):
        """Where the stages' times come from, in words (what ``explain()`` says of them),
        for the costs ``shown`` (those a call planned on; a call that refined them after
        shows those before)."""
        if self.view:   # (a view of a record, for a call that skipped stages: its times are that record's)
            return self.view[0].times_said()
        if self.refined and shown is not None and shown is not self.costs:
            return (f"times: first-call estimates in these costs; the means of {self.refined} calls' own, as "
                    f"training steps ran them, replace them from the next call")
        if self.refined:
            return f"times: the means of {self.refined} calls' own, as training steps ran them"
        if self.from_file:
            return "times: from the costs file"
        if self.attempts:
            return (f"times: first-call estimates (each stage run once, metered); calls after it refine "
                    f"them (up to {self.attempts} more)")
        return ("times: first-call estimates (each stage run once); not refined (CUDA, torch.distributed, or "
                "measured by a call that changed path)")

    def held_bytes(self):
        """Bytes of the gradients of leaves used by several stages (or by a stage
        and code before the chain), each counted once: the engine holds them
        from the backward of the last use to that of the first."""
        held = {}
        for stage in self.stages:
            held.update(stage.held)
        return sum(held.values())

# what a stage makes the chain hold through the step, by its key's kind (StageRecord.held)
_HELD = {"grad": "gradients of weights or inputs used by several stages", "side": "gradients of side inputs",
         "cached": "caches' copies of the weights (autocast's casts, parametrize.cached)",
         "elsewhere": "saved tensors something else keeps too (attention maps a hook collects)",
         "outside": "tensors stages keep outside autograd (a custom Function's ctx)",
         "state": "values of in-place state the stages read, kept for their recomputations",
         "caller": "stage outputs the code around the chain keeps"}


# weak references Dynamo would trace into their referents (remat/dynamo.py)
DYNAMO_SKIPS.append(ChainRecord.caller_holds)
