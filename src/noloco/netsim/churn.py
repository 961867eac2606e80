"""Churn at internet scale: NoLoCo's groups against DiLoCo's quorum when replicas fail.

The straggler model of :mod:`noloco.netsim.blocking` (inner-step times LogNormal(mu, sigma²),
i.i.d. per worker and step; sending takes no time) plus failures, with the rules the elastic
runtime (``noloco train --elastic``, :mod:`noloco.elastic`) follows:

- **Failures** are a Poisson process per replica (mean time between failures ``mtbf``, in
  the unit of the step times). A replica that fails loses the inner steps of its current
  outer step and is back ``rejoin_delay`` later (restart plus state transfer); it then
  starts its next outer step at that time.
- **Peer timeout.** Whoever arrives first at an operation waits at most ``timeout`` for the
  others; the members that arrived by then go on together, later ones alone. A replica that
  failed during the outer step is still in that operation's snapshot (it was alive when the
  snapshot was fixed), so its group waits the full timeout for it; afterwards it is out of
  the snapshots until it is back.
- **NoLoCo**: every replica has its own clock; each outer step a fresh random permutation of
  the replicas in the snapshot cuts them into groups (pairs: perm[j] with perm[j + k]; the
  ones left over join the last group). A group's members leave at the arrival decision:
  the last arrival if everyone came within the timeout, else the first arrival + timeout.
- **DiLoCo**: one quorum of all replicas in the snapshot per outer step, the same arrival
  rule: everyone's clock becomes the decision time (a global barrier). Replicas that came
  late, and replicas back from a failure, take the quorum's state and join the next outer
  step at the barrier (torchft's healing; their own late steps are lost).

Counted: inner steps that ended in an outer step the replica took part in (in a group or
alone), per unit of wall time (the largest clock), and compute utilisation = those steps'
compute time / (replicas × wall time).

With no failures and an infinite timeout both reduce exactly to :func:`simulate_blocking`
(the same random numbers in the same order; a test checks).

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from noloco.netsim.blocking import outer_step_work
from noloco.netsim.latency import NetsimError, check_workers


@dataclass(frozen=True, kw_only=True)
class ChurnResult:
    workers: int
    sync_every: int
    outer_steps: int
    mtbf: float
    """mean time between failures of one replica (inf: none)"""
    timeout: float
    rejoin_delay: float
    mu: float
    sigma2: float
    group_size: int
    seed: int
    noloco_seconds: float
    diloco_seconds: float
    noloco_steps: int
    """inner steps kept (summed over replicas)"""
    diloco_steps: int
    noloco_steps_per_second: float
    diloco_steps_per_second: float
    noloco_utilisation: float
    diloco_utilisation: float
    failures: int
    """failures of the NoLoCo simulation (DiLoCo sees the same failure times)"""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _decide(ready: np.ndarray, expected_absent: bool, timeout: float) -> float:
    """When the members of one operation that arrived at ``ready`` leave: the last arrival
    if nobody is missing and all came within the timeout of the first, else first + timeout
    (never before the last member in time)."""
    first, last = float(ready.min()), float(ready.max())
    if not expected_absent and last - first <= timeout:
        return last
    in_time = ready[ready <= first + timeout]
    return max(first + timeout, float(in_time.max())) if expected_absent else first + timeout


class _Failures:
    """Each replica's next failure time (exponential gaps), from its own generator."""

    def __init__(self, n: int, mtbf: float, seed: int) -> None:
        self.mtbf = mtbf
        self.rng = np.random.default_rng([seed, 0x636875726E])
        self.next = self._gap(n)
        self.count = 0

    def _gap(self, n: int) -> np.ndarray:
        if math.isinf(self.mtbf):
            return np.full(n, math.inf)
        return self.rng.exponential(self.mtbf, size=n)

    def during(self, start: np.ndarray, end: np.ndarray, up: np.ndarray) -> np.ndarray:
        """Replicas (among ``up``) failing within [start, end): their failure times are
        returned (NaN for the others) and their next failures drawn after a restart."""
        hit = up & (self.next < end)
        when = np.where(hit, np.maximum(self.next, start), np.nan)
        self.count += int(hit.sum())
        return when

    def restarted(self, i: np.ndarray, at: np.ndarray) -> None:
        self.next[i] = at + self._gap(len(i))


def simulate_churn(workers: int = 1024, sync_every: int = 100, outer_steps: int = 100, *,
                   mtbf: float = math.inf, timeout: float = math.inf, rejoin_delay: float = 0.0,
                   mu: float = 1.0, sigma2: float = 0.5, group_size: int = 2, seed: int = 0
                   ) -> ChurnResult:
    check_workers(workers)
    if workers % group_size or group_size < 2:
        raise NetsimError(f"group_size must be >= 2 and divide workers ({workers})")
    if not (mtbf > 0 and timeout > 0 and rejoin_delay >= 0):
        raise NetsimError("--mtbf and --timeout must be > 0, --rejoin-delay >= 0")
    if int(outer_steps) != outer_steps or outer_steps < 1 or sync_every < 1:
        raise NetsimError("outer_steps and sync_every must be integers >= 1")
    n, h = int(workers), int(sync_every)
    mean_step = math.exp(mu + sigma2 / 2)
    noloco = _NoLoCo(n, h, timeout, rejoin_delay, group_size, _Failures(n, mtbf, seed))
    diloco = _DiLoCo(n, h, timeout, rejoin_delay, _Failures(n, mtbf, seed))
    rng = np.random.default_rng(seed)
    for work in outer_step_work(rng, n, h, int(outer_steps), mu, sigma2):
        diloco.outer_step(work)
        noloco.outer_step(work, rng.permutation(n))
    t_n, t_d = noloco.wall(), diloco.wall()
    return ChurnResult(
        workers=n, sync_every=h, outer_steps=int(outer_steps), mtbf=mtbf, timeout=timeout,
        rejoin_delay=rejoin_delay, mu=mu, sigma2=sigma2, group_size=group_size, seed=seed,
        noloco_seconds=t_n, diloco_seconds=t_d, noloco_steps=noloco.steps,
        diloco_steps=diloco.steps, noloco_steps_per_second=noloco.steps / t_n,
        diloco_steps_per_second=diloco.steps / t_d,
        noloco_utilisation=noloco.steps * mean_step / (n * t_n),
        diloco_utilisation=diloco.steps * mean_step / (n * t_d),
        failures=noloco.failures.count)


class _NoLoCo:
    def __init__(self, n: int, h: int, timeout: float, rejoin: float, group_size: int,
                 failures: _Failures) -> None:
        self.n, self.h, self.timeout, self.rejoin, self.g = n, h, timeout, rejoin, group_size
        self.clock = np.zeros(n)
        self.back = np.zeros(n)
        """when each replica is back after a failure (0: never failed)"""
        self.failures = failures
        self.steps = 0

    def wall(self) -> float:
        return float(self.clock.max())

    def outer_step(self, work: np.ndarray, perm: np.ndarray) -> None:
        # Away: failed and not back by the time the others start this outer step (their
        # median clock: the replicas advance at different paces). An away replica is in no
        # snapshot and does no work; once back it takes a live replica's state and step
        # and starts at its return.
        present = self.back <= 0
        away = ~present & (self.back > np.median(self.clock[present])) if not present.all() \
            else np.zeros(self.n, bool)
        self.back[~away] = 0.0
        start = self.clock
        ready = start + work
        failed_at = self.failures.during(start, ready, ~away)
        failed = ~np.isnan(failed_at)
        new = ready.copy()
        new[away] = start[away]
        # The snapshot: everyone not away (one failing during this step was alive when it
        # was fixed, so its group waits the timeout for it).
        order = perm[~away[perm]]
        k = len(order) // self.g
        for j in range(k):
            members = order[[j + i * k for i in range(self.g)]]
            if j == k - 1:
                members = np.concatenate([members, order[k * self.g:]])
            alive = members[~failed[members]]
            if len(alive) == 0:
                continue
            t = _decide(ready[alive], bool(failed[members].any()), self.timeout)
            new[alive[ready[alive] <= t]] = t
            self.steps += self.h * len(alive)  # in time or alone: the steps are kept
        if 0 < len(order) < self.g:  # one replica left: alone
            alive = order[~failed[order]]
            self.steps += self.h * len(alive)
        if failed.any():
            self.back[failed] = failed_at[failed] + self.rejoin
            new[failed] = self.back[failed]
            self.failures.restarted(np.flatnonzero(failed), self.back[failed])
        self.clock = new


class _DiLoCo:
    def __init__(self, n: int, h: int, timeout: float, rejoin: float,
                 failures: _Failures) -> None:
        self.n, self.h, self.timeout, self.rejoin = n, h, timeout, rejoin
        self.t = 0.0
        """the last barrier"""
        self.back = np.zeros(n)
        """when each replica can start its next outer step (after a failure: when back)"""
        self.failures = failures
        self.steps = 0

    def wall(self) -> float:
        return self.t

    def outer_step(self, work: np.ndarray) -> None:
        up = self.back <= self.t  # the snapshot: every replica not away after a failure
        if not up.any():  # everyone away: the next barrier is when the first is back
            self.t = float(self.back.min())
            up = self.back <= self.t
        start = np.full(self.n, self.t)
        ready = start + work
        failed_at = self.failures.during(start, ready, up)
        failed = ~np.isnan(failed_at)
        if failed.any():
            self.back[failed] = failed_at[failed] + self.rejoin
            self.failures.restarted(np.flatnonzero(failed), self.back[failed])
        alive = up & ~failed
        if alive.any():
            t = _decide(ready[alive], bool(failed.any()), self.timeout)
            # In the quorum: arrived by the decision. Later ones heal: their steps are lost.
            self.steps += self.h * int((ready[alive] <= t).sum())
            self.t = t
        else:
            self.t = float(ready.max())
