"""The host of a run's store: ``noloco coordinator`` for runs across machines, the local
launcher for one machine's run.

It listens, writes the store's boot token (:data:`noloco.elastic.keys.BOOT_KEY`) before any
worker can read a key, and runs one :class:`~noloco.elastic.membership.Monitor` for each run
epoch that registers (:data:`noloco.elastic.keys.RUNS_KEY`): many runs may share one host,
each judged on its own settings. A host holds nothing that the workers cannot rebuild: one
that restarts empty gets a new boot token, the workers move to a new epoch as they reconnect
(:class:`noloco.elastic.deadline.Namespace`), and their registrations bring its monitors
back.
"""

from __future__ import annotations

import secrets
import socket
import threading
from datetime import timedelta
from typing import Any

from noloco.elastic.deadline import Prefixed, open_store
from noloco.elastic.keys import BOOT_KEY, RUNS_KEY, run_prefix
from noloco.elastic.membership import Monitor, probe


class Host:
    """The store on ``host:port`` (port 0: a free one, then :attr:`port`) and its monitors.
    Raises ``OSError`` when it cannot listen there."""

    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        import torch.distributed as dist

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        self.host, self.port = host, sock.getsockname()[1]
        self.server = dist.TCPStore(host, self.port, None, True, timedelta(seconds=timeout),
                                    wait_for_workers=False, master_listen_fd=sock.detach())
        self.boot = secrets.token_hex(8)
        # Before this, a worker that connects finds no token and waits (Namespace.enter).
        self.server.set(BOOT_KEY, self.boot)
        self.monitors: dict[str, Monitor] = {}
        """``RUN_ID/EPOCH`` → its monitor"""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="noloco-host", daemon=True)
        self._thread.start()

    @property
    def local_address(self) -> str:
        """Where a process on this machine reaches the store."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    def _loop(self) -> None:
        conn = None
        while not self._stop.wait(0.2):
            try:
                if conn is None:
                    conn = open_store(self.local_address, self.port, 30.0)
                for run_id, epoch in runs_of(conn):
                    name = f"{run_id}/{epoch}"
                    if name not in self.monitors:
                        self.monitors[name] = Monitor(
                            conn, prefix=run_prefix(run_id, epoch)).start()
            except Exception:  # noqa: BLE001 - the store is going away; try again
                conn = None

    def view(self, run_id: str, epoch: int) -> Prefixed:
        """The keys of one run epoch, read through the host's own client."""
        return Prefixed(self.server, run_prefix(run_id, epoch))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for m in self.monitors.values():
            m.stop()


def runs_of(store: Any) -> list[tuple[str, int]]:
    """(run id, epoch) of every run epoch registered at the store ``store`` (a client)."""
    got = probe(store, RUNS_KEY)
    entries = [e for e in (got or b"").decode().split(",") if e]
    return [(e.rpartition("/")[0], int(e.rpartition("/")[2])) for e in entries]
