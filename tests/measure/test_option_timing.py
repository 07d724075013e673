"""Timing an option's rebuild (``timed_rebuild``, remat/measure/timing.py: on CUDA,
Note [Measuring an option] 3 in remat/measure/options.py) and the option times
made of it (``stage_options``). The timing runs on CPU here; on CUDA it is what
a measuring call uses in place of the cheap ops' share of the forward."""

import types

import torch
import torch.nn as nn

from remat.measure.options import KeptSeen, stage_options
from remat.measure.timing import timed_rebuild
from remat.runtime.replay import capture_rng
from remat.runtime.stage_call import StageCall


class _Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc, self.out, self.norm = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.BatchNorm1d(d)

    def forward(self, x):
        h = nn.functional.dropout(nn.functional.gelu(self.fc(x)), 0.3)
        return x + self.norm(self.out(h))


def test_timed_rebuild_leaves_state_rng_and_gradients_as_they_were():
    """Two forwards and two rebuilds run, and afterwards the BatchNorm statistics, the
    RNG stream and the parameters' gradients are as before; the rebuild hands back the
    cached matmul outputs, so it is timed below a recording forward's work."""
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(64, 16, requires_grad=True)
    call = StageCall(1, "block", block, (x,), {}, 0, None, True)
    stats = [t.clone() for t in (block.norm.running_mean, block.norm.running_var, block.norm.num_batches_tracked)]
    rng = torch.get_rng_state()
    seconds = timed_rebuild(call, x, False, capture_rng(), [block.norm.running_mean, block.norm.running_var,
                                                            block.norm.num_batches_tracked])
    assert seconds is not None and seconds > 0
    assert all(torch.equal(a, b) for a, b in zip(stats, (block.norm.running_mean, block.norm.running_var,
                                                           block.norm.num_batches_tracked)))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in block.parameters()) and x.grad is None


def test_timed_rebuild_that_fails_leaves_the_estimate():
    """A stage whose forward raises on its second run gives None: the share stands."""
    runs = []

    def flaky(x):
        runs.append(1)
        if len(runs) > 1:
            raise RuntimeError("second run")
        return x @ x.t()

    x = torch.randn(4, 4, requires_grad=True)
    assert timed_rebuild(StageCall(1, "flaky", flaky, (x,), {}, 0, None, True), x, False, capture_rng(), []) is None


def _costs(seen):
    return types.SimpleNamespace(kept=seen, backward_measured=True, fwd_tmp=100, out_bytes=10, out_freed=0,
                                 fwd_time=2.0, bwd_time=3.0, bwd_tmp=50, saved_bytes=400)


def test_option_times_take_a_timed_rebuild_where_there_is_one():
    """Option 1's bwd_time is the base's plus the timed rebuild, option 2's plus the
    share of the kept ops it makes again besides; without one, the share estimate."""
    seen = KeptSeen(kept=100, kept_saved=60, any_kept=True, written=0, ops=0, cheap_share=0.5,
                    unsaved_share=0.25, rebuild=(120, 140), out_kept=False, forward=150)
    (one, two), _ = stage_options(_costs(seen), 10)
    assert one.bwd_time == 3.0 + 0.5 * 2.0 and two.bwd_time == 3.0 + 0.75 * 2.0
    (one, two), _ = stage_options(_costs(seen._replace(rebuild_seconds=0.2)), 10)
    assert one.bwd_time == 3.0 + 0.2 and two.bwd_time == 3.0 + 0.2 + 0.25 * 2.0
