"""The outer-sync engine under DiLoCo, Streaming DiLoCo and NoLoCo.

All three are local SGD with outer steps: every replica takes inner steps on its own fast
weights θ, and every H inner steps it synchronises them through its slow weights φ. They
differ in two things only, which each method fills in:

- *how replicas communicate* — :meth:`OuterSync.communicate`: DiLoCo all-reduces over all
  replicas, NoLoCo exchanges within a small random group;
- *the outer rule* — :meth:`OuterSync.pseudo_gradient`: the gradient each fragment's outer
  optimizer steps on (DiLoCo: φ − mean θ; NoLoCo: its pull towards the group).

The engine owns everything else, once:

Fragments and schedule
    The parameters are cut into P fragments by transformer block (:func:`split_model`).
    Fragment p synchronises after inner step t when t ≥ t_p and (t − t_p) mod H == 0, with
    offsets t_p = p·H/P (:class:`FragmentSchedule`), so at most one fragment starts per step.
Syncs in flight
    A fragment's communication starts after step t without blocking and is applied after
    step t + τ, in start order — the order every rank posted them in, which is why no two
    ranks can disagree on which sync a wait belongs to.
The outer step and the merge
    Each fragment keeps φ in fp32 and an outer optimizer over φ — a real ``torch.optim``
    optimizer (``torch.optim.SGD``: Nesterov for DiLoCo, heavy-ball for NoLoCo), whose
    ``state_dict`` is what a checkpoint saves. The method's pseudo-gradient goes into
    ``φ.grad`` and the optimizer steps; then the fragment's fast weights, which took τ more
    inner steps meanwhile, are merged: θ ← α·θ + (1 − α)·φ (with τ = 0, θ ← φ exactly).
State
    φ, the outer optimizers' state, each fragment's sync count and every sync in flight (its
    result waited for and saved, to be applied on time after a resume).

Paper symbols: H → ``sync_every``; P → ``fragments``; τ → ``overlap_steps``; α (merge) →
``merge_alpha``; the exchanged values' format → ``quantize``.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from noloco import quant, sparse
from noloco.comm import Communicator, Pending, flatten, is_skipped
from noloco.guard import UpdateGuard, all_finite, distance
from noloco.methods.base import Method
from noloco.quant import FORMATS
from noloco.split import block_index, fragment_parameters

ModelLike = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


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
class Sync:
    """One fragment's synchronisation between its start and its application."""

    fragment: int
    due: int
    """inner step after which it is applied"""
    payload: torch.Tensor
    """what was sent (an all-reduce leaves its mean here)"""
    pending: Pending
    extra: Any = None
    """what the method needs to finish it (NoLoCo: the group)"""
    own_bad: bool = False
    """the update guard rejected this replica's own update: its fast weights are replaced
    by the synced ones outright (no merge with the bad ones)"""


class Fragment:
    """One fragment: its fast weights θ (the live parameters), slow weights φ and the outer
    optimizer over φ.

    φ is one flat fp32 tensor (``flat_phi``; ``phi`` holds a view per parameter), so the outer
    step is one optimizer step over one tensor, and sending or comparing φ needs no copy.
    The flat copy of θ that is sent (and an exchange's receive buffers) are allocated per
    sync and live only while it is in flight: between syncs a fragment holds φ and its outer
    optimizer's state, nothing more (one allocation per H steps costs nothing beside them;
    a buffer kept for the whole run would cost the weights' size again, per replica).
    """

    def __init__(self, index: int, params: list[torch.Tensor], outer: OuterOptimizer) -> None:
        self.index, self.params = index, params
        self.flat_phi = flatten(params, torch.float32)
        self.phi = _views(self.flat_phi, params)
        self.outer = outer([self.flat_phi]) if params else None
        self.syncs = 0

    def numel(self) -> int:
        return self.flat_phi.numel()

    def fast(self) -> torch.Tensor:
        """θ of the fragment, flat, fp32: a new tensor (the sync's to send and keep)."""
        out = torch.empty_like(self.flat_phi)
        for view, p in zip(_views(out, self.params), self.params, strict=True):
            view.copy_(p.detach())
        return out

    def slow(self) -> torch.Tensor:
        """φ of the fragment, flat (the tensor itself: read it, do not change it)."""
        return self.flat_phi


def _views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive slices of ``flat`` shaped like each of ``like``."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset: offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


class OuterSync(Method, ABC):
    """The engine (see the module docstring). Subclasses implement :meth:`communicate` and
    :meth:`pseudo_gradient`, and name in ``extra_state`` the attributes of their own that a
    checkpoint must hold (numbers, lists; lists of tensors are copied into on load)."""

    extra_state: tuple[str, ...] = ()

    def __init__(self, model: ModelLike, comm: Communicator, *, sync_every: int,
                 outer_optimizer: OuterOptimizer, fragments: int = 1,
                 fragment_pattern: str = "strided", overlap_steps: int = 0,
                 merge_alpha: float = 0.5, quantize: str = "none",
                 n_layers: int | None = None, guard: UpdateGuard | None = None) -> None:
        params, frag_index = split_model(model, fragments, fragment_pattern, n_layers)
        super().__init__(params, comm)
        self.schedule = FragmentSchedule(sync_every, fragments, overlap_steps)
        if not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge_alpha must lie in [0, 1], got {merge_alpha}")
        if quantize not in FORMATS:
            raise ValueError(f"unknown quantisation format {quantize!r}; expected one of "
                             f"{FORMATS}")
        self.H, self.P, self.tau = sync_every, fragments, overlap_steps
        self.merge_alpha, self.quantize = merge_alpha, quantize
        self.fragment_index = frag_index
        self.frags = [Fragment(k, [params[i] for i in idx], outer_optimizer)
                      for k, idx in enumerate(frag_index)]
        self.phi: list[torch.Tensor] = [torch.empty(0)] * len(params)
        """φ of every parameter, in model order (the fragments' tensors)"""
        self.frag_of = [0] * len(params)
        """the fragment of every parameter"""
        for frag, idx in zip(self.frags, frag_index, strict=True):
            for i, phi in zip(idx, frag.phi, strict=True):
                self.phi[i], self.frag_of[i] = phi, frag.index
        self.guard = guard
        """checks updates before they are used or contributed (:mod:`noloco.guard`)"""
        self.compress: sparse.Compressor | None = None
        """the sparse exchange's setting and error feedback (:meth:`compress_with`)"""
        self.inflight: list[Sync] = []
        self.wait_seconds: list[float] = []
        """seconds blocked in each sync's wait, in application order"""

    def compress_with(self, spec: str, ef_decay: float = 1.0,
                      chunk: int = sparse.DEFAULT_CHUNK, undoable: bool = False) -> None:
        """Send sparse messages (``topk:F[:BITS]``) with an error-feedback buffer per
        fragment, e, checkpointed (so a resume is bit-exact); each method decides what it
        folds in and how the messages travel."""
        if self.quantize != "none":
            raise ValueError("compress and quantize are two encodings of one exchange: "
                             "choose one")
        # (on the parameters' device: a pipeline stage's empty fragment lives on the CPU)
        # ``undoable``: e's value before each round is kept, to call a round off
        # (DiLoCo.communicate, where an elastic all-gather can end with nobody stepping).
        self.compress = sparse.Compressor(spec, [f.numel() for f in self.frags], ef_decay,
                                          chunk, self.params[0].device, undoable=undoable)
        self.errors = self.compress.errors
        self.dropped = []  # (DiLoCo.pseudo_gradient)
        self.extra_state = (*self.extra_state, "errors", "dropped")

    def _guard_own(self, frag: Fragment, fast: torch.Tensor) -> bool:
        """The update guard's check of this replica's own outer gradient φ − θ before it
        is sent or folded into an error-feedback buffer (:mod:`noloco.guard`): True when it
        is rejected."""
        if self.guard is None:
            return False
        finite = all_finite(fast)
        why = self.guard.judge(distance(frag.slow(), fast) if finite else math.inf, finite)
        if why is not None:
            self.guard.reject(self.inner_steps, "own", why, fragment=frag.index)
        return why is not None

    # ---- what a method fills in -------------------------------------------------------------
    @abstractmethod
    def communicate(self, frag: Fragment, t: int) -> Sync | None:
        """Start fragment ``frag``'s communication after inner step ``t`` (due at t + τ);
        None when this worker holds none of it (a pipeline stage)."""

    @abstractmethod
    def pseudo_gradient(self, frag: Fragment, sync: Sync, received: Any) -> torch.Tensor:
        """The flat gradient the fragment's outer optimizer steps on, from the finished
        ``sync`` (``received``: what its wait returned)."""

    # ---- the schedule --------------------------------------------------------------------------
    @property
    def sync_every(self) -> int:
        return self.H

    @property
    def slow(self) -> list[torch.Tensor]:
        """φ, per parameter in model order."""
        return self.phi

    @property
    def fragment_syncs(self) -> list[int]:
        return [f.syncs for f in self.frags]

    def fragment_numel(self) -> list[int]:
        return [f.numel() for f in self.frags]

    def start_outer(self) -> None:
        super().start_outer()
        t = self.inner_steps
        self._apply_due(t)
        for p in self.schedule.starting(t):
            sync = self.communicate(self.frags[p], t)
            if sync is not None:
                self.inflight.append(sync)

    def complete_outer(self) -> None:
        self._apply_due(self.inner_steps)  # τ = 0: a sync started now is applied now

    def finish(self) -> None:
        """Wait for and apply every sync still in flight (the run's last τ steps)."""
        self._apply_due(None)

    def _apply_due(self, t: int | None) -> None:
        # In start order: the order every rank posted its operations in.
        while self.inflight and (t is None or self.inflight[0].due <= t):
            self._apply(self.inflight.pop(0))

    @torch.no_grad()
    def _apply(self, sync: Sync) -> None:
        t0 = time.perf_counter()
        received = sync.pending.wait()
        self.wait_seconds.append(time.perf_counter() - t0)
        frag = self.frags[sync.fragment]
        if is_skipped(received):
            if sync.own_bad and self.guard is not None:  # no step, but no bad weights either
                for f in self.frags:
                    merge(f.params, f.phi, 0.0)
                self.guard.restart_inner = True
            return  # no outer step: φ unchanged, θ trains on (the next sync takes it all)
        frag.flat_phi.grad = self.pseudo_gradient(frag, sync, received)
        frag.outer.step()
        frag.flat_phi.grad = None
        if sync.own_bad and self.guard is not None:
            # Its own weights went bad: the whole model (every fragment, since a NaN spreads
            # through the gradient) restarts from the slow weights, and the inner optimizer's
            # state, poisoned by the same gradients, afresh.
            for f in self.frags:
                merge(f.params, f.phi, 0.0)
            self.guard.restart_inner = True
        else:
            merge(frag.params, frag.phi, self.merge_alpha if self.tau > 0 else 0.0)
        frag.syncs += 1
        self.outer_steps += 1

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """φ, the outer optimizers' state, sync counts, and every sync in flight: completed
        here (waited for: every rank reaches the same step, so they wait together) and saved
        with what it received, to be applied on time. Tensors are the live ones (as
        ``torch.optim``'s): copy them to keep a snapshot."""
        sd = super().state_dict()
        sd.update(
            phi=[f.flat_phi for f in self.frags],
            outer=[f.outer.state_dict() if f.outer else None for f in self.frags],
            syncs=[f.syncs for f in self.frags], wait_seconds=list(self.wait_seconds),
            inflight=[(s.fragment, s.due, s.payload, s.pending.wait(), s.extra, s.own_bad)
                      for s in self.inflight],
            extra={k: getattr(self, k) for k in self.extra_state})
        if self.guard is not None:
            sd["guard"] = self.guard.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        for frag, phi, outer, syncs in zip(self.frags, sd["phi"], sd["outer"], sd["syncs"],
                                            strict=True):
            frag.flat_phi.copy_(phi)
            if frag.outer is not None:
                frag.outer.load_state_dict(outer)
            frag.syncs = int(syncs)
        self.wait_seconds = list(sd["wait_seconds"])
        for k, v in sd["extra"].items():
            mine = getattr(self, k)
            if isinstance(mine, list) and mine and isinstance(mine[0], torch.Tensor):
                for dst, src in zip(mine, v, strict=True):
                    dst.copy_(src)
            else:
                setattr(self, k, v)
        dev = self.params[0].device  # a checkpoint is read into CPU memory
        self.inflight = []
        for p, due, payload, received, extra, *bad in sd["inflight"]:
            # (an elastic exchange leaves None for a peer that did not take part)
            got = ([x if x is None else x.to(dev) for x in received]
                   if isinstance(received, list) else received)
            self.inflight.append(Sync(p, due, payload.to(dev, copy=True),
                                      Pending(self.comm, [], lambda r=got: r), extra,
                                      bool(bad and bad[0])))
        if self.guard is not None and "guard" in sd:
            self.guard.load_state_dict(sd["guard"])

    def outer_momentum(self) -> list[torch.Tensor]:
        """Each parameter's outer momentum buffer, in model order (zeros before the first
        outer step, and without momentum)."""
        per_frag = []
        for f in self.frags:
            buf = f.outer.state.get(f.flat_phi, {}).get("momentum_buffer") if f.outer else None
            per_frag.append(_views(buf if buf is not None else torch.zeros_like(f.flat_phi),
                                   f.params))
        taken = [0] * len(self.frags)
        out = []
        for k in self.frag_of:
            out.append(per_frag[k][taken[k]])
            taken[k] += 1
        return out

    def report(self) -> dict[str, Any]:
        """Extra fields for the run's summary.json (a subclass may make it collective)."""
        return self.settings()

    def settings(self) -> dict[str, Any]:
        """The method's settings and its own record, for the summary: no communication
        (an elastic replica writes its own summary)."""
        return {"fragments": self.P, "fragment_numel": self.fragment_numel(),
                "overlap_steps": self.tau, "merge_alpha": self.merge_alpha,
                "quantize": self.quantize,
                "update_guard": self.guard.report() if self.guard is not None else None,
                **({"compress": c.spec, "ef_decay": c.decay, "chunk": c.chunk,
                    "dropped_messages": list(self.dropped)}
                   if (c := self.compress) is not None else {})}


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The wire bytes of ``x`` in a quantised format (:mod:`noloco.quant`)."""
    return quant.to_bytes(quant.quantize(x, fmt))


def decode(buf: torch.Tensor, n: int, fmt: str) -> torch.Tensor:
    """Inverse of :func:`encode` for ``n`` values."""
    return quant.dequantize(quant.from_bytes(buf, n, fmt))


@torch.no_grad()
def merge(fast: Sequence[torch.Tensor], synced: Sequence[torch.Tensor], alpha: float) -> None:
    """θ ← α·θ + (1 − α)·θ̃ in place (α = 0: θ ← θ̃ exactly)."""
    for p, s in zip(fast, synced, strict=True):
        if alpha == 0.0:
            p.copy_(s)
        else:
            p.copy_(alpha * p.float() + (1 - alpha) * s)
