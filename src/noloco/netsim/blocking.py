"""Straggler waiting: DiLoCo's global barrier versus NoLoCo's pairwise waits (NoLoCo Fig. 5B).

Only waiting is modelled, exactly as SPEC §5 describes; sending takes no time.

- Every worker's inner-step time is i.i.d. ``LogNormal(mu, sigma2)`` per worker and per inner
  step (paper: mu = 1, sigma^2 = 0.5). One outer step is H inner steps (``sync_every``).
- **DiLoCo**: every outer step ends at a global barrier, so it lasts as long as the slowest
  worker's H inner steps: ``T_DiLoCo = sum over outer steps of max_i(sum of worker i's H times)``.
- **NoLoCo**: every worker has its own clock. Each outer step, a worker's clock advances by its
  own H inner-step times; then a fresh random permutation cuts the workers into groups of
  ``group_size`` (paper: pairs, ``perm[j]`` with ``perm[j + n/2]``) and every member's clock
  becomes the latest clock of its group (it waits for its partner). Waits therefore carry
  forward through the gossip graph. ``T_NoLoCo`` is the largest clock at the end.

Both methods see the same inner-step times (common random numbers), so the ratio has less
Monte Carlo noise than two independent runs would.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from noloco.netsim.latency import NetsimError, check_workers

# Draw at most this many step times at once (outer steps are batched up to this size).
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True, kw_only=True)
class BlockingResult:
    """Total wall-clock of both methods, in the unit of the inner-step times."""

    workers: int
    """n: number of workers (replicas)."""
    sync_every: int
    """H: inner steps per outer step."""
    outer_steps: int
    mu: float
    sigma2: float
    group_size: int
    seed: int
    diloco_seconds: float
    """T_DiLoCo: sum over outer steps of the slowest worker's H inner steps."""
    noloco_seconds: float
    """T_NoLoCo: the latest worker clock after the last outer step."""
    compute_seconds: float
    """Expected compute time of one worker, outer_steps * H * E[step time] (no waiting)."""
    ratio: float
    """T_DiLoCo / T_NoLoCo (paper: about 1.2 at n = 1024, H = 100)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _validate(
    workers: int, sync_every: int, outer_steps: int, sigma2: float, group_size: int
) -> None:
    check_workers(workers)
    if int(sync_every) != sync_every or sync_every < 1:
        raise NetsimError(f"sync_every (H) must be an integer >= 1, got {sync_every}")
    if int(outer_steps) != outer_steps or outer_steps < 1:
        raise NetsimError(f"outer_steps must be an integer >= 1, got {outer_steps}")
    if not math.isfinite(sigma2) or sigma2 < 0:
        raise NetsimError(f"sigma2 (variance of log step time) must be >= 0, got {sigma2}")
    if group_size < 2 or workers % group_size:
        raise NetsimError(
            f"group_size must be >= 2 and divide workers ({workers}), got {group_size}"
        )


def outer_step_work(rng: np.random.Generator, workers: int, sync_every: int,
                    outer_steps: int, mu: float, sigma2: float) -> Iterator[np.ndarray]:
    """Per outer step, every worker's time for its H inner steps (drawn in batches of outer
    steps; the caller may draw from ``rng`` between two of them, as the batches come in the
    same order whatever it draws)."""
    sigma = math.sqrt(sigma2)
    per_batch = max(1, _CHUNK_ELEMENTS // (workers * sync_every))
    done = 0
    while done < outer_steps:
        m = min(per_batch, outer_steps - done)
        yield from rng.lognormal(mu, sigma, size=(m, workers, sync_every)).sum(axis=2)
        done += m


def simulate_blocking(
    workers: int = 1024,
    sync_every: int = 100,
    outer_steps: int = 250,
    *,
    mu: float = 1.0,
    sigma2: float = 0.5,
    group_size: int = 2,
    seed: int = 0,
) -> BlockingResult:
    """Simulate both methods on the same random inner-step times (vectorised over workers)."""
    _validate(workers, sync_every, outer_steps, sigma2, group_size)
    rng = np.random.default_rng(seed)
    n, h = int(workers), int(sync_every)
    clock = np.zeros(n)  # NoLoCo: each worker's own clock
    diloco = 0.0
    for work in outer_step_work(rng, n, h, outer_steps, mu, sigma2):
        diloco += float(work.max())  # the barrier waits for the slowest worker
        clock += work
        groups = rng.permutation(n).reshape(group_size, -1)  # perm[j] with perm[j + n/g]
        clock[groups] = clock[groups].max(axis=0)  # every member waits for the latest
    noloco = float(clock.max())
    mean_step = math.exp(mu + sigma2 / 2)
    return BlockingResult(
        workers=n,
        sync_every=h,
        outer_steps=int(outer_steps),
        mu=mu,
        sigma2=sigma2,
        group_size=group_size,
        seed=seed,
        diloco_seconds=diloco,
        noloco_seconds=noloco,
        compute_seconds=outer_steps * h * mean_step,
        ratio=diloco / noloco,
    )


def blocking_sweep(
    workers: list[int],
    sync_every: list[int],
    outer_steps: int = 250,
    *,
    mu: float = 1.0,
    sigma2: float = 0.5,
    group_size: int = 2,
    seed: int = 0,
) -> list[BlockingResult]:
    """Every (n, H) combination, each simulated from the same seed."""
    for n in workers:
        for h in sync_every:
            _validate(n, h, outer_steps, sigma2, group_size)
    return [
        simulate_blocking(n, h, outer_steps, mu=mu, sigma2=sigma2, group_size=group_size, seed=seed)
        for n in workers
        for h in sync_every
    ]
