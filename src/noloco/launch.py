"""Starting workers.

- On one machine, ``noloco train --replicas N [--stages P]`` starts N·P local workers through
  PyTorch's own elastic launcher (the machinery behind ``torchrun``), rendezvous on a free
  localhost port; gloo on CPU, NCCL on GPUs.
- Across machines, ``torchrun ... -m noloco train ...`` starts the same entry point; the CLI
  sees torchrun's environment (RANK, WORLD_SIZE, ...) and runs as one worker directly.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from noloco.config import Config
from noloco.data import cpu_count


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _worker_entry(cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    from noloco.worker import run
    return run(Config.from_dict(cfg_dict))


def launch_local(cfg: Config) -> dict[str, Any] | None:
    """Run the whole job on this machine; returns rank 0's summary."""
    n = cfg.world_size
    os.environ["NOLOCO_RUNDIR_READY"] = "1"
    if n == 1:
        from noloco.worker import run
        return run(cfg)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Children inherit these before torch starts its thread pools.
    threads = max(1, cpu_count() // n)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"noloco-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
        monitor_interval=0.1, start_method="spawn",
    )
    results = elastic_launch(lc, _worker_entry)(cfg.to_dict())
    return results.get(0)
