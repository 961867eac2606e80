"""DiLoCo (Douillard et al., 2023; SPEC §2).

Every replica starts from the same slow weights φ and takes H inner (AdamW) steps on its own
data; then all replicas average their fast weights θ (one all-reduce) and every replica takes
the same outer step on φ with the outer gradient g = φ − mean_i(θ_i):

    outer SGD with Nesterov momentum (lr 0.7, μ 0.9):  b ← μ·b + g ;  φ ← φ − lr·(g + μ·b)
    θ ← φ

The outer step is ``torch.optim.SGD(nesterov=True)`` over φ with g in ``φ.grad``; with
``nesterov=False`` it is the heavy-ball form the NoLoCo paper used for its DiLoCo baseline
(b ← μ·b + g ; φ ← φ − lr·b). Inner optimizer states stay local. Schedule, overlap, state
and the rest belong to the engine (:mod:`noloco.methods.engine`); Streaming DiLoCo
(:mod:`noloco.methods.streaming`) is this class with its fragments, overlap and quantisation
switched on.

Compressed (``compress="topk:F:BITS"``, this project's option, issue 25): instead of the
dense all-reduce every replica folds its outer gradient Δ = φ − θ into an error-feedback
buffer e ← β_e·e + Δ and sends only e's chunk-wise top-k, quantised (:mod:`noloco.sparse`);
what it did not send stays in e. Sparse messages have different supports and cannot be
summed inside an all-reduce: they are all-gathered, decoded and summed in rank order on
every replica, so φ stays identical everywhere, and g is their mean. The outer step is
unchanged (Nesterov momentum); SparseLoCo (:mod:`noloco.methods.sparseloco`) is this with
the momentum taken out. Bytes sent per replica: (N − 1) × the message, growing with N.
``topk:1.0:32`` sends every entry exactly, e stays zero, and the method equals the
uncompressed one up to float rounding (the mean of φ − θ instead of φ − the mean of θ).

Paper symbol → argument: H → ``sync_every``; outer learning rate → ``outer_lr``; outer
momentum μ → ``momentum``; Nesterov → ``nesterov``; error-feedback decay → ``ef_decay``.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from noloco import sparse
from noloco.comm import Communicator, Pending, SharedGather, computed_once, is_skipped
from noloco.guard import UpdateGuard
from noloco.methods.engine import Fragment, ModelLike, OuterSync, Sync


class DiLoCo(OuterSync):
    name = "diloco"

    def __init__(self, model: ModelLike, comm: Communicator, *, sync_every: int = 100,
                 outer_lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True,
                 compress: str | None = None, ef_decay: float = 1.0,
                 chunk: int = sparse.DEFAULT_CHUNK,
                 guard: UpdateGuard | None = None, **streaming: Any) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {sync_every}")
        if outer_lr < 0 or momentum < 0:
            raise ValueError("outer_lr and momentum must be non-negative")
        self.outer_lr, self.momentum, self.nesterov = outer_lr, momentum, nesterov

        def outer(phi: list[torch.Tensor]) -> torch.optim.Optimizer:
            return torch.optim.SGD(phi, lr=outer_lr, momentum=momentum,
                                   nesterov=nesterov and momentum > 0)

        super().__init__(model, comm, sync_every=sync_every, outer_optimizer=outer, guard=guard,
                         **streaming)
        if compress is not None:
            # an elastic all-gather may end with nobody stepping: e can be put back
            self.compress_with(compress, ef_decay, chunk, undoable=comm.may_skip)

    def communicate(self, frag: Fragment, t: int) -> Sync | None:
        """All replicas average the fragment's fast weights θ — or, quantised, each one's
        outer gradient φ − θ (a small delta suits a block-scaled 4-bit format; weights would
        not): every replica decodes the same bytes, so φ stays identical everywhere."""
        if not frag.params:  # a pipeline stage may hold no block of this fragment
            return None
        fast = frag.fast()
        own_bad = self._guard_own(frag, fast)
        if self.compress is not None:
            delta = frag.slow() - fast
            if own_bad:  # nothing of a bad update enters the buffer or the message
                delta.zero_()
            payload = self.compress.encode(frag.index, delta)
            pending = self.comm.all_gather_async(payload)
            if self.comm.may_skip:
                pending = _undo_if_skipped(pending, lambda: self.compress.undo(frag.index))
            return Sync(frag.index, t + self.tau, payload, pending, own_bad=own_bad)
        if self.quantize == "none":
            # A bad update is replaced by φ itself: a zero outer gradient in the mean.
            payload = fast.copy_(frag.slow()) if own_bad else fast
            pending = self.comm.all_reduce_mean_async(payload)
        else:
            payload = frag.slow() - fast
            if own_bad:
                payload.zero_()
            pending = self.comm.all_reduce_mean_quantized_async(payload, self.quantize)
        return Sync(frag.index, t + self.tau, payload, pending, own_bad=own_bad)

    def pseudo_gradient(self, frag: Fragment, sync: Sync, received: Any) -> torch.Tensor:
        """g = φ − mean θ (the all-reduce left its mean in the payload); compressed, the mean
        of the replicas' decoded messages, summed in rank order (the same bits everywhere)."""
        if self.compress is not None:
            # Elastic: None for a replica whose message is not in the outcome (a replica
            # alone, or left out, holds its own message only).
            ranks = [r for r, m in enumerate(received) if m is not None]
            mean, dropped = computed_once(
                received, ("mean_of_sound", frag.numel()),
                lambda: self.compress.mean_of_sound([received[r] for r in ranks],
                                                    frag.numel()))
            for i, why in dropped.items():
                self._drop(frag, ranks[i], why)
            return mean if not isinstance(received, SharedGather) else mean.clone()
        if self.quantize != "none":
            return sync.payload  # already the mean of φ − θ
        return frag.slow() - sync.payload

    def _drop(self, frag: Fragment, rank: int, why: str) -> None:
        """A message left out of the mean (malformed or not finite): every replica that
        received it leaves it out alike. Said once per message, in the summary (and by the
        update guard, when there is one)."""
        source = "own" if rank == self.comm.rank else rank
        self.dropped.append({"step": self.inner_steps, "from": source,
                             "fragment": frag.index, "why": why})
        if self.guard is not None:
            self.guard.reject(self.inner_steps, source, why, fragment=frag.index)

    @property
    def buf(self) -> list[torch.Tensor]:
        """The outer momentum, per parameter in model order."""
        return self.outer_momentum()


def _undo_if_skipped(pending: Pending, undo: Callable[[], None]) -> Pending:
    """``pending``, calling ``undo`` when it ends :data:`SKIPPED` (nobody stepped: the error
    feedback forgets the round, whose Δ the next round's holds again). Done when the result
    is first read — by the sync's application, or by a checkpoint or join state taken
    before it (``OuterSync.state_dict`` waits for every sync in flight), which therefore
    saves e already put back and the result as SKIPPED, for which a resumed or joined
    replica undoes nothing again."""

    def finish() -> Any:
        got = pending.wait()
        if is_skipped(got):
            undo()
        return got

    return Pending(pending._comm, [], finish)


@torch.no_grad()
def outer_sgd_(slow: Sequence[torch.Tensor], mean_fast: Sequence[torch.Tensor],
               buf: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool) -> None:
    """DiLoCo's outer step written out on plain tensors, with g = φ − mean θ: what the outer
    ``torch.optim.SGD`` computes (a reference for tests, and for code without an optimizer).

    Heavy-ball keeps δ = −lr·(momentum buffer) so that it reads as the NoLoCo update with one
    group of all replicas."""
    for phi, theta, b in zip(slow, mean_fast, buf, strict=True):
        if nesterov:
            g = phi - theta
            b.mul_(momentum).add_(g)
            phi.sub_(lr * (g + momentum * b))
        else:
            b.mul_(momentum).add_(lr * (theta - phi))
            phi.add_(b)
