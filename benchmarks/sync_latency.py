"""Latency of one NoLoCo pair exchange against one all-reduce of the same payload.

N local processes (gloo over loopback, one torch thread each, started by
``torch.multiprocessing.spawn``) repeat, interleaved:

- ``TorchCommunicator.all_reduce_mean`` of a float32 buffer of S values over all N ranks
  (what DiLoCo does at an outer step, and DDP at every step);
- ``TorchCommunicator.exchange`` of the same buffer with one partner, the pairs drawn as NoLoCo
  draws them (``noloco.methods.groups_at(t, N, 2)``, a new random pairing each repetition),
  into a receive buffer kept from one exchange to the next, as NoLoCo's fragments keep
  theirs; all N/2 pairs exchange at the same time;
- for information, the same exchange into a fresh receive buffer per call (what the library
  did before: for a large payload the page faults of a fresh buffer cost about as much as
  the transfer).

Each repetition starts after a barrier; its time is the slowest rank's (an operation is done
when every rank has its result). After warm-up repetitions, the script reports medians and
quartiles per (N, S). S defaults to the parameter count of the ``tiny`` preset and 16M floats.

Target: at N = 8 the exchange is at least 1.7× faster than the all-reduce, 16M floats included.

    python benchmarks/sync_latency.py                # the recorded run
    python benchmarks/sync_latency.py --quick        # smoke run (N = 2, small buffers)

On a machine with fewer cores than N, the N processes share cores: the numbers then include
scheduling, which is recorded (cores, load average) with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET_RATIO = 1.7
TARGET_N = 8
LARGE = 16 * 2**20


def tiny_param_count() -> int:
    from noloco.data import ByteTokenizer
    from noloco.model import build, count_params, preset

    return count_params(build(preset("tiny", vocab_size=ByteTokenizer.vocab_size), "meta"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4, 8],
                   help="numbers of processes N (even)")
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="buffer sizes in float32 values (default: tiny preset's parameter "
                   f"count and {LARGE})")
    p.add_argument("--warmup", type=int, default=5, help="untimed repetitions per case")
    p.add_argument("--reps", type=int, default=60, help="most timed repetitions per case")
    p.add_argument("--min-reps", type=int, default=15, help="fewest timed repetitions per case")
    p.add_argument("--budget", type=float, default=25.0,
                   help="seconds per case that set the repetitions between --min-reps and --reps")
    p.add_argument("--seed", type=int, default=0, help="seed of the NoLoCo pairings")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each N, wait up to this long for the load average to drop "
                   "below the core count (the machine may be shared)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: N = 2, sizes 1000 and 100000, few repetitions")
    p.add_argument("--out-dir", default=None, help="where the JSON and PNG go "
                   "(default: the scratch directory; benchmarks/results with --record)")
    common.add_record_flag(p)
    a = p.parse_args(argv)
    if a.quick:
        a.procs = [2] if a.procs == [2, 4, 8] else a.procs
        a.sizes = a.sizes or [1000, 100_000]
        a.warmup, a.reps, a.min_reps, a.budget = 2, 8, 8, 5.0
    if any(n < 2 or n % 2 for n in a.procs):
        p.error("--procs must be even numbers >= 2 (NoLoCo pairs replicas)")
    if a.sizes is not None and any(s < 1 for s in a.sizes):
        p.error("--sizes must be >= 1")
    if a.warmup < 0 or a.min_reps < 1 or a.reps < a.min_reps:
        p.error("need --warmup >= 0 and 1 <= --min-reps <= --reps")
    return a


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one process ---------------------------------------------------------------------------

OPS = ("all_reduce", "exchange", "exchange_fresh_buffer")


def _partner(comm: Any, t: int, seed: int) -> int:
    from noloco.methods import groups_at

    group = next(g for g in groups_at(t, comm.size, 2, seed) if comm.rank in g)
    return next(r for r in group if r != comm.rank)


def time_op(op: str, comm: Any, buf: Any, out: Any, t: int, seed: int) -> float:
    """Seconds of one ``op`` on this rank, started right after a barrier. The exchanges use
    this rank's partner of NoLoCo's pairing number ``t``."""
    import torch.distributed as dist

    peer = _partner(comm, t, seed) if op != "all_reduce" else -1
    dist.barrier()
    t0 = time.perf_counter()
    if op == "all_reduce":
        comm.all_reduce_mean(buf)
    elif op == "exchange":
        comm.exchange(buf, [peer], out=[out])
    else:
        comm.exchange(buf, [peer])
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, a: argparse.Namespace, sizes: list[int],
           out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from noloco.comm import TorchCommunicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        comm = TorchCommunicator(list(range(world)), group=dist.group.WORLD)
        results = []
        for size in sizes:
            buf = torch.randn(size, generator=torch.Generator().manual_seed(rank))
            out = torch.zeros_like(buf)  # touched once, reused by every "exchange"
            t_ops = 0
            w0 = time.perf_counter()
            for _ in range(max(a.warmup, 1)):
                for op in OPS:
                    time_op(op, comm, buf, out, t_ops, a.seed)
                t_ops += 1
            # Rank 0 picks the repetitions from the warm-up pace; everyone must agree on it.
            per_rep = (time.perf_counter() - w0) / max(a.warmup, 1)
            reps = torch.tensor([min(a.reps, max(a.min_reps, int(a.budget / max(per_rep, 1e-9))))])
            dist.broadcast(reps, src=0)
            times: dict[str, list[float]] = {op: [] for op in OPS}
            for i in range(int(reps)):
                # Rotate which operation goes first, so drift affects all alike.
                for k in range(len(OPS)):
                    op = OPS[(i + k) % len(OPS)]
                    times[op].append(time_op(op, comm, buf, out, t_ops, a.seed))
                t_ops += 1
            mine = torch.tensor([times[op] for op in OPS], dtype=torch.float64)
            rows = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(rows, mine)
            slowest = torch.stack(rows).amax(0)  # (ops, reps): the slowest rank per repetition
            rec = {"size": size, "bytes": size * 4, "reps": int(reps)}
            rec.update({f"{op}_seconds": slowest[j].tolist() for j, op in enumerate(OPS)})
            results.append(rec)
        if rank == 0:
            Path(out_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ---- the driver ----------------------------------------------------------------------------

def measure(n: int, a: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="noloco-sync-") as tmp:
        out = str(Path(tmp) / "out.json")
        mp.spawn(worker, args=(n, free_port(), a, sizes, out), nprocs=n, join=True)
        return json.loads(Path(out).read_text())


def summarise(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    from noloco.comm import ring_all_reduce_bytes

    out = []
    for r in rows:
        q = {op: common.quartiles(r[f"{op}_seconds"]) for op in OPS}
        out.append({
            "procs": n, "size": r["size"], "bytes": r["bytes"], "reps": r["reps"], **q,
            "speedup": q["all_reduce"]["median"] / q["exchange"]["median"],
            "speedup_fresh_buffer": (q["all_reduce"]["median"]
                                     / q["exchange_fresh_buffer"]["median"]),
            "bytes_sent_per_rank": {"all_reduce": ring_all_reduce_bytes(r["bytes"], n),
                                    "exchange": r["bytes"]},
            "raw": {f"{op}_seconds": r[f"{op}_seconds"] for op in OPS},
        })
    return out


def plot(cases: list[dict[str, Any]], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import FormatStrFormatter

    sizes = sorted({c["size"] for c in cases})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        cs = sorted((c for c in cases if c["size"] == size), key=lambda c: c["procs"])
        ns = [c["procs"] for c in cs]
        for key, label, color in (
                ("all_reduce", "all_reduce_mean (all N)", "tab:red"),
                ("exchange", "NoLoCo pair exchange (library)", "tab:blue"),
                ("exchange_fresh_buffer", "pair exchange, fresh receive buffer",
                 "tab:cyan")):
            med = [c[key]["median"] * 1e3 for c in cs]
            lo = [(c[key]["median"] - c[key]["q1"]) * 1e3 for c in cs]
            hi = [(c[key]["q3"] - c[key]["median"]) * 1e3 for c in cs]
            ax.errorbar(ns, med, yerr=[lo, hi], marker="o", capsize=3, label=label, color=color)
        for c in cs:
            ax.annotate(f"{c['speedup']:.2f}x", (c["procs"], c["exchange"]["median"] * 1e3),
                        textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("processes N")
        ax.set_ylabel("ms per operation (median, quartiles)")
        ax.set_title(f"{size:,} float32 ({size * 4 / 2**20:.1f} MiB)")
        ax.legend(fontsize=8)
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sizes = a.sizes or [tiny_param_count(), LARGE]
    json_path, png_path = common.out_paths("sync_latency", a.out_dir, a.quick, a.record)
    config = {k: v for k, v in vars(a).items() if k != "out_dir"}
    config.update(sizes=sizes, threads_per_process=1, backend="gloo", address="127.0.0.1")
    rec = common.start_record("sync_latency", config)
    t0 = time.perf_counter()
    cases = []
    for n in a.procs:
        load = common.wait_for_quiet(a.wait_quiet) if a.wait_quiet else common.load_average()
        for c in summarise(measure(n, a, sizes), n):
            c["load_average_before"] = load
            cases.append(c)
            print(f"N={n} S={c['size']:>9}: all-reduce {c['all_reduce']['median'] * 1e3:8.2f} ms"
                  f"  exchange {c['exchange']['median'] * 1e3:8.2f} ms  "
                  f"speed-up {c['speedup']:.2f}x  (fresh receive buffer: "
                  f"{c['exchange_fresh_buffer']['median'] * 1e3:.2f} ms, "
                  f"{c['speedup_fresh_buffer']:.2f}x; {c['reps']} reps)", flush=True)
    at_target = [c for c in cases if c["procs"] == TARGET_N]
    results = {
        "cases": cases,
        "target": {"procs": TARGET_N, "min_speedup": TARGET_RATIO},
        "target_met_by_size": {str(c["size"]): c["speedup"] >= TARGET_RATIO for c in at_target},
    }
    common.write_json(json_path, common.finish_record(rec, results, time.perf_counter() - t0))
    plot(cases, png_path)
    for c in at_target:
        print(f"N={TARGET_N}, {c['size']} floats: exchange {c['speedup']:.2f}x faster "
              f"(target >= {TARGET_RATIO}: {'met' if c['speedup'] >= TARGET_RATIO else 'MISSED'})")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
