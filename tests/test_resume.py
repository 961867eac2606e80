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


@pytest.mark.parametrize("change, what", [
    ({"method": {"stages": 2, "routing": "fixed"}}, "with pipeline stages"),
    ({"train": {"coordinator": "127.0.0.1:29400", "replica_ids": "0-1"}}, "at a coordinator")])
def test_an_elastic_run_resumes_only_locally_and_in_one_stage(finished, tmp_path, capfd,
                                                             change, what):
    """What elastic --resume does not do yet is one line, before anything starts."""
    import shutil

    run = tmp_path / "elastic"
    shutil.copytree(finished, run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["method"].update(method="noloco", replicas=2, elastic=True, sync_every=5)
    for section, values in change.items():
        cfg[section].update(values)
    (run / "config.json").write_text(json.dumps(cfg))
    assert main(["train", "--resume", str(run), "--steps", "20"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--resume of an elastic run {what} is not supported yet" in err[0]


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
