"""``noloco coordinator``: the meeting point of an elastic run across machines.

It hosts the run's c10d ``TCPStore`` — the store the replicas keep their heartbeats,
membership snapshots, arrival sets and process-group rendezvous in (:mod:`noloco.elastic`) —
and nothing else: it takes part in no training operation, and holds no state a replica
cannot live without except the store itself (run it on the most reliable machine). Each
machine then runs its replicas with ``noloco train --elastic --coordinator HOST:PORT
--replica-ids ...``; a machine that joins late, or again after a crash, runs the same command
and its replicas join from live ones.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("coordinator", help="host the store of an elastic run across machines",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (default: every interface)")
    p.add_argument("--port", type=int, default=29400, help="port (default 29400)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    import torch.distributed as dist

    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ns.host, ns.port))
        sock.listen(1024)
    except OSError as e:
        print(f"noloco: error: cannot listen on {ns.host}:{ns.port} ({e.strerror})",
              file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    store = dist.TCPStore(ns.host, port, None, True, timedelta(seconds=60),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    from noloco.elastic.membership import Monitor

    monitor = Monitor(store).start()  # liveness, judged here on one clock for every machine
    stop: list[int] = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, _f: stop.append(signum))
    print(f"noloco coordinator: listening on {ns.host}:{port}; on each machine run: noloco "
          f"train --elastic --coordinator THIS_HOST:{port} --replica-ids ... (Ctrl-C stops)",
          flush=True)
    while not stop:
        time.sleep(0.2)
    monitor.stop()
    del store
    return 0
