"""The NCCL path (issue 34 item 5): workers that each own a GPU use "cpu:gloo,cuda:nccl".

It needs two GPUs, and is skipped without them, saying so. What it checks is what gloo
tolerates and NCCL does not (the findings of the NCCL review, docs/results.md): the group's
backends, a point-to-point exchange as a group's first operation, the quantised all-reduce on
its helper thread beside other collectives, a blocked wait counted as blocked and a peer that
never posts raising instead of hanging, and the backend agreed by every rank.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from noloco.comm import _HELPER_JOBS, CommError, TorchCommunicator

pytestmark = [
    pytest.mark.slow("two GPUs and NCCL"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs (the NCCL path: one GPU per worker)"),
]


def _nccl_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from noloco.distributed import Layout, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    lay = Layout(rank=rank, world=world, local_world=world, replica=rank, replicas=world)
    ctx = init_distributed(lay, 20.0, device, attempt=0)
    res: dict = {"backend": str(dist.get_backend_config())}
    # an exchange as the first operation of a fresh group
    comm = TorchCommunicator(list(range(world)), timeout=20.0)
    got = comm.exchange(torch.full((1000,), float(rank), device=device), [1 - rank])[0]
    res["exchange"] = bool(torch.equal(got, torch.full((1000,), float(1 - rank),
                                                       device=device)))
    x = torch.arange(8, dtype=torch.float64, device=device) * (rank + 1)
    comm.all_reduce_mean(x)
    res["mean"] = x.cpu()
    # the quantised all-reduce on the helper thread, then other collectives at once
    q = torch.randn(1 << 16, device=device, generator=torch.Generator(device).manual_seed(rank))
    pending = comm.all_reduce_mean_quantized_async(q, "fp4")
    world_comm = TorchCommunicator(list(range(world)), group=dist.group.WORLD)
    res["gather"] = [int(t) for t in world_comm.all_gather(torch.tensor([rank]))]
    pending.wait()
    res["quantized"] = q.cpu()
    res["helpers_left"] = len([f for f in _HELPER_JOBS if not f.done()])
    # a late peer: the wait is blocked time, not zero
    before = comm.sync_seconds
    if rank == 1:
        time.sleep(2.0)
    comm.all_reduce_mean(torch.ones(4, device=device))
    res["blocked"] = comm.sync_seconds - before
    # a peer that never posts: a CommError, not a hang or an abort
    short = TorchCommunicator(list(range(world)), timeout=5.0)
    short.all_reduce_mean(torch.ones(4, device=device))  # the communicator exists
    if rank == 0:
        t0 = time.perf_counter()
        try:
            short.all_reduce_mean(torch.ones(4, device=device))
            res["timeout"] = "returned"
        except CommError:
            res["timeout"] = time.perf_counter() - t0
    else:
        time.sleep(12.0)
        res["timeout"] = None
    torch.save(res, f"{out}/{rank}.pt")
    # rank 0's NCCL communicator of the timed-out operation is broken: no orderly teardown
    del ctx
    os._exit(0)


@pytest.mark.timeout(180)
def test_the_nccl_path_on_two_gpus(tmp_path) -> None:
    import torch.multiprocessing as mp
    from dist_utils import free_port

    mp.start_processes(_nccl_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    assert "nccl" in r0["backend"] and "gloo" in r0["backend"]
    assert r0["exchange"] and r1["exchange"]
    assert torch.equal(r0["mean"], torch.arange(8, dtype=torch.float64) * 1.5)
    assert r0["gather"] == r1["gather"] == [0, 1]
    assert torch.equal(r0["quantized"], r1["quantized"])  # every rank decodes the same bytes
    assert r0["helpers_left"] == r1["helpers_left"] == 0
    assert r0["blocked"] >= 1.5  # the host waited: the wait counts as blocked
    assert isinstance(r0["timeout"], float) and r0["timeout"] < 15, r0["timeout"]
