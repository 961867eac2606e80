"""Store work of elastic membership and agreement, from 16 to 1,024 replicas.

The real code of an elastic run — :class:`noloco.elastic.Membership` (heartbeats, who is
eligible) and :class:`noloco.elastic.ElasticCommunicator` (snapshots, arrival agreement, key
deletion) — with many members and no model, against a real ``noloco coordinator`` (its
``TCPStore`` and its liveness monitor) on loopback. Members are threads, a few processes of
them, each member with its own store connection (as a replica has); one thread per process
beats for all its members on one more connection (beats are per second, not per operation,
and are not counted below). Every member repeats operations, as a replica does at every outer
step:

- ``exchange`` (NoLoCo): read the operation's snapshot (the first member to come fixes it),
  draw the pairs from it, agree on arrival with its partner;
- ``all_reduce`` (DiLoCo): the same snapshot, then agree on arrival with every member.

No bytes move between members (that is gloo's part, measured elsewhere): this is the store's
part of every operation. Each member's store client counts its requests and bytes.

Measured per N and mode: store requests and bytes per member per operation; seconds per
operation per member (median, 95th percentile); the agreement's latency — from the last
member's arrival until every member has the decision (``all_reduce``); and the keys the store
holds after the operations (sampled during the run too). Connecting the members is timed
apart (see ../shared/FACTS.md: connecting many clients is the slow part here).

Targets (issue 19): requests per member per operation the same at every N (≤ 10); one
agreement at N = 1,024 ≤ 1 s on loopback; keys held ≤ 20 × N whatever the run length.

    python benchmarks/elastic_scale.py --record           # N = 16, 64, 256, 1024
    python benchmarks/elastic_scale.py --quick            # smoke run (N = 4, 8; 30 ops)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PEER_TIMEOUT = 10.0
"""long enough that no member of a loaded 2-core machine is ever judged late: every
operation is a full one, so its store work is the steady state's"""


class CountingStore:
    """A store client that counts its requests — round trips to the store: a ``get`` or
    ``multi_get`` is two (the client waits for the keys first), every other call one — and
    the bytes of keys and values they carry (both ways). Everything the membership and
    agreement code calls goes through it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests, self.bytes = inner, 0, 0
        self.kinds: dict[str, int] = {}

    def _n(self, kind: str, *xs: Any) -> None:
        trips = 2 if kind in ("get", "multi_get") else 1
        self.requests += trips
        self.kinds[kind] = self.kinds.get(kind, 0) + trips
        for x in xs:
            if isinstance(x, (list, tuple)):
                self.bytes += sum(len(v) for v in x)
            elif isinstance(x, (str, bytes)):
                self.bytes += len(x)

    def set(self, k: str, v: Any) -> None:
        self._n("set", k, v)
        self.inner.set(k, v)

    def get(self, k: str) -> bytes:
        v = self.inner.get(k)
        self._n("get", k, v)
        return v

    def add(self, k: str, n: int) -> int:
        self._n("add", k)
        return self.inner.add(k, n)

    def append(self, k: str, v: Any) -> None:
        self._n("append", k, v)
        self.inner.append(k, v)

    def check(self, keys: list[str]) -> bool:
        self._n("check", keys)
        return self.inner.check(keys)

    def compare_set(self, k: str, e: Any, d: Any) -> bytes:
        v = self.inner.compare_set(k, e, d)
        self._n("compare_set", k, e, d, v)
        return v

    def multi_get(self, keys: list[str]) -> list[bytes]:
        vs = self.inner.multi_get(keys)
        self._n("multi_get", keys, vs)
        return vs

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._n("wait", keys)
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, k: str) -> bool:
        self._n("delete_key", k)
        return self.inner.delete_key(k)


RUN_ID = "elastic-scale"
"""the members' run at the coordinator"""


# ---- one process of members ------------------------------------------------------------------

def member_process(host: str, port: int, n: int, first: int, count: int, ops: int,
                   mode: str, compute_ms: float) -> dict[str, Any]:
    import torch.distributed as dist

    from noloco.elastic import ElasticCommunicator, Membership, groups_of
    from noloco.elastic.deadline import Namespace, Prefixed

    def tcp() -> Any:
        return dist.TCPStore(host, port, None, False, timedelta(seconds=600))

    # The members' keys under one run's namespace, as a real run's are (the coordinator
    # monitors the run epochs that register).
    ns = Namespace(RUN_ID)
    ns.enter(tcp())

    def client() -> Any:
        return Prefixed(tcp(), ns.prefix)

    t0 = time.perf_counter()
    beat_store = client()
    raw = tcp()
    stores = [CountingStore(client()) for _ in range(count)]
    connect_s = time.perf_counter() - t0
    members = [Membership(s, r, n, PEER_TIMEOUT) for r, s in
               zip(range(first, first + count), stores, strict=True)]
    for m in members:
        m.ready = True
        m.start(beat_store=beat_store, thread=False)
    stop = threading.Event()

    def beats() -> None:  # one thread beats for every member of this process
        while not stop.wait(min(1.0, PEER_TIMEOUT / 5)):
            for m in members:
                m.beat()

    beater = threading.Thread(target=beats, daemon=True)
    beater.start()
    # Every member of every process registered before the first operation.
    raw.add("bench/ready", count)
    raw.wait(["bench/go"], timedelta(seconds=1800))
    kinds0 = [dict(s.kinds) for s in stores]
    samples: list[list[Any]] = [[] for _ in members]

    def run(i: int) -> None:
        m, s = members[i], stores[i]
        comm = ElasticCommunicator(m, PEER_TIMEOUT)
        rng = random.Random(m.replica)
        for c in range(ops):
            # the inner steps between two operations: replicas never arrive in one instant
            time.sleep(rng.uniform(0, 2 * compute_ms) / 1e3)
            m.step = c + 1
            r0, b0, t_in = s.requests, s.bytes, time.monotonic()
            snap = comm.members()
            if mode == "exchange":
                group = next((g for g in groups_of(snap, c, 2) if m.replica in g),
                             [m.replica])
            else:
                group = snap
            final = comm.agree(group)
            samples[i].append((c, t_in, time.monotonic(), s.requests - r0, s.bytes - b0,
                               len(final) == len(group), len(snap) == n))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    beater.join()
    for m in members:
        m.beat(done=True)
    kinds: dict[str, int] = {}
    for s, k0 in zip(stores, kinds0, strict=True):
        for k, v in s.kinds.items():
            kinds[k] = kinds.get(k, 0) + v - k0.get(k, 0)
    return {"connect_seconds": connect_s, "samples": samples, "kinds": kinds}


# ---- the driver ------------------------------------------------------------------------------

def run_n(n: int, ops: int, mode: str, procs: int, compute_ms: float) -> dict[str, Any]:
    import torch.distributed as dist

    port = common.free_port()
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1")
    # --insecure: the members are plain store clients on loopback; what is measured is the
    # store's work, not the gate's (docs/security.md)
    coord = subprocess.Popen([*common.NOLOCO, "coordinator",
                              *common.flags(host="127.0.0.1", port=port), "--insecure"],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert "listening on" in (coord.stdout.readline() if coord.stdout else "")
        procs = min(procs, n)
        share = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
        firsts = [sum(share[:i]) for i in range(procs)]
        t0 = time.perf_counter()
        # Results come back in files: a pipe would fill and block a member process.
        tmp = Path(tempfile.mkdtemp(prefix="noloco-scale-"))
        files = [tmp / f"{f}.json" for f in firsts]
        workers = [subprocess.Popen(
            [sys.executable, __file__, "--member-proc", str(port), str(n), str(f), str(k),
             str(ops), mode, str(compute_ms), str(path)], env=env)
            for f, k, path in zip(firsts, share, files, strict=True)]
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=600))
        while store.add("bench/ready", 0) < n:
            time.sleep(0.2)
        from noloco.elastic.keys import live_key, run_prefix
        live = run_prefix(RUN_ID, 0) + live_key()
        while not (store.check([live]) and len(json.loads(store.get(live))) == n):
            time.sleep(0.2)  # the monitor has seen every member beat
        connected_s = time.perf_counter() - t0
        keys_start = store.num_keys()
        keys_seen = [keys_start]
        store.set("bench/go", "1")
        t1 = time.perf_counter()
        while any(w.poll() is None for w in workers):
            keys_seen.append(store.num_keys())
            time.sleep(0.5)
        ops_s = time.perf_counter() - t1
        if any(w.returncode for w in workers):
            raise RuntimeError(f"a member process failed at N = {n}")
        outs = [json.loads(f.read_text()) for f in files]
        shutil.rmtree(tmp)
        keys_end = store.num_keys()
    finally:
        coord.terminate()
        coord.wait(timeout=30)
    samples = [s for o in outs for member in o["samples"] for s in member]
    per_op: dict[int, list[Any]] = {}
    for s in samples:
        per_op.setdefault(s[0], []).append(s)
    # An operation's agreement latency: from the last member's arrival until every member
    # has the decision (all_reduce: one agreement among all N).
    latency = [max(s[2] for s in xs) - max(s[1] for s in xs) for xs in per_op.values()]
    secs = [s[2] - s[1] for s in samples]
    reqs = [s[3] for s in samples]
    kinds: dict[str, int] = {}
    for o in outs:
        for k, v in o["kinds"].items():
            kinds[k] = kinds.get(k, 0) + v
    return {
        "n": n, "mode": mode, "ops": ops, "member_processes": procs, "compute_ms": compute_ms,
        "connect_seconds": round(connected_s, 2),
        "connect_seconds_per_process": [round(o["connect_seconds"], 2) for o in outs],
        "ops_seconds": round(ops_s, 2),
        "requests_per_member_op": {"mean": statistics.fmean(reqs), "max": max(reqs)},
        "requests_per_member_op_by_kind": {k: v / len(samples) for k, v in sorted(kinds.items())},
        "bytes_per_member_op": statistics.fmean(s[4] for s in samples),
        "seconds_per_member_op": {"median": statistics.median(secs),
                                  "p95": sorted(secs)[int(0.95 * (len(secs) - 1))]},
        "agreement_latency_seconds": common.quartiles(latency),
        # every member arrived in time, and every snapshot held all N (else a loaded machine
        # made a member late, and the counts are not the steady state's)
        "full_agreements": sum(1 for s in samples if s[5]) / len(samples),
        "full_snapshots": sum(1 for s in samples if s[6]) / len(samples),
        "keys_before_ops": keys_start, "keys_held_max": max(keys_seen),
        "keys_held_end": keys_end, "keys_held_per_member": keys_end / n,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, mark in (("exchange", "o-"), ("all_reduce", "s--")):
        rs = [r for r in results if r["mode"] == mode]
        ns = [r["n"] for r in rs]
        axes[0].plot(ns, [r["requests_per_member_op"]["mean"] for r in rs], mark, label=mode)
        axes[1].plot(ns, [r["agreement_latency_seconds"]["median"] for r in rs], mark,
                     label=mode)
        axes[2].plot(ns, [r["keys_held_max"] / r["n"] for r in rs], mark, label=mode)
    for ax, title in zip(axes, ("store requests per member per operation",
                                "agreement latency (s, median)",
                                "keys held / N (max over the run)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("members N")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    axes[0].axhline(10, color="grey", lw=0.8, ls=":")
    axes[1].axhline(1, color="grey", lw=0.8, ls=":")
    axes[2].axhline(20, color="grey", lw=0.8, ls=":")
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--member-proc":
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1)  # a stack of every thread, should one hang
        port, n, first, count, ops = map(int, argv[1:6])
        Path(argv[8]).write_text(json.dumps(member_process(
            "127.0.0.1", port, n, first, count, ops, argv[6], float(argv[7]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,64,256,1024")
    p.add_argument("--ops", default="1000,1000,300,100",
                   help="operations per size (one number: every size)")
    p.add_argument("--modes", default="exchange,all_reduce")
    p.add_argument("--procs", type=int, default=8, help="member processes")
    p.add_argument("--compute-ms", type=float, default=10.0,
                   help="mean milliseconds each member computes between two operations "
                   "(uniform in [0, 2x]; 0: every member arrives at once, the worst case)")
    p.add_argument("--quick", action="store_true", help="smoke run: N = 4, 8; 30 ops")
    common.add_output_flags(p, runs_dir=None, wait_quiet=False)
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.ops, a.procs = "4,8", "30", 2
    sizes = [int(x) for x in a.sizes.split(",")]
    ops = [int(x) for x in a.ops.split(",")]
    ops = ops * len(sizes) if len(ops) == 1 else ops
    if len(ops) != len(sizes):
        p.error("--ops needs one number or one per size")
    json_path, png_path = common.out_paths("elastic_scale", a.out_dir, a.quick, a.record)
    rec = common.start_record("elastic_scale", {"sizes": sizes, "ops": ops, "modes": a.modes,
                                                "procs": a.procs,
                                                "compute_ms": a.compute_ms,
                                                "peer_timeout": PEER_TIMEOUT})
    t0 = time.perf_counter()
    results = []
    for n, k in zip(sizes, ops, strict=True):
        for mode in a.modes.split(","):
            r = run_n(n, k, mode, a.procs, a.compute_ms)
            results.append(r)
            req = r["requests_per_member_op"]["mean"]
            print(f"N={n:>5} {mode:<10} ops={k:<5} requests/op {req:.2f}"
                  f" (max {r['requests_per_member_op']['max']}) | agreement "
                  f"{r['agreement_latency_seconds']['median'] * 1e3:.1f} ms | s/op "
                  f"{r['seconds_per_member_op']['median'] * 1e3:.1f} ms | keys "
                  f"{r['keys_held_max']} max ({r['keys_held_max'] / n:.1f} x N) | connect "
                  f"{r['connect_seconds']:.1f} s", flush=True)
            common.write_record(json_path, rec, results, t0)
    big = [r for r in results if r["mode"] == "all_reduce"]
    rec["targets"] = {
        "requests_per_member_op_max": max(r["requests_per_member_op"]["mean"]
                                          for r in results),
        "requests_at_most_10": all(r["requests_per_member_op"]["mean"] <= 10 for r in results),
        "agreement_at_largest_n_seconds": big[-1]["agreement_latency_seconds"]["median"]
        if big else None,
        "keys_held_at_most_20n": all(r["keys_held_max"] <= 20 * r["n"] for r in results),
    }
    common.write_record(json_path, rec, results, t0)
    plot(results, png_path)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
