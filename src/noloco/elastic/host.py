"""The host of a run's store: ``noloco coordinator`` for runs across machines, the local
launcher for one machine's run.

It listens, writes the store's boot token (:data:`noloco.elastic.keys.BOOT_KEY`) before any
worker can read a key, and runs one :class:`~noloco.elastic.membership.Monitor` for each run
epoch that registers (:data:`noloco.elastic.keys.RUNS_KEY`): many runs may share one host,
each judged on its own settings. A host holds nothing that the workers cannot rebuild: one
that restarts empty gets a new boot token, the workers move to a new epoch as they reconnect
(:class:`noloco.elastic.deadline.Namespace`), and their registrations bring its monitors
back.

Floor 2 of docs/architecture.md: communication and the methods.
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
from noloco.stop import StopEvent


class Host:
    """The store on ``host:port`` (port 0: a free one, then :attr:`port`) and its monitors.
    With a ``secret`` the store itself listens on 127.0.0.1 only (:attr:`store_port`) and a
    :class:`noloco.elastic.auth.Gate` on ``host:port`` admits only clients that prove it.
    Raises ``OSError`` when it cannot listen there."""

    def __init__(self, host: str, port: int, timeout: float = 60.0,
                 secret: bytes | None = None) -> None:
        import torch.distributed as dist

        self.gate = None
        if secret is not None:
            from noloco.elastic.auth import Gate

            # The gate takes the public address first: a busy port fails before anything
            # else started.
            probe_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe_sock.bind((host, port))
            probe_sock.close()
            inner = "127.0.0.1"
        else:
            inner = host
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((inner, 0 if secret is not None else port))
        sock.listen(1024)
        self.host, self.store_port = host, sock.getsockname()[1]
        self.server = dist.TCPStore(inner, self.store_port, None, True,
                                    timedelta(seconds=timeout), wait_for_workers=False,
                                    master_listen_fd=sock.detach())
        self.port = self.store_port
        """where clients connect: the gate's port, or the store's own"""
        if secret is not None:
            self.gate = Gate(host, port, self.store_port, secret)
            self.port = self.gate.port
        self.boot = secrets.token_hex(8)
        # Before this, a worker that connects finds no token and waits (Namespace.enter).
        self.server.set(BOOT_KEY, self.boot)
        self.monitors: dict[str, Monitor] = {}
        """``RUN_ID/EPOCH`` → its monitor"""
        self._stop = StopEvent()
        self._thread = threading.Thread(target=self._loop, name="noloco-host", daemon=True)
        self._thread.start()

    @property
    def local_address(self) -> str:
        """Where this process reaches the store itself (at :attr:`store_port`)."""
        return "127.0.0.1" if self.gate is not None or self.host in ("0.0.0.0", "") \
            else self.host

    def _loop(self) -> None:
        conn = None
        while not self._stop.wait(0.2):
            try:
                if conn is None:
                    conn = open_store(self.local_address, self.store_port, 30.0,
                                      direct=True)
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
        if self.gate is not None:
            self.gate.stop()
        self._thread.join(5.0)
        for m in self.monitors.values():
            m.stop()


def runs_of(store: Any) -> list[tuple[str, int]]:
    """(run id, epoch) of every run epoch registered at the store ``store`` (a client)."""
    got = probe(store, RUNS_KEY)
    entries = [e for e in (got or b"").decode().split(",") if e]
    return [(e.rpartition("/")[0], int(e.rpartition("/")[2])) for e in entries]
