"""Run a function on several gloo ranks in fresh processes and collect what each returns."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
           outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from datetime import timedelta
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(outdir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the per-rank results.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    """
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_entry, args=(world, free_port(), fn, args, outdir), nprocs=world, join=True)
        return [torch.load(Path(outdir) / f"{r}.pt", weights_only=False) for r in range(world)]
