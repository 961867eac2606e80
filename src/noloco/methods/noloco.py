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

Streaming NoLoCo (this project's extension: fragments, overlap and quantisation of Streaming
DiLoCo, :mod:`noloco.methods.streaming`, applied to gossip)

- Fragments (``fragments`` P, ``fragment_pattern``): the same split as Streaming DiLoCo.
  Fragment p runs its own NoLoCo outer step after inner step t when t ≥ t_p and
  (t − t_p) mod H == 0, t_p = p·H/P, with its own slow weights and momentum (the slices of
  φ_i and δ_i holding its parameters). Groups are drawn per exchange: the e-th fragment
  exchange of the run (counting all fragments, in schedule order, from 0) uses
  ``groups_at(e, N, n, seed)``, so every replica agrees without talking, and a fragment meets
  a fresh random partner each time. With P = 1, e is the outer step: plain NoLoCo.
- Overlap (``overlap_steps`` τ, ``merge_alpha``): the fragment's exchange with its group
  starts after step t (non-blocking point-to-point) and is applied after step t + τ: the
  update above uses the values sent at t, giving the new φ_p =: θ̃_p, and the fast weights,
  τ local steps further on, are merged θ_p ← α_m·θ_p + (1 − α_m)·θ̃_p (α_m = ``merge_alpha``;
  with τ = 0, θ_p ← θ̃_p). P = 1, τ = 0, no quantisation is plain NoLoCo exactly.
- Quantisation (``quantize`` fp4 / int8 / fp8). The update needs, from every member j of G,
  Δ_j = θ_j − φ_j and φ_j (with γ = β it needs θ_j = φ_j + Δ_j; in NoLoCo the slow weights
  of replicas differ, so Δ_j alone is not enough). Quantising θ_j or φ_j themselves is
  unsound (E3M0 keeps a power of two of the block maximum: a third of a weight's value can
  be lost). So a member sends two encoded parts:
    1. Δ_j in the chosen format — the outer delta, a small quantity, as in Streaming DiLoCo;
    2. φ_j − φ⁰ in int8 (:data:`SLOW_FORMAT`), where φ⁰ is the fragment's starting weights,
       bit-identical on every replica (SPEC §3), so the receiver adds it back for free. Its
       error is at most 1/254 of the block's largest drift since the start.
  Every member — the sender included — uses the *decoded* values Δ̂_j, φ̂_j = φ⁰ + deq(…):
      δ_i ← α·δ_i + β·mean_G(Δ̂_j) − γ·(φ̂_i − mean_G φ̂_j) ;  φ_i ← φ_i + δ_i
  so all members of G compute bit-identical means (decoded in group order), and the pull
  term sums to exactly zero over G: quantisation never moves the group's mean of φ (the
  gossip-averaging invariant), and members with equal φ get exactly zero pull. Bytes per
  member and fragment exchange of n values: (|G| − 1)·(wire(n, fmt) + wire(n, int8)) ≈
  (|G| − 1)·n·(0.5 + 1 + 8/256) for FP4, against (|G| − 1)·4n unquantised with γ = β
  (2.6× fewer) or (|G| − 1)·8n with γ ≠ β (5.2× fewer). Limitation: the φ part's error grows
  with the drift from the start; long runs would want a refreshed common reference.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

from noloco import quant
from noloco.comm import Communicator, Pending, flatten, unflatten_into
from noloco.methods.base import Method
from noloco.methods.streaming import FragmentSchedule, InFlight, ModelLike, merge, split_model

SLOW_FORMAT = "int8"
"""Encoding of the slow weights' drift φ − φ⁰ in quantised streaming NoLoCo."""


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

    def __init__(self, model: ModelLike, comm: Communicator, *,
                 sync_every: int = 50, outer_lr: float = 0.7, momentum: float = 0.5,
                 gamma: float | None = None, group_size: int = 2, seed: int = 0,
                 n_layers: int | None = None, fragments: int = 1,
                 fragment_pattern: str = "strided", overlap_steps: int = 0,
                 merge_alpha: float = 0.5, quantize: str = "none") -> None:
        params, frag_index = split_model(model, fragments, fragment_pattern, n_layers)
        super().__init__(params, comm)
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
        self.schedule = FragmentSchedule(sync_every, fragments, overlap_steps)
        if not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge_alpha must lie in [0, 1], got {merge_alpha}")
        if quantize not in quant.FORMATS:
            raise ValueError(f"unknown quantisation format {quantize!r}; expected one of "
                             f"{quant.FORMATS}")
        self.H, self.beta, self.alpha = sync_every, outer_lr, momentum
        self.gamma = outer_lr if gamma is None else gamma
        self.group_size, self.seed = group_size, seed
        self.P, self.tau, self.merge_alpha, self.quantize = (
            fragments, overlap_steps, merge_alpha, quantize)
        lo, hi = stability_bounds(self.alpha, max(group_size, 2))
        if not lo < self.gamma < hi:
            warnings.warn(
                f"gamma {self.gamma:g} is outside the stability interval ({lo:.3f}, {hi:.3f}) "
                f"for alpha {self.alpha:g} and group size {group_size}: replicas may drift apart",
                stacklevel=2,
            )
        self.slow = [p.detach().clone().float() for p in self.params]  # φ_i
        self.delta = [torch.zeros_like(s) for s in self.slow]  # δ_i
        self.fragment_index = frag_index
        # φ⁰, the common reference of the quantised slow-weight part (identical everywhere).
        self.start = [s.clone() for s in self.slow] if quantize != "none" else None
        self.exchanges = 0
        """fragment exchanges started so far (e); the next one's groups are groups_at(e)"""
        self.inflight: list[InFlight] = []
        self.last_group: list[int] = []

    @property
    def sync_every(self) -> int:
        return self.H

    @property
    def exchanges_slow_weights(self) -> bool:
        return self.gamma != self.beta or self.quantize != "none"

    def after_inner_step(self) -> None:
        super().after_inner_step()
        t = self.inner_steps
        self._apply_due(t)
        for p in self.schedule.starting(t):
            self._start(p, t)
        self._apply_due(t)  # τ = 0: applied at once

    def finish(self) -> None:
        """Wait for and apply every exchange still in flight."""
        self._apply_due(None)

    def my_group(self) -> list[int]:
        """This replica's group in the next fragment exchange."""
        groups = groups_at(self.exchanges, self.comm.size, self.group_size, self.seed)
        return next(g for g in groups if self.comm.rank in g)

    @torch.no_grad()
    def outer_step(self) -> None:
        """Synchronise every fragment now, blocking (P = 1: one plain NoLoCo outer step)."""
        self._apply_due(None)
        for p in range(self.P):
            self._start(p, self.inner_steps)
            self._apply_due(None)

    # ---- one fragment exchange ---------------------------------------------------------------
    def _frag(self, seq: list[torch.Tensor], p: int) -> list[torch.Tensor]:
        return [seq[i] for i in self.fragment_index[p]]

    @torch.no_grad()
    def _start(self, p: int, t: int) -> None:
        group = self.my_group() if self.comm.size > 1 else [0]
        self.exchanges += 1
        if not self.fragment_index[p]:  # a pipeline stage may hold no block of fragment p
            return
        peers = [r for r in group if r != self.comm.rank]
        fast = flatten(self._frag(self.params, p), torch.float32)
        slow = flatten(self._frag(self.slow, p))
        if self.quantize != "none":
            # Δ = θ − φ in the chosen format, then φ − φ⁰ in int8 (module docstring).
            ref = flatten(self._frag(self.start, p))
            payload = torch.cat([quant.to_bytes(quant.quantize(fast - slow, self.quantize)),
                                 quant.to_bytes(quant.quantize(slow - ref, SLOW_FORMAT))])
        elif self.exchanges_slow_weights:
            payload = torch.cat([fast, slow])
        else:
            payload = fast
        pending = self.comm.exchange_async(payload, peers)
        self.inflight.append(InFlight(p, t + self.tau, payload, pending,
                                      extra=(group, peers, fast.numel())))

    def _apply_due(self, t: int | None) -> None:
        # In start order: the order every rank posted its exchanges in.
        while self.inflight and (t is None or self.inflight[0].due <= t):
            self._apply(self.inflight.pop(0))

    @torch.no_grad()
    def _apply(self, job: InFlight) -> None:
        group, peers, n = job.extra
        received = dict(zip(peers, job.pending.wait(), strict=True))
        received[self.comm.rank] = job.payload
        p = job.fragment
        if self.quantize != "none":
            self._update_quantized(p, group, [received[r] for r in group], n)
        else:
            # Sum in group order, so every member of G computes bit-identical means.
            mean = torch.stack([received[r] for r in group]).mean(0)
            self._update(p, mean, n)
        merge(self._frag(self.params, p), self._frag(self.slow, p),
              self.merge_alpha if self.tau > 0 else 0.0)
        self.last_group = group
        self.outer_steps += 1

    def _update(self, p: int, mean: torch.Tensor, n_fast: int) -> None:
        slow, delta = self._frag(self.slow, p), self._frag(self.delta, p)
        mean_fast = [torch.empty_like(s) for s in slow]
        unflatten_into(mean[:n_fast], mean_fast)
        if self.exchanges_slow_weights:
            mean_slow = [torch.empty_like(s) for s in slow]
            unflatten_into(mean[n_fast:], mean_slow)
        for i, (phi, d, mt) in enumerate(zip(slow, delta, mean_fast, strict=True)):
            if self.exchanges_slow_weights:
                ms = mean_slow[i]
                d.mul_(self.alpha).add_(self.beta * (mt - ms)).sub_(self.gamma * (phi - ms))
            else:
                d.mul_(self.alpha).add_(self.beta * (mt - phi))
            phi.add_(d)

    def _update_quantized(self, p: int, group: list[int], messages: list[torch.Tensor],
                          n: int) -> None:
        split = quant.wire_bytes(n, self.quantize)
        ref = flatten(self._frag(self.start, p))
        deltas, slows = [], []
        for msg in messages:  # group order
            deltas.append(quant.dequantize(quant.from_bytes(msg[:split], n, self.quantize)))
            slows.append(ref + quant.dequantize(quant.from_bytes(msg[split:], n, SLOW_FORMAT)))
        me = slows[group.index(self.comm.rank)]
        mean_delta = torch.stack(deltas).mean(0)
        mean_slow = torch.stack(slows).mean(0)
        # δ ← α·δ + β·mean Δ̂ − γ·(φ̂_i − mean φ̂), on the fragment's flat view.
        step = self.beta * mean_delta - self.gamma * (me - mean_slow)
        slow, delta = self._frag(self.slow, p), self._frag(self.delta, p)
        steps = [torch.empty_like(s) for s in slow]
        unflatten_into(step, steps)
        for phi, d, st in zip(slow, delta, steps, strict=True):
            d.mul_(self.alpha).add_(st)
            phi.add_(d)

    def report(self) -> dict[str, Any]:
        """Extra fields for the run's summary.json."""
        return {"fragments": self.P, "fragment_numel": [
                    sum(self.params[i].numel() for i in idx) for idx in self.fragment_index],
                "overlap_steps": self.tau, "merge_alpha": self.merge_alpha,
                "quantize": self.quantize}

    def state_dict(self) -> dict[str, Any]:
        """φ, δ and the exchange counter; an exchange in flight is completed (waited for,
        both partners at the same step) and what it received saved, to be applied on time.
        Tensors are the live ones (as ``torch.optim``'s): copy them to keep a snapshot."""
        sd = super().state_dict()
        sd.update(slow=self.slow, delta=self.delta, exchanges=self.exchanges,
                  last_group=list(self.last_group),
                  inflight=[(j.fragment, j.due, j.payload, list(j.pending.wait()), j.extra)
                            for j in self.inflight])
        if self.start is not None:
            sd["start"] = self.start
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        for dst, src in zip(self.slow + self.delta, sd["slow"] + sd["delta"], strict=True):
            dst.copy_(src)
        if self.start is not None and "start" in sd:
            for dst, src in zip(self.start, sd["start"], strict=True):
                dst.copy_(src)
        self.exchanges = int(sd.get("exchanges", self.outer_steps))
        self.last_group = list(sd.get("last_group", []))
        dev = self.slow[0].device  # a checkpoint is read into CPU memory
        self.inflight = []
        for p, due, payload, received, extra in sd.get("inflight", []):
            got = [x.to(dev) for x in received]
            self.inflight.append(InFlight(p, due, payload.to(dev),
                                          Pending(self.comm, [], lambda r=got: r), extra))
