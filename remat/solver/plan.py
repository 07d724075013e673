"""``Plan``: a schedule as the runtime reads it, stage by stage in the forward
phase and op by op in the backward phase. Ops have one encoding, the op
objects of remat/solver/schedule.py, from the solver's output to the runtime."""

from dataclasses import dataclass

from .schedule import Fall, Loss

__all__ = ["Plan"]


@dataclass(frozen=True, eq=False)
class Plan:
    """A ``Schedule`` for the runtime.

    Attributes:
        schedule: the schedule (``remat.Schedule``).
        costs: the costs it was solved on (what ``explain()`` shows).
        modes: ``modes[k]`` is the op class stage k runs with in the forward
            phase (``Fn``, ``Fck`` or ``Fall``); ``modes[0]`` is None.
        options: ``options[k]`` is the option stage k's forward-phase ``Fall``
            records with (``Fall.option``: 0, the base record, for every stage
            of costs without ``Costs.options``, and for ``Fn``/``Fck``);
            ``options[0]`` is None. A ``Fall`` of ``backward`` carries its own.
        backward: the ops after ``Loss``. Ops on the chain's tail
            (``Costs.tail``) are left out of both: the caller runs it.
        fall_at: stage -> index in ``backward`` of the ``Fall`` that rebuilds it.
    """

    schedule: object
    costs: object
    modes: tuple
    backward: tuple
    fall_at: dict
    options: tuple = ()

    @classmethod
    def of(cls, schedule, costs):
        """The plan of ``schedule`` solved on ``costs``."""
        ops = schedule.ops
        if costs.tail:
            ops = tuple(op for op in ops if op.stage != costs.length)
        split = ops.index(Loss)
        backward = ops[split + 1:]
        forward = ops[:split]
        return cls(schedule, costs, (None, *(type(op) for op in forward)), backward,
                   {op.stage: j for j, op in enumerate(backward) if type(op) is Fall},
                   (None, *(op.option if type(op) is Fall else 0 for op in forward)))
