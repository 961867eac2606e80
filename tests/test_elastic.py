"""Elastic training (--elastic): replicas die, stall and join while the others train on."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_utils import SMALL, cli, interrupt_elastic, summary, wait_for, weights, worker_pids

from noloco.checkpoint import complete_steps
from noloco.cli import main
from noloco.elastic import groups_of
from noloco.elastic.files import replica_checkpoints
from noloco.methods.noloco import groups_at

TIMEOUT = 3.0
"""--peer-timeout of these runs"""
RUN = [*SMALL, "--replicas", "4", "--sync-every", "10", "--eval-every", "20",
       "--peer-timeout", str(TIMEOUT)]


def start(out: Path, data: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(data), *RUN, "--elastic",
         "--out", str(out), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def evaluated(out: Path, replica: int, step: int) -> bool:
    p = out / "metrics" / f"replica-{replica}.jsonl"
    return p.is_file() and any(json.loads(x)["step"] >= step
                               for x in p.read_text().splitlines() if x.strip())


def finish(proc: subprocess.Popen, timeout: float = 200) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return err


# ---- groups from a membership snapshot ----------------------------------------------------

def test_groups_of_all_replicas_are_the_static_groups():
    for e in range(20):
        for n, size in ((4, 2), (8, 2), (8, 4), (6, 3)):
            assert groups_of(list(range(n)), e, size, seed=3) == groups_at(e, n, size, seed=3)


def test_groups_of_a_snapshot_partition_its_members():
    members = [0, 2, 3, 5, 7]
    for e in range(20):
        groups = groups_of(members, e, 2, seed=1)
        assert sorted(r for g in groups for r in g) == members
        assert [len(g) for g in groups] == [2, 3]  # the one left over joins the last group
        assert groups == groups_of(list(reversed(members)), e, 2, seed=1)  # order-free
    assert groups_of([4], 0, 2) == [[4]]


# ---- whole runs ---------------------------------------------------------------------------

@pytest.mark.slow("elastic worker processes")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method, streaming", [
    ("noloco", []), ("diloco", []),
    ("streaming", ["--fragments", "2", "--overlap-steps", "1", "--quantize", "fp4"]),
    ("noloco", ["--compress", "topk:0.02:2"]),
    # sparse messages all-gathered among the members that arrive (all of them here), per
    # fragment, with overlap
    ("streaming", ["--fragments", "2", "--overlap-steps", "1", "--compress", "topk:0.05:4"])],
    ids=["noloco", "diloco", "streaming-fp4", "noloco-sparse", "streaming-sparse"])
def test_without_failures_elastic_equals_static_bit_for_bit(tmp_path, corpus, method,
                                                            streaming):
    runs = {}
    for mode in ("static", "elastic"):
        out = tmp_path / mode
        extra = ["--elastic"] if mode == "elastic" else []
        r = cli("train", "--data", str(corpus), *RUN, "--method", method, "--steps", "40",
                "--out", str(out), *streaming, *extra)
        assert r.returncode == 0, r.stderr
        runs[mode] = out
    a, b = weights(runs["static"]), weights(runs["elastic"])
    for r in range(4):
        name = f"replica-{r}.safetensors"
        assert all((a[name][k] == b[name][k]).all() for k in a[name]), name
    s, e = summary(runs["static"]), summary(runs["elastic"])
    assert e["final_val_loss_per_replica"] == s["final_val_loss_per_replica"]
    assert e["bytes_sent_per_replica"] == s["bytes_sent_per_replica"]
    assert e["bytes_sent"] == s["bytes_sent"]
    assert e["failures"] == [] and e["elastic"]["replicas_finished"] == [0, 1, 2, 3]
    assert math.isclose(e["weight_spread"], s["weight_spread"], rel_tol=1e-6)
    op = {"noloco": "exchange", "diloco": "all_reduce", "streaming": "all_reduce_quantized"}
    if "--compress" in streaming and method != "noloco":
        op[method] = "all_gather"
    ops = {json.loads((runs["elastic"] / "metrics" / f"replica-{r}.json").read_text())["ops"]
           .get(op[method]) for r in range(4)}
    assert ops == {4 * (2 if "--fragments" in streaming else 1)}  # every fragment's sync
    if method == "noloco":  # pairs only: no operation ever involves more than the group
        for r in range(4):
            rs = json.loads((runs["elastic"] / "metrics" / f"replica-{r}.json").read_text())
            assert rs["ops"] == {"exchange": 4}


@pytest.mark.slow("elastic worker processes, a kill -9")
@pytest.mark.timeout(300)
def test_kill9_of_one_replica_the_others_finish(tmp_path, corpus):
    out = tmp_path / "run"
    proc = start(out, corpus, "--method", "noloco", "--steps", "100")
    try:
        wait_for(lambda: evaluated(out, 2, 40), 120, "replica 2 at step 40")
        pid = worker_pids(out)[(2, 0)]
        os.kill(pid, signal.SIGKILL)  # from outside, as a user or the OOM killer would
        err = finish(proc)
    finally:
        proc.kill()
    assert "replica 2 failed at step" in err and "SIGKILL" in err
    s = summary(out)
    assert s["status"] == "completed" and s["elastic"]["replicas_finished"] == [0, 1, 3]
    assert [(f["replica"], f["kind"]) for f in s["failures"]] == [(2, "SIGKILL")]
    assert 30 <= s["failures"][0]["step"] <= 60
    assert all(math.isfinite(v) for v in s["final_val_loss_per_replica"].values())
    assert s["elastic"]["steps_per_replica"] == {"0": 100, "1": 100, "3": 100}
    # Each survivor lost at most the peer timeout (+ one exchange) on any one exchange.
    assert max(s["elastic"]["longest_wait_seconds"].values()) < TIMEOUT + 1.5
    assert any(e.get("missing") == [2] for ev in s["elastic"]["events"].values() for e in ev)
    assert (out / "model" / "average.safetensors").is_file()
    assert not (out / "model" / "replica-2.safetensors").exists()


@pytest.mark.slow("elastic worker processes, a Ctrl-C and a resume")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["diloco", "noloco"])
def test_an_interrupted_elastic_run_resumes_each_replica_exactly(tmp_path, corpus, method):
    """Ctrl-C (SIGINT to the launcher): every replica saves the step it is at, on its own,
    and the line says how to continue; ``--resume`` continues each replica from its own
    checkpoint, and the run ends bit for bit where the same run without the stop ends (the
    static run, which an uncut elastic run equals: the test above)."""
    args = ["--data", str(corpus), *RUN, "--method", method, "--replicas", "2", "--steps",
            "60"]
    assert cli("train", *args, "--out", str(tmp_path / "static")).returncode == 0
    out = tmp_path / "run"
    # Paced (0.1 s a step, a sleep): stopped mid-run, wherever each replica is then.
    proc = start(out, corpus, *args[2:], "--inject-fault", "pace:0:0.1,pace:1:0.1")
    saved = interrupt_elastic(proc, lambda: evaluated(out, 0, 20) and evaluated(out, 1, 20),
                              out)
    assert sorted(saved) == [0, 1] and all(20 <= s < 60 for s in saved.values()), saved
    r = cli("train", "--resume", str(out))
    assert r.returncode == 0, r.stderr
    for rep, step in saved.items():
        assert f"replica {rep}: resuming from step {step}" in r.stderr, r.stderr
        own = json.loads((out / "metrics" / f"replica-{rep}.json").read_text())
        assert own["resumed_from_step"] == step and own["steps"] == 60
    s = summary(out)
    assert s["status"] == "completed" and s["elastic"]["replicas_finished"] == [0, 1]
    a, b = weights(tmp_path / "static"), weights(out)
    for name in ("replica-0.safetensors", "replica-1.safetensors"):
        assert all((a[name][k] == b[name][k]).all() for k in a[name]), name


@pytest.mark.slow("elastic worker processes, a stall")
@pytest.mark.timeout(300)
def test_a_stalled_replica_is_waited_for_at_most_the_timeout_and_comes_back(tmp_path,
                                                                           corpus):
    out = tmp_path / "run"
    # Paced steps (0.2 s; no CPU while they wait): the others are still ~30 steps from the
    # end when replica 2 comes back, however loaded the machine (flat out, a loaded run's
    # others once finished before it came back: it had nobody left to exchange with).
    proc = start(out, corpus, "--method", "noloco", "--steps", "100", "--inject-fault",
                 ",".join(f"pace:{r}:0.2" for r in range(4)))
    try:
        wait_for(lambda: evaluated(out, 2, 40), 120, "replica 2 at step 40")
        pid = worker_pids(out)[(2, 0)]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2 * TIMEOUT)
        os.kill(pid, signal.SIGCONT)
        finish(proc)
    finally:
        proc.kill()
    s = summary(out)
    assert s["failures"] == [] and s["elastic"]["replicas_finished"] == [0, 1, 2, 3]
    others = [v for r, v in s["elastic"]["longest_wait_seconds"].items() if r != "2"]
    assert max(others) < TIMEOUT + 1.5
    ev = s["elastic"]["events"]["2"]
    assert any(e["kind"] == "late" for e in ev)  # it came back after its partner had left
    # ... and exchanged again afterwards: fewer solo exchanges than exchanges after the stall.
    late = {e["call"] for e in ev if e["kind"] not in ("realigned", "waited_for_link")}
    # (late, absent, or left out of a snapshot)
    assert len(late) < 10 - 4, ev
    assert math.isfinite(s["final_val_loss_per_replica"]["2"])


@pytest.mark.slow("elastic worker processes, a respawn")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("streaming", [
    [], ["--fragments", "2", "--overlap-steps", "1"],
    # sparse gossip: the donor's error feedback stays the donor's (not sent, not checksummed)
    ["--fragments", "2", "--overlap-steps", "1", "--compress", "topk:0.02:2"]],
    ids=["whole", "fragments-in-flight", "sparse-fragments-in-flight"])
def test_a_respawned_replica_joins_with_its_donors_state_and_learns(tmp_path, corpus,
                                                                    streaming):
    """With fragments and overlap the donor's state holds an exchange in flight (fragment 0
    starts at the join step and lands one step later): the joiner applies it as the donor
    would have."""
    out = tmp_path / "run"
    r = cli("train", "--data", str(corpus), *RUN, "--elastic", "--method", "noloco",
            "--steps", "120", "--out", str(out), "--inject-fault", "kill:2@40", "--respawn", "1",
            *streaming)
    assert r.returncode == 0, r.stderr
    assert "replica 2 joined at step" in r.stderr
    s = summary(out)
    assert s["elastic"]["replicas_finished"] == [0, 1, 2, 3]
    assert [f["replica"] for f in s["failures"]] == [2]
    donated = [j for j in s["elastic"]["joins"] if j.get("kind") == "donated"]
    joined = [j for j in s["elastic"]["joins"] if j.get("kind") == "joined"]
    assert len(donated) == len(joined) == 1
    d, j = donated[0], joined[0]
    # Bit for bit: the checksum of model and slow weights on both sides, at the same step.
    assert (d["to"], d["step"], d["checksum"]) == (2, j["step"], j["checksum"])
    assert d["bytes"] == j["bytes"] > 0 and j["seconds"] > 0
    assert j["own_checkpoint_step"] is not None  # its own optimizer and data position
    recs = [json.loads(x) for x in (out / "metrics" / "replica-2.jsonl").read_text().splitlines()
            if x.strip()]
    after = [x["val_loss"] for x in recs if x["step"] > j["step"]]
    assert len(after) >= 2 and after[-1] < after[0]


@pytest.mark.parametrize("respawn, left, checkpoint, others, outcome, why", [
    (1, 1, True, [], "restarted", None),  # nobody to join: its own checkpoint
    (1, 1, False, [1], "restarted", None),  # a live replica to join
    (1, 1, False, [], "dead", "no live replica to join from and no checkpoint of its own"),
    (2, 0, True, [1], "dead", "--respawn is spent"),
    (0, 0, True, [1], "dead", None),  # never allowed: nothing to explain
])
def test_a_failed_replica_is_started_again_or_the_summary_says_why(
        tmp_path, store, respawn, left, checkpoint, others, outcome, why):
    """Issue 36, item 4: with --respawn a dead replica starts again while it has a state to
    start from (a live replica's, or its own newest checkpoint); where it has neither its
    failure record says so."""
    from types import SimpleNamespace

    from noloco.checkpoint import receipt_file
    from noloco.config import Config
    from noloco.elastic.launcher import ElasticRun

    run = ElasticRun()
    run.out, run.replicas, run.stages = tmp_path, 2, 1
    run.local = [0, *others]
    run.incarnation, run.respawns = {0: 0, 1: 0}, left
    if checkpoint:
        receipt = receipt_file(replica_checkpoints(tmp_path, 0), 10, 0)
        receipt.parent.mkdir(parents=True)
        receipt.write_text("{}")  # what newest_checkpoints looks for
    started = []
    run.start = lambda sup, r: started.append(r)
    cfg = Config()
    cfg.train.respawn = respawn
    sup = SimpleNamespace(cfg=cfg, procs={0: SimpleNamespace(poll=lambda: -9)}, done=set(),
                          dead=set(), failures=[], store=store, read=lambda key: None)
    run.sup = sup
    assert run.failed(sup, 0) == outcome
    assert started == ([0] if outcome == "restarted" else [])
    assert sup.failures[0]["kind"] == "SIGKILL"
    assert sup.failures[0].get("not_restarted") == why


@pytest.mark.slow("elastic worker processes, a respawn after the others finished")
@pytest.mark.timeout(300)
def test_a_replica_killed_behind_after_the_others_finished_goes_on_from_its_checkpoint(
        tmp_path, corpus):
    """Issue 36, item 4: replica 3 freezes for 15 s at step 30 and the others finish
    meanwhile; killed at step 40, it has nobody to join from. It is started again all the
    same and goes on from its own newest checkpoint to the run's last step, and the run ends
    with all four."""
    out = tmp_path / "run"
    r = cli("train", "--data", str(corpus), *RUN, "--elastic", "--method", "noloco",
            "--steps", "50", "--sync-every", "5", "--out", str(out), "--respawn", "1",
            "--checkpoint-every", "10", "--inject-fault", "stall:3@30:15,kill:3@40",
            timeout=240)
    assert r.returncode == 0, r.stderr
    assert "nobody is left to join from: it goes on from its own checkpoint at step" in r.stderr
    s = summary(out)
    assert s["elastic"]["replicas_finished"] == [0, 1, 2, 3]
    assert [(f["replica"], f["step"]) for f in s["failures"]] == [(3, 40)]
    assert "not_restarted" not in s["failures"][0]
    own = [j for j in s["elastic"]["joins"] if j.get("kind") == "own checkpoint"]
    assert [j["replica"] for j in own] == [3] and 30 <= own[0]["step"] <= 40
    assert s["elastic"]["steps_per_replica"]["3"] == 50


@pytest.mark.slow("elastic worker processes, a kill")
@pytest.mark.timeout(300)
def test_diloco_survivors_stay_identical_after_a_death(tmp_path, corpus):
    out = tmp_path / "run"
    r = cli("train", "--data", str(corpus), *RUN, "--elastic", "--method", "diloco",
            "--steps", "80", "--out", str(out), "--inject-fault", "kill:2@40")
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["elastic"]["replicas_finished"] == [0, 1, 3]
    w = weights(out)
    ref = w["replica-0.safetensors"]
    for name in ("replica-1.safetensors", "replica-3.safetensors"):
        assert all((w[name][k] == ref[k]).all() for k in ref), name
    assert s["weight_spread"] == 0.0
    # The quorum shrank to the survivors: their all-reduce went on without replica 2.
    assert all(any(e.get("missing") == [2] for e in s["elastic"]["events"][r])
               for r in ("0", "1", "3"))


@pytest.mark.parametrize("args, message", [
    (["--method", "ddp", "--elastic"],
     "--elastic applies to noloco, diloco, streaming and sparseloco"),
    (["--method", "noloco", "--elastic", "--stages", "2"], "needs --routing fixed"),
    # a stage without a block of some fragment would count other operations than its peers
    (["--method", "streaming", "--elastic", "--stages", "2", "--routing", "fixed",
      "--fragments", "2", "--fragment-pattern", "sequential"],
     "stage 0 holds no block of fragment 1"),
    (["--method", "noloco", "--elastic", "--stages", "2", "--routing", "fixed",
      "--fragments", "4", "--sync-every", "100"], "stage 0 holds no block of fragment 2"),
    (["--method", "noloco", "--respawn", "1"], "--respawn needs --elastic"),
    (["--method", "noloco", "--elastic", "--peer-timeout", "0"], "--peer-timeout must be > 0"),
])
def test_impossible_elastic_settings_are_one_line(tmp_path, corpus, args, message, capsys):
    # in this process: the settings are refused before any other process starts
    code = main(["train", "--data", str(corpus), *SMALL, "--replicas", "4", *args,
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow("elastic worker processes, a stall")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", [
    ["diloco"],
    # per-fragment slow weights: the heal's checksum covers them too (it once crashed there)
    ["streaming", "--fragments", "2", "--overlap-steps", "1", "--quantize", "fp4"],
    # an all-gather of sparse messages; the healer starts owing nothing, like a joiner
    ["sparseloco"]],
    ids=["diloco", "streaming-fp4", "sparseloco"])
def test_diloco_a_stalled_replica_heals_from_the_quorum(tmp_path, corpus, method):
    out = tmp_path / "run"
    r = cli("train", "--data", str(corpus), *RUN, "--elastic", "--method", *method,
            "--steps", "200", "--out", str(out), "--inject-fault", f"stall:2@40:{TIMEOUT + 1.5}")
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["elastic"]["replicas_finished"] == [0, 1, 2, 3] and s["failures"] == []
    healed = [j for j in s["elastic"]["joins"] if j.get("kind") == "healed"]
    assert healed and healed[0]["step"] > healed[0]["step_before"]  # it caught up
    others = [v for k, v in s["elastic"]["longest_wait_seconds"].items() if k != "2"]
    assert max(others) < TIMEOUT + 1.5
    if method[0] == "streaming":  # Streaming's fragments train on between their syncs
        return
    w = weights(out)
    ref = w["replica-0.safetensors"]
    for k in (1, 2, 3):  # the quorum's slow weights again, everywhere
        assert all((w[f"replica-{k}.safetensors"][n] == ref[n]).all() for n in ref), k


ROLE = """
import json, os, sys, time, torch
from datetime import timedelta
import torch.distributed as dist
from noloco.elastic import ElasticCommunicator, Membership
port, r, n, plan = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
op = sys.argv[5]
store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
m = Membership(store, r, n, 2.0).start()
c = ElasticCommunicator(m, 2.0)
if plan.get("seal"):
    from noloco.faults import Tamper
    from noloco.integrity import Sealer
    c.sealer = Sealer(b"k" * 32)
    if r in plan.get("tamper", []):  # installed from outside, as the fault does
        c.wire = Tamper()
store.add("started", 1)
while store.add("started", 0) < n:  # all beat before anyone fixes a snapshot
    time.sleep(0.01)
attempts = []
group = c._group


class Work:
    def __init__(self, work, act):
        self.work, self.act = work, act

    def wait(self):
        self.work.wait()
        if self.act[0] == "fail_after":  # the ring completed here, then this member broke
            time.sleep(self.act[1])
            raise RuntimeError("broke after the collective")
        if self.act[0] == "slow":  # completed here; reports late
            time.sleep(self.act[1])


class PG:
    def __init__(self, pg, act):
        self.pg, self.act = pg, act

    def allreduce(self, xs):
        return Work(self.pg.allreduce(xs), self.act)

    def allgather(self, outs, xs):
        return Work(self.pg.allgather(outs, xs), self.act)


def planned(call, tag, final):
    act = plan.get(str(r), {}).get(str(len(attempts)), ["ok"])
    attempts.append(final)
    pg = group(call, tag, final)
    if act[0] == "die":  # arrived and connected, gone before the all-reduce: as a kill -9
        os._exit(0)
    return PG(pg, act)


c._group = planned
if op == "all_gather":  # replica r's message: 1000 bytes of r + 1
    got = c.all_gather_async(torch.full((1000,), r + 1, dtype=torch.uint8)).wait()
    value = [None if x is None else x.unique().tolist() for x in got]
else:
    t = torch.full((1000,), float(r + 1))
    c.all_reduce_mean_async(t).wait()
    value = t.unique().tolist()
print(json.dumps({"value": value, "retries": c.retries, "behind": c.behind,
                  "attempts": attempts, "events": [e["kind"] for e in c.events],
                  "bytes": c.bytes_sent, "mac_bytes": c.mac_bytes}))
"""


def all_reduce_roles(n: int, plan: dict, op: str = "all_reduce") -> dict[int, dict]:
    """``n`` replicas all-reduce ``r + 1`` once through the elastic communicator (or, ``op``
    all_gather, gather a message of ``r + 1``s), replica r acting out ``plan[r][attempt]``
    (die, fail_after SECONDS, slow SECONDS, or ok); ``plan["seal"]``: with payload MACs,
    ``plan["tamper"]`` the replicas whose messages leave altered. The results of those that
    finished."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30),
                          wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, "-c", ROLE, str(store.port), str(r), str(n),
                               json.dumps(plan), op],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    outs = [p.communicate(timeout=90) for p in procs]
    return {r: json.loads(o.strip().splitlines()[-1]) for r, (o, _) in enumerate(outs)
            if o.strip()}


@pytest.mark.slow("member processes at a store")
@pytest.mark.timeout(120)
def test_an_all_reduce_member_lost_midway_then_another_in_the_retry():
    """Four replicas; 3 connects and dies before the all-reduce, then 2 does the same in the
    retry: 0 and 1 discard both failed attempts and average between themselves — the same
    bits, each retry among the previous attempt's members (not each one's own view)."""
    res = all_reduce_roles(4, {3: {0: ["die"]}, 2: {1: ["die"]}})
    assert sorted(res) == [0, 1], res
    assert res[0]["value"] == res[1]["value"] == [1.5], res
    for x in res.values():
        assert x["retries"] == 2 and not x["behind"], x
        assert x["attempts"] == [[0, 1, 2, 3], [0, 1, 2], [0, 1]], x
        assert x["events"] == ["lost", "absent", "lost", "absent"], x


@pytest.mark.slow("member processes at a store")
@pytest.mark.timeout(120)
def test_an_all_reduce_that_completed_elsewhere_commits_and_the_broken_member_heals():
    """The collective completes on 0 and 1, which commit and step; 2 breaks after it: the
    outcome is fixed, so 2 steps on nothing of its own — it is behind (it heals)."""
    res = all_reduce_roles(3, {2: {0: ["fail_after", 1.0]}})
    assert res[0]["value"] == res[1]["value"] == [2.0], res
    assert not res[0]["behind"] and not res[1]["behind"] and res[0]["retries"] == 0
    assert res[2]["behind"] and res[2]["value"] == [3.0] and res[2]["events"] == ["behind"]


@pytest.mark.slow("member processes at a store")
@pytest.mark.timeout(120)
def test_an_all_reduce_aborted_first_is_retried_by_members_that_completed_it():
    """2 breaks at once after the collective; 0 and 1 completed it but report later: the
    abort stands, and all three retry (0 and 1 drop the mean they had) and agree."""
    res = all_reduce_roles(3, {2: {0: ["fail_after", 0.0]}, 0: {0: ["slow", 1.0]},
                               1: {0: ["slow", 1.0]}})
    assert [res[r]["value"] for r in range(3)] == [[2.0]] * 3, res
    for r in range(3):
        assert res[r]["retries"] == 1 and not res[r]["behind"], res[r]
        assert res[r]["events"] == ["lost" if r == 2 else "aborted"], res[r]
        assert res[r]["attempts"] == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.slow("member processes at a store")
@pytest.mark.timeout(120)
def test_an_all_gather_member_lost_midway_is_left_out_of_every_members_result():
    """Four replicas gather their messages; 3 connects and dies before the collective: 0, 1
    and 2 discard the attempt and gather among themselves — each holds the same three
    messages, and 3's place is empty. Bytes: two messages each (the committed attempt)."""
    res = all_reduce_roles(4, {"3": {"0": ["die"]}}, "all_gather")
    assert sorted(res) == [0, 1, 2], res
    for x in res.values():
        assert x["value"] == [[1], [2], [3], None], x
        assert x["retries"] == 1 and not x["behind"], x
        assert x["attempts"] == [[0, 1, 2, 3], [0, 1, 2]], x
        assert x["bytes"] == 2 * 1000, x


@pytest.mark.slow("member processes at a store")
@pytest.mark.timeout(120)
def test_an_all_gather_that_completed_elsewhere_leaves_the_broken_member_its_own_message():
    """The gather completes on 0 and 1, which commit; 2 breaks after it: it holds only its
    own message and is behind (it heals; its message is in nobody's mean but its own)."""
    res = all_reduce_roles(3, {"2": {"0": ["fail_after", 1.0]}}, "all_gather")
    assert res[0]["value"] == res[1]["value"] == [[1], [2], [3]], res
    assert res[2]["behind"] and res[2]["value"] == [None, None, [3]], res


@pytest.mark.slow("member processes at a store")
@pytest.mark.timeout(120)
def test_a_sealed_all_gather_leaves_out_the_member_whose_message_was_altered():
    """With payload MACs, replica 1's message leaves altered after its seal: every member
    sees the bad tag, and all retry without 1 (the first report names it), which is left
    with its own message alone and behind."""
    res = all_reduce_roles(3, {"seal": True, "tamper": [1]}, "all_gather")
    for r in (0, 2):
        assert res[r]["value"] == [[1], None, [3]], res
        assert res[r]["attempts"] == [[0, 1, 2], [0, 2]] and not res[r]["behind"], res
        assert res[r]["mac_bytes"] > 0
    assert res[1]["behind"] and res[1]["value"] == [None, [2], None], res
    clean = all_reduce_roles(3, {"seal": True}, "all_gather")
    assert all(x["value"] == [[1], [2], [3]] and x["retries"] == 0 for x in clean.values())


STAGES = ["--stages", "2", "--routing", "fixed"]


@pytest.mark.slow("elastic worker processes in pipeline stages")
@pytest.mark.timeout(300)
def test_with_pipeline_stages_elastic_equals_static_and_a_replica_rejoins(tmp_path, corpus):
    """Fixed routing keeps a replica's samples in its own pipeline: its stages are a fault
    domain of their own (a process group per replica), stage s of each replica exchanges with
    stage s of its partners, and a respawned replica's stages all take their state from the
    donor's same stages at one step. On Ctrl-C a replica's stages agree on a step and save it
    (no step is redone); ``--resume`` continues each replica from the step all its stages
    saved, and the run ends bit for bit as the static one (which an uncut elastic run
    equals)."""
    two = [*RUN, "--replicas", "2"]  # 2 replicas x 2 stages: 4 workers (the last flag wins)
    runs = {"static": tmp_path / "static", "elastic": tmp_path / "elastic"}
    args = ["--data", str(corpus), *two, *STAGES, "--method", "noloco", "--steps", "40"]
    r = cli("train", *args, "--out", str(runs["static"]))
    assert r.returncode == 0, r.stderr
    # Paced steps (a sleep): stopped mid-run, between two checkpoints of each stage.
    proc = subprocess.Popen([sys.executable, "-m", "noloco", "train", *args, "--elastic",
                             "--checkpoint-every", "10", "--out", str(runs["elastic"]),
                             "--inject-fault", "pace:0:0.1,pace:1:0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: all(10 in complete_steps(replica_checkpoints(runs["elastic"], q, st,
                                                                      2), 1)
                             for q in (0, 1) for st in (0, 1)),
                 120, "every stage's checkpoint of step 10")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "--resume" in err and "stopped past its checkpoint" not in err, err
    stopped = summary(runs["elastic"])["elastic"]
    saved = {int(q): st for q, st in stopped["saved_steps"].items()}
    # Each replica stopped at the step its stages agreed on and saved (the periodic
    # checkpoints are 10 apart: stopping at once, the stages would have saved less).
    assert saved == {int(q): st for q, st in stopped["reached_steps"].items()}, stopped
    assert sorted(saved) == [0, 1] and all(10 <= st < 40 for st in saved.values()), saved
    r = cli("train", "--resume", str(runs["elastic"]))
    assert r.returncode == 0, r.stderr
    for q, st in saved.items():
        for stage in (0, 1):
            assert f"replica {q} stage {stage}: resuming from step {st}" in r.stderr, r.stderr
            own = json.loads((runs["elastic"] / "metrics" / f"replica-{q}.stage-{stage}.json")
                             .read_text())
            assert own["resumed_from_step"] == st
    a, b = weights(runs["static"]), weights(runs["elastic"])
    assert set(a) == set(b) and "replica-1.stage-1.safetensors" in b
    for name in a:
        for k in a[name]:
            if name.startswith("replica-"):
                assert torch.equal(a[name][k], b[name][k]), name
            else:  # the average: an all-reduce there, a mean of the files here (rounding)
                torch.testing.assert_close(a[name][k], b[name][k], rtol=0, atol=1e-6)
    s, e = summary(runs["static"]), summary(runs["elastic"])
    assert e["bytes_sent_per_replica"] == s["bytes_sent_per_replica"]
    assert math.isclose(e["weight_spread"], s["weight_spread"], rel_tol=1e-6, abs_tol=1e-12)

    out = tmp_path / "killed"
    r = cli("train", "--data", str(corpus), *two, *STAGES, "--method", "noloco",
            "--steps", "100", "--elastic", "--inject-fault", "kill:1@40", "--respawn", "1",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    k = summary(out)
    assert k["elastic"]["replicas_finished"] == [0, 1]
    assert [(f["replica"], f["kind"]) for f in k["failures"]] == [(1, "SIGKILL")]
    donated = {j["stage"]: j for j in k["elastic"]["joins"] if j.get("kind") == "donated"}
    joined = {j["stage"]: j for j in k["elastic"]["joins"] if j.get("kind") == "joined"}
    assert set(donated) == set(joined) == {0, 1}
    assert len({j["step"] for j in [*donated.values(), *joined.values()]}) == 1  # one step
    for st in (0, 1):  # bit for bit, stage by stage
        assert donated[st]["checksum"] == joined[st]["checksum"]
    assert max(k["elastic"]["longest_wait_seconds"].values()) < TIMEOUT + 1.5
    assert all(math.isfinite(v) for v in k["final_val_loss_per_replica"].values())


@pytest.mark.slow("elastic worker processes in pipeline stages")
@pytest.mark.alone("6 worker processes (3 replicas x 2 stages) with hangs against timeouts")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", [["diloco"], ["streaming", "--quantize", "fp4",
                                                 "--fragments", "2"], ["sparseloco"]],
                         ids=["diloco", "streaming-fp4", "sparseloco"])
def test_all_reduce_methods_with_pipeline_stages_elastic_equal_static_and_heal_together(
        tmp_path, corpus, method):
    """An all-reduce method, 3 replicas x 2 stages under fixed routing: without failures the
    elastic run is the static one bit for bit. A replica whose stages hang past
    --peer-timeout is left out of an all-reduce (its slow weights are no longer the
    others'): its stages find that together at the next step boundary and heal together,
    stage by stage from one donor at one step (checksums equal); with DiLoCo and SparseLoCo
    every replica then ends with the same weights (Streaming's fragments are synced at other
    steps: its replicas end apart even without failures). A DiLoCo replica killed and
    respawned joins the same way."""
    args = ["--data", str(corpus), *RUN, "--replicas", "3", *STAGES, "--method", *method]
    runs = {k: tmp_path / k for k in ("static", "elastic", "hung", "killed")}
    # Paced steps: the others still train when a hung one comes back, and six processes
    # flat out would starve the tests in the other lanes (their replicas would miss
    # timeouts: an etcd test did once beside this one).
    paced = "pace:0:0.1,pace:1:0.1,pace:2:0.1"
    for name, extra in (("static", []), ("elastic", ["--elastic"])):
        r = cli("train", *args, "--steps", "40", "--inject-fault", paced, *extra,
                "--out", str(runs[name]))
        assert r.returncode == 0, r.stderr
    a, b = weights(runs["static"]), weights(runs["elastic"])
    assert set(a) == set(b) and "replica-2.stage-1.safetensors" in b
    for name in a:
        if name.startswith("replica-"):
            assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    assert summary(runs["elastic"])["bytes_sent_per_replica"] == \
        summary(runs["static"])["bytes_sent_per_replica"]

    faults = {"hung": f"hang:1@15:{TIMEOUT + 2}", "killed": "kill:1@35"}
    for name in ("hung", "killed") if method[0] == "diloco" else ("hung",):
        r = cli("train", *args, "--steps", "100", "--elastic", "--respawn", "1",
                "--inject-fault", f"{faults[name]},{paced}", "--out", str(runs[name]))
        assert r.returncode == 0, r.stderr
        s = summary(runs[name])
        kind = "healed" if name == "hung" else "joined"
        took = {j["stage"]: j for j in s["elastic"]["joins"] if j.get("kind") == kind}
        gave = {j["stage"]: j for j in s["elastic"]["joins"] if j.get("kind") == "donated"}
        assert set(took) == set(gave) == {0, 1}, s["elastic"]["joins"]
        assert {j["replica"] for j in took.values()} == {1}
        assert len({j["from"] for j in took.values()}) == 1  # one donor for both stages
        assert len({j["step"] for j in [*took.values(), *gave.values()]}) == 1  # one step
        for st in (0, 1):
            assert took[st]["checksum"] == gave[st]["checksum"]
        if name == "hung":
            assert all(j["step_before"] < j["step"] for j in took.values())
            assert not s["failures"]
        assert s["elastic"]["replicas_finished"] == [0, 1, 2]
        assert all(math.isfinite(v) for v in s["final_val_loss_per_replica"].values())
        if method[0] == "streaming":
            continue
        w = weights(runs[name])
        for st in (0, 1):  # the last all-reduce left every replica's weights the same
            mine = [w[f"replica-{q}.stage-{st}.safetensors"] for q in range(3)]
            assert all(torch.equal(m[k], mine[0][k]) for m in mine[1:] for k in m), (name, st)


def test_a_store_that_goes_away_is_one_line_not_a_traceback():
    import torch.distributed as dist

    from noloco.config import Config
    from noloco.spec import WorkerSpec
    from noloco.worker import WorkerStatus, classify

    status = WorkerStatus(spec=WorkerSpec(Config()))
    code, kind, line, culprit = classify(dist.DistStoreError("wait timeout after 30000ms, "
                                                             "keys: /x\nmore"), status)
    assert (code, kind, culprit) == (1, "comm", None)
    assert line == "noloco: error: the run's store is unreachable (wait timeout after 30000ms, " \
                   "keys: /x)"
