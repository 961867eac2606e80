"""The namespace harness of benchmarks/wan.py: connectivity, shaping, and cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import netns  # noqa: E402

OK, WHY = netns.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no shaped namespaces here: {WHY}")

PREFIX = "nlct"

# Echo server: answers a short line with the same line, then for "SEND n" sends n bytes, and
# for "RECV n" reads n bytes and answers "done".
SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5077)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); f = c.makefile("rb")
for line in f:
    cmd = line.split()
    if cmd[0] == b"SEND":
        c.sendall(b"x" * int(cmd[1]))
    elif cmd[0] == b"RECV":
        left = int(cmd[1])
        while left > 0:
            left -= len(f.read1(min(left, 1 << 20)))
        c.sendall(b"done\n")
    else:
        c.sendall(line)
"""

# Client: echo check, then times an upload and a download of n bytes; prints JSON.
CLIENT = r"""
import json, socket, sys, time
n = int(sys.argv[2]); s = socket.create_connection((sys.argv[1], 5077), timeout=20)
f = s.makefile("rb")
s.sendall(b"hello\n"); echo = f.readline().decode().strip()
t = time.perf_counter(); s.sendall(f"RECV {n}\n".encode() + b"y" * n); f.readline()
up = time.perf_counter() - t
t = time.perf_counter(); s.sendall(f"SEND {n}\n".encode()); left = n
while left > 0:
    left -= len(f.read1(min(left, 1 << 20)))
down = time.perf_counter() - t
print(json.dumps({"echo": echo, "up": up, "down": down}))
"""


def _leftovers(name: str) -> list[str]:
    return netns.namespaces(name)


@pytest.mark.slow("network namespaces")
@pytest.mark.timeout(60)
def test_connectivity_and_both_directions_shaped():
    import json

    n = 2_000_000  # 2 MB at 20 Mbit/s: 0.8 s on the wire, >= 0.5 s even with a full bucket
    # Worker 0 is shaped, worker 1 is not: both directions must still run at worker 0's rate.
    with netns.Namespaces([20e6, None], prefix=PREFIX) as ns:
        assert sorted(ns.created()) == sorted([w.netns for w in ns.workers] + [ns.bridge_ns])
        srv = ns.popen(1, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "ready"
        out = subprocess.run(
            ns.exec_argv(0, [sys.executable, "-c", CLIENT, ns.workers[1].addr, str(n)]),
            capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        sent = ns.tx_bytes(0)
        name = ns.name
    assert res["echo"] == "hello"
    assert res["up"] >= 0.5, res
    assert res["down"] >= 0.5, res
    assert res["up"] < 5 and res["down"] < 5, res  # shaped, not stalled
    assert sent >= n  # the upload went over the veth, headers on top
    assert _leftovers(name) == []


@pytest.mark.slow("network namespaces")
@pytest.mark.timeout(30)
def test_unshaped_link_is_fast():
    # The control for the test above: the same transfer without shaping is far quicker.
    import json

    with netns.Namespaces([None, None], prefix=PREFIX) as ns:
        srv = ns.popen(1, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "ready"
        out = subprocess.run(
            ns.exec_argv(0, [sys.executable, "-c", CLIENT, ns.workers[1].addr, "2000000"]),
            capture_output=True, text=True, timeout=20)
        res = json.loads(out.stdout)
    assert res["up"] < 0.4 and res["down"] < 0.4, res


@pytest.mark.slow("network namespaces")
@pytest.mark.timeout(30)
def test_cleanup_after_exception_kills_processes_and_namespaces():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Namespaces([10e6, 10e6, 10e6], prefix=PREFIX) as ns:
            name = ns.name
            proc = ns.popen(0, ["sleep", "60"])
            assert len(ns.created()) == 4
            raise RuntimeError("boom")
    assert proc.poll() is not None  # killed, not left running inside a deleted namespace
    assert _leftovers(name) == []


@pytest.mark.slow("network namespaces")
@pytest.mark.timeout(30)
def test_cleanup_on_sigterm(tmp_path):
    code = (
        f"import sys, time; sys.path.insert(0, {str(Path(netns.__file__).parent)!r})\n"
        "import netns\n"
        f"with netns.Namespaces([10e6, 10e6], prefix={PREFIX!r}) as ns:\n"
        "    print(ns.name, flush=True)\n"
        "    time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    name = p.stdout.readline().strip()
    assert name and len(_leftovers(name)) == 3
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=20)
    assert _leftovers(name) == []


@pytest.mark.slow("network namespaces")
@pytest.mark.timeout(30)
def test_stale_cleanup_removes_only_dead_owners():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-dead-w0"
    live = f"{PREFIX}{os.getpid()}-live-w0"
    forced = f"{PREFIX}x{os.getpid()}-live-w0"  # its own prefix, `PREFIX + "x"`
    try:
        for n in (stale, live, forced):
            subprocess.run(["ip", "netns", "add", n], check=True)
        removed = netns.cleanup(PREFIX)
        assert stale in removed and live not in removed
        assert _leftovers(stale) == [] and _leftovers(live) == [live]
        assert netns.cleanup(f"{PREFIX}x", everything=True) == [forced]
        assert _leftovers(forced) == []
    finally:
        for n in (stale, live, forced):
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
    assert _leftovers(live) == []


def test_tbf_arguments():
    args = netns.tbf_args(100e6)
    assert args[:3] == ["tbf", "rate", "100000000bit"]
    burst = int(args[args.index("burst") + 1])
    limit = int(args[args.index("limit") + 1])
    assert burst >= 100e6 / 8 / 250 and limit >= 3 * burst
    assert int(netns.tbf_args(1e6)[4]) >= 16_000  # at least a few MTUs at low rates
    with pytest.raises(ValueError):
        netns.tbf_args(0)
