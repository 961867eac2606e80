"""Throughput and peak memory of ``noloco train --method single`` against a bare PyTorch loop.

Both sides train the same model (``noloco.model.build`` of the same preset, seed 0) on the same
text (byte tokens of ``--data``) with the same batch size, sequence length, AdamW settings and
gradient clipping, each in its own fresh process, in alternating order (noloco first in even
repeats, the bare loop first in odd ones) so the drift of a shared machine hits both alike.

- noloco runs its real command line, ``noloco.cli.main(["train", "--method", "single", ...])``,
  in a process whose only addition is a timestamp per step: the step hook of noloco's progress
  reporter (called once after every optimizer step) is wrapped to note ``perf_counter`` and
  ``process_time``.
- the bare loop (random windows of the token stream, forward, cross-entropy, backward, clip,
  AdamW step, zero_grad; nothing else) notes the same two clocks after every step.

So both loops are timed the same way: per-step wall and CPU seconds from consecutive
timestamps (the first step, which warms up, is dropped). A run's speed is tokens per step ÷ its
median step time; the medians over runs are compared. noloco's own ``tokens_per_second`` (its
summary.json: whole loop, evaluations excluded) and the bare loop's whole-loop figure are kept
too. On a busy machine the per-step medians and CPU seconds are far steadier than totals.
Peak memory is each process's maximum resident set size (``ru_maxrss`` from ``wait4``).

Targets: noloco ≥ 0.95 × the bare loop's tokens/s and ≤ 1.1 × its peak memory.

    python benchmarks/throughput.py                 # the recorded run
    python benchmarks/throughput.py --cpus 1        # both pinned to one core (one thread)
    python benchmarks/throughput.py --quick         # smoke run, results in the temp directory
    python benchmarks/throughput.py --against compile --record   # noloco with --compile
    python benchmarks/throughput.py --against bf16 --record      # noloco with --precision bf16

``--against compile|bf16`` measures noloco against itself with that switch instead of against
the bare loop (record ``throughput_compile`` / ``throughput_bf16``; the ratio is switch ÷ plain;
the switch's first step — compiling — is dropped with the warm-up, its cost is in the process
seconds).
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
    common.add_run_flags(p, {"preset": "model preset (noloco.model.PRESETS)",
                             "steps": "training steps per run",
                             "batch_size": "sequences per step", "lr": "AdamW learning rate"},
                         data=str(common.DEFAULT_DATA), preset="tiny", steps=60, batch_size=16,
                         seq_len=128, lr=1e-3)
    p.add_argument("--repeats", type=int, default=5, help="runs of each side (alternating)")
    p.add_argument("--cpus", type=int, default=0,
                   help="pin both sides to this many CPUs (0: all; noloco then uses as many "
                   "threads, and so does the bare loop); 1 is steadier on a busy machine")
    p.add_argument("--profile", action="store_true",
                   help="also run noloco once under cProfile and record its top functions")
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, one repeat")
    common.add_output_flags(p, runs_dir=None)
    p.add_argument("--against", choices=("bare", "compile", "bf16"), default="bare",
                   help="what noloco is measured against: the bare loop, or noloco with "
                   "--compile or --precision bf16")
    p.add_argument("--worker", choices=("bare", "noloco", "compile", "bf16"),
                   help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.repeats = min(a.steps, 8), 1
    if a.steps < 3:
        p.error("--steps must be >= 3 (the first step is dropped as warm-up)")
    common.check_at_least_one(p, a, "batch_size", "seq_len", "repeats")
    if not 0 <= a.cpus <= common.cores():
        p.error(f"--cpus must lie in 0..{common.cores()}")
    common.check_data(p, a.data)
    return a


# ---- the two workers (each runs in its own process) -----------------------------------------

def _mark(marks: list[tuple[float, float]]) -> None:
    marks.append((time.perf_counter(), time.process_time()))


def bare_worker(a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from noloco.model import build, preset

    torch.set_num_threads(common.threads())  # as noloco single: all the cores it may use
    torch.set_num_interop_threads(1)
    if a.data == "builtin":  # the same text noloco reads: its built-in documents, as bytes
        from noloco.data import builtin_documents

        text = b"".join(t.encode("utf-8") for _, t in builtin_documents())
    else:
        text = Path(a.data).read_bytes()
    raw = np.frombuffer(text, dtype=np.uint8)
    tokens = torch.from_numpy(raw.astype(np.int64))
    model = build(preset(a.preset, vocab_size=257), seed=0)  # 256 bytes + end-of-document
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(a.seq_len + 1)
    marks: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    for _ in range(a.steps):
        starts = torch.randint(len(tokens) - a.seq_len - 1, (a.batch_size, 1), generator=gen)
        rows = tokens[starts + offsets]
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _mark(marks)
    loop = time.perf_counter() - t0
    return {"marks": marks, "loop_tokens_per_second": a.steps * a.batch_size * a.seq_len / loop,
            "final_train_loss": loss.item(), "threads": torch.get_num_threads()}


def noloco_worker(a: argparse.Namespace) -> dict[str, Any]:
    from noloco import cli, metrics

    marks: list[tuple[float, float]] = []
    step = metrics.Progress.step

    def timed_step(self: Any, *args: Any, **kw: Any) -> None:
        _mark(marks)
        step(self, *args, **kw)

    metrics.Progress.step = timed_step
    rc = cli.main(noloco_argv(a, Path(a.run_dir)) + SWITCHES.get(a.worker, []))
    if rc:
        raise SystemExit(rc)
    s = common.read_summary(Path(a.run_dir))
    if len(marks) != a.steps:
        raise RuntimeError(f"expected {a.steps} step timestamps, got {len(marks)}")
    return {"marks": marks, "loop_tokens_per_second": s["tokens_per_second"],
            "final_val_loss": s["final_val_loss"], "threads": s["threads_per_worker"]}


SWITCHES = {"compile": ["--compile"], "bf16": ["--precision", "bf16"]}
"""the noloco flags of each ``--against`` side"""


def noloco_argv(a: argparse.Namespace, out: Path) -> list[str]:
    return common.train_argv(common.flags(
        method="single", preset=a.preset, data=a.data, steps=a.steps, batch_size=a.batch_size,
        seq_len=a.seq_len, lr=a.lr, warmup=0, weight_decay=0, grad_clip=1.0,
        eval_every=a.steps, eval_sequences=a.batch_size, seed=0, device="cpu"), out)


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
    return stdout, wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def worker_cmd(a: argparse.Namespace, side: str, run_dir: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *common.flags(
        worker=side, run_dir=run_dir, preset=a.preset, data=a.data, steps=a.steps,
        batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr)]


def run_side(a: argparse.Namespace, side: str, tmp: Path) -> dict[str, Any]:
    stdout, wall, rss, cpu = run_child(worker_cmd(a, side, tmp / "run"), a.cpus)
    r = json.loads(stdout.strip().splitlines()[-1])
    marks = r.pop("marks")
    step_wall = [b[0] - a_[0] for a_, b in zip(marks, marks[1:], strict=False)]
    step_cpu = [b[1] - a_[1] for a_, b in zip(marks, marks[1:], strict=False)]
    tokens = a.batch_size * a.seq_len
    r.update(
        tokens_per_second=tokens / statistics.median(step_wall),
        tokens_per_cpu_second=tokens / statistics.median(step_cpu),
        step_seconds=common.quartiles(step_wall), step_cpu_seconds=common.quartiles(step_cpu),
        process_seconds=wall, process_cpu_seconds=cpu, peak_rss_bytes=rss)
    return r


def profile_noloco(a: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """cProfile one noloco run through its command line; the functions with the most own time."""
    import pstats

    prof = tmp / "noloco.prof"
    run_child([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "noloco",
               *noloco_argv(a, tmp / "prof_run")], a.cpus)
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in pstats.Stats(str(prof)).stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls": ncalls,
                     "own_seconds": round(tottime, 4), "cumulative_seconds": round(cumtime, 4)})
    rows.sort(key=lambda r: -r["own_seconds"])
    return rows[:25]


STAT_KEYS = ("tokens_per_second", "tokens_per_cpu_second", "loop_tokens_per_second")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: common.quartiles([r[k] for r in runs]) for k in STAT_KEYS}
    out["peak_rss_mib"] = common.quartiles([r["peak_rss_bytes"] / 2**20 for r in runs])
    out["process_seconds"] = common.quartiles([r["process_seconds"] for r in runs])
    return out


def plot(res: dict[str, Any], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    sides = ("bare", "noloco")
    panels = (("tokens_per_second", 1.0, "tokens / s (median step)",
               f"wall: ratio {res['speed_ratio']:.3f} (target >= {TARGET_SPEED})"),
              ("tokens_per_cpu_second", 1.0, "tokens / CPU second (median step)",
               f"CPU: ratio {res['cpu_speed_ratio']:.3f}"),
              ("peak_rss_bytes", 2**-20, "peak RSS (MiB)",
               f"memory: ratio {res['memory_ratio']:.3f} (target <= {TARGET_MEMORY})"))
    for ax, (key, scale, label, title) in zip(axes, panels, strict=True):
        for i, side in enumerate(sides):
            vals = [r[key] * scale for r in res["runs"][side]]
            ax.bar(i, statistics.median(vals), color=("tab:gray", "tab:blue")[i], alpha=0.6)
            ax.scatter([i] * len(vals), vals, color="k", s=12, zorder=3)
        ax.set_xticks(range(len(sides)), ["bare PyTorch loop", "noloco single"])
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        r = bare_worker(a) if a.worker == "bare" else noloco_worker(a)  # noloco, or a switch
        print(json.dumps(r))
        return 0
    other = a.against
    name = "throughput" if other == "bare" else f"throughput_{other}"
    json_path, png_path = common.out_paths(name, a.out_dir, a.quick, a.record)
    config = common.config_of(a, ("worker", "run_dir", "out_dir"))
    config["tokens_per_step"] = a.batch_size * a.seq_len
    config["noloco_command"] = "noloco " + " ".join(noloco_argv(a, Path("TMP")))
    rec = common.start_record(name, config)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {"noloco": [], other: []}
    with tempfile.TemporaryDirectory(prefix="noloco-throughput-") as tmpd:
        tmp = Path(tmpd)
        for r in range(a.repeats):
            for side in (("noloco", other) if r % 2 == 0 else (other, "noloco")):
                load = common.wait_for_quiet(a.wait_quiet) if a.wait_quiet else None
                res = run_side(a, side, tmp)
                res.update(repeat=r, load_average_before=load or common.load_average())
                runs[side].append(res)
                print(f"repeat {r} {side:>6}: {res['tokens_per_second']:8.0f} tok/s "
                      f"({res['tokens_per_cpu_second']:6.0f} per CPU s), peak RSS "
                      f"{res['peak_rss_bytes'] / 2**20:5.0f} MiB", flush=True)
        profile = profile_noloco(a, tmp) if a.profile else None
    stats = {side: summarise(rs) for side, rs in runs.items()}
    if other != "bare":
        return record_switch(a, other, runs, stats, rec, t0, json_path)

    def ratio(key: str) -> float:
        return stats["noloco"][key]["median"] / stats["bare"][key]["median"]

    speed, memory = ratio("tokens_per_second"), ratio("peak_rss_mib")
    # Per-repeat ratios (the two runs of a repeat are adjacent in time) show the drift.
    pair = [n["tokens_per_second"] / b["tokens_per_second"]
            for n, b in zip(runs["noloco"], runs["bare"], strict=True)]
    results = {
        "runs": runs, "stats": stats,
        "speed_ratio": speed, "memory_ratio": memory,
        "cpu_speed_ratio": ratio("tokens_per_cpu_second"),
        "loop_speed_ratio": ratio("loop_tokens_per_second"),
        "speed_ratio_per_repeat": common.quartiles(pair),
        "targets": {"speed_ratio_min": TARGET_SPEED, "memory_ratio_max": TARGET_MEMORY},
        "speed_target_met": speed >= TARGET_SPEED, "memory_target_met": memory <= TARGET_MEMORY,
        "profile_noloco_top_own_time": profile,
    }
    common.write_record(json_path, rec, results, t0)
    print(f"noloco / bare: tokens/s {speed:.3f} (target >= {TARGET_SPEED}: "
          f"{'met' if speed >= TARGET_SPEED else 'MISSED'}; per CPU second "
          f"{results['cpu_speed_ratio']:.3f}; whole loop {results['loop_speed_ratio']:.3f}), "
          f"peak memory {memory:.3f} (target <= {TARGET_MEMORY}: "
          f"{'met' if memory <= TARGET_MEMORY else 'MISSED'})")
    print(common.wrote(json_path, plot(results, png_path)))
    return 0


def record_switch(a: argparse.Namespace, switch: str, runs: dict[str, list[dict[str, Any]]],
                  stats: dict[str, Any], rec: dict[str, Any], t0: float, json_path: Path
                  ) -> int:
    """noloco with a switch against plain noloco: tokens/s (median step), peak memory, the
    process's seconds (compiling included) and the final loss of each side."""
    def ratio(key: str) -> float:
        return stats[switch][key]["median"] / stats["noloco"][key]["median"]

    results = {"runs": runs, "stats": stats, "switch": SWITCHES[switch],
               "speed_ratio": ratio("tokens_per_second"),
               "cpu_speed_ratio": ratio("tokens_per_cpu_second"),
               "memory_ratio": ratio("peak_rss_mib"),
               "process_seconds_ratio": ratio("process_seconds"),
               "final_val_loss": {s: statistics.median(r["final_val_loss"] for r in rs)
                                  for s, rs in runs.items()}}
    common.write_record(json_path, rec, results, t0)
    print(f"noloco {' '.join(SWITCHES[switch])} / noloco: tokens/s (median step) "
          f"{results['speed_ratio']:.3f}, per CPU second {results['cpu_speed_ratio']:.3f}, "
          f"whole process {1 / results['process_seconds_ratio']:.3f}, peak memory "
          f"{results['memory_ratio']:.3f}; final loss {results['final_val_loss']}")
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
