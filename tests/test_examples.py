"""Every example under examples/ runs, with few steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow("the examples run as worker processes")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.timeout(120)
def test_noloco_plain_loop_example() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "noloco_loop.py"), "--replicas", "2",
                           "--steps", "20", "--sync-every", "10"], capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "outer steps 2" in proc.stdout and "in 2 pair exchanges" in proc.stdout


@pytest.mark.timeout(240)
def test_hf_diloco_example(tmp_path) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "hf_diloco.py"), "--steps", "4",
                           "--sync-every", "2", "--replicas", "2", "--out", str(out),
                           "--extra", "--batch-size", "2", "--seq-len", "32",
                           "--eval-sequences", "2", "--log-every", "0"],
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: diloco, 2 replicas" in proc.stdout and proc.stdout.rstrip().splitlines()[-1]
    assert (out / "model" / "model.json").is_file()


@pytest.mark.timeout(300)
def test_two_machines_recipe_in_two_network_namespaces(tmp_path, corpus) -> None:
    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    out = tmp_path / "run"
    flags = ["--steps", "4", "--sync-every", "2", "--batch-size", "2", "--seq-len", "32",
             "--eval-sequences", "2", "--log-every", "0", "--data", str(corpus),
             "--out", str(out)]
    import os
    with netns.Namespaces([None, None], prefix="nlcx", subnet="10.79.0.0/24") as ns:
        master = ns.workers[0].addr
        procs = [ns.popen(i, ["bash", str(EXAMPLES / "two_machines.sh"), str(i), master,
                              *flags],
                          env={**os.environ, "GLOO_SOCKET_IFNAME": ns.workers[i].ifname,
                               "LOCAL_ADDR": ns.workers[i].addr},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        logs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-2000:] for x in logs)
    s = __import__("json").loads((out / "summary.json").read_text())
    assert s["status"] == "completed" and s["replicas"] == 4 and s["outer_steps"] == 2
    assert s["bytes_sent"] > 0


@pytest.mark.timeout(240)
def test_elastic_loop_example() -> None:
    """examples/elastic_loop.py: a plain loop in four processes, one killed (SIGKILL) and
    started again; it rejoins from a donor and every replica ends on the same weights."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "elastic_loop.py"), "--steps", "50",
                           "--kill-at", "10", "--step-seconds", "0.3"], capture_output=True,
                          text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "replica 2 rejoined at step" in proc.stdout
    assert "all 4 replicas finished 50 steps; the same weights on every replica" in proc.stdout
