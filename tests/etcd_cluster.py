"""An etcd cluster of N members on loopback ports, for tests (Debian's `etcd-server`)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def available() -> tuple[bool, str]:
    if shutil.which("etcd") is None:
        return False, "no etcd here (Debian's etcd-server package)"
    return True, ""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Cluster:
    """``members`` etcd processes on 127.0.0.1, data under ``root``; fast elections (50 ms
    heartbeats, 500 ms election timeout) so a lost leader is replaced within a second."""

    def __init__(self, root: Path, members: int = 3) -> None:
        root.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(2 * members)
        self.client = ports[:members]
        peer = ports[members:]
        names = [f"m{i}" for i in range(members)]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peer, strict=True))
        self.procs: list[subprocess.Popen | None] = []
        for i, name in enumerate(names):
            log = open(root / f"{name}.log", "w")  # noqa: SIM115 - lives with the process
            self.procs.append(subprocess.Popen(
                ["etcd", "--name", name, "--data-dir", str(root / name),
                 "--listen-client-urls", f"http://127.0.0.1:{self.client[i]}",
                 "--advertise-client-urls", f"http://127.0.0.1:{self.client[i]}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer[i]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer[i]}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", "noloco-test", "--heartbeat-interval", "50",
                 "--election-timeout", "500"], stdout=log, stderr=subprocess.STDOUT))
        self.wait_ready()

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client)

    def put_works(self, i: int) -> bool:
        req = urllib.request.Request(f"http://127.0.0.1:{self.client[i]}/v3/kv/put",
                                     json.dumps({"key": "cHJvYmU=", "value": "MQ=="}).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for i, p in enumerate(self.procs):
            while p is not None and not self.put_works(i):
                if time.monotonic() > deadline or p.poll() is not None:
                    raise RuntimeError(f"etcd member {i} did not start")
                time.sleep(0.2)

    def leader(self) -> int:
        """The index of the member that leads now."""
        ids = []
        for i, p in enumerate(self.procs):
            if p is None:
                ids.append(None)
                continue
            req = urllib.request.Request(f"http://127.0.0.1:{self.client[i]}/v3/maintenance/"
                                         f"status", b"{}", {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                st = json.loads(r.read())
            ids.append(st["header"]["member_id"])
            lead = st["leader"]
        return ids.index(lead)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None:
            p.kill()
            p.wait()
            self.procs[i] = None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
