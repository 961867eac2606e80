"""noloco.integrations: a Lightning callback and a Hugging Face Trainer callback make the
framework's own loop one replica of a noloco run, static (a gloo group) or elastic (at a
store hosted in this process), with a replica killed and started again."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow("framework replicas as processes")

WORKER = Path(__file__).with_name("framework_worker.py")
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
       "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
FRAMEWORKS = [
    pytest.param("lightning", marks=pytest.mark.skipif(
        not __import__("importlib").util.find_spec("lightning"),
        reason="the 'lightning' extra is not installed")),
    pytest.param("hf", marks=pytest.mark.skipif(
        not __import__("importlib").util.find_spec("accelerate"),
        reason="the 'hf' extra (transformers, accelerate) is not installed")),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(framework: str, out: Path, replica: int, replicas: int, steps: int, *args: str
           ) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), framework, str(out), "--replica",
                             str(replica), "--replicas", str(replicas), "--steps", str(steps),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)


def finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        _, err = p.communicate(timeout=200)
        assert p.returncode == 0, err[-3000:]
        for sign in ("frame #", "Exception raised from", "terminate called", "Traceback"):
            assert sign not in err, err[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_static_replicas_in_a_framework_loop(tmp_path, framework):
    """Two processes in a gloo group, each the framework's own loop with the callback:
    DiLoCo's outer steps inside the framework's optimizer.step(); the same weights at the
    end (20 steps, H = 5)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    finish([worker(framework, tmp_path / f"{r}.json", r, 2, 20, "--init", init)
            for r in range(2)])
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [(x["step"], x["outer_steps"]) for x in res] == [(20, 4), (20, 4)]
    assert res[0]["weights"] == res[1]["weights"]


@pytest.fixture
def host():
    from noloco.elastic import auth
    from noloco.elastic.host import Host

    h = Host("127.0.0.1", 0, secret=auth.load_secret(None))
    yield h
    h.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_elastic_framework_replica_killed_and_started_again_rejoins(tmp_path, host,
                                                                       framework):
    """Three elastic replicas, each a framework's loop; replica 1 is killed (SIGKILL) at
    step 12 of 50 and started again: it takes a donor's state, the framework trains on
    from the run's step, and all three finish at step 50 on the same weights."""
    # The others must still train when the restarted one has imported its framework: paced,
    # and held at step 30 until it has (under CI's load its import outlasted the others' 38
    # paced steps once, and it found nobody left to join).
    pace = ["--port", str(host.port), "--step-seconds", "0.3"]
    started = tmp_path / "restarted"
    others = [worker(framework, tmp_path / f"{r}.json", r, 3, 50, *pace,
                     "--hold", f"30:{started}") for r in (0, 2)]
    first = worker(framework, tmp_path / "1.json", 1, 3, 50, "--die-at", "12", *pace)
    first.communicate(timeout=200)
    assert first.returncode == -9
    again = worker(framework, tmp_path / "1.json", 1, 3, 50, *pace, "--mark", str(started))
    finish([*others, again])
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert all(x["step"] == 50 for x in res), [x["step"] for x in res]
    assert "joined" in [j["kind"] for j in res[1]["joins"]]
    assert all(x["weights"] == res[0]["weights"] for x in res)
