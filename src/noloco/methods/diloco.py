"""DiLoCo (Douillard et al., 2023; SPEC §2).

Every replica starts from the same slow weights φ, takes H inner (AdamW) steps on its own
data, then all replicas average their fast weights θ and take one outer SGD step on φ with
the outer gradient g = φ − mean_i(θ_i). Inner optimizer states stay local.

Paper symbol → argument:
- H → ``sync_every`` (inner steps between outer steps)
- outer learning rate (0.7) → ``outer_lr``
- outer momentum μ (0.9) → ``momentum``; ``nesterov=True`` is the DiLoCo paper's Nesterov
  SGD, ``nesterov=False`` the heavy-ball form the NoLoCo paper used for its baseline:
  δ ← μ·δ + lr·(mean θ − φ); φ ← φ + δ.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from noloco.comm import Communicator, flatten, unflatten_into
from noloco.methods.base import Method


@torch.no_grad()
def outer_sgd_(slow: Sequence[torch.Tensor], mean_fast: Sequence[torch.Tensor],
               buf: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool) -> None:
    """One outer SGD step on φ (``slow``) with outer gradient g = φ − mean θ, in place.

    Heavy-ball keeps δ = −lr·(momentum buffer) so that it is literally the NoLoCo update with
    one group of all replicas (the equivalence NoLoCo's paper states, and our tests check).
    """
    for phi, theta, b in zip(slow, mean_fast, buf, strict=True):
        if nesterov:
            g = phi - theta
            b.mul_(momentum).add_(g)
            phi.sub_(lr * (g + momentum * b))
        else:
            b.mul_(momentum).add_(lr * (theta - phi))
            phi.add_(b)


class DiLoCo(Method):
    name = "diloco"

    def __init__(self, model: nn.Module | Iterable[torch.Tensor], comm: Communicator, *,
                 sync_every: int = 100, outer_lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True) -> None:
        super().__init__(model, comm)
        if sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {sync_every}")
        if outer_lr < 0 or momentum < 0:
            raise ValueError("outer_lr and momentum must be non-negative")
        self.H, self.outer_lr, self.momentum, self.nesterov = (
            sync_every, outer_lr, momentum, nesterov)
        # φ in fp32 whatever the training dtype: the outer step adds small deltas.
        self.slow = [p.detach().clone().float() for p in self.params]
        self.buf = [torch.zeros_like(s) for s in self.slow]

    @property
    def sync_every(self) -> int:
        return self.H

    def after_inner_step(self) -> None:
        super().after_inner_step()
        if self.inner_steps % self.H == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        flat = flatten(self.params, torch.float32)
        self.comm.all_reduce_mean(flat)
        mean_fast = [torch.empty_like(s) for s in self.slow]
        unflatten_into(flat, mean_fast)
        outer_sgd_(self.slow, mean_fast, self.buf, self.outer_lr, self.momentum, self.nesterov)
        for p, s in zip(self.params, self.slow, strict=True):
            p.copy_(s)
        self.outer_steps += 1

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd.update(slow=self.slow, buf=self.buf)  # live tensors, as torch.optim's state_dict
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        for dst, src in zip(self.slow + self.buf, sd["slow"] + sd["buf"], strict=True):
            dst.copy_(src)
