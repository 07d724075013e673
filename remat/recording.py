"""What the measuring call of a chain learned (``Recording``), the plans
solved from it, and ``explain()`` to show them to a person.

Note [The chain's output]
-------------------------
The cost model lets a^L go at ``B(L)`` with a-bar^L, and where the last
stage's backward does not read a^L, ``bwd_tmp[L]`` gives its bytes back
during ``B(L)`` itself (remat/profile.py). That holds where the caller lets
the chain's output go once it is used (a head that saved it has released it
by ``B(L)``), not where a training loop keeps it in a variable through
``loss.backward()``: then a^L stays to the end of the backward, and a step
went up to one output over the budget (38 of 60 random test chains kept as
``y = net(x); loss = f(y); loss.backward()``; 26 before the give-back).

So plans are solved as if the caller held a^L through the whole step (its
bytes added to ``input_bytes``: ``planning_costs``), until a call shows
otherwise: each call puts a pre-hook on the node that made a^L which has
the engine ask, at the end of that backward, whether a^L's storage is still
alive (a weak reference: PyTorch keeps a storage's Python object as long as
the storage). Not as ``B(L)`` starts: a last stage whose backward reads its
output (a ReLU) holds it then whoever else does.
Gone: the next call solves on the costs as measured. Alive, once: the held
count comes back for good, since a loop that holds the output some of the
time would go over the budget the next time it does. The costs file keeps
the costs as measured. Under torch.distributed the held count stays (every
rank must solve the same plan).
"""

import weakref

import torch

from .costs import Costs
from .costs_source import distributed, write_costs
from .errors import BudgetError, CostsError
from .refine import SAMPLES, combine
from .runtime import BWD, FALL, FCK, FN
from .schedule import B, Fall, Fck, Fn, Loss
from .solve import solve
from .units import format_bytes

__all__ = ["Recording", "Explanation", "explain"]

_CODES = {Fn: FN, Fck: FCK, Fall: FALL, B: BWD}
_last = [None]


class Explanation:
    """What remat knows about one chain: costs, budget, schedule.

    ``costs`` are those the schedule was solved on; ``measured`` those the
    chain measured (or read), as its costs file holds them. They differ by
    the chain's output, counted in ``input_bytes`` while the code around the
    chain may hold it through the backward (Note [The chain's output])."""

    def __init__(self, costs, schedule, budget, names, measured=None):
        self.costs = costs
        self.schedule = schedule
        self.budget = budget
        self.names = names
        self.measured = costs if measured is None else measured

    def table(self):
        """Per-stage costs and the op each stage gets in the forward phase."""
        modes = self.schedule.forward_modes() if self.schedule is not None else []
        lines = self.costs.table().splitlines()
        out = [lines[0] + "  forward   name", lines[1]]
        for i, line in enumerate(lines[2:]):
            mode = modes[i].__name__ if i < len(modes) else "-"
            out.append(f"{line}  {mode:<8}  {self.names[i] if i < len(self.names) else ''}")
        return "\n".join(out)

    def __str__(self):
        head = f"remat chain of {self.costs.length} stages, budget {format_bytes(self.budget)}"
        if self.schedule is None:
            return head + "\n" + self.table()
        return f"{head}\n{self.schedule.summary()}\n{self.table()}\nschedule:\n{self.schedule}"


def explain():
    """The ``Explanation`` of the latest chain call, or None before any.

    Example:
        >>> import remat
        >>> remat.explain() is None or hasattr(remat.explain(), "schedule")
        True
    """
    return _last[0]


class Recording:
    """What the measuring call of one key learned, and the plans solved from it."""

    def __init__(self):
        self.idents = []      # weak references to each stage's object
        self.names = []
        self.in_sigs = []     # (shape, dtype) of each stage input
        self.meta = []        # per stage: tuple of (shape, dtype, device) saved by autograd
        self.uses_rng = []
        self.grad_replay = []  # per stage: recompute with grad mode on (Note [Replaying a stage] 4)
        self.state = []       # per stage: weak references to tensors it writes in place
        self.reads_state = []  # per stage: its result may depend on their values (Instrument.reads_state)
        self.rows = []        # per stage: dict of cost fields
        self.held = []        # per stage: {id: bytes} of gradients held past it (Upstream.held_grads)
        self.input_bytes = 0
        self.costs = None
        self.plans = {}
        self.attempts = 0        # calls left to refine the times (remat/refine.py)
        self.samples = []        # the stamped calls' times so far (remat/refine.py)
        self.costs_file = None   # the costs file this process measured for (or None)
        self.unsaved = False     # refined costs not yet written to it
        self.output_held = None  # whether a call held a^L at B(L) (Note [The chain's output])
        self._held_costs = None  # (costs, the same with a^L held) for planning_costs

    def planning_costs(self):
        """The costs plans are solved on: the measured ones, with a^L held through the
        step unless calls showed it gone by B(L) (Note [The chain's output])."""
        if self.output_held is False or self.costs is None:
            return self.costs
        cached = self._held_costs
        if cached is None or cached[0] is not self.costs:
            data = self.costs.to_dict()
            data["input_bytes"] += data["out_bytes"][-1]
            cached = self._held_costs = (self.costs, Costs.from_dict(data))
        return cached[1]

    def watch_output(self, act):
        """Have ``act``, a^L of this call, tell at the end of its backward whether it is
        still held."""
        if self.output_held or not isinstance(act, torch.Tensor) or act.grad_fn is None or distributed():
            return
        storage = weakref.ref(act.untyped_storage())
        entry = weakref.ref(self)
        queued = [False]

        def seen():
            e = entry()
            if e is not None:
                e.output_seen(storage() is not None)

        def started(_grads):
            if not queued[0]:
                queued[0] = True
                torch.autograd.Variable._execution_engine.queue_callback(seen)

        act.grad_fn.register_prehook(started)

    def output_seen(self, held):
        """A call's a^L was (``held``) or was not alive at the end of its backward."""
        was = self.output_held
        if was or was is held:
            return
        self.output_held = held
        if was is not None or not held:   # the plans' count of a^L changes (not None -> held)
            self.plans = {}

    def timed(self, forward, backward, nograd):
        """A call after the measuring one was stamped (Note [Timing the second call],
        remat/refine.py): ``forward`` and ``nograd`` map stages to seconds,
        ``backward`` lists them. With ``SAMPLES`` such calls, or none left to try,
        the times replace the measured ones."""
        costs = self.costs
        n = costs.length if costs is not None else -1
        if len(backward) != n or sorted(forward) != list(range(1, n + 1)):
            return
        self.samples.append(([forward[k] for k in range(1, n + 1)], list(backward), dict(nograd)))
        if len(self.samples) >= SAMPLES or self.attempts == 0:
            self.refine()

    def refine(self):
        """The samples' times, stage by stage (``combine``), replace the measured
        ones; plans are solved again and the costs file this process measured for
        is written again."""
        samples, self.samples = self.samples, []
        self.attempts = 0
        if not samples:
            return
        n = self.costs.length
        nograd = {}
        for _, _, times in samples:
            for k, t in times.items():
                nograd.setdefault(k, []).append(t)
        nograd = {k: combine(ts) for k, ts in nograd.items()}
        data = self.costs.to_dict()
        data["fwd_time"] = [combine([f[i] for f, _, _ in samples]) for i in range(n)]
        data["bwd_time"] = [combine([b[i] for _, b, _ in samples]) for i in range(n)]
        # (3 of the Note: a forward without recording does no more than one with it)
        data["fwd_nograd_time"] = [
            nograd.get(k, data["fwd_time"][k - 1] if self.grad_replay[k - 1] else min(t, data["fwd_time"][k - 1]))
            for k, t in enumerate(data["fwd_nograd_time"], 1)]
        self.costs = Costs.from_dict(data)
        self.plans = {}
        if self.costs_file is not None:
            try:
                write_costs(self.costs, self.costs_file)
            except CostsError:
                self.unsaved = True   # the next call writes it, or says why it cannot

    def held_bytes(self):
        """Bytes of the gradients of leaves used by several stages (or by a stage
        and code before the chain), each counted once: the engine holds them
        from the backward of the last use to that of the first."""
        held = {}
        for stage in self.held:
            held.update(stage)
        return sum(held.values())

    def plan(self, budget, algorithm, slots):
        key = (budget, algorithm, slots)
        plan = self.plans.get(key)
        if plan is None:
            costs = self.planning_costs()
            try:
                schedule = solve(costs, budget, algorithm, slots)
            except BudgetError as exc:
                if costs is self.costs:
                    raise
                why = ("the code around the chain kept it" if self.output_held else
                       "no backward has shown yet that the code around the chain lets it go")
                raise BudgetError(
                    f"{exc}. That counts the chain's output ({format_bytes(self.costs.out_bytes[-1])}) "
                    f"as held through the backward: {why} (remat/recording.py Note [The chain's output])"
                ) from None
            ops = schedule.ops
            split = ops.index(Loss)
            modes = [None] + [_CODES[type(op)] for op in ops[:split]]
            back = tuple((_CODES[type(op)], op.stage) for op in ops[split + 1:])
            fall_at = {i: j for j, (code, i) in enumerate(back) if code == FALL}
            plan = (schedule, modes, back, fall_at)
            if len(self.plans) > 16:
                self.plans.clear()
            self.plans[key] = plan
        return plan
