"""An elastic run across two "machines" (network namespaces) meeting at `noloco coordinator`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_utils import SMALL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import netns  # noqa: E402

OK, WHY = netns.available()
pytestmark = [pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}"),
              pytest.mark.slow("network namespaces, a coordinator and elastic worker processes")]


def start_coordinator(ns: netns.Namespaces, port: int
                      ) -> tuple[str, dict[str, str], subprocess.Popen]:
    """`noloco coordinator` on "machine" 0: (its address, the environment every machine's
    commands need, the process)."""
    host = ns.workers[0].addr
    env = dict(os.environ, GLOO_SOCKET_IFNAME=netns.WORKER_IF, PYTHONUNBUFFERED="1")
    coord = ns.popen(0, [sys.executable, "-m", "noloco", "coordinator", "--host", host,
                         "--port", str(port)], env=env, stdout=subprocess.PIPE, text=True)
    assert "listening on" in coord.stdout.readline()
    return host, env, coord


def run_machines(ns: netns.Namespaces, host: str, port: int, env: dict[str, str],
                 coord: subprocess.Popen, out: Path, ids: tuple[str, ...], args: list[str],
                 timeout: float) -> list[dict]:
    """Machine i runs ``noloco train --elastic ARGS --replica-ids ids[i]`` at the coordinator
    (stopped at the end); every launcher must exit 0. Their summaries."""
    procs = [ns.popen(m, [sys.executable, "-m", "noloco", "train", *SMALL, "--method", "noloco",
                          "--elastic", "--coordinator", f"{host}:{port}", "--replica-ids",
                          machine_ids, *args, "--out", str(out / f"machine{m}")],
                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m, machine_ids in enumerate(ids)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    coord.terminate()
    coord.wait(timeout=10)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return [json.loads((out / f"machine{m}" / "summary.json").read_text())
            for m in range(len(ids))]


@pytest.mark.timeout(300)
def test_two_machines_one_replica_killed_the_others_finish(tmp_path, corpus):
    port = 29471
    with netns.Namespaces([None, None], prefix="nlce", subnet="10.79.0.0/24") as ns:
        host, env, coord = start_coordinator(ns, port)
        s0, s1 = run_machines(ns, host, port, env, coord, tmp_path, ("0-1", "2-3"), [
            "--data", str(corpus), "--replicas", "4", "--steps", "60", "--sync-every",
            "10", "--eval-every", "20", "--peer-timeout", "3", "--inject-fault", "kill:3@30"],
            timeout=240)
    assert s0["elastic"]["replicas_finished"] == [0, 1]
    assert s1["elastic"]["replicas_finished"] == [2]
    assert [(f["replica"], f["kind"]) for f in s1["failures"]] == [(3, "SIGKILL")]
    # The replicas exchanged across the machines: the bytes say so, and 2 and 3 were paired
    # with 0 or 1 at some exchange (groups are drawn over all four).
    assert all(v > 0 for v in s1["bytes_sent_per_replica"].values())
    events = {**s0["elastic"]["events"], **s1["elastic"]["events"]}
    assert any(e.get("missing") == [3] for ev in events.values() for e in ev)


@pytest.mark.timeout(300)
def test_a_machine_that_crashes_and_comes_back_joins_the_run(tmp_path, corpus):
    """Machine 1 (replicas 2, 3) dies whole — its launcher and workers killed — and its
    command is run again: the store counts the workers' starts, so its replicas join from
    machine 0's live ones instead of starting over."""
    import signal

    port = 29472
    with netns.Namespaces([None, None], prefix="nlce", subnet="10.79.1.0/24") as ns:
        host, env, coord = start_coordinator(ns, port)

        def machine(index: int, ids: str, out: str) -> subprocess.Popen:
            argv = [sys.executable, "-m", "noloco", "train", "--data", str(corpus),
                    *SMALL, "--method", "noloco", "--replicas", "4", "--steps", "160",
                    "--sync-every", "10", "--eval-every", "20", "--elastic",
                    "--peer-timeout", "3", "--coordinator", f"{host}:{port}",
                    "--replica-ids", ids, "--out", str(tmp_path / out)]
            return ns.popen(index, argv, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)

        m0 = machine(0, "0-1", "m0")
        m1 = machine(1, "2-3", "m1")
        metrics = tmp_path / "m1" / "metrics" / "replica-2.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and m1.poll() is None
            time.sleep(0.2)
        os.killpg(m1.pid, signal.SIGKILL)  # the whole machine: launcher and workers
        m1.wait()
        time.sleep(1)
        m1 = machine(1, "2-3", "m1-again")
        out1, err1 = m1.communicate(timeout=200)
        out0, err0 = m0.communicate(timeout=200)
        coord.terminate()
        coord.wait(timeout=10)
    assert m0.returncode == 0, err0
    assert m1.returncode == 0, err1
    assert "replica 2 joined at step" in err1 and "replica 3 joined at step" in err1
    s0 = json.loads((tmp_path / "m0" / "summary.json").read_text())
    s1 = json.loads((tmp_path / "m1-again" / "summary.json").read_text())
    assert s0["elastic"]["replicas_finished"] == [0, 1]
    assert s1["elastic"]["replicas_finished"] == [2, 3]
    joined = [j for j in s1["elastic"]["joins"] if j.get("kind") == "joined"]
    assert {j["from"] for j in joined} <= {0, 1} and all(j["step"] >= 40 for j in joined)


def test_coordinator_and_replica_ids_need_elastic(tmp_path, corpus, capsys):
    from noloco.cli import main

    def refused(*args: str) -> str:  # in this process: refused before anything starts
        code = main(["train", "--data", str(corpus), *SMALL, "--replicas", "4", "--method",
                     "noloco", *args, "--out", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        return err

    assert "--coordinator and --replica-ids need --elastic" in refused(
        "--coordinator", "127.0.0.1:1")
    assert "--replica-ids 3-5 must name distinct replicas" in refused(
        "--elastic", "--replica-ids", "3-5")
    assert "--coordinator must be HOST:PORT" in refused("--elastic", "--coordinator", "nohost")
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(600)
def test_transfers_slower_than_the_peer_timeout_complete(tmp_path, corpus):
    """Two machines on 2.5 Mbit/s links: one NoLoCo exchange (~3.7 MB each way) takes ~3 ×
    --peer-timeout, a join's state transfer (~11 MB) ~9 ×. Arrival is awaited --peer-timeout;
    the transfer itself gets --comm-timeout: every exchange completes and the replica killed
    mid-run is respawned and joins over the slow link."""
    port = 29473
    # Every deadline of a replica scales with the peer timeout (arrival, a donor's answer to
    # a joiner, the joiner's search): at 2 s, on a loaded machine (the suite's other lane,
    # two busy loops beside it), a respawned replica found no donor in time and a machine
    # that started late missed every arrival window. At 4 s, with the links and the steps
    # slowed alike, the same ratios with twice the room.
    timeout = 4.0
    with netns.Namespaces([2.5e6, 2.5e6], prefix="nlce", subnet="10.79.2.0/24") as ns:
        host, env, coord = start_coordinator(ns, port)
        s0, s1 = run_machines(ns, host, port, env, coord, tmp_path, ("0", "1"), [
            "--data", str(corpus), "--replicas", "2", "--steps", "60", "--sync-every",
            "10", "--eval-every", "30", "--peer-timeout", str(timeout), "--inject-fault",
            # steps of 0.2 s, on a loaded machine as on an idle one (pace, not slow): the
            # joiner, which receives the tail of the state through the shaper ~2 s after its
            # donor sent it, is a whole operation behind at most
            "kill:1@25,pace:0:0.2,pace:1:0.2", "--respawn", "1"], timeout=500)
    assert s0["elastic"]["replicas_finished"] == [0] and s1["elastic"]["replicas_finished"] == [1]
    joined = [j for j in s1["elastic"]["joins"] if j.get("kind") == "joined"]
    # slower than before's limit
    assert joined and joined[0]["seconds"] > 3 * timeout, s1["elastic"]["joins"]
    # no exchange broke: the only events are the dead replica's absence
    lost = [e for ev in {**s0["elastic"]["events"], **s1["elastic"]["events"]}.values() for e in ev
            if e["kind"] == "lost"]
    assert lost == [], lost
    # An exchange went through that outlasted the peer timeout twice over (its transfer
    # alone takes ~3 x). How many of the 8 exchanges meet in the arrival window depends on
    # the machine's load (a machine that starts late joins instead, and is left out of an
    # operation or two): CI once saw 1 of 8 with nothing lost, so count none beyond one.
    assert s0["elastic"]["longest_wait_seconds"]["0"] > 2 * timeout
    assert s0["bytes_sent_per_replica"]["0"] > 3.5e6
    assert s1["bytes_sent_per_replica"]["1"] > 3.5e6
