"""Bytes each method puts on the wire in one synchronisation: the one definition used by the
communicator's accounting (what a run reports) and by ``noloco netsim predict`` (what it
predicts for another method or network), so the two cannot drift apart.

The all-reduce formulas live beside the collectives in :mod:`noloco.comm` (whose accounting
calls them); this module adds what each method sends through them.

A *synchronisation* is one bucket's all-reduce (DDP), one fragment's all-reduce (DiLoCo,
Streaming DiLoCo: the whole model is one fragment) or one fragment's group exchange (NoLoCo),
of ``numel`` values. Bytes are what one replica's worker sends.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

from noloco import quant, sparse
from noloco.comm import quantized_all_reduce_bytes, ring_all_reduce_bytes

__all__ = ["SLOW_FORMAT", "exchange_message_bytes", "quantized_all_reduce_bytes",
           "ring_all_reduce_bytes", "sync_bytes"]

SLOW_FORMAT = "int8"
"""Encoding of the slow weights' drift φ − φ⁰ in quantised (streaming) NoLoCo."""


def exchange_message_bytes(numel: int, element_size: int = 4, quantize: str = "none",
                           slow_weights: bool = False, compress: str | None = None) -> int:
    """One NoLoCo message of a fragment of ``numel`` values: θ (γ = β); θ and φ (γ ≠ β);
    quantised, Δ in ``quantize`` and φ − φ⁰ in int8; or, compressed (sparse gossip), the
    sparse Δ̂ and the pulled chunks' φ in fp32."""
    if compress is not None:
        fraction, bits = sparse.parse(compress)
        c = sparse.num_chunks(numel, sparse.DEFAULT_CHUNK)
        pulled = min(c, max(1, round(fraction * c)))
        return sparse.wire_bytes(numel, fraction, bits) + 4 * pulled * sparse.DEFAULT_CHUNK
    if quantize != "none":
        return quant.wire_bytes(numel, quantize) + quant.wire_bytes(numel, SLOW_FORMAT)
    return numel * element_size * (2 if slow_weights else 1)


def sync_bytes(method: str, numel: int, replicas: int, *, element_size: int = 4,
               group_size: int = 2, quantize: str = "none", gamma_differs: bool = False,
               compress: str | None = None) -> int:
    """Bytes one replica's worker sends in one synchronisation of ``numel`` values
    (``compress``: sparseloco's defaults to topk:0.02:2)."""
    if replicas <= 1 or method == "single":
        return 0
    if method == "sparseloco":
        compress = compress or "topk:0.02:2"
    if method == "noloco":
        peers = min(group_size, replicas) - 1
        return peers * exchange_message_bytes(numel, element_size, quantize,
                                              slow_weights=gamma_differs, compress=compress)
    if compress is not None and method in ("sparseloco", "diloco", "streaming"):
        # an all-gather: one message to each other replica
        fraction, bits = sparse.parse(compress)
        return (replicas - 1) * sparse.wire_bytes(numel, fraction, bits)
    if method == "ddp" or quantize == "none":
        return ring_all_reduce_bytes(numel * element_size, replicas)
    if method in ("diloco", "streaming"):
        return quantized_all_reduce_bytes(numel, replicas, quantize)
    raise ValueError(f"unknown method {method!r}")
