"""Run 3 of Note [Measuring a stage] meters the forward without recording
(remat/measure/timing.py, Note [Metering the forward without recording]):
``Costs.fwd_nograd_less``, what ``Fn`` and ``Fck`` after ``Loss`` need less than
``fwd_tmp``."""

import copy

import pytest
import torch
import torch.nn as nn

import remat
import remat.measure.measuring as measuring
from remat.measure.meter import Instrument
from chains import IMG_KINDS, SEQ_KINDS, Net, measured_costs



pytestmark = pytest.mark.usefixtures("one_thread")   # (tests/conftest.py)


def _mlp(d, depth, p=0.1, bn=False):
    """``depth`` Linear+GELU(+Dropout) pairs, widening to 2d: a forward that saves much."""
    layers, width = [], d
    for i in range(depth):
        out = d if i == depth - 1 else 2 * d
        layers += [nn.Linear(width, out)] + ([nn.BatchNorm1d(out)] if bn and i == 0 else []) + \
            [nn.GELU(), nn.Dropout(p)]
        width = out
    return nn.Sequential(*layers)


def _step(stages, x, **chain):
    """One step of ``stages`` as a chain at no limit; the chain's explanation."""
    with remat.chain(budget=2**30, **chain):
        h = x
        for s in stages:
            h = s(h)
    h.sum().backward()
    return remat.explain()


def _nograd_tmp(module, x):
    """A forward of ``module`` on ``x`` under ``torch.no_grad``, metered on its own:
    its peak above its input, its output taken out."""
    with torch.no_grad(), Instrument(writes=False) as meter:
        out = module(x)
    return meter.peak - out.untyped_storage().nbytes()


def _state_bytes(module):
    """Bytes of the buffers a training forward of ``module`` writes in place (BatchNorm's)."""
    return sum(b.numel() * b.element_size() for b in module.buffers())


def test_the_forward_without_recording_is_metered():
    """A stage whose forward saves much (Linear+GELU layers, dropout) needs less
    without recording: fwd_tmp_nograd is the peak of its forward under no_grad above
    input and output, metered apart, plus the copy of the state it writes in place a
    recomputation holds (BatchNorm's)."""
    remat.clear_cache()
    torch.manual_seed(0)
    d, batch = 32, 16
    bodies = [_mlp(d, 3), _mlp(d, 2, bn=True), _mlp(d, 4, p=0.0)]
    plain = copy.deepcopy(bodies)
    costs = _step([remat.stage(b) for b in bodies], torch.randn(batch, d, requires_grad=True)).costs
    for i, module in enumerate(plain):
        expected = _nograd_tmp(module, torch.randn(batch, d)) + _state_bytes(module)
        assert costs.fwd_tmp_nograd[i] == expected, (i, costs.fwd_tmp_nograd, expected)
        assert 0 < costs.fwd_nograd_less[i] <= costs.fwd_tmp[i], (i, costs.fwd_nograd_less, costs.fwd_tmp)
    assert costs.fwd_nograd_less[-1] == 0   # (the tail: it never runs without recording)


class _Differs(nn.Module):
    """A stage whose forward without recording gives another output: recomputed with
    grad mode on (Note [Replaying a stage] 4)."""

    def __init__(self, d):
        super().__init__()
        self.body = _mlp(d, 3)

    @remat.stage
    def forward(self, x):
        return self.body(x) + (0.0 if torch.is_grad_enabled() else 1.0)


def test_a_stage_recomputed_with_grad_mode_gets_none():
    """A stage whose forward without recording differs is recomputed recording: it
    needs no less (and its time without recording is its time with)."""
    remat.clear_cache()
    torch.manual_seed(0)
    d = 32
    stages = [remat.stage(_mlp(d, 2)), _Differs(d), remat.stage(_mlp(d, 3, p=0.0))]
    explanation = _step(stages, torch.randn(16, d, requires_grad=True))
    costs = explanation.costs
    assert [s.grad_replay for s in explanation._record.stages] == [False, True, False]
    assert costs.fwd_nograd_less[1] == 0 and costs.fwd_nograd_time[1] == costs.fwd_time[1]
    assert costs.fwd_nograd_less[0] > 0 and costs.fwd_nograd_less[2] > 0, costs.fwd_nograd_less


def test_a_twin_takes_its_twins_value(monkeypatch):
    """Note [Twin stages]: copies of one block run run 3 once or twice; the others
    take the value their twin measured."""
    remat.clear_cache()
    torch.manual_seed(0)
    runs = []
    real = measuring.nograd_run

    def spy(*args):
        runs.append(args[-1])
        return real(*args)

    monkeypatch.setattr(measuring, "nograd_run", spy)
    n = 6
    costs = _step([remat.stage(_mlp(32, 3)) for _ in range(n)], torch.randn(16, 32, requires_grad=True)).costs
    less = costs.fwd_nograd_less[:n]
    assert len(runs) < n
    assert less[0] > 0 and len(set(less)) == 1, less
    assert len(set(costs.fwd_nograd_time[1:n])) == 1


def test_costs_from_a_file_keep_its_value(tmp_path):
    """Costs saved to a file carry fwd_nograd_less; a chain reading the file keeps the
    file's value, unmeasured."""
    path = str(tmp_path / "costs.json")
    torch.manual_seed(0)
    bodies = [_mlp(32, 3), _mlp(32, 2, p=0.0), _mlp(32, 3)]
    x = torch.randn(16, 32, requires_grad=True)
    remat.clear_cache()
    measured = _step([remat.stage(b) for b in bodies], x, costs=path).measured
    saved = remat.Costs.load(path)
    assert saved.fwd_nograd_less == measured.fwd_nograd_less and any(saved.fwd_nograd_less)
    data = saved.to_dict()
    data["fwd_nograd_less"] = [v // 2 + 1 for v in data["fwd_nograd_less"]]
    remat.Costs.from_dict(data).save(path)
    remat.clear_cache()
    explanation = _step([remat.stage(b) for b in bodies], x, costs=path)
    assert list(explanation.measured.fwd_nograd_less) == data["fwd_nograd_less"]
    assert list(explanation.costs.fwd_nograd_less[:3]) == data["fwd_nograd_less"]


@pytest.mark.parametrize("image", [False, True])
def test_the_measured_value_is_within_fwd_tmp(image):
    """On chains of every stage kind, 0 <= fwd_nograd_less <= fwd_tmp, and stages that
    save what they make need less."""
    kinds = IMG_KINDS if image else SEQ_KINDS
    torch.manual_seed(0)
    costs = measured_costs(Net(list(kinds), image=image))
    for i, (less, tmp) in enumerate(zip(costs.fwd_nograd_less, costs.fwd_tmp)):
        assert 0 <= less <= tmp, (kinds[i], less, tmp)
    assert any(costs.fwd_nograd_less), costs.fwd_nograd_less


def test_casts_a_cache_holds_are_counted():
    """Under autocast, run 3 finds run 1's casts of the weights in autocast's cache;
    a recomputation after Loss, in an autocast region of its own, makes them again:
    fwd_tmp_nograd is at least what a forward without recording needs there."""
    remat.clear_cache()
    torch.manual_seed(0)
    bodies = [nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(2)]
    bodies[1].append(nn.Dropout(0.1))
    plain = copy.deepcopy(bodies)
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with remat.chain(budget=2**30):
            h = x
            for b in [remat.stage(b) for b in bodies]:
                h = b(h)
        loss = h.float().sum()
    loss.backward()
    costs = remat.explain().costs
    for i, module in enumerate(plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            need = _nograd_tmp(module, torch.randn(32, 64))
        assert costs.fwd_tmp_nograd[i] >= need, (i, costs.fwd_tmp_nograd, need)
        assert costs.fwd_nograd_less[i] > 0, costs.fwd_nograd_less


def test_gradients_stay_plain_pytorchs():
    """A measuring call that meters run 3 leaves the gradients of plain PyTorch's step."""
    remat.clear_cache()
    torch.manual_seed(0)
    bodies = [_mlp(32, 3), _mlp(32, 2, bn=True), _mlp(32, 3)]
    plain = copy.deepcopy(bodies)
    x = torch.randn(16, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch.manual_seed(1)
    _step([remat.stage(b) for b in bodies], x)
    torch.manual_seed(1)
    h = x_ref
    for b in plain:
        h = b(h)
    h.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for p, q in zip((p for b in bodies for p in b.parameters()), (q for b in plain for q in b.parameters())):
        assert torch.equal(p.grad, q.grad)
    assert all(torch.equal(a, b) for a, b in zip(bodies[1].buffers(), plain[1].buffers()))
