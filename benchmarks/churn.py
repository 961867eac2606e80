"""Training through failures: elastic NoLoCo, elastic DiLoCo and restart-from-checkpoint.

Eight replicas on this machine (one process each). A kill loop sends SIGKILL to a random
live worker at exponential intervals (mean ``--mtbf`` seconds, the same seeded schedule for
every run, at most ``--kills`` kills). Runs, side by side in one invocation:

- ``noloco`` and ``diloco`` with ``--elastic`` and no failures: the references;
- the same with the kill loop and ``--respawn``: the others go on, the killed replica is
  started again and joins from a live one;
- ``restart``: static NoLoCo with ``--max-restarts`` and a checkpoint at every outer step,
  under the same kill loop: every failure stops all replicas, which restart from the newest
  checkpoint.

Recorded per run: wall seconds, failures, final validation loss (mean over the replicas that
finished), inner steps kept (a joiner's steps count from the step it joined at), the seconds
the surviving replicas spent blocked per failure (beyond the failure-free run's blocked
seconds) and the longest single wait, and the wall seconds lost per failure against the
failure-free run. Targets (the elastic training issue): elastic NoLoCo loses at most
``--peer-timeout`` seconds per failure on the survivors and ends within 2% of the
failure-free validation loss; restart-from-checkpoint loses a whole restart per failure.

    python benchmarks/churn.py                 # ~10 min on 2 cores; --record to keep it
    python benchmarks/churn.py --quick         # smoke run
    python benchmarks/churn.py --replicas 32 --runs noloco --kills 6 --peer-timeout 10 \
        --record --name churn32                # 32 elastic NoLoCo replicas, 6 kills

With many replicas on few cores the load is the point of the record: it samples the load
average every 5 s of every run (``load_average`` per run: mean and max).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_flags(p, {"sync_every": "H"}, data=common.DEFAULT_DATA, replicas=8,
                         steps=300, sync_every=20, batch_size=8, seq_len=64)
    p.add_argument("--peer-timeout", type=float, default=5.0)
    p.add_argument("--mtbf", type=float, default=15.0,
                   help="mean seconds between two kills (whole run)")
    p.add_argument("--kills", type=int, default=3, help="at most this many kills per run")
    common.add_run_flags(p, {"seed": "seed of the kill schedule"}, seed=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 replicas, 60 steps")
    common.add_output_flags(p, runs_dir=str(common.SCRATCH / "churn_runs"), wait_quiet=False)
    p.add_argument("--runs", default="noloco,diloco,restart",
                   help="which runs: noloco (clean + elastic), diloco (clean + elastic), "
                        "restart (restart-from-checkpoint)")
    p.add_argument("--name", default="churn", help="the record's name (results/NAME.json)")
    a = p.parse_args(argv)
    common.check_data(p, a.data)
    if a.quick:
        a.replicas, a.steps, a.sync_every, a.mtbf, a.kills, a.peer_timeout = 4, 60, 10, 4.0, 1, 3
    common.check_pairs(p, a.replicas)
    a.runs = [x.strip() for x in a.runs.split(",") if x.strip()]
    if not a.runs or set(a.runs) - {"noloco", "diloco", "restart"}:
        p.error("--runs takes noloco, diloco and restart")
    if "restart" in a.runs and "noloco" not in a.runs:
        p.error("--runs restart is measured against noloco: add it")
    return a


def train_args(a: argparse.Namespace, method: str, out: Path, extra: list[str]) -> list[str]:
    return common.noloco_train(common.flags(
        data=a.data, method=method, replicas=a.replicas, steps=a.steps,
        sync_every=a.sync_every, batch_size=a.batch_size, seq_len=a.seq_len,
        eval_every=a.sync_every * 3, eval_sequences=32, log_every=0), out, extra)


def live_workers(out: Path) -> list[int]:
    want = f"NOLOCO_RUN={out.resolve()}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                state = (d / "stat").read_text().split()[2]
            except OSError:
                continue
            if want in env and state != "Z":
                pids.append(int(d.name))
    return sorted(pids)


def run(cmd: list[str], out: Path, gaps: list[float]) -> dict[str, Any]:
    """Run ``cmd``; kill a random live worker after each of ``gaps`` (seconds, cumulative)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kills: list[float] = []
    rng = random.Random(len(gaps))

    def killer() -> None:
        for gap in gaps:
            deadline = time.perf_counter() + gap
            while time.perf_counter() < deadline:
                if proc.poll() is not None:
                    return
                time.sleep(0.1)
            pids = live_workers(out)
            if len(pids) < 2:
                continue
            try:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills.append(time.perf_counter() - t0)
            except ProcessLookupError:
                pass

    loads: list[float] = []
    th = threading.Thread(target=killer, daemon=True)
    th.start()
    threading.Thread(target=common.sample_loads, args=(lambda: proc.poll() is None, loads),
                     daemon=True).start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    th.join(timeout=1)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd)}):\n{stderr[-3000:]}")
    curve = [(m["wall_seconds"], m["val_loss"])
             for m in common.read_jsonl(out / "metrics.jsonl")]
    return {"wall_seconds": wall, "kills_at": kills, "summary": common.read_summary(out),
            "curve": curve, "load_average": {**common.load_stats(loads), "samples": len(loads)},
            "stderr_tail": stderr[-1500:]}


def kept_steps(s: dict[str, Any], steps: int, replicas: int) -> int:
    """Inner steps whose result is in the final weights: a joiner's count from the step it
    (last) joined at."""
    el = s.get("elastic")
    if not el:
        return steps * replicas
    joined_at = {}
    for j in el["joins"]:
        if j.get("kind") == "donated":
            joined_at[j["to"]] = max(joined_at.get(j["to"], 0), j["step"])
    return sum(steps - joined_at.get(r, 0) for r in el["replicas_finished"])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    json_path, png_path = common.out_paths(a.name, a.out_dir, a.quick, a.record)
    runs_dir = Path(a.runs_dir or (common.SCRATCH / "churn_runs"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    gaps = [rng.expovariate(1 / a.mtbf) + (2.0 if i == 0 else 0.0) for i in range(a.kills)]
    elastic = ["--elastic", "--peer-timeout", str(a.peer_timeout)]
    every = {
        "noloco_clean": ("noloco", elastic, []),
        "noloco_elastic": ("noloco", [*elastic, "--respawn", str(a.kills)], gaps),
        "diloco_clean": ("diloco", elastic, []),
        "diloco_elastic": ("diloco", [*elastic, "--respawn", str(a.kills)], gaps),
        "noloco_restart": ("noloco", ["--max-restarts", str(a.kills), "--checkpoint-every",
                                      str(a.sync_every)], gaps),
    }
    plan = {k: v for k, v in every.items()
            if ("restart" if k == "noloco_restart" else k.split("_")[0]) in a.runs}
    rec = common.start_record(a.name, {**vars(a), "kill_gaps_seconds": gaps})
    t_start = time.perf_counter()
    results: dict[str, Any] = {}
    for name, (method, extra, kill_gaps) in plan.items():
        out = runs_dir / name
        print(f"[churn] {name} ...", file=sys.stderr, flush=True)
        results[name] = run(train_args(a, method, out, extra), out, kill_gaps)
        s = results[name]["summary"]
        print(f"[churn] {name}: {results[name]['wall_seconds']:.1f} s, loss "
              f"{s['final_val_loss']:.4f}, kills {len(results[name]['kills_at'])}",
              file=sys.stderr, flush=True)
    table = {}
    for name, r in results.items():
        s = r["summary"]
        method = name.split("_")[0]
        clean = results[f"{method}_clean"]
        cs = clean["summary"]
        failures = len(s.get("failures") or [])
        row = {"wall_seconds": r["wall_seconds"], "failures": failures,
               "final_val_loss": s["final_val_loss"],
               "loss_vs_clean": s["final_val_loss"] / cs["final_val_loss"] - 1,
               "steps_kept": kept_steps(s, a.steps, a.replicas),
               "wall_lost_per_failure": ((r["wall_seconds"] - clean["wall_seconds"]) / failures
                                         if failures else None)}
        if s.get("elastic") and failures:
            failed = {f["replica"] for f in s["failures"]}
            survivors = [k for k in s["sync_seconds_per_replica"] if int(k) not in failed]
            base = cs["sync_seconds_per_replica"]
            row["survivor_blocked_per_failure"] = max(
                (s["sync_seconds_per_replica"][k] - base[k]) / failures for k in survivors)
            row["survivor_longest_wait"] = max(s["elastic"]["longest_wait_seconds"][k]
                                               for k in survivors)
        table[name] = row
    verdict = {} if "noloco_elastic" not in table else {
        "noloco_survivors_lose_at_most_peer_timeout_per_failure":
            table["noloco_elastic"].get("survivor_blocked_per_failure", 0) <= a.peer_timeout,
        "noloco_within_2pct_of_clean": abs(table["noloco_elastic"]["loss_vs_clean"]) <= 0.02,
    }
    common.write_record(json_path, rec, {"runs": results, "table": table, "verdict": verdict},
                        t_start)
    plt = common.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, r in results.items():
            xs, ys = zip(*r["curve"], strict=True)
            label = name + (" (restarts' lost time not on this axis)"
                            if name == "noloco_restart" else "")
            ax.plot(xs, ys, "-" if "clean" in name else "--", marker="o", ms=3, label=label)
            for k in r["kills_at"]:
                ax.axvline(k, color="grey", lw=0.5, alpha=0.4)
        ax.set_xlabel("wall seconds (training loop)")
        ax.set_ylabel("validation loss")
        ax.set_title(f"{a.replicas} replicas, {len(gaps)} kills (grey: kill times)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        common.save_figure(fig, png_path)
    print(json.dumps({"table": table, "verdict": verdict}, indent=2))
    print(common.wrote(json_path, png_path if plt is not None else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
