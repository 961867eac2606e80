"""What payload MACs cost: a NoLoCo pair exchange of the small preset over a shaped 1 Gbit/s link,
sealed and not, side by side.

Two workers, each in its own network namespace (``netns.py``), their links shaped with tbf to
``--rate`` (default 1 Gbit/s). Each round, in turn: the same pair exchange of the model's fp32
weights (what NoLoCo sends; the small preset with the byte tokenizer, ~85 M parameters, ~340 MB)

- ``plain``: unsealed, as a run without a secret sends it;
- ``sealed``: :func:`noloco.integrity.post_exchange` / :func:`~noloco.integrity.finish_peer`,
  the elastic exchange's own code: chunks, each hashed on arrival, the tag after the payload;
- ``sealed_serial``: the control — hash, then send; receive all, then hash — what the MAC
  would cost without the overlap.

The rounds interleave the three, so the machine's load falls on all alike; the record has each
one's quartiles and the ratios of their medians. Target (issue 21): sealed within 10% of plain.
Needs root and iproute2 (otherwise it prints why and exits 0).

    python benchmarks/payload_mac.py --record     # ~3 min on 2 cores
    python benchmarks/payload_mac.py --quick      # the tiny preset, seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import netns  # noqa: E402
from common import (  # noqa: E402
    add_record_flag,
    finish_record,
    out_paths,
    pyplot,
    quartiles,
    save_figure,
    start_record,
    write_json,
)

PREFIX = "nlcm"
SUBNET = "10.79.9.0/24"
PORT = 29391
MODES = ("plain", "sealed", "sealed_serial")


def param_bytes(preset: str) -> int:
    import torch

    from noloco.model import Transformer, count_params
    from noloco.model import preset as args_of

    with torch.device("meta"):
        model = Transformer(args_of(preset, vocab_size=257))
    return 4 * count_params(model)


def worker_main(spec_path: str) -> None:
    """Runs inside a namespace: time the exchanges, write this rank's JSON."""
    import torch
    import torch.distributed as dist

    from noloco.integrity import (
        TAG_BYTES,
        Sealer,
        finish_peer,
        payload_key,
        post_exchange,
    )

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    other = 1 - rank
    store = dist.TCPStore(os.environ["MASTER_ADDR"], PORT, 2, rank == 0,
                          datetime.timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("mac", store), rank, 2,
                               datetime.timedelta(seconds=spec["timeout"]))
    sealer = Sealer(payload_key(b"a benchmark secret, not a real one"))
    x = torch.randn(spec["payload_bytes"] // 4)
    buf = torch.empty_like(x)
    flag = torch.zeros(1)

    def barrier() -> None:
        w = [pg.recv([flag], other, 99), pg.send([torch.zeros(1)], other, 99)]
        for v in w:
            v.wait()

    def exchange(sealed: bool, rnd: int) -> bool:
        works, opened, lost = post_exchange(pg, x, [buf], [(other, other)], rank,
                                            sealer if sealed else None, f"bench/{rnd}")
        assert not lost
        return finish_peer(works[other], opened.get(other))

    def serial(rnd: int) -> bool:
        context = f"bench/{rnd}"
        mac = sealer.seal(x, context, rank, [other])[0]
        got = torch.empty(TAG_BYTES, dtype=torch.uint8)
        works = [pg.recv([buf], other, 0), pg.recv([got], other, 1),
                 pg.send([x], other, 0), pg.send([mac], other, 1)]
        for w in works:
            w.wait()
        return sealer.check(buf, got, context, other, rank)

    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    sealer.seal(x, "hash alone", rank, [other])
    hash_s = time.perf_counter() - t0
    for rnd in range(-1, spec["rounds"]):  # round -1 warms up (connections, buffers)
        for mode in MODES:
            barrier()
            t0 = time.perf_counter()
            ok = serial(rnd) if mode == "sealed_serial" else exchange(mode == "sealed", rnd)
            seconds = time.perf_counter() - t0
            if not ok:
                raise SystemExit(f"round {rnd}: a {mode} payload failed its MAC")
            if rnd >= 0:
                rows.append({"mode": mode, "round": rnd, "seconds": seconds})
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(
        {"rows": rows, "hash_seconds": hash_s}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=1e9, help="link rate, bits/s")
    ap.add_argument("--preset", default="small", help="the model whose weights are exchanged")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 3 rounds")
    ap.add_argument("--out-dir", default=None, help="output directory")
    add_record_flag(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker) or 0
    if not netns.ready("payload_mac.py", PREFIX):
        return 0
    if args.quick:
        args.preset, args.rounds = "tiny", 3
    nbytes = param_bytes(args.preset)
    json_path, png_path = out_paths("payload_mac", args.out_dir, args.quick, args.record)
    rec = start_record("payload_mac", {"rate_bps": args.rate, "preset": args.preset,
                                        "payload_bytes": nbytes, "rounds": args.rounds})
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="payload-mac-") as tmp:
        spec = {"payload_bytes": nbytes, "rounds": args.rounds, "timeout": 600, "out": tmp}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        with netns.Namespaces([args.rate, args.rate], prefix=PREFIX, subnet=SUBNET) as ns:
            procs = []
            for w in ns.workers:
                env = dict(os.environ, RANK=str(w.index), MASTER_ADDR=ns.workers[0].addr,
                           OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=w.ifname)
                procs.append(ns.popen(w.index, [sys.executable, str(Path(__file__).resolve()),
                                                "--worker", str(spec_path)], env=env))
            for p in procs:
                if p.wait(timeout=1800) != 0:
                    raise SystemExit("payload_mac.py: a worker failed")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in (0, 1)]
    # An exchange ends for both when the slower end is done: the round's time is the max.
    per = {m: [max(r["rows"][i]["seconds"] for r in ranks
                   if r["rows"][i]["mode"] == m)
               for i in range(len(ranks[0]["rows"])) if ranks[0]["rows"][i]["mode"] == m]
           for m in MODES}
    stats = {m: quartiles(v) for m, v in per.items()}
    plain = stats["plain"]["median"]
    results = {
        "seconds": stats,
        "overhead_sealed": stats["sealed"]["median"] / plain - 1,
        "overhead_sealed_serial": stats["sealed_serial"]["median"] / plain - 1,
        "hash_seconds": max(r["hash_seconds"] for r in ranks),
        "wire_seconds_at_rate": nbytes * 8 / args.rate,
        "target": "sealed within 10% of plain (issue 21)",
    }
    finish_record(rec, results, time.perf_counter() - t_start)
    write_json(json_path, rec)
    print(f"{args.preset}: {nbytes / 1e6:.0f} MB each way at {args.rate / 1e9:g} Gbit/s: "
          f"plain {plain:.2f} s, sealed {stats['sealed']['median']:.2f} s "
          f"({100 * results['overhead_sealed']:+.1f}%), serial "
          f"{stats['sealed_serial']['median']:.2f} s "
          f"({100 * results['overhead_sealed_serial']:+.1f}%); hashing alone "
          f"{results['hash_seconds']:.2f} s -> {json_path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.boxplot([per[m] for m in MODES], tick_labels=list(MODES))
        ax.set_ylabel("seconds per exchange")
        ax.set_title(f"{args.preset}, {nbytes / 1e6:.0f} MB at {args.rate / 1e9:g} Gbit/s")
        save_figure(fig, png_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
