"""NoLoCo in a plain PyTorch training loop, through noloco's Python API.

Any model, any data, your own loop: start one process per replica (here 4 on this machine, by
torch.multiprocessing and gloo over loopback; on a cluster, torchrun), wrap the loop with the
method, and the outer steps happen inside ``opt.step()``. No all-reduce is ever issued: every
50 steps each replica averages with one random partner.

    python examples/noloco_loop.py [--replicas 4] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from noloco.comm import TorchCommunicator
from noloco.methods import NoLoCo


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every replica starts from the same weights (NoLoCo requires it)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))


def replica(rank: int, world: int, port: int, steps: int, sync_every: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    method = NoLoCo(model, TorchCommunicator(), sync_every=sync_every, outer_lr=0.7,
                    momentum=0.5, group_size=2)
    method.attach(opt)  # outer steps run inside opt.step()
    g = torch.Generator().manual_seed(1000 + rank)  # each replica its own data
    w_true = torch.linspace(-1, 1, 16)
    for step in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = (x @ w_true).unsqueeze(1) + 0.1 * torch.randn(32, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step + 1) % sync_every == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}, outer steps {method.outer_steps}, "
                  f"partner group {method.last_group}", flush=True)
    if rank == 0:
        print(f"replica 0 sent {method.comm.bytes_sent / 1e3:.1f} kB in "
              f"{method.outer_steps} pair exchanges")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=50)
    a = p.parse_args()
    from noloco.launch import loopback_interface

    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(replica, args=(a.replicas, port, a.steps, a.sync_every), nprocs=a.replicas)


if __name__ == "__main__":
    main()
