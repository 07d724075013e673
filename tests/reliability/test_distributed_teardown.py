"""What remat leaves behind in a DDP run (gloo, two CPU processes): after training,
nothing of remat's keeps the DDP module, its reducer or its parameters alive, it
started no thread, it left no saved-tensor hooks in force, and it sent no collective
with its hooks in force.

Why this matters: a gloo work keeps the thread-local state it was sent in (Python
objects included) and may drop it on gloo's worker thread, which must then take the
GIL; at interpreter exit that thread is killed and the process aborts ("terminate
called without an active exception"). Plain DDP does this too (docs/limitations.md,
"Exit under torch.distributed"); remat must not add to it.
"""

import datetime
import gc
import os
import socket
import threading
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import remat

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

D, STEPS = 16, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    @remat.stage
    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x):
        with remat.chain(budget="1GiB", algorithm="periodic(2)"):
            for block in self.blocks:
                x = block(x)
        return x


def _hooks():
    """The saved-tensor hooks in force on this thread, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _train(rank):
    """STEPS steps of DDP over ``Net``; weak references to what DDP holds, and the
    ``Explanation``'s recomputation count."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x = torch.randn(4, 5, D, generator=torch.Generator().manual_seed(10 * rank + step))
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    refs = {"ddp": weakref.ref(model), "module": weakref.ref(model.module),
            "block": weakref.ref(model.module.blocks[0]), "reducer": weakref.ref(model.reducer),
            "parameter": weakref.ref(next(model.parameters())), "loss": weakref.ref(loss)}
    return refs, remat.explain().schedule.recomputations()


def _worker(rank, port, tmp):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    # remat's collectives (rank 0's costs, remat/measure/costs_source.py): the hooks in force at each
    sent = []
    sends = {name: getattr(dist, name) for name in ("broadcast_object_list", "all_gather_object")}

    def watching(send):
        def watched(*args, **kwargs):
            sent.append(_hooks())
            return send(*args, **kwargs)
        return watched

    for name, send in sends.items():
        setattr(dist, name, watching(send))
    threads = {t.ident for t in threading.enumerate()}
    try:
        refs, recomputations = _train(rank)
    finally:
        for name, send in sends.items():
            setattr(dist, name, send)
    gc.collect()
    out = {"alive": sorted(k for k, r in refs.items() if r() is not None),
           "recomputations": recomputations, "sent": len(sent),
           "sent_under_hooks": sum(h is not None for h in sent), "hooks_after": _hooks() is not None,
           "new_threads": [t.name for t in threading.enumerate() if t.ident not in threads]}
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    # the teardown docs/limitations.md gives: without os._exit about one exit in 20
    # aborts, with remat or without (gloo's worker threads against the interpreter's end)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def teardown(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("teardown")
    # join=True raises ProcessExitedException if a rank fails or is killed before its os._exit
    mp.spawn(_worker, args=(_free_port(), str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def test_nothing_of_ddp_outlives_training(teardown):
    """Once the training function returns, the DDP module, its reducer, its
    parameters and the last loss are freed: remat's records keep none of them."""
    for rank, out in enumerate(teardown):
        assert out["recomputations"] > 0, f"rank {rank}: the chain recomputed nothing"
        assert out["alive"] == [], f"rank {rank}: still alive after training: {out['alive']}"


def test_no_thread_and_no_hooks_left(teardown):
    """remat starts no thread and leaves no saved-tensor hooks in force."""
    for rank, out in enumerate(teardown):
        assert out["new_threads"] == [], f"rank {rank}"
        assert not out["hooks_after"], f"rank {rank}"


def test_collectives_sent_without_remat_hooks(teardown):
    """remat's collectives (rank 0's costs, each rank's sizes) are sent with none of its saved-tensor
    hooks in force (a gloo work would keep them, and free them on its own thread)."""
    for rank, out in enumerate(teardown):
        assert out["sent"] > 0, f"rank {rank}: remat sent no collective"
        assert out["sent_under_hooks"] == 0, f"rank {rank}"
