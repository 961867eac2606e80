"""Workers forked from a warm parent (noloco.warm) train exactly as fresh processes do, answer
as processes do, and never outlive their launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_utils import (
    SMALL,
    alive,
    assert_same_run,
    cli,
    of_run,
    summary,
    train,
    wait_for,
    worker_pids,
)

from noloco import warm
from noloco.worker import process_name

pytestmark = pytest.mark.slow("worker processes")


def run_processes(run: Path) -> list[int]:
    """Every process of ``run`` (workers, their warm parent; a launcher of the command line)."""
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and of_run(d.name, run)]


@pytest.mark.timeout(180)
def test_forked_workers_train_bit_for_bit_as_fresh_processes(tmp_path, corpus, monkeypatch):
    """Same weights, metrics and summary (seeds, threads, ranks all come from the worker's own
    environment), and the warm parent is gone with the run."""
    args = ("--method", "noloco", "--replicas", "2", "--stages", "2", "--sync-every", "5",
            "--steps", "20")
    monkeypatch.setenv("NOLOCO_WARM_START", "0")
    assert train(tmp_path / "fresh", corpus, *args) == 0
    monkeypatch.setenv("NOLOCO_WARM_START", "1")
    assert train(tmp_path / "forked", corpus, *args) == 0
    assert_same_run(tmp_path / "fresh", tmp_path / "forked")
    assert run_processes(tmp_path / "forked") == []
    # The command line forks the warm parent itself from the launcher (a library caller, as
    # this test's process, starts it as a program).
    r = cli("train", "--data", str(corpus), *SMALL, *args, "--out", str(tmp_path / "cli"))
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path / "fresh", tmp_path / "cli")
    assert [summary(tmp_path / d)["startup"]["workers_start"] for d in ("fresh", "forked", "cli")
            ] == ["off", "started", "forked"]
    assert run_processes(tmp_path / "cli") == []


@pytest.mark.timeout(120)
def test_nothing_outlives_a_launcher_killed_with_sigkill(tmp_path, corpus):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "noloco", "train", "--data", str(corpus), *SMALL,
         "--method", "ddp", "--replicas", "2", "--steps", "100000", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = wait_for(lambda: len(w := worker_pids(out)) == 2 and w, 90, "the workers")
        parents = {int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
                   for p in pids.values()}
        assert len(parents) == 1 and proc.pid not in parents  # forked by one warm parent
        everyone = [*pids.values(), *parents]
        assert set(everyone) <= set(run_processes(out))
        proc.kill()
        proc.wait()
        wait_for(lambda: not any(alive(p) for p in everyone), 20, "workers and warm parent")
    finally:
        proc.kill()


@pytest.mark.timeout(120)
def test_a_forked_process_reports_its_exit_code_and_the_parent_ends_after_it():
    parent = warm.WarmParent(dict(os.environ))
    try:
        assert parent.ready()
        p = parent.start(["not json"], dict(os.environ))  # the worker fails at once
        assert p is not None and p.pid != parent.proc.pid
        assert p.wait(timeout=60) == 1 and p.poll() == 1
        p.kill()  # a no-op once it has ended: its pid may be someone else's now
    finally:
        parent.close()
    assert parent.proc.returncode == 0


def test_with_warm_start_off_workers_are_fresh_processes(monkeypatch):
    monkeypatch.setenv("NOLOCO_WARM_START", "0")
    starter = warm.Starter()
    p = starter.start([json.dumps({"not": "a config"})], dict(os.environ))
    try:
        assert isinstance(p, subprocess.Popen) and starter.parent is None
        assert p.wait(timeout=60) != 0
    finally:
        p.kill()
        starter.close()


def test_the_process_name_fits_the_kernels_limit():
    assert process_name(2, 0) == "noloco r2s0"
    assert len(process_name(12345, 678)) <= 15


EXITS = '''
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from noloco.exiting import exit_now
d = Path(sys.argv[1])
f = open(d / "open.txt", "w")  # never closed: its bytes sit in the buffer
f.write("buffered")
atexit.register(lambda: (d / "atexit.txt").write_text("ran"))
def late():
    time.sleep(0.3)
    (d / "thread.txt").write_text("joined")
threading.Thread(target=late).start()
pool = ThreadPoolExecutor(1)
pool.submit(lambda: None).result()  # an idle pool's thread must not hold the exit up
print("printed", end="")
exit_now(int(sys.argv[2]))
'''


@pytest.mark.slow("a Python subprocess that exits")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, 3])
def test_exit_now_keeps_what_a_normal_exit_does(tmp_path, code):
    """noloco's processes skip the interpreter's teardown at exit (about 0.8 s of CPU each
    with torch imported), and nothing else: the exit code, non-daemon threads joined, atexit
    handlers run, files left open flushed, standard output flushed into a pipe."""
    r = subprocess.run([sys.executable, "-c", EXITS, str(tmp_path), str(code)],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == code, r.stderr
    assert r.stdout == "printed" and r.stderr == ""
    assert (tmp_path / "open.txt").read_text() == "buffered"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "joined"


FORKABLE = '''
import os, socket, threading
from noloco import warm
def say(): print(int(warm._forkable()), end="")
say()  # a library caller: never
warm.allow_fork()
say()
f = open(os.devnull, "w"); say(); f.close(); say()
s = socket.socket(); say(); s.close(); say()
e = threading.Event(); t = threading.Thread(target=e.wait); t.start(); say()
e.set(); t.join()
import time  # the kernel lists a joined thread a moment longer
deadline = time.monotonic() + 5
while not warm._forkable() and time.monotonic() < deadline:
    time.sleep(0.01)
say()
import atexit  # a handler of the launcher's own, after its imports: the child would run it
atexit.register(print, "bye", end="")
say()
'''


@pytest.mark.slow("a Python subprocess")
@pytest.mark.timeout(60)
def test_the_warm_parent_is_forked_only_from_a_process_that_holds_nothing_it_could_disturb():
    r = subprocess.run([sys.executable, "-c", FORKABLE], capture_output=True, text=True,
                       timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "010101010bye"


FORKED = '''
import atexit, os, signal, sys
from pathlib import Path
import noloco.cli  # what the command line has imported when it forks: torch, numpy
from noloco import warm
log = Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *a: log.open("a").write(f"handler {os.getpid()}\\n"))
warm.allow_fork()
parent = warm.WarmParent(dict(os.environ))
assert parent.how == "forked" and parent.ready()
p = parent.start(["not json"], dict(os.environ))  # the worker fails at once
assert p.wait(timeout=60) == 1
q = parent.start(["not json"], dict(os.environ))
os.kill(parent.proc.pid, signal.SIGTERM)  # the launcher's handler is not the warm parent's
q.wait(timeout=60)
parent.close()
print(parent.proc.returncode, end="")
'''


@pytest.mark.slow("a Python subprocess that forks a warm parent")
@pytest.mark.timeout(120)
def test_a_forked_warm_parent_keeps_none_of_the_launchers_signal_handlers(tmp_path):
    """Not the launcher's signal handlers: a SIGTERM ends the warm parent as it would a
    started one (the launcher's handler, inherited, would write the log and go on)."""
    log = tmp_path / "log"
    r = subprocess.run([sys.executable, "-c", FORKED, str(log)], capture_output=True,
                       text=True, timeout=100, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == str(-signal.SIGTERM)
    assert not log.exists(), log.read_text()
