"""An elastic run across two "machines" (network namespaces) meeting at `noloco coordinator`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_utils import SMALL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import netns  # noqa: E402

OK, WHY = netns.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")


@pytest.mark.timeout(300)
def test_two_machines_one_replica_killed_the_others_finish(tmp_path, shakespeare):
    port = 29471
    with netns.Namespaces([None, None], prefix="nlce", subnet="10.79.0.0/24") as ns:
        host = ns.workers[0].addr
        env = dict(os.environ, GLOO_SOCKET_IFNAME=netns.WORKER_IF, PYTHONUNBUFFERED="1")
        coord = ns.popen(0, [sys.executable, "-m", "noloco", "coordinator", "--host", host,
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, text=True)
        assert "listening on" in coord.stdout.readline()
        procs = []
        for machine, ids in ((0, "0-1"), (1, "2-3")):
            argv = [sys.executable, "-m", "noloco", "train", "--data", str(shakespeare), *SMALL,
                    "--method", "noloco", "--replicas", "4", "--steps", "60",
                    "--sync-every", "10", "--eval-every", "20", "--elastic",
                    "--peer-timeout", "3", "--coordinator", f"{host}:{port}",
                    "--replica-ids", ids, "--inject-fault", "kill:3@30",
                    "--out", str(tmp_path / f"machine{machine}")]
            procs.append(ns.popen(machine, argv, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=240) for p in procs]
        coord.terminate()
        coord.wait(timeout=10)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    s0 = json.loads((tmp_path / "machine0" / "summary.json").read_text())
    s1 = json.loads((tmp_path / "machine1" / "summary.json").read_text())
    assert s0["replicas_finished"] == [0, 1] and s1["replicas_finished"] == [2]
    assert [(f["replica"], f["kind"]) for f in s1["failures"]] == [(3, "SIGKILL")]
    # The replicas exchanged across the machines: the bytes say so, and 2 and 3 were paired
    # with 0 or 1 at some exchange (groups are drawn over all four).
    assert all(v > 0 for v in s1["bytes_sent_per_replica"].values())
    assert any(e["missing"] == [3] for ev in {**s0["events"], **s1["events"]}.values()
               for e in ev)


def test_coordinator_and_replica_ids_need_elastic(tmp_path, shakespeare):
    from run_utils import cli

    r = cli("train", "--data", str(shakespeare), *SMALL, "--replicas", "4", "--method",
            "noloco", "--coordinator", "127.0.0.1:1", "--out", str(tmp_path / "r"), timeout=60)
    assert r.returncode == 2 and "--coordinator and --replica-ids need --elastic" in r.stderr
    r = cli("train", "--data", str(shakespeare), *SMALL, "--replicas", "4", "--method",
            "noloco", "--elastic", "--replica-ids", "3-5", "--out", str(tmp_path / "r"),
            timeout=60)
    assert r.returncode == 2 and "--replica-ids 3-5 must name distinct replicas" in r.stderr
    r = cli("train", "--data", str(shakespeare), *SMALL, "--replicas", "4", "--method",
            "noloco", "--elastic", "--coordinator", "nohost", "--out", str(tmp_path / "r"),
            timeout=60)
    assert r.returncode == 2 and "--coordinator must be HOST:PORT" in r.stderr
