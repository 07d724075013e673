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
        policies: ``policies[k]`` says what each option of stage k keeps (its
            record's ``StageCosts.policies``, remat/measure/options.py);
            read through ``policy``.
    """

    schedule: object
    costs: object
    modes: tuple
    backward: tuple
    fall_at: dict
    options: tuple = ()
    policies: tuple = ()

    @classmethod
    def of(cls, schedule, costs, policies=()):
        """The plan of ``schedule`` solved on ``costs``, whose stage k's options keep
        as ``policies[k - 1]`` says."""
        ops = schedule.ops
        if costs.tail:
            ops = tuple(op for op in ops if op.stage != costs.length)
        split = ops.index(Loss)
        backward = ops[split + 1:]
        forward = ops[:split]
        return cls(schedule, costs, (None, *(type(op) for op in forward)), backward,
                   {op.stage: j for j, op in enumerate(backward) if type(op) is Fall},
                   (None, *(op.option if type(op) is Fall else 0 for op in forward)), (None, *policies))

    def policy(self, k, option):
        """What option ``option`` of stage k keeps: its record's policy, or the
        option's own number where the record lists none for it (costs that give
        a stage options of their own, as tests do)."""
        listed = self.policies[k] if k < len(self.policies) else ()
        return listed[option - 1] if 0 < option <= len(listed) else option
