"""``remat.Costs``: validation that names the field and the stage, what it takes
as numbers and lists, the optional forward-drop fields and old files without them."""

import types

import pytest

from chains import costs_file_step
from remat.solver import binding as _c_solver
from remat.solver.costs import Costs
from remat.errors import CostsError, SolverError
from remat.solver.schedule import simulate
from remat.solver.schedule import B, Fall, Fck, Loss
from remat.solver.solve import store_all


def test_costs_errors_name_field_and_stage():
    """Costs validation names the field and the 1-based stage."""
    good = Costs.uniform(3).to_dict()
    with pytest.raises(CostsError, match=r"fwd_time\[1\] \(stage 2\)"):
        Costs(**{**good, "fwd_time": [1.0, float("nan"), 1.0]})
    with pytest.raises(CostsError, match=r"saved_bytes\[2\] \(stage 3\)"):
        Costs(**{**good, "saved_bytes": [1, 1, -4]})
    # a backward may give back its stage's output (bwd_tmp down to -out_bytes), no more
    assert Costs(**{**good, "bwd_tmp": [-1, 0, -1]}).bwd_tmp == (-1, 0, -1)
    with pytest.raises(CostsError, match=r"bwd_tmp\[0\] \(stage 1\) is -2; it may give back"):
        Costs(**{**good, "bwd_tmp": [-2, 0, 0]})
    with pytest.raises(SolverError, match=r"bwd_tmp\[1\] \(stage 2\)"):
        _c_solver._check_costs(types.SimpleNamespace(**{**good, "bwd_tmp": [0, -2, 0], "length": 3}))


def test_costs_take_sequences_of_numbers_only():
    """NumPy-like numbers and sequences are taken as the numbers they are; a mapping
    (whose keys a tuple() would take), a set or a string is refused, as are times
    beyond the solver's bound and a stage count that is no int."""
    good = Costs.uniform(3, size=32).to_dict()
    import numpy as np   # (transformers, a test dependency, needs it)

    costs = Costs(**{**good, "out_bytes": np.array([32, 32, 32]), "fwd_time": np.full(3, 0.5, np.float32)})
    assert costs.out_bytes == (32, 32, 32) and type(costs.out_bytes[0]) is int
    assert costs.fwd_time == (0.5, 0.5, 0.5) and type(costs.fwd_time[0]) is float
    for bad in ({5.0: "a", 6.0: "b", 7.0: "c"}, {1.0, 2.0, 3.0}, "123"):
        with pytest.raises(CostsError, match="fwd_time must be a list with one entry per stage"):
            Costs(**{**good, "fwd_time": bad})
    with pytest.raises(CostsError, match=r"fwd_time\[0\] \(stage 1\) is 1e\+300 seconds, beyond any real run"):
        Costs(**{**good, "fwd_time": [1e300, 1.0, 1.0]})
    for length in (3.5, -1, True):
        with pytest.raises(CostsError, match="Costs.uniform needs a number of stages"):
            Costs.uniform(length)


def test_forward_drops_are_checked_and_optional(tmp_path):
    """fwd_drop is at most out_bytes and 0 for the last stage, fwd_drop_whole 0 or
    fwd_drop; both default to nothing dropped, and a costs file from before them loads."""
    good = Costs.uniform(3, size=10).to_dict()
    for field, values, match in (("fwd_drop", [11, 0, 0], r"fwd_drop\[0\] \(stage 1\) is 11; it must be at most"),
                                 ("fwd_drop", [0, 0, 10], r"fwd_drop\[2\] \(stage 3\) .* 0 for the last stage"),
                                 ("fwd_drop_whole", [0, 5, 0], r"fwd_drop_whole\[1\] \(stage 2\) is 5; it must be 0 or")):
        with pytest.raises(CostsError, match=match):
            Costs(**{**good, **({"fwd_drop": [0, 10, 0]} if field == "fwd_drop_whole" else {}), field: values})
    old = {k: v for k, v in good.items() if not k.startswith("fwd_drop")}
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps({"format": "remat.costs/1", **old}))
    assert Costs.load(path) == Costs(**good) and Costs.load(path).fwd_drop == (0, 0, 0)
    dropping = Costs(**{**good, "fwd_drop": [10, 10, 0], "fwd_drop_whole": [10, 0, 0]})
    dropping.save(tmp_path / "new.json")
    assert Costs.load(tmp_path / "new.json") == dropping
    # storing everything: a^1 goes once Fall(2) has run (it is inside a-bar^1)
    assert simulate(dropping, store_all(3)).peak == simulate(Costs(**good), store_all(3)).peak - 10


def test_costs_file_of_a_wider_model_with_the_same_sizes_is_refused(tmp_path):
    """A costs file from a model whose stages take and return the same sizes but
    save far more or less for the backward (another hidden width): the length,
    input and output sizes agree, yet its saved bytes were 14x off and its schedule
    went over the budget. Now a CostsError names the stage; the file of the same
    model is still taken, and the chain runs once the file is gone."""
    import os

    import torch
    import torch.nn as nn

    import remat

    path = str(tmp_path / "costs.json")

    def model(hidden):
        torch.manual_seed(0)
        return [remat.stage(nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Linear(hidden, 16)))
                for _ in range(3)]

    narrow, wide = model(8), model(256)
    costs_file_step(narrow, path)
    remat.clear_cache()
    costs_file_step(model(8), path)   # the same model: the file is taken
    remat.clear_cache()
    with pytest.raises(CostsError, match=r"stage 1 saves .* this chain's saves"):
        costs_file_step(wide, path)
    assert all(p.grad is None for layer in wide for p in layer.parameters())
    os.remove(path)
    assert costs_file_step(wide, path) is not None


def test_costs_file_with_a_bad_value_names_the_file(tmp_path):
    """A costs file that is valid JSON but holds a bad value (a hand edit, another
    remat's format) is refused with its path and the fix, from ``Costs.load`` and
    from a chain reading it; the chain runs again once the file is gone."""
    import json
    import os

    import torch.nn as nn

    import remat

    path = str(tmp_path / "costs.json")
    layers = [remat.stage(nn.Linear(16, 16)) for _ in range(3)]
    costs_file_step(layers, path)
    with open(path) as fh:
        data = json.load(fh)
    data["saved_bytes"][1] = -7
    with open(path, "w") as fh:
        json.dump(data, fh)
    message = rf"costs file {path}: Costs.saved_bytes\[1\] \(stage 2\) is -7; .*delete the file to measure again"
    with pytest.raises(CostsError, match=message):
        Costs.load(path)
    remat.clear_cache()
    with pytest.raises(CostsError, match=message):
        costs_file_step(layers, path)
    os.remove(path)
    assert costs_file_step(layers, path) is not None


def test_costs_file_that_never_ends_is_refused(tmp_path, monkeypatch):
    """A costs path naming a device that never ends (``/dev/zero``) or a file larger
    than any chain's costs is refused with the limit, not read forever; one just
    under the limit is read (and refused for what it holds)."""
    import os

    from remat.solver import costs as costs_module

    if os.path.exists("/dev/zero"):
        with pytest.raises(CostsError, match=r"/dev/zero is over 64\.00 MiB"):
            Costs.load("/dev/zero")
    monkeypatch.setattr(costs_module, "MAX_FILE_BYTES", 100)
    path = tmp_path / "big.json"
    path.write_text(" " * 101)
    with pytest.raises(CostsError, match="is over 100 B, more than the costs of any chain take"):
        Costs.load(str(path))
    path.write_text(" " * 100)
    with pytest.raises(CostsError, match="is not valid JSON"):
        Costs.load(str(path))


def test_costs_file_with_options_is_planned_without_them(tmp_path):
    """A costs file that lists options (remat.Option) other than those the runtime
    runs is read with a warning that says so; the chain plans without them and
    runs as before."""
    import torch.nn as nn

    import remat
    from remat.solver.option import Option

    path = str(tmp_path / "costs.json")
    layers = [remat.stage(nn.Linear(16, 16)) for _ in range(3)]
    want = costs_file_step(layers, path)
    costs = Costs.load(path)
    keep_less = Option(saved_bytes=costs.out_bytes[0], fwd_time=costs.fwd_time[0], bwd_time=2 * costs.bwd_time[0],
                       fwd_tmp=0, bwd_tmp=0)
    costs.with_options({1: [keep_less]}).save(path)
    remat.clear_cache()
    with pytest.warns(RuntimeWarning, match=r"list options .* other than those remat's runtime runs.* this chain "
                                            r"plans without them"):
        got = costs_file_step(layers, path)
    assert got.equal(want)
    assert not remat.explain().costs.has_options and Costs.load(path).has_options


def test_a_rebuilt_backward_needs_less_where_the_costs_say_so(tmp_path):
    """bwd_rebuilt_less is 0 to bwd_tmp + out_bytes (named when not), optional (costs
    files without it load, and are written without it where it is 0), and simulate
    takes it off B(i)'s transient only where a-bar^i was rebuilt after Loss with its
    base record: per-block checkpointing's B(2) below, not store-all's."""
    good = Costs.uniform(2, size=10, saved=30).to_dict()
    good["bwd_tmp"] = [4, 4]
    with pytest.raises(CostsError, match=r"bwd_rebuilt_less\[1\] \(stage 2\) is 15; it must be at most"):
        Costs(**{**good, "bwd_rebuilt_less": [0, 15]})
    with pytest.raises(SolverError, match=r"bwd_rebuilt_less\[0\] \(stage 1\) is -1"):
        _c_solver._check_costs(types.SimpleNamespace(**{**good, "bwd_rebuilt_less": [-1, 0], "length": 2}))
    plain = Costs(**good)
    assert "bwd_rebuilt_less" not in plain.to_dict() and plain.bwd_rebuilt_less == (0, 0)
    less = Costs(**{**good, "bwd_rebuilt_less": [3, 3]})
    less.save(tmp_path / "less.json")
    assert Costs.load(tmp_path / "less.json") == less and less.bwd_tmp_rebuilt == (1, 1)
    tailed = less.with_tail(1.0, 1.0, 2, 8, 0, 0)
    assert tailed.bwd_rebuilt_less == (3, 3, 0) and tailed.without_tail() == less
    assert simulate(less, store_all(2)) == simulate(plain, store_all(2))
    per_block = (Fck(1), Fall(2), Loss, B(2), Fall(1), B(1))
    trace, plain_trace = [], []
    simulate(less, per_block, trace)
    simulate(plain, per_block, plain_trace)
    assert [d for _, d, _ in trace] == [d - (3 if op == B(1) else 0) for op, d, _ in plain_trace]


def test_an_output_the_caller_holds_counts_once():
    """With output_held, held_bytes counts a^L: held on its own (after Fck(L)) or as
    Fall(L)'s output it takes nothing more, its gradient still x[L]; before, the
    tail's forward counted it twice (a step measured 5% under its prediction)."""
    base = Costs.uniform(2, size=10, saved=30)
    plain = base.with_tail(1.0, 1.0, 0, 50, 40, 0)
    held = Costs(**{**base.to_dict(), "output_held": True, "held_bytes": 10}).with_tail(1.0, 1.0, 0, 50, 40, 0)
    assert held.alone_sizes() == (10, 10, 0, 0) and held.sizes() == (10, 10, 10, 0)
    per_block = (Fck(1), Fck(2), Fall(3), Loss, B(3), Fall(2), B(2), Fall(1), B(1))
    trace, plain_trace = [], []
    simulate(held, per_block, trace)
    simulate(plain, per_block, plain_trace)
    # held_bytes counts a^2 from the start; from Fck(2) on, once, as where the caller lets it go
    assert [d for _, d, _ in trace][:3] == [30, 30, 80] and [d for _, d, _ in plain_trace][:3] == [20, 30, 80]
    assert [m for _, _, m in trace][-1] == 10 + [m for _, _, m in plain_trace][-1]   # (held to the end)
    with pytest.raises(CostsError, match="output_held must be True or False"):
        Costs(**{**base.to_dict(), "output_held": 1})


def test_a_costs_file_is_never_read_half_written(tmp_path):
    """``Costs.save`` writes a file beside the record and renames it over it: a reader
    meanwhile (another job's first call) finds a whole record every time. Before, it
    truncated the file and wrote it, and most reads during a rewrite failed with
    "is not valid JSON ... delete it to measure again"."""
    import threading
    import time

    path = str(tmp_path / "costs.json")
    costs = Costs.uniform(48, time=0.001, size=32768, saved=328704)
    costs.save(path)
    done = threading.Event()

    def write():
        while not done.is_set():
            costs.save(path)

    writer = threading.Thread(target=write)
    writer.start()
    failed, end = 0, time.time() + 1.0
    try:
        while time.time() < end:
            try:
                Costs.load(path)
            except CostsError:
                failed += 1
    finally:
        done.set()
        writer.join()
    assert failed == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["costs.json"]   # (no file left beside it)


@pytest.mark.parametrize("bad", [0, 1, None, 2.5])
def test_a_costs_file_given_as_anything_but_a_path_is_refused(bad, capsys):
    """``Costs.load(1)`` opened file descriptor 1 and closed the process's stdout (every
    print after it raised), ``Costs.load(0)`` waited on stdin: a path is asked for."""
    with pytest.raises(CostsError, match="given by its path"):
        Costs.load(bad)
    with pytest.raises(CostsError, match="given by its path"):
        Costs.uniform(3).save(bad)
    print("stdout is open")
    assert "stdout is open" in capsys.readouterr().out
