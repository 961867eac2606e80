"""Throughput and peak memory of ``noloco train --method single`` against a bare PyTorch loop.

Both sides train the same model (``noloco.model.build`` of the same preset, seed 0) on the same
text (byte tokens of ``--data``) with the same batch size, sequence length, AdamW settings and
gradient clipping, each in its own fresh process, in alternating order (noloco first in even
repeats, the bare loop first in odd ones) so slow drift of a shared machine hits both alike.

- noloco runs through the real command line (``python -m noloco train --method single ...``);
  its tokens/s is ``tokens_per_second`` of its summary.json: steps × tokens per step ÷ the
  seconds of its training loop, evaluations excluded.
- the bare loop is timed the same way: steps × tokens per step ÷ the seconds of its loop
  (random contiguous windows of the token stream, forward, cross-entropy, backward, clip,
  AdamW step, zero_grad — nothing else).
- peak memory is each process's maximum resident set size (``ru_maxrss`` from ``wait4``).

Targets: noloco ≥ 0.95 × the bare loop's tokens/s and ≤ 1.1 × its peak memory.

    python benchmarks/throughput.py                 # the recorded run
    python benchmarks/throughput.py --quick         # smoke run, results in the temp directory
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET_SPEED = 0.95
TARGET_MEMORY = 1.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(common.DEFAULT_DATA), help="training text file")
    p.add_argument("--preset", default="tiny", help="model preset (noloco.model.PRESETS)")
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--repeats", type=int, default=5, help="runs of each side (alternating)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of the bare loop (0: all cores, as noloco single uses)")
    p.add_argument("--cpus", type=int, default=0,
                   help="pin both sides to this many CPUs (0: all; noloco then uses as many "
                   "threads, and so does the bare loop); 1 is steadier on a busy machine")
    p.add_argument("--profile", action="store_true",
                   help="also run noloco once under cProfile and record its top functions")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait up to this long for the load average to drop "
                   "below the core count (the machine may be shared)")
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, one repeat")
    p.add_argument("--out-dir", default=None, help="where the JSON and PNG go "
                   "(default benchmarks/results; --quick: the temporary directory)")
    p.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.repeats = min(a.steps, 8), 1
    for name in ("steps", "batch_size", "seq_len", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= a.cpus <= common.cores():
        p.error(f"--cpus must lie in 0..{common.cores()}")
    if not a.bare_worker and not Path(a.data).is_file():
        p.error(f"data file not found: {a.data}")
    return a


# ---- the bare loop (runs in its own process) -----------------------------------------------

def bare_worker(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from noloco.model import build, preset

    torch.set_num_threads(a.threads or common.cores())
    torch.set_num_interop_threads(1)
    raw = np.frombuffer(Path(a.data).read_bytes(), dtype=np.uint8)
    tokens = torch.from_numpy(raw.astype(np.int64))
    model = build(preset(a.preset, vocab_size=257), seed=0)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(a.seq_len + 1)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        starts = torch.randint(len(tokens) - a.seq_len - 1, (a.batch_size, 1), generator=gen)
        rows = tokens[starts + offsets]
        x, y = rows[:, :-1], rows[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    print(json.dumps({"loop_seconds": seconds, "final_loss": loss.item(),
                      "tokens_per_second": a.steps * a.batch_size * a.seq_len / seconds,
                      "threads": torch.get_num_threads()}))


# ---- the driver ----------------------------------------------------------------------------

def run_child(cmd: list[str], cpus: int = 0) -> tuple[str, float, int, float]:
    """Run ``cmd`` (on the first ``cpus`` allowed CPUs if > 0); its stdout, wall seconds, peak
    RSS in bytes and CPU seconds (that child only: ``wait4`` reports the resources of the one
    process it reaps)."""
    pin = None
    if cpus:
        allowed = sorted(os.sched_getaffinity(0))[:cpus]

        def pin() -> None:
            os.sched_setaffinity(0, allowed)

    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, preexec_fn=pin)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return stdout, wall, usage.ru_maxrss * 1024, cpu  # Linux reports ru_maxrss in KiB


def noloco_cmd(a: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "noloco", "train", "--method", "single",
            "--preset", a.preset, "--data", a.data, "--steps", str(a.steps),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
            "--lr", str(a.lr), "--warmup", "0", "--weight-decay", "0", "--grad-clip", "1.0",
            "--eval-every", str(a.steps), "--eval-batches", "1", "--seed", "0",
            "--device", "cpu", "--out", str(out), "--overwrite"]


def bare_cmd(a: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--bare-worker",
            "--preset", a.preset, "--data", a.data, "--steps", str(a.steps),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
            "--lr", str(a.lr), "--threads", str(a.threads)]


def run_noloco(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / "run"
    _, wall, rss, cpu = run_child(noloco_cmd(a, out), a.cpus)
    s = json.loads((out / "summary.json").read_text())
    return {"tokens_per_second": s["tokens_per_second"], "loop_seconds": s["train_seconds"],
            "process_seconds": wall, "process_cpu_seconds": cpu, "peak_rss_bytes": rss,
            "final_loss": s["final_val_loss"], "threads": s["threads_per_worker"]}


def run_bare(a: argparse.Namespace) -> dict[str, Any]:
    stdout, wall, rss, cpu = run_child(bare_cmd(a), a.cpus)
    r = json.loads(stdout.strip().splitlines()[-1])
    r.update(process_seconds=wall, process_cpu_seconds=cpu, peak_rss_bytes=rss)
    return r


def profile_noloco(a: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """cProfile one noloco run; the functions with the most own time."""
    import pstats

    prof = tmp / "noloco.prof"
    cmd = noloco_cmd(a, tmp / "prof_run")
    run_child([cmd[0], "-m", "cProfile", "-o", str(prof), *cmd[1:]], a.cpus)
    st = pstats.Stats(str(prof))
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in st.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls": ncalls,
                     "own_seconds": round(tottime, 4), "cumulative_seconds": round(cumtime, 4)})
    rows.sort(key=lambda r: -r["own_seconds"])
    return rows[:25]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tokens_per_second": common.quartiles([r["tokens_per_second"] for r in runs]),
        "peak_rss_mib": common.quartiles([r["peak_rss_bytes"] / 2**20 for r in runs]),
        "process_seconds": common.quartiles([r["process_seconds"] for r in runs]),
        "process_cpu_seconds": common.quartiles([r["process_cpu_seconds"] for r in runs]),
    }


def plot(res: dict[str, Any], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    sides = ("bare", "noloco")
    for ax, key, scale, label in ((axes[0], "tokens_per_second", 1.0, "tokens / s"),
                                  (axes[1], "peak_rss_bytes", 2**-20, "peak RSS (MiB)")):
        for i, side in enumerate(sides):
            vals = [r[key] * scale for r in res["runs"][side]]
            ax.bar(i, statistics.median(vals), color=("tab:gray", "tab:blue")[i], alpha=0.6)
            ax.scatter([i] * len(vals), vals, color="k", s=12, zorder=3)
        ax.set_xticks(range(len(sides)), ["bare PyTorch loop", "noloco train --method single"])
        ax.set_ylabel(label)
    axes[0].set_title(f"throughput: ratio {res['speed_ratio']:.3f} (target >= {TARGET_SPEED})")
    axes[1].set_title(f"memory: ratio {res['memory_ratio']:.3f} (target <= {TARGET_MEMORY})")
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.bare_worker:
        bare_worker(a)
        return 0
    json_path, png_path = common.out_paths("throughput", a.out_dir, a.quick)
    config = {k: v for k, v in vars(a).items() if k not in ("bare_worker", "out_dir")}
    config["tokens_per_step"] = a.batch_size * a.seq_len
    rec = common.start_record("throughput", config)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {"noloco": [], "bare": []}
    order_log = []
    with tempfile.TemporaryDirectory(prefix="noloco-throughput-") as tmpd:
        tmp = Path(tmpd)
        for r in range(a.repeats):
            order = ("noloco", "bare") if r % 2 == 0 else ("bare", "noloco")
            for side in order:
                load = common.wait_for_quiet(a.wait_quiet) if a.wait_quiet else None
                load = load or common.load_average()
                res = run_noloco(a, tmp) if side == "noloco" else run_bare(a)
                res.update(repeat=r, load_average_before=load)
                runs[side].append(res)
                order_log.append(side)
                print(f"repeat {r} {side:>6}: {res['tokens_per_second']:8.0f} tok/s, "
                      f"peak RSS {res['peak_rss_bytes'] / 2**20:6.0f} MiB", flush=True)
        profile = profile_noloco(a, tmp) if a.profile else None
    stats = {side: summarise(rs) for side, rs in runs.items()}
    speed = (stats["noloco"]["tokens_per_second"]["median"]
             / stats["bare"]["tokens_per_second"]["median"])
    memory = stats["noloco"]["peak_rss_mib"]["median"] / stats["bare"]["peak_rss_mib"]["median"]
    # Per-repeat ratios (same repeat = adjacent in time) show how much the machine drifted.
    pair = [n["tokens_per_second"] / b["tokens_per_second"]
            for n, b in zip(runs["noloco"], runs["bare"], strict=True)]
    results = {
        "runs": runs, "order": order_log, "stats": stats,
        "speed_ratio": speed, "memory_ratio": memory,
        "speed_ratio_per_repeat": common.quartiles(pair),
        "targets": {"speed_ratio_min": TARGET_SPEED, "memory_ratio_max": TARGET_MEMORY},
        "speed_target_met": speed >= TARGET_SPEED, "memory_target_met": memory <= TARGET_MEMORY,
        "profile_noloco_top_own_time": profile,
    }
    common.write_json(json_path, common.finish_record(rec, results, time.perf_counter() - t0))
    plot(results, png_path)
    print(f"noloco / bare: tokens/s {speed:.3f} (target >= {TARGET_SPEED}: "
          f"{'met' if speed >= TARGET_SPEED else 'MISSED'}), peak memory {memory:.3f} "
          f"(target <= {TARGET_MEMORY}: {'met' if memory <= TARGET_MEMORY else 'MISSED'})")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
