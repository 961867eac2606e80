"""NoLoCo (Kolehmainen et al., 2025; SPEC §3): no all-reduce at all.

Every H inner steps each replica averages with a small random group G instead of with all
replicas, through a modified momentum update that also pulls the slow weights together:

    Δ_i = θ_i − φ_i
    δ_i ← α·δ_i + β·mean_{j∈G}(Δ_j) − γ·(φ_i − mean_{j∈G}(φ_j))
    φ_i ← φ_i + δ_i ;   θ_i ← φ_i

(+β, as in the paper's appendix and reference code.) With γ = β this is
δ_i ← α·δ_i + β·(mean_G θ − φ_i): only the fast weights θ travel, S bytes each way. With
γ ≠ β the slow weights travel too. The momentum δ and the inner optimizer state are local:
never exchanged, never reset when the partner changes.

Groups: at outer step t every replica draws the same permutation of 0..N−1 from a seed made
of (seed, t) — no coordination — and cuts it into N/n groups; group k is perm[k], perm[k + N/n],
..., so for n = 2 replica perm[j] pairs with perm[j + N/2] as in the reference code.

Paper symbol → argument: H → ``sync_every``; n → ``group_size``; α → ``momentum``
(default 0.5); β → ``outer_lr`` (0.7); γ → ``gamma`` (default β).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from noloco.comm import Communicator, flatten, unflatten_into
from noloco.methods.base import Method


def groups_at(outer_step: int, replicas: int, group_size: int, seed: int = 0
              ) -> list[list[int]]:
    """The groups of outer step ``outer_step``: identical on every rank that calls it."""
    if replicas % group_size:
        raise ValueError(f"{replicas} replicas are not divisible by group size {group_size}")
    rng = np.random.default_rng([seed, outer_step, 0x6E6F6C6F])
    perm = rng.permutation(replicas)
    k = replicas // group_size
    return [sorted(int(perm[g + j * k]) for j in range(group_size)) for g in range(k)]


def stability_bounds(alpha: float, group_size: int) -> tuple[float, float]:
    """γ interval inside which the replicas' weight spread stays bounded (SPEC §3, paper
    appendix, quadratic model): √(n/(2(n−1)))·α < γ < √(n(2+α²)/(2(n−1)))."""
    n = group_size
    return (math.sqrt(n / (2 * (n - 1))) * alpha, math.sqrt(n * (2 + alpha**2) / (2 * (n - 1))))


class NoLoCo(Method):
    name = "noloco"

    def __init__(self, model: nn.Module | Iterable[torch.Tensor], comm: Communicator, *,
                 sync_every: int = 50, outer_lr: float = 0.7, momentum: float = 0.5,
                 gamma: float | None = None, group_size: int = 2, seed: int = 0) -> None:
        super().__init__(model, comm)
        n_rep = comm.size
        if sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {sync_every}")
        if group_size < 2 and n_rep > 1:
            raise ValueError(f"group_size must be >= 2, got {group_size}")
        group_size = min(group_size, n_rep) if n_rep == 1 else group_size
        if group_size > n_rep:
            raise ValueError(f"group size {group_size} is larger than {n_rep} replicas")
        if n_rep % group_size:
            raise ValueError(f"{n_rep} replicas are not divisible by group size {group_size}")
        self.H, self.beta, self.alpha = sync_every, outer_lr, momentum
        self.gamma = outer_lr if gamma is None else gamma
        self.group_size, self.seed = group_size, seed
        lo, hi = stability_bounds(self.alpha, max(group_size, 2))
        if not lo < self.gamma < hi:
            warnings.warn(
                f"gamma {self.gamma:g} is outside the stability interval ({lo:.3f}, {hi:.3f}) "
                f"for alpha {self.alpha:g} and group size {group_size}: replicas may drift apart",
                stacklevel=2,
            )
        self.slow = [p.detach().clone().float() for p in self.params]  # φ_i
        self.delta = [torch.zeros_like(s) for s in self.slow]  # δ_i
        self.last_group: list[int] = []

    @property
    def sync_every(self) -> int:
        return self.H

    @property
    def exchanges_slow_weights(self) -> bool:
        return self.gamma != self.beta

    def after_inner_step(self) -> None:
        super().after_inner_step()
        if self.inner_steps % self.H == 0:
            self.outer_step()

    def my_group(self) -> list[int]:
        groups = groups_at(self.outer_steps, self.comm.size, self.group_size, self.seed)
        return next(g for g in groups if self.comm.rank in g)

    @torch.no_grad()
    def outer_step(self) -> None:
        group = self.my_group() if self.comm.size > 1 else [0]
        peers = [r for r in group if r != self.comm.rank]
        fast = flatten(self.params, torch.float32)
        payload = torch.cat([fast, flatten(self.slow)]) if self.exchanges_slow_weights else fast
        received = dict(zip(peers, self.comm.exchange(payload, peers), strict=True))
        received[self.comm.rank] = payload
        # Sum in group order, so every member of G computes bit-identical means.
        mean = torch.stack([received[r] for r in group]).mean(0)
        self._update(mean, fast.numel())
        self.last_group = group
        self.outer_steps += 1

    def _update(self, mean: torch.Tensor, n_fast: int) -> None:
        mean_fast = [torch.empty_like(s) for s in self.slow]
        unflatten_into(mean[:n_fast], mean_fast)
        if self.exchanges_slow_weights:
            mean_slow = [torch.empty_like(s) for s in self.slow]
            unflatten_into(mean[n_fast:], mean_slow)
        for i, (phi, d, mt) in enumerate(zip(self.slow, self.delta, mean_fast, strict=True)):
            if self.exchanges_slow_weights:
                ms = mean_slow[i]
                d.mul_(self.alpha).add_(self.beta * (mt - ms)).sub_(self.gamma * (phi - ms))
            else:
                d.mul_(self.alpha).add_(self.beta * (mt - phi))
            phi.add_(d)
        for p, s in zip(self.params, self.slow, strict=True):
            p.copy_(s)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd.update(slow=[s.clone() for s in self.slow], delta=[d.clone() for d in self.delta])
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        for dst, src in zip(self.slow + self.delta, sd["slow"] + sd["delta"], strict=True):
            dst.copy_(src)
