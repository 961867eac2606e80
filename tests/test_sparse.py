"""Chunk-wise top-k compression with quantised values and error feedback (noloco.sparse)."""

from __future__ import annotations

import pytest
import torch

from noloco import sparse as S


def test_specs_parse_and_bad_ones_say_why():
    assert S.parse("topk:0.02:2") == (0.02, 2)
    assert S.parse("topk:1.0") == (1.0, 32)
    for bad, why in [("topk", "expected"), ("top:0.1", "expected"), ("topk:0:2", "fraction"),
                     ("topk:1.5", "fraction"), ("topk:0.1:5", "bits")]:
        with pytest.raises(ValueError, match=why):
            S.parse(bad)


def test_the_kept_entries_are_each_chunks_largest():
    torch.manual_seed(0)
    x = torch.randn(10_000)
    msg = S.compress(x, 0.05, 32, chunk=1000)
    assert msg.indices.shape == (10, 50)
    dense = S.decompress(msg)
    for c in range(10):
        part = x[c * 1000:(c + 1) * 1000]
        top = set(part.abs().topk(50).indices.tolist())
        assert set(msg.indices[c].tolist()) == top
        kept = dense[c * 1000:(c + 1) * 1000]
        assert torch.equal(kept[list(top)], part[list(top)])  # 32 bits: exact
        assert int((kept != 0).sum()) == 50
    # the padded tail: 10,500 elements make 11 chunks, the last half zeros
    assert S.decompress(S.compress(torch.randn(10_500), 0.05, 32, chunk=1000)).numel() == 10_500


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantised_values_keep_their_sign_and_lie_within_half_a_level(bits):
    torch.manual_seed(1)
    x = torch.randn(8192) * torch.logspace(-3, 1, 8192)
    msg = S.compress(x, 0.1, bits, chunk=1024)
    got = S.values_of(msg)
    want = x.view(8, 1024).gather(1, msg.indices)
    levels = 1 << (bits - 1)
    assert msg.scales is not None
    assert torch.all((got - want).abs() <= msg.scales[:, None] / (2 * levels) * (1 + 1e-6))
    assert torch.equal(torch.sign(got), torch.sign(want))
    if bits == 2:  # two magnitudes: half the chunk's largest kept value, and all of it
        rel = got.abs() / msg.scales[:, None]
        assert torch.all(torch.isclose(rel, torch.tensor(0.5))
                         | torch.isclose(rel, torch.tensor(1.0)))
    assert torch.equal(S.decompress(S.compress(torch.zeros(2048), 0.1, bits, chunk=1024)),
                       torch.zeros(2048))


@pytest.mark.parametrize("bits,chunk", [(32, 4096), (2, 4096), (4, 1000), (8, 65536),
                                        (2, 70_000)])
def test_the_wire_format_round_trips_at_the_size_it_counts(bits, chunk):
    torch.manual_seed(2)
    x = torch.randn(150_001)
    msg = S.compress(x, 0.02, bits, chunk)
    data = S.to_bytes(msg)
    assert data.dtype == torch.uint8
    assert data.numel() == S.wire_bytes(x.numel(), 0.02, bits, chunk)
    back = S.from_bytes(data, x.numel(), 0.02, bits, chunk)
    assert torch.equal(S.decompress(back), S.decompress(msg))
    with pytest.raises(ValueError, match="bytes"):
        S.from_bytes(data[:-1], x.numel(), 0.02, bits, chunk)


def test_indices_take_two_bytes_and_a_bad_one_is_refused():
    n, chunk = 4096 * 10, 4096
    # 82 kept per chunk: 2-byte indices, 2-bit values packed 4 a byte, one fp32 scale a chunk
    assert S.wire_bytes(n, 0.02, 2, chunk) == 10 * 82 * 2 + (10 * 82 * 2 + 7) // 8 + 4 * 10
    assert 4 * n / S.wire_bytes(n, 0.02, 2, chunk) > 80  # against fp32
    msg = S.compress(torch.randn(n), 0.02, 2, chunk)
    data = S.to_bytes(msg).clone()
    data[0], data[1] = 0xFF, 0xFF  # index 65535 in a chunk of 4096
    with pytest.raises(ValueError, match="outside"):
        S.from_bytes(data, n, 0.02, 2, chunk)


def test_error_feedback_loses_nothing_and_a_lossless_one_stays_zero():
    torch.manual_seed(3)
    deltas = [torch.randn(20_000) for _ in range(6)]
    lossless = S.ErrorFeedback(20_000, 1.0, 32)
    for d in deltas:
        assert torch.equal(S.decompress(lossless.message(d)), d)
        assert torch.count_nonzero(lossless.error) == 0
    ef = S.ErrorFeedback(20_000, 0.02, 2)
    sent = torch.zeros(20_000, dtype=torch.float64)
    for d in deltas:
        sent += S.decompress(ef.message(d)).double()
    # what was sent plus what is still owed is everything (decay 1)
    total = sum(d.double() for d in deltas)
    assert torch.allclose(sent + ef.error.double(), total, atol=1e-5)
    assert torch.count_nonzero(ef.error) > 0


def test_a_repeated_or_unsorted_index_is_refused():
    """The encoder sorts each chunk's distinct indices; anything else would make the decoded
    values depend on which of two writes a scatter keeps."""
    n, chunk = 4096 * 2, 4096
    data = S.to_bytes(S.compress(torch.randn(n), 0.02, 2, chunk)).clone()
    idx = data[:2 * 82 * 2].view(torch.int16)
    idx[1] = idx[0]  # chunk 0's second index repeats its first
    with pytest.raises(ValueError, match="not increasing"):
        S.from_bytes(data, n, 0.02, 2, chunk)


def test_a_round_called_off_leaves_the_error_feedback_as_it_was():
    torch.manual_seed(4)
    ef = S.ErrorFeedback(9000, 0.05, 2, decay=0.9, undoable=True)
    ef.message(torch.randn(9000))
    before = ef.error.clone()
    ef.message(torch.randn(9000))
    assert not torch.equal(ef.error, before)
    ef.undo()
    assert torch.equal(ef.error, before)
    with pytest.raises(RuntimeError, match="no copy"):
        S.ErrorFeedback(10, 0.5, 2).undo()


def test_the_mean_of_sound_messages_leaves_out_malformed_and_non_finite_ones():
    torch.manual_seed(5)
    comp = S.Compressor("topk:0.1:32", [5000])
    msgs = [S.to_bytes(S.compress(torch.randn(5000), 0.1, 32)) for _ in range(4)]
    bad_index = msgs[1].clone()
    bad_index[:2] = 0xFF  # an index outside its chunk
    nan = msgs[2].clone()
    nan[-4:] = torch.tensor([float("nan")]).view(torch.uint8)  # the last kept value
    short = msgs[3][:-1]
    mean, dropped = comp.mean_of_sound([msgs[0], bad_index, nan, short, msgs[3]], 5000)
    assert sorted(dropped) == [1, 2, 3]
    assert "outside" in dropped[1] and dropped[2] == "not finite" and "bytes" in dropped[3]
    def plain(ms):  # summed in order, then divided: the same bits on every replica
        return sum(comp.decode(m, 5000) for m in ms) / len(ms)

    assert torch.equal(mean, plain([msgs[0], msgs[3]]))
    # sound messages alone: the plain mean, bit for bit
    assert torch.equal(comp.mean_of_sound(msgs, 5000)[0], plain(msgs))
    zeros, dropped = comp.mean_of_sound([bad_index], 5000)
    assert dropped.keys() == {0} and not zeros.any()
    # finite messages whose sum overflows: no mean at all, on every replica alike
    huge = S.to_bytes(S.compress(torch.full((5000,), 3e38), 0.1, 32))
    zeros, dropped = comp.mean_of_sound([huge, huge, msgs[0]], 5000)
    assert sorted(dropped) == [0, 1, 2] and not zeros.any()
