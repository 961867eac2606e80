"""Resume: K steps + ``--resume`` + K more equals 2K straight steps, bit for bit, per method."""

from __future__ import annotations

import json

import pytest
from run_utils import assert_same_run, summary, train

from noloco import checkpoint as C
from noloco.cli import main

CASES = {
    # method flags, K (the straight run takes 2K), evaluation interval
    "single": (["--method", "single", "--dropout", "0.1", "--checkpoint-every", "3"], 6, 3),
    "ddp": (["--method", "ddp", "--replicas", "2", "--dropout", "0.1",
             "--checkpoint-every", "3"], 6, 3),
    # gradient accumulation: the data position counts microbatches
    "ddp-accum": (["--method", "ddp", "--replicas", "2", "--grad-accum", "3",
                   "--checkpoint-every", "3"], 6, 3),
    "diloco": (["--method", "diloco", "--replicas", "2", "--sync-every", "3"], 6, 3),
    # Muon's momentum and AdamW's moments, both in the checkpoint
    "diloco-muon": (["--method", "diloco", "--replicas", "2", "--sync-every", "3",
                     "--inner-optimizer", "muon"], 6, 3),
    "noloco": (["--method", "noloco", "--replicas", "2", "--sync-every", "3"], 6, 4),
    # the error feedback buffer is in the checkpoint
    "sparseloco": (["--method", "sparseloco", "--replicas", "2", "--sync-every", "3",
                    "--compress", "topk:0.05:2"], 6, 3),
    # sparse gossip, two fragments, τ = 1: the pulled chunks of a sync in flight, and every
    # fragment's error feedback
    "noloco-sparse": (["--method", "noloco", "--replicas", "2", "--sync-every", "4",
                       "--fragments", "2", "--overlap-steps", "1", "--compress", "topk:0.05:2"],
                      4, 2),
    # τ = 1: fragment 0's sync starts after step 4, the checkpoint's step, and lands at 5.
    "streaming": (["--method", "streaming", "--replicas", "2", "--sync-every", "4",
                   "--fragments", "2", "--overlap-steps", "1", "--quantize", "fp4"], 4, 2),
    "pipeline": (["--method", "noloco", "--replicas", "2", "--stages", "2", "--sync-every", "3",
                  "--microbatches", "2"], 6, 3),
}


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_k_steps_resume_k_more_equals_2k_straight(tmp_path, corpus, capfd, case):
    flags, k, every = CASES[case]
    flags = [*flags, "--eval-every", str(every)]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, corpus, *flags, "--steps", str(2 * k)) == 0
    # The first part plans the same schedule as the straight run: --schedule-steps 2K.
    assert train(split, corpus, *flags, "--steps", str(k), "--schedule-steps",
                 str(2 * k)) == 0
    first = summary(split)
    assert first["status"] == "completed" and first["steps"] == k
    assert C.complete_steps(split / "checkpoints", first["replicas"] * first["stages"])[0] == k
    if case in ("streaming", "noloco-sparse"):
        # the checkpoint holds a sync in flight, with what it received (sparse gossip: and
        # the chunks it pulls)
        saved = C.read_state(C.verify(split / "checkpoints", k, 0, _hash(split))[0])
        assert [(f, due) for f, due, *_ in saved["method"]["inflight"]] == [(0, k + 1)]
        if case == "noloco-sparse":
            extra = saved["method"]["inflight"][0][4]
            assert len(extra) == 5 and len(extra[4]) >= 1
            assert any(e.abs().sum() > 0 for e in saved["method"]["extra"]["errors"])
    assert main(["train", "--resume", str(split), "--steps", str(2 * k), "--log-every",
                 "0"]) == 0
    assert f"resuming from checkpoints/step-{k:08d} (step {k})" in capfd.readouterr().err
    assert_same_run(straight, split)
    assert summary(split)["resumed_from_step"] == k
    assert json.loads((split / "config.json").read_text())["train"]["steps"] == 2 * k


def _hash(run) -> str:
    from noloco.rundir import RunDir

    return RunDir(run).read_config().resolved().math_hash()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, request, corpus):
    """A finished single-replica run of 10 steps (checkpoints at 5 and 10, schedule of 20)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert train(run, corpus, "--steps", "10", "--schedule-steps", "20",
                 "--checkpoint-every", "5", "--eval-every", "5") == 0
    return run


BAD_RESUME = [
    (["--lr", "0.5"], "--lr cannot change when resuming"),
    (["--method", "ddp"], "--method cannot change when resuming"),
    (["--inner-optimizer", "muon"], "--inner-optimizer cannot change when resuming"),
    (["--steps", "10"], "already reached step 10"),
    (["--steps", "20", "--out", "/tmp/elsewhere"], "--out cannot be combined with --resume"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,msg", BAD_RESUME)
def test_resume_refuses_what_would_change_the_run(finished, capfd, argv, msg):
    before = {p: p.stat().st_mtime_ns for p in finished.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(finished), *argv]) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and msg in err, err
    assert {p: p.stat().st_mtime_ns for p in finished.rglob("*") if p.is_file()} == before


def test_an_elastic_replica_resumes_from_the_newest_step_all_its_stages_hold(tmp_path):
    """A replica continues from the newest step every one of its stages saved whole (its
    stages stopped at once, finding no step to agree on: apart); none in common, none."""
    from noloco.elastic.files import newest_checkpoints, replica_checkpoints

    held = {(0, 0): [10, 20, 30], (0, 1): [10, 20], (1, 0): [10], (1, 1): [20]}
    for (r, s), steps in held.items():
        for step in steps:
            C.receipt_file(replica_checkpoints(tmp_path, r, s, 2), step, 0).parent.mkdir(
                parents=True)
            C.receipt_file(replica_checkpoints(tmp_path, r, s, 2), step, 0).write_text("{}")
    C.step_dir(replica_checkpoints(tmp_path, 0, 1, 2), 30).mkdir()  # no receipt: unfinished
    assert newest_checkpoints(tmp_path, [0, 1], 2) == {0: 20, 1: None}
    assert newest_checkpoints(tmp_path, [0], 1) == {0: None}  # one stage: replica-0/ itself


def test_machines_resuming_at_one_coordinator_meet_in_one_new_epoch(tmp_path, monkeypatch):
    """``--resume`` at a coordinator that stayed up: the first machine to resume moves the
    run to a new epoch (no key of the stopped run's operations is met again), a machine
    resuming after it finds that epoch and stays, and a machine whose run trains on at
    another machine's replicas does not move it (its replicas join them). A store that
    restarted empty since the stop is followed as it is, whatever its epoch numbers; a run
    directory without a record (its launcher was killed) moves the run only where nobody
    trains."""
    import json
    import shutil

    from noloco.config import Config
    from noloco.elastic import auth
    from noloco.elastic.deadline import Namespace, open_store, run_epoch
    from noloco.elastic.host import Host
    from noloco.elastic.keys import live_key
    from noloco.elastic.launcher import ElasticRun
    from noloco.rundir import RunDir

    # An open store (another test of this process may have set a run secret).
    monkeypatch.setattr(auth, "_secret", None)
    host = Host("127.0.0.1", 0, 10.0)
    address = f"127.0.0.1:{host.port}"
    try:
        boot = run_epoch(address, "r1", 10.0)["boot"]
        assert boot and run_epoch(address, "r1", 10.0)["epoch"] is None  # no run yet

        def machine(local: list[int], stopped: dict | None, name: str = ""
                    ) -> tuple[ElasticRun, object]:
            run = ElasticRun()
            run.out, run.replicas, run.stages, run.local = (tmp_path / f"{local}{name}", 3, 1,
                                                            local)
            RunDir(run.out).prepare(Config(), overwrite=True)
            if stopped != "no summary":
                RunDir(run.out).write_summary({"status": "interrupted",
                                               "elastic": {"store": stopped}})
            run.ns = Namespace("r1")
            return run, open_store("127.0.0.1", host.port, 10.0, run.ns)

        a, conn_a = machine([0], {"boot": boot, "epoch": 0})
        b, conn_b = machine([1], {"boot": boot, "epoch": 0})
        assert a.ns.epoch == b.ns.epoch == 0
        a._resume_epoch(conn_a)  # nobody trains: a new epoch
        assert a.ns.epoch == 1 and run_epoch(address, "r1", 10.0) == {"boot": boot, "epoch": 1}
        b._resume_epoch(conn_b)  # stopped in 0, the run is in 1 now: it stays there
        assert b.ns.epoch == 1
        ns = Namespace("r1")
        open_store("127.0.0.1", host.port, 10.0, ns)
        assert ns.epoch == 1  # and every worker entering finds it
        # The run trains on at replica 2 (elsewhere) in epoch 1; replica 0 here stopped in 1
        # (A set gets no answer: a request after it on the same connection is answered
        # only once the store took it, so another connection reads the new value.)
        conn_a.set(live_key(), json.dumps({"0": {"step": 5}, "2": {"step": 40}}))
        conn_a.get(live_key())
        c, conn_c = machine([0], {"boot": boot, "epoch": 1})
        c._resume_epoch(conn_c)
        assert c.ns.epoch == 1  # its replicas join the live ones
        conn_a.set(live_key(), json.dumps({"0": {"step": 5}}))  # only its own (stale) beat
        conn_a.get(live_key())
        c._resume_epoch(conn_c)
        assert c.ns.epoch == 2
        # Stopped in epoch 5 of a store that has restarted empty since: not compared
        d, conn_d = machine([0], {"boot": "another store", "epoch": 5}, "d")
        d._resume_epoch(conn_d)
        assert d.ns.epoch == 2
        # No summary (a killed launcher), a summary of another shape: nobody trains, it moves
        for what in ("no summary", {"epoch": "x"}):
            e, conn_e = machine([0], what, "e")
            shutil.rmtree(e.out / "metrics", ignore_errors=True)
            before = e.ns.epoch
            e._resume_epoch(conn_e)
            assert e.ns.epoch == before + 1
    finally:
        host.stop()


def test_resume_needs_a_run_with_a_checkpoint(tmp_path, corpus, capfd):
    assert main(["train", "--resume", str(tmp_path / "nothing"), "--steps", "5"]) == 2
    assert "not a run directory" in capfd.readouterr().err
    run = tmp_path / "nockpt"
    assert train(run, corpus, "--steps", "2", "--checkpoint-every", "0") == 0
    capfd.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "5"]) == 2
    assert "no complete checkpoint" in capfd.readouterr().err


@pytest.mark.timeout(200)
def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(
        tmp_path, corpus, capfd):
    common = ["--checkpoint-every", "5", "--eval-every", "5", "--dropout", "0.1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, corpus, *common, "--steps", "20") == 0
    assert train(split, corpus, *common, "--steps", "10", "--schedule-steps", "20") == 0
    f = C.state_file(split / "checkpoints", 10, 0)
    raw = bytearray(f.read_bytes())
    raw[-100] ^= 0x01  # one flipped bit
    f.write_bytes(bytes(raw))
    capfd.readouterr()
    assert main(["train", "--resume", str(split), "--steps", "20", "--log-every", "0"]) == 0
    err = capfd.readouterr().err
    assert "checkpoint step-00000010: rank-00000.safetensors is corrupt" in err
    assert "resuming from checkpoints/step-00000005 (step 5)" in err
    assert_same_run(straight, split)


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(240)
def test_a_checkpoint_cadence_in_time_saves_agreed_steps_and_resumes(tmp_path, corpus, capfd):
    """``--checkpoint-every 1s`` with one replica twice as slow as the other: both save the
    same steps, at the slower one's pace (the outer all-reduce makes the faster one wait, so
    both measure it; the agreement over differing measurements is checked in
    test_checkpoint), at multiples of H (probe at step 20, 0.1 s a step: about every 10
    steps), and a resume from the last of them continues."""
    out = tmp_path / "run"
    assert train(out, corpus, "--method", "diloco", "--replicas", "2", "--sync-every", "2",
                 "--steps", "44", "--eval-every", "44", "--checkpoint-every", "1s",
                 "--keep-checkpoints", "10", "--inject-fault", "pace:0:0.05,pace:1:0.1") == 0
    steps = C.complete_steps(out / "checkpoints", 2)
    s = summary(out)
    assert s["checkpoint_every_seconds"] == 1.0 and s["checkpoint_saves"] == len(steps)
    assert steps[0] == 44 and all(x % 2 == 0 for x in steps), steps
    between = sorted(steps)[:-1]  # the end's save, and those the plans chose
    assert 2 <= len(between) <= 4 and between[0] > 20, steps
    gaps = [b - a for a, b in zip(between, between[1:], strict=False)]
    assert all(6 <= g <= 14 for g in gaps), steps  # ~10 steps of 0.1 s (not 20 of 0.05 s)
    assert main(["train", "--resume", str(out), "--steps", "48", "--log-every", "0"]) == 0
    assert "(step 44)" in capfd.readouterr().err
