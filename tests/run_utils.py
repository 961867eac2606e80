"""Helpers of the end-to-end tests: small runs through the real CLI, and comparing two runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from noloco.cli import main

SMALL = ["--batch-size", "4", "--seq-len", "32", "--eval-sequences", "8", "--log-every", "0"]
TIMING = {"wall_seconds", "sync_seconds", "sync_seconds_by_replica"}
"""metrics that measure time: the only fields two identical runs may disagree on"""
SAME = ("steps", "outer_steps", "final_val_loss", "final_val_loss_per_replica",
        "bytes_sent_per_replica", "weight_spread", "peak_step_bytes", "activation_bytes",
        "tokens_per_replica", "params")


def train(out: Path, data: Path, *args: str) -> int:
    """``noloco train`` in this process (its launcher starts the workers)."""
    return main(["train", "--data", str(data), *SMALL, *args, "--out", str(out)])


def cli(*args: str, timeout: float = 240, **kw: Any) -> subprocess.CompletedProcess:
    """``python -m noloco ARGS`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "noloco", *args], capture_output=True,
                          text=True, timeout=timeout, **kw)


def weights(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {f.name: load_file(str(f)) for f in sorted((run / "model").glob("*.safetensors"))}


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


def assert_same_run(a: Path, b: Path) -> None:
    """Bit for bit: final weights of every replica (and their average), every metrics line
    but its timings, and the summary's losses, bytes and spread."""
    wa, wb = weights(a), weights(b)
    assert wa and wa.keys() == wb.keys()
    for f in wa:
        assert wa[f].keys() == wb[f].keys()
        for k in wa[f]:
            assert torch.equal(wa[f][k], wb[f][k]), f"{f}:{k} differs"
    ma = [{k: v for k, v in m.items() if k not in TIMING} for m in metrics(a)]
    mb = [{k: v for k, v in m.items() if k not in TIMING} for m in metrics(b)]
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    assert ma == mb
    sa, sb = summary(a), summary(b)
    assert sa["status"] == sb["status"] == "completed"
    assert {k: sa[k] for k in SAME} == {k: sb[k] for k in SAME}


def of_run(pid: int | str, run: Path) -> bool:
    """Whether process ``pid`` belongs to ``run``: it (or, forked from it, the process it was
    forked from) started with NOLOCO_RUN=run in its environment — a worker, a warm parent
    started as a program — or it is, or was forked from, ``noloco train`` with ``--out RUN``
    or ``--resume RUN`` on its command line — a launcher, the warm parent it forked, and the
    workers that one forked (/proc shows a forked process the environment and command line of
    the program that was started)."""
    run = Path(run).resolve()
    d = Path("/proc") / str(pid)
    try:
        if f"NOLOCO_RUN={run}".encode() in (d / "environ").read_bytes().split(b"\0"):
            return True
        args = [a.decode() for a in (d / "cmdline").read_bytes().split(b"\0")]
        cwd = Path(os.readlink(d / "cwd"))
    except OSError:
        return False
    if "train" not in args:
        return False
    for i, a in enumerate(args):
        for flag in ("--out", "--resume"):
            if a == flag and i + 1 < len(args):
                a = f"{flag}={args[i + 1]}"
            if a.startswith(flag + "=") and (cwd / a[len(flag) + 1:]).resolve() == run:
                return True
    return False


def worker_pids(run: Path) -> dict[tuple[int, int], int]:
    """(replica, stage) → pid of the local launcher's workers of ``run``: the processes named
    ``noloco rRsS`` (noloco.worker.process_name) that belong to it (:func:`of_run`)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            name = (d / "comm").read_text().strip()
            ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        m = re.fullmatch(r"noloco r(\d+)s(\d+)", name)
        if m and (of_run(d.name, run) or of_run(ppid, run)):
            out[(int(m[1]), int(m[2]))] = int(d.name)
    return out


def wait_for(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def interrupt_elastic(proc: Any, cond: Any, out: Path) -> dict[int, int]:
    """SIGINT to an elastic run's launcher once ``cond()`` holds; it stops with the resume
    line, and every replica's saved step (from the summary)."""
    try:
        wait_for(cond, 120, "the moment to stop")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert f"continue with: noloco train --resume {out}" in err, err
    stopped = summary(out)
    assert stopped["status"] == "interrupted"
    return {int(r): s for r, s in stopped["elastic"]["saved_steps"].items()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
