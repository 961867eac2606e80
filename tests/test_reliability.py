"""Failures on cue: kill -9 and restart, a stopped peer, Ctrl-C, a full disk, listeners, bad input.

Every run here is a real multi-process run through the CLI (or torchrun); "equals the
uninterrupted run" means bit for bit (:func:`run_utils.assert_same_run`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import free_port
from run_utils import (
    SMALL,
    alive,
    assert_same_run,
    cli,
    metrics,
    summary,
    train,
    wait_for,
    worker_pids,
)

from noloco import checkpoint as C
from noloco.cli import main

DILOCO = ["--method", "diloco", "--replicas", "2", "--sync-every", "4", "--eval-every", "8",
          "--steps", "24"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The uninterrupted DiLoCo run every restart must reproduce."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert train(run, corpus, *DILOCO) == 0
    return run


@pytest.mark.slow("worker processes, a kill -9")
@pytest.mark.timeout(180)
def test_kill9_with_max_restarts_continues_from_the_checkpoint(tmp_path, corpus, capfd,
                                                               reference):
    out = tmp_path / "run"
    assert train(out, corpus, *DILOCO, "--max-restarts", "1",
                 "--inject-fault", "kill:1@10") == 0
    err = capfd.readouterr().err
    assert "rank 1 (replica 1, stage 0) was killed by SIGKILL" in err
    assert "restarting from checkpoint step" in err and "(restart 1 of 1)" in err
    assert_same_run(reference, out)
    s = summary(out)
    assert s["restarts"] == 1 and s["resumed_from_step"] in (4, 8)
    assert s["failures"][0]["rank"] == 1 and s["failures"][0]["signal"] == "SIGKILL"


@pytest.mark.slow("worker processes, a kill -9")
@pytest.mark.timeout(240)
def test_kill9_from_outside_mid_run(tmp_path, corpus, reference):
    """A real ``kill -9`` at whatever moment the run has reached, once it holds a checkpoint
    (the workers are slowed down so that moment comes well before the end)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *SMALL,
         *DILOCO, "--max-restarts", "1", "--inject-fault", "slow:0:6,slow:1:6",
         "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: C.complete_steps(out / "checkpoints", 2), 120, "a checkpoint")
        pids = wait_for(lambda: worker_pids(out), 30, "the workers")
        os.kill(pids[(1, 0)], signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "was killed by SIGKILL" in err and "restarting from checkpoint step" in err
    assert_same_run(reference, out)


@pytest.mark.slow("torchrun and its worker processes")
@pytest.mark.timeout(240)
def test_torchrun_max_restarts_continues_from_the_checkpoint(tmp_path, corpus,
                                                             reference):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "--max-restarts", "1", "-m", "noloco", "train", "--data", str(corpus),
         *SMALL, *DILOCO, "--inject-fault", "kill:1@10", "--out", str(out)],
        capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "injected fault: SIGKILL to rank 1" in proc.stderr
    assert "resuming from checkpoints/step-" in proc.stderr
    assert_same_run(reference, out)
    assert summary(out)["attempt"] == 1


@pytest.mark.slow("worker processes, a SIGSTOP")
@pytest.mark.timeout(180)
def test_a_stopped_worker_is_named_by_the_warning_and_the_error(tmp_path, corpus):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *SMALL,
         "--method", "ddp", "--replicas", "3", "--steps", "100000", "--eval-every", "1000",
         "--checkpoint-every", "5", "--stall-warning", "1", "--comm-timeout", "5",
         "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: C.complete_steps(out / "checkpoints", 3), 90, "training")
        pids = worker_pids(out)
        t0 = time.monotonic()
        os.kill(pids[(2, 0)], signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    warnings = [x for x in lines if x.startswith("noloco: warning:")]
    assert warnings and all("for rank 2 (replica 2, stage 0): no heartbeat" in x
                            for x in warnings), err
    final = lines[-1]
    assert final.startswith("noloco: error: rank 2 (replica 2, stage 0) stopped answering"), err
    assert proc.returncode == 1 and took < 60
    s = summary(out)
    assert s["status"] == "failed" and s["failed_rank"] == 2 and s["signal"] is None
    assert not any(alive(p) for p in pids.values())


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(120)
def test_a_worker_error_is_the_cause_not_the_peer_it_left_waiting(tmp_path, corpus,
                                                                   capfd):
    out = tmp_path / "run"
    assert train(out, corpus, "--method", "ddp", "--replicas", "2", "--steps", "20",
                 "--inject-fault", "crash:1@3") == 1
    err = capfd.readouterr().err
    assert "InjectedCrash: injected crash of rank 1 (replica 1, stage 0) after step 3" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("noloco: error: InjectedCrash: injected crash of rank 1"), last
    s = summary(out)
    assert s["status"] == "failed" and s["failed_rank"] == 1
    assert s["reason"].startswith("InjectedCrash")


def _as_torchrun_worker(monkeypatch, run_id: str) -> None:
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                 "TORCHELASTIC_RUN_ID": run_id}.items():
        monkeypatch.setenv(k, v)


def test_a_torchrun_restart_of_the_same_job_resumes_and_a_new_job_is_refused(
        tmp_path, corpus, capfd, monkeypatch):
    out = tmp_path / "run"
    argv = ["train", "--data", str(corpus), *SMALL, "--checkpoint-every", "2",
            "--eval-every", "2", "--out", str(out), "--overwrite"]
    _as_torchrun_worker(monkeypatch, "job-a")
    assert main([*argv, "--steps", "4", "--schedule-steps", "8"]) == 0
    assert json.loads((out / "job.json").read_text()) == {"torchelastic_run_id": "job-a"}
    # torchrun restarts job-a (same run id): it resumes, even with --overwrite in its flags.
    capfd.readouterr()
    assert main([*argv, "--steps", "8", "--schedule-steps", "8"]) == 0
    assert "resuming from checkpoints/step-00000004" in capfd.readouterr().err
    assert summary(out)["resumed_from_step"] == 4 and summary(out)["steps"] == 8
    # Another job without --overwrite is refused; the run is left as it was.
    _as_torchrun_worker(monkeypatch, "job-b")
    argv.remove("--overwrite")
    assert main([*argv, "--steps", "8"]) == 2
    assert "already exists" in capfd.readouterr().err
    assert summary(out)["status"] == "completed"


@pytest.mark.slow("training subprocesses stopped by signals")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method,replicas,sig", [
    ("ddp", "2", signal.SIGINT), ("ddp", "2", signal.SIGTERM), ("single", "1", signal.SIGINT)])
def test_ctrl_c_and_sigterm_end_in_one_line(tmp_path, corpus, method, replicas, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *SMALL,
         "--method", method, "--replicas", replicas, "--steps", "100000", "--eval-every", "5",
         "--checkpoint-every", "5", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
        wait_for(lambda: C.complete_steps(out / "checkpoints", int(replicas)), 90, "training")
        pids = worker_pids(out)
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where it hangs: faulthandler dumps on SIGABRT
            proc.send_signal(signal.SIGABRT)
            pytest.fail("no exit within 60 s of the signal; stacks:\n" + proc.communicate()[1])
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("noloco: interrupted at step ")
    assert lines[0].endswith(f"; continue with: noloco train --resume {out}")
    s = summary(out)
    assert s["status"] == "interrupted" and s["last_step"] >= 5
    assert s["newest_checkpoint"].startswith("checkpoints/step-")
    assert not any(alive(p) for p in pids.values()) and not worker_pids(out)
    assert not list(out.rglob("*.tmp"))
    metrics(out)  # whole lines only


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: room for one checkpoint of the tiny model (~11 MB), not two."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow("a tmpfs mount and a subprocess")
@pytest.mark.timeout(120)
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(small_disk, corpus):
    out = small_disk / "run"
    r = cli("train", "--data", str(corpus), *SMALL, "--steps", "40",
            "--checkpoint-every", "5", "--eval-every", "5", "--out", str(out))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0] == (f"noloco: error: disk full writing {out}/checkpoints/step-00000010/"
                        f"rank-00000.safetensors (No space left on device) (the newest complete "
                        f"checkpoint, step 5, is intact)")
    data, why = C.verify(out / "checkpoints", 5, 0, _hash(out))
    assert data is not None, why
    steps = [m["step"] for m in metrics(out)]  # whole lines, up to where the error surfaced
    assert steps[:3] == [0, 5, 10] and steps == list(range(0, 5 * len(steps), 5))
    assert not list(small_disk.rglob("*.tmp"))
    s = summary(out)
    assert s["status"] == "failed" and s["newest_checkpoint"] == "checkpoints/step-00000005"


def _hash(run: Path) -> str:
    from noloco.rundir import RunDir

    return RunDir(run).read_config().resolved().math_hash()


def _listening_sockets(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on (from /proc)."""
    listen = {}
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                listen[f[9]] = f[1]
    found = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listen:
                found.append(listen[target[8:-1]])
    return found


def _loopback(hex_addr: str) -> bool:
    ip = hex_addr.split(":")[0]
    return ip in ("0100007F", "00000000000000000000000001000000",
                  "0000000000000000FFFF00000100007F")


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(120)
def test_a_local_run_listens_on_loopback_only(tmp_path, corpus):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *SMALL,
         "--method", "noloco", "--replicas", "2", "--stages", "2", "--sync-every", "2",
         "--steps", "100000", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file(), 90, "training")
        pids = [proc.pid, *worker_pids(out).values()]
        assert len(pids) == 5
        addrs = _listening_sockets(pids)
        assert addrs and all(_loopback(a) for a in addrs), addrs
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


# ---- bad input: exit 2, one line, nothing written ----------------------------------------------

def _one_line_exit_2(capfd, out: Path, *argv: str, msg: str) -> None:
    assert main(["train", *argv, "--out", str(out)]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
def test_device_cuda_without_a_gpu(tmp_path, capfd):
    _one_line_exit_2(capfd, tmp_path / "run", "--device", "cuda", "--steps", "1",
                     msg="--device cuda: no GPU is visible")


def test_unwritable_out(tmp_path, capfd):
    (tmp_path / "a-file").write_text("")
    _one_line_exit_2(capfd, tmp_path / "a-file" / "run", "--steps", "1",
                     msg="is not a directory")


def test_binary_data_is_refused_unless_allowed(tmp_path, capfd):
    blob = tmp_path / "blob.txt"
    blob.write_bytes(os.urandom(50_000))
    _one_line_exit_2(capfd, tmp_path / "run", "--data", str(blob), "--steps", "1",
                     msg="of its bytes are not UTF-8 (pass --allow-binary")
    assert main(["train", "--data", str(blob), "--allow-binary", *SMALL, "--steps", "1",
                 "--out", str(tmp_path / "ok")]) == 0


def test_a_data_error_inside_a_torchrun_worker(tmp_path, capfd, monkeypatch):
    blob = tmp_path / "blob.txt"
    blob.write_bytes(os.urandom(50_000))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)  # as torchrun starts a worker: no preflight in a launcher
    _one_line_exit_2(capfd, tmp_path / "run", "--data", str(blob), "--steps", "1",
                     msg="is not text")


def test_plot_without_matplotlib_is_refused_before_computing(tmp_path, capfd):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    png = tmp_path / "fig.png"
    t0 = time.monotonic()
    assert main(["netsim", "blocking", "--workers", "1024", "--plot", str(png)]) == 2
    assert time.monotonic() - t0 < 5
    err = capfd.readouterr().err.strip()
    assert err == "noloco: error: --plot needs matplotlib (pip install 'noloco[plot]')"
    assert not png.exists()


def test_a_stop_signal_while_a_failure_is_being_diagnosed_interrupts_the_run(tmp_path, capsys):
    """Ctrl-C in the moment after a worker failed (while the others get their grace to fail
    too): the run is interrupted — the others stop at a common step — and no failure is
    recorded or restarted."""
    from types import SimpleNamespace

    from noloco.launch import StaticRun

    class Worker:
        def __init__(self, code: int | None) -> None:
            self.returncode = code

        def poll(self) -> int | None:
            return self.returncode

    stopped = []
    sup = SimpleNamespace(
        signum=signal.SIGINT, procs={0: Worker(None), 1: Worker(-9)}, out=tmp_path, world=2,
        stages=1, failures=[], read=lambda key: None,
        cfg=SimpleNamespace(train=SimpleNamespace(max_restarts=3)),
        _stop_all=lambda graceful=False, grace=0: stopped.append(graceful))
    policy = StaticRun()
    policy.sup = sup
    assert policy.failed(sup, 0) == 128 + signal.SIGINT
    assert stopped == [True] and sup.failures == [] and policy.attempt == 0
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"
    assert capsys.readouterr().err.startswith("noloco: interrupted at step 0")
