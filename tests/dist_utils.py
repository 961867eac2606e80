"""Run a function on several gloo ranks in processes of their own and collect what each
returns.

The rank processes are forked from a *fork server* (Python's ``forkserver`` start method)
that imported torch, its optimizers' compiler front end and noloco once, when this test
process first needed it: a rank then starts in milliseconds instead of the ~2 s of CPU a
fresh interpreter spends importing them (about a hundred ranks a suite). The server runs no
tensor operation and starts no thread pool, so a forked rank is as a fresh one; each rank
gets the environment of the caller at the time of the call, as a spawned one would.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "noloco.train", "noloco.worker",
           "noloco.pipeline", "noloco.methods"]
"""what the fork server imports before it forks any rank (torch._dynamo: the first call into
a torch optimizer imports it)"""
mp.set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
           outdir: str, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(outdir) / f"{rank}.pt")
    finally:
        if dist.is_initialized():  # fn may have ended the group itself (a worker's run)
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes in one gloo group; returns the
    per-rank results.

    ``fn`` must be a module-level function (it is pickled into the rank processes).
    """
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, outdir, dict(os.environ)),
                           nprocs=world, join=True, start_method="forkserver")
        return [torch.load(Path(outdir) / f"{r}.pt", weights_only=False) for r in range(world)]
