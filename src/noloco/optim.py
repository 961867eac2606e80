"""The inner optimizer: AdamW, or Muon for the hidden matrices with AdamW for the rest.

``--inner-optimizer muon`` follows MuLoCo (arXiv 2505.23725): the 2-D weight matrices inside the
transformer blocks (attention and MLP projections) step with torch's own ``torch.optim.Muon``
(momentum, then Newton–Schulz orthogonalisation of the update); embeddings, the output head,
norms and biases keep AdamW, as Muon is not meant for them. Muon's learning rate is adjusted
to match AdamW's update size (``adjust_lr_fn="match_rms_adamw"``), so one ``--lr`` and one
schedule drive both. Every method (DDP, DiLoCo, NoLoCo, Streaming) sees only "the inner
optimizer": the outer steps do not change.

:class:`Inner` keeps the training loop's view of a single optimizer: ``param_groups`` (the
schedule sets their ``lr``), ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict``
(checkpoints, state transfers) and :meth:`Inner.reset` (a guarded restart).

Floor 1 of docs/architecture.md: a run's description.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from noloco.config import INNER_OPTIMIZERS as INNER_OPTIMIZERS  # re-exported

MUON_MOMENTUM = 0.95


def muon_eligible(name: str, p: torch.Tensor) -> bool:
    """A hidden matrix: 2-D, inside a transformer block (not the embedding, not the head)."""
    return p.ndim == 2 and (".layers." in f".{name}" or name.startswith("layers."))


class Inner:
    """One or two torch optimizers behind one interface (module docstring)."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer], kind: str) -> None:
        self.parts = list(parts)
        self.kind = kind

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.parts for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.parts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    def reset(self) -> None:
        """Forget every moment (the weights' own update was bad: the guard restarts them)."""
        for opt in self.parts:
            opt.state.clear()

    def state_dict(self) -> dict[str, Any]:
        if self.kind == "adamw":  # the plain AdamW state, as checkpoints always held it
            return self.parts[0].state_dict()
        return {"kind": self.kind, "parts": [opt.state_dict() for opt in self.parts]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        kind = sd.get("kind", "adamw") if isinstance(sd, dict) else "adamw"
        if kind != self.kind:
            raise ValueError(f"the optimizer state is {kind}'s, this run's inner optimizer is "
                             f"{self.kind}")
        if self.kind == "adamw":
            self.parts[0].load_state_dict(sd)
            return
        for opt, part in zip(self.parts, sd["parts"], strict=True):
            opt.load_state_dict(part)


def build_inner(named: Sequence[tuple[str, torch.Tensor]], kind: str, lr: float,
                betas: tuple[float, float], weight_decay: float) -> Inner:
    """The inner optimizer over ``named`` parameters (in the order given)."""
    params = [p for _, p in named]
    if kind == "adamw":
        return Inner([torch.optim.AdamW(params, lr=lr, betas=betas,
                                        weight_decay=weight_decay)], kind)
    if kind != "muon":
        raise ValueError(f"unknown inner optimizer {kind!r}")
    matrices = [p for n, p in named if muon_eligible(n, p)]
    rest = [p for n, p in named if not muon_eligible(n, p)]
    parts: list[torch.optim.Optimizer] = []
    if matrices:
        parts.append(torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay,
                                      momentum=MUON_MOMENTUM, nesterov=True,
                                      adjust_lr_fn="match_rms_adamw"))
    if rest:
        parts.append(torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay))
    return Inner(parts, kind)
