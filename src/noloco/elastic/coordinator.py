"""``noloco coordinator``: the meeting point of an elastic run across machines.

It hosts the c10d ``TCPStore`` that replicas keep their heartbeats, membership snapshots,
arrival sets and process-group rendezvous in (:mod:`noloco.elastic`), for any number of runs
(each under its ``--run-id``), and judges each run's liveness (:mod:`noloco.elastic.host`).
It takes part in no training operation and holds nothing the replicas cannot rebuild: killed
and started again on the same address, it comes back empty and the runs go on in a new epoch
(the replicas train on meanwhile; ``docs/elastic.md``). Each
machine then runs its replicas with ``noloco train --elastic --coordinator HOST:PORT
--replica-ids ...``; a machine that joins late, or again after a crash, runs the same command
and its replicas join from live ones.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("coordinator", help="host the store of an elastic run across machines",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (default: every interface)")
    p.add_argument("--port", type=int, default=29400, help="port (default 29400)")
    p.add_argument("--dashboard", type=int, metavar="PORT",
                   help="serve a live view of every run here (a page that refreshes itself) on "
                        "--dashboard-host:PORT")
    p.add_argument("--dashboard-host", default="127.0.0.1",
                   help="address of the live view (default 127.0.0.1: this machine only)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from noloco.elastic.host import Host

    try:
        host = Host(ns.host, ns.port)
    except OSError as e:
        print(f"noloco: error: cannot listen on {ns.host}:{ns.port} ({e.strerror})",
              file=sys.stderr)
        return 2
    dashboard = None
    if ns.dashboard is not None:
        from noloco.elastic.deadline import open_store
        from noloco.elastic.status import Dashboard

        try:
            dashboard = Dashboard(open_store(host.local_address, host.port, 30.0),
                                  ns.dashboard, ns.dashboard_host)
        except OSError as e:
            print(f"noloco: error: cannot serve the dashboard on {ns.dashboard_host}:"
                  f"{ns.dashboard} ({e.strerror})", file=sys.stderr)
            host.stop()
            return 2
    stop: list[int] = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, _f: stop.append(signum))
    print(f"noloco coordinator: listening on {ns.host}:{host.port}; on each machine run: "
          f"noloco train --elastic --coordinator THIS_HOST:{host.port} --replica-ids ... "
          f"(Ctrl-C stops)", flush=True)
    if dashboard is not None:
        print(f"noloco coordinator: live view on http://{ns.dashboard_host}:{dashboard.port}/",
              flush=True)
    while not stop:
        time.sleep(0.2)
    if dashboard is not None:
        dashboard.stop()
    host.stop()
    return 0
