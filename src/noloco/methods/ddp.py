"""Synchronous data parallel (SPEC §1), the baseline every claim is measured against.

After every backward pass the gradients of all N replicas are averaged (one all-reduce of
the flattened gradients, S bytes, per inner step), so every replica takes the same optimizer
step and the replicas never drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from noloco.comm import Communicator, flatten, unflatten_into
from noloco.methods.base import Method


class DDP(Method):
    name = "ddp"

    def __init__(self, model: nn.Module | Iterable[torch.Tensor], comm: Communicator) -> None:
        super().__init__(model, comm)

    def sync_gradients(self) -> None:
        if self.comm.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        # One bucket for the whole model: every rank flattens in the same parameter order,
        # so slice k means the same parameter everywhere.
        flat = flatten(grads, torch.float32)
        self.comm.all_reduce_mean(flat)
        for p, g in zip(self.params, grads, strict=True):
            if p.grad is None:
                p.grad = g
        unflatten_into(flat, [p.grad for p in self.params])
