"""What a worker is told when it starts, once: :class:`WorkerSpec`.

A launcher (:mod:`noloco.launch`, :mod:`noloco.elastic.launcher`) builds one spec per worker
and hands it over as the worker's one argument (JSON; through the warm parent's pipe when the
worker is forked, :mod:`noloco.warm`). Under torchrun the command line is the entry point: it
builds the spec from torchrun's environment (:meth:`WorkerSpec.under_torchrun`). Below the
entry point nothing reads a launcher's setting from the environment again: the spec's fields
are the whole channel from a launcher to its worker (torchrun's own variables — ``RANK``,
``MASTER_ADDR``, ... — are read where the process group is built, as torchrun defines them).

No secret travels in a spec (it may be a process's command line): the run secret stays where
the user put it (``--secret-file`` or ``NOLOCO_SECRET``), read by :mod:`noloco.elastic.auth`.

Floor 1 of docs/architecture.md: a run's description.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any

from noloco.config import Config, ConfigError
from noloco.errors import plural

HOST_STAGING_ENV = "NOLOCO_HOST_STAGING"
"""``1``: stage every communicator's traffic through host buffers even on CPU (the same code
as GPU workers that share a GPU: how the tests check it on a machine without one). A user's
setting, read by the entry point into :attr:`WorkerSpec.host_staging`."""


def forced_host_staging(env: Any = None) -> bool:
    """Whether ``env`` (default: this process's environment) sets :data:`HOST_STAGING_ENV`."""
    return (os.environ if env is None else env).get(HOST_STAGING_ENV) == "1"


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's start: its run (the config, resolved once by the entry point), its place
    in the run, and how this start relates to earlier ones."""

    config: Config
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    attempt: int | None = None
    """our launcher's attempt (0, then one more per restart); None: counted in the run's
    store (torchrun restarts every worker, :func:`noloco.distributed.attempt_number`)"""
    resume: bool = False
    """continue from the newest complete checkpoint (none: start afresh...)"""
    must_resume: bool = False
    """... unless this is set: then no checkpoint is an error"""
    rundir_ready: bool = False
    """a launcher prepared the run directory (else rank 0 does)"""
    supervised: bool = False
    """our local launcher supervises the worker: it reports to the store, the launcher speaks
    for the run"""
    elastic: bool = False
    """one replica of an elastic run (:mod:`noloco.elastic.worker`)"""
    store: str | None = None
    """an elastic run's store: ``etcd://...`` or ``HOST:PORT`` (a coordinator's or the
    launcher's)"""
    launcher_pid: int | None = None
    """the process the worker dies with (a local launcher's)"""
    host_staging: bool = False
    """stage traffic through host buffers even on CPU (:data:`HOST_STAGING_ENV`)"""

    @property
    def replica(self) -> int:
        return self.rank // self.config.method.stages

    @property
    def stage(self) -> int:
        return self.rank % self.config.method.stages

    # ---- the hand-over ------------------------------------------------------------------------
    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}
        return json.dumps({"config": self.config.to_dict(), **d})

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        d = json.loads(text)
        return cls(config=Config.from_dict(d.pop("config")), **d)

    def but(self, **changes: Any) -> WorkerSpec:
        """A copy with ``changes`` (the same run, another worker or start)."""
        return replace(self, **changes)

    # ---- the entry points -----------------------------------------------------------------------
    @classmethod
    def under_torchrun(cls, cfg: Config, resume: bool = False, must_resume: bool = False,
                       rundir_ready: bool = False) -> WorkerSpec:
        """The spec of this process under torchrun, or of one worker alone (no ``RANK``): its
        place from torchrun's variables. ``cfg`` resolved."""
        env = os.environ
        world = int(env.get("WORLD_SIZE", 1))
        m = cfg.method
        if m.elastic:
            raise ConfigError("--elastic does not run under torchrun: across machines, start "
                              "`noloco coordinator` and `noloco train --elastic --coordinator "
                              "HOST:PORT --replica-ids ...` on each (docs/elastic.md)")
        if world != m.replicas * m.stages:
            raise ConfigError(f"world size {world} does not match --replicas {m.replicas} x "
                              f"--stages {m.stages} = {plural(m.replicas * m.stages, 'worker')}")
        return cls(config=cfg, rank=int(env.get("RANK", 0)), world=world,
                   local_rank=int(env.get("LOCAL_RANK", 0)),
                   local_world=int(env.get("LOCAL_WORLD_SIZE", world)), resume=resume,
                   must_resume=must_resume, rundir_ready=rundir_ready,
                   host_staging=forced_host_staging(env))

    @classmethod
    def for_launcher(cls, cfg: Config, local_world: int, **kw: Any) -> WorkerSpec:
        """The spec a local launcher starts from (rank 0; :meth:`but` places each worker):
        supervised, its run directory prepared. ``cfg`` resolved."""
        return cls(config=cfg, world=cfg.world_size, local_world=local_world, supervised=True,
                   rundir_ready=True, launcher_pid=os.getpid(),
                   host_staging=forced_host_staging(), **kw)

