"""Replicas that leave and join during a simulated run (``--churn RATE``).

At every outer-step boundary (after inner step t with t mod H = 0), first every replica whose
time away is over joins, then every replica in the run leaves with probability RATE — drawn
from the run's seed, so a churned run is reproducible — except that the last one never
leaves. A replica stays away ``--churn-away`` outer steps (H inner steps each).

The rules are an elastic run's (docs/elastic.md), side by side in docs/simulate.md:

- a leaver is left out of every operation that starts after it left (an all-reduce averages
  the replicas in the run, NoLoCo draws its groups among them, an all-gather has no message
  of it); what it posted before it left counts;
- a joiner takes a donor's state — the lowest-numbered replica in the run (every replica in
  the run is at the same step) — as an elastic join does: its weights, its method's whole
  state (slow weights, outer momentum, syncs in flight, NoLoCo's exchange count) but not its
  error feedback (a joiner owes nothing), and its operation count; it keeps its own data
  position (where it left off) and its AdamW moments from when it left (an elastic replica
  reloads its own checkpoint's, up to a checkpoint interval old); the AdamW step count is
  the stacks' one, shared.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Churn:
    rate: float
    """the probability that a replica in the run leaves during one outer step (H steps)"""
    away: int = 1
    """outer steps a replica that left stays away"""
    seed: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    back_at: dict[int, int] = field(default_factory=dict)
    """replica away → the step it joins at"""

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"--churn must lie in [0, 1), got {self.rate:g}")
        if self.away < 1:
            raise ValueError(f"--churn-away must be >= 1 outer step, got {self.away}")
        self._rng = np.random.default_rng([self.seed, 0x636875726E])

    def joining(self, step: int) -> list[int]:
        """The replicas that join after inner step ``step``."""
        back = sorted(r for r, at in self.back_at.items() if at <= step)
        for r in back:
            del self.back_at[r]
        return back

    def leaving(self, step: int, live: list[int], sync_every: int) -> list[int]:
        """The replicas that leave after inner step ``step`` (one draw per replica in the run,
        in rank order; the last one in the run stays)."""
        draws = self._rng.random(len(live))
        out = [r for r, u in zip(live, draws, strict=True) if u < self.rate]
        if len(out) == len(live):
            out = out[1:]
        for r in out:
            self.back_at[r] = step + self.away * sync_every
        return out

    def record(self, step: int, replica: int, kind: str, donor: int | None = None) -> None:
        self.events.append({"step": step, "replica": replica, "kind": kind,
                            **({"donor": donor} if donor is not None else {})})

    def report(self) -> dict[str, Any]:
        return {"rate": self.rate, "away_outer_steps": self.away,
                "left": sum(e["kind"] == "left" for e in self.events),
                "joined": sum(e["kind"] == "joined" for e in self.events),
                "events": list(self.events)}
