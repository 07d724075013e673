"""The ops of a schedule (docs/how-it-works.md, "The schedule"): ``Fn``,
``Fck``, ``Fall`` and ``B`` on a stage, and ``Loss``; what each costs is
``simulate``'s (remat/solver/schedule.py Note [Accounting])."""

from dataclasses import dataclass

__all__ = ["Fn", "Fck", "Fall", "B", "Loss"]


@dataclass(frozen=True, slots=True)
class _StageOp:
    """An op on stage ``stage``. Each op is a subclass, made a dataclass again (its
    own ``__init__`` and slots), that sets its ``code``: what the C solver returns
    for it. ``str`` gives the class name and the stage ("Fn3")."""
    stage: int
    code = None

    def __str__(self):
        return f"{type(self).__name__}{self.stage}"


@dataclass(frozen=True, slots=True)
class Fn(_StageOp):
    """Forward stage ``stage`` keeping nothing; its input is let go."""
    code = 0


@dataclass(frozen=True, slots=True)
class Fck(_StageOp):
    """Forward stage ``stage`` keeping its input as a checkpoint."""
    code = 1


@dataclass(frozen=True, slots=True, repr=False)
class Fall(_StageOp):
    """Forward stage ``stage`` recording the graph: keep its input and a-bar; with
    ``option`` k > 0, the record of the stage's k-th option (``Costs.options``,
    remat/solver/option.py Note [Options]) in place of a-bar. ``str`` shows the
    option where there is one ("Fall3:o1")."""
    option: int = 0
    code = 2

    def __str__(self):
        return f"Fall{self.stage}:o{self.option}" if self.option else f"Fall{self.stage}"

    def __repr__(self):
        return f"Fall(stage={self.stage!r}, option={self.option!r})" if self.option else f"Fall(stage={self.stage!r})"


@dataclass(frozen=True, slots=True)
class B(_StageOp):
    """Backward of stage ``stage``."""
    code = 3


class _LossOp:
    __slots__ = ()
    code = 4
    stage = 0

    def __repr__(self):
        return "Loss"

    __str__ = __reduce__ = __repr__   # (pickled as the module's Loss)


Loss = _LossOp()
