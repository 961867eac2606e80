"""Starting and supervising workers.

- Across machines, ``torchrun ... -m noloco train ...`` starts the workers; the CLI sees
  torchrun's environment (RANK, WORLD_SIZE, ...) and runs as one worker. torchrun's own
  ``--max-restarts`` restarts them, and they resume from the newest checkpoint.
- On one machine, ``noloco train --replicas N [--stages P]`` starts N·P worker processes and
  supervises them here (one worker without restarts runs in this process instead).

The supervisor hosts the run's c10d ``TCPStore`` (the same store torchrun's agent hosts) on
127.0.0.1 only, and starts each worker as ``python -m noloco.worker`` — forked from a warm
parent that imported torch once (:mod:`noloco.warm`) — with torchrun's environment variables
and its :class:`~noloco.spec.WorkerSpec` as its one argument (``ps`` shows a worker as
``noloco rRsS``).
Workers write heartbeats and, when they fail, a report into the store; gloo is bound to the
loopback interface. It does what torchrun's agent does for one
machine, plus what a user needs from a local run:

- when a worker dies, the others are stopped, the cause is found (the rank killed by a
  signal, the rank the others' reports name as having stopped answering, ...), and — within
  ``--max-restarts`` — every worker is started again and continues from the newest complete
  checkpoint;
- Ctrl-C / SIGTERM stop every worker — SIGINT, on which they agree on a step, checkpoint it
  and exit; SIGTERM, then SIGKILL, to those still running after a grace period — and end the
  run with one line (the resume command, where a checkpoint makes it work) and exit code
  130 / 143;
- ``summary.json`` always says how the run ended (``status``: completed, failed, interrupted).

Workers run in their own sessions (a Ctrl-C reaches the supervisor only, which stops them in
order) and die with it if it is killed (``PR_SET_PDEATHSIG``).

Floor 6 of docs/architecture.md: launching and watching runs, and what reads a run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from noloco import checkpoint as ckpt_mod
from noloco.config import Config
from noloco.distributed import default_threads
from noloco.rundir import RunDir
from noloco.spec import WorkerSpec
from noloco.warm import Starter, WarmProcess
from noloco.watchdog import heartbeat_key

GRACE_SECONDS = 3.0
"""after the first worker fails: how long the others get to fail (and report) by themselves"""
SIGNAL_GRACE_SECONDS = 0.5
"""the same when a worker was killed by a signal: the cause is known, no report is needed"""
STOP_SECONDS = 10.0
"""after SIGTERM: how long a worker gets to finish its checkpoint write before SIGKILL"""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ)


def supervisor_for(cfg: Config, resume: bool = False, must_resume: bool = False,
                   policy: Policy | None = None) -> Supervisor | None:
    """The supervisor of a run on this machine: ``policy`` says what kind (an elastic run's,
    :class:`noloco.elastic.launcher.ElasticRun`; by default a static run's,
    :class:`StaticRun`). None when the run is one static worker without restarts, which runs
    in the calling process."""
    t = cfg.train
    if policy is None:
        if cfg.method.elastic:  # the caller builds the elastic policy (no import up here)
            raise ValueError("an elastic run needs its policy (noloco.elastic.launcher)")
        if cfg.world_size == 1 and t.max_restarts == 0 and not t.inject_fault:
            return None
    return Supervisor(cfg, resume, must_resume, policy or StaticRun())


def loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux)."""
    with contextlib.suppress(OSError, ValueError):
        for name in sorted(os.listdir("/sys/class/net")):
            if int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & 0x8:  # LOOPBACK
                return name
    return "lo"


@dataclass
class Outcome:
    kind: str
    """completed, failed or interrupted"""
    code: int = 0
    rank: int | None = None
    line: str = ""
    signal: str | None = None
    restartable: bool = False
    last_step: int = 0
    details: dict[str, Any] = field(default_factory=dict)


class Policy(Protocol):
    """What kind of run the one :class:`Supervisor` supervises: a static run
    (:class:`StaticRun`: every worker stops when one fails, and all start again) or an
    elastic one (:class:`noloco.elastic.launcher.ElasticRun`: a replica fails alone and
    starts again alone). The supervisor starts the workers, watches them, forwards signals
    and stops them; the policy answers what that means."""

    def open(self, sup: Supervisor) -> int | None:
        """Host (or reach) the run's store; an exit code when it cannot."""

    def groups(self, sup: Supervisor) -> dict[int, list[int]]:
        """The groups of workers (their global ranks) that end and start again together."""

    def start(self, sup: Supervisor, group: int) -> None:
        """Start the group's workers (:meth:`Supervisor.start_worker`)."""

    def failed(self, sup: Supervisor, group: int) -> str | int:
        """A worker of ``group`` failed: ``"restarted"`` (it was started again), ``"dead"``
        (the others go on without it), or the run's exit code (it ends here)."""

    def interrupted(self, sup: Supervisor) -> int:
        """A stop signal came (:attr:`Supervisor.signum`): stop the workers; the exit code."""

    def finished(self, sup: Supervisor, done: set[int], dead: set[int]) -> int:
        """Every group finished (``done``) or failed for good (``dead``): the exit code."""

    def close(self, sup: Supervisor) -> None:
        """The run is over: release the store and what else :meth:`open` started."""


class Supervisor:
    """The local launcher of every run on this machine: one loop over groups of workers, the
    run's kind in its :class:`Policy`."""

    def __init__(self, cfg: Config, resume: bool, must_resume: bool,
                 policy: Policy | None = None) -> None:
        self.cfg, self.resume, self.must_resume = cfg, resume, must_resume
        from noloco.distributed import Layout

        self.policy: Policy = policy or StaticRun()
        self.world = cfg.world_size
        self.stages = cfg.method.stages
        self.describe = Layout(world=self.world, replicas=cfg.method.replicas,
                               stages=self.stages).describe
        self.out = Path(cfg.train.out)
        self.failures: list[dict[str, Any]] = []
        self.signum: int | None = None
        self.procs: dict[int, subprocess.Popen | WarmProcess] = {}
        self.done: set[int] = set()
        """the groups whose workers all finished"""
        self.dead: set[int] = set()
        """the groups that failed for good (an elastic run goes on without them)"""
        self.store: Any = None
        """the run's store, as the policy opened it"""
        self.port = 0
        self.starter = Starter()
        """forks the workers from a warm parent (noloco.warm), closed when the run ends"""
        self.spec = WorkerSpec.for_launcher(cfg, local_world=self.world)
        """what every worker is told (each its own place and start: :meth:`WorkerSpec.but`)"""

    # ---- the run -----------------------------------------------------------------------------
    def host_store(self) -> None:
        """The run's c10d TCPStore, on 127.0.0.1 and a free port."""
        import torch.distributed as dist

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        self.port = sock.getsockname()[1]
        self.store = dist.TCPStore(
            "127.0.0.1", self.port, self.world, True,
            timedelta(seconds=self.cfg.method.comm_timeout), wait_for_workers=False,
            master_listen_fd=sock.detach())

    def run(self) -> int:
        code = self.policy.open(self)
        if code is not None:
            return code
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._supervise()
        finally:
            self.policy.close(self)
            self._stop_all()
            self.starter.close()
            for s, h in handlers.items():
                signal.signal(s, h)

    def _supervise(self) -> int:
        """Start every group; watch them until each has finished or failed for good."""
        groups = self.policy.groups(self)
        for g in groups:
            self.policy.start(self, g)
        done, dead = self.done, self.dead
        while len(done | dead) < len(groups):
            if self.signum is not None:
                return self.policy.interrupted(self)
            for g, ranks in groups.items():
                if g in done or g in dead:
                    continue
                codes = [self.procs[r].poll() for r in ranks]
                if all(c == 0 for c in codes):
                    done.add(g)
                elif any(c not in (None, 0) for c in codes):
                    what = self.policy.failed(self, g)
                    if isinstance(what, int):
                        return what
                    if what == "dead":
                        dead.add(g)
            time.sleep(0.05)
        return self.policy.finished(self, done, dead)

    def start_worker(self, rank: int, spec: WorkerSpec, env: dict[str, str]) -> None:
        """Start the worker of global rank ``rank`` (``self.procs[rank]``)."""
        self.procs[rank] = self.starter.start([spec.to_json()], env)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = self.signum or signum

    def prestart(self) -> None:
        """Start the warm parent now (it imports torch while this process prepares the run);
        :meth:`run` closes it."""
        threads = str(default_threads(self.world))
        self.starter.prestart(dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                                   NOLOCO_RUN=str(self.out.resolve())))

    def base_env(self) -> dict[str, str]:
        """Every worker's environment, less its rank."""
        threads = str(default_threads(self.world))
        env = dict(os.environ)
        # torchrun's variables (the worker's own settings are its spec: noloco.spec), and
        # NOLOCO_RUN, which names the run's processes for whoever looks (nothing reads it).
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), WORLD_SIZE=str(self.world),
            LOCAL_WORLD_SIZE=str(self.world), GROUP_RANK="0",
            TORCHELASTIC_USE_AGENT_STORE="True", NOLOCO_RUN=str(self.out.resolve()),
            # Children inherit these before torch starts its thread pools.
            OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
            # Every listener of a local run on 127.0.0.1: gloo and NCCL bind to loopback.
            GLOO_SOCKET_IFNAME=loopback_interface(), NCCL_SOCKET_IFNAME=loopback_interface())
        env.pop("TORCHELASTIC_RUN_ID", None)
        return env

    def _stop_all(self, graceful: bool = False, grace: float = STOP_SECONDS) -> None:
        """SIGTERM (and SIGCONT, for a stopped worker), then SIGKILL after STOP_SECONDS.
        ``graceful``: SIGINT first, on which the workers stop at a step they agree on and
        checkpoint it (:meth:`noloco.train.Trainer.agree_stop_step`), within ``grace``
        seconds."""
        if graceful:
            self._signal_and_wait(signal.SIGINT, grace)
        for p in self._signal_and_wait(signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()

    def _signal_and_wait(self, sig: signal.Signals, seconds: float = STOP_SECONDS
                         ) -> list[subprocess.Popen | WarmProcess]:
        """``sig`` (and SIGCONT, for a stopped worker) to every live worker; the workers still
        running ``seconds`` later."""
        alive = [p for p in self.procs.values() if p.poll() is None]
        for p in alive:
            for s in (sig, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(s)
        deadline = time.monotonic() + seconds
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        return [p for p in alive if p.poll() is None]

    # ---- the store ------------------------------------------------------------------------
    def read(self, key: str) -> dict[str, Any] | None:
        """A JSON value of the run's store (a report, a heartbeat), None if there is none or
        it cannot be read."""
        try:
            if self.store.check([key]):
                return json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001 - an unreadable report is no report
            pass
        return None


class StaticRun:
    """A static run's :class:`Policy`: the whole world is one group. When a worker fails, the
    others are stopped, the cause is found, and — within ``--max-restarts`` — every worker
    starts again as the next attempt, resuming from the newest complete checkpoint."""

    def __init__(self) -> None:
        self.attempt = 0
        self.sup: Supervisor

    def open(self, sup: Supervisor) -> int | None:
        self.sup = sup
        sup.host_store()
        return None

    def groups(self, sup: Supervisor) -> dict[int, list[int]]:
        return {0: list(range(sup.world))}

    def start(self, sup: Supervisor, group: int) -> None:
        base = sup.base_env()
        spec = sup.spec.but(attempt=self.attempt, resume=sup.resume or self.attempt > 0,
                            must_resume=self.attempt == 0 and sup.must_resume)
        sup.procs = {}
        for rank in range(sup.world):
            sup.start_worker(rank, spec.but(rank=rank, local_rank=rank),
                             dict(base, RANK=str(rank), LOCAL_RANK=str(rank)))

    def failed(self, sup: Supervisor, group: int) -> str | int:
        outcome = self._ended(sup)
        if outcome is None:  # a stop signal came first: the others stop at a common step
            return self.interrupted(sup)
        if outcome.kind == "completed":  # every other worker ended well meanwhile: no
            return self.finished(sup, {0}, set())  # (a failure noticed, then all exit 0)
        newest = self._newest_checkpoint()
        restarts = sup.cfg.train.max_restarts
        sup.failures.append({"attempt": self.attempt, "rank": outcome.rank,
                             "signal": outcome.signal,
                             "exit_code": outcome.details.get("exit_code"),
                             "reason": outcome.line, "step": outcome.last_step,
                             "t": time.time()})
        if self.attempt < restarts and outcome.restartable and sup.signum is None:
            where = (f"checkpoint step {newest}" if newest is not None
                     else "the start (no checkpoint yet)")
            print(f"noloco: {outcome.line} at step {outcome.last_step}; restarting "
                  f"from {where} (restart {self.attempt + 1} of {restarts})",
                  file=sys.stderr, flush=True)
            self.attempt += 1
            self.start(sup, group)
            return "restarted"
        if sup.signum is not None:  # interrupted while the failed attempt was being stopped
            return self._interrupted_at(outcome.last_step)
        if outcome.details.get("kind") == "usage":  # bad input: nothing is written
            print(f"noloco: error: {outcome.line}", file=sys.stderr, flush=True)
            return 2
        self._write_status("failed", outcome)
        keep = (f"newest checkpoint: step {newest}; continue with: noloco train "
                f"--resume {sup.out}" if newest is not None else "no checkpoint")
        print(f"noloco: error: {outcome.line}; the run stopped at step "
              f"{outcome.last_step} ({keep})", file=sys.stderr, flush=True)
        return outcome.code

    def interrupted(self, sup: Supervisor) -> int:
        sup._stop_all(graceful=True)  # the workers report the step they stopped at
        if all(p.returncode == 0 for p in sup.procs.values()):
            return self.finished(sup, {0}, set())  # the stop came at the last step
        return self._interrupted_at(self._last_step(self._reports()))

    def finished(self, sup: Supervisor, done: set[int], dead: set[int]) -> int:
        if sup.failures:
            RunDir(sup.out).update_summary(restarts=self.attempt, failures=sup.failures)
        return 0

    def close(self, sup: Supervisor) -> None:
        """Nothing of its own to release: the store is the supervisor's, and ends with it."""

    # ---- what went wrong -----------------------------------------------------------------
    def _interrupted_at(self, step: int) -> int:
        sup = self.sup
        assert sup.signum is not None
        outcome = Outcome("interrupted", code=128 + sup.signum, last_step=step)
        self._write_status("interrupted", outcome)
        print(ckpt_mod.interrupted_line(sup.out, outcome.last_step, sup.world),
              file=sys.stderr, flush=True)
        return outcome.code

    def _ended(self, sup: Supervisor) -> Outcome | None:
        """After the first failure is noticed: the others get a moment to fail (and report)
        by themselves, the rest are stopped, and the cause is found. None: a stop signal
        came meanwhile (the run is interrupted, as the supervisor's loop would say)."""
        failed: list[tuple[int, int]] = []  # (rank, exit code) in the order noticed
        first_at = time.monotonic()
        while True:
            if sup.signum is not None:
                return None
            codes = {r: p.poll() for r, p in sup.procs.items()}
            for r, c in codes.items():
                if c not in (None, 0) and all(r != f for f, _ in failed):
                    failed.append((r, c))
            if all(c is not None for c in codes.values()):
                break
            grace = SIGNAL_GRACE_SECONDS if any(c < 0 for _, c in failed) else GRACE_SECONDS
            if time.monotonic() - first_at > grace:
                break
            time.sleep(0.05)
        if not failed:
            return Outcome("completed")
        stopped = {r for r, p in sup.procs.items() if p.poll() is None}
        sup._stop_all()
        return self._diagnose(failed, stopped)
    def _reports(self) -> dict[int, dict[str, Any]]:
        """What the workers of this attempt reported when they stopped, by rank."""
        from noloco.worker import report_key

        return {r: rep for r in range(self.sup.world)
                if (rep := self.sup.read(report_key(self.attempt, r))) is not None}

    def _last_step(self, reports: dict[int, dict[str, Any]]) -> int:
        steps = [r.get("step", 0) for r in reports.values()]
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            # rank 0 keeps it at least as new as its last log, evaluation or checkpoint (a
            # lone worker has no store to report or beat in)
            steps.append(int(RunDir(self.sup.out).read_summary().get("last_step") or 0))
        for rank in range(self.sup.world):
            hb = self.sup.read(heartbeat_key(self.attempt, rank))
            if hb:
                steps.append(hb["step"])
        return max(steps, default=0)

    def _diagnose(self, failed: list[tuple[int, int]], stopped: set[int]) -> Outcome:
        """The cause of a failed attempt, from exit codes and the workers' reports.

        Precedence: bad input (exit 2: restarting cannot help); a full disk (likewise); a
        worker killed by a signal nobody here sent (kill -9, the OOM killer); a worker's own
        error (its report says what); the rank the others' reports blame for not answering
        (a SIGSTOP, a hang); else the first worker noticed failing."""
        reports = self._reports()
        step = self._last_step(reports)
        describe = self.sup.describe

        def outcome(rank: int, line: str, restartable: bool, **details: Any) -> Outcome:
            code = dict(failed).get(rank)
            sig = signal.Signals(-code).name if code is not None and code < 0 else None
            return Outcome("failed", code=1, rank=rank, line=line.removeprefix(
                "noloco: error: "), signal=sig, restartable=restartable, last_step=step,
                details={"exit_code": code if code and code > 0 else None, **details})

        own = sorted((r, rep) for r, rep in reports.items()
                     if rep["kind"] not in ("comm", "quiet", "interrupted"))
        for kind in ("usage", "disk"):
            for r, rep in own:
                if rep["kind"] == kind:
                    return outcome(r, rep["line"], False, kind=kind)
        for r, code in failed:
            if code < 0 and r not in reports:
                return outcome(r, f"{describe(r)} was killed by "
                               f"{signal.Signals(-code).name}", True, kind="signal")
        for r, rep in own:
            return outcome(r, rep["line"], rep.get("restartable", True), kind=rep["kind"])
        blamed = [rep["culprit"] for rep in reports.values()
                  if rep["kind"] == "comm" and rep.get("culprit") is not None]
        if blamed:
            culprit = max(set(blamed), key=blamed.count)
            line = next(rep["line"] for rep in reports.values()
                        if rep["kind"] == "comm" and rep.get("culprit") == culprit)
            return outcome(culprit, line, True, kind="stall", stopped=culprit in stopped)
        r, code = failed[0]
        rep = reports.get(r)
        return outcome(r, rep["line"] if rep else f"{describe(r)} exited with code {code}",
                       True, kind="exit")

    def _newest_checkpoint(self) -> int | None:
        steps = ckpt_mod.complete_steps(self.sup.out / "checkpoints", self.sup.world)
        return steps[0] if steps else None

    def _write_status(self, status: str, o: Outcome) -> None:
        newest = self._newest_checkpoint()
        fields: dict[str, Any] = {
            "status": status, "last_step": o.last_step, "exit_code": o.code,
            "newest_checkpoint": (f"checkpoints/{ckpt_mod.step_dir(Path(), newest).name}"
                                  if newest is not None else None),
            "restarts": self.attempt, "failures": self.sup.failures}
        if status == "failed":
            stages = self.sup.stages
            fields.update(failed_rank=o.rank, replica=o.rank // stages,
                          stage=o.rank % stages, signal=o.signal,
                          worker_exit_code=o.details.get("exit_code"), reason=o.line)
        with contextlib.suppress(OSError):
            RunDir(self.sup.out).update_summary(**fields)
