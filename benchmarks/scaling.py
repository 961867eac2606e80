"""How the methods scale with the number of replicas N, simulated (``noloco simulate``).

The study of issue 35: NoLoCo, DiLoCo, SparseLoCo and DDP at N = 4, 16, 64 replicas of the
tiny preset, with the same global batch per step at every N (``--global-batch`` sequences,
so each replica's batch is global/N) and the same number of inner steps and H, so every run
computes the same tokens in all and differs only in how the replicas are split and kept
together. Per run: the final validation loss (mean over replicas), the weight spread, the
bytes per replica, the wall-clock; per seed and N, each method's loss gap to DDP. A churn
row: NoLoCo and DiLoCo at the largest N with ``--churn``.

With ``--speed``, the targets of issue 35 measured side by side on this machine: the same
16-replica run simulated and as 16 processes (wall ratio, target ≤ 1/3); 64 replicas for
500 steps (target ≤ 30 minutes); and peak memory per replica against its weights, AdamW
state and outer state (target ≤ 1.2×; measured as what one more replica adds to a run's
peak RSS, with glibc's heap as it is and with its fragmentation taken out). Beside the
speed ratio, both sides' model FLOP rates and a plain matmul's on this machine.

    python benchmarks/scaling.py --record             # the study, 3 seeds, and --speed
    python benchmarks/scaling.py --seeds 0            # one seed
    python benchmarks/scaling.py --quick              # smoke run (N = 2, 4; a few steps)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

METHODS = ("noloco", "diloco", "sparseloco", "ddp")
COLORS = {"ddp": "tab:gray", "diloco": "tab:red", "noloco": "tab:blue",
          "sparseloco": "tab:green"}
TARGET_SPEED_RATIO = 1 / 3
TARGET_N64_MINUTES = 30.0
TARGET_MEMORY_RATIO = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="4,16,64", help="the N to run, comma-separated")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=20, help="H of every method")
    p.add_argument("--global-batch", type=int, default=64,
                   help="sequences per inner step over all replicas (each: global/N)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-sequences", type=int, default=64)
    p.add_argument("--churn", type=float, default=0.1,
                   help="the churn row's rate at the largest N (0: no churn row)")
    p.add_argument("--data", default=str(common.DEFAULT_DATA))
    p.add_argument("--speed", action="store_true", help="also measure the speed and memory "
                   "targets (16 processes against 16 simulated; 64 replicas x 500 steps)")
    p.add_argument("--quick", action="store_true", help="smoke run: N = 2, 4, a few steps")
    common.add_record_flag(p)
    p.add_argument("--out-dir", help="where the JSON and PNG go (default: see --record)")
    p.add_argument("--runs-dir", help="keep the run directories here")
    a = p.parse_args(argv)
    if a.record:  # the committed record holds the targets too
        a.speed = True
    if a.quick:
        a.replicas, a.seeds, a.steps, a.sync_every = "2,4", "0", 8, 4
        a.global_batch, a.seq_len, a.eval_every, a.eval_sequences, a.warmup = 8, 32, 8, 8, 2
    a.replica_counts = [int(x) for x in a.replicas.split(",")]
    a.method_list = a.methods.split(",")
    a.seed_list = [int(x) for x in a.seeds.split(",")]
    bad = [n for n in a.replica_counts if n < 1 or a.global_batch % n]
    if bad:
        p.error(f"--global-batch {a.global_batch} must be divisible by every N (not {bad})")
    unknown = set(a.method_list) - set(METHODS)
    if unknown:
        p.error(f"unknown method(s) {sorted(unknown)}: choose from {', '.join(METHODS)}")
    return a


def run_measured(cmd: list[str], name: str, env: dict[str, str] | None = None
                 ) -> tuple[float, int]:
    """Run ``cmd`` to its end: (wall seconds, its peak RSS in bytes, from wait4)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{name} failed ({code}):\n{err[-3000:]}")
    return wall, usage.ru_maxrss * 1024


def simulate_cmd(a: argparse.Namespace, out: Path, method: str, n: int, seed: int,
                 steps: int | None = None, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "noloco", "simulate", *common.flags(
        method=method, replicas=n, preset="tiny", data=a.data, steps=steps or a.steps,
        batch_size=a.global_batch // n, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
        eval_every=a.eval_every, eval_sequences=a.eval_sequences, seed=seed,
        log_every=0, device="cpu", out=str(out)),
        *([] if method == "ddp" else ["--sync-every", str(a.sync_every)]), *extra]


def one_run(a: argparse.Namespace, runs: Path, method: str, n: int, seed: int,
            extra: list[str] = (), tag: str = "") -> dict[str, Any]:
    out = runs / f"{method}-n{n}-s{seed}{tag}"
    cmd = simulate_cmd(a, out, method, n, seed, extra=extra)
    wall, rss = run_measured(cmd, out.name)
    s = common.read_summary(out)
    curve = common.read_jsonl(out / "metrics.jsonl")
    print(f"  {out.name}: val {s['final_val_loss']:.4f}  spread {s['weight_spread']:.2e}  "
          f"{s['bytes_sent'] / 1e6:.1f} MB/replica  {wall:.0f} s", flush=True)
    return {
        "method": method, "replicas": n, "seed": seed, "batch_per_replica": a.global_batch // n,
        "command": " ".join(cmd[2:]), "final_val_loss": s["final_val_loss"],
        "weight_spread": s["weight_spread"], "bytes_sent_per_replica": s["bytes_sent"],
        "outer_steps": s["outer_steps"], "process_seconds": wall, "peak_rss_bytes": rss,
        "params": s["params"], "churn": s.get("churn") and {
            k: s["churn"][k] for k in ("rate", "left", "joined")},
        "curve": [{k: m.get(k) for k in ("step", "val_loss", "weight_spread", "bytes_sent",
                                         "replicas_in_run")} for m in curve],
    }


def gaps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's loss gap to DDP of the same N and seed (relative)."""
    ddp = {(r["replicas"], r["seed"]): r["final_val_loss"] for r in runs
           if r["method"] == "ddp" and not r.get("churn")}
    out = []
    for r in runs:
        ref = ddp.get((r["replicas"], r["seed"]))
        if r["method"] != "ddp" and ref:
            out.append({"method": r["method"], "replicas": r["replicas"], "seed": r["seed"],
                        "churn": bool(r.get("churn")),
                        "gap_to_ddp": r["final_val_loss"] / ref - 1})
    return out


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and spread over the seeds, per method and N (churn rows apart)."""
    import statistics

    rows: dict[tuple[str, int, bool], list[dict[str, Any]]] = {}
    for r in runs:
        rows.setdefault((r["method"], r["replicas"], bool(r.get("churn"))), []).append(r)
    out = []
    for (method, n, churned), rs in sorted(rows.items()):
        losses = [r["final_val_loss"] for r in rs]
        out.append({"method": method, "replicas": n, "churn": churned, "seeds": len(rs),
                    "val_loss_mean": statistics.fmean(losses),
                    "val_loss_sd": statistics.stdev(losses) if len(rs) > 1 else 0.0,
                    "weight_spread_mean": statistics.fmean(r["weight_spread"] for r in rs),
                    "bytes_sent_per_replica": rs[0]["bytes_sent_per_replica"]})
    return out


def speed(a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """The three targets, side by side on this machine."""
    n, steps = (4, 8) if a.quick else (16, 200)
    sim = runs / "speed-sim"
    sim_wall, _ = run_measured(simulate_cmd(a, sim, "noloco", n, 0, steps=steps), "speed-sim")
    proc = runs / "speed-processes"
    cmd = simulate_cmd(a, proc, "noloco", n, 0, steps=steps)
    cmd[3] = "train"
    proc_wall, _ = run_measured(cmd, "speed-processes")
    same = common.read_summary(sim)["final_val_loss"] - common.read_summary(proc)[
        "final_val_loss"]
    big_n, big_steps = (8, 10) if a.quick else (64, 500)
    big = runs / "speed-n64"
    big_wall, _ = run_measured(
        simulate_cmd(a, big, "diloco", big_n, 0, steps=big_steps), "speed-n64")
    mem = memory(a, runs, big_n)
    # Both runs do the same arithmetic: their model FLOP rates (6 · parameters · tokens, the
    # attention's own left out) against what a plain matmul reaches here say how much a
    # batched step could still gain.
    params = common.read_summary(sim)["params"]
    flops = 6 * params * steps * a.global_batch * a.seq_len
    peak = matmul_flops()
    print(f"  speed: {n} simulated {sim_wall:.0f} s, as processes {proc_wall:.0f} s "
          f"({flops / sim_wall / 1e9:.0f} and {flops / proc_wall / 1e9:.0f} GFLOP/s; a matmul "
          f"here: {peak / 1e9:.0f}); {big_n} x {big_steps} steps {big_wall / 60:.1f} min; "
          f"{mem['memory_per_replica_bytes'] / 2**20:.1f} MiB per replica "
          f"({mem['memory_per_replica_live_bytes'] / 2**20:.1f} live) against "
          f"{mem['state_per_replica_bytes'] / 2**20:.1f} MiB of state", flush=True)
    return {
        "replicas": n, "steps": steps, "simulated_seconds": sim_wall,
        "processes_seconds": proc_wall, "ratio": sim_wall / proc_wall,
        "final_val_loss_difference": same,
        "model_flops": flops, "simulated_flops_per_second": flops / sim_wall,
        "processes_flops_per_second": flops / proc_wall, "matmul_flops_per_second": peak,
        "big_replicas": big_n, "big_steps": big_steps, "big_seconds": big_wall,
        "big_batch_per_replica": a.global_batch // big_n,
        **mem,
    }


def memory(a: argparse.Namespace, runs: Path, big_n: int) -> dict[str, Any]:
    """Peak memory per replica: the peak RSS of a DiLoCo run of ``big_n`` replicas less that
    of the same run with 8 (batch 1 each, 3 outer steps), over the replicas between — what
    one more replica costs, without the process's own (Python, torch, the corpus). Once with
    glibc's allocator as it is, and once with every block above 128 KiB mapped on its own
    (``MALLOC_MMAP_THRESHOLD_``), whose peak follows the live tensors: the difference is
    what the heap's fragmentation keeps."""
    small_n, steps = (2, 6) if a.quick else (8, 3 * a.sync_every)
    peaks: dict[tuple[str, int], int] = {}
    for how, env in (("default", {}), ("live", {"MALLOC_MMAP_THRESHOLD_": "131072"})):
        for n in (small_n, big_n):
            out = runs / f"memory-{how}-n{n}"
            cmd = simulate_cmd(a, out, "diloco", n, 0, steps=steps,
                               extra=["--batch-size", "1", "--eval-every", str(steps)])
            _, peaks[how, n] = run_measured(cmd, out.name, env=env)
    params = common.read_summary(runs / f"memory-default-n{big_n}")["params"]
    state = params * 4 * (1 + 2 + 2)  # weights, AdamW's moments, φ and momentum
    per = (peaks["default", big_n] - peaks["default", small_n]) / (big_n - small_n)
    live = (peaks["live", big_n] - peaks["live", small_n]) / (big_n - small_n)
    return {
        "memory_replicas": [small_n, big_n], "memory_steps": steps,
        "peak_rss_bytes": {f"{how} n{n}": v for (how, n), v in peaks.items()},
        "memory_per_replica_bytes": per, "memory_per_replica_live_bytes": live,
        "gradients_per_replica_bytes": params * 4,
        "state_per_replica_bytes": state,
        "memory_ratio": per / state, "memory_ratio_live": live / state,
    }


def matmul_flops() -> float:
    """FLOP/s of a 512² fp32 matmul in this process (the torch threads a run has)."""
    import torch

    x = torch.randn(512, 512)
    for _ in range(3):
        x @ x
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        x @ x
        reps += 1
    return 2 * 512**3 * reps / (time.perf_counter() - t0)


def judge(speed_rec: dict[str, Any] | None) -> dict[str, Any]:
    if speed_rec is None:
        return {}
    return {
        "speed_ratio": speed_rec["ratio"],
        "speed_ratio_le_one_third": speed_rec["ratio"] <= TARGET_SPEED_RATIO,
        "n64_500_steps_minutes": speed_rec["big_seconds"] / 60,
        "n64_500_steps_le_30_min": speed_rec["big_seconds"] / 60 <= TARGET_N64_MINUTES,
        "memory_ratio": speed_rec["memory_ratio"],
        "memory_ratio_le_1_2": speed_rec["memory_ratio"] <= TARGET_MEMORY_RATIO,
        "memory_ratio_live": speed_rec["memory_ratio_live"],
        "memory_ratio_live_le_1_2": speed_rec["memory_ratio_live"] <= TARGET_MEMORY_RATIO,
    }


def plot(rows: list[dict[str, Any]], png: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method and not r["churn"]]
        if not mine:
            continue
        ns = [r["replicas"] for r in mine]
        ax1.errorbar(ns, [r["val_loss_mean"] for r in mine], [r["val_loss_sd"] for r in mine],
                     marker="o", capsize=3, color=COLORS[method], label=method)
        if method != "ddp":
            ax2.plot(ns, [r["weight_spread_mean"] for r in mine], "o-", color=COLORS[method],
                     label=method)
        churned = [r for r in rows if r["method"] == method and r["churn"]]
        for r in churned:
            ax1.plot([r["replicas"]], [r["val_loss_mean"]], "x", ms=9, color=COLORS[method],
                     label=f"{method}, churn")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas N (same global batch)")
        ax.legend(fontsize=8)
    ax1.set_ylabel("final validation loss (mean over replicas)")
    ax2.set_ylabel("weight spread")
    ax2.set_yscale("log")
    fig.suptitle("noloco simulate: the methods against N (tiny preset)")
    return common.save_figure(fig, png)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    json_path, png_path = common.out_paths("scaling", a.out_dir, a.quick, a.record)
    rec = common.start_record("scaling", common.config_of(a, ("out_dir", "runs_dir",
                                                               "replica_counts",
                                                               "method_list", "seed_list")))
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with common.run_dirs(a.runs_dir, "noloco-scaling-") as root:
        for seed in a.seed_list:
            for n in a.replica_counts:
                for method in a.method_list:
                    runs.append(one_run(a, root, method, n, seed))
        if a.churn > 0:
            n = max(a.replica_counts)
            for method in ("noloco", "diloco"):
                if method in a.method_list:
                    runs.append(one_run(a, root, method, n, a.seed_list[0],
                                        ["--churn", str(a.churn)], "-churn"))
        speed_rec = speed(a, root) if a.speed else None
    rows = table(runs)
    results = {"runs": runs, "table": rows, "gaps": gaps(runs), "speed": speed_rec,
               "verdict": judge(speed_rec)}
    common.write_record(json_path, rec, results, started)
    png = plot(rows, png_path)
    common.print_verdict(results["verdict"])
    print(common.wrote(json_path, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
