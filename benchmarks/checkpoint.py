"""What checkpointing costs, and what a crash costs with it.

Overhead: the same training runs with ``--checkpoint-every H`` (a checkpoint at every outer
step, the default) and with ``--checkpoint-every 0``, alternating (checkpointing first in even
repeats, last in odd ones) so a shared machine's drift hits both alike. Recorded per preset:

- bytes of one worker's checkpoint file, seconds the training loop waited per save (the copy
  of the state; the write itself runs in a background thread), seconds of background writing
  per save;
- one outer step's seconds (H × the median inner-step seconds of the runs without
  checkpoints), and the waited and written seconds as fractions of it;
- the overhead per outer step: median training-loop seconds with checkpoints, less the wait
  for the last checkpoint's write at the end of the run (once per run, however long: reported
  apart), ÷ without − 1 (evaluations excluded). The background writes compete with training
  for the cores, memory bandwidth and the disk, so this is the honest figure; the raw ratio
  (end wait included) is recorded too. Target: ≤ 2% at H = 50.

Recovery: one more run with ``--max-restarts 1`` whose replica 1 is killed with SIGKILL after
``--kill-step``; this script timestamps the run's output lines as they arrive: the kill, the
launcher's restart line, the workers' "resuming from" line (state loaded), and the first
training step after it. Work lost = the steps between the checkpoint resumed from and the
kill (done twice); seconds lost = that run's wall time − the median wall time of the
uninterrupted runs with checkpoints.

Presets: ``tiny`` runs NoLoCo on 2 replicas (2 worker processes, batch 16 × 128); ``small``
(85M parameters with the byte tokenizer; weights, AdamW's two moments, slow weights and outer
momentum make 1.7 GB, of which the slow weights equal the weights at an outer step and are
stored once) runs DiLoCo on 1 replica (one process with both cores, batch 8 × 128), which
keeps a recorded run within about 40 minutes on 2 cores.

    python benchmarks/checkpoint.py               # the recorded run (~40 min on 2 cores)
    python benchmarks/checkpoint.py --quick       # smoke run, results in the temp directory
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET_OVERHEAD = 0.02
PRESETS = {
    "tiny": {"method": "noloco", "replicas": 2, "batch_size": 16, "seq_len": 128},
    "small": {"method": "diloco", "replicas": 1, "batch_size": 8, "seq_len": 128},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_flags(p, data=common.DEFAULT_DATA)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--sync-every", type=int, default=50, help="H: inner steps per outer step")
    p.add_argument("--outer-steps", type=int, nargs=2, default=[4, 3], metavar=("TINY", "SMALL"),
                   help="outer steps per run for tiny and small (default 4 3)")
    p.add_argument("--repeats", type=int, nargs=2, default=[3, 2], metavar=("TINY", "SMALL"),
                   help="runs of each side per preset (default 3 2)")
    p.add_argument("--kill-step", type=int, default=130,
                   help="recovery run (tiny): replica 1 is killed after this inner step")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny only, H 5, 2 outer steps, one repeat")
    common.add_output_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.presets, a.sync_every, a.outer_steps, a.repeats, a.kill_step = (
            ["tiny"], 5, [2, 2], [1, 1], 7)
    if a.sync_every < 1 or min(a.outer_steps) < 1 or min(a.repeats) < 1:
        p.error("--sync-every, --outer-steps and --repeats must be >= 1")
    steps = a.outer_steps[0] * a.sync_every
    if not a.sync_every < a.kill_step < steps:
        p.error(f"--kill-step must lie after the first checkpoint and before the end "
                f"({a.sync_every} < step < {steps})")
    return a


def train_cmd(a: argparse.Namespace, preset: str, out: Path, checkpoint_every: int,
              extra: list[str] = ()) -> list[str]:
    c = PRESETS[preset]
    steps = a.outer_steps[0 if preset == "tiny" else 1] * a.sync_every
    return common.noloco_train(common.flags(
        preset=preset, data=a.data, method=c["method"], replicas=c["replicas"],
        sync_every=a.sync_every, steps=steps, batch_size=c["batch_size"], seq_len=c["seq_len"],
        eval_every=steps, eval_sequences=2 * c["batch_size"], device="cpu",
        checkpoint_every=checkpoint_every), out, extra)


def run(cmd: list[str], a: argparse.Namespace) -> tuple[float, list[tuple[float, str]]]:
    """Run ``cmd``; returns its wall seconds and its output lines with arrival times."""
    if a.wait_quiet:
        common.wait_for_quiet(a.wait_quiet)
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)

    def read(stream: Any) -> None:
        for line in stream:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(s,)) for s in (proc.stdout, proc.stderr)]
    for r in readers:
        r.start()
    proc.wait()
    for r in readers:
        r.join()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join(x for _, x in lines[-30:])
        raise RuntimeError(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return wall, sorted(lines)


def overhead(a: argparse.Namespace, preset: str, runs: Path) -> dict[str, Any]:
    reps = a.repeats[0 if preset == "tiny" else 1]
    sides: dict[str, list[dict[str, Any]]] = {"checkpoint": [], "none": []}
    for rep in range(reps):
        order = ("checkpoint", "none") if rep % 2 == 0 else ("none", "checkpoint")
        for side in order:
            out = runs / f"{preset}-{side}-{rep}"
            every = a.sync_every if side == "checkpoint" else 0
            load = common.load_average()
            wall, _ = run(train_cmd(a, preset, out, every), a)
            s = common.read_summary(out)
            sides[side].append({
                "wall_seconds": wall, "train_seconds": s["train_seconds"],
                "step_seconds": s["step_seconds"], "saves": s["checkpoint_saves"],
                "bytes": s["checkpoint_bytes"],
                "blocked_seconds": s["checkpoint_blocked_seconds"],
                "write_seconds": s["checkpoint_write_seconds"],
                "final_wait_seconds": s["checkpoint_final_wait_seconds"], "load_average": load})
            print(f"{preset} {side} #{rep}: train {s['train_seconds']:.1f} s, "
                  f"{s['checkpoint_saves']} saves", flush=True)
    ck, none = sides["checkpoint"], sides["none"]
    med = statistics.median
    outer_s = a.sync_every * med(r["step_seconds"] for r in none)
    blocked = med(r["blocked_seconds"] / r["saves"] for r in ck)
    written = med(r["write_seconds"] / r["saves"] for r in ck)
    base = med(r["train_seconds"] for r in none)
    ratio = med(r["train_seconds"] for r in ck) / base
    steady = med(r["train_seconds"] - r["final_wait_seconds"] for r in ck) / base
    return {
        "config": {**PRESETS[preset], "preset": preset, "sync_every": a.sync_every,
                   "steps": a.outer_steps[0 if preset == "tiny" else 1] * a.sync_every},
        "runs": sides,
        "checkpoint_bytes_per_worker": ck[0]["bytes"],
        "saves_per_run": ck[0]["saves"],
        "blocked_seconds_per_save": blocked,
        "write_seconds_per_save": written,
        "outer_step_seconds": outer_s,
        "blocked_fraction_of_outer_step": blocked / outer_s,
        "write_fraction_of_outer_step": written / outer_s,
        "final_wait_seconds": med(r["final_wait_seconds"] for r in ck),
        "train_seconds_ratio": ratio,
        "overhead_with_final_wait": ratio - 1,
        "overhead": steady - 1,
        "overhead_within_target": steady - 1 <= TARGET_OVERHEAD,
    }


def recovery(a: argparse.Namespace, runs: Path, reference_wall: float | None
             ) -> dict[str, Any]:
    out = runs / "tiny-recovery"
    extra = ["--max-restarts", "1", "--inject-fault", f"kill:1@{a.kill_step}",
             "--log-every", "1"]
    wall, lines = run(train_cmd(a, "tiny", out, a.sync_every, extra), a)

    def first(pattern: str, after: float = -1.0) -> tuple[float, re.Match]:
        for t, line in lines:
            if t > after and (m := re.search(pattern, line)):
                return t, m
        raise RuntimeError(f"no line matching {pattern!r} in the recovery run")

    t_kill, _ = first(r"injected fault: SIGKILL")
    t_restart, m = first(r"restarting from (?:checkpoint step (\d+)|the start)", t_kill)
    resumed_from = int(m.group(1) or 0)  # 0: the kill came before any checkpoint finished
    t_loaded = first(r"resuming from checkpoints/step-", t_restart)[0] if resumed_from else \
        t_restart
    t_step, _ = first(r"^step +\d+/", t_loaded)
    s = common.read_summary(out)
    return {
        "kill_step": a.kill_step, "resumed_from_step": resumed_from,
        "steps_lost": a.kill_step - resumed_from,
        "seconds_of_steps_lost": (a.kill_step - resumed_from) * s["step_seconds"],
        "kill_to_restart_seconds": t_restart - t_kill,
        "restart_to_state_loaded_seconds": t_loaded - t_restart,
        "state_loaded_to_first_step_seconds": t_step - t_loaded,
        "kill_to_training_again_seconds": t_step - t_kill,
        "wall_seconds": wall, "reference_wall_seconds": reference_wall,
        "seconds_lost": wall - reference_wall if reference_wall else None,
        "status": s["status"], "restarts": s.get("restarts"),
    }


def plot(results: dict[str, Any], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results["overhead"])
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [100 * results["overhead"][n]["overhead"] for n in names],
            0.4, label="training-loop overhead")
    ax1.bar([i + 0.2 for i in x],
            [100 * results["overhead"][n]["blocked_fraction_of_outer_step"] for n in names],
            0.4, label="loop waiting for the copy")
    ax1.axhline(100 * TARGET_OVERHEAD, color="k", ls="--", lw=1, label="target 2%")
    mb = [results["overhead"][n]["checkpoint_bytes_per_worker"] / 1e6 for n in names]
    ax1.set_xticks(list(x), [f"{n}\n{m:,.0f} MB/worker" for n, m in zip(names, mb, strict=True)])
    ax1.set_ylabel("% of training time (checkpoint every outer step)")
    ax1.legend(fontsize=8)
    r = results.get("recovery")
    if r:
        parts = [("kill → restart", r["kill_to_restart_seconds"]),
                 ("restart → state loaded", r["restart_to_state_loaded_seconds"]),
                 ("loaded → first step", r["state_loaded_to_first_step_seconds"]),
                 (f"{r['steps_lost']} steps redone", r["seconds_of_steps_lost"])]
        left = 0.0
        for label, v in parts:
            ax2.barh([0], [v], left=left, label=f"{label}: {v:.1f} s")
            left += v
        ax2.set_yticks([])
        ax2.set_xlabel("seconds")
        ax2.set_title("one SIGKILL, --max-restarts 1 (tiny, 2 replicas)")
        ax2.legend(fontsize=8, loc="upper right")
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    json_path, png_path = common.out_paths("checkpoint", a.out_dir, a.quick, a.record)
    rec = common.start_record("checkpoint", vars(a))
    t0 = time.perf_counter()
    with common.run_dirs(a.runs_dir, "noloco-checkpoint-") as runs:
        results: dict[str, Any] = {"overhead": {}}
        for preset in a.presets:
            results["overhead"][preset] = overhead(a, preset, runs)
        ref = results["overhead"].get("tiny")
        ref_wall = (statistics.median(r["wall_seconds"] for r in ref["runs"]["checkpoint"])
                    if ref else None)
        results["recovery"] = recovery(a, runs, ref_wall)
    common.write_record(json_path, rec, results, t0)
    drawn = plot(results, png_path)
    for name, o in results["overhead"].items():
        print(f"{name}: {o['checkpoint_bytes_per_worker'] / 1e6:,.1f} MB per worker, loop "
              f"waits {o['blocked_seconds_per_save'] * 1e3:.1f} ms per save "
              f"({100 * o['blocked_fraction_of_outer_step']:.2f}% of an outer step of "
              f"{o['outer_step_seconds']:.1f} s), writes {o['write_seconds_per_save']:.2f} s "
              f"in the background; overhead per outer step {100 * o['overhead']:+.2f}% "
              f"(target <= {100 * TARGET_OVERHEAD:.0f}%); the run's end waited "
              f"{o['final_wait_seconds']:.1f} s for its last write")
    r = results["recovery"]
    print(f"recovery: kill at step {r['kill_step']} -> training again in "
          f"{r['kill_to_training_again_seconds']:.1f} s from step {r['resumed_from_step']} "
          f"({r['steps_lost']} steps redone); seconds lost "
          + (f"{r['seconds_lost']:.1f}" if r["seconds_lost"] is not None else "n/a"))
    print(common.wrote(json_path, drawn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
