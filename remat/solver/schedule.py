"""Ops, ``Schedule`` and ``simulate``: the single source of truth for what a
schedule costs (docs/how-it-works.md, "The cost model" and "The schedule").

Note [Accounting]
-----------------
``simulate`` tracks which values are held. x[j] is the size of a^j (x[0]
the chain input), s[i] the size of a-bar^i, which includes a^i.

1. Held memory is the sum of x[j] for every a^j held on its own (not inside
   a held a-bar^j), of s[i] for every held a-bar^i, of the gradient
   currently flowing back (none before ``Loss``), and of held_bytes. With
   ``Costs.output_held``, held_bytes counts a^L (L the chain's last stage
   before its tail), so a^L on its own, or as ``Fall(L)``'s output in its
   peak (rule 3), counts 0 (``Costs.alone_sizes``); its gradient x[L]. Made
   again after ``Loss`` (a^L recomputed, in the backward of a tail), it is a
   copy beside the caller's: x[L] more, in a-bar^L to ``B(L)``.
2. ``Fn(i)``, ``Fck(i)``: need a^(i-1); peak during the op is held + x[i] +
   fwd_tmp[i], less fwd_nograd_less[i] after ``Loss`` (not recording, rule 8);
   then a^i is held and ``Fn`` lets go of a^(i-1) (reachable if a-bar^(i-1) is).
3. ``Fall(i)``: needs a^(i-1), keeps it; peak is held + max(s[i], x[i] +
   fwd_tmp[i]); afterwards a-bar^i is held.
4. ``Loss``: after the forward phase; the gradient of a^L (x[L]) appears.
5. ``B(i)``: needs a-bar^i, a^(i-1) and the gradient of a^i; peak is
   held + x[i-1] + bwd_tmp[i]; afterwards a-bar^i, the gradient of a^i and a
   separately held a^(i-1) are gone (nothing needs them again) and the
   gradient of a^(i-1) flows on. bwd_tmp[i] may be as low as -x[i] (a
   backward that does not read a^i, which a-bar^i counts but which is gone
   by then), so that peak can be under the held level before the op. Where
   a-bar^i was made after ``Loss`` (rebuilt) with the base record, B(i) takes
   bwd_rebuilt_less[i] off bwd_tmp[i] (``Costs.bwd_rebuilt_less``).
6. Dropped in the forward phase: a forward-phase ``Fall(i+1)`` whose input
   a^i is held on its own lets go of fwd_drop[i] bytes of it, one whose a^i
   is inside a held a-bar^i fwd_drop_whole[i] (stage i+1's recording does
   not keep its input, nor B(i) it). a^i stays usable in the rules (B(i+1)
   reads no more of it), and frees no more later: ``B(i+1)`` lets go of x[i]
   less what was dropped, ``B(i)`` of s[i] less it, and ``B(i)``'s peak adds
   it back (bwd_tmp[i] gives back a^i's bytes where B(i) does not read it,
   and they are already gone).
7. The tail (``Costs.tail``: stage L is the code after the chain, its head
   and loss) runs once, as the caller runs it: ``Fall(L)`` in the forward
   phase and ``B(L)``, nothing else; what the caller keeps of it through the
   backward is in held_bytes from the start (it is held before the tail runs
   only where the forward phase's peak is under the tail's, which is the
   usual case: the tail's own peak holds it too).
8. Time: ``Fall`` costs fwd_time; ``Fn``/``Fck`` cost fwd_time in the forward
   phase (it records the graph: docs/how-it-works.md, "The schedule") and
   fwd_nograd_time afterwards; ``B`` costs bwd_time.
9. Options (remat/solver/option.py Note [Options]): ``Fall(i, option=o)``, o > 0,
   is rule 3 with option o's saved_bytes, fwd_tmp and fwd_time; the ``B(i)``
   of the a-bar^i it keeps is rule 5 with its bwd_tmp and bwd_time, and frees
   its saved_bytes. Rule 6 lets nothing go at such a ``Fall(i)``, nor of an
   a^i inside such an a-bar^i.

10. Casts (``Costs.cast_bytes``, autocast's copies of the weights): of
   held_bytes, c[i] is held only from stage i's first forward to ``Loss``
   (autocast's cache; Fn/Fck and Fall in the forward phase add it after
   their op, Fall's peak counting it beside s[i]), then by each held a-bar^i,
   and by those ``Fall(i)`` makes after Loss, to ``B(i)`` (all of c[i], the
   casts autograd does not save, a bias's, too: on the safe side).

A schedule is invalid if it uses a value that is not held, computes a value
that is already held, recomputes a stage after its backward, runs the
forward phase out of order, ends before ``B(1)`` or records a stage with an
option it does not have.
"""

from dataclasses import dataclass
from typing import NamedTuple

from ..errors import InvalidScheduleError, UsageError
from ..units import format_bytes
from .checks import check_costs, check_schedule, schedule_ops
from .ops import B, Fall, Fck, Fn, Loss

__all__ = ["Fn", "Fck", "Fall", "B", "Loss", "Schedule", "Simulation", "simulate"]

_BY_CODE = (Fn, Fck, Fall, B)


def op_from_code(code, stage, option=0):
    """The op for a (code, stage, option) as the C solver returns them."""
    if code == 2 and option:
        return Fall(stage, option)
    return Loss if code == 4 else _BY_CODE[code](stage)


class Simulation(NamedTuple):
    """Predicted time (seconds) and peak memory (bytes) of a schedule."""
    time: float
    peak: int


@dataclass(frozen=True)
class Schedule:
    """An immutable sequence of ops with its predicted time and peak.

    Attributes:
        ops: the ops, forward phase, ``Loss``, then the backward phase.
        time: predicted seconds (``simulate``).
        peak: predicted peak bytes (``simulate``).
        algorithm: the algorithm that made it.
        budget: the budget in bytes it was made for (None if none).
        slot_bytes: the memory unit the solver worked in (None if exact).
        tail: the last stage is the chain's tail (solved on costs with ``Costs.tail``).
        grouping: None, or how the solver planned on groups of adjacent stages
            (a ``Grouping``, remat/solver/group.py Note [Groups]): the exact
            table would have taken too long.
    """

    ops: tuple
    time: float = float("nan")
    peak: int = -1
    algorithm: str = "custom"
    budget: int = None
    slot_bytes: int = None
    tail: bool = False
    grouping: object = None

    def __post_init__(self):   # (ops as a tuple; a field of the wrong kind: a UsageError naming it)
        object.__setattr__(self, "ops", check_schedule(self))

    @property
    def length(self):
        """Number of stages, the tail included (as in ``Costs.length``)."""
        return sum(1 for op in self.ops if isinstance(op, B))

    @property
    def stages(self):
        """Number of the chain's own stages: ``length`` less the tail (``Costs.tail``)."""
        return self.length - self.tail

    def forward_modes(self):
        """The op of each stage in the forward phase, stage 1 first."""
        return [type(op) for op in (self.ops[:self.ops.index(Loss)] if Loss in self.ops else self.ops)]

    def backward_ops(self):
        """The ops after ``Loss``."""
        return self.ops[self.ops.index(Loss) + 1:]

    def recomputations(self):
        """Number of forward ops run after ``Loss``."""
        return sum(1 for op in self.backward_ops() if not isinstance(op, B))

    def __str__(self):
        n = self.length if self.tail else None
        name = lambda op: str(op) if op.stage != n or op is Loss else ("Tail" if isinstance(op, Fall) else "BTail")
        if Loss in self.ops:
            k = self.ops.index(Loss)
            return " ".join(map(name, self.ops[:k])) + "\n| " + " ".join(map(name, self.ops[k + 1:]))
        return " ".join(map(name, self.ops))

    def summary(self):
        """One line: algorithm, predicted time and peak (where simulated), recomputations."""
        budget = "" if self.budget is None else f" for budget {format_bytes(self.budget)}"
        sim = f"predicted {self.time * 1e3:.3f} ms, peak {format_bytes(self.peak)}" if self.peak >= 0 else "unsimulated"
        return (f"{self.algorithm} schedule{budget}: {sim}, {self.recomputations()} recomputed stages"
                + (f", solved on {len(self.grouping.sizes):,} groups of stages" if self.grouping else ""))


def simulate(costs, schedule, trace=None):
    """Predicted time and peak memory of ``schedule`` on ``costs`` (Note [Accounting]).

    Args:
        costs: a ``remat.Costs``.
        schedule: a ``Schedule`` or a sequence of ops.
        trace: an optional list; (op, peak during the op, bytes held after it)
            is appended for every op (the memory timeline).

    Returns:
        Simulation(time, peak).

    Raises:
        InvalidScheduleError: the schedule breaks a rule or holds what is not an op; the message names the op.
        TypeError: ``costs`` is not a Costs, ``schedule`` not a Schedule or ops (None, a str), ``trace`` not a list.

    Example:
        >>> from remat import Costs
        >>> c = Costs.uniform(2, time=1.0, size=10)
        >>> simulate(c, [Fall(1), Fall(2), Loss, B(2), B(1)])
        Simulation(time=6.0, peak=50)
    """
    ops = schedule_ops(schedule, "simulate's schedule")
    if trace is not None and not isinstance(trace, list):
        raise UsageError(f"remat: simulate's trace must be a list (each op's is appended), got {type(trace).__name__}")
    run = _Run(check_costs(costs, "simulate"))
    n, tail = run.n, (run.n if costs.tail else None)
    for pos, op in enumerate(ops):
        code, i = op.code, op.stage   # (ops: checks.schedule_ops)
        if code == 4:
            run.loss(pos, op)
        else:
            if not isinstance(i, int) or isinstance(i, bool) or not 1 <= i <= n:
                _bad(pos, op, f"stage {i!r} is outside 1..{n}")
            if i == tail and code != 3 and (code != 2 or not run.forward):
                _bad(pos, op, f"stage {i} is the chain's tail (the code after it), which runs once: "
                              f"Fall({i}) in the forward phase, then B({i})")
            run.backward(pos, op, i) if code == 3 else run.forward_op(pos, op, i, code)
        if trace is not None:
            trace.append((op, run.during, run.mem))
    if run.forward:
        raise InvalidScheduleError("remat: the schedule has no Loss op")
    if run.grad != 0:
        raise InvalidScheduleError(f"remat: the schedule ends before B(1) (last backward was B({run.grad + 1}))")
    return Simulation(run.time, run.peak)


def _bad(pos, op, why):
    raise InvalidScheduleError(f"remat: op {pos} ({op}) of the schedule is invalid: {why}")


class _Run:
    """A schedule as ``simulate`` runs it, op by op, by the rules of Note [Accounting].

    ``mem`` is what is held (rule 1), ``during`` the peak during the last op,
    ``peak`` the largest ``during`` so far and ``time`` the seconds so far. Each op
    checks what it needs, then updates them."""

    __slots__ = ("n", "x", "xa", "s", "ft", "ftn", "bt", "less", "late", "tf", "tn", "tb", "fd", "fdw", "options",
                 "rec", "gone", "alone", "whole", "held_at", "copy", "mem", "during", "peak", "time", "forward",
                 "next_fwd", "grad", "c", "cast")

    def __init__(self, costs):
        n = self.n = costs.length
        x = self.x = costs.sizes()
        self.xa = costs.alone_sizes()   # (a^j held on its own: 0 for the one the caller holds)
        self.held_at, self.copy = costs.stages if costs.output_held else -1, 0   # (rule 1: that one made again)
        self.s, self.ft, self.ftn, self.bt = costs.saved_bytes, costs.fwd_tmp, costs.fwd_tmp_nograd, costs.bwd_tmp
        self.less = costs.bwd_rebuilt_less
        self.late = [False] * (n + 1)    # the held a-bar^j was made after Loss (rule 5)
        self.tf, self.tn, self.tb = costs.fwd_time, costs.fwd_nograd_time, costs.bwd_time
        self.fd, self.fdw = costs.fwd_drop, costs.fwd_drop_whole
        self.options = costs.options
        self.rec = [0] * (n + 1)         # the option the held a-bar^j was recorded with (rule 9)
        self.gone = [0] * (n + 1)        # bytes of a^j let go in the forward phase (rule 6)
        self.alone = [False] * (n + 1)   # a^j held on its own
        self.whole = [False] * (n + 1)   # a-bar^j held (index 0 unused)
        self.alone[0] = True
        self.c, self.cast = costs.cast_bytes, [0] * (n + 1)   # (rule 10: the cast a held a-bar^j holds)
        self.mem = self.during = self.peak = x[0] + costs.held_bytes - sum(self.c)
        self.time = 0.0
        self.forward = True   # in the forward phase (before Loss)
        self.next_fwd = 1     # the stage the forward phase runs next
        self.grad = -1        # index of the gradient flowing back; -1 before Loss

    def loss(self, pos, op):
        """``Loss`` (rule 4): the forward phase is over; the gradient of a^L appears."""
        n = self.n
        if not self.forward:
            _bad(pos, op, "Loss appears twice")
        if self.next_fwd != n + 1:
            _bad(pos, op, f"the forward phase ended at stage {self.next_fwd - 1} of {n}")
        self.forward = False
        self.grad = n
        if any(self.c):   # (rule 10: autocast's cache is gone, each held a-bar^j holds its stage's casts)
            self.cast = [0] + [c if w else 0 for c, w in zip(self.c, self.whole[1:])]
            self.mem -= sum(self.c) - sum(self.cast)
        mem = self.mem = self.during = self.mem + self.x[n]
        if mem > self.peak:
            self.peak = mem

    def backward(self, pos, op, i):
        """``B(i)`` (rule 5), giving back what rule 6 has not already let go."""
        n, x, gone, alone, whole = self.n, self.x, self.gone, self.alone, self.whole
        if self.forward:
            _bad(pos, op, "a backward before Loss")
        if i != self.grad:
            _bad(pos, op, f"the gradient flowing back is that of a^{self.grad}, not a^{i} "
                          f"(stages must be backwarded once each, {n} down to 1)")
        if not whole[i]:
            _bad(pos, op, f"a-bar^{i} is not held (run Fall({i}) first)")
        if not (alone[i - 1] or whole[i - 1]):
            _bad(pos, op, f"a^{i - 1} is not held")
        mem = self.mem
        s, bt, tb = self.s[i - 1], self.bt[i - 1], self.tb[i - 1]
        if self.rec[i]:   # (rule 9)
            o = self.options[i - 1][self.rec[i] - 1]
            s, bt, tb = o.saved_bytes, o.bwd_tmp, o.bwd_time
        elif self.late[i]:
            bt -= self.less[i - 1]
        if i == self.held_at:   # (a copy of a^L a Fall(L) after Loss made: rule 1)
            s, self.copy = s + self.copy, 0
        s, self.cast[i] = s + self.cast[i], 0
        during = self.during = mem + gone[i] + x[i - 1] + bt
        if during > self.peak:
            self.peak = during
        self.time += tb
        whole[i] = False
        alone[i] = False
        mem -= s - gone[i] + x[i]
        gone[i] = 0
        if alone[i - 1]:
            alone[i - 1] = False
            if not whole[i - 1]:
                mem -= self.xa[i - 1] - gone[i - 1]
                gone[i - 1] = 0
        self.mem = mem + x[i - 1]
        self.grad = i - 1

    def forward_op(self, pos, op, i, code):
        """``Fn(i)``, ``Fck(i)`` (rule 2) or ``Fall(i)`` (rule 3, and rule 6 in the
        forward phase)."""
        alone, whole = self.alone, self.whole
        forward = self.forward
        if forward:
            if i != self.next_fwd:
                _bad(pos, op, f"the forward phase must run stage {self.next_fwd} next "
                              f"(stages 1..{self.n} once each, in order)")
            self.next_fwd += 1
        elif i > self.grad:
            _bad(pos, op, f"stage {i} is recomputed after its backward")
        if not (alone[i - 1] or whole[i - 1]):
            _bad(pos, op, f"a^{i - 1} is used but not held")
        if alone[i] or whole[i]:
            _bad(pos, op, f"a^{i} is computed while already held")
        mem = self.mem
        if code == 2:
            s, ft, tf = self.s[i - 1], self.ft[i - 1], self.tf[i - 1]
            option = getattr(op, "option", 0)
            if option:   # (rule 9)
                listed = self.options[i - 1]
                if isinstance(option, bool) or not isinstance(option, int) or not 0 < option <= len(listed):
                    _bad(pos, op, f"stage {i} has no option {option!r} (Costs.options lists {len(listed)} for it)")
                o = listed[option - 1]
                s, ft, tf = o.saved_bytes, o.fwd_tmp, o.fwd_time
            copy = self.x[i] if not forward and i == self.held_at else 0   # (rule 1)
            self.copy = copy if i == self.held_at else self.copy
            c = self.c[i - 1]   # (rule 10: held by the cache, or by this a-bar^i after Loss)
            self.cast[i] = 0 if forward else c
            during = mem + max(s + copy + c, (copy or self.xa[i]) + ft)
            self.time += tf
            whole[i] = True
            self.rec[i] = option
            self.late[i] = not forward
            mem += s + copy + c
            if forward and i > 1 and not option:   # (rule 9: an option lets nothing go)
                gone = self.gone
                drop = (self.fdw[i - 2] if not self.rec[i - 1] else 0) if whole[i - 1] else \
                    self.fd[i - 2] if alone[i - 1] else 0
                if drop and not gone[i - 1]:
                    gone[i - 1] = drop
                    mem -= drop
        else:
            xa = self.xa
            xi = self.x[i] if not forward and i == self.held_at else xa[i]   # (rule 1)
            during = mem + xi + (self.ft if forward else self.ftn)[i - 1]
            self.time += self.tf[i - 1] if forward else self.tn[i - 1]
            alone[i] = True
            mem += xi + (self.c[i - 1] if forward else 0)   # (rule 10)
            if code == 0 and alone[i - 1]:
                alone[i - 1] = False
                if not whole[i - 1]:
                    mem -= xa[i - 1]
        self.mem = mem
        self.during = during
        if during > self.peak:
            self.peak = during
