"""The solver half: a chain's ``Costs`` (with its stages' ``Option``), the ops
and ``simulate`` (what a schedule costs), ``solve`` (the optimal schedule for a
budget, in C through ``binding``) and the ``Plan`` the runtime reads."""

from .costs import Costs
from .option import Option

__all__ = ["Costs", "Option"]
