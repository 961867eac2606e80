"""Quantisers for the values exchanged in outer synchronisation.

Streaming DiLoCo sends each replica's outer gradient (Δ = φ − θ) as 4-bit floats in the E3M0
format and accumulates the received values in FP32. This module encodes and decodes a flat
fp32 tensor in one of :data:`FORMATS` and counts the bytes that really cross the wire.

Block scaling
    The tensor is cut into consecutive blocks of ``block_size`` elements
    (:data:`DEFAULT_BLOCK_SIZE` = 256; the last block may be short). Every quantised format
    stores one fp32 scale per block: the block's absolute maximum ``s = max |x|``, so the
    meaning of ``scales`` is the same for every format. An all-zero block has ``s = 0`` and
    decodes to exact zeros (nothing is ever divided by zero). Each element is first normalised
    to ``y = x / s`` in [−1, 1] (exact division, never overflows, even for subnormal ``s``).

Formats (``n`` elements, ``b = ceil(n / block_size)`` blocks; see :func:`wire_bytes`)
    ``none``  fp32 passthrough: the raw 4 bytes per element, no scales. ``4·n`` bytes.

    ``fp4``   E3M0: 1 sign bit and 3 exponent bits, no mantissa. A 4-bit code is
              ``sign << 3 | k`` with ``k`` in 0..7; ``k = 0`` is zero and ``k = 1..7`` is the
              magnitude ``s · 2^(k − 7)``, i.e. the 7 powers of two 2^-6 .. 2^0 of the block
              max. The value set for ``s = 1`` is therefore
              {0, ±1/64, ±1/32, ±1/16, ±1/8, ±1/4, ±1/2, ±1} (code 8, "negative zero", also
              decodes to 0 but is never produced). Rounding is to the nearest value in the
              *linear* domain: it picks the closest grid point for every element, so it has
              the lowest absolute and squared error for any input distribution (log-domain
              rounding would trade that for a smaller worst-case relative error, 29 % instead
              of 33 %). The decision thresholds on ``|y|`` are 2^-7 between 0 and 2^-6, and
              ``0.75 · 2^(k − 7)`` between ``2^(k − 8)`` and ``2^(k − 7)``; a tie rounds away
              from zero. Error bound per element: ``|x − q| ≤ max(|x| / 3, s · 2^-7)``.
              Two codes are packed per byte, element ``2i`` in the low nibble and ``2i + 1``
              in the high nibble (an odd tail is padded with a zero nibble).
              ``ceil(n / 2) + 4·b`` bytes (4.125 bits per element at block size 256).

    ``int8``  symmetric integer: ``q = round(127 · y)`` in −127..127 (round half to even),
              decoded as ``q · s / 127``. Error bound: ``|x − q| ≤ s / 254``. ``n + 4·b`` bytes.

    ``fp8``   ``torch.float8_e4m3fn`` of ``448 · y`` (so the block max maps to 448, the largest
              finite e4m3 value; round to nearest even), decoded as ``f · s / 448``. Error
              bound: ``|x − q| ≤ |x| · 2^-4 + s · 2^-10 / 448`` (3 mantissa bits for normal
              values; subnormal spacing 2^-9 below 2^-6). ``n + 4·b`` bytes.

The bounds above are exact in real arithmetic; the fp32 normalisation adds at most a few
ulps (relative ~1e-7), which the tests allow for.

A NaN or inf reaching :func:`quantize` raises ``ValueError``: a diverged replica must not be
averaged silently into everyone's weights. The check reads back one boolean, so on a GPU it
synchronises the stream once per call.

All work is vectorised torch on the input's device (no Python loop over elements): on a
2-core CPU, 10M elements encode in about 0.15 s and decode in under 0.1 s (FP4).

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS: tuple[str, ...] = ("none", "fp4", "int8", "fp8")
"""The accepted values of ``fmt``."""

DEFAULT_BLOCK_SIZE = 256
"""Elements per scale block. 4 bytes of scale per 256 elements is 3 % on top of FP4's payload,
while a block small enough keeps E3M0's narrow range (2^-6 .. 2^0 of the block max) useful."""

FP8_MAX = 448.0
"""Largest finite ``torch.float8_e4m3fn`` value; the block max is mapped to it."""

INT8_MAX = 127
"""Largest int8 code magnitude (symmetric: −128 is never used)."""

_SCALE_DTYPE = torch.float32
_SCALE_BYTES = 4

FP4_MAGNITUDES: tuple[float, ...] = (0.0,) + tuple(2.0 ** (k - 7) for k in range(1, 8))
"""Decoded magnitude of 3-bit code k (index k) for a block max of 1."""


def fp4_value_table() -> torch.Tensor:
    """Decoded value of every 4-bit E3M0 code 0..15 for a block max of 1 (fp32, shape (16,)).

    Code ``c`` has sign bit ``c >> 3`` and magnitude code ``c & 7``; code 8 decodes to 0.
    """
    mags = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags]) + 0.0  # + 0.0 turns -0.0 into +0.0


@dataclass
class Quantized:
    """A tensor encoded for the wire.

    ``payload`` holds the per-element data as bytes (uint8, 1-D): raw fp32 bytes for ``none``,
    packed nibbles for ``fp4``, int8 or e4m3 bit patterns for ``int8`` / ``fp8``. ``scales`` is
    the fp32 absolute maximum of each block (empty for ``none``). ``numel`` is the number of
    encoded elements, ``fmt`` the format and ``block_size`` the block length used.
    """

    payload: torch.Tensor
    scales: torch.Tensor
    numel: int
    fmt: str
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: payload plus scales (equals :func:`wire_bytes`)."""
        return self.payload.numel() * self.payload.element_size() + (
            self.scales.numel() * self.scales.element_size()
        )


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantisation format {fmt!r}; expected one of {FORMATS}")


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def num_blocks(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Number of scale blocks for ``numel`` elements (the last block may be short)."""
    _check_block_size(block_size)
    return -(-numel // block_size)


def _payload_bytes(numel: int, fmt: str) -> int:
    if fmt == "none":
        return 4 * numel
    if fmt == "fp4":
        return (numel + 1) // 2
    return numel  # int8, fp8


def wire_bytes(numel: int, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes that :func:`quantize` would put on the wire for ``numel`` elements.

    ``none``: ``4·n``; ``fp4``: ``ceil(n/2) + 4·ceil(n/block_size)``;
    ``int8`` and ``fp8``: ``n + 4·ceil(n/block_size)``.
    """
    _check_fmt(fmt)
    _check_block_size(block_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    scales = 0 if fmt == "none" else _SCALE_BYTES * num_blocks(numel, block_size)
    return _payload_bytes(numel, fmt) + scales


def _raise_non_finite(x: torch.Tensor, fmt: str) -> None:
    bad = int((~torch.isfinite(x)).sum().item())
    raise ValueError(
        f"non-finite value in outer gradient: {bad} NaN/inf of {x.numel()} elements reached "
        f"quantize(fmt={fmt!r}); the replica has diverged (lower the learning rate or check "
        "the data)"
    )


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` zero-padded to whole blocks, shape (num_blocks, block_size)."""
    n = x.numel()
    pad = num_blocks(n, block_size) * block_size - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(-1, block_size)


# fp32 bit patterns used by the E3M0 encoder (|y| viewed as int32).
_F32_EXP_SHIFT = 23
_F32_HALF_MANTISSA = 1 << 22  # adding it carries into the exponent iff the significand >= 1.5
_F32_BITS_2_POW_M7 = (127 - 7) << 23  # bit pattern of 2^-7, the rounding threshold to zero
_FP4_EXP_BIAS = 127 - 7  # code k = rounded unbiased exponent + 7


def _encode_fp4(y: torch.Tensor) -> torch.Tensor:
    """Normalised fp32 values y in [-1, 1] (1-D) → E3M0 codes 0..15 as uint8 (unpacked).

    Works on the fp32 bits: for |y| = 1.m · 2^e, rounding to the nearer of 2^e and 2^(e+1) in
    the linear domain means rounding up iff 1.m >= 1.5, i.e. iff the top mantissa bit is set,
    so ``(bits + 2^22) >> 23`` is the biased exponent of the nearest power of two (ties away
    from zero). Below 2^-7 (half of the smallest magnitude 2^-6) the value rounds to zero;
    in [2^-7, 2^-6) it rounds up to code 1.
    """
    bits = y.view(torch.int32)
    negative = bits < 0
    bits = bits & 0x7FFFFFFF
    to_zero = bits < _F32_BITS_2_POW_M7
    k = bits.add_(_F32_HALF_MANTISSA).bitwise_right_shift_(_F32_EXP_SHIFT)
    k = k.sub_(_FP4_EXP_BIAS).clamp_(1, 7).to(torch.uint8)
    k.masked_fill_(to_zero, 0)
    k |= (negative & ~to_zero).to(torch.uint8) << 3
    return k


def _fp4_byte_table(device: torch.device) -> torch.Tensor:
    """Decoded (low nibble, high nibble) values of every packed byte 0..255, shape (256, 2)."""
    table = fp4_value_table()
    byte = torch.arange(256)
    return torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=1).to(device)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def quantize(x: torch.Tensor, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Quantized:
    """Encode a 1-D float tensor in format ``fmt`` with one scale per ``block_size`` elements.

    Other floating dtypes are converted to fp32 first. The result never aliases ``x``.

    Raises:
        ValueError: unknown ``fmt``, bad ``block_size``, ``x`` not 1-D floating point, or a
            NaN / inf anywhere in ``x``.
    """
    _check_fmt(fmt)
    _check_block_size(block_size)
    if x.dim() != 1:
        raise ValueError(f"quantize expects a 1-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating point tensor, got {x.dtype}")
    x = x.detach().to(torch.float32).contiguous()
    n = x.numel()

    if fmt == "none":
        if not bool(torch.isfinite(x).all()):
            _raise_non_finite(x, fmt)
        return Quantized(
            payload=x.clone().view(torch.uint8),
            scales=torch.empty(0, dtype=_SCALE_DTYPE, device=x.device),
            numel=n,
            fmt=fmt,
            block_size=block_size,
        )

    blocks = _blocks(x, block_size)
    scales = blocks.abs().amax(dim=1) if n else blocks.new_zeros(0)
    # amax propagates NaN and inf, so checking the (small) scale tensor catches every one.
    if not bool(torch.isfinite(scales).all()):
        _raise_non_finite(x, fmt)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    # |x| <= s, so y is in [-1, 1] exactly (division is correctly rounded and monotone).
    y = (blocks / safe[:, None]).view(-1)[:n]

    if fmt == "fp4":
        payload = _pack_nibbles(_encode_fp4(y))
    elif fmt == "int8":
        q = torch.round(y * INT8_MAX).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        payload = q.view(torch.uint8)
    else:  # fp8
        f = (y * FP8_MAX).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        payload = f.view(torch.uint8)
    return Quantized(
        payload=payload.contiguous(),
        scales=scales.to(_SCALE_DTYPE).contiguous(),
        numel=n,
        fmt=fmt,
        block_size=block_size,
    )


def dequantize(q: Quantized) -> torch.Tensor:
    """Decode ``q`` to a new fp32 1-D tensor of ``q.numel`` elements on ``q.payload``'s device."""
    _check_fmt(q.fmt)
    n, fmt = q.numel, q.fmt
    expected = _payload_bytes(n, fmt)
    if q.payload.dtype != torch.uint8 or q.payload.numel() != expected:
        raise ValueError(
            f"{fmt} payload for {n} elements must be {expected} uint8 bytes, got "
            f"{q.payload.numel()} of {q.payload.dtype}"
        )
    if fmt == "none":
        return q.payload.clone().view(torch.float32)
    nb = num_blocks(n, q.block_size)
    if q.scales.numel() != nb:
        raise ValueError(f"expected {nb} scales for {n} elements, got {q.scales.numel()}")

    payload = q.payload.contiguous()
    if fmt == "fp4":
        # One lookup per byte decodes both of its nibbles.
        y = _fp4_byte_table(payload.device).index_select(0, payload.long()).view(-1)[:n]
    elif fmt == "int8":
        y = payload.view(torch.int8).to(torch.float32) / INT8_MAX
    else:  # fp8
        y = payload.view(torch.float8_e4m3fn).to(torch.float32) / FP8_MAX

    pad = nb * q.block_size - n
    if pad:
        y = torch.nn.functional.pad(y, (0, pad))
    out = y.view(nb, q.block_size) * q.scales.to(torch.float32)[:, None]
    return out.view(-1)[:n].contiguous()


def to_bytes(q: Quantized) -> torch.Tensor:
    """Flatten ``q`` into one uint8 tensor of ``q.nbytes`` bytes: the scales' fp32 bytes first,
    then the payload (scales first so that they stay 4-byte aligned in the buffer)."""
    scales = q.scales.to(_SCALE_DTYPE).contiguous().view(torch.uint8)
    return torch.cat([scales, q.payload.contiguous()])


def from_bytes(
    buf: torch.Tensor, numel: int, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE
) -> Quantized:
    """Inverse of :func:`to_bytes`: the receiver knows ``numel``, ``fmt`` and ``block_size``.

    The returned tensors are copies, so ``buf`` may be reused at once.
    """
    _check_fmt(fmt)
    expected = wire_bytes(numel, fmt, block_size)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != expected:
        raise ValueError(
            f"{fmt} message for {numel} elements (block size {block_size}) must be a 1-D uint8 "
            f"tensor of {expected} bytes, got shape {tuple(buf.shape)} of {buf.dtype}"
        )
    n_scale_bytes = 0 if fmt == "none" else _SCALE_BYTES * num_blocks(numel, block_size)
    scales = buf[:n_scale_bytes].clone().view(_SCALE_DTYPE)
    payload = buf[n_scale_bytes:].clone()
    return Quantized(payload=payload, scales=scales, numel=numel, fmt=fmt, block_size=block_size)
