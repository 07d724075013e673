"""Unit tests of the plan a call that skipped stages runs (``_holed``,
remat/runtime/skips.py Note [Skipped stages]), on costs alone."""

from hypothesis import given, strategies as st

import remat
from remat.runtime.skips import _holed
from remat.solver.plan import Plan
from remat.solver.schedule import B, Fall, Fck, Fn, Loss, Schedule, simulate
from remat.solver.solve import minimum_budget, solve, store_all


class _View:
    """What ``_holed`` asks of a view: its planning costs and its stages' policies."""

    def __init__(self, costs):
        self.costs = costs

    def planning_costs(self, options=True):
        return self.costs

    def policies(self):
        return [()] * self.costs.length


class _Spec:
    options = False


@given(st.integers(3, 14), st.floats(0.0, 1.0), st.data())
def test_a_chain_of_like_stages_without_some_runs_its_plan_less_their_ops(length, fraction, data):
    """Like stages (a transformer's layers): the optimal plan of the whole chain,
    less the ops of any inner stages skipped, is a valid schedule of the chain
    without them, under the same budget and faster (so a LayerDrop call never needs
    to measure, wherever its record's plan fits)."""
    costs = remat.Costs.uniform(length, time=1.0, size=100)
    low, high = minimum_budget(costs), simulate(costs, store_all(length)).peak
    budget = int(low + fraction * (high - low))
    plan = Plan.of(solve(costs, budget), costs)
    gone = data.draw(st.sets(st.integers(2, length - 1), min_size=1, max_size=length - 2))
    keep = [i for i in range(length) if i + 1 not in gone]
    view = _View(remat.Costs.uniform(len(keep), time=1.0, size=100))
    holed = _holed(plan, keep, view, budget, _Spec())
    assert holed is not None, (plan.schedule, sorted(gone))
    assert holed.schedule.peak <= budget
    assert holed.schedule.time < plan.schedule.time
    assert simulate(view.costs, holed.schedule) == (holed.schedule.time, holed.schedule.peak)
    assert [op.stage for op in holed.schedule.ops if op.stage] and \
        max(op.stage for op in holed.schedule.ops) == len(keep)


def _schedule(text):
    """The ``Schedule`` of ops written as ``str(schedule)`` writes them ("Fck1 Fn2 | B2 ...")."""
    kinds = {"Fn": Fn, "Fck": Fck, "Fall": Fall, "B": B}
    ops = []
    for word in text.replace("|", "Loss").split():
        name = word.rstrip("0123456789")
        ops.append(Loss if word == "Loss" else kinds[name](int(word[len(name):])))
    return Schedule(tuple(ops))


def test_what_ran_only_to_rebuild_a_skipped_stage_goes():
    """Stages 2 and 3 of five skipped: their forward ops go; the rebuild of stage 4
    from the checkpoint a^0 loses its runs of them; the rebuild of stage 3 goes
    whole (``Fck1 Fn2`` led only to it); stage 1's record, made beside stage 2's,
    stays. Stage 4 then rebuilds from a^0, as the chain's input is held."""
    costs = remat.Costs.uniform(5, time=1.0, size=100)
    plan = Plan.of(_schedule("Fck1 Fn2 Fn3 Fn4 Fall5 | B5 Fck1 Fn2 Fn3 Fall4 B4 Fck1 Fn2 Fall3 B3 "
                             "Fall1 Fall2 B2 B1"), costs)
    view = _View(remat.Costs.uniform(3, time=1.0, size=100))
    holed = _holed(plan, [0, 3, 4], view, 2**30, _Spec())
    assert " ".join(map(str, holed.schedule.ops)) == "Fck1 Fn2 Fall3 Loss B3 Fck1 Fall2 B2 Fall1 B1"


def test_a_stage_after_a_gap_keeps_the_checkpoint_the_skipped_one_kept():
    """A skipped stage that kept its input (``Fck3``) hands the checkpoint to the
    next stage kept, which keeps it (``Fn4`` becomes ``Fck``): the rebuilds after it
    start there. Where the schedule would not fit the budget, there is none."""
    costs = remat.Costs.uniform(5, time=1.0, size=100)
    plan = Plan.of(_schedule("Fck1 Fn2 Fck3 Fn4 Fall5 | B5 Fck3 Fall4 B4 Fck1 Fn2 Fall3 B3 Fck1 Fall2 B2 Fall1 B1"),
                   costs)
    view = _View(remat.Costs.uniform(4, time=1.0, size=100))
    holed = _holed(plan, [0, 1, 3, 4], view, 2**30, _Spec())
    assert " ".join(map(str, holed.schedule.ops)) == "Fck1 Fn2 Fck3 Fall4 Loss B4 Fall3 B3 Fck1 Fall2 B2 Fall1 B1"
    assert _holed(plan, [0, 1, 3, 4], view, holed.schedule.peak - 1, _Spec()) is None
