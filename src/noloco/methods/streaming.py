"""Streaming DiLoCo (Douillard et al., 2025; SPEC §4): DiLoCo, one fragment at a time.

Three changes to DiLoCo (:mod:`noloco.methods.diloco`), each optional:

Fragments
    The transformer blocks are split into P fragments by :func:`noloco.split.fragment_parameters`:
    ``strided`` (the default, the paper's) puts block k in fragment k mod P, ``sequential``
    gives each fragment a contiguous run of blocks. The parameters outside the blocks go with
    the fragment of their nearest block: the input embedding with block 0's fragment, the
    final norm and the output head with the last block's. Fragment p has offset
    t_p = p·H/P and is synchronised after inner step t whenever t ≥ t_p and
    (t − t_p) mod H == 0, so fragment p > 0 has its first sync after only t_p steps and
    then one every H; at most one fragment starts per step and the peak bytes of a step drop
    by about P×. Every fragment keeps its own slow weights φ_p and its own outer momentum.

Overlap
    The all-reduce of fragment p starts after step t without blocking (gloo runs it on its own
    threads) and is waited for after step t + τ, while the inner steps keep computing. The
    outer optimizer is then applied to φ_p with the outer gradient of step t, giving θ̃_p, and
    the fragment's fast weights, which took τ more local steps meanwhile, are merged:
    θ_p ← α·θ_p + (1 − α)·θ̃_p. With τ = 0 there is nothing local to keep and θ_p ← θ̃_p
    whatever α, so P = 1, τ = 0 without quantisation is exactly DiLoCo.

Quantisation
    Unquantised, the fast weights θ_p travel (fp32, as DiLoCo). Quantised, every replica's
    outer gradient φ_p − θ_p travels instead (a small delta suits the quantiser's block
    scale; weights would not), through the communicator's reduce-scatter / all-gather on
    encoded bytes (:meth:`noloco.comm.Communicator.all_reduce_mean_quantized_async`): about
    2·(N−1)/N·(S_p/8 + scales) bytes per replica for FP4, summed in fp32. Every replica
    decodes the same bytes, so the slow weights stay identical on all replicas.

Paper symbol → argument: H → ``sync_every``; P → ``fragments``; τ → ``overlap_steps``;
α (merge) → ``merge_alpha``; outer lr → ``outer_lr``; outer momentum → ``momentum``
(Nesterov with ``nesterov=True``, as DiLoCo); E3M0 4-bit → ``quantize="fp4"``.

Invariant: every replica runs the same schedule, so the fragments' collectives are issued in
the same order on every rank; with τ < H/P at most one is in flight at any time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from noloco.comm import Communicator, Pending, flatten, unflatten_into
from noloco.methods.base import Method
from noloco.methods.diloco import outer_sgd_
from noloco.quant import FORMATS
from noloco.split import block_index, fragment_parameters

ModelLike = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def split_model(model: ModelLike, fragments: int = 1, pattern: str = "strided",
                n_layers: int | None = None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The parameters (model order) and, per fragment, the indices of its parameters.

    ``model`` is a module, its ``named_parameters()`` (a pipeline stage passes its own, named
    as in the whole model) or plain tensors (one fragment only: fragments need names).
    ``n_layers`` defaults to the highest block index found in the names, plus one.
    """
    items = list(model.named_parameters()) if isinstance(model, nn.Module) else list(model)
    if not items:
        raise ValueError("the model has no parameters")
    named = all(isinstance(x, tuple) and len(x) == 2 for x in items)
    params = [x[1] for x in items] if named else items
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if fragments == 1:
        return params, [list(range(len(params)))]
    if not named:
        raise ValueError("fragments > 1 need named parameters (model.named_parameters())")
    if n_layers is None:
        blocks = [b for name, _ in items if (b := block_index(name)) is not None]
        if not blocks:
            raise ValueError("no transformer blocks (names 'layers.K.') to fragment")
        n_layers = max(blocks) + 1
    index = {id(p): i for i, p in enumerate(params)}
    groups = fragment_parameters(items, n_layers, fragments, pattern)
    return params, [[index[id(p)] for p in g] for g in groups]


@dataclass(frozen=True)
class FragmentSchedule:
    """When fragment p's sync starts (after inner step t, counted from 1) and completes."""

    sync_every: int
    """H"""
    fragments: int = 1
    """P"""
    overlap_steps: int = 0
    """τ"""

    def __post_init__(self) -> None:
        H, P, tau = self.sync_every, self.fragments, self.overlap_steps
        if H < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {H}")
        if not 1 <= P <= H or H % P:
            raise ValueError(f"sync_every (H) {H} must be divisible by fragments (P) {P}")
        if not 0 <= tau < H // P:
            raise ValueError(f"overlap_steps (tau) must satisfy 0 <= tau < H/P = {H // P}, "
                             f"got {tau}")

    def offset(self, fragment: int) -> int:
        """t_p = p·H/P."""
        return fragment * self.sync_every // self.fragments

    def starting(self, t: int) -> list[int]:
        """Fragments whose sync starts after inner step ``t``: (t − t_p) mod H == 0, t ≥ t_p."""
        return [p for p in range(self.fragments)
                if t >= max(self.offset(p), 1) and (t - self.offset(p)) % self.sync_every == 0]

    def completing(self, t: int) -> list[int]:
        """Fragments whose sync is applied after inner step ``t`` (started at t − τ)."""
        return self.starting(t - self.overlap_steps) if t - self.overlap_steps >= 1 else []


@dataclass
class InFlight:
    """One fragment's synchronisation between its start and its application."""

    fragment: int
    due: int
    """inner step after which it is applied"""
    payload: torch.Tensor
    """what was sent; the mean lands here"""
    pending: Pending
    extra: Any = None


class StreamingDiLoCo(Method):
    name = "streaming"

    def __init__(self, model_or_named_params: ModelLike, comm: Communicator, *,
                 n_layers: int | None = None, sync_every: int = 100, fragments: int = 1,
                 fragment_pattern: str = "strided", overlap_steps: int = 0,
                 merge_alpha: float = 0.5, quantize: str = "none", outer_lr: float = 0.7,
                 momentum: float = 0.9, nesterov: bool = True) -> None:
        params, frag_index = split_model(model_or_named_params, fragments, fragment_pattern,
                                         n_layers)
        super().__init__(params, comm)
        self.schedule = FragmentSchedule(sync_every, fragments, overlap_steps)
        if not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge_alpha must lie in [0, 1], got {merge_alpha}")
        if quantize not in FORMATS:
            raise ValueError(f"unknown quantisation format {quantize!r}; expected one of "
                             f"{FORMATS}")
        if outer_lr < 0 or momentum < 0:
            raise ValueError("outer_lr and momentum must be non-negative")
        self.H, self.P, self.tau = sync_every, fragments, overlap_steps
        self.merge_alpha, self.quantize = merge_alpha, quantize
        self.outer_lr, self.momentum, self.nesterov = outer_lr, momentum, nesterov
        self.fragment_index = frag_index
        self.fragments = [[self.params[i] for i in idx] for idx in frag_index]
        # φ_p in fp32 and the outer momentum, per fragment.
        self.slow = [[p.detach().clone().float() for p in f] for f in self.fragments]
        self.buf = [[torch.zeros_like(s) for s in f] for f in self.slow]
        self.inflight: list[InFlight] = []
        self.fragment_syncs = [0] * fragments
        self.wait_seconds: list[float] = []
        """seconds blocked in each sync's wait, in application order"""

    @property
    def sync_every(self) -> int:
        return self.H

    def fragment_numel(self) -> list[int]:
        return [sum(p.numel() for p in f) for f in self.fragments]

    def after_inner_step(self) -> None:
        super().after_inner_step()
        t = self.inner_steps
        self._apply_due(t)
        for p in self.schedule.starting(t):
            self._start(p, t)
        self._apply_due(t)  # τ = 0: a sync started now is applied now

    def finish(self) -> None:
        """Wait for and apply every sync still in flight (the run's last τ steps)."""
        self._apply_due(None)

    # ---- one fragment ----------------------------------------------------------------------
    @torch.no_grad()
    def _start(self, p: int, t: int) -> None:
        if not self.fragments[p]:  # a pipeline stage may hold no block of fragment p
            return
        if self.quantize == "none":
            payload = flatten(self.fragments[p], torch.float32)
            pending = self.comm.all_reduce_mean_async(payload)
        else:
            payload = flatten(self.slow[p]) - flatten(self.fragments[p], torch.float32)
            pending = self.comm.all_reduce_mean_quantized_async(payload, self.quantize)
        self.inflight.append(InFlight(p, t + self.tau, payload, pending))

    def _apply_due(self, t: int | None) -> None:
        # In start order: the order every rank issued the collectives in.
        while self.inflight and (t is None or self.inflight[0].due <= t):
            self._apply(self.inflight.pop(0))

    @torch.no_grad()
    def _apply(self, job: InFlight) -> None:
        t0 = time.perf_counter()
        job.pending.wait()
        self.wait_seconds.append(time.perf_counter() - t0)
        p = job.fragment
        slow = self.slow[p]
        mean_fast = [torch.empty_like(s) for s in slow]
        unflatten_into(job.payload, mean_fast)
        if self.quantize != "none":  # the payload is the mean outer gradient φ − θ
            for m, s in zip(mean_fast, slow, strict=True):
                torch.sub(s, m, out=m)
        outer_sgd_(slow, mean_fast, self.buf[p], self.outer_lr, self.momentum, self.nesterov)
        merge(self.fragments[p], slow, self.merge_alpha if self.tau > 0 else 0.0)
        self.fragment_syncs[p] += 1
        self.outer_steps += 1

    # ---- bookkeeping -----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Extra fields for the run's summary.json. Collective: every replica calls it.

        ``sync_wait_last_arrival_seconds`` sums, over the syncs, the shortest wait of any
        replica: the replica that reached a sync last waited for no straggler, only for the
        communication itself, so this is the blocking the transfer caused (what overlap
        can hide), apart from waiting on slower replicas (which it cannot).
        """
        out: dict[str, Any] = {
            "fragments": self.P, "fragment_numel": self.fragment_numel(),
            "overlap_steps": self.tau, "merge_alpha": self.merge_alpha,
            "quantize": self.quantize, "fragment_syncs": list(self.fragment_syncs)}
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

    def state_dict(self) -> dict[str, Any]:
        """Slow weights and momenta per fragment; a sync in flight is completed (waited for,
        every rank at the same step) and its received mean saved, to be applied on time.
        Tensors are the live ones (as ``torch.optim``'s): copy them to keep a snapshot."""
        sd = super().state_dict()
        for job in self.inflight:
            job.pending.wait()
        sd.update(slow=self.slow, buf=self.buf, fragment_syncs=list(self.fragment_syncs),
                  inflight=[(j.fragment, j.due, j.payload) for j in self.inflight],
                  wait_seconds=list(self.wait_seconds))
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        for dst, src in zip(self.slow + self.buf, sd["slow"] + sd["buf"], strict=True):
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
        self.fragment_syncs = list(sd["fragment_syncs"])
        self.wait_seconds = list(sd.get("wait_seconds", []))
        dev = self.params[0].device  # a checkpoint is read into CPU memory
        self.inflight = [InFlight(p, due, payload.to(dev, copy=True), Pending(self.comm, []))
                         for p, due, payload in sd["inflight"]]


@torch.no_grad()
def merge(fast: Sequence[torch.Tensor], synced: Sequence[torch.Tensor], alpha: float) -> None:
    """θ ← α·θ + (1 − α)·θ̃ in place (α = 0: θ ← θ̃ exactly)."""
    for p, s in zip(fast, synced, strict=True):
        if alpha == 0.0:
            p.copy_(s)
        else:
            p.copy_(alpha * p.float() + (1 - alpha) * s)
