"""Issue 38, a new user's first hour: the tools around a run work on every kind of run (static,
elastic, one replica, not completed), and what cannot work says so in one line, before
anything is written or printed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_utils import SMALL, cli, summary, train, wait_for

from noloco.cli import main
from noloco.netsim.predict import load_run, predict_run

WORDS = ("the cat sat on a mat and the dog ran far away from home while birds sang in "
         "old green trees").split()


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> Path:
    """A few KB of words to train on."""
    rng = random.Random(0)
    data = tmp_path_factory.mktemp("first_hour") / "words.txt"
    data.write_text(" ".join(rng.choice(WORDS) for _ in range(3000)))
    return data


@pytest.fixture(scope="module")
def single(tmp_path_factory, words) -> Path:
    """A one-replica run of 4 steps (in this process: a second or two)."""
    out = tmp_path_factory.mktemp("first_hour") / "single"
    assert train(out, words, "--method", "single", "--steps", "4", "--eval-every", "2",
                 "--checkpoint-every", "0") == 0
    return out


@pytest.fixture(scope="module")
def elastic(tmp_path_factory, words) -> Path:
    """An elastic two-replica DiLoCo run of 4 steps (worker processes: ~20 s)."""
    out = tmp_path_factory.mktemp("first_hour") / "elastic"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # the launcher's closing lines (print)
        # One all-reduce: the run's first snapshot waits for every replica (up to half the
        # peer timeout), so predict's bytes are those of a run without absences. A later
        # snapshot takes the replicas live at that moment: in a two-lane CI run the second of
        # two all-reduces left replica 1 out ('not_in_snapshot', its partner alone; not yet
        # understood: issue 36).
        assert train(out, words, "--method", "diloco", "--replicas", "2", "--sync-every", "4",
                     "--steps", "4", "--elastic", "--peer-timeout", "60") == 0
    (out.parent / "stdout.txt").write_text(said.getvalue())
    return out


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("noloco: error: ")
    return err[0]


def _unfinished(tmp_path: Path, run: Path, status: dict, metrics_lines: int) -> Path:
    """A copy of ``run`` as a run that stopped early: its config, its first metrics lines
    and the summary such a run leaves (its status alone, no results)."""
    out = tmp_path / status["status"]
    out.mkdir()
    shutil.copy(run / "config.json", out / "config.json")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)[:metrics_lines]
    if lines:
        (out / "metrics.jsonl").write_text("".join(lines))
    (out / "summary.json").write_text(json.dumps(status))
    return out


def test_overwrite_clears_a_previous_elastic_runs_replica_files(tmp_path) -> None:
    """An elastic run's end combines every ``metrics/replica-K.json`` it finds: one left by an
    earlier run of more replicas (or one whose replica finished) would count as this run's
    and name final weights this run never wrote. --overwrite clears them; what the run
    directory's contract does not name stays."""
    from noloco.config import Config
    from noloco.rundir import RunDir

    out = tmp_path / "run"
    (out / "metrics").mkdir(parents=True)
    (out / "metrics" / "replica-3.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    RunDir(out).prepare(Config(), overwrite=True)
    assert not (out / "metrics").exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()


# ---- 1. noloco report ------------------------------------------------------------------------

@pytest.mark.slow("an elastic run's worker processes")
@pytest.mark.timeout(120)
def test_report_reads_elastic_one_replica_and_unfinished_runs(single, elastic, tmp_path,
                                                               capsys) -> None:
    # Elastic summaries key per-replica numbers by replica ("0", "1"); static ones are lists.
    stopped = _unfinished(tmp_path, single,
                          {"status": "interrupted", "last_step": 3, "reason": "interrupted"}, 1)
    started = _unfinished(tmp_path, elastic, {"status": "running", "last_step": 0}, 0)
    out = tmp_path / "report"
    assert main(["report", str(elastic), str(single), str(stopped),
                 str(started), "--out", str(out)]) == 0
    rows = {r.split(" | ")[0].lstrip("| "): r.split(" | ")
            for r in (out / "report.md").read_text().splitlines() if r.startswith("| ")}
    s = summary(elastic)
    el = rows["elastic"]
    assert el[1:4] == ["diloco", "2", "1"] and el[10] == f"{s['final_val_loss']:.4f}"
    # how far each run got: runs of different lengths are told apart
    assert el[8:10] == ["4", f"{s['tokens_per_replica']:,.0f}"]
    mean_sent = sum(s["bytes_sent_per_replica"].values()) / 2
    assert el[12] == f"{mean_sent / 1e6:,.1f}" and float(el[12]) > 0
    one = rows["single"]
    assert one[1:3] == ["single", "1"] and one[11] == "—"  # no spread over one replica
    # a run that stopped: its settings from config.json, its last evaluation (step 0)
    first = json.loads((single / "metrics.jsonl").read_text().splitlines()[0])
    cut = rows["interrupted (interrupted at step 3)"]
    assert cut[1] == "single" and cut[10] == f"{first['val_loss']:.4f} (step 0)"
    assert cut[8] == "0"  # the step of that evaluation
    assert rows["running (running at step 0)"][1:3] == ["diloco", "2"]
    assert rows["running (running at step 0)"][10] == "—"
    capsys.readouterr()


def test_report_goes_beside_the_runs_unless_told(single, tmp_path, monkeypatch, capsys) -> None:
    """Not into whatever directory the user stands in: report/ in the directory holding the
    runs; -o puts it elsewhere."""
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(single)]) == 0
    assert (single.parent / "report" / "report.md").is_file()
    assert not (tmp_path / "report").exists()
    assert main(["report", str(single), "-o", str(tmp_path / "mine")]) == 0
    assert (tmp_path / "mine" / "report.md").is_file()
    assert f"wrote {single.parent / 'report' / 'report.md'}" in capsys.readouterr().out


# ---- 2. missing extras: refused before anything is written -----------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag, modules, extra", [
    ("--tensorboard", ("tensorboard", "torch.utils.tensorboard"), "noloco[tb]"),
    ("--wandb", ("wandb",), "noloco[wandb]")])
def test_a_logger_without_its_extra_is_refused_before_the_run_starts(
        words, tmp_path, monkeypatch, capsys, flag, modules, extra) -> None:
    for m in modules:  # None in sys.modules: its import raises ImportError
        monkeypatch.setitem(sys.modules, m, None)
    out = tmp_path / "run"
    assert train(out, words, "--method", "single", "--steps", "2", flag) == 2
    line = _err_line(capsys)
    assert flag in line and extra in line
    assert not out.exists()  # the same command without the flag is not refused


@pytest.mark.timeout(60)
def test_netsim_plot_problems_are_found_before_the_table(tmp_path, monkeypatch, capsys) -> None:
    assert main(["netsim", "latency", "--plot", str(tmp_path / "no" / "x.png")]) == 2
    assert capsys.readouterr().out == ""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["netsim", "blocking", "--plot", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().out == ""
    assert main(["netsim", "blocking", "--plot", str(tmp_path / "x.png")]) == 2
    assert "noloco[plot]" in _err_line(capsys)
    assert not (tmp_path / "x.png").exists()


# ---- 3. damaged final weights ----------------------------------------------------------------

@pytest.mark.timeout(120)
def test_damaged_final_weights_are_one_line(single, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(single, run)
    weights = next((run / "model").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    assert main(["generate", str(run), "--prompt", "x", "--max-tokens", "2"]) != 0
    line = _err_line(capsys)
    assert line.startswith(f"noloco: error: cannot read model weights {weights}: ")
    pytest.importorskip("transformers")
    assert main(["export", str(run), str(tmp_path / "hf")]) != 0
    assert _err_line(capsys).startswith("noloco: error: cannot read model weights")
    assert not (tmp_path / "hf").exists()


# ---- 4. netsim predict on a run's own summary ------------------------------------------------

@pytest.mark.timeout(120)
def test_predict_for_a_one_replica_run_predicts_several(single, capsys) -> None:
    from noloco.netsim.predict import ONE_REPLICA_DEFAULT

    pred = predict_run(single, "1Gbit", "50ms")
    assert {m.replicas for m in pred.methods} == {ONE_REPLICA_DEFAULT}
    ddp = next(m for m in pred.methods if m.method == "ddp")
    assert ddp.bytes_sent_per_replica > 0  # N = 1 exchanges nothing: every row was 0 MB
    assert "-N" in pred.note
    assert main(["netsim", "predict", str(single), "-b", "1Gbit"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: the run had 1 replica, which exchanges nothing")
    # asked for N = 1: that is what it gets, without a note
    one = predict_run(single, "1Gbit", 0, replicas=1)
    assert {m.replicas for m in one.methods} == {1} and one.note is None


@pytest.mark.slow("an elastic run's worker processes")
@pytest.mark.timeout(120)
def test_an_elastic_run_ends_with_its_bytes_and_what_to_do_next(elastic) -> None:
    said = (elastic.parent / "stdout.txt").read_text()
    assert "done: elastic diloco, 2 of 2 replicas finished" in said
    assert " MB per replica, blocked up to " in said and "in communication" in said
    assert f"next: noloco report {elastic}" in said
    assert f"noloco netsim predict {elastic} --bandwidth" in said


@pytest.mark.slow("an elastic run's worker processes")
@pytest.mark.timeout(120)
def test_predict_reads_an_elastic_run(single, elastic, tmp_path, capsys) -> None:
    run = elastic
    s = summary(run)
    pred = predict_run(run, "1Gbit", 0, methods=("diloco",))
    # the run's own method: the run's own bytes (its summary keys them by replica)
    assert pred.methods[0].bytes_sent_per_replica == s["bytes_sent_per_replica"]["0"]
    assert pred.measured["bytes_sent_per_replica"] == s["bytes_sent_per_replica"]["0"]
    workers = [json.loads(f.read_text()) for f in sorted((run / "metrics").glob("*.json"))]
    assert len(workers) == 2
    assert load_run(run).compute_seconds == pytest.approx(
        sum(w["compute_seconds"] for w in workers) / 2)
    assert main(["netsim", "predict", str(run), "-b", "1Gbit"]) == 0
    capsys.readouterr()
    # without the workers' files: one line saying what is missing
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run / "summary.json", bare / "summary.json")
    assert main(["netsim", "predict", str(bare), "-b", "1Gbit"]) == 2
    assert "lacks compute_seconds" in _err_line(capsys)
    # a run that did not complete measured nothing to predict from
    stopped = _unfinished(tmp_path, single, {"status": "interrupted", "last_step": 1}, 1)
    assert main(["netsim", "predict", str(stopped), "-b", "1Gbit"]) == 2
    assert "did not complete (status 'interrupted')" in _err_line(capsys)


# ---- 5. flags are spelt out; counts agree with their nouns -----------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, flag", [
    (["train", "--method", "single", "--step", "5"], "--step"),  # was taken as --steps 5
    (["report", "--ou", "x", "run"], "--ou"),  # a subcommand's flag (report --out)
    (["netsim", "latency", "--work", "3"], "--work"),  # a nested subcommand's (--workers)
])
def test_an_abbreviated_flag_is_refused(argv, flag, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert f"unrecognized arguments: {flag}" in _err_line(capsys)
    assert not any(tmp_path.iterdir())  # nothing was trained nor written


def test_counts_of_one_are_singular() -> None:
    from noloco.config import ConfigError
    from noloco.distributed import Layout, check_device, cuda_devices
    from noloco.errors import plural

    assert (plural(1, "worker"), plural(2, "worker"), plural(0, "GPU")) == (
        "1 worker", "2 workers", "0 GPUs")
    if cuda_devices() == 0:
        with pytest.raises(ConfigError, match=r"no GPU is visible to this machine.s 1 worker "):
            check_device("cuda", 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match=r"--stages 1 = 1 worker$"):
            Layout.from_env(1, 1)


# ---- 6. the closing advice on more steps ----------------------------------------------------

@pytest.mark.timeout(120)
def test_the_advice_on_more_steps_keeps_to_the_schedule(words, single, tmp_path, capsys) -> None:
    from noloco.metrics import Progress

    capsys.readouterr()
    # A schedule that ended with the run: resuming would train at lr/10, and the line says so.
    Progress(enabled=True, total=4).final(summary(single), "runs/x", 4)
    out = capsys.readouterr().out
    assert "noloco train --resume runs/x --steps 8 would train on at the final learning rate" \
        in out and "train anew with --steps 8 --overwrite" in out
    # A schedule planned further: resume up to its end, the command that continues well.
    out = tmp_path / "planned"
    assert train(out, words, "--method", "single", "--steps", "2", "--schedule-steps",
                 "6", "--eval-every", "2", "--checkpoint-every", "2") == 0
    said = capsys.readouterr().out
    assert f"noloco train --resume {out} --steps 6   (to the end of its learning-rate " \
           f"schedule, --schedule-steps 6)" in said
    assert "final learning rate" not in said


# ---- 7. Ctrl-C keeps the work: a checkpoint of the step reached, and advice that works ------

def _interrupt(out: Path, data: Path, *args: str, after: int = 4,
               torchrun: int = 0) -> tuple[int, str]:
    """``noloco train`` in a fresh process, SIGINT once its progress line shows step
    ``after``: (exit code, stderr). Checkpoints every 100 steps: none before the signal.
    ``torchrun``: that many workers under torchrun, and the SIGINT to the whole process
    group, as a Ctrl-C at a terminal sends it (torchrun and every worker get it)."""
    log = out.parent / f"{out.name}.stdout"
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(torchrun)] if torchrun else [sys.executable])
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*launch, "-m", "noloco", "train", "--data", str(data), *SMALL,
             "--steps", "100000", "--checkpoint-every", "100", "--eval-every", "1000",
             "--log-every", "1", *args, "--out", str(out)],
            stdout=f, stderr=subprocess.PIPE, text=True, start_new_session=bool(torchrun))
        try:
            wait_for(lambda: f"step {after:>6}/" in log.read_text(), 120, f"step {after}")
            if torchrun:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                if torchrun:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
    return proc.returncode, err


@pytest.mark.slow("training subprocesses stopped by SIGINT")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("args, world", [
    (("--method", "single"), 1),  # one process: the worker runs in the CLI's own
    (("--method", "diloco", "--replicas", "2", "--sync-every", "5"), 2)])  # the launcher's
def test_an_interrupted_run_resumes_from_the_step_it_reached(words, tmp_path, args, world) -> None:
    from noloco.checkpoint import complete_steps

    out = tmp_path / "early"
    code, err = _interrupt(out, words, *args)
    assert code == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    s = summary(out)
    step = s["last_step"]
    assert s["status"] == "interrupted" and 4 <= step < 100
    # every worker saved the step reached (the same one), and the advice is the resume
    assert complete_steps(out / "checkpoints", world) == [step]
    assert s["newest_checkpoint"] == f"checkpoints/step-{step:08d}"
    assert lines[0] == (f"noloco: interrupted at step {step}; continue with: "
                        f"noloco train --resume {out}")
    r = cli("train", "--resume", str(out), "--steps", str(step + 2))
    assert r.returncode == 0, r.stderr
    assert f"noloco: resuming from checkpoints/step-{step:08d} (step {step})\n" in r.stderr
    s = summary(out)
    assert s["status"] == "completed" and s["resumed_from_step"] == step
    assert s["steps"] == step + 2


@pytest.mark.slow("torchrun and its workers stopped by a terminal's SIGINT")
@pytest.mark.timeout(240)
def test_a_ctrl_c_under_torchrun_keeps_the_step_reached(words, tmp_path) -> None:
    """The terminal's SIGINT reaches every worker directly and again through torchrun: one
    stop, not two (a second signal would stop at once, without the checkpoint); the workers
    agree on a step in torchrun's store and save it, and the resume starts there."""
    from noloco.checkpoint import complete_steps

    out = tmp_path / "early"
    code, err = _interrupt(out, words, "--method", "diloco", "--replicas", "2",
                           "--sync-every", "5", torchrun=2)
    assert code != 0, err
    s = summary(out)
    step = s["last_step"]
    assert s["status"] == "interrupted" and 4 <= step < 100, err
    assert complete_steps(out / "checkpoints", 2) == [step], err
    assert (f"noloco: stopped by SIGINT at step {step} (torchrun restarts the workers if its "
            f"--max-restarts allows); continue with: noloco train --resume {out}") in err, err
    r = cli("train", "--resume", str(out), "--steps", str(step + 2))
    assert r.returncode == 0, r.stderr
    assert f"noloco: resuming from checkpoints/step-{step:08d} (step {step})\n" in r.stderr
    assert summary(out)["resumed_from_step"] == step


def test_the_interrupt_line_never_advises_a_resume_that_fails(tmp_path) -> None:
    from noloco.checkpoint import interrupted_line, receipt_file

    out = tmp_path / "run"
    out.mkdir()
    line = interrupted_line(out, 45, 1)
    assert line == ("noloco: interrupted at step 45, with no checkpoint to resume from; start "
                    "again with the same command and --overwrite") and "--resume" not in line
    receipt = receipt_file(out / "checkpoints", 100, 0)
    receipt.parent.mkdir(parents=True)
    receipt.write_text("{}")
    assert interrupted_line(out, 129, 1) == (
        f"noloco: interrupted at step 129; its newest checkpoint is of step 100: the resume "
        f"redoes steps 101-129; continue with: noloco train --resume {out}")
    assert "no checkpoint" in interrupted_line(out, 129, 2)  # rank 1's is missing


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(180)
def test_a_resume_says_which_steps_it_redoes(words, tmp_path, capfd) -> None:
    out = tmp_path / "crashed"
    assert train(out, words, "--method", "ddp", "--replicas", "2", "--steps", "12",
                 "--checkpoint-every", "5", "--inject-fault", "crash:0@7") != 0
    assert summary(out)["last_step"] == 7
    capfd.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "8"]) == 0
    err = capfd.readouterr().err
    assert ("noloco: resuming from checkpoints/step-00000005 (step 5); the run had reached "
            "step 7: 2 steps (6-7) will be redone") in err, err


# ---- 8. a static run watched from another terminal -------------------------------------------

@pytest.mark.slow("training subprocesses")
@pytest.mark.timeout(240)
def test_status_watches_a_static_run(words, single, tmp_path) -> None:
    out = tmp_path / "watched"
    log = tmp_path / "stdout"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "noloco", "train", "--data", str(words), *SMALL,
             "--method", "diloco", "--replicas", "2", "--sync-every", "4", "--steps", "100000",
             "--eval-every", "4", "--log-every", "2", "--out", str(out)],
            stdout=f, stderr=subprocess.PIPE, text=True)
        try:
            # summary.json follows the run (it read "last_step": 0 until the run ended)
            wait_for(lambda: re.search(r"^step +4  train", log.read_text(), re.M), 120,
                     "an evaluation")
            step = wait_for(lambda: summary(out)["last_step"], 60, "a step in summary.json")
            assert summary(out)["status"] == "running"
            r = cli("status", str(out))
            assert r.returncode == 0, r.stderr
            head, *table = r.stdout.splitlines()
            assert head.startswith(f"run {out}: diloco, 2 replicas, running at step ")
            assert int(head.split("running at step ")[1].split()[0]) >= step
            rows = [x.split() for x in table[1:]]
            assert [x[:2] for x in rows] == [["0", "running"], ["1", "running"]]
            assert all(float(x[3]) > 0 and int(x[4]) >= 4 for x in rows)  # per-replica loss
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
        finally:
            proc.kill()
    r = cli("status", str(out), "--json")
    assert r.returncode == 0, r.stderr
    js = json.loads(r.stdout)
    assert js["status"] == "interrupted" and js["step"] == summary(out)["last_step"] >= step
    assert [row["state"] for row in js["rows"]] == ["interrupted"] * 2
    r = cli("status", str(single))
    assert r.returncode == 0 and "single, 1 replica, completed at step 4 of 4" in r.stdout


def test_status_shows_an_interrupted_replica_as_stopped_not_finished() -> None:
    """A replica stopped by Ctrl-C beats its last beat as one that finished (nobody waits for
    it) but says it stopped: `noloco status` and the live view show it stopped, to be resumed."""
    from noloco.elastic.status import COLOURS, _row

    assert _row(0, 0, {"done": True, "stopped": True}, "", None)["state"] == "stopped"
    assert _row(0, 0, {"done": True}, "", None)["state"] == "finished"
    assert "stopped" in COLOURS
