"""`noloco coordinator` is no single point of failure, and serves many runs at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_utils import SMALL, interrupt_elastic, summary, wait_for

pytestmark = pytest.mark.slow("a coordinator killed and restarted under elastic worker processes")

RUN = [*SMALL, "--replicas", "4", "--sync-every", "10", "--eval-every", "20",
       "--peer-timeout", "3"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")
STEPS = 120
"""long enough that the replicas train on well after the coordinator is back (the steps are
slowed down: the outage is a share of the run's wall time, not of its compute)"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator(port: int, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "noloco", "coordinator", "--host", "127.0.0.1",
                          "--port", str(port), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout is not None and "listening on" in p.stdout.readline()
    return p


def train(out: Path, data: Path, port: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(data), *RUN, "--elastic",
         "--coordinator", f"127.0.0.1:{port}", "--replica-ids", "0-3", "--out", str(out),
         *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def evaluated(out: Path, replica: int, step: int) -> bool:
    p = out / "metrics" / f"replica-{replica}.jsonl"
    return p.is_file() and any(json.loads(x)["step"] >= step
                               for x in p.read_text().splitlines() if x.strip())


def no_cpp_dump(text: str) -> None:
    for sign in ("frame #", "Exception raised from", "terminate called", "Traceback"):
        assert sign not in text, text[-3000:]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("method", ["noloco", "diloco"])
def test_the_coordinator_killed_and_restarted_every_replica_finishes(tmp_path, corpus,
                                                                     method):
    port = free_port()
    # The reference (a static run: its numbers do not depend on timing) runs beside the
    # elastic run, whose steps mostly sleep.
    ref = subprocess.Popen([sys.executable, "-m", "noloco", "train", "--data", str(corpus),
                            *RUN, "--method", method, "--steps", str(STEPS), "--threads", "1",
                            "--out", str(tmp_path / "ref")], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env=ENV)
    coord = coordinator(port)
    out = tmp_path / "run"
    # Steps of a real model take seconds, not this one's 50 ms: paced to 0.4 s (it changes
    # no number, sleeping costs no CPU, and a loaded machine steps as fast as an idle one),
    # the outage of about 7 s is some 15-20 steps of 120, not half the run.
    # NoLoCo: the outage outlasts the bound on operations alone (one here: an outer step is
    # 4 s), so every replica waits for the coordinator, then re-aligns (issue 36).
    lonely = ["--max-lonely-outer-steps", "1"] if method == "noloco" else []
    proc = train(out, corpus, port, "--method", method, "--steps", str(STEPS),
                 "--inject-fault", ",".join(f"pace:{r}:0.4" for r in range(4)), *lonely)
    try:
        wait_for(lambda: evaluated(out, 2, 40), 200, "replica 2 at step 40")
        coord.send_signal(signal.SIGKILL)
        coord.wait()
        time.sleep(5)
        coord = coordinator(port)  # the same address, empty
        _, err = proc.communicate(timeout=300)
        _, ref_err = ref.communicate(timeout=200)
    finally:
        proc.kill()
        coord.kill()
        ref.kill()
    assert ref.returncode == 0, ref_err
    assert proc.returncode == 0, err
    no_cpp_dump(err)
    s = summary(out)
    assert s["status"] == "completed" and s["elastic"]["replicas_finished"] == [0, 1, 2, 3], err
    assert s["failures"] == []
    # Every replica went on in the new epoch and says so, with the operations it skipped.
    restarts = s["elastic"]["store_restarts"]
    assert sorted(o["replica"] for o in restarts) == [0, 1, 2, 3], restarts
    assert {o["epoch"] for o in restarts} == {1}
    assert all(o["from_step"] <= o["to_step"] and o["operations_skipped"] >= 0
               for o in restarts)
    assert sum(o["operations_skipped"] for o in restarts) >= 1
    assert "restarted empty" in err
    if lonely:
        kinds = {r: [e["kind"] for e in ev] for r, ev in s["elastic"]["events"].items()}
        assert all("waited_for_link" in k and "realigned" in k for k in kinds.values()), kinds
    # The replicas met again after it: each exchanged (or all-reduced) in the new epoch, in
    # its last 20 steps at least. (The outage lasts as long as the new coordinator takes to
    # start, longer on a loaded machine: in a three-lane run beside two busy loops a replica
    # went on at step 84 of 120, its outage ~44 paced steps.)
    assert max(o["to_step"] for o in restarts) < STEPS - 20
    for r in range(4):
        assert json.loads((out / "metrics" / f"replica-{r}.json").read_text())["epoch"] == 1
        sent = {json.loads(x)["step"]: json.loads(x)["bytes_sent"] for x in
                (out / "metrics" / f"replica-{r}.jsonl").read_text().splitlines()}
        assert sent[STEPS] > sent[STEPS - 20], sent
    # NoLoCo within 2%. DiLoCo pays more: its first all-reduce after the outage is one outer
    # step over all of it (H ~ 30-40 instead of 10, with Nesterov momentum); measured +2.2% to
    # +2.9% at 200 steps whatever the outage's share of the run (12-50%), and -0.5% (NoLoCo)
    # and +0.3% (DiLoCo) at these 120. DiLoCo's spread is wide: where each replica goes on
    # (step 56 to 60 here) sets the length of that outer step, and with it the loss: five
    # runs of this test gave -2.1%, +0.3%, +0.3%, +2.2% and +4.01% (under CI's load), so its
    # bound is 6%. (That the replicas met again is the bytes check above, not this one.)
    ref_loss = summary(tmp_path / "ref")["final_val_loss"]
    bound = {"noloco": 0.02, "diloco": 0.06}[method]
    assert abs(s["final_val_loss"] - ref_loss) <= bound * ref_loss, (s["final_val_loss"],
                                                                     ref_loss)


@pytest.mark.timeout(200)
def test_without_the_coordinator_for_the_timeout_replicas_save_and_stop(tmp_path, corpus):
    port = free_port()
    coord = coordinator(port)
    out = tmp_path / "run"
    proc = train(out, corpus, port, "--method", "noloco", "--steps", "100000",
                 "--coordinator-timeout", "6", "--checkpoint-every", "0")
    try:
        wait_for(lambda: evaluated(out, 0, 20), 120, "replica 0 at step 20")
        coord.kill()
        coord.wait()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        coord.kill()
    assert proc.returncode == 1, err
    no_cpp_dump(err)
    assert "--coordinator-timeout" in err
    s = summary(out)
    assert [f["kind"] for f in s["failures"]] == ["store lost"] * 4
    for r in range(4):  # each saved where it stopped
        assert any((out / "checkpoints" / f"replica-{r}").glob("step-*")), r


@pytest.mark.timeout(300)
def test_two_runs_share_a_coordinator_without_seeing_each_other(tmp_path, corpus):
    """Two runs of the same settings and replica ids at one coordinator: each its own run id.
    Apart, they compute exactly what one alone does (and the same bits as each other)."""
    port = free_port()
    coord = coordinator(port)
    try:
        procs = {name: train(tmp_path / name, corpus, port, "--method", "noloco",
                             "--steps", "40", "--run-id", name, "--peer-timeout", "10")
                 for name in ("a", "b")}
        errs = {name: p.communicate(timeout=200)[1] for name, p in procs.items()}
    finally:
        coord.kill()
        for p in procs.values():
            p.kill()
    for name, p in procs.items():
        assert p.returncode == 0, errs[name]
    a, b = summary(tmp_path / "a"), summary(tmp_path / "b")
    assert a["elastic"]["run_id"] == "a" and b["elastic"]["run_id"] == "b"
    for s in (a, b):
        assert s["elastic"]["replicas_finished"] == [0, 1, 2, 3] and s["failures"] == []
        assert all(e == [] for e in s["elastic"]["events"].values())
    assert a["final_val_loss_per_replica"] == b["final_val_loss_per_replica"]
    assert a["bytes_sent"] == b["bytes_sent"]


@pytest.mark.timeout(300)
def test_an_interrupted_run_at_a_coordinator_resumes_each_replica_exactly(tmp_path, corpus):
    """Ctrl-C on every machine of a run at a coordinator that stays up, then ``--resume``:
    the run continues in a new epoch of the coordinator's store (no key of the stopped run's
    operations can be met again), each replica from its own checkpoint, and ends bit for bit
    where the same run without the stop ends (the static run, which an uncut elastic run
    equals). Without the new epoch the resumed replicas would count as respawns and wait for
    a live replica to join from."""
    port = free_port()
    args = ["--data", str(corpus), *RUN, "--method", "noloco", "--replicas", "2", "--steps",
            "60"]
    ref = subprocess.run([sys.executable, "-m", "noloco", "train", *args, "--out",
                          str(tmp_path / "ref")], capture_output=True, text=True, env=ENV,
                         timeout=200)
    assert ref.returncode == 0, ref.stderr
    coord = coordinator(port)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "noloco", "train", *args, "--elastic", "--coordinator",
           f"127.0.0.1:{port}", "--replica-ids", "0-1", "--out", str(out)]
    try:
        proc = subprocess.Popen([*cmd, "--inject-fault", "pace:0:0.1,pace:1:0.1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=ENV)
        saved = interrupt_elastic(
            proc, lambda: evaluated(out, 0, 20) and evaluated(out, 1, 20), out)
        assert summary(out)["elastic"]["store"]["epoch"] == 0
        assert sorted(saved) == [0, 1] and all(20 <= s < 60 for s in saved.values()), saved
        r = subprocess.run([sys.executable, "-m", "noloco", "train", "--resume", str(out)],
                           capture_output=True, text=True, env=ENV, timeout=200)
    finally:
        coord.kill()
    assert r.returncode == 0, r.stderr
    no_cpp_dump(r.stderr)
    for rep, step in saved.items():
        assert f"replica {rep}: resuming from step {step}" in r.stderr, r.stderr
    s = summary(out)
    assert s["status"] == "completed" and s["elastic"]["replicas_finished"] == [0, 1]
    assert s["elastic"]["store"]["epoch"] == 1 and s["elastic"]["joins"] == []
    from run_utils import weights

    a, b = weights(tmp_path / "ref"), weights(out)
    for name in ("replica-0.safetensors", "replica-1.safetensors"):
        assert all((a[name][k] == b[name][k]).all() for k in a[name]), name
