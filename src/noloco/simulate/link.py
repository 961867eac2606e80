"""The wall-clock a simulated run would take on a network: netsim's model, step by step.

A simulated run has no network; with ``--bandwidth`` (and ``--latency``, ``--step-time``) it
keeps a modelled clock. Every inner step adds the step time of one replica on the modelled
hardware, plus the communication it could not hide: per replica, the bytes it sent in the
step (counted by the distributed formulas, :mod:`noloco.simulate.fabric`) over the bandwidth,
plus the latency terms of its operations — the model of ``noloco netsim predict``
(docs/netsim.md, P2–P4):

    all-reduce, quantised all-reduce (a ring):  2·(n − 1) latencies
    all-gather (a ring's steps):                 n − 1 latencies
    exchange with a group (all at once):         1 latency

where n is the replicas taking part. A sync that overlaps τ inner steps (Streaming) hides
up to τ step times: exposed = max(0, t − τ·step time). The replicas move in lockstep, so a
step takes as long as its slowest replica's.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

LATENCY_TERMS = {"all_reduce": "ring", "all_reduce_quantized": "ring", "all_gather": "gather",
                 "exchange": "one"}


@dataclass
class LinkModel:
    bandwidth_bps: float
    latency_s: float = 0.0
    step_seconds: float | None = None
    """one replica's inner step on the modelled hardware (None: this process's step time
    divided by the replicas, measured step by step)"""
    overlap_steps: int = 0
    seconds: float = 0.0
    """the modelled wall-clock so far"""
    exposed_seconds: float = 0.0
    """communication not hidden behind compute, so far"""
    _last: list[tuple[int, Counter[str]]] = field(default_factory=list)

    def sync_seconds(self, sent: int, ops: Counter[str], members: int) -> float:
        """One replica's communication of a step: ``sent`` bytes in ``ops``."""
        terms = {"ring": 2 * (members - 1), "gather": members - 1, "one": 1}
        lat = sum(count * terms[LATENCY_TERMS.get(kind, "one")] for kind, count in ops.items())
        return sent * 8 / self.bandwidth_bps + lat * self.latency_s

    def start(self, comms: list[Any]) -> None:
        """Before the first step: what the replicas' communicators counted so far."""
        self._last = [(c.bytes_sent, Counter(c.ops)) for c in comms]

    def step(self, comms: list[Any], live: list[int], measured_step_seconds: float) -> None:
        """Advance by one inner step: every live replica's bytes and operations since the
        last call, or since :meth:`start` (``comms``: the replicas' communicators)."""
        t_step = self.step_seconds if self.step_seconds is not None else measured_step_seconds
        worst = 0.0
        for r in live:
            c = comms[r]
            sent0, ops0 = self._last[r]
            ops = Counter(c.ops)
            ops.subtract(ops0)
            ops = +ops
            if ops:
                t = self.sync_seconds(c.bytes_sent - sent0, ops, len(live))
                worst = max(worst, max(0.0, t - self.overlap_steps * t_step))
        self._last = [(c.bytes_sent, Counter(c.ops)) for c in comms]
        self.seconds += t_step + worst
        self.exposed_seconds += worst

    def report(self) -> dict[str, Any]:
        return {"bandwidth_bps": self.bandwidth_bps, "latency_s": self.latency_s,
                "step_seconds": self.step_seconds, "wall_seconds": self.seconds,
                "exposed_sync_seconds": self.exposed_seconds}
