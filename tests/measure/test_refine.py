"""Times refined by the calls after the measuring one (remat/measure/refine.py, Note
[Timing the second call]): stages that sleep show what the storage meter's op
timer misses and a training step does not."""

import time

import pytest
import torch
import torch.nn as nn

import remat
from remat.measure.refine import ATTEMPTS
from remat.solver.solve import minimum_budget


class _Sleepy(torch.autograd.Function):
    """Sleeps ``fwd`` seconds in its forward and ``bwd`` in its backward: wall time
    the meter's op timer does not see, but a training step does."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        time.sleep(fwd)
        ctx.bwd = bwd
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd)
        return g, None, None


class Sleepy(nn.Module):
    def __init__(self, d, fwd, bwd):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.fwd, self.bwd = fwd, bwd

    @remat.stage
    def forward(self, x):
        return _Sleepy.apply(torch.tanh(self.lin(x)), self.fwd, self.bwd)


def _sleepy_chain(fwd, bwd, n=4, stage=Sleepy, options="auto"):
    """``call(budget, path, backward)`` runs a chain of ``n`` ``stage(16, fwd, bwd)``
    (``call.stages``) and gives its explanation."""
    torch.manual_seed(0)
    stages = nn.ModuleList(stage(16, fwd, bwd) for _ in range(n))
    x = torch.randn(8, 16, requires_grad=True)

    def call(budget, path=None, backward=True):
        with remat.chain(budget=budget, costs=path, options=options):
            h = x
            for s in stages:
                h = s(h)
        if backward:
            h.sum().backward()
        return remat.explain()

    call.stages = stages
    return call


def test_second_call_gives_the_times():
    """Note [Timing the second call]: the two calls after the measuring one,
    stamped stage by stage, replace the measured times (their mean),
    and the call after them plans on them. The meter times ops only, so it misses
    a stage's Python (sleeps here); a training step does not."""
    remat.clear_cache()
    call = _sleepy_chain(0.01, 0.02)
    first, second, third, fourth = (call(2**50) for _ in range(4))
    assert all(t < 0.01 for t in first.measured.fwd_time), first.measured.fwd_time
    assert all(t < 0.02 for t in first.measured.bwd_time), first.measured.bwd_time
    assert second.measured is first.measured and third.measured is first.measured
    assert all(0.01 <= t < 0.1 for t in fourth.measured.fwd_time), fourth.measured.fwd_time
    assert all(0.02 <= t < 0.1 for t in fourth.measured.bwd_time), fourth.measured.bwd_time
    # nothing was recomputed: the times without recording stay measured, up to
    # the new times with recording
    assert list(fourth.measured.fwd_nograd_time) == [
        min(n, f) for n, f in zip(first.measured.fwd_nograd_time, fourth.measured.fwd_time)]
    assert fourth.schedule.time > first.schedule.time + 4 * 0.025
    assert call(2**50).measured is fourth.measured   # once only


class Slowed(Sleepy):
    """Sleeps ``extra`` seconds more in its next forward (the machine busy
    elsewhere), and ``cold`` more in its first forward without recording (a
    kernel's first call, a cold cache: the measuring call's run 3 sees it)."""

    extra = 0.0
    cold = 0.0

    @remat.stage
    def forward(self, x):
        extra, self.extra = self.extra, 0.0
        if not torch.is_grad_enabled():
            extra, self.cold = extra + self.cold, 0.0
        time.sleep(extra)
        return _Sleepy.apply(torch.tanh(self.lin(x)), self.fwd, self.bwd)


def test_one_slow_sample_is_outvoted():
    """A stage slowed down in one of the two stamped calls keeps its usual time."""
    remat.clear_cache()
    call = _sleepy_chain(0.01, 0.0, stage=Slowed)
    call(2**50)
    call.stages[1].extra = 0.2
    for _ in range(3):
        costs = call(2**50).measured
    assert all(0.01 <= t < 0.1 for t in costs.fwd_time), costs.fwd_time


def test_samples_combine_to_their_mean_unless_one_is_an_outlier():
    """Two like samples give their mean (the least would be biased low); one 1.5x
    the other gives the lesser (the stage was preempted in that call)."""
    from remat.measure.refine import combine

    assert combine([0.010, 0.012]) == pytest.approx(0.011)
    assert combine([0.010, 0.016]) == 0.010
    assert combine([0.030, 0.010]) == 0.010
    assert combine([0.004]) == 0.004


def test_one_sample_is_used_when_no_second_comes(tmp_path):
    """If only one of the calls that may be stamped gives a whole backward, its
    times are used once none is left (at the next call)."""
    remat.clear_cache()
    path = str(tmp_path / "costs.json")
    call = _sleepy_chain(0.01, 0.02)
    first = call(2**50, path).measured
    call(2**50, path)                       # a sample
    for _ in range(ATTEMPTS - 1):           # none
        assert call(2**50, path, backward=False).measured is first
    last = call(2**50, path).measured
    assert last is not first
    assert all(0.01 <= t < 0.1 for t in last.fwd_time), last.fwd_time
    assert remat.Costs.load(path).fwd_time == last.fwd_time


def test_second_call_times_leave_out_its_recomputations(tmp_path):
    """At a budget where the backward recomputes, the recomputations (0.06 s of
    forward each here) are no stage's backward time; they give the times without
    recording of the stages they ran. The costs file the measuring call wrote is
    written again with the refined times."""
    remat.clear_cache()
    path = str(tmp_path / "costs.json")
    call = _sleepy_chain(0.06, 0.02)
    least = minimum_budget(call(2**50).costs)   # (the tail after the block seen)
    remat.clear_cache()
    metered = call(least, path).measured
    assert remat.Costs.load(path).bwd_time == metered.bwd_time
    second = call(least, path)
    assert second.schedule.recomputations() > 0
    call(least, path)
    refined = remat.Costs.load(path)
    assert all(0.06 <= t < 0.1 for t in refined.fwd_time), refined.fwd_time
    assert all(0.02 <= t < 0.05 for t in refined.bwd_time), refined.bwd_time
    changed = [i for i in range(4) if refined.fwd_nograd_time[i] != metered.fwd_nograd_time[i]]
    assert changed and all(0.06 <= refined.fwd_nograd_time[i] < 0.1 for i in changed)


def test_times_without_recording_are_no_more_than_with():
    """A stage's measured time without recording that the second call did not run
    (nothing recomputed) is capped at its refined time with recording (Note
    [Timing the second call], 3)."""
    remat.clear_cache()
    call = _sleepy_chain(0.005, 0.0, stage=Slowed)
    for stage in call.stages:
        stage.cold = 0.05
    first, _, _, fourth = (call(2**50).measured for _ in range(4))
    assert min(first.fwd_nograd_time[:2]) >= 0.05, first.fwd_nograd_time
    assert all(0.005 <= t < 0.05 for t in fourth.fwd_time), fourth.fwd_time
    assert all(n <= f for n, f in zip(fourth.fwd_nograd_time, fourth.fwd_time)), fourth.fwd_nograd_time


@pytest.mark.filterwarnings("ignore:remat. the code around the chain keeps")   # (the loop keeps ``mid``)
def test_times_stay_measured_without_a_whole_backward(tmp_path):
    """No backward, or one that stops inside the chain, leaves the measured times
    (the next call tries again); costs read from a file are never refined."""
    remat.clear_cache()
    call = _sleepy_chain(0.0, 0.02)
    first = call(2**50)
    assert call(2**50, backward=False).measured is first.measured
    assert call(2**50).measured is first.measured   # the third call gives a sample
    assert call(2**50).measured is first.measured   # the fourth the second one
    assert call(2**50).measured is not first.measured
    remat.clear_cache()
    torch.manual_seed(0)
    stages = nn.ModuleList(Sleepy(16, 0.0, 0.02) for _ in range(4))
    x = torch.randn(8, 16, requires_grad=True)
    seen = []
    for _ in range(3):
        with remat.chain(budget=2**50):
            h = x
            mid = None
            for i, s in enumerate(stages):
                h = s(h)
                if i == 1:
                    mid = h
        seen.append(remat.explain().measured)
        torch.autograd.grad(h.sum(), mid)
    assert seen[2] is seen[0]
    remat.clear_cache()
    path = str(tmp_path / "costs.json")
    call = _sleepy_chain(0.0, 0.02)
    call(2**50, path)
    call(2**50, path)
    given = remat.Costs.load(path)
    remat.clear_cache()
    seen = [call(2**50, path).measured for _ in range(3)]
    assert all(c.bwd_time == given.bwd_time for c in seen)


def test_stamped_times_hold_remat_own_work(monkeypatch):
    """A stamped forward time covers remat's work for the stage as well as the
    stage (the checks against the chain's record before it), and the last stage's the
    chain's end of call: simulate charges nothing else, and on small stages that
    work is a few percent of a step (Note [Timing the second call], 1)."""
    import remat.runtime.runner as running

    remat.clear_cache()
    call = _sleepy_chain(0.0, 0.0)
    call(2**50)   # measuring
    slow_check, slow_end = 0.01, 0.03
    matches, finish = running.Runner.matches, running.Runner.finish

    def slow_matches(self, *args):
        time.sleep(slow_check)
        return matches(self, *args)

    def slow_finish(self, *args):
        time.sleep(slow_end)
        return finish(self, *args)

    monkeypatch.setattr(running.Runner, "matches", slow_matches)
    monkeypatch.setattr(running.Runner, "finish", slow_finish)
    call(2**50), call(2**50)   # stamped
    costs = call(2**50).measured
    assert all(t >= slow_check for t in costs.fwd_time), costs.fwd_time
    assert costs.fwd_time[-1] >= slow_check + slow_end, costs.fwd_time
    assert all(t < slow_check + slow_end for t in costs.fwd_time[:-1]), costs.fwd_time


def test_recording_recomputations_count_in_the_forward_time(monkeypatch):
    """A recomputation that records pays remat's work around the stage (replay,
    pack hooks, the determinism guard: slowed here): a stage's refined forward time
    is the mean of that run and its forward-phase run, so that the schedule that
    ran both is charged their sum (Note [Timing the second call], 3)."""
    import remat.runtime.recompute as recompute

    remat.clear_cache()
    call = _sleepy_chain(0.0, 0.0)
    least = minimum_budget(call(2**50).costs)   # (the tail after the block seen)
    remat.clear_cache()
    call(least)   # measuring
    slow = 0.02
    check = recompute.check_saved

    def slow_check(*args):
        time.sleep(slow)
        return check(*args)

    monkeypatch.setattr(recompute, "check_saved", slow_check)
    second = call(least)
    ops = second.schedule.ops
    recorded = {op.stage for op in ops[ops.index(remat.Loss):] if isinstance(op, remat.Fall)}
    whole = {op.stage for op in ops[:ops.index(remat.Loss)]
             if isinstance(op, remat.Fall) and op.stage <= second.schedule.stages}   # (not the tail)
    assert recorded and whole and not recorded & whole, ops
    call(least)
    costs = call(least).measured
    for k in recorded:
        assert slow / 2 <= costs.fwd_time[k - 1] < slow, (k, costs.fwd_time)
    for k in whole:
        assert costs.fwd_time[k - 1] < slow / 4, (k, costs.fwd_time)


class Gated(Sleepy):
    """Saves two tensors made by cheap ops of one matmul's output: option 1, keeping
    that output, keeps less than the stage's record."""

    @remat.stage
    def forward(self, x):
        y = self.lin(x)
        return _Sleepy.apply(torch.sigmoid(y) * torch.tanh(y), self.fwd, self.bwd)


def test_an_option_run_gives_the_option_its_times(monkeypatch):
    """Note [Timing the second call], 5: a stage the stamped calls ran with option 1
    (its matmul kept, the rest run again before its backward) has the option's
    recomputation, the sleep the meter's op timer misses, in the option's refined
    bwd_time, and its own fwd_time is the stage's, not halved by that rebuild."""
    import dataclasses

    from remat.measure.chain_record import ChainRecord

    planning = ChainRecord.planning_costs

    def options_first(self, output=None, options=True):   # (plans take the options wherever offered)
        c = planning(self, output, options)
        if c is None or not c.has_options:
            return c
        return c.with_options({k: [dataclasses.replace(o, fwd_time=0.0, bwd_time=0.0) for o in c.options[k - 1]]
                               for k in range(1, c.length + 1) if c.options[k - 1]})

    monkeypatch.setattr(ChainRecord, "planning_costs", options_first)
    remat.clear_cache()
    call = _sleepy_chain(0.01, 0.0, stage=Gated, options=True)
    first = call(2**50)
    assert all(first.measured.options[i] for i in range(4)), first.measured.options
    assert all(o.bwd_time - b < 0.005 for o, b in zip((s[0] for s in first.measured.options[:4]),
                                                       first.measured.bwd_time)), "(the meter misses the sleep)"
    second = call(2**50)
    loss = second.schedule.ops.index(remat.Loss)
    ran = [op.stage for op in second.schedule.ops[:loss] if isinstance(op, remat.Fall) and op.option]
    assert ran, second.schedule.ops
    call(2**50)
    refined = call(2**50).measured
    for k in ran:
        extra = refined.options[k - 1][0].bwd_time - refined.bwd_time[k - 1]
        assert 0.01 <= extra < 0.05, (k, extra)
        assert 0.01 <= refined.fwd_time[k - 1] < 0.05, (k, refined.fwd_time)


def test_refine_takes_an_option_run_apart():
    """refine's arithmetic (Note [Timing the second call], 5) on made-up stamps: an
    option's forward less its mode's dispatch is the stage's, its rebuild before
    the backward is the option's recomputation, and options no call ran scale
    their first-call estimate by what those that ran showed."""
    import types

    from remat.measure.refine import Sample, refine

    opt = remat.Option(saved_bytes=1, fwd_time=1.1, bwd_time=2.5, fwd_tmp=0, bwd_tmp=0)   # +0.1, +0.5
    costs = remat.Costs.uniform(3, time=1.0, size=1, saved=4).with_options({1: [opt], 2: [opt], 3: [opt]})
    record = types.SimpleNamespace(costs=costs, samples=[], attempts=2, refined=0, plans={1: None},
                                   stages=[types.SimpleNamespace(grad_replay=False)] * 3, save=lambda: None)
    # stage 1 ran option 1 (forward 2.1 = 2.0 + the mode's 0.1; its rebuild 1.5), stage 2 whole,
    # stage 3 recorded again with option 1 in the backward (3.1) and rebuilt from its cache (2.0)
    for _ in range(2):
        record.samples.append(Sample(forward=[2.1, 2.0, 3.0], backward=[4.0, 4.0, 4.0], options=[1, 0, 0],
                                     nograd={}, recorded={3: (3.1, 1)}, cached={1: 1.5, 3: 2.0}))
    refine(record)
    c = record.costs
    assert c.fwd_time == pytest.approx([2.0, 2.0, 3.0])
    assert c.bwd_time == pytest.approx([4.0, 4.0, 4.0])
    assert [o[0].fwd_time for o in c.options] == pytest.approx([2.1, 2.1, 3.1])
    # seen: 1.5 and 2.0 against estimates of 0.5 each: stage 2's 0.5 scales by 3.5 / 1.0
    assert [o[0].bwd_time - b for o, b in zip(c.options, c.bwd_time)] == pytest.approx([1.5, 1.75, 2.0])
    assert record.plans == {} and record.refined == 2
