"""Streaming DiLoCo and streaming NoLoCo against DiLoCo and NoLoCo: loss, bytes, blocking.

Every run trains the same model (``--preset``, seed 0) on the same text with N replicas and
the same inner steps, batch and sequence length, through the real command line
(``python -m noloco train ...``); this script reads back summary.json and metrics.jsonl:

- final validation loss (mean over replicas);
- bytes sent per replica in the whole run, and the peak bytes sent in any one inner step
  (``peak_step_bytes``: what the link must carry at once);
- seconds blocked in communication per replica (``sync_seconds``).

The runs (one H for all; streaming fragments strided):

    diloco                     DiLoCo, fp32 all-reduce of the whole model every H steps
    streaming-P2, -P4          P fragments, one synchronised every H/P steps
    streaming-P4-tau1          + the all-reduce overlapped with τ = 1 inner step (α = 0.5)
    streaming-P4-tau1-fp4      + outer gradients sent as 4-bit E3M0
    noloco                     NoLoCo, pairs
    noloco-P4-tau1-fp4         streaming NoLoCo: fragments, overlap, 4-bit deltas (+ int8 φ)

On loopback, with N worker processes sharing a few cores, a replica's blocked seconds are
mostly waiting for slower replicas (scheduling skew), not transfer. So the overlap is also
measured where transfer costs time: every worker in its own network namespace behind a
shaped link (``--shaped-mbit``, tbf both ways; ``benchmarks/netns.py``, needs root and
iproute2, skipped otherwise), streaming-P4 against streaming-P4-tau1 for ``--shaped-steps``.

Finally an overlap micro-benchmark on 2 ranks (on a shaped link of ``--overlap-mbit`` when
possible) shows that the communication progresses while the caller computes: an all-reduce
is timed alone, then started just before a window of computation twice as long, and waited
for after it; the seconds still blocked in that wait (≈ 0: it progressed meanwhile) and the
computation done in the window against the same window without communication are recorded,
for gloo's fp32 all-reduce and for the quantised FP4 one (helper thread).

Targets: streaming + FP4 within 2% of DiLoCo's validation loss with ≥ 8× fewer bytes; peak
bytes per step lower by ≈ P× (judged: ≥ 0.8·P); overlap (τ = 1) removes ≥ 80% of the
blocked seconds of the same run without it (τ = 0), judged on the shaped links.

    python benchmarks/streaming.py             # the recorded run (4 replicas)
    python benchmarks/streaming.py --quick     # smoke run (2 replicas, a few steps)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET_LOSS_GAP = 0.02
TARGET_BYTES_RATIO = 8.0
TARGET_PEAK_FRACTION = 0.8  # peak ratio ≥ 0.8·P counts as "≈ P×"
TARGET_BLOCKED_REMOVED = 0.8

RUNS: dict[str, list[str]] = {
    "diloco": ["--method", "diloco"],
    "streaming-P2": ["--method", "streaming", "--fragments", "2"],
    "streaming-P4": ["--method", "streaming", "--fragments", "4"],
    "streaming-P4-tau1": ["--method", "streaming", "--fragments", "4", "--overlap-steps", "1"],
    "streaming-P4-tau1-fp4": ["--method", "streaming", "--fragments", "4", "--overlap-steps",
                              "1", "--quantize", "fp4"],
    "noloco": ["--method", "noloco"],
    "noloco-P4-tau1-fp4": ["--method", "noloco", "--fragments", "4", "--overlap-steps", "1",
                           "--quantize", "fp4"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_flags(p, {"sync_every": "H of every method",
                             "eval_batches": "validation batches (at the end)"},
                         data=str(common.DEFAULT_DATA), preset="tiny", replicas=4, steps=96,
                         batch_size=8, seq_len=64, lr=3e-3, warmup=20, sync_every=24,
                         eval_batches=8)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                   help="runs, in this order")
    p.add_argument("--shaped-mbit", type=float, default=100.0,
                   help="link rate of the shaped runs, Mbit/s per worker (0: skip them)")
    p.add_argument("--shaped-steps", type=int, default=48, help="inner steps of a shaped run")
    p.add_argument("--overlap-mb", type=float, default=8.0,
                   help="fp32 megabytes all-reduced in the overlap micro-benchmark")
    p.add_argument("--overlap-mbit", type=float, default=200.0,
                   help="link rate of the micro-benchmark, Mbit/s (0: loopback)")
    common.add_run_flags(p, seed=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 replicas, 16 steps, H 8")
    common.add_output_flags(p, wait_quiet=False)
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.steps, a.sync_every, a.batch_size, a.eval_batches, a.warmup = (
            2, 16, 8, 4, 1, 4)
        a.overlap_mb, a.shaped_steps = 2.0, 16
    common.check_pairs(p, a.replicas)
    if a.sync_every % 4 or a.steps < a.sync_every or a.shaped_steps < a.sync_every:
        p.error("--sync-every must be divisible by 4 (fragments) and at most the steps")
    common.check_data(p, a.data)
    return a


def train_cmd(a: argparse.Namespace, run: str, out: Path) -> list[str]:
    return common.noloco_train([*RUNS[run], *common.flags(
        replicas=a.replicas, preset=a.preset, data=a.data, steps=a.steps,
        batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
        sync_every=a.sync_every, eval_every=a.steps,
        eval_sequences=a.eval_batches * a.batch_size, seed=a.seed, device="cpu")], out)


def run_one(a: argparse.Namespace, run: str, runs: Path) -> dict[str, Any]:
    out = runs / run
    keep = ("method", "replicas", "steps", "outer_steps", "sync_every", "params", "param_bytes",
            "final_val_loss", "final_val_loss_per_replica", "bytes_sent_per_replica",
            "peak_step_bytes", "sync_seconds", "compute_seconds", "train_seconds",
            "compute_utilisation", "wall_seconds", "weight_spread", "fragments",
            "fragment_numel", "fragment_syncs", "overlap_steps", "quantize",
            "sync_wait_mean_seconds", "sync_wait_last_arrival_seconds")
    return common.run_and_read(train_cmd(a, run, out), out, run, keep)


# ---- workers started by hand (in shaped network namespaces when possible) -----------------

PREFIX, SUBNET, PORT = "nlst", "10.78.0.0/24", 29517


def shaping_available() -> tuple[bool, str]:
    import netns

    return netns.available()


def run_workers(argv: list[str], n: int, rate_mbit: float | None, log_dir: Path, tag: str,
                timeout: float = 900) -> dict[str, Any]:
    """``argv`` as ranks 0..n−1 (torchrun's environment variables): each worker in its own
    network namespace with a ``rate_mbit`` link (tbf, both directions) when ``rate_mbit`` is
    set, else on loopback. Returns the wall seconds and the link used."""
    import contextlib

    import netns

    ns_cm = (netns.Namespaces([rate_mbit * 1e6] * n, prefix=PREFIX, subnet=SUBNET)
             if rate_mbit else contextlib.nullcontext())
    t0 = time.perf_counter()
    with ns_cm as ns:
        port = PORT if ns else _free_port()
        procs = []
        for r in range(n):
            env = dict(os.environ)
            env.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(n),
                       OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MASTER_PORT=str(port),
                       MASTER_ADDR=ns.workers[0].addr if ns else "127.0.0.1")
            if ns:  # otherwise gloo resolves the hostname to 127.0.0.1
                env["GLOO_SOCKET_IFNAME"] = ns.workers[r].ifname
            log = open(log_dir / f"{tag}.rank{r}.log", "w")
            popen = ns.popen if ns else (lambda _i, a, **kw: subprocess.Popen(a, **kw))
            procs.append((popen(r, argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        failed = []
        for r, (proc, log) in enumerate(procs):
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            log.close()
            if rc != 0:
                failed.append(r)
        if failed:
            tail = (log_dir / f"{tag}.rank{failed[0]}.log").read_text()[-3000:]
            raise RuntimeError(f"{tag}: ranks {failed} failed; rank {failed[0]}:\n{tail}")
    return {"wall_seconds": time.perf_counter() - t0,
            "link": f"{rate_mbit:g} Mbit/s per worker (tbf)" if rate_mbit else "loopback"}


def run_shaped(a: argparse.Namespace, run: str, runs: Path) -> dict[str, Any]:
    """One training run with every worker behind its own shaped link."""
    out = runs / f"shaped-{run}"
    cmd = train_cmd(a, run, out)
    steps_at = cmd.index("--steps") + 1
    cmd[steps_at] = str(a.shaped_steps)
    cmd[cmd.index("--eval-every") + 1] = str(a.shaped_steps)
    cmd += ["--log-every", str(a.shaped_steps)]
    launch = run_workers(cmd, a.replicas, a.shaped_mbit, runs, f"shaped-{run}")
    summary = json.loads((out / "summary.json").read_text())
    keep = ("final_val_loss", "bytes_sent_per_replica", "peak_step_bytes", "sync_seconds",
            "compute_seconds", "train_seconds", "compute_utilisation", "steps",
            "sync_wait_mean_seconds", "sync_wait_last_arrival_seconds")
    return {"command": " ".join(cmd[2:]), "summary": common.kept(summary, keep), **launch}


# ---- overlap micro-benchmark ----------------------------------------------------------------

def overlap_worker(spec_path: str) -> None:
    """One rank of the micro-benchmark (started by :func:`overlap_benchmark`).

    Computation runs for a fixed window (twice the all-reduce's time alone, at least 0.3 s),
    once alone and once with the all-reduce started just before it; after the window the
    all-reduce is waited for. Blocked seconds ≈ 0 mean it finished during the computation;
    the matmuls done in the window, with against without, show what its CPU use cost.
    """
    import torch
    import torch.distributed as dist

    from noloco.comm import TorchCommunicator

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = TorchCommunicator(group=dist.group.WORLD)
    a = torch.randn(256, 256)

    def compute_for(seconds: float) -> int:
        n, x, t0 = 0, a, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            x = torch.tanh(x @ a) * 0.05
            n += 1
        return n

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    res: dict[str, Any] = {}
    for fmt in ("none", "fp4"):
        x = torch.randn(spec["numel"])
        comm.all_reduce_mean_quantized_async(x.clone(), fmt).wait()  # warm-up
        comm_alone = statistics.median(
            timed(lambda f=fmt, x=x: comm.all_reduce_mean_quantized_async(x.clone(), f).wait())
            for _ in range(spec["repeats"]))
        window = torch.tensor([max(0.3, 2 * comm_alone)], dtype=torch.float64)
        dist.broadcast(window, 0)  # the same window on both ranks
        w = float(window)
        rows = []
        for _ in range(spec["repeats"]):
            dist.barrier()
            iters_alone = compute_for(w)
            dist.barrier()
            pend = comm.all_reduce_mean_quantized_async(x.clone(), fmt)
            iters_with = compute_for(w)
            before = comm.sync_seconds
            pend.wait()
            rows.append({"iters_alone": iters_alone, "iters_with_comm_in_flight": iters_with,
                         "blocked_in_wait": comm.sync_seconds - before})
        res[fmt] = {"comm_alone": comm_alone, "compute_window": w,
                    **{k: statistics.median(r[k] for r in rows) for k in rows[0]}}
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def overlap_benchmark(megabytes: float, rate_mbit: float | None, work: Path,
                      repeats: int = 3) -> dict[str, Any]:
    numel = int(megabytes * 2**20 / 4)
    out = work / "overlap"
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"numel": numel, "repeats": repeats, "out": str(out)}))
    launch = run_workers([sys.executable, str(Path(__file__).resolve()), "--overlap-worker",
                          str(spec)], 2, rate_mbit, out, "overlap", timeout=600)
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    res: dict[str, Any] = {"numel": numel, "megabytes_fp32": megabytes, "ranks": 2, **launch,
                           "per_rank": per_rank}
    for fmt in ("none", "fp4"):
        r = per_rank[0][fmt]
        res[fmt] = {**r, "hidden_fraction": 1 - r["blocked_in_wait"] / r["comm_alone"],
                    "compute_kept": r["iters_with_comm_in_flight"] / r["iters_alone"]}
    return res


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- verdict and plot -----------------------------------------------------------------------

def judge(res: dict[str, dict[str, Any]], shaped: dict[str, dict[str, Any]] | None = None
          ) -> dict[str, Any]:
    s = {k: r["summary"] for k, r in res.items()}
    out: dict[str, Any] = {}
    if "diloco" in s:
        d = s["diloco"]
        if "streaming-P4-tau1-fp4" in s:
            q = s["streaming-P4-tau1-fp4"]
            out["fp4_loss_gap_vs_diloco"] = q["final_val_loss"] / d["final_val_loss"] - 1
            out["fp4_loss_within_2pct"] = abs(out["fp4_loss_gap_vs_diloco"]) <= TARGET_LOSS_GAP
            out["fp4_bytes_ratio_vs_diloco"] = (d["bytes_sent_per_replica"]
                                                / q["bytes_sent_per_replica"])
            out["fp4_bytes_ratio_ge_8"] = out["fp4_bytes_ratio_vs_diloco"] >= TARGET_BYTES_RATIO
        for P in (2, 4):
            k = f"streaming-P{P}"
            if k in s:
                ratio = d["peak_step_bytes"] / s[k]["peak_step_bytes"]
                out[f"peak_ratio_P{P}"] = ratio
                out[f"peak_ratio_P{P}_approx_P"] = ratio >= TARGET_PEAK_FRACTION * P
    # Overlap: all blocked seconds (waits for slower replicas included), and the part the
    # transfer itself caused (the wait of the replica that arrived last at each sync).
    pairs = [("loopback", s)]
    if shaped:
        pairs.append(("shaped", {k: r["summary"] for k, r in shaped.items()}))
    for where, ss in pairs:
        if not all(k in ss for k in ("streaming-P4", "streaming-P4-tau1")):
            continue
        a0, a1 = ss["streaming-P4"], ss["streaming-P4-tau1"]
        for metric, key in (("blocked", "sync_seconds"),
                            ("transfer_blocked", "sync_wait_last_arrival_seconds")):
            b0, b1 = a0[key], a1[key]
            removed = 1 - b1 / b0 if b0 else None
            out[f"overlap_{metric}_removed_{where}"] = removed
            out[f"overlap_{metric}_removes_80pct_{where}"] = (
                removed is not None and removed >= TARGET_BLOCKED_REMOVED)
    if "noloco" in s and "noloco-P4-tau1-fp4" in s:
        n0, n1 = s["noloco"], s["noloco-P4-tau1-fp4"]
        out["streaming_noloco_loss_gap_vs_noloco"] = (n1["final_val_loss"]
                                                      / n0["final_val_loss"] - 1)
        out["streaming_noloco_bytes_ratio_vs_noloco"] = (n0["bytes_sent_per_replica"]
                                                         / n1["bytes_sent_per_replica"])
    return out


def plot(res: dict[str, dict[str, Any]], a: argparse.Namespace, path: Path,
         shaped: dict[str, dict[str, Any]] | None = None) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import NullFormatter

    names = list(res)
    s = [res[k]["summary"] for k in names]
    colors = ["tab:red" if n.startswith("diloco") else "tab:orange" if n.startswith("stream")
              else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 5, figsize=(18, 4.4))
    panels = [("final validation loss", [x["final_val_loss"] for x in s], False),
              ("MiB sent per replica (run)", [x["bytes_sent_per_replica"] / 2**20 for x in s],
               True),
              ("peak KiB sent in one step", [x["peak_step_bytes"] / 2**10 for x in s], True),
              ("seconds blocked per replica\n(black: caused by the transfer)",
               [x["sync_seconds"] for x in s], False)]
    for ax, (title, vals, log) in zip(axes, panels, strict=False):
        ax.barh(range(len(names)), vals, color=colors)
        ax.set_yticks(range(len(names)), names if ax is axes[0] else [""] * len(names),
                      fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        if title.startswith("final"):
            ax.set_xlim(min(vals) - 0.05, max(vals) + 0.02)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.3g}", va="center", fontsize=7)
    transfer = [x.get("sync_wait_last_arrival_seconds") for x in s]
    axes[3].barh([i for i, v in enumerate(transfer) if v is not None],
                 [v for v in transfer if v is not None], height=0.3, color="black")
    ax = axes[4]
    pairs = [("loopback", {k: res[k]["summary"] for k in res})]
    if shaped:
        pairs.append((shaped[next(iter(shaped))]["link"].split(" per")[0],
                      {k: r["summary"] for k, r in shaped.items()}))
    labels, total, caused = [], [], []
    for where, ss in pairs:
        for run, tag in (("streaming-P4", "tau 0"), ("streaming-P4-tau1", "tau 1")):
            if run in ss:
                labels.append(f"P4 {tag}, {where}")
                total.append(ss[run]["sync_seconds"])
                caused.append(ss[run]["sync_wait_last_arrival_seconds"])
    y = range(len(labels))
    ax.barh([i - 0.2 for i in y], total, height=0.4, color="tab:orange", label="all blocked")
    ax.barh([i + 0.2 for i in y], caused, height=0.4, color="black",
            label="caused by the transfer")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title("overlap: blocked seconds per replica", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(f"{a.preset} preset, {a.replicas} replicas, {a.steps} steps x {a.batch_size}x"
                 f"{a.seq_len} tokens, H = {a.sync_every}", fontsize=10)
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--overlap-worker":
        overlap_worker(sys.argv[2])
        return 0
    a = parse_args(argv)
    json_path, png_path = common.out_paths("streaming", a.out_dir, a.quick, a.record)
    rec = common.start_record("streaming", common.config_of(a))
    t0 = time.perf_counter()
    res: dict[str, dict[str, Any]] = {}
    shaped: dict[str, dict[str, Any]] = {}
    ok, why = shaping_available()
    with common.run_dirs(a.runs_dir, "noloco-streaming-") as runs:
        for run in a.runs:
            res[run] = r = run_one(a, run, runs)
            s = r["summary"]
            print(f"{run:>22}: val {s['final_val_loss']:.4f} | "
                  f"{s['bytes_sent_per_replica'] / 2**20:8.2f} MiB/replica | peak step "
                  f"{s['peak_step_bytes'] / 2**10:8.1f} KiB | blocked {s['sync_seconds']:6.2f} s"
                  f" | wall {r['process_seconds']:6.1f} s", flush=True)
        if a.shaped_mbit > 0 and not ok:
            print(f"shaped runs skipped: {why}", flush=True)
        for run in ("streaming-P4", "streaming-P4-tau1") if a.shaped_mbit > 0 and ok else ():
            shaped[run] = r = run_shaped(a, run, runs)
            s = r["summary"]
            print(f"{'shaped ' + run:>24}: {r['link']}: val {s['final_val_loss']:.4f} | "
                  f"blocked {s['sync_seconds']:6.2f} s | train {s['train_seconds']:6.1f} s",
                  flush=True)
        overlap = overlap_benchmark(a.overlap_mb, a.overlap_mbit if ok else None, runs)
    for fmt in ("none", "fp4"):
        o = overlap[fmt]
        print(f"overlap {fmt:>4} on {overlap['link']}: all-reduce alone {o['comm_alone']:.3f} s;"
              f" started before {o['compute_window']:.2f} s of compute, then still blocked "
              f"{o['blocked_in_wait']:.3f} s ({o['hidden_fraction']:.0%} hidden); compute done "
              f"meanwhile {o['compute_kept']:.0%} of the compute done alone", flush=True)
    verdict = judge(res, shaped)
    results = {"runs": res, "shaped_runs": shaped, "shaping_unavailable": None if ok else why,
               "overlap_microbenchmark": overlap, "verdict": verdict,
               "targets": {"loss_gap_max": TARGET_LOSS_GAP, "bytes_ratio_min": TARGET_BYTES_RATIO,
                           "peak_ratio_min_fraction_of_P": TARGET_PEAK_FRACTION,
                           "blocked_removed_min": TARGET_BLOCKED_REMOVED}}
    common.write_record(json_path, rec, results, t0)
    plot(res, a, png_path, shaped)
    common.print_verdict(verdict)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
