"""Real slow links on one machine: N network namespaces joined through a shaped bridge.

Topology (everything lives inside namespaces this module creates; the root namespace is never
touched, so nothing here can disturb the machine's own network)::

    {name}-w0  [nl0 10.77.0.1] ==veth== [p0]  \
    {name}-w1  [nl0 10.77.0.2] ==veth== [p1]   >- br0  in {name}-br (the bridge namespace)
    ...                                        /

Worker i's link is its veth pair. Both ends carry a token-bucket filter (``tc qdisc ... tbf``)
at the worker's rate: egress of ``nl0`` limits what the worker sends, egress of ``p{i}`` (the
bridge side) limits what it receives. A transfer from i to j therefore runs at most at
min(rate_i, rate_j), full duplex — the "slowest link" model of the network simulator.
Latency is not injected (the kernel here has no ``netem``); only bandwidth is shaped.

Cleanup: deleting a namespace destroys the veth ends and the bridge inside it, so removing the
namespaces removes everything. :class:`Namespaces` removes them on normal exit, on an
exception and on SIGINT/SIGTERM (the handlers turn the signal into an exception so ``finally``
runs), after killing the processes it started inside them (a namespace stays alive while a
process runs in it). Every namespace name carries the creating process id,
``{prefix}{pid}-...``, so :func:`cleanup` can remove what a killed run (SIGKILL) left behind
without touching a run that is still alive.

Needs root and iproute2 (``ip``, ``tc``); :func:`available` says why not when it cannot work.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_PREFIX = "nlc"
WORKER_IF = "nl0"
"""Name of the worker's interface inside its namespace (give it to GLOO_SOCKET_IFNAME)."""
BRIDGE = "br0"
HZ_SECONDS = 1 / 250
"""The token bucket must hold at least one timer tick of data (HZ = 250 is the usual kernel)."""


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {p.stderr.strip() or p.stdout.strip()}")
    return p


def available() -> tuple[bool, str]:
    """Whether namespaces can be built here, and if not, why (for skip messages)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"iproute2's `{tool}` is not on PATH"
    probe = f"{DEFAULT_PREFIX}{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
        _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "a0", "root", "tbf",
             "rate", "1mbit", "burst", "16kb", "limit", "64kb")
    except NetnsError as e:
        return False, f"cannot build a shaped namespace here: {e}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return True, ""


def ready(script: str, prefix: str) -> bool:
    """Whether a benchmark can build its namespaces here: if not, say why (it skips); if so,
    remove what a killed run of it left behind first."""
    ok, why = available()
    if not ok:
        print(f"{script}: skipped: {why}")
        return False
    stale = cleanup(prefix)
    if stale:
        print(f"removed stale namespaces of a killed run: {', '.join(stale)}")
    return True


def namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the existing namespaces that start with ``prefix``."""
    out = _run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(prefix: str = DEFAULT_PREFIX, *, everything: bool = False) -> list[str]:
    """Remove stale namespaces named ``{prefix}{pid}-...`` whose creating process is gone
    (all of them with ``everything=True``). Processes still running inside are killed first.
    Returns the names removed."""
    pat = re.compile(re.escape(prefix) + r"(\d+)-")
    removed = []
    for name in namespaces(prefix):
        m = pat.match(name)
        if m is None:
            continue
        if not everything and _pid_alive(int(m.group(1))):
            continue
        _delete_namespace(name)
        removed.append(name)
    return removed


def _delete_namespace(name: str) -> None:
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", name, check=False)


def tbf_args(rate_bps: float, *, queue_seconds: float = 0.1) -> list[str]:
    """``tc qdisc add ... tbf`` arguments for ``rate_bps`` bits/s.

    burst: one timer tick of data (rate/HZ) but at least 16 KB, so that the bucket can always
    release an MTU-sized packet. limit: ``queue_seconds`` of data (at least 3 bursts) — a queue
    that short drops early enough that TCP does not build seconds of delay, yet long enough
    that it does not starve the link.
    """
    if not rate_bps > 0:
        raise ValueError(f"rate must be > 0 bits/s, got {rate_bps}")
    rate_bytes = rate_bps / 8
    burst = max(int(rate_bytes * HZ_SECONDS), 16_000)
    limit = max(int(rate_bytes * queue_seconds), 3 * burst)
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


@dataclass(frozen=True)
class Worker:
    """One worker's namespace and link."""

    index: int
    netns: str
    addr: str
    """Its address inside the private subnet (also MASTER_ADDR when it is rank 0)."""
    ifname: str
    """Its interface, as seen inside its namespace (GLOO_SOCKET_IFNAME)."""
    rate_bps: float | None
    """Link rate each way, bits/s (None: unshaped)."""


class Namespaces:
    """Context manager: ``len(rates_bps)`` shaped worker namespaces on one bridge.

    ``rates_bps[i]`` is worker i's link rate in bits/s, each direction (None leaves it
    unshaped); a list of different rates gives the heterogeneous case.
    """

    def __init__(self, rates_bps: Sequence[float | None], *, prefix: str = DEFAULT_PREFIX,
                 subnet: str = "10.77.0.0/24", queue_seconds: float = 0.1) -> None:
        if not rates_bps:
            raise ValueError("need at least one worker")
        net = ipaddress.ip_network(subnet)
        if not net.is_private:
            raise ValueError(f"subnet {subnet} is not private")
        hosts = list(net.hosts())
        if len(rates_bps) > len(hosts):
            raise ValueError(f"{len(rates_bps)} workers do not fit into {subnet}")
        self.prefix = prefix
        self.name = f"{prefix}{os.getpid()}-{os.urandom(2).hex()}"
        self.bridge_ns = f"{self.name}-br"
        self.prefixlen = net.prefixlen
        self.queue_seconds = queue_seconds
        self.workers = [
            Worker(i, f"{self.name}-w{i}", str(hosts[i]), WORKER_IF, r)
            for i, r in enumerate(rates_bps)
        ]
        self._procs: list[subprocess.Popen[Any]] = []
        self._old_handlers: dict[int, Any] = {}
        self._up = False

    # ---- lifetime ------------------------------------------------------------------------
    def __enter__(self) -> Namespaces:
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs inside, delete every namespace (idempotent)."""
        try:
            for p in self._procs:
                if p.poll() is None:
                    p.kill()
            for p in self._procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self._procs.clear()
            existing = set(self.created())
            for name in [w.netns for w in self.workers] + [self.bridge_ns]:
                if name in existing:
                    _delete_namespace(name)
            self._up = False
        finally:
            self._restore_signal_handlers()

    def created(self) -> list[str]:
        """This harness's namespaces that exist right now."""
        return namespaces(self.name)

    def _install_signal_handlers(self) -> None:
        def raise_instead(signum: int, _frame: Any) -> None:
            # An exception unwinds through every ``finally``; the default SIGTERM action would
            # end the process on the spot and leave the namespaces behind.
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, raise_instead)
            except ValueError:  # not the main thread: the caller must clean up itself
                break

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _build(self) -> None:
        br = self.bridge_ns
        _run("ip", "netns", "add", br)
        _run("ip", "-n", br, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", br, "link", "set", BRIDGE, "up")
        _run("ip", "-n", br, "link", "set", "lo", "up")
        # A fresh namespace has no firewall rules, but if bridged frames are sent through
        # iptables anyway they must not be filtered.
        _run("ip", "netns", "exec", br, "sysctl", "-qw",
             "net.bridge.bridge-nf-call-iptables=0", check=False)
        for w in self.workers:
            port = f"p{w.index}"
            _run("ip", "netns", "add", w.netns)
            # Both ends are born inside their namespaces: nothing ever lands in the root one.
            _run("ip", "-n", w.netns, "link", "add", w.ifname, "type", "veth",
                 "peer", "name", port, "netns", br)
            _run("ip", "-n", br, "link", "set", port, "master", BRIDGE)
            _run("ip", "-n", br, "link", "set", port, "up")
            _run("ip", "-n", w.netns, "addr", "add", f"{w.addr}/{self.prefixlen}",
                 "dev", w.ifname)
            _run("ip", "-n", w.netns, "link", "set", w.ifname, "up")
            _run("ip", "-n", w.netns, "link", "set", "lo", "up")
            if w.rate_bps is not None:
                q = tbf_args(w.rate_bps, queue_seconds=self.queue_seconds)
                _run("ip", "netns", "exec", w.netns, "tc", "qdisc", "add", "dev", w.ifname,
                     "root", *q)
                _run("ip", "netns", "exec", br, "tc", "qdisc", "add", "dev", port, "root", *q)
        self._up = True
        self._wait_links_up()

    def _wait_links_up(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.link_state(w.index) in ("UP", "UNKNOWN") for w in self.workers):
                return
            time.sleep(0.05)
        raise NetnsError("veth links did not come up")

    # ---- use -----------------------------------------------------------------------------
    def exec_argv(self, index: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside worker ``index``'s namespace."""
        return ["ip", "netns", "exec", self.workers[index].netns, *argv]

    def popen(self, index: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in worker ``index``'s namespace; it is killed when the harness
        closes, if it is still running."""
        if not self._up:
            raise NetnsError("the namespaces are not up (use `with Namespaces(...)`)")
        p = subprocess.Popen(self.exec_argv(index, argv), env=dict(env) if env else None, **kw)
        self._procs.append(p)
        return p

    def cut(self, index: int, cut: bool = True) -> None:
        """Take worker ``index``'s link down at the bridge (``cut=False``: up again): a
        partition. Its packets go nowhere; its connections see no reset, only silence."""
        _run("ip", "-n", self.bridge_ns, "link", "set", f"p{index}", "down" if cut else "up")

    def link_state(self, index: int) -> str:
        w = self.workers[index]
        out = _run("ip", "-n", w.netns, "-j", "link", "show", w.ifname).stdout
        return json.loads(out)[0].get("operstate", "?")

    def tx_bytes(self, index: int) -> int:
        """Bytes worker ``index`` has sent on its link (headers included)."""
        w = self.workers[index]
        out = _run("ip", "-n", w.netns, "-j", "-s", "link", "show", w.ifname).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def qdiscs(self, index: int) -> tuple[str, str]:
        """``tc qdisc show`` of both ends of worker ``index``'s link (for the record)."""
        w = self.workers[index]
        a = _run("ip", "netns", "exec", w.netns, "tc", "qdisc", "show", "dev", w.ifname)
        b = _run("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "show", "dev",
                 f"p{index}")
        return a.stdout.strip(), b.stdout.strip()
