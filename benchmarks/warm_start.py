"""Workers forked from a warm parent against fresh worker processes: what a local run's start
costs, and an elastic respawn's.

Each configuration is one ``noloco train`` in a fresh process, run with ``NOLOCO_WARM_START``
1 (*warm*, the default: the launcher forks its workers from one parent that imported torch
once, ``noloco.warm``, and forks that parent from itself), ``program`` (*program*: the same,
with the warm parent started as a program of its own, as a library caller's launcher starts
it) and 0 (*fresh*: every worker a fresh ``python -m noloco.worker``), the modes interleaved
round after round, so all see the same machine. Recorded per run:

- ``wall_seconds``: the command, start to exit (``--steps 1``: nearly all of it is start-up);
- ``cpu_seconds``: user + system CPU of the command and every process under it (the kernel's
  count for waited-for children: launcher, warm parent, workers);
- ``first_step_seconds_max``: from a worker's start to the end of its first step (slowest),
  as the run's summary.json says.

And one elastic run per mode in which replica 1 is killed at step 5 and respawned
(``--respawn 1``): ``respawn_seconds``, from the launcher starting it again to its joining
(the summary's ``joins``).

    python benchmarks/warm_start.py --record     # 2, 4 and 8 replicas, 3 rounds
    python benchmarks/warm_start.py --quick      # 2 replicas, 1 round, no respawn
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MODES = {"warm": "1", "program": "program", "fresh": "0"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="2,4,8", help="replica counts (default 2,4,8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every run (default 3)")
    p.add_argument("--no-respawn", action="store_true", help="leave out the elastic respawn")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 replicas, 1 round, no respawn")
    common.add_output_flags(p, runs_dir=None, wait_quiet=False)
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.rounds, a.no_respawn = "2", 1, True
    a.replica_counts = common.replica_counts(p, a.replicas, 2,
                                             " (one replica runs in the launcher)")
    common.check_at_least_one(p, a, "rounds")
    return a


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU seconds of the command and all it waited for); RuntimeError on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    _, wall = common.run_checked(cmd, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def train_cmd(out: Path, *args: str) -> list[str]:
    return common.noloco_train([*common.flags(
        preset="tiny", data="builtin", max_tokens=200000, batch_size=4, seq_len=64,
        eval_sequences=4, checkpoint_every=0, log_every=0, method="noloco"), *args], out)


def start_run(replicas: int, mode: str, out: Path, cache: str) -> dict[str, Any]:
    env = {**os.environ, "NOLOCO_WARM_START": MODES[mode], "NOLOCO_TOKEN_CACHE": cache}
    wall, cpu = timed(train_cmd(out, *common.flags(replicas=replicas, steps=1, eval_every=1)),
                      env)
    st = common.read_summary(out)["startup"]
    return {"wall_seconds": wall, "cpu_seconds": cpu,
            "first_step_seconds_max": st.get("first_step_seconds_max")}


def respawn_run(mode: str, out: Path, cache: str) -> dict[str, Any]:
    env = {**os.environ, "NOLOCO_WARM_START": MODES[mode], "NOLOCO_TOKEN_CACHE": cache}
    wall, cpu = timed(train_cmd(
        out, *common.flags(replicas=2, steps=40, sync_every=5, eval_every=20), "--elastic",
        *common.flags(peer_timeout=3, inject_fault="kill:1@5", respawn=1)), env)
    s = common.read_summary(out)
    started = [j["started"] for j in s["elastic"]["joins"] if "started" in j]
    joined = [j for j in s["elastic"]["joins"] if j.get("kind") == "joined"]
    respawn = None
    if started and joined and "t" in joined[0]:
        respawn = joined[0]["t"] - started[0]
    return {"wall_seconds": wall, "cpu_seconds": cpu, "respawn_seconds": respawn,
            "joined": bool(joined)}


def measure(a: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    cache = str(scratch / "tokens")  # tokenised once, before the first measured run
    start_run(a.replica_counts[0], "warm", scratch / "warm-up", cache)
    runs: dict[str, Any] = {m: {str(n): [] for n in a.replica_counts} for m in MODES}
    respawns: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for k in range(a.rounds):
        order = list(MODES) if k % 2 == 0 else list(reversed(MODES))
        for n in a.replica_counts:
            for mode in order:
                r = start_run(n, mode, scratch / f"run-{mode}-{n}", cache)
                runs[mode][str(n)].append(r)
                print(f"round {k + 1}: {n} replicas, {mode:>7}: wall {r['wall_seconds']:6.2f} s"
                      f" | CPU {r['cpu_seconds']:6.2f} s | first step "
                      f"{r['first_step_seconds_max'] or 0:5.2f} s", flush=True)
        for mode in order if not a.no_respawn else []:
            r = respawn_run(mode, scratch / f"respawn-{mode}", cache)
            respawns[mode].append(r)
            print(f"round {k + 1}: elastic respawn, {mode:>7}: wall {r['wall_seconds']:6.2f} s |"
                  f" CPU {r['cpu_seconds']:6.2f} s | respawn to joined "
                  f"{r['respawn_seconds'] or 0:5.2f} s", flush=True)
    return {"runs": runs, "respawns": respawns}


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def medians(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, Any]:
    """The median of ``key`` per mode; ``ratio``: warm ÷ fresh, ``ratio_program``: warm ÷
    program (below 1: the warm start is cheaper)."""
    m = {mode: median([r[key] for r in runs[mode] if r[key] is not None] or [0.0])
         for mode in MODES}
    return {**m, "ratio": m["warm"] / m["fresh"] if m["fresh"] else None,
            "ratio_program": m["warm"] / m["program"] if m["program"] else None}


def judge(res: dict[str, Any]) -> dict[str, Any]:
    """Medians per mode and their ratios, per replica count and for the respawn."""
    out: dict[str, Any] = {
        n: {key: medians({mode: res["runs"][mode][n] for mode in MODES}, key)
            for key in ("wall_seconds", "cpu_seconds", "first_step_seconds_max")}
        for n in res["runs"]["warm"]}
    out["elastic_respawn"] = {
        key: medians(res["respawns"], key)
        for key in (("wall_seconds", "cpu_seconds", "respawn_seconds")
                    if res["respawns"]["warm"] else ())}
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    rec = common.start_record("warm_start", {k: v for k, v in vars(a).items()
                                             if k != "replica_counts"})
    with tempfile.TemporaryDirectory(prefix="noloco-warm-") as tmp:
        res = measure(a, Path(tmp))
    judged = judge(res)
    json_path, png_path = common.out_paths("warm_start", a.out_dir, a.quick, a.record)
    common.write_record(json_path, rec, {**res, "judged": judged}, t_start)
    for n in a.replica_counts:
        j = judged[str(n)]
        print(f"{n} replicas: warm/fresh wall {j['wall_seconds']['ratio']:.2f}x, CPU "
              f"{j['cpu_seconds']['ratio']:.2f}x; warm/program wall "
              f"{j['wall_seconds']['ratio_program']:.2f}x, CPU "
              f"{j['cpu_seconds']['ratio_program']:.2f}x")
    plt = common.pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        xs = a.replica_counts
        for ax, key, label in ((axes[0], "wall_seconds", "wall seconds"),
                               (axes[1], "cpu_seconds", "CPU seconds")):
            for mode, style in (("fresh", "o--"), ("program", "s:"), ("warm", "o-")):
                ax.plot(xs, [judged[str(n)][key][mode] for n in xs], style, label=mode)
            ax.set_xlabel("local replicas (noloco train --steps 1)")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
        axes[0].set_title("start-up: warm parent vs fresh workers")
        common.save_figure(fig, png_path)
    print(common.wrote(json_path, png_path if plt is not None else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
