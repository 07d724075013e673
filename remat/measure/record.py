"""The typed records of a measuring call: what one stage costs
(``StageCosts``), what measuring its forward and backward showed besides
(``Probe``), and everything a later call needs of that stage (``StageRecord``).
A ``ChainRecord`` (remat/measure/chain_record.py) holds one ``StageRecord`` per
stage; the costs file is written from their ``StageCosts`` and read back into
them (remat/measure/costs_source.py).
"""

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

from ..runtime.recompute import NO_SLOTS
from ..solver.costs import Costs

__all__ = ["COST_FIELDS", "Probe", "StageCosts", "StageGraph", "StageRecord", "TailSeen", "casts_freed", "stage_casts"]

# the per-stage fields of ``remat.Costs``, in its order
COST_FIELDS = ("fwd_time", "fwd_nograd_time", "bwd_time", "out_bytes", "saved_bytes", "fwd_tmp", "bwd_tmp",
               "bwd_rebuilt_less", "fwd_nograd_less")


@dataclass(slots=True)
class StageCosts:
    """One stage's costs as a measuring call saw them (``remat.Costs``' per-stage
    fields, Note [Accounting] in remat/solver/schedule.py), and what decides the
    forward phase's drops (Note [What the forward phase drops],
    remat/measure/chain_record.py). None: not known (costs read from a file measure
    only ``out_bytes``; a stage's backward not measured)."""

    out_bytes: int
    fwd_time: float = None
    fwd_nograd_time: float = None
    bwd_time: float = None
    saved_bytes: int = None
    fwd_tmp: int = None
    bwd_tmp: int = None
    bwd_rebuilt_less: int = 0  # what its backward needs less where it is rebuilt (``Costs.bwd_rebuilt_less``)
    fwd_nograd_less: int = 0   # what its forward needs less without recording (``Costs.fwd_nograd_less``, run 3)
    out_freed: int = None      # the output's bytes if the stage's own backward does not read it, else 0
    input_kept: bool = None    # its recording keeps its input's storage (saved, or returned as a view)
    caller_holds: bool = None  # the code around the chain held its output as the chain ended
    out_of_input: bool = None  # its output shares its input's storage (a view of it): it goes only with that
    saved_seen: int = None     # saved_bytes as a forward with costs from a file saw it (``_check_given``)
    kept: tuple = None         # what run 1 saw of options and rungs (``KeptSeen``, remat/measure/options.py)
    options: tuple = ()        # the options as the costs of a chain measured again after it tell (``of``)
    policies: tuple = ()       # what each of its options keeps (remat/measure/options.py, ``stage_options``)
    measure_peak: int = None   # the most its measuring runs 1 and 2 held at once, its input counted (CPU)
    bwd_tmp_sums: int = None   # bwd_tmp where it starts the sums of its shared leaves' gradients (None: it has
                               # none; Note [Shared leaves], remat/measure/leaves.py)
    bwd_cast_less: int = 0     # what bwd_tmp needs less where its casts go as last read (Note [Casts freed at
                               # the Loss] 2, remat/solver/casts.py; on CPU)

    @property
    def backward_measured(self):
        """Whether the stage's backward was measured (bwd_tmp known)."""
        return self.bwd_tmp is not None

    @classmethod
    def of(cls, costs, i, policies=()):
        """Stage i+1's costs in ``costs`` (a ``remat.Costs``), for a chain measured
        again after it: what decides the drops only as far as the costs tell
        (``forward_drops``, remat/measure/costs_source.py: unknown is kept); its
        options run with ``policies``."""
        return cls(**{f: getattr(costs, f)[i] for f in COST_FIELDS}, out_freed=costs.fwd_drop_whole[i],
                   input_kept=i == 0 or not costs.fwd_drop[i - 1], caller_holds=not costs.fwd_drop[i],
                   options=costs.options[i], policies=policies)


class StageGraph(NamedTuple):
    """A measured stage's own backward graph, as its forward left it (run 1 of
    Note [Measuring a stage], remat/measure/profile.py), for its backward (run 2)."""
    stop: set       # the nodes where it ends (its inputs')
    side: list      # its side inputs needing grad, whose gradients are taken at their edges
    params: list    # the leaves whose gradients it makes (those used behind it left out)
    saved: list     # what autograd saved in its forward
    keys: dict      # {storage: bytes} of those the stage made (``saved_storages``)
    shared: list = []   # the leaves whose gradients it makes that are used behind it too (``Upstream``)
    casts: dict = {}    # {storage: bytes} of those it made that a cache holds too (autocast's casts)


@dataclass(slots=True, eq=False)
class Probe:
    """What measuring one stage's forward (and backward) showed
    (``instrumented_run``, remat/measure/profile.py)."""

    out: object                   # what the stage returned
    costs: StageCosts             # None if its activation is not a tensor
    writes: list                  # [(tensor, value before)] of the state it updates in place
    uses_rng: bool
    reads_state: bool             # what it computes may depend on that state's values
    held_grads: dict = field(default_factory=dict)   # Upstream.held_grads of its parameters
    leaves: dict = None           # {id: gradient bytes} of the leaves its backward reaches
    held_outside: int = 0         # bytes it still holds outside autograd (Note [Saved tensors held elsewhere])
    saved_elsewhere: int = 0      # saved bytes something else keeps too
    saved_cached: int = 0         # saved bytes a cache keeps (autocast's casts of the weights)
    grad_layout: tuple = None     # strides of its output's gradient in run 2
    input_grad_layout: tuple = None   # strides of the gradient its backward handed its input
    meta: tuple = None            # (shape, dtype, device) of each tensor it saved, in order
    cached: dict = None           # what run 1 made from parameters alone and left alive (``made_alone``,
                                  # remat/measure/timing.py): a cache's, which run 3 may find made

    def run2(self):
        """The results of run 2 a twin (Note [Twin stages], remat/measure/twins.py)
        takes, as a dict."""
        c = self.costs
        return {"bwd_time": c.bwd_time, "bwd_tmp": c.bwd_tmp, "bwd_rebuilt_less": c.bwd_rebuilt_less,
                "bwd_tmp_sums": c.bwd_tmp_sums, "bwd_cast_less": c.bwd_cast_less, "grad_layout": self.grad_layout,
                "input_grad_layout": self.input_grad_layout}

    def take_run2(self, run2):
        """Take a twin's run 2 results (``run2``)."""
        c = self.costs
        c.bwd_time, c.bwd_tmp, c.bwd_rebuilt_less = run2["bwd_time"], run2["bwd_tmp"], run2["bwd_rebuilt_less"]
        c.bwd_tmp_sums, c.bwd_cast_less = run2["bwd_tmp_sums"], run2["bwd_cast_less"]
        self.grad_layout, self.input_grad_layout = run2["grad_layout"], run2["input_grad_layout"]


@dataclass(slots=True, eq=False, weakref_slot=True)
class StageRecord:
    """Everything the measuring call learned of one stage: what a later call is
    checked against (Note [Chain keys], remat/chain.py), what a recomputation
    replays (Note [Replaying a stage], remat/runtime/replay.py) and its costs."""

    ident: weakref.ref       # the stage's object (set by ``ChainRecord.add``, which lets go of the dicts with it)
    name: str
    in_sig: tuple            # its input's signature (stage_call.input_signature)
    dicts: tuple             # its module's and submodules' __dict__ (stage_call.module_dicts)
    structure: object        # what its module is made of (stage_call.module_structure)
    slots: tuple             # where its module's parameters and buffers live (recompute.module_slots)
    grads: tuple             # dtype and requires_grad of those parameters (replay.param_flags)
    autocast: object         # the autocast state it ran in
    meta: tuple              # (shape, dtype, device) of each tensor autograd saved
    state: tuple             # the tensors it writes in place, as slot indices or weak references
    reads_state: bool        # its result may depend on their values (Instrument.reads_state)
    uses_rng: bool
    generators: list         # its own torch.Generator objects (Note [Replaying a stage] 1)
    grad_replay: bool        # recomputed with grad mode on (Note [Replaying a stage] 4)
    costs: StageCosts        # None if its activation is not a tensor
    held: dict               # {key: bytes} held through the step because of it (Upstream.held_grads, ...)
    quiet: tuple = None      # ``ChainRecord.quiet``'s answer, once asked
    leaves: dict = None      # {id: gradient bytes} of the leaves its backward reaches (remat/measure/overlap.py)

    def forget_module(self):
        """The stage's object is gone: let go of its module's dicts (``ChainRecord.add``)."""
        self.dicts, self.structure, self.slots = (), None, NO_SLOTS

    def again(self, costs):
        """A copy for a chain's record made again from this one, with ``costs``."""
        return dataclasses.replace(self, costs=costs, quiet=None)


@dataclass
class TailSeen:
    """What a measuring call saw of the chain's tail (Note [The chain's tail], remat/measure/tail.py).

    Attributes:
        metered: whether the tail inside the block was metered (else ``why``).
        peak: bytes its forward inside the block reached above the chain's end.
        alive: bytes of what it made that were alive as the block ended.
        kept: bytes of them still alive as the chain's backward began (None
            before a backward has shown it).
        backward_peak: the peak above the chain's end through the tail's
            forward and backward, as that backward showed it (None before).
        seconds: time inside its forward's ops; ``backward_seconds`` its
            backward's nodes' (None before a backward).
        why: why it was not metered ("" if it was).
    """

    metered: bool = False
    peak: int = 0
    alive: int = 0
    kept: int = None
    backward_peak: int = None
    seconds: float = 0.0
    backward_seconds: float = None
    why: str = ""
    after_block: bool = False   # metered after the chain's block (Note [The chain's tail] 5)
    cut: bool = False           # cut short by a chain opened before the backward (Note [The chain's tail] 6)
    casts: str = ""   # "forward": its block ended under autocast; "freed"/"held": its backward began outside/in it

    def costs(self, handed=None):
        """The tail as ``Costs.with_tail``'s arguments: its peak, less what the caller keeps,
        which held_bytes counts. Until a backward has shown them, its forward's peak and
        nothing kept: the least it can need (the plan a measuring call makes then is for a
        later call, solved again once its backward has run; one it cannot make, the budget
        cannot hold). ``handed`` (the bytes of a^L's gradient): its backward's at B(L), after
        autocast's casts went (solver/casts.py), its forward's alone with them."""
        split = handed is not None and self.backward_peak is not None
        peak = self.peak if self.backward_peak is None or split else max(self.peak, self.backward_peak)
        kept = 0 if self.kept is None else self.kept
        back = 2 * self.seconds if self.backward_seconds is None else self.backward_seconds
        return {"fwd_time": self.seconds, "bwd_time": back, "out_bytes": 0, "saved_bytes": 0, "kept": kept,
                "fwd_tmp": max(0, peak - kept), "bwd_tmp": max(0, self.backward_peak - kept - handed) if split else 0}

    def __str__(self):
        if not self.metered:
            return f"tail not metered: {self.why}"
        seen = "its backward not yet seen" if self.kept is None else \
            f"{_mib(self.backward_peak)} with its backward, {_mib(self.kept)} kept through the chain's backward"
        if self.after_block:
            cut = ", cut short by a chain opened before it (6 of Note [The chain's tail])" if self.cut else ""
            return f"tail (the code after the last stage, until its backward reached the chain{cut}): {seen}"
        return (f"tail (after the last stage, inside the chain's block): peak {_mib(self.peak)} above the "
                f"chain's end, {_mib(self.alive)} alive as the block ended; {seen}")


def _mib(n):
    return f"{n / 2**20:.2f} MiB"


def stage_casts(record):
    """Bytes of the caches' copies of the weights a ``StageRecord`` made (its held
    ("cached", k)): autocast's casts, ``parametrize.cached()``'s weights."""
    return sum(v for k, v in record.held.items() if type(k) is tuple and k[0] == "cached")


def casts_freed(costs, stages):
    """A chain's planning ``costs`` where autocast's casts go at the loss (the backward after
    the autocast block; Note [Casts freed at the Loss], remat/solver/casts.py), its stages'
    ``StageRecord``s ``stages``: each stage's casts (``stage_casts``, the tail's none) in
    ``cast_bytes``, and its backward's transient less what letting them go as they are read
    last takes off its peak (``StageCosts.bwd_cast_less``; none for a stage starting the sums
    of shared leaves' gradients, whose bwd_tmp is another peak), bwd_tmp at least -out_bytes
    and a rebuilt one's no lower than either alone."""
    n, bt = costs.stages, costs.bwd_tmp
    casts = ([stage_casts(s) for s in stages] + [0] * n)[:n] + [0] * (costs.length - n)
    cut = [min(s.costs.bwd_cast_less, t + o) if s.costs is not None and s.costs.bwd_tmp_sums is None else 0
           for s, t, o in zip(stages[:n], bt, costs.out_bytes)]
    cut += [0] * (costs.length - len(cut))
    return Costs.from_dict({**costs.to_dict(), "cast_bytes": casts, "bwd_tmp": [t - c for t, c in zip(bt, cut)],
                            "bwd_rebuilt_less": [max(0, r - c) for r, c in zip(costs.bwd_rebuilt_less, cut)]})
