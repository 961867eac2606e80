"""Latency of a global all-reduce versus a NoLoCo group exchange (NoLoCo §5.3, Fig. 5A).

Every message between two workers takes a random time t. Its distribution is log-normal,
``t ~ LogNormal(mu, sigma^2)``, described here by its coefficient of variation
``cv = std(t) / mean(t) = sqrt(exp(sigma^2) - 1)`` (the x-axis of Fig. 5A). ``mu`` only scales
every time by the same factor, so it is chosen to make the mean message time 1: all times
returned by this module are in units of the mean message time t_c, and the ratios do not
depend on it.

Three communication patterns over ``n`` workers (paper symbol n; ``workers`` here):

- **Tree all-reduce** (SPEC §5): reduce to a root over a binary tree with n leaves
  (ceil(log2 n) levels), then broadcast back down the same tree. In the reduce, a parent can
  forward only when both children's messages have arrived, so its ready time is
  ``max(ready(left) + t_left, ready(right) + t_right)``; the root is therefore ready after the
  slowest leaf-to-root path. The broadcast ends when the last leaf has its copy: the slowest
  root-to-leaf path of fresh, independent message times. With constant times this is
  ``2 * t_c * log2(n)``.
- **Ring all-reduce**: 2(n - 1) sequential message steps (reduce-scatter then all-gather); in
  each step all n workers send one message in parallel and the next step waits for the
  slowest of the n. Expected time ``2 (n - 1) * E[max of n message times]``.
- **Pair exchange** (NoLoCo, group size 2): the paper counts two message times, each waiting
  for the slower of the two partners: ``2 * E[max(t1, t2)]`` with the closed form
  ``E[max(t1, t2)] = (1 + erf(sigma / 2)) * exp(mu + sigma^2 / 2)``.

So at cv = 0, tree / pair = log2(n) (10 at n = 1024) and ring / pair = n - 1.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# Bound on the number of random numbers drawn at once (memory stays ~ 16 MiB per array).
_CHUNK_ELEMENTS = 1 << 21


class NetsimError(ValueError):
    """Bad input to the network model (the CLI prints it as one line and exits with code 2).

    Defined in this module because every other netsim module imports it from here.
    """


def check_workers(workers: int, minimum: int = 2) -> int:
    """Validate a worker count (an int >= ``minimum``)."""
    if isinstance(workers, bool) or int(workers) != workers or workers < minimum:
        raise NetsimError(f"workers must be an integer >= {minimum}, got {workers}")
    return int(workers)


def check_cv(cv: float) -> float:
    """Validate a coefficient of variation (finite, >= 0)."""
    if not math.isfinite(cv) or cv < 0:
        raise NetsimError(f"cv (std/mean of the message time) must be >= 0, got {cv}")
    return float(cv)


def cv_to_sigma(cv: float) -> float:
    """Log-normal shape sigma whose coefficient of variation is ``cv``: sigma^2 = ln(1 + cv^2)."""
    return math.sqrt(math.log1p(check_cv(cv) ** 2))


def sigma_to_cv(sigma: float) -> float:
    """Inverse of :func:`cv_to_sigma`: cv = sqrt(exp(sigma^2) - 1)."""
    return math.sqrt(math.expm1(sigma**2))


def unit_mean_mu(sigma: float) -> float:
    """The log-normal mu that makes the mean message time exp(mu + sigma^2/2) equal to 1."""
    return -0.5 * sigma**2


def expected_max_of_two(mu: float, sigma: float) -> float:
    """Closed form E[max(t1, t2)] for i.i.d. t ~ LogNormal(mu, sigma^2) (NoLoCo §5.3)."""
    return (1.0 + math.erf(sigma / 2.0)) * math.exp(mu + 0.5 * sigma**2)


def pair_exchange_time(cv: float) -> float:
    """Expected pair-exchange time in mean message times: 2 * E[max(t1, t2)]."""
    sigma = cv_to_sigma(cv)
    return 2.0 * expected_max_of_two(unit_mean_mu(sigma), sigma)


def _messages(rng: np.random.Generator, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
    """Message times with mean 1 (exactly 1 when sigma = 0)."""
    if sigma == 0.0:
        return np.ones(shape)
    return rng.lognormal(unit_mean_mu(sigma), sigma, size=shape)


def _chunks(samples: int, width: int) -> list[int]:
    """Split ``samples`` Monte Carlo draws into chunks of at most ~_CHUNK_ELEMENTS numbers."""
    per = max(1, _CHUNK_ELEMENTS // max(1, width))
    return [min(per, samples - s) for s in range(0, samples, per)]


def _slowest_tree_path(n: int, sigma: float, samples: int, rng: np.random.Generator) -> np.ndarray:
    """Per sample: the longest leaf-to-root path of a binary tree with n leaves.

    Leaves are padded to the next power of two; padded leaves are absent (ready at -inf), so a
    parent with a single real child just waits for that child. This is both the reduce time
    (parents wait for their slower child) and, with fresh draws, the broadcast time.
    """
    levels = max(1, math.ceil(math.log2(n)))
    width = 1 << levels
    out = []
    for m in _chunks(samples, 2 * width):
        ready = np.full((m, width), -np.inf)
        ready[:, :n] = 0.0
        for _ in range(levels):
            arrive = ready + _messages(rng, sigma, ready.shape)
            ready = np.maximum(arrive[:, 0::2], arrive[:, 1::2])
        out.append(ready[:, 0])
    return np.concatenate(out)


def tree_allreduce_samples(
    workers: int, cv: float, samples: int = 2000, seed: int = 0
) -> np.ndarray:
    """Monte Carlo draws of the tree all-reduce time (reduce + broadcast), in mean message times."""
    n = check_workers(workers)
    sigma = cv_to_sigma(cv)
    rng = np.random.default_rng(seed)
    reduce = _slowest_tree_path(n, sigma, samples, rng)
    broadcast = _slowest_tree_path(n, sigma, samples, rng)
    return reduce + broadcast


def expected_max_of_n(workers: int, cv: float, samples: int = 2000, seed: int = 0) -> float:
    """Monte Carlo E[max of n i.i.d. message times] (one step of a ring all-reduce)."""
    n = check_workers(workers, minimum=1)
    sigma = cv_to_sigma(cv)
    if sigma == 0.0:
        return 1.0
    rng = np.random.default_rng(seed)
    total = 0.0
    for m in _chunks(samples, n):
        total += _messages(rng, sigma, (m, n)).max(axis=1).sum()
    return total / samples


def ring_allreduce_time(workers: int, cv: float, samples: int = 2000, seed: int = 0) -> float:
    """Expected ring all-reduce time: 2(n - 1) sequential steps, each the slowest of n messages."""
    n = check_workers(workers)
    return 2 * (n - 1) * expected_max_of_n(n, cv, samples, seed)


def pair_exchange_samples(cv: float, samples: int = 200_000, seed: int = 0) -> np.ndarray:
    """Monte Carlo draws of the pair-exchange time 2 * max(t1, t2) (to check the closed form)."""
    sigma = cv_to_sigma(cv)
    rng = np.random.default_rng(seed)
    return 2.0 * _messages(rng, sigma, (samples, 2)).max(axis=1)


@dataclass(frozen=True, kw_only=True)
class LatencyPoint:
    """One (workers, cv) point of Fig. 5A. Times are in units of the mean message time t_c."""

    workers: int
    cv: float
    sigma: float
    tree_seconds: float
    """E[tree all-reduce time], Monte Carlo."""
    ring_seconds: float
    """E[ring all-reduce time], Monte Carlo over one step times 2(n - 1)."""
    pair_seconds: float
    """E[pair exchange time] = 2 E[max(t1, t2)], closed form."""
    pair_seconds_mc: float
    """The same by Monte Carlo (agrees with the closed form within sampling error)."""
    tree_over_pair: float
    ring_over_pair: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def latency_point(workers: int, cv: float, samples: int = 2000, seed: int = 0) -> LatencyPoint:
    """Tree and ring all-reduce versus pair exchange at one (n, cv)."""
    n = check_workers(workers)
    cv = check_cv(cv)
    if samples < 1:
        raise NetsimError(f"samples must be >= 1, got {samples}")
    tree = float(tree_allreduce_samples(n, cv, samples, seed).mean())
    ring = ring_allreduce_time(n, cv, samples, seed + 1)
    pair = pair_exchange_time(cv)
    pair_mc = float(pair_exchange_samples(cv, max(samples, 20_000), seed + 2).mean())
    return LatencyPoint(
        workers=n,
        cv=cv,
        sigma=cv_to_sigma(cv),
        tree_seconds=tree,
        ring_seconds=ring,
        pair_seconds=pair,
        pair_seconds_mc=pair_mc,
        tree_over_pair=tree / pair,
        ring_over_pair=ring / pair,
    )


def latency_sweep(
    workers: list[int], cvs: list[float], samples: int = 2000, seed: int = 0
) -> list[LatencyPoint]:
    """Every (n, cv) combination, n outer; the seed is shared so points are reproducible."""
    for n in workers:
        check_workers(n)
    for cv in cvs:
        check_cv(cv)
    return [latency_point(n, cv, samples, seed) for n in workers for cv in cvs]
