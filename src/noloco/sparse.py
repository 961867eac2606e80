"""Sparse compression of what is exchanged: chunk-wise top-k, values quantised, indices packed.

SparseLoCo (arXiv 2508.15706) sends 1–3% of the entries of each replica's outer gradient: the
flat fp32 tensor is cut into chunks of ``chunk`` elements (:data:`DEFAULT_CHUNK`; the last one
zero-padded), and in every chunk the ``k = max(1, round(fraction · chunk))`` entries of largest
magnitude are kept. What is not kept stays behind in the replica's error feedback
(:class:`ErrorFeedback`) and is sent in a later round.

Values (``bits``)
    ``32``: the kept values as they are (fp32). Below 32, sign and magnitude: one fp32 scale
    per chunk, ``s = max |v|`` of the chunk's kept values; ``L = 2^(bits−1)`` magnitude levels
    ``s·m/L`` for ``m = 1..L`` (a kept value is among the largest of its chunk, so zero is no
    level worth a code), the nearest level by linear distance, ties up. ``bits = 2``: the
    levels ``s/2`` and ``s``. A chunk whose kept values are all zero decodes to zeros.
    Error bound per kept value: ``s / (2L)``.

Wire format (:func:`to_bytes`; ``n`` elements, ``c`` chunks, ``k`` kept per chunk)
    indices within their chunk, ``c·k`` of them: uint16 when ``chunk ≤ 65536`` (2 bytes),
    else int32 (4 bytes); then the values: fp32 (``4·c·k`` bytes) or the codes packed
    little-endian ``bits`` at a time (``ceil(c·k·bits/8)`` bytes) and the ``c`` fp32 scales.
    Every size follows from (n, chunk, fraction, bits), so a message needs no header and
    every replica's message is the same size (an all-gather can carry them).
    :func:`wire_bytes` is that size: what is counted as sent.

Sparse messages cannot be summed inside an all-reduce: each replica's goes to every other
(an all-gather), so the bytes one replica sends grow with the replicas N, as ``(N−1)·size``,
where a ring all-reduce sends ``2·(N−1)/N`` of the dense tensor whatever N.

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CHUNK = 4096
"""elements per chunk: an index within its chunk takes 12 bits, stored as 16"""


def parse(spec: str) -> tuple[float, int]:
    """``topk:FRACTION[:BITS]`` → (fraction, bits); bits default 32."""
    parts = spec.split(":")
    if parts[0] != "topk" or len(parts) not in (2, 3):
        raise ValueError(f"expected topk:FRACTION[:BITS], got {spec!r}")
    fraction = float(parts[1])
    bits = int(parts[2]) if len(parts) == 3 else 32
    if not 0 < fraction <= 1:
        raise ValueError(f"the fraction must be in (0, 1], got {fraction:g}")
    if bits not in (2, 3, 4, 8, 32):
        raise ValueError(f"bits must be one of 2, 3, 4, 8 or 32, got {bits}")
    return fraction, bits


def kept_per_chunk(fraction: float, chunk: int) -> int:
    return min(chunk, max(1, round(fraction * chunk)))


def num_chunks(numel: int, chunk: int) -> int:
    return max(1, -(-numel // chunk))


def _index_bytes(chunk: int) -> int:
    return 2 if chunk <= 1 << 16 else 4


def wire_bytes(numel: int, fraction: float, bits: int, chunk: int = DEFAULT_CHUNK) -> int:
    """The bytes of one replica's message of ``numel`` elements (module docstring)."""
    c, k = num_chunks(numel, chunk), kept_per_chunk(fraction, chunk)
    values = 4 * c * k if bits == 32 else -(-c * k * bits // 8) + 4 * c
    return c * k * _index_bytes(chunk) + values


@dataclass
class Sparse:
    numel: int
    chunk: int
    bits: int
    indices: torch.Tensor
    """(chunks, k) int64: the kept entries' positions within their chunk"""
    values: torch.Tensor
    """(chunks, k) fp32 — or, below 32 bits, the magnitude codes m−1 in 0..L−1 with the sign
    in the top bit of a ``bits``-bit code"""
    scales: torch.Tensor | None
    """(chunks,) fp32 below 32 bits"""


def compress(x: torch.Tensor, fraction: float, bits: int, chunk: int = DEFAULT_CHUNK) -> Sparse:
    """The chunk-wise top-k of the flat fp32 ``x``, its values quantised to ``bits``."""
    n = x.numel()
    c, k = num_chunks(n, chunk), kept_per_chunk(fraction, chunk)
    flat = torch.zeros(c * chunk, dtype=torch.float32, device=x.device)
    flat[:n] = x.reshape(-1)
    rows = flat.view(c, chunk)
    # torch.topk's order among equal magnitudes is the kernel's; sorting the kept indices
    # makes the message a function of the values alone.
    idx = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    kept = rows.gather(1, idx)
    if bits == 32:
        return Sparse(n, chunk, bits, idx, kept, None)
    levels = 1 << (bits - 1)
    scales = kept.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    m = torch.floor(kept.abs() / safe[:, None] * levels + 0.5).clamp_(1, levels) - 1
    codes = m.to(torch.int64) | ((kept < 0).to(torch.int64) << (bits - 1))
    return Sparse(n, chunk, bits, idx, codes, scales)


def values_of(s: Sparse) -> torch.Tensor:
    """The kept values as decoded, (chunks, k) fp32."""
    if s.bits == 32:
        return s.values
    assert s.scales is not None
    levels = 1 << (s.bits - 1)
    m = (s.values & (levels - 1)).to(torch.float32) + 1
    sign = 1 - 2 * ((s.values >> (s.bits - 1)) & 1).to(torch.float32)
    return sign * m / levels * s.scales[:, None]


def decompress(s: Sparse) -> torch.Tensor:
    """The dense flat tensor: the kept values at their places, zeros elsewhere."""
    c = s.indices.shape[0]
    rows = torch.zeros(c, s.chunk, dtype=torch.float32, device=s.indices.device)
    rows.scatter_(1, s.indices, values_of(s))
    return rows.view(-1)[:s.numel]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits``-bit codes, little-endian, into bytes."""
    flat = codes.reshape(-1).to(torch.int64)
    bitpos = torch.arange(bits, dtype=torch.int64, device=flat.device)
    stream = ((flat[:, None] >> bitpos) & 1).reshape(-1)
    pad = (-stream.numel()) % 8
    stream = torch.cat([stream, stream.new_zeros(pad)]).view(-1, 8)
    weights = 1 << torch.arange(8, dtype=torch.int64, device=flat.device)
    return (stream * weights).sum(dim=1).to(torch.uint8)


def _unpack(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    bitpos = torch.arange(8, dtype=torch.int64, device=data.device)
    stream = ((data.to(torch.int64)[:, None] >> bitpos) & 1).reshape(-1)[:count * bits]
    weights = 1 << torch.arange(bits, dtype=torch.int64, device=data.device)
    return (stream.view(count, bits) * weights).sum(dim=1)


def to_bytes(s: Sparse) -> torch.Tensor:
    """The message (module docstring), a flat uint8 tensor of :func:`wire_bytes` bytes."""
    idx = s.indices.reshape(-1)
    if _index_bytes(s.chunk) == 2:
        # uint16 in int16's bits: an index ≥ 32768 is stored as idx − 65536, undone on reading
        idx = torch.where(idx >= 1 << 15, idx - (1 << 16), idx).to(torch.int16)
    else:
        idx = idx.to(torch.int32)
    parts = [idx.view(torch.uint8)]
    if s.bits == 32:
        parts.append(s.values.reshape(-1).contiguous().view(torch.uint8))
    else:
        assert s.scales is not None
        parts += [_pack(s.values, s.bits), s.scales.contiguous().view(torch.uint8)]
    return torch.cat(parts)


def from_bytes(data: torch.Tensor, numel: int, fraction: float, bits: int,
               chunk: int = DEFAULT_CHUNK) -> Sparse:
    """:func:`to_bytes` undone; ``ValueError`` if ``data`` is not of the size it must be."""
    if data.numel() != wire_bytes(numel, fraction, bits, chunk):
        raise ValueError(f"a sparse message of {data.numel()} bytes, expected "
                         f"{wire_bytes(numel, fraction, bits, chunk)}")
    c, k = num_chunks(numel, chunk), kept_per_chunk(fraction, chunk)
    ib = _index_bytes(chunk)
    raw = data[:c * k * ib].clone()
    if ib == 2:
        idx = raw.view(torch.int16).to(torch.int64) & 0xFFFF
    else:
        idx = raw.view(torch.int32).to(torch.int64)
    if ((idx >= chunk) | (idx < 0)).any():
        raise ValueError("a sparse message with an index outside its chunk")
    rows = idx.view(c, k)
    if k > 1 and (rows[:, 1:] <= rows[:, :-1]).any():
        # the encoder sorts each chunk's distinct indices: a repeated one would make the
        # decoded value depend on which write a scatter keeps
        raise ValueError("a sparse message whose indices are not increasing within a chunk")
    rest = data[c * k * ib:]
    if bits == 32:
        return Sparse(numel, chunk, bits, idx.view(c, k),
                      rest.clone().view(torch.float32).view(c, k), None)
    packed = -(-c * k * bits // 8)
    codes = _unpack(rest[:packed], c * k, bits).view(c, k)
    scales = rest[packed:].clone().view(torch.float32)  # its own storage: aligned
    return Sparse(numel, chunk, bits, idx.view(c, k), codes, scales)


class ErrorFeedback:
    """What a replica has not sent yet (SparseLoCo's e): each round ``e ← decay·e + Δ``, the
    message is the compressed e, and what it carries is taken out of e. With a lossless
    compressor (fraction 1, 32 bits) e stays zero."""

    def __init__(self, numel: int, fraction: float, bits: int, decay: float = 1.0,
                 chunk: int = DEFAULT_CHUNK, device: torch.device | str = "cpu",
                 undoable: bool = False) -> None:
        self.fraction, self.bits, self.decay, self.chunk = fraction, bits, decay, chunk
        self.error = torch.zeros(numel, dtype=torch.float32, device=device)
        self.before: torch.Tensor | None = torch.empty_like(self.error) if undoable else None
        """e as it was before the last round (``undoable``): one more buffer of the
        fragment's size, kept only where a round can be called off (:meth:`undo`)"""

    def message(self, delta: torch.Tensor) -> Sparse:
        """Fold ``delta`` in, compress, keep the remainder; the message to send."""
        if self.before is not None:
            self.before.copy_(self.error)
        self.error.mul_(self.decay).add_(delta.reshape(-1))
        msg = compress(self.error, self.fraction, self.bits, self.chunk)
        self.error.sub_(decompress(msg))
        return msg

    def undo(self) -> None:
        """Call the last round off: e exactly as before it. For a round in which nobody
        stepped (an elastic all-gather that gave up): the fast weights train on, so the next
        round's Δ holds this one's again, and keeping it in e as well would count it twice."""
        if self.before is None:
            raise RuntimeError("this error feedback keeps no copy to undo a round with")
        self.error.copy_(self.before)


class Compressor:
    """One replica's compressed exchange of its fragments: the ``topk:F[:BITS]`` setting and
    an error-feedback buffer per fragment (sizes ``sizes``)."""

    def __init__(self, spec: str, sizes: list[int], decay: float = 1.0,
                 chunk: int = DEFAULT_CHUNK, device: torch.device | str = "cpu",
                 undoable: bool = False) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"the error feedback's decay must lie in [0, 1], got {decay}")
        self.fraction, self.bits = parse(spec)
        self.decay, self.chunk = decay, chunk
        self.feedback = [ErrorFeedback(n, self.fraction, self.bits, decay, chunk, device,
                                       undoable) for n in sizes]

    @property
    def spec(self) -> str:
        return f"topk:{self.fraction:g}:{self.bits}"

    @property
    def errors(self) -> list[torch.Tensor]:
        """e of every fragment (live tensors: a checkpoint copies into them)."""
        return [fb.error for fb in self.feedback]

    def message_bytes(self, numel: int) -> int:
        return wire_bytes(numel, self.fraction, self.bits, self.chunk)

    def encode(self, fragment: int, delta: torch.Tensor) -> torch.Tensor:
        """Fold ``delta`` into the fragment's buffer; the packed message of what goes."""
        return to_bytes(self.feedback[fragment].message(delta))

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        """A message back to a dense flat fp32 tensor (``ValueError`` if it is malformed)."""
        return decompress(from_bytes(data, numel, self.fraction, self.bits, self.chunk))

    def undo(self, fragment: int) -> None:
        """Call the fragment's last round off (:meth:`ErrorFeedback.undo`)."""
        self.feedback[fragment].undo()

    def mean_of_sound(self, messages: list[torch.Tensor], numel: int
                      ) -> tuple[torch.Tensor, dict[int, str]]:
        """The mean of the messages that decode (the right size, increasing indices
        inside their chunks) to finite values; the others are left out, by position, with
        why. Summed in the order given, and the verdict depends on a message's bytes alone,
        so every replica that received the same messages leaves out the same ones and sums
        the same bits. None sound: zeros (no outer gradient at all)."""
        device = messages[0].device if messages else self.feedback[0].error.device
        total = torch.zeros(numel, dtype=torch.float32, device=device)
        dropped: dict[int, str] = {}
        for i, m in enumerate(messages):
            try:
                x = self.decode(m, numel)
            except ValueError as e:
                dropped[i] = str(e)
                continue
            if not bool(torch.isfinite(x).all()):
                dropped[i] = "not finite"
                continue
            total += x
        sound = len(messages) - len(dropped)
        if sound:
            total.div_(sound)
        if not bool(torch.isfinite(total).all()):
            # finite messages whose sum overflowed: the same on every replica, no step
            dropped.update({i: "the mean of the messages is not finite"
                            for i in range(len(messages)) if i not in dropped})
            total.zero_()
        return total, dropped
