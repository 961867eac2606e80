"""Slow links for real: every worker in its own network namespace, its link shaped with tbf.

Needs root and iproute2 (otherwise it prints why and exits 0). Two parts, on 8 workers:

(a) **Sync time.** One all-reduce (gloo, through ``TorchCommunicator.all_reduce_mean``) and one
    NoLoCo pair exchange (``TorchCommunicator.exchange`` with the pairs of
    ``noloco.methods.groups_at``) of the tiny model's size and of a larger payload, on uniform
    links (100 Mbit/s and 1 Gbit/s) and with one link 10x slower than the others; measured
    next to the network model's prediction (``noloco.netsim.predict.predict_sync_seconds``):
    all-reduce = ring, 2(N-1)/N·S through the slowest link plus 2(N-1) latencies; exchange =
    S each way through the slower link of the pair plus one latency. Each worker also reads
    its link's byte counter, so the JSON shows how many bytes gloo's algorithm really put on
    the wire (ring-like 2(N-1)/N·S, or something else).
(b) **Training.** ``noloco train`` with ddp, diloco and noloco, each worker started in its
    namespace with torchrun's environment, on the uniform 100 Mbit/s links (and, with
    ``--train-hetero``, on the heterogeneous ones); blocked seconds and wall-clock next to
    ``noloco netsim predict``.

Two exchanges are timed. ``exchange`` is the library's ``TorchCommunicator.exchange``, which
posts its receive before its send. ``exchange_send_first`` is the same pair exchange with the
send posted first (raw ``dist.isend``/``dist.irecv``), kept as the control for why the order
matters on gloo: a send only starts once the peer's "receive ready" notice has arrived, and
that notice travels on the same TCP stream as the peer's own data. A rank that posts its send
first, while its peer's receive is already known, puts its whole payload on the stream before
its own "receive ready" — so the peer's payload cannot start until the first one has crossed
the link, and the two directions run one after the other (about 2x the model on a shaped
link). Posting receives first keeps both notices ahead of both payloads.

Latency cannot be injected here (no ``netem`` in this kernel): the links have the latency of
a veth (tens of microseconds) plus gloo's and Python's own per-message overhead (milliseconds
on a loaded machine). Part (a) measures it with a 4-byte exchange and hands half of that to
the model as its one-way latency; a gloo pair exchange counts two latency terms (the
"receive ready" notice, then the data), the ring all-reduce its 2(N-1) steps.

    python benchmarks/wan.py                # (a) and (b) on uniform links, < 15 min on 2 cores
    python benchmarks/wan.py --train-hetero # (b) on the heterogeneous links too
    python benchmarks/wan.py --quick        # smaller, a couple of minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
import netns  # noqa: E402

PREFIX = "nlcw"
OPS = ("allreduce", "exchange", "exchange_send_first")
SUBNET = "10.77.0.0/24"
PORT = 29511


# ---- the model's prediction ----------------------------------------------------------------
from noloco.netsim.predict import predict_run, predict_sync_seconds  # noqa: E402

PREDICTOR = "noloco.netsim.predict.predict_sync_seconds"
PAIR_LATENCY_TERMS = 2
"""A gloo pair exchange costs two one-way trips: the "receive ready" notice, then the data."""


def predict_sync(method: str, n: int, payload_bytes: float, bandwidth_bps: float,
                 latency_s: float) -> float:
    return float(predict_sync_seconds(method, n, payload_bytes, bandwidth_bps, latency_s,
                                      pair_latency_terms=PAIR_LATENCY_TERMS))


# ---- part (a): one worker's measurements ---------------------------------------------------
def worker_main(spec_path: str) -> None:
    """Runs inside a namespace: time all-reduces and exchanges, write this rank's JSON."""
    import torch
    import torch.distributed as dist

    from noloco.comm import TorchCommunicator
    from noloco.methods import groups_at

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout"]))
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = TorchCommunicator(list(range(n)), group=dist.group.WORLD)
    counter = Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes")

    def tx() -> int:
        return int(counter.read_text())

    rows: list[dict[str, Any]] = []

    def timed(op: str, payload: int, rep: int, fn: Any, peer: int | None = None) -> None:
        dist.barrier()
        b0, t0 = tx(), time.perf_counter()
        fn()
        t1, b1 = time.perf_counter(), tx()
        rows.append({"op": op, "payload_bytes": payload, "rep": rep, "seconds": t1 - t0,
                     "tx_bytes": b1 - b0, "peer": peer})

    def peer_at(step: int) -> int:
        group = next(g for g in groups_at(step, n, 2, seed=0) if rank in g)
        return next(r for r in group if r != rank)

    # Latency probe: a 4-byte exchange, two one-way trips (notice, then data; see
    # PAIR_LATENCY_TERMS), so the one-way latency is half its time.
    tiny = torch.zeros(1)
    for rep in range(spec["latency_reps"]):
        p = peer_at(rep)
        timed("latency", 4, rep, lambda p=p: comm.exchange(tiny, [p]), p)
    def exchange_send_first(x: torch.Tensor, peer: int) -> None:
        # The same exchange with the send posted before the receive (see the module doc).
        buf = torch.empty_like(x)
        works = [dist.isend(x, peer), dist.irecv(buf, peer)]
        for w in works:
            w.wait()

    for payload in spec["payloads"]:
        x = torch.ones(payload // 4)
        for rep in range(-1, spec["reps"]):  # rep -1 is a warm-up (connections, buffers)
            timed("allreduce", payload, rep, lambda x=x: comm.all_reduce_mean(x))
            p = peer_at(rep + 1000)
            timed("exchange", payload, rep, lambda x=x, p=p: comm.exchange(x, [p]), p)
            timed("exchange_send_first", payload, rep,
                  lambda x=x, p=p: exchange_send_first(x, p), p)
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def worker_env(ns: netns.Namespaces, rank: int, extra: dict[str, str] | None = None
               ) -> dict[str, str]:
    n = len(ns.workers)
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK="0",
               # All N workers share this machine's cores: cores / N threads each.
               LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               MASTER_ADDR=ns.workers[0].addr, MASTER_PORT=str(PORT),
               # Without it gloo resolves the hostname to 127.0.0.1 and cannot connect.
               GLOO_SOCKET_IFNAME=ns.workers[rank].ifname)
    env.update(extra or {})
    return env


def run_workers(ns: netns.Namespaces, argv: list[str], timeout: float, log_dir: Path,
                tag: str) -> float:
    """Start ``argv`` in every namespace, wait for all; returns the wall seconds."""
    t0 = time.perf_counter()
    procs = []
    for w in ns.workers:
        log = open(log_dir / f"{tag}.rank{w.index}.log", "w")
        procs.append((ns.popen(w.index, argv, env=worker_env(ns, w.index), stdout=log,
                               stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    failed = []
    for i, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        log.close()
        if rc != 0:
            failed.append((i, rc))
    if failed:
        i = failed[0][0]
        tail = (log_dir / f"{tag}.rank{i}.log").read_text()[-2000:]
        raise RuntimeError(f"{tag}: workers {failed} failed; rank {i} log tail:\n{tail}")
    return time.perf_counter() - t0


def sync_scenario(name: str, rates: list[float], payloads: list[int], reps: int,
                  work: Path) -> dict[str, Any]:
    n = len(rates)
    out = work / f"sync-{name}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"payloads": payloads, "reps": reps, "latency_reps": 20, "timeout": 300,
            "out": str(out)}
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    with netns.Namespaces(rates, prefix=PREFIX, subnet=SUBNET) as ns:
        qdisc = ns.qdiscs(0)
        wall = run_workers(ns, [sys.executable, str(Path(__file__).resolve()), "--worker",
                                str(spec_path)], timeout=600, log_dir=out, tag="sync")
    rows = [dict(r, rank=k) for k in range(n)
            for r in json.loads((out / f"rank{k}.json").read_text())]
    # One-way latency: half a 4-byte exchange (gloo overhead included, like ping's RTT/2).
    lat = statistics.median(r["seconds"] for r in rows if r["op"] == "latency") / 2
    slowest = min(rates)
    result: dict[str, Any] = {"name": name, "rates_bps": rates, "workers": n,
                              "latency_s": lat, "wall_seconds": wall, "qdisc_worker0": qdisc,
                              "payloads": []}
    for payload in payloads:
        entry: dict[str, Any] = {"payload_bytes": payload}
        for op in OPS:
            mine = [r for r in rows if r["op"] == op and r["payload_bytes"] == payload
                    and r["rep"] >= 0]
            per_rep_mean, per_rep_max, pred_mean, pred_max = [], [], [], []
            for rep in sorted({r["rep"] for r in mine}):
                rr = [r for r in mine if r["rep"] == rep]
                secs = [r["seconds"] for r in rr]
                per_rep_mean.append(sum(secs) / len(secs))
                per_rep_max.append(max(secs))
                if op == "allreduce":
                    p = [predict_sync("ddp", n, payload, slowest, lat)] * len(rr)
                else:  # both exchanges
                    p = [predict_sync("noloco", n, payload,
                                      min(rates[r["rank"]], rates[r["peer"]]), lat)
                         for r in rr]
                pred_mean.append(sum(p) / len(p))
                pred_max.append(max(p))
            tx = [r["tx_bytes"] for r in mine]
            model_bytes = (2 * (n - 1) / n * payload if op == "allreduce" else payload)
            m_mean, m_max = statistics.median(per_rep_mean), statistics.median(per_rep_max)
            p_mean, p_max = statistics.median(pred_mean), statistics.median(pred_max)
            entry[op] = {
                "measured_mean_s": m_mean, "measured_max_s": m_max,
                "predicted_mean_s": p_mean, "predicted_max_s": p_max,
                "measured_over_predicted_mean": m_mean / p_mean,
                "measured_over_predicted_max": m_max / p_max,
                "per_rep_mean_s": per_rep_mean, "per_rep_max_s": per_rep_max,
                "wire_bytes_per_rank": statistics.median(tx),
                "model_bytes_per_rank": model_bytes,
                "wire_over_model_bytes": statistics.median(tx) / model_bytes,
            }
        ar = entry["allreduce"]
        for op in OPS[1:]:
            ex = entry[op]
            ex["speedup_mean"] = ar["measured_mean_s"] / ex["measured_mean_s"]
            ex["speedup_max"] = ar["measured_max_s"] / ex["measured_max_s"]
            ex["predicted_speedup_mean"] = ar["predicted_mean_s"] / ex["predicted_mean_s"]
            ex["predicted_speedup_max"] = ar["predicted_max_s"] / ex["predicted_max_s"]
        result["payloads"].append(entry)
    return result


# ---- part (b): training runs -------------------------------------------------------------
def train_scenario(name: str, rates: list[float], methods: list[str], args: argparse.Namespace,
                   latency_s: float, work: Path) -> list[dict[str, Any]]:
    out_rows = []
    for method in methods:
        run_dir = work / f"train-{name}-{method}"
        argv = common.noloco_train(
            common.flags(method=method, replicas=len(rates), data=args.data, preset="tiny",
                         batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                         eval_every=args.steps, eval_sequences=args.batch_size, warmup=2,
                         log_every=args.steps, comm_timeout=600), run_dir,
            common.flags(sync_every=args.sync_every) if method != "ddp" else [])
        with netns.Namespaces(rates, prefix=PREFIX, subnet=SUBNET) as ns:
            launch_wall = run_workers(ns, argv, timeout=900, log_dir=work,
                                      tag=f"train-{name}-{method}")
        s = common.read_summary(run_dir)
        row: dict[str, Any] = {
            "scenario": name, "method": method, "rates_bps": rates, "run_dir": str(run_dir),
            "command": " ".join(argv[1:]), "launch_wall_seconds": launch_wall,
            **common.kept(s, ("replicas", "steps", "outer_steps", "sync_every",
                              "param_bytes", "final_val_loss", "bytes_sent_per_replica",
                              "sync_seconds", "compute_seconds", "train_seconds",
                              "wall_seconds", "compute_utilisation")),
        }
        row["predicted"] = predict_training(run_dir, method, rates, latency_s)
        out_rows.append(row)
        print(f"  {name:14s} {method:7s} blocked {s['sync_seconds']:7.2f} s "
              f"(predicted {row['predicted']['sync_seconds']:7.2f})  train "
              f"{s['train_seconds']:7.2f} s (predicted {row['predicted']['wall_seconds']:7.2f})"
              f"  val {s['final_val_loss']:.3f}", flush=True)
    return out_rows


def predict_training(run_dir: Path, method: str, rates: list[float], latency_s: float
                     ) -> dict[str, Any]:
    """``noloco netsim predict`` for this run on its own network.

    ddp and diloco all-reduce through the slowest link: netsim's ring formula at the slowest
    rate is the whole prediction. noloco: netsim has one bandwidth per run, which fits the
    uniform links only. With one slow link the benchmark replays the run's own pairs
    (``groups_at``) on per-worker clocks — each pair starts its exchange when the later of
    the two arrives and takes netsim's exchange time at the pair's slower rate — so a late
    worker delays its next partners, as in ``netsim blocking``. On uniform links that replay
    equals netsim's closed form; both are in the JSON (``netsim_*`` keys)."""
    slow = min(rates)
    p = predict_run(run_dir, slow, latency_s, methods=(method,),
                    pair_latency_terms=PAIR_LATENCY_TERMS).methods[0]
    out = {"sync_seconds": p.exposed_sync_seconds, "seconds_per_sync": p.seconds_per_sync,
           "sync_events": p.sync_events, "compute_seconds": p.compute_seconds,
           "source": "noloco.netsim.predict.predict_run",
           "cli": f"noloco netsim predict {run_dir} --bandwidth {int(slow)} "
                  f"--latency {latency_s:.6f} --methods {method} "
                  f"--pair-latency-terms {PAIR_LATENCY_TERMS}"}
    if method == "noloco":
        s = common.read_summary(run_dir)
        seed = json.loads((run_dir / "config.json").read_text()).get("train", {}).get("seed", 0)
        out["netsim_sync_seconds"] = out["sync_seconds"]
        out["sync_seconds"] = gossip_blocked_seconds(rates, p.payload_bytes, latency_s,
                                                     s["outer_steps"], seed)
        out["source"] += " (exchange time) + pair replay on per-worker clocks"
    out["wall_seconds"] = out["compute_seconds"] + out["sync_seconds"]
    return out


def gossip_blocked_seconds(rates: list[float], payload_bytes: float, latency_s: float,
                           outer_steps: int, seed: int) -> float:
    """Mean seconds a worker waits in NoLoCo's pair exchanges, replaying the run's pairs.

    Every worker computes the same time between outer steps, so only the exchanges move the
    clocks apart: a pair finishes at max(its two clocks) + its exchange time."""
    from noloco.methods import groups_at

    n = len(rates)
    clock, blocked = [0.0] * n, [0.0] * n
    for k in range(outer_steps):
        for i, j in groups_at(k, n, 2, seed):
            t = predict_sync("noloco", n, payload_bytes, min(rates[i], rates[j]), latency_s)
            end = max(clock[i], clock[j]) + t
            blocked[i] += end - clock[i]
            blocked[j] += end - clock[j]
            clock[i] = clock[j] = end
    return sum(blocked) / n


# ---- record ------------------------------------------------------------------------------
def tiny_param_bytes() -> int:
    from noloco.data import make_tokenizer
    from noloco.model import build, count_params, preset

    vocab = make_tokenizer("bytes").vocab_size
    model = build(preset("tiny", vocab_size=vocab), device="meta", seed=0)
    return 4 * count_params(model)


def machine() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(), "date": datetime.datetime.now().isoformat()}


def plot(record: dict[str, Any], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    colors = {"allreduce": "tab:red", "exchange": "tab:blue", "exchange_send_first": "tab:cyan"}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    ax = axes[0]
    labels: list[str] = []
    for sc in record["sync"]:
        for e in sc["payloads"]:
            x = len(labels)
            for k, op in enumerate(OPS):
                d, xo = e[op], x + (k - 1) * 0.27
                ax.bar(xo, d["measured_mean_s"], 0.25, color=colors[op],
                       label=f"{op}, measured" if x == 0 else None)
                ax.plot([xo - 0.12, xo + 0.12], [d["predicted_mean_s"]] * 2, color="black",
                        lw=2, label="model" if x == k == 0 else None)
            labels.append(f"{sc['name']}\n{e['payload_bytes'] / 1e6:.1f} MB")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("seconds blocked in one sync (mean over workers)")
    ax.set_title(f"(a) one sync, {record['workers']} workers: gloo all-reduce vs pair exchange")
    ax.legend(fontsize=7)
    ax = axes[1]
    rows = record["train"]
    for i, r in enumerate(rows):
        ax.bar(i - 0.2, r["sync_seconds"], 0.38, color="tab:orange",
               label="blocked, measured" if i == 0 else None)
        ax.bar(i + 0.2, r["predicted"]["sync_seconds"], 0.38, color="tab:gray",
               label="blocked, netsim predict" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{r['scenario']}\n{r['method']}" for r in rows],
                  fontsize=7)
    ax.set_ylabel("seconds blocked over the run (mean over workers)")
    ax.set_title(f"(b) training, {rows[0]['steps'] if rows else 0} steps")
    ax.legend(fontsize=7)
    return common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rates", default="100e6,1e9",
                    help="uniform link rates to measure, bits/s, comma-separated")
    ap.add_argument("--hetero-rate", type=float, default=100e6,
                    help="the fast links of the heterogeneous case, bits/s")
    ap.add_argument("--slow-factor", type=float, default=10.0,
                    help="the slow link of the heterogeneous case is this many times slower")
    ap.add_argument("--large-mb", type=float, default=16.0,
                    help="the larger payload, MB (bandwidth-dominated)")
    ap.add_argument("--reps", type=int, default=3)
    # part (b)'s runs; the recorded run names its --data (the default: every clone has it)
    common.add_run_flags(ap, steps=12, sync_every=4, batch_size=4, seq_len=64,
                         data=common.DEFAULT_DATA)
    ap.add_argument("--no-train", action="store_true", help="skip part (b)")
    ap.add_argument("--train-hetero", action="store_true",
                    help="part (b) on the heterogeneous links too (about +8 min on 2 cores)")
    ap.add_argument("--quick", action="store_true", help="fewer cases, for a smoke run")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: the scratch directory; "
                    "benchmarks/results with --record)")
    common.add_record_flag(ap)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0

    ok, why = netns.available()
    if not ok:
        print(f"wan.py: skipped: {why}")
        return 0
    stale = netns.cleanup(PREFIX)
    if stale:
        print(f"removed stale namespaces of a killed run: {', '.join(stale)}")
    if args.quick:
        args.rates, args.reps, args.steps, args.large_mb = "100e6", 2, 8, 8.0
    n = args.workers
    uniform = [float(r) for r in args.rates.split(",")]
    slow = args.hetero_rate / args.slow_factor
    hetero_rates = [args.hetero_rate] * (n - 1) + [slow]
    tiny = tiny_param_bytes()
    large = int(args.large_mb * 1e6) // 4 * 4
    t_start = time.perf_counter()
    record: dict[str, Any] = {
        "benchmark": "wan", "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine(), "predictor": PREDICTOR, "workers": n,
        "tiny_param_bytes": tiny, "large_payload_bytes": large,
        "shaping": {"qdisc": "tbf on both veth ends", "tbf": netns.tbf_args(1e8),
                    "note": "burst = max(rate/250 B, 16 kB), limit = 0.1 s of data"},
        "sync": [], "train": [], "part_seconds": {},
    }
    with tempfile.TemporaryDirectory(prefix="wan-") as tmp:
        work = Path(tmp)
        cases = [(f"{r / 1e6:g}Mbit", [r] * n) for r in uniform]
        cases.append((f"{args.hetero_rate / 1e6:g}Mbit+1slow", hetero_rates))
        for name, rates in cases:
            # Time scales with 1/rate: the slow case gets the tiny payload only.
            payloads = [tiny] if min(rates) < 50e6 else [tiny, large]
            print(f"(a) {name}: payloads {[p / 1e6 for p in payloads]} MB", flush=True)
            t0 = time.perf_counter()
            sc = sync_scenario(name, rates, payloads, args.reps, work)
            record["part_seconds"][f"sync {name}"] = time.perf_counter() - t0
            record["sync"].append(sc)
            for e in sc["payloads"]:
                ar = e["allreduce"]
                print(f"    {e['payload_bytes'] / 1e6:5.1f} MB  all-reduce "
                      f"{ar['measured_mean_s']:.3f} s (model {ar['predicted_mean_s']:.3f}, "
                      f"wire/model bytes {ar['wire_over_model_bytes']:.3f})", flush=True)
                for op in OPS[1:]:
                    ex = e[op]
                    print(f"      {op:20s} {ex['measured_mean_s']:.3f} s (model "
                          f"{ex['predicted_mean_s']:.3f}) speed-up over all-reduce: mean "
                          f"x{ex['speedup_mean']:.2f}, slowest worker x{ex['speedup_max']:.2f}",
                          flush=True)
        if not args.no_train:
            if args.data != "builtin" and not Path(args.data).is_file():
                print(f"(b) skipped: no data at {args.data}")
            else:
                lat = record["sync"][0]["latency_s"]
                train_cases = [cases[0]] + ([cases[-1]] if args.train_hetero else [])
                for name, rates in train_cases:
                    print(f"(b) {name}: training", flush=True)
                    t0 = time.perf_counter()
                    record["train"] += train_scenario(name, rates, ["ddp", "diloco", "noloco"],
                                                      args, lat, work)
                    record["part_seconds"][f"train {name}"] = time.perf_counter() - t0
                for r in record["train"]:
                    r.pop("run_dir")  # a temporary directory, gone after the run
    record["machine"]["loadavg_end"] = os.getloadavg()
    record["seconds"] = time.perf_counter() - t_start
    record["targets"] = targets(record)
    json_path, png_path = common.out_paths("wan", args.out, args.quick, args.record)
    common.write_json(json_path, record)
    drawn = plot(record, png_path)
    print(json.dumps(record["targets"], indent=1))
    print(f"{common.wrote(json_path, drawn)} in {record['seconds']:.0f} s")
    return 0


def targets(record: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, checked against this run's numbers."""
    within: list[dict[str, Any]] = []
    speed: dict[str, dict[str, list[dict[str, Any]]]] = {
        op: {"uniform": [], "hetero": []} for op in OPS[1:]}
    for sc in record["sync"]:
        kind = "uniform" if len(set(sc["rates_bps"])) == 1 else "hetero"
        for e in sc["payloads"]:
            case = f"{sc['name']} {e['payload_bytes']} B"
            for op in OPS:
                within.append({"case": f"{case} {op}",
                               "measured_over_predicted": e[op]["measured_over_predicted_mean"]})
            for op in OPS[1:]:
                speed[op][kind].append({"case": case, "speedup_mean": e[op]["speedup_mean"],
                                        "speedup_max": e[op]["speedup_max"]})

    def met(rows: list[dict[str, Any]], key: str, bar: float) -> bool | None:
        return all(r[key] >= bar for r in rows) if rows else None

    out: dict[str, Any] = {"sync_within_30pct": {
        "target": "0.7 <= measured/predicted <= 1.3 (mean over workers)",
        "met": {op: all(0.7 <= w["measured_over_predicted"] <= 1.3 for w in within
                        if w["case"].endswith(" " + op)) for op in OPS},
        "cases": within}}
    for op in OPS[1:]:
        out[f"{op}_speedup"] = {
            "uniform_1.7x": {"mean": met(speed[op]["uniform"], "speedup_mean", 1.7),
                             "slowest": met(speed[op]["uniform"], "speedup_max", 1.7)},
            "hetero_3x": {"mean": met(speed[op]["hetero"], "speedup_mean", 3),
                          "slowest": met(speed[op]["hetero"], "speedup_max", 3)},
            "cases": speed[op]}
    return out


if __name__ == "__main__":
    sys.exit(main())
