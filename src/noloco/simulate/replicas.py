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
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode

from noloco.model import lm_loss

# (what vmap would say of attention without _ReplicasAsBatch: see there)
warnings.filterwarnings("ignore", message="There is a performance drop because we have not "
                        "yet implemented the batching rule")


class _FlatAttention(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` (causal, no mask, no dropout: the training and
    evaluation forward) whose vmap rule folds the replica dimension into the batch dimension.

    vmap has no batching rule for the CPU flash-attention kernel and falls back to a loop
    over the replicas whose backward zero-fills a full-size gradient per replica: work that
    grows as N², the larger part of a step beyond 64 replicas. Folded, the kernel sees one
    batch of N·B sequences and computes each (sequence, head) as it does alone, so every
    replica's numbers stay its own. The backward recomputes the forward (one attention
    forward more) and differentiates the same kernel."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            qkv = [x.detach().requires_grad_() for x in ctx.saved_tensors]
            out = F.scaled_dot_product_attention(*qkv, is_causal=True)
            return torch.autograd.grad(out, qkv, grad)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, int]:
        n = info.batch_size
        q, k, v = (x.movedim(d, 0) if d is not None else x.expand(n, *x.shape)
                   for x, d in zip((q, k, v), in_dims, strict=True))
        out = _FlatAttention.apply(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1))
        return out.unflatten(0, (n, q.shape[1])), 0


class _ReplicasAsBatch(TorchFunctionMode):
    """Inside it, the model's causal attention goes through :class:`_FlatAttention`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if (func is F.scaled_dot_product_attention and len(args) == 3
                and kwargs.get("is_causal") and kwargs.get("attn_mask") is None
                and not kwargs.get("dropout_p") and kwargs.get("scale") is None
                and set(kwargs) <= {"is_causal", "attn_mask", "dropout_p", "scale"}):
            return _FlatAttention.apply(*args)
        return func(*args, **kwargs)


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
        with _ReplicasAsBatch():
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
    def weight_spread(self, rows: list[int] | None = None) -> float:
        """sqrt( Σ (p − mean over replicas)² / (#params · N) ), as
        :func:`noloco.metrics.weight_spread` reports it for a distributed run; over
        ``rows`` only when given (the replicas in the run)."""
        n = self.n if rows is None else len(rows)
        if n <= 1:
            return 0.0
        total, count = 0.0, 0
        for p in self.params:
            x = p.detach().double() if rows is None else p.detach()[rows].double()
            total += float(((x - x.mean(0, keepdim=True)) ** 2).sum())
            count += p[0].numel()
        return (total / (count * n)) ** 0.5
