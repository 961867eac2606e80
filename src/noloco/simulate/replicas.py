"""N replicas of one model as a batch dimension: stacked weights, one batched step.

Every parameter of the model becomes one tensor of shape ``(N, *shape)`` (row r: replica r's
weights). The unchanged model of :mod:`noloco.model` (or a Hugging Face one) runs through
``torch.func.functional_call`` under ``torch.func.vmap``, so one call computes every replica's
loss on its own batch; the backward pass of their sum gives every replica the gradient of its
own loss alone (replica r's loss depends on row r only). What a distributed replica does
elementwise is done on the stacks as they are:

- AdamW (``torch.optim.AdamW`` over the stacks): elementwise, so row r takes replica r's
  step exactly;
- the gradient clip: per row, ``torch.nn.utils.clip_grad_norm_``'s own formula (the norm
  of the per-parameter norms, the coefficient clamped at 1);
- DDP's gradient mean: the mean over the rows.

A method's per-replica view of the weights (:meth:`StackedReplicas.named_views`) is rows of
the stacks: what a method writes into them (an outer step's θ ← φ) is the stacks' content.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from noloco.model import lm_loss

# vmap has no batching rule for CPU flash attention and falls back to a loop over the
# replicas for that one operation: the same numbers, said once per process by torch.
warnings.filterwarnings("ignore", message="There is a performance drop because we have not "
                        "yet implemented the batching rule")


class StackedReplicas:
    """The N replicas' weights, stacked (module docstring). ``model`` holds the identical
    starting weights every replica of a distributed run builds from the same seed."""

    def __init__(self, model: nn.Module, replicas: int) -> None:
        self.model, self.n = model, replicas
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        with torch.no_grad():
            self.params = [p.detach().unsqueeze(0).repeat(replicas, *([1] * p.dim()))
                           .requires_grad_(p.requires_grad) for _, p in named]
        # the template's own weights are never read again: the stacks replace them
        for _, p in named:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.buffers = {name: b for name, b in model.named_buffers()}

        def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
                 ) -> torch.Tensor:
            return lm_loss(functional_call(model, (params, self.buffers), (x,)), y)

        self._loss = vmap(loss)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.params, strict=True))

    def named_views(self, replica: int) -> list[tuple[str, torch.Tensor]]:
        """Replica ``replica``'s weights as views of the stacks, in model order."""
        return [(name, p[replica]) for name, p in zip(self.names, self.params, strict=True)]

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Every replica's loss on its own batch: ``x``, ``y`` of shape (N, B, T)."""
        return self._loss(self.as_dict(), x, y)

    @torch.no_grad()
    def mean_gradients(self) -> None:
        """Every replica's gradient becomes the mean over the replicas (DDP)."""
        for p in self.params:
            if p.grad is not None:
                p.grad.copy_(p.grad.mean(0, keepdim=True).expand_as(p.grad))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Each replica's gradient clipped to ``max_norm`` by its own norm, as
        ``torch.nn.utils.clip_grad_norm_`` does it on one replica; the N norms before
        clipping."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(self.n)
        # Row by row: a norm along a dimension sums in another order than the norm of one
        # contiguous tensor, and a clip coefficient one ulp off changes every weight.
        total = torch.stack([
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g[r]) for g in grads]))
            for r in range(self.n)])
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))
        return total

    @torch.no_grad()
    def eval_losses(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Every replica's validation loss over ``batches`` (the same for all), weighted by
        sequences, summed as a distributed replica sums it."""
        self.model.eval()
        totals = [0.0] * self.n
        for x, y in batches:
            got = self.losses(x.expand(self.n, *x.shape), y.expand(self.n, *y.shape)).tolist()
            for r, v in enumerate(got):
                totals[r] += v * len(x)
        self.model.train()
        count = sum(len(x) for x, _ in batches)
        return [v / count for v in totals]

    @torch.no_grad()
    def weight_spread(self) -> float:
        """sqrt( Σ (p − mean over replicas)² / (#params · N) ), as
        :func:`noloco.metrics.weight_spread` reports it for a distributed run."""
        if self.n == 1:
            return 0.0
        total, count = 0.0, 0
        for p in self.params:
            x = p.detach().double()
            total += float(((x - x.mean(0, keepdim=True)) ** 2).sum())
            count += p[0].numel()
        return (total / (count * self.n)) ** 0.5

    def state_numel(self) -> dict[str, Any]:
        return {"per_replica": sum(p[0].numel() for p in self.params)}
