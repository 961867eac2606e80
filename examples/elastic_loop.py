"""Fault tolerance in a plain training loop: four local processes, one killed and started again.

Each process is one replica of an elastic DiLoCo run around its own model, optimizer and loop
(``noloco.library.join_run``). This script hosts the run's store (what ``noloco coordinator``
serves across machines) with a fresh run secret, starts the four replicas, kills one with
SIGKILL partway, and starts it again as a launcher (torchrun, Slurm, Kubernetes) would: it
takes a live replica's state inside ``join_run`` and trains on with the others. At the end it
says where the restarted replica rejoined and whether every replica ended on the same
weights (DiLoCo's outer step leaves them equal).

    python examples/elastic_loop.py [--steps 60] [--kill-at 15] [--sync-every 5]
        [--step-seconds 0.2] [--device cpu|cuda]

With ``--device cuda`` the four replicas share the GPU (the first), and their tensors reach
the run through pinned host buffers (an elastic run's traffic is gloo's).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPLICAS = 4


def replica_main(port: int, replica: int, steps: int, sync_every: int, out: str,
                 step_seconds: float, device: str) -> int:
    """One replica: an ordinary loop; the run happens inside ``optimizer.step()``."""
    from noloco.library import RunError, join_run

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every replica starts from the same weights
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        run = join_run(model, optimizer, coordinator=f"127.0.0.1:{port}", run_id="example",
                       replica=replica, replicas=REPLICAS, method="diloco",
                       sync_every=sync_every, peer_timeout=3.0)
    except RunError as e:
        print(e, file=sys.stderr)
        return 2
    started_at = run.step
    with run:
        while run.step < steps:
            # the loop's own data order, keyed by the run's step (a joiner's is its donor's)
            g = torch.Generator().manual_seed(10_000 * replica + run.step)
            x = torch.randn(32, 16, generator=g).to(device)
            y = (x[:, :4].sum(1, keepdim=True)).tanh()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"step {run.step} loss {loss.item():.4f}", flush=True)
            time.sleep(step_seconds)  # (a real step takes longer: time for the restart)
    Path(out).write_text(json.dumps({
        "started_at": started_at, "step": run.step, "outer_steps": run.outer_steps,
        "device": str(next(model.parameters()).device), "bytes_sent": run.bytes_sent,
        "joins": run.joins, "loss": loss.item(),
        "weights": [p.detach().flatten().tolist() for p in model.parameters()]}))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=15, help="kill replica 2 after this step")
    p.add_argument("--sync-every", type=int, default=5, help="DiLoCo's H")
    p.add_argument("--step-seconds", type=float, default=0.2,
                   help="each replica's step takes at least this long (the toy model's would "
                   "take milliseconds: the others would finish before the restart)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where every replica's model trains (cuda: all on the first GPU)")
    p.add_argument("--replica", nargs=4, help=argparse.SUPPRESS)  # (a replica process)
    a = p.parse_args()
    if a.replica:
        port, replica, out, _ = a.replica
        return replica_main(int(port), int(replica), a.steps, a.sync_every, out,
                            a.step_seconds, a.device)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible to torch")

    from noloco.elastic.host import Host

    secret = secrets.token_hex(32)
    host = Host("127.0.0.1", 0, secret=secret.encode())
    env = {**os.environ, "NOLOCO_SECRET": secret, "OMP_NUM_THREADS": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    tmp = Path(tempfile.mkdtemp(prefix="noloco-elastic-loop-"))

    def start(r: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, __file__, "--steps", str(a.steps), "--sync-every",
             str(a.sync_every), "--step-seconds", str(a.step_seconds), "--device", a.device,
             "--replica",
             str(host.port), str(r), str(tmp / f"{r}.json"), "x"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    try:
        procs = {r: start(r) for r in range(REPLICAS)}
        victim = procs[2]
        assert victim.stdout is not None
        for line in victim.stdout:  # until it reports the step to die at (or one past it:
            # a process that started late took a live state at a later step)
            if line.startswith("step ") and int(line.split()[1]) >= a.kill_at:
                victim.send_signal(signal.SIGKILL)
                break
        victim.wait()
        print(f"replica 2 killed (SIGKILL) after step {a.kill_at}; starting it again")
        procs[2] = start(2)
        failed = []
        for r, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                failed.append(r)
                print(f"replica {r} failed ({proc.returncode}): {err.strip()[-500:]}",
                      file=sys.stderr)
        if failed:
            return 1
        res = {r: json.loads((tmp / f"{r}.json").read_text()) for r in procs}
        joined = [j for j in res[2]["joins"] if j["kind"] == "joined"]
        if joined:
            j = joined[-1]
            print(f"replica 2 rejoined at step {j['step']} with the state of replica "
                  f"{j['from']}")
        same = all(x["weights"] == res[0]["weights"] for x in res.values())
        for r, x in res.items():
            print(f"replica {r}: {x['step']} steps, {x['outer_steps']} outer steps, "
                  f"{x['bytes_sent']:,} bytes sent, last loss {x['loss']:.4f} on {x['device']}")
        print(f"all {REPLICAS} replicas finished {a.steps} steps; "
              f"{'the same weights on every replica' if same else 'their weights differ'}")
        return 0 if same and joined else 1
    finally:
        for proc in locals().get("procs", {}).values():
            if proc.poll() is None:
                proc.kill()
        host.stop()


if __name__ == "__main__":
    sys.exit(main())
