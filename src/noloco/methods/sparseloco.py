"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, 2025; arXiv 2508.15706).

DiLoCo's inner loop — H local steps from the shared slow weights φ — with a sparse exchange:
each replica folds its outer gradient Δ = φ − θ into an error-feedback buffer and sends only
that buffer's chunk-wise top-k entries, quantised (:mod:`noloco.sparse`); what it did not
send stays in the buffer for later rounds. The buffer's decay takes the place of DiLoCo's
outer momentum, so the outer step is plain SGD on the mean of the replicas' sparse messages:

    e ← β·e + Δ ;  Δ̂ = Q(TopK(e)) ;  e ← e − Δ̂          (on every replica)
    φ ← φ − α · mean_r Δ̂_r ;  θ ← φ

Sparse messages cannot be summed by an all-reduce (each has its own support): every replica's
message goes to every other through an all-gather (:meth:`noloco.comm.Communicator.
all_gather_async`), all of the same size, decoded and summed in rank order on every replica —
so φ stays identical everywhere. Bytes sent per replica: (N − 1) × the message
(:func:`noloco.sparse.wire_bytes`), growing with N where a ring all-reduce's do not.

With ``topk:1.0:32`` every entry goes, exact, the buffer stays zero whatever β, and this is
DiLoCo without outer momentum at the same α (tests/test_sparseloco.py).

Paper symbol → argument: H → ``sync_every``; α → ``outer_lr``; β → ``decay``; e → the
per-fragment ``errors``; TopK density → ``fraction``; Q's bits → ``bits``; chunk → ``chunk``.
"""

from __future__ import annotations

from typing import Any

import torch

from noloco import sparse
from noloco.comm import Communicator
from noloco.guard import UpdateGuard
from noloco.methods.diloco import DiLoCo
from noloco.methods.engine import Fragment, ModelLike, Sync


class SparseLoCo(DiLoCo):
    """DiLoCo (its schedule, its guard of this replica's own update) with the sparse
    exchange and the error feedback in place of the all-reduce and the outer momentum."""

    name = "sparseloco"
    extra_state = ("errors",)

    def __init__(self, model: ModelLike, comm: Communicator, *, sync_every: int = 50,
                 outer_lr: float = 1.0, decay: float = 0.95, compress: str = "topk:0.02:2",
                 chunk: int = sparse.DEFAULT_CHUNK, guard: UpdateGuard | None = None,
                 **streaming: Any) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"decay must lie in [0, 1], got {decay}")
        self.decay, self.chunk = decay, chunk
        self.fraction, self.bits = sparse.parse(compress)
        # the outer step: plain SGD (the error feedback plays the momentum's part)
        super().__init__(model, comm, sync_every=sync_every, outer_lr=outer_lr, momentum=0.0,
                         nesterov=False, guard=guard, **streaming)
        self.feedback = [sparse.ErrorFeedback(f.numel(), self.fraction, self.bits, decay, chunk,
                                              f.flat_phi.device) for f in self.frags]
        self.errors = [fb.error for fb in self.feedback]
        """e of every fragment: checkpointed, so a resume is bit-exact"""

    def communicate(self, frag: Fragment, t: int) -> Sync | None:
        if not frag.params:
            return None
        fast = frag.fast()
        own_bad = self._guard_own(frag, fast)
        delta = frag.slow() - fast
        if own_bad:  # nothing of a bad update enters the buffer or the message
            delta.zero_()
        msg = self.feedback[frag.index].message(delta)
        payload = sparse.to_bytes(msg)
        return Sync(frag.index, t + self.tau, payload, self.comm.all_gather_async(payload),
                    own_bad=own_bad)

    def pseudo_gradient(self, frag: Fragment, sync: Sync, received: Any) -> torch.Tensor:
        """mean_r Δ̂_r, decoded and summed in rank order (the same bits everywhere)."""
        n = frag.numel()
        total = torch.zeros(n, dtype=torch.float32, device=frag.flat_phi.device)
        for buf in received:
            total += sparse.decompress(sparse.from_bytes(buf, n, self.fraction, self.bits,
                                                         self.chunk))
        return total.div_(len(received))

    def report(self) -> dict[str, Any]:
        return {**super().report(), "compress": f"topk:{self.fraction:g}:{self.bits}",
                "ef_decay": self.decay, "chunk": self.chunk}
