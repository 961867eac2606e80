"""The training methods, one module per paper. :func:`build_method` maps a config to one."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from noloco.comm import Communicator
from noloco.config import MethodConfig
from noloco.methods.base import Method, Single
from noloco.methods.ddp import DDP
from noloco.methods.diloco import DiLoCo
from noloco.methods.noloco import NoLoCo, groups_at, stability_bounds

__all__ = ["DDP", "DiLoCo", "Method", "NoLoCo", "Single", "build_method", "groups_at",
           "stability_bounds"]


def build_method(cfg: MethodConfig, model: nn.Module | Iterable[torch.Tensor],
                 comm: Communicator, seed: int = 0) -> Method:
    """The method a resolved config names, over this stage's replicas (``comm``)."""
    if cfg.method == "single":
        return Single(model, comm)
    if cfg.method == "ddp":
        return DDP(model, comm)
    if cfg.method == "diloco":
        return DiLoCo(model, comm, sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                      momentum=cfg.outer_momentum, nesterov=cfg.nesterov)
    if cfg.method == "noloco":
        return NoLoCo(model, comm, sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                      momentum=cfg.outer_momentum, gamma=cfg.gamma, group_size=cfg.group_size,
                      seed=seed)
    raise ValueError(f"method {cfg.method!r} is not available")
