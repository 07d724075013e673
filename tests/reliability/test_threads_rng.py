"""remat and the random numbers of other threads (Note [Replaying a stage] 1 in
remat/runtime/replay.py)."""

import torch
import torch.nn as nn

import remat


def test_a_chain_that_draws_nothing_sets_no_generator(monkeypatch):
    """A chain of stages that draw no random numbers, at a budget that recomputes: no
    call, the measuring one included, sets the process's generators, which every
    thread shares (each recomputation and measuring run set them, so another thread
    drawing meanwhile got another stream); a stage with dropout still has its stream
    replayed, and its gradients are plain PyTorch's."""
    torch.manual_seed(0)
    blocks = [remat.stage(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32))) for _ in range(8)]
    x = torch.randn(32, 32)
    sets = []
    real = torch.set_rng_state
    monkeypatch.setattr(torch, "set_rng_state", lambda state: (sets.append(1), real(state))[1])
    import remat.runtime.replay as replay

    monkeypatch.setattr(replay.torch, "set_rng_state", torch.set_rng_state)
    for _ in range(4):
        with remat.chain(budget=150_000):
            h = x
            for b in blocks:
                h = b(h)
        h.sum().backward()
    assert remat.explain().schedule.recomputations() > 0
    assert not sets, f"the generator was set {len(sets)} times"
    # a stage that draws is replayed: dropout's masks in the recomputation are the forward's
    drop = [remat.stage(nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5))) for _ in range(4)]
    plain = [nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5)) for _ in range(4)]
    for p, d in zip(plain, drop):
        p.load_state_dict(d.state_dict())
    for step in range(3):
        torch.manual_seed(step)
        h = x
        for p in plain:
            h = p(h)
        h.sum().backward()
        torch.manual_seed(step)
        with remat.chain(budget=30_000):
            g = x
            for d in drop:
                g = d(g)
        g.sum().backward()
    assert sets and remat.explain().schedule.recomputations() > 0
    for p, d in zip(plain, drop):
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(p.parameters(), d.parameters()))
