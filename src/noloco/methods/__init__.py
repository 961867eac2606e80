"""The training methods, one module per paper. :func:`build_method` maps a config to one.

Floor 2 of docs/architecture.md: communication and the methods."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from noloco.comm import Communicator
from noloco.config import MethodConfig
from noloco.guard import UpdateGuard
from noloco.methods.base import Method, Single
from noloco.methods.ddp import DDP
from noloco.methods.diloco import DiLoCo
from noloco.methods.engine import FragmentSchedule, OuterSync
from noloco.methods.noloco import NoLoCo, groups_at, stability_bounds
from noloco.methods.sparseloco import SparseLoCo
from noloco.methods.streaming import StreamingDiLoCo

__all__ = ["DDP", "DiLoCo", "FragmentSchedule", "Method", "NoLoCo", "OuterSync", "Single",
           "SparseLoCo", "StreamingDiLoCo",
           "build_method", "groups_at", "stability_bounds"]


def build_method(cfg: MethodConfig,
                 model: nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 comm: Communicator, seed: int = 0, n_layers: int | None = None,
                 backward_passes: int = 1) -> Method:
    """The method a resolved config names, over this stage's replicas (``comm``).

    ``model`` may be a module, plain parameters, or ``(name, parameter)`` pairs named as in
    the whole model (what fragments need; ``n_layers`` is the whole model's block count).
    ``backward_passes``: per inner step (gradient accumulation).
    """
    guard = UpdateGuard(cfg.guard_factor) if cfg.update_guard else None
    if cfg.method == "streaming":
        return StreamingDiLoCo(
            model, comm, n_layers=n_layers, sync_every=cfg.sync_every,
            fragments=cfg.fragments, fragment_pattern=cfg.fragment_pattern,
            overlap_steps=cfg.overlap_steps, merge_alpha=cfg.merge_alpha,
            quantize=cfg.quantize, outer_lr=cfg.outer_lr, momentum=cfg.outer_momentum,
            nesterov=cfg.nesterov, compress=cfg.compress, ef_decay=_ef_decay(cfg), guard=guard)
    if cfg.method == "noloco":
        return NoLoCo(model, comm, sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                      momentum=cfg.outer_momentum, gamma=cfg.gamma, group_size=cfg.group_size,
                      seed=seed, n_layers=n_layers, fragments=cfg.fragments,
                      fragment_pattern=cfg.fragment_pattern, overlap_steps=cfg.overlap_steps,
                      merge_alpha=cfg.merge_alpha, quantize=cfg.quantize,
                      compress=cfg.compress, ef_decay=_ef_decay(cfg), guard=guard)
    if not isinstance(model, nn.Module):
        model = [x[1] if isinstance(x, tuple) else x for x in model]
    if cfg.method == "single":
        return Single(model, comm)
    if cfg.method == "ddp":
        # A pipeline stage runs backward once per microbatch, gradient accumulation once per
        # accumulated microbatch: no overlap with either (DDP's invariant).
        return DDP(model, comm, overlap=cfg.stages == 1 and backward_passes == 1)
    if cfg.method == "sparseloco":
        return SparseLoCo(model, comm, sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                          decay=_ef_decay(cfg), compress=cfg.compress or "topk:0.02:2",
                          guard=guard)
    if cfg.method == "diloco":
        return DiLoCo(model, comm, sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                      momentum=cfg.outer_momentum, nesterov=cfg.nesterov,
                      compress=cfg.compress, ef_decay=_ef_decay(cfg), guard=guard)
    raise ValueError(f"method {cfg.method!r} is not available")


def _ef_decay(cfg: MethodConfig) -> float:
    """The resolved --ef-decay (a config built by hand may leave it unset)."""
    if cfg.ef_decay is not None:
        return cfg.ef_decay
    return 0.95 if cfg.method == "sparseloco" else 1.0
