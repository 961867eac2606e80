"""One replica of a library run (tests/test_library.py): a plain loop around a small MLP.

    python library_worker.py PORT REPLICA REPLICAS STEPS OUT [--die-at K] [--hidden H]
        [--seed S] [--method M] [--sync-every H] [--secret-file F] [--step-seconds T]
        [--checkpoint-dir D] [--coordinator etcd://...] [--barrier DIR] [--mark FILE]
        [--hold STEP:FILE] [--at STEP:FILE] [--stop-at K] [--resume] [--run-id ID]
        [--peer-timeout T]

Writes OUT (JSON) at the end: its step, outer steps, joins and final weights."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from noloco.library import RunError, join_run
from noloco.staging import HostStaged


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop's own data order: a function of (replica, step)."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("port", "replica", "replicas", "steps"):
        p.add_argument(name, type=int)
    p.add_argument("out")
    p.add_argument("--die-at", type=int, default=0)
    p.add_argument("--stop-at", type=int, default=0, help="leave the run at step K (the loop "
                   "was stopped: its checkpoint there, then a resume continues it)")
    p.add_argument("--resume", action="store_true", help="join_run(resume=True)")
    p.add_argument("--run-id", default="lib")
    p.add_argument("--peer-timeout", type=float, default=6.0)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", default="diloco")
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--secret-file")
    p.add_argument("--step-seconds", type=float, default=0.0, help="pace the loop")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--coordinator", help="instead of 127.0.0.1:PORT (etcd://...)")
    p.add_argument("--mark", help="FILE: touched when this replica starts, before it joins")
    p.add_argument("--hold", help="STEP:FILE: at STEP, wait until FILE exists (at most 120 s)")
    p.add_argument("--at", help="STEP:FILE: touch FILE once the loop reached STEP")
    p.add_argument("--barrier", help="DIR: after joining, wait until REPLICAS replicas have "
                   "(a file each in DIR): replicas that start together train together, "
                   "however slowly each process starts")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(8, a.hidden), nn.Tanh(), nn.Linear(a.hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if a.mark:
        Path(a.mark).touch()
    try:
        run = join_run(model, opt, coordinator=a.coordinator or f"127.0.0.1:{a.port}",
                       run_id=a.run_id, resume=a.resume,
                       replica=a.replica, replicas=a.replicas, method=a.method,
                       sync_every=a.sync_every, peer_timeout=a.peer_timeout, comm_timeout=30.0,
                       secret_file=a.secret_file, checkpoint_dir=a.checkpoint_dir)
    except RunError as e:
        print(f"refused: {e}", file=sys.stderr, flush=True)
        return 2
    first = run.step
    if a.barrier:
        Path(a.barrier, f"ready-{a.replica}").touch()
        deadline = time.monotonic() + 120
        while (len(list(Path(a.barrier).glob("ready-*"))) < a.replicas
               and time.monotonic() < deadline):
            time.sleep(0.05)
    sent = {}  # step → bytes sent so far
    with run:
        while run.step < (a.stop_at or a.steps):
            x, y = batch(a.replica, run.step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"step {run.step} loss {loss.item():.4f}", flush=True)
            sent[run.step] = run.bytes_sent
            time.sleep(a.step_seconds)
            if a.at and run.step == int(a.at.split(":")[0]):
                Path(a.at.split(":", 1)[1]).touch()
            if a.hold and run.step == int(a.hold.split(":")[0]):
                deadline = time.monotonic() + 120
                while not Path(a.hold.split(":", 1)[1]).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if a.die_at and run.step == a.die_at:
                # The checkpoint written in the background finished first: a restart's tests
                # then know which step is on disk (a kill during a write is checkpoint
                # tests' business: a torn write is never taken).
                run.ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    with open(a.out, "w") as f:
        json.dump({"replica": a.replica, "step": run.step, "first_step": first,
                   "bytes_sent": run.bytes_sent, "staged": isinstance(run.comm, HostStaged),
                   "outer_steps": run.outer_steps, "joins": run.joins,
                   "resumed_from": run.resumed_from, "epoch": run.ns.epoch,
                   # the elastic machinery's own records (not the handle's API)
                   "outages": run.membership.outages, "events": run.comm.events,
                   "bytes_by_step": sent,
                   "weights": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
