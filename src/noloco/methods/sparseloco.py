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

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

from typing import Any

from noloco import sparse
from noloco.comm import Communicator
from noloco.guard import UpdateGuard
from noloco.methods.diloco import DiLoCo
from noloco.methods.engine import ModelLike


class SparseLoCo(DiLoCo):
    """DiLoCo's compressed exchange (:class:`DiLoCo` with ``compress``) with the outer
    momentum taken out: the error feedback's decay plays its part, and the outer step is
    plain SGD on the mean of the sparse messages."""

    name = "sparseloco"

    def __init__(self, model: ModelLike, comm: Communicator, *, sync_every: int = 50,
                 outer_lr: float = 1.0, decay: float = 0.95, compress: str = "topk:0.02:2",
                 chunk: int = sparse.DEFAULT_CHUNK, guard: UpdateGuard | None = None,
                 **streaming: Any) -> None:
        super().__init__(model, comm, sync_every=sync_every, outer_lr=outer_lr, momentum=0.0,
                         nesterov=False, compress=compress, ef_decay=decay, chunk=chunk,
                         guard=guard, **streaming)
        self.decay = decay
