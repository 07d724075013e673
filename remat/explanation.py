"""What remat knows about a chain after a call: its costs, budget and schedule
(``remat.explain()``, ``remat.chain.last``), with a per-stage table."""

from .units import format_bytes

__all__ = ["Explanation", "LatestExplanation", "explain", "publish"]

_last = [None]   # the Explanation of the latest chain call


class Explanation:
    """What remat knows about one chain: costs, budget, schedule.

    ``costs`` are those the schedule was solved on; ``measured`` those the
    chain measured (or read), as its costs file holds them. They differ by
    the chain's output, counted in ``held_bytes`` while the code around the
    chain may hold it through the backward (Note [The chain's output], remat/measure/chain_record.py)."""

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
        out = [lines[0] + "  forward   name"]
        for line in lines[1:]:
            first = line.split()[0]
            if not first.isdigit():   # the input's and the held bytes' lines
                out.append(line)
                continue
            i = int(first) - 1
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


def publish(explanation):
    """Make ``explanation`` the latest chain call's."""
    _last[0] = explanation


class LatestExplanation:
    """``remat.chain.last``: the ``Explanation`` of the latest chain call, read on
    the class or an instance (as ``explain()``)."""

    def __get__(self, obj, owner=None):
        return _last[0]
