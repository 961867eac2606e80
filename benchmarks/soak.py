"""A chaos soak: elastic NoLoCo through kills, stalls, a skewed clock and a coordinator restart.

Two runs side by side in one invocation (the same load on both), each of ``--replicas``
replicas on two "machines" (two launchers with ``--replica-ids`` at one ``noloco
coordinator`` on loopback; machine 1's clocks run ``--skew`` ahead under libfaketime):

- ``calm``: nothing goes wrong — the reference;
- ``chaos``: every ~``--mtbf`` seconds (exponential, seeded) a random live worker is killed
  (SIGKILL) or stalled (SIGSTOP for ``--stall`` seconds, then SIGCONT); once, after
  ``--outage-at`` of the calm run's expected length, the coordinator is killed and started
  again, empty, on the same address ``--outage`` seconds later. ``--respawn`` restarts.

Every inner step is paced (``pace:R:SECONDS``): the run lasts as long on a loaded machine as on
an idle one, and what is measured is the protocol, not the compute.

Recorded: each machine's exit code, the replicas that finished, the bytes each replica sent
in both runs and the chaos run's share of the calm run's, the final validation loss of both
(mean over the replicas), the failures, respawns, partitions and store restarts the summaries
list, the events by kind, the seconds the others spent blocked per chaos event, C++ noise in
the logs, and the load average. Targets (issue 36): every replica finishes, the chaos run
sends >= 70% of the calm run's bytes, its loss is within 2% of the calm run's, no C++ dump.

    python benchmarks/soak.py --record        # ~4 min on 2 cores
    python benchmarks/soak.py --quick         # 4 replicas, one outage, ~1 min
    python benchmarks/soak.py --mtbf 0 --record --name soak_outage_only   # the outage alone
    python benchmarks/soak.py --mtbf 0 --max-lonely-outer-steps 2 --record \
        --name soak_outage_only_k2                 # ... with a tighter bound on lonely steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

FAKETIME = shutil.which("faketime")
CPP_SIGNS = ("frame #", "Exception raised from", "terminate called", "Traceback",
             "connectFullMesh")
"""what a C++ stack dump or a Python traceback leaves in a log"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_flags(p, data=common.DEFAULT_DATA, replicas=8, steps=400, sync_every=5,
                         seed=0)
    p.add_argument("--pace", type=float, default=0.25, help="seconds every inner step takes")
    p.add_argument("--peer-timeout", type=float, default=5.0)
    p.add_argument("--respawn", type=int, default=30)
    p.add_argument("--mtbf", type=float, default=15.0,
                   help="mean seconds between two chaos events (a kill or a stall; 0: none)")
    p.add_argument("--stall", type=float, default=8.0, help="seconds a stalled worker stops")
    p.add_argument("--skew", default="+90s", help="machine 1's clock offset (faketime)")
    p.add_argument("--outage", type=float, default=10.0,
                   help="seconds the coordinator is down (once; 0: never)")
    p.add_argument("--outage-at", type=float, default=0.4,
                   help="when the outage starts, as a share of the calm run's length")
    p.add_argument("--max-lonely-outer-steps", type=int, default=None,
                   help="noloco train's bound on outer steps alone while cut off (default: "
                   "noloco's)")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 replicas, 160 steps")
    common.add_output_flags(p, runs_dir=str(common.SCRATCH / "soak_runs"), wait_quiet=False)
    p.add_argument("--name", default="soak", help="the record's name (results/NAME.json)")
    a = p.parse_args(argv)
    common.check_data(p, a.data)
    if a.quick:
        a.replicas, a.steps, a.mtbf = 4, 160, 12.0
    if a.replicas < 4 or a.replicas % 2:
        p.error("--replicas: an even number of at least 4 (two machines of pairs)")
    return a


def machines(a: argparse.Namespace) -> list[str]:
    half = a.replicas // 2
    return [f"0-{half - 1}", f"{half}-{a.replicas - 1}"]


def train_cmd(a: argparse.Namespace, port: int, ids: str, out: Path, skew: bool) -> list[str]:
    pace = ",".join(f"pace:{r}:{a.pace:g}" for r in range(a.replicas))
    cmd = common.noloco_train([
        *common.flags(data=a.data, method="noloco", replicas=a.replicas, steps=a.steps,
                      sync_every=a.sync_every, eval_every=a.sync_every * 10, batch_size=4,
                      seq_len=32, eval_sequences=8, log_every=0, seed=a.seed), "--elastic",
        *common.flags(peer_timeout=a.peer_timeout, respawn=a.respawn, inject_fault=pace,
                      coordinator=f"127.0.0.1:{port}", replica_ids=ids, threads=1),
        *(common.flags(max_lonely_outer_steps=a.max_lonely_outer_steps)
          if a.max_lonely_outer_steps is not None else [])], out)
    return [FAKETIME, "-f", a.skew, *cmd] if skew and FAKETIME else cmd


def coordinator(port: int, env: dict[str, str]) -> subprocess.Popen:
    p = subprocess.Popen([*common.NOLOCO, "coordinator", "--host", "127.0.0.1", "--port",
                          str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout is not None and "listening on" in p.stdout.readline()
    return p


def workers_of(launchers: list[int]) -> dict[tuple[int, int], int]:
    """(replica, stage) → pid of every live worker under the ``launchers`` (the processes
    named ``noloco rRsS``, noloco.worker.process_name, descended from one of them)."""
    parent, names = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            names[int(d.name)] = (d / "comm").read_text().strip()
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    out = {}
    for pid, name in names.items():
        m = re.fullmatch(r"noloco r(\d+)s(\d+)", name)
        if not m:
            continue
        q = pid
        while q in parent and q not in launchers and q > 1:
            q = parent[q]
        if q in launchers:
            out[(int(m[1]), int(m[2]))] = pid
    return out


def chaos(a: argparse.Namespace, procs: list[subprocess.Popen], coord: list[Any],
          port: int, env: dict[str, str], t0: float, events: list[dict[str, Any]]) -> None:
    """The chaos run's faults, until its machines exit: kills and stalls at exponential
    intervals, and the coordinator's outage once."""
    rng = random.Random(a.seed)
    calm_seconds = a.steps * a.pace
    outage_at = t0 + a.outage_at * calm_seconds
    outage_done = False
    next_event = t0 + 10 + (rng.expovariate(1 / a.mtbf) if a.mtbf > 0 else 0)
    launchers = [p.pid for p in procs]
    while any(p.poll() is None for p in procs):
        now = time.time()
        if not outage_done and a.outage > 0 and now >= outage_at:
            coord[0].kill()
            coord[0].wait()
            events.append({"t": now - t0, "kind": "coordinator down"})
            time.sleep(a.outage)
            coord[0] = coordinator(port, env)
            events.append({"t": time.time() - t0, "kind": "coordinator back"})
            outage_done = True
            continue
        if a.mtbf > 0 and now >= next_event:
            next_event = now + rng.expovariate(1 / a.mtbf)
            live = workers_of(launchers)
            if live:
                (replica, stage), pid = rng.choice(sorted(live.items()))
                kind = rng.choice(("kill", "stall"))
                try:
                    if kind == "kill":
                        os.kill(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGSTOP)
                        threading.Timer(a.stall, _resume, (pid,)).start()
                except ProcessLookupError:
                    continue
                events.append({"t": now - t0, "kind": kind, "replica": replica})
        time.sleep(0.2)


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # killed while stopped
        os.kill(pid, signal.SIGCONT)


def one_run(a: argparse.Namespace, name: str, port: int, out: Path,
            result: dict[str, Any]) -> None:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("NOLOCO_SECRET", secrets.token_hex(32))  # the run's, on every machine
    coord = [coordinator(port, env)]
    t0 = time.time()
    procs = [subprocess.Popen(train_cmd(a, port, ids, out / f"m{m}", skew=m == 1), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m, ids in enumerate(machines(a))]
    events: list[dict[str, Any]] = []
    chaotic = None
    if name == "chaos":
        chaotic = threading.Thread(target=chaos, args=(a, procs, coord, port, env, t0, events))
        chaotic.start()
    outs = [p.communicate() for p in procs]
    if chaotic is not None:
        chaotic.join()
    coord[0].terminate()
    coord[0].wait(timeout=10)
    summaries = []
    for m in range(2):
        try:
            summaries.append(common.read_summary(out / f"m{m}"))
        except (OSError, ValueError):
            summaries.append({})
    result.update(t0=t0, seconds=round(time.time() - t0, 1),
                  exit_codes=[p.returncode for p in procs], events=events,
                  stderr=[err for _, err in outs], summaries=summaries,
                  metrics={r: common.read_jsonl(out / f"m{m}" / "metrics" / f"replica-{r}.jsonl")
                           for m, ids in enumerate(machines(a))
                           for r in range(int(ids.split("-")[0]), int(ids.split("-")[1]) + 1)})


def merged(r: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for s in r["summaries"] for k, v in (s.get(key) or {}).items()}


def elastic(r: dict[str, Any], key: str) -> list[Any]:
    got: list[Any] = []
    for s in r["summaries"]:
        v = (s.get("elastic") or {}).get(key) or []
        got += v if isinstance(v, list) else [v]
    return got


def mean_loss(r: dict[str, Any]) -> float | None:
    losses = merged(r, "final_val_loss_per_replica")
    return sum(losses.values()) / len(losses) if losses else None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    json_path, png_path = common.out_paths(a.name, a.out_dir, a.quick, a.record)
    runs_dir = Path(a.runs_dir or (common.SCRATCH / "soak_runs"))
    rec = common.start_record("soak", common.config_of(a))
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {"calm": {}, "chaos": {}}
    loads: list[float] = []
    threads = [threading.Thread(target=one_run, args=(a, n, common.free_port(), runs_dir / n,
                                                      results[n])) for n in results]
    for t in threads:
        t.start()
    common.sample_loads(lambda: any(t.is_alive() for t in threads), loads)
    for t in threads:
        t.join()
    calm, wild = results["calm"], results["chaos"]
    calm_bytes, wild_bytes = merged(calm, "bytes_sent_per_replica"), merged(
        wild, "bytes_sent_per_replica")
    finished = sorted(r for s in wild["summaries"]
                      for r in (s.get("elastic") or {}).get("replicas_finished", []))
    faults = [e for e in wild["events"] if e["kind"] in ("kill", "stall")]
    blocked = {n: max((w for s in r["summaries"] for w in
                       ((s.get("elastic") or {}).get("longest_wait_seconds") or {}).values()),
                      default=None) for n, r in results.items()}
    sync = {n: sum(merged(r, "sync_seconds_per_replica").values())
            for n, r in results.items()}
    kinds = Counter(e["kind"] for s in wild["summaries"]
                    for ev in ((s.get("elastic") or {}).get("events") or {}).values() for e in ev)
    table = {
        "exit_codes": {n: r["exit_codes"] for n, r in results.items()},
        "replicas_finished": finished,
        "bytes_sent_calm": calm_bytes, "bytes_sent_chaos": wild_bytes,
        "bytes_sent_ratio": {k: round(wild_bytes.get(k, 0) / v, 4)
                             for k, v in calm_bytes.items() if v},
        "bytes_sent_total_ratio": round(sum(wild_bytes.values()) / sum(calm_bytes.values()), 4)
        if calm_bytes and sum(calm_bytes.values()) else None,
        "final_val_loss": {n: mean_loss(r) for n, r in results.items()},
        "chaos_events": wild["events"],
        "kills": sum(e["kind"] == "kill" for e in faults),
        "stalls": sum(e["kind"] == "stall" for e in faults),
        "failures": elastic_failures(wild),
        "respawned": sum(1 for j in elastic(wild, "joins") if j.get("kind") in
                         ("joined", "own checkpoint")),
        "partitions": len(elastic(wild, "partitions")),
        "store_restarts": len(elastic(wild, "store_restarts")),
        "event_kinds": dict(kinds),
        "longest_wait_seconds": blocked,
        "sync_seconds_total": sync,
        "blocked_seconds_per_fault": round((sync["chaos"] - sync["calm"]) / max(len(faults), 1)
                                           / a.replicas, 2),
        "run_seconds": {n: r["seconds"] for n, r in results.items()},
        "skew": a.skew if FAKETIME else None,
        "load_average": common.load_stats(loads),
        "cpp_noise_in_logs": sorted({s for r in results.values() for err in r["stderr"]
                                     for s in CPP_SIGNS if s in err}),
    }
    losses = table["final_val_loss"]
    verdict = {
        "every_machine_exits_0": all(c == 0 for r in results.values() for c in r["exit_codes"]),
        "every_replica_finished": finished == list(range(a.replicas)),
        "bytes_at_least_70pct_of_calm": (table["bytes_sent_total_ratio"] or 0) >= 0.7,
        "loss_within_2pct": losses["chaos"] is not None and losses["calm"] is not None
        and losses["chaos"] <= 1.02 * losses["calm"],
        "no_cpp_dump": not table["cpp_noise_in_logs"]}
    common.write_record(json_path, rec, {
        "table": table, "verdict": verdict,
        "stderr_tail": {n: [err[-3000:] for err in r["stderr"]] for n, r in results.items()},
        "t0": {n: r["t0"] for n, r in results.items()},
        "metrics": {n: r["metrics"] for n, r in results.items()}}, start)
    plt = common.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        # Machine 1's records carry its skewed clock: back onto the plot's (machine 0's).
        skew, half = skew_seconds(a.skew) if FAKETIME else 0.0, a.replicas // 2
        on_one_clock = {n: {"t0": r["t0"], "metrics": {
            rep: [{**x, "t": x["t"] - (skew if int(rep) >= half else 0.0)} for x in recs]
            for rep, recs in r["metrics"].items()}} for n, r in results.items()}
        common.plot_bytes_in_time(ax, on_one_clock, "chaos",
                                  lambda n, rep: n if rep == 0 else None)
        colours = {"kill": "red", "stall": "orange"}
        for e in wild["events"]:
            if e["kind"] in colours:
                ax.axvline(e["t"], color=colours[e["kind"]], lw=0.6, alpha=0.6)
        down = [e["t"] for e in wild["events"] if e["kind"] == "coordinator down"]
        up = [e["t"] for e in wild["events"] if e["kind"] == "coordinator back"]
        if down and up:
            ax.axvspan(down[0], up[0], color="grey", alpha=0.25, label="coordinator down")
        ax.set_xlabel("seconds since start (red: a kill, orange: a stall)")
        ax.set_ylabel("MB sent per replica")
        ax.set_title(f"elastic NoLoCo, {a.replicas} replicas on 2 machines: a chaos soak")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        common.save_figure(fig, png_path)
    print(json.dumps({"table": {k: v for k, v in table.items()
                                if k not in ("chaos_events", "failures")},
                      "verdict": verdict}, indent=2))
    common.print_verdict(verdict)
    print(common.wrote(json_path, png_path if plt is not None else None))
    return 0


def skew_seconds(skew: str) -> float:
    """faketime's offset (``+90s``, ``-2m``, ``+1.5h``, ``+30``) in seconds."""
    m = re.fullmatch(r"([+-]?\d+(?:\.\d+)?)([smhd]?)", skew.strip())
    if m is None:
        return 0.0
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]


def elastic_failures(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: f.get(k) for k in ("replica", "step", "kind", "not_restarted")}
            for s in r["summaries"] for f in s.get("failures") or []]


if __name__ == "__main__":
    raise SystemExit(main())
