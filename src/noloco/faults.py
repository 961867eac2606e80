"""Deterministic fault injection: a testing and demonstration tool (``--inject-fault``).

Failures in distributed training are rare and badly timed; tests need them on cue. A fault
names a worker by its replica (and optionally its stage) and an inner step:

- ``kill:R@S`` — after inner step S, the worker of replica R sends itself SIGKILL: exactly what
  ``kill -9`` from outside does, at a step a test can rely on.
- ``stall:R@S:SECONDS`` — after inner step S the worker stops itself with SIGSTOP (its
  heartbeat thread stops too, as for a frozen or partitioned machine); a helper process sends
  SIGCONT after SECONDS.
- ``slow:R:FACTOR`` — every inner step of replica R takes FACTOR times as long (it sleeps the
  difference): a straggler.
- ``pace:R:SECONDS`` — every inner step of replica R takes at least SECONDS (it sleeps the
  rest): a machine of a known speed whatever else runs beside it. A run that must outlast
  something timed (a cut link, a restart) lasts as long on a loaded machine as on an idle
  one, where ``slow`` would stretch the load's delays too.
- ``crash:R@S`` — after inner step S the worker raises an error, as a bug would.
- ``hang:R@S[:SECONDS]`` — after inner step S the training loop stops for SECONDS (default
  60) while the process — its heartbeat thread included — runs on: a replica stuck in a
  deadlock, a dead accelerator or a filesystem call, which looks alive to every heartbeat.

- ``corrupt:R@S:nan`` / ``corrupt:R@S:scale:F`` — after inner step S the weights of replica R
  turn NaN, or are multiplied by F: a faulty accelerator, a bit flip, a bug — what the update
  guard (:mod:`noloco.guard`) keeps from spreading.
- ``tamper:R@S`` — (elastic runs) from inner step S on, every payload replica R sends another
  replica — exchanges, quantised all-reduce messages, states — leaves altered after it was
  sealed: what a machine on the path between them could do. With a run secret the receivers
  drop it (:mod:`noloco.integrity`); without one it goes through. (gloo's own unquantised
  all-reduce is not altered: noloco never holds its messages.)

``R`` is ``REPLICA`` (stage 0 for kill and stall, every stage for slow and pace) or
``REPLICA.STAGE``.
kill, stall, hang, crash, corrupt and tamper fire once per run: in the first attempt of a fresh
run, never again after a restart or a resume (which would otherwise replay them forever).

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from noloco.errors import ConfigError
from noloco.integrity import WireFilter

KINDS = ("kill", "stall", "hang", "slow", "pace", "crash", "corrupt", "tamper")
HANG_SECONDS = 60.0
"""how long ``hang:R@S`` stops the training loop when it names no time"""


@dataclass(frozen=True)
class Fault:
    kind: str
    replica: int
    stage: int | None
    """None: every stage (slow, pace) — kill and stall default to stage 0"""
    step: int = 0
    seconds: float = 0.0
    """stall, hang: how long; pace: the shortest inner step"""
    factor: float = 1.0
    """slow: the step's stretch; corrupt: what the weights are multiplied by (NaN: nan)"""

    def hits(self, replica: int, stage: int) -> bool:
        return self.replica == replica and (self.stage is None or self.stage == stage)


def parse_faults(spec: str, replicas: int, stages: int) -> list[Fault]:
    """``kill:1@40,stall:2@10:5,slow:3:2.5`` → faults; a malformed one is a ConfigError."""
    out = []
    for item in filter(None, (x.strip() for x in (spec or "").split(","))):
        kind, _, rest = item.partition(":")
        try:
            if kind == "slow":
                who, factor = rest.split(":")
                replica, stage = _who(who, default_stage=None)
                fault = Fault("slow", replica, stage, factor=float(factor))
                if not fault.factor >= 1.0:
                    raise ValueError
            elif kind == "pace":
                who, seconds = rest.split(":")
                replica, stage = _who(who, default_stage=None)
                fault = Fault("pace", replica, stage, seconds=float(seconds))
                if not 0 < fault.seconds < math.inf:
                    raise ValueError
            elif kind == "corrupt":
                who, _, when = rest.partition("@")
                parts = when.split(":")
                replica, stage = _who(who, default_stage=None)
                if parts[1:] == ["nan"]:
                    factor = math.nan
                elif len(parts) == 3 and parts[1] == "scale":
                    factor = float(parts[2])
                else:
                    raise ValueError
                fault = Fault("corrupt", replica, stage, step=int(parts[0]), factor=factor)
                if fault.step < 1:
                    raise ValueError
            elif kind in ("kill", "stall", "hang", "crash", "tamper"):
                who, _, when = rest.partition("@")
                parts = when.split(":")
                if len(parts) not in {"stall": (2,), "hang": (1, 2)}.get(kind, (1,)):
                    raise ValueError
                replica, stage = _who(who, default_stage=0)
                seconds = float(parts[1]) if len(parts) == 2 else (
                    HANG_SECONDS if kind == "hang" else 0.0)
                fault = Fault(kind, replica, stage, step=int(parts[0]), seconds=seconds)
                if fault.step < 1 or fault.seconds < 0:
                    raise ValueError
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(f"bad --inject-fault {item!r} (expected kill:REPLICA@STEP, "
                              f"stall:REPLICA@STEP:SECONDS, hang:REPLICA@STEP[:SECONDS], "
                              f"crash:REPLICA@STEP, tamper:REPLICA@STEP, "
                              f"corrupt:REPLICA@STEP:nan, "
                              f"corrupt:REPLICA@STEP:scale:FACTOR, "
                              f"slow:REPLICA:FACTOR>=1 or pace:REPLICA:SECONDS>0)") from None
        if not 0 <= fault.replica < replicas or (
                fault.stage is not None and not 0 <= fault.stage < stages):
            raise ConfigError(f"--inject-fault {item!r} names a worker outside {replicas} "
                              f"replicas x {stages} stages")
        out.append(fault)
    return out


class InjectedCrash(RuntimeError):
    """What ``crash:R@S`` raises: an error like any bug's."""


def _who(text: str, default_stage: int | None) -> tuple[int, int | None]:
    replica, dot, stage = text.partition(".")
    return int(replica), int(stage) if dot else default_stage


class Wired(Protocol):
    """A communicator whose payloads pass through a wire filter (the elastic one's)."""

    wire: WireFilter | None


class Tamper:
    """What ``tamper:R@S`` installs as its replica's wire filter
    (:class:`noloco.integrity.WireFilter`): every message leaves with one byte flipped, after
    it was sealed. Which byte: a state's last (unsealed, such a state still loads), every
    other message's first."""

    def __call__(self, messages: torch.Tensor, channel: str) -> torch.Tensor:
        out = messages.clone()
        out[:, -1 if channel == "state" else 0] ^= 0xFF
        return out


class FaultInjector:
    """The faults of one worker. ``once`` is False after a restart or resume: kill and stall
    have fired already (or were meant for a run that no longer exists)."""

    def __init__(self, faults: list[Fault], replica: int, stage: int, rank: int,
                 once: bool, publish: Callable[[], None] | None = None) -> None:
        """``publish``: called before a kill or a stop, to make the step this worker reached
        known (a heartbeat now): what the launcher then says matches this worker's line."""
        mine = [f for f in faults if f.hits(replica, stage)]
        self.rank, self.replica, self.stage = rank, replica, stage
        self.publish = publish
        self.pending = {f.step: f for f in mine if f.kind not in ("slow", "pace") and once}
        self.slow = max((f.factor for f in mine if f.kind == "slow"), default=1.0)
        self.shortest = max((f.seconds for f in mine if f.kind == "pace"), default=0.0)
        """pace: the least seconds an inner step takes"""

    def pace(self, step_seconds: float) -> None:
        """Stretch an inner step that took ``step_seconds`` by the slow factor, then to the
        pace's shortest step."""
        extra = max(self.slow * step_seconds, self.shortest) - step_seconds
        if extra > 0:
            time.sleep(extra)

    def after_step(self, step: int, params: list[torch.Tensor] | None = None,
                   comm: Wired | None = None) -> None:
        # The first step at or past the fault's: an elastic replica that caught up by taking
        # a live state jumps over steps, and its fault must not vanish with them.
        due = [s for s in self.pending if s <= step]
        if not due:
            return
        fault = self.pending.pop(min(due))
        who = f"rank {self.rank} (replica {self.replica}, stage {self.stage})"
        pid = os.getpid()
        if fault.kind in ("kill", "stall") and self.publish is not None:
            self.publish()
        if fault.kind == "kill":
            print(f"noloco: injected fault: SIGKILL to {who} after step {step}",
                  file=sys.stderr, flush=True)
            os.kill(pid, signal.SIGKILL)
        elif fault.kind == "corrupt":
            what = "turn NaN" if math.isnan(fault.factor) else f"are multiplied by {fault.factor:g}"
            print(f"noloco: injected fault: the weights of {who} {what} after step {step}",
                  file=sys.stderr, flush=True)
            with torch.no_grad():
                for p in params or []:
                    if math.isnan(fault.factor):
                        p.fill_(math.nan)
                    else:
                        p.mul_(fault.factor)
        elif fault.kind == "tamper":
            print(f"noloco: injected fault: every payload {who} sends is altered on the wire "
                  f"from step {step} on", file=sys.stderr, flush=True)
            if comm is not None:  # from outside: the communicator knows no faults
                comm.wire = Tamper()
        elif fault.kind == "crash":
            raise InjectedCrash(f"injected crash of {who} after step {step}")
        elif fault.kind == "hang":
            print(f"noloco: injected fault: the training loop of {who} hangs after step "
                  f"{step} for {fault.seconds:g} s (its heartbeat goes on)", file=sys.stderr,
                  flush=True)
            time.sleep(fault.seconds)
        else:
            print(f"noloco: injected fault: SIGSTOP to {who} after step {step} for "
                  f"{fault.seconds:g} s", file=sys.stderr, flush=True)
            # The helper outlives a stop of this process; its own session keeps a Ctrl-C
            # meant for the run from killing it before it wakes the worker.
            subprocess.Popen(["sh", "-c", f"sleep {fault.seconds}; kill -CONT {pid}"],
                             start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            os.kill(pid, signal.SIGSTOP)
