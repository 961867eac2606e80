"""noloco's DDP against torch's own DistributedDataParallel, side by side.

Both train the same model (``noloco.model.build`` of ``--preset``, seed 0) on the same
batches (noloco's sharded reader over the same corpus: replica r reads shard r) with N
replicas as N local processes (gloo over loopback, one torch thread each — what noloco gives
N workers on this machine's cores), AdamW with the same settings, gradient clipping at 1.0:

- ``noloco``: ``python -m noloco train --method ddp --replicas N`` (bucketed gradient
  all-reduce started from post-accumulate-grad hooks during backward, as torch's DDP does;
  evaluation only at the end, no checkpoints);
- ``torch``: a bare loop of ``torch.nn.parallel.DistributedDataParallel`` (default buckets:
  25 MiB, the first 1 MiB) around the same model.

Rank 0 of each side marks the time after every optimizer step (noloco: its progress line,
``--log-every 1``, timestamped on arrival; torch: ``perf_counter``); a run's speed is
N · batch · sequence tokens ÷ its median step time (the first steps, which warm up, are
dropped). Runs alternate (noloco first in even repeats), so a shared machine's drift hits both
alike. The comparison is the median over repeats of each repeat's ratio (its two runs are
back to back, so drift between repeats cancels); the ratio of the sides' medians is recorded
too.

Target: noloco ≥ 0.95 × torch DDP's tokens/s at 4 replicas.

    python benchmarks/ddp.py               # the recorded run
    python benchmarks/ddp.py --quick       # smoke run, results in the temp directory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET = 0.95
WARMUP = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="builtin", help="training text (default: built-in corpus)")
    p.add_argument("--preset", default="tiny", help="model preset")
    p.add_argument("--replicas", type=int, default=4, help="replicas N (processes)")
    p.add_argument("--steps", type=int, default=60, help="inner steps per run")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step per replica")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--repeats", type=int, default=5, help="runs of each side (alternating)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 replicas, 8 steps, once")
    p.add_argument("--out-dir", default=None, help="where the JSON and PNG go "
                   "(default: the scratch directory; benchmarks/results with --record)")
    common.add_record_flag(p)
    p.add_argument("--torch-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.steps, a.repeats, a.batch_size, a.seq_len = 2, 8, 1, 4, 64
    if a.replicas < 2 or a.steps <= WARMUP + 2 or a.repeats < 1:
        p.error(f"need --replicas >= 2, --steps > {WARMUP + 2}, --repeats >= 1")
    return a


# ---- torch's DDP: one process per rank -------------------------------------------------------

def torch_rank(a: argparse.Namespace) -> None:
    """One rank of the bare torch DDP loop (started by :func:`run_torch`)."""
    import torch
    import torch.distributed as dist

    from noloco.data import ShardedReader, load_corpus, make_tokenizer
    from noloco.model import build, lm_loss, preset

    rank, n = a.torch_rank, a.replicas
    torch.set_num_threads(common.threads())  # its share: run_torch set OMP_NUM_THREADS
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=n, timeout=timedelta(seconds=300))
    tok = make_tokenizer("bytes")
    corpus = load_corpus(a.data, tok, a.seq_len)
    reader = ShardedReader(corpus.train, a.seq_len, a.batch_size, rank, n, seed=0)
    model = torch.nn.parallel.DistributedDataParallel(
        build(preset(a.preset, vocab_size=tok.vocab_size), seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    marks = []
    for _ in range(a.steps):
        x, y = reader.next_batch()
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
    if rank == 0:
        Path(a.result).write_text(json.dumps({"marks": marks, "loss": loss.item()}))
    dist.destroy_process_group()


def run_torch(a: argparse.Namespace, tmp: Path) -> list[float]:
    from noloco.launch import loopback_interface

    port, result = common.free_port(), tmp / "torch.json"
    env = dict(os.environ, GLOO_SOCKET_IFNAME=loopback_interface(),
               OMP_NUM_THREADS=str(common.threads(a.replicas)))
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--torch-rank", str(r), "--port", str(port),
         "--result", str(result), "--replicas", str(a.replicas), "--steps", str(a.steps),
         "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr),
         "--preset", a.preset, "--data", a.data], env=env) for r in range(a.replicas)]
    if any(p.wait() for p in procs):
        raise RuntimeError("the torch DDP run failed")
    marks = json.loads(result.read_text())["marks"]
    return [b - c for c, b in zip(marks, marks[1:], strict=False)]


# ---- noloco's DDP ------------------------------------------------------------------------------

def run_noloco(a: argparse.Namespace, tmp: Path) -> tuple[list[float], dict[str, Any]]:
    return common.run_noloco_timed(
        ["--method", "ddp", "--replicas", str(a.replicas), "--preset", a.preset,
         "--data", a.data, "--steps", str(a.steps), "--batch-size", str(a.batch_size),
         "--seq-len", str(a.seq_len), "--lr", str(a.lr), "--warmup", "0", "--weight-decay", "0",
         "--grad-clip", "1.0", "--eval-every", str(a.steps), "--eval-sequences", str(a.batch_size),
         "--checkpoint-every", "0", "--device", "cpu", "--seed", "0"], tmp / "noloco")


# ---- the driver ----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.torch_rank is not None:
        torch_rank(a)
        return 0
    json_path, png_path = common.out_paths("ddp", a.out_dir, a.quick, a.record)
    rec = common.start_record("ddp", vars(a))
    t0 = time.perf_counter()
    tokens = a.replicas * a.batch_size * a.seq_len
    runs: dict[str, list[dict[str, Any]]] = {"noloco": [], "torch": []}
    with tempfile.TemporaryDirectory(prefix="noloco-ddp-") as tmp:
        for rep in range(a.repeats):
            for side in (("noloco", "torch") if rep % 2 == 0 else ("torch", "noloco")):
                load = common.load_average()
                if side == "noloco":
                    steps, s = run_noloco(a, Path(tmp))
                    extra = {"bytes_sent_per_replica": s["bytes_sent"],
                             "sync_seconds": s["sync_seconds"],
                             "tokens_per_second_summary": s["tokens_per_second"]}
                else:
                    steps, extra = run_torch(a, Path(tmp)), {}
                timed = steps[WARMUP:]
                runs[side].append({"step_seconds": common.quartiles(timed),
                                   "tokens_per_second": tokens / statistics.median(timed),
                                   "load_average": load, **extra})
                print(f"repeat {rep} {side:>6}: {runs[side][-1]['tokens_per_second']:,.0f} "
                      f"tokens/s", flush=True)
    med = {k: statistics.median(r["tokens_per_second"] for r in v) for k, v in runs.items()}
    paired = [n["tokens_per_second"] / t["tokens_per_second"]
              for n, t in zip(runs["noloco"], runs["torch"], strict=True)]
    ratio = statistics.median(paired)
    results = {"runs": runs, "tokens_per_second": med, "paired_ratios": paired,
               "ratio_noloco_over_torch": ratio,
               "ratio_of_medians": med["noloco"] / med["torch"],
               "target": TARGET, "target_met": ratio >= TARGET}
    common.write_json(json_path, common.finish_record(rec, results, time.perf_counter() - t0))
    drawn = plot(runs, png_path)
    print(f"noloco DDP / torch DDP tokens/s: {ratio:.3f}, median of the paired runs' ratios "
          f"{', '.join(f'{x:.3f}' for x in paired)} (target >= {TARGET}: "
          f"{'met' if ratio >= TARGET else 'MISSED'}); ratio of the medians "
          f"{med['noloco'] / med['torch']:.3f}")
    print(f"wrote {json_path}" + (f" and {drawn}" if drawn else " (no plot: no matplotlib)"))
    return 0


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, (side, rs) in enumerate(runs.items()):
        ys = [r["tokens_per_second"] for r in rs]
        ax.scatter([i] * len(ys), ys, label=side)
        ax.hlines(statistics.median(ys), i - 0.2, i + 0.2, color="k")
    ax.set_xticks(range(len(runs)), [f"{k} DDP" for k in runs])
    ax.set_ylabel("tokens/s (all replicas)")
    ax.set_xlim(-0.6, len(runs) - 0.4)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
