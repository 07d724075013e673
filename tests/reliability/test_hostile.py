"""Hostile input: every row of docs/hostile-input.md is a case here, and each case raises
the documented exception with the documented text in its message (or, for rows marked
"none", behaves as the row says). The table is parsed, so doc and tests cannot drift."""

import builtins
import copy
import pathlib
import re

import pytest
import torch
import torch.nn as nn

import remat
from remat import Costs
from remat.solver.schedule import B, Fall, Loss
from remat.solver.solve import minimum_budget, time_bound

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "hostile-input.md"
_L0 = dict(fwd_time=[], fwd_nograd_time=[], bwd_time=[], out_bytes=[], saved_bytes=[], fwd_tmp=[],
           bwd_tmp=[], input_bytes=0)


def _costs(**change):
    data = Costs.uniform(3, size=32).to_dict()
    data.update(change)
    return Costs(**data)


def _stages(n=3, grad=True):
    torch.manual_seed(0)
    return [remat.stage(nn.Linear(4, 4).requires_grad_(grad)) for _ in range(n)]


def _chain(stages, x, **kw):
    with remat.chain(**{"budget": 2**30, **kw}):
        for s in stages:
            x = s(x)
    return x


def _plain(stages, x):
    for s in stages:
        x = s(x)
    return x


def _write(tmp, text, mode="w"):
    path = tmp / "costs.json"
    with open(path, mode) as fh:
        fh.write(text)
    return str(path)


def _chain_with_file(tmp, content, mode="w"):
    remat.clear_cache()
    path = _write(tmp, content, mode)
    _chain(_stages(), torch.randn(2, 4, requires_grad=True), costs=path)


# cases: id -> callable(tmp_path); must raise what the doc's row says, or return for "none"

def _empty_chain(tmp):
    before = remat.explain()
    with remat.chain(budget=100):
        pass
    assert remat.explain() is before


def _chain_without_stages(tmp):
    @remat.chain(budget=100)
    def double(x):
        return x * 2

    x = torch.ones(3, requires_grad=True)
    assert torch.equal(double(x), x * 2)


def _no_grad_input(tmp):
    stages = _stages()
    x = torch.randn(2, 4)
    ref = copy.deepcopy(stages)
    _plain(ref, x).square().sum().backward()
    _chain(stages, x, algorithm="min_memory").square().sum().backward()
    for a, b in zip(ref, stages):
        assert torch.equal(a.weight.grad, b.weight.grad) and torch.equal(a.bias.grad, b.bias.grad)


def _nothing_needs_grad(tmp):
    stages = _stages(grad=False)
    x = torch.randn(2, 4)
    y = _chain(stages, x)
    assert not y.requires_grad and torch.equal(y, _plain(stages, x))


def _outside_chain(tmp):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    staged = remat.stage(copy.deepcopy(lin))
    x = torch.randn(2, 4)
    assert torch.equal(lin(x), staged(x))


def _no_tensor_argument(tmp):
    with remat.chain(budget=2**30):
        _stages(1)[0]([1.0, 2.0])


def _returns_non_tensor(tmp):
    @remat.stage
    def three(x):
        return 3

    with remat.chain(budget=2**30):
        three(torch.randn(2, 4, requires_grad=True))


def _meta_between_stages(tmp):
    s = _stages(2)
    with remat.chain(budget=2**30):
        s[1](s[0](torch.randn(2, 4, requires_grad=True)).to("meta"))


def _stage_moves_to_meta(tmp):
    @remat.stage
    def to_meta(x):
        return (x * 2).to("meta")

    s = _stages(1)
    with remat.chain(budget=2**30):
        to_meta(s[0](torch.randn(2, 4, requires_grad=True)))


def _all_on_meta(tmp):
    m = remat.stage(nn.Linear(4, 4, device="meta"))
    with remat.chain(budget=2**30):
        m(m(torch.randn(2, 4, device="meta", requires_grad=True)))


def _below_minimum(tmp):
    remat.clear_cache()
    _chain(_stages(), torch.randn(3, 4, requires_grad=True), budget=1)


def _another_chains_costs(tmp):
    remat.clear_cache()
    path = str(tmp / "costs.json")
    Costs.uniform(5, size=32).save(path)
    _chain(_stages(), torch.randn(2, 4, requires_grad=True), costs=path)


def _other_sizes_costs(tmp):
    """3 stages, the input's size, stage 2's output twice this chain's."""
    remat.clear_cache()
    path = str(tmp / "costs.json")
    data = Costs.uniform(3, size=32).to_dict()
    data["out_bytes"][1] = 64
    Costs.from_dict(data).save(path)
    _chain(_stages(), torch.randn(2, 4, requires_grad=True), costs=path)


def _tailed_costs(tmp):
    remat.clear_cache()
    path = str(tmp / "costs.json")
    Costs.uniform(3, size=32).with_tail(fwd_time=0.0, bwd_time=0.0, out_bytes=0, saved_bytes=0, fwd_tmp=0,
                                         bwd_tmp=0, kept=0).save(path)
    _chain(_stages(), torch.randn(2, 4, requires_grad=True), costs=path)


def _wider_costs(tmp):
    """The costs file of 3 stages that save 4/7 of what these do (their MLPs 4/7 as wide)."""
    remat.clear_cache()
    path = str(tmp / "costs.json")

    def stages(hidden):
        torch.manual_seed(0)
        return [remat.stage(nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 4))) for _ in range(3)]

    _chain(stages(16), torch.randn(8, 4, requires_grad=True), costs=path)
    remat.clear_cache()
    _chain(stages(28), torch.randn(8, 4, requires_grad=True), costs=path)


def _costs_dir(tmp):
    remat.clear_cache()
    _chain(_stages(), torch.randn(2, 4, requires_grad=True), costs=str(tmp))


CASES = {
    "budget-abc": lambda t: remat.chain(budget="abc"),
    "budget-parsecs": lambda t: remat.chain(budget="1.5 parsecs"),
    "budget-minus-1": lambda t: remat.chain(budget=-1),
    "budget-0": lambda t: remat.chain(budget=0),
    "budget-float": lambda t: remat.chain(budget=1.5),
    "budget-none": lambda t: remat.chain(budget=None),
    "budget-list": lambda t: remat.chain(budget=[]),
    "budget-bool": lambda t: remat.chain(budget=True),
    "budget-0MB": lambda t: remat.chain(budget="0MB"),
    "budget-half-byte": lambda t: remat.chain(budget="0.5"),
    "budget-negative-unit": lambda t: remat.chain(budget="-5GiB"),
    "budget-2**70": lambda t: remat.chain(budget=2**70),
    "budget-nan": lambda t: remat.chain(budget="nan GiB"),
    "budget-1e400": lambda t: remat.chain(budget="1e400"),
    "budget-empty": lambda t: remat.chain(budget=""),
    "budget-percent": lambda t: remat.chain(budget="90%"),
    "budget-below-minimum": _below_minimum,
    "solve-budget-0": lambda t: remat.solve(Costs.uniform(3), 0),
    "solve-budget-negative": lambda t: remat.solve(Costs.uniform(3), -5),
    "solve-budget-2**62": lambda t: remat.solve(Costs.uniform(3), 2**62),
    "solve-budget-str": lambda t: remat.solve(Costs.uniform(3), "2GiB"),
    "time-bound-nan-budget": lambda t: time_bound(Costs.uniform(3), float("nan")),
    "costs-nan-time": lambda t: _costs(fwd_time=[float("nan"), 1, 1]),
    "costs-negative-time": lambda t: _costs(fwd_nograd_time=[1, -1.0, 1]),
    "costs-inf-time": lambda t: _costs(bwd_time=[1, 1, float("inf")]),
    "costs-negative-size": lambda t: _costs(out_bytes=[32, -1, 32]),
    "costs-nan-size": lambda t: _costs(saved_bytes=[float("nan"), 32, 32]),
    "costs-fraction-size": lambda t: _costs(fwd_tmp=[1.5, 0, 0]),
    "costs-huge-size": lambda t: _costs(bwd_tmp=[2**63, 0, 0]),
    "costs-bwd-tmp-below-output": lambda t: _costs(bwd_tmp=[0, -33, 0]),
    "costs-negative-input": lambda t: _costs(input_bytes=-3),
    "costs-short-list": lambda t: _costs(fwd_tmp=[0, 0]),
    "costs-string-list": lambda t: _costs(fwd_time="abc"),
    "costs-file-corrupt": lambda t: Costs.load(_write(t, "{not json")),
    "costs-file-truncated": lambda t: Costs.load(_write(t, '{"format": "remat.costs/1", "fwd_time": [1')),
    "costs-file-empty": lambda t: Costs.load(_write(t, "")),
    "costs-file-binary": lambda t: Costs.load(_write(t, b"\xff\xfe\x00junk", "wb")),
    "costs-file-nested-deep": lambda t: Costs.load(_write(t, "[" * 100000 + "]" * 100000)),
    "costs-file-list": lambda t: Costs.load(_write(t, "[1, 2]")),
    "costs-file-other-format": lambda t: Costs.load(_write(t, '{"format": "remat.costs/99", "fwd_time": [1]}')),
    "costs-file-missing-fields": lambda t: Costs.load(_write(t, '{"fwd_time": [1]}')),
    "costs-file-nan": lambda t: Costs.load(_write(t, '{"fwd_time": [NaN], "fwd_nograd_time": [1], '
                                                      '"bwd_time": [1], "out_bytes": [1], "saved_bytes": [1], '
                                                      '"fwd_tmp": [0], "bwd_tmp": [0], "input_bytes": 1}')),
    "chain-costs-file-corrupt": lambda t: _chain_with_file(t, "{oops"),
    "chain-costs-file-binary": lambda t: _chain_with_file(t, b"\x00\xff", "wb"),
    "chain-costs-other-chain": _another_chains_costs,
    "chain-costs-other-sizes": _other_sizes_costs,
    "costs-huge-int-time": lambda t: _costs(fwd_time=[10**400, 1, 1]),
    "chain-costs-tail": _tailed_costs,
    "chain-costs-other-width": _wider_costs,
    "chain-costs-directory": _costs_dir,
    "chain-costs-not-a-path": lambda t: remat.chain(budget=100, costs=123),
    "costs-save-directory": lambda t: _costs().save(str(t)),
    "costs-save-missing-folder": lambda t: _costs().save(str(t / "missing" / "costs.json")),
    "solve-L0": lambda t: remat.solve(Costs(**_L0), 100),
    "solve-not-costs": lambda t: remat.solve({"fwd_time": []}, 100),
    "simulate-bool-stage": lambda t: remat.simulate(_costs(), [Fall(True), Fall(2), Fall(3), Loss, B(3), B(2), B(1)]),
    "simulate-trace-not-list": lambda t: remat.simulate(_costs(), remat.solve(_costs(), 2**20), trace=5),
    "simulate-not-costs": lambda t: remat.simulate({}, [Fall(1), Loss, B(1)]),
    "simulate-schedule-none": lambda t: remat.simulate(_costs(), None),
    "simulate-schedule-str": lambda t: remat.simulate(_costs(), "Fall"),
    "simulate-op-class": lambda t: remat.simulate(_costs(), [Fall, Fall(2), Fall(3), Loss, B(3), B(2), B(1)]),
    "schedule-none": lambda t: remat.Schedule(None),
    "schedule-str": lambda t: remat.Schedule("abc"),
    "minimum-budget-not-costs": lambda t: minimum_budget(None),
    "costs-uniform-time-none": lambda t: Costs.uniform(3, time=None),
    "costs-with-tail-none": lambda t: _costs().with_tail(0.0, 0.0, None, 0, 0, 0),
    "costs-with-held-str": lambda t: _costs().with_held("1GiB"),
    "costs-with-options-none": lambda t: _costs().with_options(None),
    "algorithm-unknown": lambda t: remat.chain(budget=100, algorithm="fastest"),
    "algorithm-periodic-0": lambda t: remat.chain(budget=100, algorithm="periodic(0)"),
    "algorithm-none": lambda t: remat.chain(budget=100, algorithm=None),
    "solve-algorithm-unknown": lambda t: remat.solve(Costs.uniform(3), 100, "bogus"),
    "slots-0": lambda t: remat.chain(budget=100, slots=0),
    "slots-float": lambda t: remat.chain(budget=100, slots=1.5),
    "slots-10**9": lambda t: remat.chain(budget=100, slots=10**9),
    "solve-slots-0": lambda t: remat.solve(Costs.uniform(3), 100, slots=0),
    "empty-chain": _empty_chain,
    "chain-without-stages": _chain_without_stages,
    "activation-no-grad": _no_grad_input,
    "nothing-needs-grad": _nothing_needs_grad,
    "stage-outside-chain": _outside_chain,
    "stage-no-tensor": _no_tensor_argument,
    "stage-returns-int": _returns_non_tensor,
    "device-change-between-stages": _meta_between_stages,
    "stage-changes-device": _stage_moves_to_meta,
    "chain-on-meta": _all_on_meta,
}


def _rows():
    """(id, exception, message fragment) of each row of the doc's table."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`") or cells[0] == "`id`":
            continue
        ident = cells[0].strip("`")
        kind = cells[2].strip("`")
        fragment = re.sub(r"^`|`$", "", cells[3]).replace("\\|", "|")
        rows.append((ident, kind, fragment))
    return rows


ROWS = _rows()


def test_doc_and_cases_match():
    """Every case is documented once and every documented row has a case."""
    ids = [r[0] for r in ROWS]
    assert len(ids) == len(set(ids)), "a row is documented twice"
    assert set(ids) == set(CASES), (sorted(set(CASES) - set(ids)), sorted(set(ids) - set(CASES)))


def _exception_class(name):
    cls = getattr(remat, name, None) or getattr(builtins, name, None)
    assert isinstance(cls, type) and issubclass(cls, BaseException), f"unknown exception {name}"
    return cls


@pytest.fixture(autouse=True)
def fresh_cache():
    remat.clear_cache()
    yield
    remat.clear_cache()


@pytest.mark.parametrize("ident,kind,fragment", ROWS, ids=[r[0] for r in ROWS])
def test_hostile_input(ident, kind, fragment, tmp_path):
    """The input of the row raises the row's exception, whose message contains the row's text."""
    case = CASES[ident]
    if kind == "none":
        case(tmp_path)
        return
    with pytest.raises(_exception_class(kind)) as info:
        case(tmp_path)
    assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    if issubclass(info.type, remat.RematError) or ident.startswith(("budget", "solve", "algorithm", "slots")):
        assert str(info.value).startswith("remat: "), str(info.value)
    # the next ordinary call works and is plain PyTorch's
    stages = _stages()
    x = torch.randn(2, 4, requires_grad=True)
    assert torch.equal(_chain(stages, x), _plain(stages, x))
