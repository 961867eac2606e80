"""One worker process, from start to exit code.

:func:`run` joins the job (:mod:`noloco.distributed`), decides with the other workers whether
this start resumes, and trains (:mod:`noloco.train`). :func:`main` turns every way a worker
can end into an exit code, one line, a report in the run's store for the local launcher
(:mod:`noloco.launch`), and — without one — the run's status in summary.json.
``python -m noloco.worker SPEC_JSON`` is how the local launcher starts a worker
(:mod:`noloco.spec`).

Floor 5 of docs/architecture.md: a worker process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from noloco import checkpoint as ckpt_mod
from noloco.comm import CommError, Communicator
from noloco.config import Config, ConfigError
from noloco.distributed import (
    Layout,
    host_staged,
    init_distributed,
    limit_threads,
    pick_device,
)
from noloco.errors import STORE_LOST_EXIT, SUPERSEDED_EXIT, Interrupted, StoreLost, Superseded
from noloco.exiting import exit_now
from noloco.rundir import RunDir, os_error_line
from noloco.spec import WorkerSpec
from noloco.train import Trainer, check_identical_start


@dataclass
class WorkerStatus:
    """What the error path needs to know about a worker that stopped."""

    spec: WorkerSpec
    lay: Layout = field(default_factory=Layout)
    step: int = 0
    out: str = ""
    store: Any = None
    attempt: int = 0
    graceful: bool = False
    """set by the training loop while a stop can wait for its next step boundary (where it
    checkpoints first): the first SIGINT/SIGTERM then only sets :attr:`stop_signal`"""
    stop_signal: int | None = None
    signalled_at: float = 0.0
    """when the stop signal came (monotonic seconds)"""


def run(spec: WorkerSpec, status: WorkerStatus | None = None) -> dict[str, Any] | None:
    """Run one worker of the job ``spec`` describes. Returns rank 0's summary."""
    status = status or WorkerStatus(spec=spec)
    if spec.elastic:
        from noloco.elastic import worker as elastic_worker
        return elastic_worker.run(spec, status)
    cfg = spec.config
    m, t = cfg.method, cfg.train
    lay = Layout.of(spec)
    status.lay, status.out = lay, t.out
    threads = limit_threads(lay.local_world, t.threads)
    device = pick_device(t.device, spec.local_rank, lay.local_world)
    ctx = init_distributed(lay, m.comm_timeout, device,
                           host_staged(device, lay.local_world, spec.host_staging), spec.attempt)
    status.store, status.attempt = ctx.store, ctx.attempt
    rundir = RunDir(Path(t.out))
    trainer = None
    ok = False
    try:
        # The pieces first (bad data fails here, before anything is written), then the run
        # directory.
        trainer = Trainer(cfg, lay, device, threads, rundir, ctx, status)
        resume, required = _prepare_rundir(cfg, lay, rundir, spec.resume, spec.must_resume,
                                           spec.rundir_ready, ctx.attempt, trainer.world)
        if resume:
            trainer.resume(required=required)
        else:
            check_identical_start(trainer.params, lay, trainer.world)
        status.step = trainer.state.step
        summary = trainer.train()
        ok = True
        return summary
    finally:
        if trainer is not None:
            trainer.close(ok)
        ctx.close(ok)


def _prepare_rundir(cfg: Config, lay: Layout, rundir: RunDir, resume: bool,
                    must_resume: bool, ready: bool, attempt: int, world: Communicator
                    ) -> tuple[bool, bool]:
    """Whether this start resumes (and must find a checkpoint), decided by rank 0 for all.

    Under our launcher (``ready``) the run directory is prepared and the attempt number
    tells a restart. Under torchrun, rank 0 tells a restart by the job marker: the run
    directory names the torchrun job (``TORCHELASTIC_RUN_ID``) that started it, and a
    restart of that job — after a crash, or with a node replaced — finds its own id there and
    resumes; it never prepares (or, with ``--overwrite``, empties) the directory again. A new
    job prepares the directory (or, with ``--resume``, continues it) and writes its id.
    Every rank learns the decision, and whether it failed (else the others would wait for
    rank 0 until the timeout)."""
    error = None
    required = must_resume
    if lay.rank == 0:
        try:
            run_id = os.environ.get("TORCHELASTIC_RUN_ID")
            if ready:
                resume, required = resume or attempt > 0, must_resume and attempt == 0
            elif run_id is not None and rundir.job() == run_id:
                resume, required = True, False  # torchrun restarted this job
            else:
                if resume:
                    rundir.write_config(cfg)
                else:
                    rundir.prepare(cfg, overwrite=cfg.train.overwrite)
                if run_id is not None:
                    rundir.set_job(run_id)
            rundir.remove_stale_tmp()
        except ConfigError as e:
            error = e
        except OSError as e:
            error = ConfigError(os_error_line(e))
    if lay.world > 1:
        mine = [float(error is not None), float(resume), float(required)]
        rows = world.all_gather(torch.tensor(mine, dtype=torch.float64))
        failed, resume, required = (bool(x) for x in rows[0].tolist())
        if failed and error is None:
            raise QuietExit(2)  # rank 0 says why
    if error is not None:
        raise error
    return resume, required


# ---- how a worker ends ------------------------------------------------------------------------

class QuietExit(Exception):
    """Stop with this exit code; another worker reports why."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_SECONDS = 1.0
"""a stop signal this soon after the first is the same stop delivered twice, not a second
Ctrl-C (which stops at once)"""


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    # Once: a second SIGTERM or Ctrl-C while the first one unwinds (the launcher stopping
    # every worker, an impatient user) would interrupt the clean-up, even inside a finaliser
    # or the interpreter's exit, where an exception can leave a lock held and the exit hung.
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def report_key(attempt: int, rank: int) -> str:
    """Where a worker that stopped leaves its report (read by the local launcher)."""
    return f"noloco/report/{attempt}/{rank}"


def classify(e: BaseException, status: WorkerStatus) -> tuple[int, str, str, int | None]:
    """(exit code, kind, one line, rank to blame) for how a worker ended."""
    from noloco.data import DataError

    if isinstance(e, QuietExit):
        return e.code, "quiet", "", None
    if isinstance(e, Superseded):
        return SUPERSEDED_EXIT, "superseded", f"noloco: {e}", None
    if isinstance(e, StoreLost):
        return STORE_LOST_EXIT, "store lost", f"noloco: {e}", None
    if isinstance(e, (ConfigError, DataError)):
        return 2, "usage", f"noloco: error: {e}", None
    if isinstance(e, (Interrupted, KeyboardInterrupt)):
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun may be stopping us to restart us
            return 128 + signum, "interrupted", ckpt_mod.interrupted_line(
                status.out, status.step, status.lay.world,
                how=f"stopped by {signal.Signals(signum).name}",
                note=" (torchrun restarts the workers if its --max-restarts allows)"), None
        return 128 + signum, "interrupted", ckpt_mod.interrupted_line(
            status.out, status.step, status.lay.world), None
    if isinstance(e, CommError):
        return 1, "comm", f"noloco: error: {e}", e.culprit
    if isinstance(e, (torch.distributed.DistStoreError, torch.distributed.DistNetworkError)):
        # The run's store (the launcher's, torchrun's or the elastic coordinator's) went away
        # or stopped answering: every worker that touches it ends here, none is to blame.
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return 1, "comm", f"noloco: error: the run's store is unreachable ({first})", None
    if isinstance(e, OSError):
        kind = "disk" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
        newest = ckpt_mod.complete_steps(Path(status.out) / "checkpoints", status.lay.world)
        keep = f" (the newest complete checkpoint, step {newest[0]}, is intact)" if newest else ""
        return 1, kind, f"noloco: error: {os_error_line(e)}{keep}", status.lay.rank
    return 1, "crash", f"noloco: error: {type(e).__name__}: {e}", status.lay.rank


def main(spec: WorkerSpec) -> int:
    """A worker process from start to exit code. Errors end as one line (a bug also with its
    traceback); the run directory's summary.json says how the run ended.

    Under our local launcher (``spec.supervised``) the worker only reports to the store and
    the launcher speaks for the run; elsewhere (one process, torchrun) rank 0 writes the
    run's status and every worker prints its own error line.
    """
    supervised = spec.supervised
    status = WorkerStatus(spec=spec, out=spec.config.train.out)
    # Only the main thread may install handlers (a test may call main from another).
    handle = threading.current_thread() is threading.main_thread()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Our launcher asks its workers to stop with SIGINT (a user's Ctrl-C or SIGTERM to
        # it), and to stop at once with SIGTERM (a worker failed: the others must not wait).
        now = time.monotonic()
        if status.stop_signal is not None and now - status.signalled_at < REPEAT_SECONDS:
            # The same stop twice: a Ctrl-C at a terminal reaches torchrun's workers (in its
            # process group) and again through torchrun, which passes it on.
            return
        if (status.graceful and status.stop_signal is None
                and (signum == signal.SIGINT or not supervised)):
            # the loop checkpoints and stops at its next step
            status.stop_signal, status.signalled_at = signum, now
            return
        _raise_interrupted(signum, frame)  # a second signal, or outside the loop: now

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS} if handle else {}

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    try:
        run(spec, status)
        restore()
        return 0
    except BaseException as e:  # noqa: BLE001 - every ending becomes an exit code
        if isinstance(e, SystemExit):
            raise
        code, kind, line, culprit = classify(e, status)
        if kind == "crash":
            traceback.print_exc()
        _report(status, {"kind": kind, "line": line, "culprit": culprit, "code": code,
                         "step": status.step, "restartable": kind in ("comm", "crash"),
                         "t": time.time()})
        speak = kind in ("comm", "disk", "io", "crash") or status.lay.rank == 0
        if line and not supervised and speak:
            print(line, file=sys.stderr, flush=True)
        if not supervised and status.lay.rank == 0 and kind not in ("usage", "quiet"):
            _write_status(status, kind, line, culprit, code)
        # SIGTERM and SIGINT stay ignored once one came (a checkpoint write may still be
        # finishing on its thread, joined at exit); otherwise back to what the caller had.
        if kind != "interrupted":
            restore()
        elif handle:
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)
        return code


def _report(status: WorkerStatus, report: dict[str, Any]) -> None:
    if status.store is None:
        return
    try:
        status.store.set(report_key(status.attempt, status.lay.rank), json.dumps(report))
    except Exception:  # noqa: BLE001 - the store may be gone with the run
        pass


def _write_status(status: WorkerStatus, kind: str, line: str, culprit: int | None,
                  code: int) -> None:
    rundir = RunDir(status.out)
    if not rundir.path.is_dir():
        return
    newest = ckpt_mod.complete_steps(rundir.path / "checkpoints", status.lay.world)
    fields: dict[str, Any] = {
        "status": "interrupted" if kind == "interrupted" else "failed",
        "reason": line.removeprefix("noloco: error: ").removeprefix("noloco: "),
        "last_step": status.step, "exit_code": code,
        "newest_checkpoint": f"checkpoints/{ckpt_mod.step_dir(Path(), newest[0]).name}"
        if newest else None}
    if kind != "interrupted":
        fields["failed_rank"] = culprit if culprit is not None else status.lay.rank
    try:
        rundir.update_summary(**fields)
    except OSError:
        pass


def process_name(replica: int, stage: int) -> str:
    """What ``ps`` shows for a worker (at most 15 bytes, the kernel's limit)."""
    return f"noloco r{replica}s{stage}"[:15]


def set_process_name(name: str) -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def die_with(parent: int) -> None:
    """This process is killed when ``parent`` (its parent now) ends; if it already ended,
    exit now."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    if os.getppid() != parent:
        os._exit(1)  # the parent ended before the line above took effect


def entry(args: list[str], fresh: bool = False) -> int:
    """A worker of a local launcher (:mod:`noloco.launch`, :mod:`noloco.elastic.launcher`),
    fresh (``fresh``: it dies with its launcher, no orphans when that is killed) or forked
    from a warm parent (:mod:`noloco.warm`, which it dies with): ``args`` = [its
    :class:`~noloco.spec.WorkerSpec` as JSON]."""
    spec = WorkerSpec.from_json(args[0])
    if fresh:
        die_with(spec.launcher_pid if spec.launcher_pid is not None else os.getppid())
    set_process_name(process_name(spec.replica, spec.stage))
    return main(spec)


if __name__ == "__main__":
    exit_now(entry(sys.argv[1:], fresh=True))
