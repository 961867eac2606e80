"""Tests for noloco.quant: value sets, error bounds, byte counts and the wire format."""

import pytest
import torch

from noloco import quant
from noloco.quant import (
    DEFAULT_BLOCK_SIZE,
    FORMATS,
    Quantized,
    dequantize,
    from_bytes,
    quantize,
    to_bytes,
    wire_bytes,
)

QUANTISED = ("fp4", "int8", "fp8")
# fp32 normalisation (x / s, then · s) adds a few ulps on top of the exact bounds.
ULP_SLACK = 1e-6


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


def _block_max(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each element's block absmax, shape like x."""
    s = torch.stack([c.abs().max() for c in x.split(block_size)])
    return s.repeat_interleave(block_size)[: x.numel()]


def _roundtrip(x: torch.Tensor, fmt: str, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    return dequantize(quantize(x, fmt, block_size))


# --- the E3M0 value set ---------------------------------------------------------------------


def test_fp4_value_table_is_documented_set() -> None:
    expected = [0.0] + [2.0 ** (k - 7) for k in range(1, 8)]
    table = quant.fp4_value_table()
    assert table.dtype == torch.float32
    assert table.tolist() == expected + [-v for v in expected]
    assert quant.FP4_MAGNITUDES == tuple(expected)
    # code 8 ("negative zero") decodes to +0, not -0
    assert torch.signbit(table[8]).item() is False


def test_every_fp4_code_decodes_to_its_value() -> None:
    scale = 3.0
    codes = torch.arange(16, dtype=torch.uint8)
    packed = codes[0::2] | (codes[1::2] << 4)  # element 2i low nibble, 2i+1 high nibble
    q = Quantized(packed, torch.tensor([scale]), 16, "fp4", block_size=16)
    assert dequantize(q).tolist() == (quant.fp4_value_table() * scale).tolist()


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-20, 1234.5])
def test_fp4_representable_values_are_lossless(scale: float) -> None:
    table = quant.fp4_value_table()
    x = (torch.cat([table, table.flip(0)]) * scale).float()
    q = quantize(x, "fp4", block_size=32)
    assert torch.equal(dequantize(q), x)
    # and the codes are the canonical ones (zero never gets the sign bit)
    codes = torch.stack([q.payload & 0x0F, q.payload >> 4], dim=1).view(-1)
    assert codes[:16].tolist() == list(range(8)) + [0] + list(range(9, 16))


def test_fp4_rounding_thresholds_linear_domain() -> None:
    # block max 1 (first element); the other values sit at and around the decision points
    t = [2.0**-7] + [0.75 * 2.0 ** (k - 7) for k in range(2, 8)]  # threshold below code k
    eps = 1e-4
    vals, want = [1.0], [1.0]
    for k, th in enumerate(t, start=1):
        lower = quant.FP4_MAGNITUDES[k - 1]
        upper = quant.FP4_MAGNITUDES[k]
        vals += [th, th * (1 - eps), th * (1 + eps), -th, -th * (1 - eps)]
        want += [upper, lower, upper, -upper, -lower]
    x = torch.tensor(vals)
    assert dequantize(quantize(x, "fp4")).tolist() == pytest.approx(want, abs=0)


def test_fp4_is_nearest_grid_point() -> None:
    x = _randn(50_000, seed=1) * torch.exp(_randn(50_000, seed=2) * 2)  # wide dynamic range
    bs = 128
    s = _block_max(x, bs)
    got = _roundtrip(x, "fp4", bs)
    grid = quant.fp4_value_table()[:8]
    y = (x / s).abs()
    dist = (y[:, None] - grid[None, :]).abs()
    nearest = dist.min(dim=1).values
    got_dist = (y - (got / s).abs()).abs()
    assert torch.all(got_dist <= nearest + ULP_SLACK)
    assert torch.all(torch.sign(got) * torch.sign(x) >= 0)


def test_fp4_linear_rounding_beats_log_rounding() -> None:
    """The documented choice: linear-domain nearest has lower mean squared error."""
    x = _randn(64 * 256, seed=3)
    s = _block_max(x, 256)
    y = (x / s).abs()
    k = torch.log2(y.clamp_min(2.0**-30)).round().clamp(-6, 0)
    log_q = torch.where(y < 2.0**-7, 0.0, 2.0**k) * s * torch.sign(x)
    lin_q = _roundtrip(x, "fp4", 256)
    assert ((lin_q - x) ** 2).mean() < ((log_q - x) ** 2).mean()


# --- round-trip error bounds ----------------------------------------------------------------


@pytest.mark.parametrize("bs", [7, 256, 1000])
def test_fp4_error_bound(bs: int) -> None:
    x = _randn(10_007, seed=4) * torch.exp(_randn(10_007, seed=5))
    s = _block_max(x, bs)
    err = (_roundtrip(x, "fp4", bs) - x).abs()
    bound = torch.maximum(x.abs() / 3, s * 2.0**-7)
    assert torch.all(err <= bound * (1 + ULP_SLACK))
    # in the normal range the relative error is at most 1/3
    normal = x.abs() >= s * 2.0**-6
    assert torch.all(err[normal] <= x.abs()[normal] / 3 * (1 + ULP_SLACK))


@pytest.mark.parametrize("bs", [7, 256, 1000])
def test_int8_error_bound(bs: int) -> None:
    x = _randn(10_007, seed=6) * 5
    s = _block_max(x, bs)
    err = (_roundtrip(x, "int8", bs) - x).abs()
    assert torch.all(err <= s / 254 * (1 + ULP_SLACK) + s * ULP_SLACK)
    # the block max itself is exact (it maps to ±127)
    q = _roundtrip(x, "int8", bs)
    at_max = x.abs() == s
    assert torch.equal(q[at_max], x[at_max])


@pytest.mark.parametrize("bs", [7, 256, 1000])
def test_fp8_error_bound(bs: int) -> None:
    x = _randn(10_007, seed=7) * torch.exp(_randn(10_007, seed=8) * 2)
    s = _block_max(x, bs)
    err = (_roundtrip(x, "fp8", bs) - x).abs()
    bound = x.abs() * 2.0**-4 + s * 2.0**-10 / 448
    assert torch.all(err <= bound * (1 + ULP_SLACK) + s * ULP_SLACK)
    at_max = x.abs() == s
    assert torch.allclose(_roundtrip(x, "fp8", bs)[at_max], x[at_max], rtol=1e-6, atol=0)


def test_none_is_exact() -> None:
    x = _randn(1001, seed=9)
    q = quantize(x, "none")
    assert torch.equal(dequantize(q), x)
    assert q.scales.numel() == 0 and q.nbytes == 4 * 1001


def test_relative_l2_errors_on_gaussian() -> None:
    x = _randn(256 * 400, seed=10)
    rel = {f: ((_roundtrip(x, f) - x).norm() / x.norm()).item() for f in FORMATS}
    assert rel["none"] == 0.0
    assert rel["int8"] < 0.01
    assert rel["fp8"] < 0.03
    assert rel["fp4"] < 0.21
    assert rel["int8"] < rel["fp8"] < rel["fp4"]


# --- scales, zeros, lengths -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTISED)
def test_scales_are_block_absmax(fmt: str) -> None:
    x = _randn(1000, seed=11)
    q = quantize(x, fmt, block_size=128)
    assert q.scales.dtype == torch.float32
    assert q.scales.shape == (8,)
    expected = torch.stack([c.abs().max() for c in x.split(128)])
    assert torch.equal(q.scales, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_and_all_zero_blocks(fmt: str) -> None:
    x = _randn(1000, seed=12)
    x[:256] = 0.0  # one whole block of zeros
    x[300:310] = 0.0  # zeros inside a nonzero block
    x[400] = -0.0
    x[-5:] = 0.0
    out = _roundtrip(x, fmt)
    assert torch.isfinite(out).all()
    zero = x == 0
    assert torch.all(out[zero] == 0)
    out_all = _roundtrip(torch.zeros(777), fmt)
    assert torch.equal(out_all, torch.zeros(777))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 255, 257, 1001])
def test_odd_lengths(fmt: str, n: int) -> None:
    x = _randn(n, seed=13)
    q = quantize(x, fmt, block_size=256)
    assert q.numel == n
    assert q.nbytes == wire_bytes(n, fmt, 256)
    out = dequantize(q)
    assert out.shape == (n,)
    if fmt == "none":
        assert torch.equal(out, x)
    else:
        # the last element of an odd-length input survives (not eaten by nibble padding)
        if n:
            assert torch.sign(out[-1]) == torch.sign(x[-1]) or out[-1] == 0


@pytest.mark.parametrize("fmt", QUANTISED)
def test_tiny_and_huge_scales(fmt: str) -> None:
    for scale in (1e-42, 1e-30, 1e30, 3e38):  # subnormal block max and near fp32 max
        x = torch.tensor([1.0, -0.5, 0.25, 0.0]) * scale
        out = _roundtrip(x, fmt)
        assert torch.isfinite(out).all()
        assert out[0] == pytest.approx(x[0].item(), rel=1e-6)


# --- bytes on the wire ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 256, 257, 10_000, 1_000_001])
@pytest.mark.parametrize("bs", [1, 64, 256, 1024])
def test_wire_bytes_formula(n: int, bs: int) -> None:
    nb = -(-n // bs)
    assert wire_bytes(n, "none", bs) == 4 * n
    assert wire_bytes(n, "fp4", bs) == (n + 1) // 2 + 4 * nb
    assert wire_bytes(n, "int8", bs) == n + 4 * nb
    assert wire_bytes(n, "fp8", bs) == n + 4 * nb


@pytest.mark.parametrize("fmt", FORMATS)
def test_nbytes_matches_wire_bytes(fmt: str) -> None:
    x = _randn(12_345, seed=14)
    for bs in (100, 256):
        q = quantize(x, fmt, bs)
        assert q.nbytes == wire_bytes(12_345, fmt, bs)
        assert to_bytes(q).numel() == q.nbytes


def test_fp4_is_about_one_eighth_of_fp32() -> None:
    n = 1 << 20
    fp4 = wire_bytes(n, "fp4")
    assert fp4 == n // 2 + 4 * n // DEFAULT_BLOCK_SIZE
    assert 4 * n / fp4 == pytest.approx(8 / (1 + 8 / DEFAULT_BLOCK_SIZE))  # 7.76 at 256
    assert 8 * fp4 / n == pytest.approx(4.125)  # bits per element at block size 256


# --- the flat message -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [0, 1, 1001])
def test_to_bytes_from_bytes_roundtrip(fmt: str, n: int) -> None:
    x = _randn(n, seed=15)
    q = quantize(x, fmt, block_size=64)
    buf = to_bytes(q)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    r = from_bytes(buf.clone(), n, fmt, block_size=64)
    assert torch.equal(r.payload, q.payload)
    assert torch.equal(r.scales, q.scales)
    assert (r.numel, r.fmt, r.block_size) == (n, fmt, 64)
    assert torch.equal(dequantize(r), dequantize(q))


@pytest.mark.parametrize("fmt", FORMATS)
def test_from_bytes_of_unaligned_slice(fmt: str) -> None:
    """A message received into a larger buffer at an odd offset still decodes."""
    x = _randn(301, seed=16)
    q = quantize(x, fmt, block_size=64)
    buf = to_bytes(q)
    big = torch.zeros(buf.numel() + 3, dtype=torch.uint8)
    big[1 : 1 + buf.numel()] = buf
    r = from_bytes(big[1 : 1 + buf.numel()], 301, fmt, block_size=64)
    big.zero_()  # the decoded message must not alias the receive buffer
    assert torch.equal(dequantize(r), dequantize(q))


def test_from_bytes_rejects_wrong_length() -> None:
    q = quantize(_randn(100), "fp4")
    with pytest.raises(ValueError, match="bytes"):
        from_bytes(to_bytes(q)[:-1], 100, "fp4")


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(fmt: str, bad: float) -> None:
    x = _randn(1000, seed=17)
    x[513] = bad
    with pytest.raises(ValueError, match="non-finite value in outer gradient"):
        quantize(x, fmt)


@pytest.mark.parametrize("func", ["quantize", "wire_bytes", "from_bytes"])
def test_unknown_format_raises(func: str) -> None:
    with pytest.raises(ValueError, match="expected one of .*fp4"):
        if func == "quantize":
            quantize(torch.zeros(4), "fp16")
        elif func == "wire_bytes":
            wire_bytes(4, "e2m1")
        else:
            from_bytes(torch.zeros(4, dtype=torch.uint8), 4, "bf16")


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="1-D"):
        quantize(torch.zeros(2, 3), "fp4")
    with pytest.raises(ValueError, match="floating point"):
        quantize(torch.zeros(4, dtype=torch.int32), "int8")
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.zeros(4), "fp4", block_size=0)


# --- dtype, device, aliasing ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_dtype_device_preserved(fmt: str) -> None:
    x = _randn(500, seed=18)
    q = quantize(x, fmt)
    assert q.payload.dtype == torch.uint8 and q.payload.dim() == 1
    assert q.payload.device == x.device and q.scales.device == x.device
    out = dequantize(q)
    assert out.dtype == torch.float32 and out.device == x.device and out.is_contiguous()


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_aliasing_with_input(fmt: str) -> None:
    x = _randn(300, seed=19)
    q = quantize(x, fmt)
    before = dequantize(q)
    x.add_(100.0)
    assert torch.equal(dequantize(q), before)


def test_non_contiguous_input() -> None:
    x = _randn(2000, seed=20)[::2]
    assert torch.equal(_roundtrip(x, "fp4"), _roundtrip(x.contiguous(), "fp4"))


def test_ten_million_elements_is_vectorised() -> None:
    x = _randn(10_000_000, seed=21)
    q = quantize(x, "fp4")
    out = dequantize(q)
    assert q.nbytes == wire_bytes(10_000_000, "fp4")
    assert ((out - x).norm() / x.norm()).item() < 0.21
