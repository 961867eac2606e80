"""Streaming DiLoCo (Douillard et al., 2025; SPEC §4): DiLoCo, one fragment at a time.

Three changes to DiLoCo (:mod:`noloco.methods.diloco`), each optional, all carried out by the
engine (:mod:`noloco.methods.engine`):

Fragments
    The transformer blocks are split into P fragments: ``strided`` (the default, the
    paper's) puts block k in fragment k mod P, ``sequential`` gives each a contiguous run.
    The embedding goes with block 0's fragment, the final norm and output head with the last
    block's. Fragment p has offset t_p = p·H/P and is synchronised after inner step t
    whenever t ≥ t_p and (t − t_p) mod H == 0, so fragment p > 0 has its first sync after
    only t_p steps and then one every H; at most one fragment starts per step and the peak
    bytes of a step drop by about P×. Every fragment has its own φ_p and outer momentum.
Overlap
    The all-reduce of fragment p starts after step t without blocking (gloo runs it on its
    own threads) and is waited for after step t + τ, while the inner steps keep computing.
    The outer optimizer is then applied to φ_p with the outer gradient of step t, giving θ̃_p,
    and the fragment's fast weights, τ local steps further on, are merged:
    θ_p ← α·θ_p + (1 − α)·θ̃_p. With τ = 0 there is nothing local to keep and θ_p ← θ̃_p
    whatever α, so P = 1, τ = 0 without quantisation is exactly DiLoCo.
Quantisation
    Quantised, every replica's outer gradient φ_p − θ_p travels instead of θ_p, through the
    communicator's reduce-scatter / all-gather on encoded bytes
    (:meth:`noloco.comm.Communicator.all_reduce_mean_quantized_async`): about
    2·(N−1)/N·(S_p/8 + scales) bytes per replica for FP4 (E3M0), summed in fp32.
Compression (``compress``, instead of quantisation)
    Each fragment's outer gradient goes through its own error-feedback buffer and is sent as
    a chunk-wise top-k, all-gathered (DiLoCo's compressed exchange, :mod:`noloco.methods.
    diloco`).

Paper symbol → argument: H → ``sync_every``; P → ``fragments``; τ → ``overlap_steps``;
α (merge) → ``merge_alpha``; outer lr → ``outer_lr``; outer momentum → ``momentum``
(Nesterov with ``nesterov=True``, as DiLoCo); E3M0 4-bit → ``quantize="fp4"``.

Invariant: every replica runs the same schedule, so the fragments' collectives are issued in
the same order on every rank; with τ < H/P at most one is in flight at any time.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

from typing import Any

import torch

from noloco.comm import Communicator
from noloco.guard import UpdateGuard
from noloco.methods.diloco import DiLoCo
from noloco.methods.engine import FragmentSchedule, ModelLike, Sync, merge, split_model

__all__ = ["FragmentSchedule", "StreamingDiLoCo", "Sync", "merge", "split_model"]


class StreamingDiLoCo(DiLoCo):
    name = "streaming"

    def __init__(self, model_or_named_params: ModelLike, comm: Communicator, *,
                 n_layers: int | None = None, sync_every: int = 100, fragments: int = 1,
                 fragment_pattern: str = "strided", overlap_steps: int = 0,
                 merge_alpha: float = 0.5, quantize: str = "none", outer_lr: float = 0.7,
                 momentum: float = 0.9, nesterov: bool = True, compress: str | None = None,
                 ef_decay: float = 1.0, guard: UpdateGuard | None = None) -> None:
        super().__init__(model_or_named_params, comm, sync_every=sync_every,
                         outer_lr=outer_lr, momentum=momentum, nesterov=nesterov,
                         compress=compress, ef_decay=ef_decay,
                         fragments=fragments, fragment_pattern=fragment_pattern,
                         overlap_steps=overlap_steps, merge_alpha=merge_alpha,
                         quantize=quantize, n_layers=n_layers, guard=guard)

    @property
    def slow(self) -> list[list[torch.Tensor]]:  # type: ignore[override]
        """φ, per fragment."""
        return [f.phi for f in self.frags]

    def report(self) -> dict[str, Any]:
        """Extra fields for the run's summary.json. Collective: every replica calls it.

        ``sync_wait_last_arrival_seconds`` sums, over the syncs, the shortest wait of any
        replica: the replica that reached a sync last waited for no straggler, only for the
        communication itself, so this is the blocking the transfer caused (what overlap
        can hide), apart from waiting on slower replicas (which it cannot).
        """
        out = {**super().report(), "fragment_syncs": self.fragment_syncs}
        waits = torch.tensor(self.wait_seconds, dtype=torch.float64)
        if self.comm.size > 1 and waits.numel():
            with self.comm.uncounted():  # metrics traffic, not training traffic
                rows = torch.stack(self.comm.all_gather(waits))
        else:
            rows = waits[None]
        out["sync_wait_mean_seconds"] = float(rows.mean(0).sum()) if waits.numel() else 0.0
        out["sync_wait_last_arrival_seconds"] = (float(rows.min(0).values.sum())
                                                 if waits.numel() else 0.0)
        return out
