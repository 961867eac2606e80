"""What the one local launcher (:class:`noloco.launch.Supervisor`) does in an elastic run
(``noloco train --elastic``): :class:`ElasticRun`, its policy.

Unlike a static run's, a worker that dies does not stop the others: the
failure is recorded (replica, step, how), the replica is started again while ``--respawn``
allows (it joins from a live replica, :mod:`noloco.elastic.join`), and the run ends when
every replica has finished or died. Then the run's numbers are combined from the files each
replica left (:func:`noloco.elastic.worker.combine`). The launcher hosts the store the
replicas meet in (membership, snapshots, process-group rendezvous); it takes part in no
training operation.

Floor 6 of docs/architecture.md: launching and watching runs, and what reads a run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

from noloco.addresses import ETCD_SCHEME as SCHEME
from noloco.addresses import parse_address, parse_endpoints
from noloco.config import ConfigError, local_replicas
from noloco.elastic import auth
from noloco.elastic.deadline import (
    Namespace,
    Renewing,
    open_address,
    open_store_patiently,
    request_deadline,
    run_epoch,
    stopped_record,
    store_errors,
    wait_reachable,
)
from noloco.elastic.files import newest_checkpoints, replica_metrics
from noloco.elastic.host import Host
from noloco.elastic.keys import heartbeat_key
from noloco.elastic.membership import live_replicas
from noloco.elastic.status import STORE_FILE, Dashboard
from noloco.elastic.worker import combine
from noloco.errors import STORE_LOST_EXIT, SUPERSEDED_EXIT
from noloco.launch import STOP_SECONDS, Supervisor
from noloco.metrics import final_report
from noloco.rundir import RunDir, write_json_atomic


class ElasticRun:
    """An elastic run's :class:`~noloco.launch.Policy`: each local replica (its stages) is a
    group that fails alone and, while ``--respawn`` allows, starts again alone (it joins from
    a live replica); the run ends when every replica has finished or died."""

    def __init__(self) -> None:
        self.sup: Supervisor
        self.ns: Namespace
        self.host: Host | None = None
        self.dashboard: Dashboard | None = None
        self.coordinator: tuple[str, int] | None = None
        self.incarnation: dict[int, int] = {}
        self.joins: list[dict[str, Any]] = []
        self.respawns = 0
        self.t0 = 0.0

    # ---- the store --------------------------------------------------------------------------
    def open(self, sup: Supervisor) -> int | None:
        self.sup = sup
        cfg, t = sup.cfg, sup.cfg.train
        self.replicas = cfg.method.replicas
        self.stages = sup.stages
        self.out = sup.out
        self.local = local_replicas(t.replica_ids, self.replicas)
        timeout = request_deadline(cfg.method.peer_timeout)
        ns = self.ns = Namespace(cfg.run_id())
        try:
            if t.coordinator and t.coordinator.startswith(SCHEME):  # an etcd cluster
                self.coordinator = parse_endpoints(t.coordinator)[0]
                sup.port = self.coordinator[1]
                conn = open_store_patiently(t.coordinator, timeout, ns, cfg.method.comm_timeout)
            elif t.coordinator:  # across machines: the coordinator hosts the store
                auth.use_secret(auth.load_secret(t.secret_file))
                self.coordinator = parse_address(t.coordinator)
                sup.port = self.coordinator[1]
                wait_reachable(*self.coordinator, cfg.method.comm_timeout)
                conn = open_store_patiently(t.coordinator, timeout, ns, cfg.method.comm_timeout)
            else:
                # This launcher hosts it, and judges liveness beside it (on one clock).
                self.host = Host("127.0.0.1", 0, cfg.method.comm_timeout)
                sup.port = self.host.port
                conn = open_store_patiently(f"127.0.0.1:{sup.port}", timeout, ns,
                                            cfg.method.comm_timeout)
            if t.coordinator and sup.resume:
                self._resume_epoch(conn)
        except ConfigError as e:  # the secret: missing, wrong, unreadable
            print(f"noloco: error: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # noqa: BLE001 - one line, whatever the store says
            self.close(sup)
            where = f"the coordinator at {t.coordinator}" if t.coordinator else "its store"
            print(f"noloco: error: cannot reach {where} "
                  f"({str(e).splitlines()[0][:160]})", file=sys.stderr)
            return 1
        # Its reads outlive a coordinator's restart: a failed one is retried on a new
        # connection (in the run's new epoch) the next time.
        sup.store = Renewing(conn, timeout)
        self.address = t.coordinator or f"127.0.0.1:{sup.port}"
        write_json_atomic(self.out / STORE_FILE, {
            "address": self.address, "run_id": ns.run_id,
            "gated": bool(t.coordinator) and not t.coordinator.startswith(SCHEME)})
        if t.dashboard is not None:
            try:
                self.dashboard = Dashboard(Renewing(open_address(self.address, timeout),
                                                    timeout), t.dashboard, run_id=ns.run_id)
            except OSError as e:
                print(f"noloco: error: cannot serve the dashboard on 127.0.0.1:{t.dashboard} "
                      f"({e.strerror})", file=sys.stderr)
                self.close(sup)
                return 2
            print(f"noloco: live view of the run: http://127.0.0.1:{self.dashboard.port}/",
                  file=sys.stderr, flush=True)
        self.t0 = time.time()
        self.incarnation = {r: 0 for r in self.local}
        self.respawns = t.respawn
        return None

    def _resume_epoch(self, conn: Any) -> None:
        """``--resume`` at a coordinator: the run continues in a new epoch of its store where
        nobody trains, else this machine's replicas join it
        (:meth:`~noloco.elastic.deadline.Namespace.continue_stopped`)."""
        others: set[int] = set()

        def trains_on() -> bool:  # (this machine's replicas are not running now)
            others.update(r for r in live_replicas(conn, self.replicas, self.stages)
                          if r not in self.local)
            return bool(others)

        if self.ns.continue_stopped(conn, self._stopped_at(), trains_on) == "trains on":
            print(f"noloco: the run trains on at replicas {sorted(others)}: the replicas here "
                  f"join them", file=sys.stderr, flush=True)

    def _stopped_at(self) -> dict[str, Any] | None:
        """Where the run stood in its store when this machine's part of it last ended
        (summary.json's ``elastic.store``): None where that is unknown (the launcher was
        killed, or the run is older)."""
        try:
            got = (RunDir(self.out).read_summary().get("elastic") or {}).get("store")
        except (OSError, ValueError):
            return None
        return stopped_record(got)

    def _store_now(self) -> dict[str, Any] | None:
        """Where the run stands in its coordinator's store now (read afresh: this launcher's
        own connection may not have seen a restart of it); None without a coordinator."""
        if not self.sup.cfg.train.coordinator:
            return None
        return run_epoch(self.address, self.ns.run_id,
                         request_deadline(self.sup.cfg.method.peer_timeout))

    def close(self, sup: Supervisor) -> None:
        if self.dashboard is not None:
            self.dashboard.stop()
            self.dashboard = None
        if self.host is not None:
            self.host.stop()
            self.host = None

    def groups(self, sup: Supervisor) -> dict[int, list[int]]:
        return {r: [r * self.stages + s for s in range(self.stages)] for r in self.local}

    def start(self, sup: Supervisor, group: int) -> None:
        for stage in range(self.stages):
            self._start_worker(group, stage, group * self.stages + stage)

    # ---- a stop signal ----------------------------------------------------------------------
    def interrupted(self, sup: Supervisor) -> int:
        assert sup.signum is not None
        # Each replica saves the step it is at and stops; its pipeline stages agree on that
        # step first (Trainer.agree_stop_step). A replica inside an operation finishes it
        # first: it may wait --peer-timeout for a partner that stopped before it. A resume
        # continues from the newest step all of a replica's stages saved.
        sup._stop_all(graceful=True, grace=STOP_SECONDS + sup.cfg.method.peer_timeout)
        if all(p.poll() == 0 for p in sup.procs.values()):
            return self.finished(sup, set(self.local), set())  # every one ended first
        reached = {r: self._step(r) for r in self.local}
        step = max(reached.values(), default=0)
        saved = newest_checkpoints(self.out, self.local, self.stages)
        # Where the run stands in its store now: a resume opens the next epoch, unless
        # another machine of the run did first or the run trains on elsewhere
        # (:meth:`_resume_epoch`).
        with contextlib.suppress(OSError):
            RunDir(self.out).update_summary(status="interrupted", last_step=step,
                                            exit_code=128 + sup.signum,
                                            failures=sup.failures,
                                            elastic={"saved_steps": saved,
                                                     "reached_steps": reached,
                                                     "store": self._store_now()})
        name = signal.Signals(sup.signum).name
        if any(s is not None for s in saved.values()):
            at = ", ".join(f"replica {r} at step {s}" for r, s in saved.items()
                           if s is not None)
            # A replica stopped beyond its save: it stopped at once (its stages found no
            # step to agree on in time: the store out of reach, a stage hung).
            behind = [r for r, s in saved.items() if s is not None and s < reached[r]]
            redo = (f" (replica{'s' if len(behind) > 1 else ''} "
                    f"{', '.join(map(str, behind))} stopped past its checkpoint: the resume "
                    f"redoes the steps after)" if behind else "")
            print(f"noloco: stopped by {name}; saved {at}{redo}; continue with: noloco "
                  f"train --resume {self.out}", file=sys.stderr, flush=True)
        else:
            print(f"noloco: stopped by {name} at step {step}, before any "
                  f"checkpoint: nothing to resume (start again with --overwrite)",
                  file=sys.stderr, flush=True)
        return 128 + sup.signum

    # ---- a replica failed -------------------------------------------------------------------
    def failed(self, sup: Supervisor, group: int) -> str | int:
        r = group
        stages = [sup.procs[rank] for rank in self.groups(sup)[r]]
        failed = [c for c in (p.poll() for p in stages) if c not in (None, 0)]
        # A replica ends as a whole: its other stages cannot train without this one (they
        # would wait for it until the timeout).
        for p in stages:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()
        if SUPERSEDED_EXIT in failed:  # a newer process owns the id: not ours now
            sup.failures.append({"replica": r, "step": self._step(r), "kind": "superseded",
                                 "incarnation": self.incarnation[r], "t": time.time()})
            print(f"noloco: replica {r} was taken over by a newer process with the same id; "
                  f"not restarting it here", file=sys.stderr, flush=True)
            return "dead"
        if STORE_LOST_EXIT in failed:  # it stopped with a checkpoint, on purpose
            sup.failures.append({"replica": r, "step": self._step(r), "kind": "store lost",
                                 "incarnation": self.incarnation[r], "t": time.time()})
            print(f"noloco: replica {r} stopped: the run's store did not answer for "
                  f"--coordinator-timeout (it saved a checkpoint)", file=sys.stderr,
                  flush=True)
            return "dead"
        self._record_failure(r, min(failed))  # a signal (< 0) names the cause
        # Someone to join from: a replica here, or one alive elsewhere.
        others = [q for q in self.local if q != r and q not in sup.done | sup.dead]
        if not others:
            with contextlib.suppress(*store_errors()):  # unknown: nobody
                others = [q for q in live_replicas(sup.store, self.replicas, self.stages)
                          if q != r]
        # Nobody to join from (the others finished or died): its own newest checkpoint.
        own = newest_checkpoints(self.out, [r], self.stages)[r]
        if self.respawns > 0 and (others or own is not None):
            self.respawns -= 1
            self.incarnation[r] += 1
            self.joins.append({"replica": r, "incarnation": self.incarnation[r],
                               "started": time.time()})
            how = ("it joins from a live replica" if others else
                   f"nobody is left to join from: it goes on from its own checkpoint at step "
                   f"{own}")
            print(f"noloco: starting replica {r} again ({how})", file=sys.stderr, flush=True)
            self.start(sup, r)
            return "restarted"
        if sup.cfg.train.respawn > 0:  # it was allowed restarts: say why it got none
            why = ("--respawn is spent" if self.respawns <= 0 else
                   "no live replica to join from and no checkpoint of its own")
            sup.failures[-1]["not_restarted"] = why
            print(f"noloco: replica {r} is not started again: {why}", file=sys.stderr,
                  flush=True)
        return "dead"

    # ---- the end ----------------------------------------------------------------------------
    def finished(self, sup: Supervisor, done: set[int], dead: set[int]) -> int:
        self.close(sup)
        summary = combine(sup.cfg, self.out, sup.failures, self.joins, time.time() - self.t0,
                          self._store_now())
        if not done:
            if all(f["kind"] == "superseded" for f in sup.failures):
                print("noloco: every replica here was taken over by newer processes",
                      file=sys.stderr, flush=True)
                return 0
            if all(f["kind"] == "store lost" for f in sup.failures):
                reason = ("the run's store did not answer for --coordinator-timeout; every "
                          "replica here saved a checkpoint and stopped")
                RunDir(self.out).update_summary(reason=reason)
                print(f"noloco: error: {reason} (under {self.out}/checkpoints/)",
                      file=sys.stderr, flush=True)
                return 1
            print("noloco: error: every replica failed", file=sys.stderr, flush=True)
            return 1
        print(final_report(summary, str(self.out), local=len(self.local)), flush=True)
        return 0

    def _start_worker(self, replica: int, stage: int, rank: int) -> None:
        sup = self.sup
        local_rank = self.local.index(replica) * self.stages + stage
        local_world = len(self.local) * self.stages
        env = dict(sup.base_env(), RANK=str(rank), LOCAL_RANK=str(local_rank),
                   LOCAL_WORLD_SIZE=str(local_world))
        if self.coordinator is not None:
            # Across machines: the coordinator's store, and gloo on the interface the user
            # names (GLOO_SOCKET_IFNAME) or the one the hostname resolves to — not loopback.
            env.update(MASTER_ADDR=self.coordinator[0], MASTER_PORT=str(self.coordinator[1]))
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if var in os.environ:
                    env[var] = os.environ[var]
                else:
                    env.pop(var, None)
        spec = sup.spec.but(rank=rank, local_rank=local_rank, local_world=local_world,
                            elastic=True, resume=sup.resume, store=self.address)
        sup.start_worker(rank, spec, env)

    def _step(self, replica: int) -> int:
        """The last step the replica is known to have reached: its beat (which may lag the
        training thread by a beat interval, several steps of a small model) or the last line
        of its metrics here, whichever is later."""
        hb = self.sup.read(heartbeat_key(replica))
        step = int(hb["step"]) if hb else 0
        path = replica_metrics(self.out, replica, self.stages - 1, self.stages)
        with contextlib.suppress(OSError, ValueError):
            for line in path.read_text().splitlines():
                if line.strip():
                    step = max(step, int(json.loads(line).get("step", 0)))
        return step

    def _record_failure(self, replica: int, code: int) -> None:
        from noloco.worker import report_key

        step = self._step(replica)
        report = None
        for stage in range(self.stages):  # the worker's own report, if it wrote one
            hb = self.sup.read(heartbeat_key(replica, stage)) or {}
            rep = self.sup.read(report_key(hb.get("incarnation", 0),
                                           replica * self.stages + stage))
            if rep and rep.get("line") and report is None:
                report = rep
        how = (signal.Signals(-code).name if code < 0 else
               (report["line"] if report and report.get("line") else f"exit code {code}"))
        self.sup.failures.append({"replica": replica, "step": step, "kind": how,
                                  "incarnation": self.incarnation[replica],
                                  "t": time.time()})
        print(f"noloco: replica {replica} failed at step {step} ({how}); the others go on",
              file=sys.stderr, flush=True)
