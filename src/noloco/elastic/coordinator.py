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

Floor 6 of docs/architecture.md: launching and watching runs, and what reads a run directory.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from noloco.errors import ConfigError


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
    p.add_argument("--secret-file", metavar="FILE",
                   help="the run secret every machine must prove (challenge and response; "
                        "the secret is never sent). Default: NOLOCO_SECRET, else "
                        "~/.config/noloco/coordinator.secret, created (readable by its owner "
                        "only) when missing")
    p.add_argument("--insecure", action="store_true",
                   help="serve the store to any client, without a secret (a warning on any "
                        "address but loopback; docs/security.md)")
    p.set_defaults(func=run)


def _secret(ns: argparse.Namespace) -> tuple[bytes | None, str]:
    """The secret the gate asks for (None: --insecure), and a line that says where it
    lives."""
    from noloco.elastic.auth import ENV, create_secret, default_secret_file, load_secret

    if ns.insecure:
        if ns.secret_file:
            raise ConfigError("--insecure and --secret-file contradict each other")
        if ns.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"noloco coordinator: warning: --insecure on {ns.host}: anyone who reaches "
                  f"port {ns.port} can read and write this run's store (docs/security.md)",
                  file=sys.stderr, flush=True)
        return None, ""
    secret = load_secret(ns.secret_file)
    if secret is not None:
        where = ENV if os.environ.get(ENV) is not None else ns.secret_file
        return secret, f"noloco coordinator: the run secret is in {where}"
    path = default_secret_file()
    existed = path.is_file()
    try:
        secret = create_secret(path)
    except OSError as e:
        raise ConfigError(f"cannot create the secret file {path} ({e.strerror}): give one "
                          f"with --secret-file or NOLOCO_SECRET") from None
    return secret, (f"noloco coordinator: the run secret is in {path}"
                    f"{'' if existed else ' (new, readable by you only)'}: copy it to every "
                    f"machine and give it there with --secret-file FILE or NOLOCO_SECRET")


def run(ns: argparse.Namespace) -> int:
    from noloco.elastic.host import Host

    try:
        secret, where = _secret(ns)
    except ConfigError as e:
        print(f"noloco: error: {e}", file=sys.stderr)
        return 2
    try:
        host = Host(ns.host, ns.port, secret=secret)
    except OSError as e:
        print(f"noloco: error: cannot listen on {ns.host}:{ns.port} ({e.strerror})",
              file=sys.stderr)
        return 2
    dashboard = None
    if ns.dashboard is not None:
        from noloco.elastic.deadline import open_store
        from noloco.elastic.status import Dashboard

        try:
            dashboard = Dashboard(open_store(host.local_address, host.store_port, 30.0,
                                             direct=True),
                                  ns.dashboard, ns.dashboard_host)
        except OSError as e:
            print(f"noloco: error: cannot serve the dashboard on {ns.dashboard_host}:"
                  f"{ns.dashboard} ({e.strerror})", file=sys.stderr)
            host.stop()
            return 2
    stop: list[int] = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, _f: stop.append(signum))
    auth = " --secret-file FILE" if secret is not None else ""
    print(f"noloco coordinator: listening on {ns.host}:{host.port}"
          f"{'' if secret is not None else ' (insecure: no secret)'}; on each machine run: "
          f"noloco train --elastic --coordinator THIS_HOST:{host.port}{auth} --replica-ids ... "
          f"(Ctrl-C stops)", flush=True)
    if where:
        print(where, flush=True)
    if dashboard is not None:
        print(f"noloco coordinator: live view on http://{ns.dashboard_host}:{dashboard.port}/",
              flush=True)
    while not stop:
        time.sleep(0.2)
    if dashboard is not None:
        dashboard.stop()
    host.stop()
    return 0
