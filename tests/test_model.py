from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from noloco.model import PRESETS, ModelArgs, Transformer, build, count_params, lm_loss, preset

SMALL = ModelArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=257, max_seq_len=64)


def test_shapes_and_loss():
    model = build(SMALL, seed=0)
    x = torch.randint(0, 257, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, 257)
    loss = lm_loss(logits, x)
    # An untrained model is close to uniform over the vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.5


def test_causal_later_tokens_never_change_earlier_logits():
    model = build(SMALL, seed=1).eval()
    x = torch.randint(0, 257, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 257, (2, 8))
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_same_seed_same_weights_and_untied_embeddings():
    a, b = build(SMALL, seed=3), build(SMALL, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert a.tok_embeddings.weight.data_ptr() != a.output.weight.data_ptr()
    assert not torch.equal(a.tok_embeddings.weight, a.output.weight)


def test_rope_makes_attention_position_aware():
    # Without position information, attention over a prefix is a function of the set of its
    # tokens: swapping two earlier tokens would leave the last position's output unchanged.
    model = build(SMALL, seed=2).eval()
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    y = torch.tensor([[2, 1, 3, 4, 5, 6]])
    with torch.no_grad():
        a, b = model(x), model(y)
    assert not torch.allclose(a[0, -1], b[0, -1], atol=1e-4)


def test_tiny_preset_is_about_one_million_params():
    n = count_params(build(preset("tiny", vocab_size=257), seed=0))
    assert 0.5e6 < n < 2e6


def test_large_presets_build_on_meta_device():
    for name, lo, hi in (("small", 80e6, 200e6), ("medium", 1.0e9, 1.6e9),
                         ("large", 6.0e9, 7.5e9)):
        args = preset(name, vocab_size=32000)
        with torch.device("meta"):
            model = Transformer(args)
        n = count_params(model)
        assert lo < n < hi, (name, n)
        assert next(model.parameters()).is_meta
    assert set(PRESETS) == {"tiny", "small", "medium", "large"}


def test_kv_cache_gives_the_logits_of_the_whole_sequence():
    from noloco.model import KVCache

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=50, max_seq_len=16)
    m = build(args, seed=3).eval()
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = m(tokens)
        cache = KVCache(args, 2, 12, "cpu")
        # a prompt of 5, then a chunk of 3 (masked within itself), then one token at a time
        parts = [m(tokens[:, :5], cache), m(tokens[:, 5:8], cache)]
        parts += [m(tokens[:, i:i + 1], cache) for i in range(8, 12)]
        assert cache.length == 12 and int(cache.position) == 12
        # the buffers are static: one more position does not fit, said before anything runs
        with pytest.raises(ValueError, match="do not fit"):
            m(tokens[:, :1], cache)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    # and the cache is not a no-op: a token fed without its history gives other logits
    with torch.no_grad():
        assert not torch.allclose(m(tokens[:, 11:12])[:, -1], full[:, -1], atol=1e-3)
    # a slot written ahead of the position (a captured step's warm-up) stays masked out until
    # the position reaches it and a forward writes it again
    with torch.no_grad():
        cache = KVCache(args, 2, 12, "cpu")
        cache.k.normal_()
        cache.v.normal_()
        parts = [m(tokens[:, :6], cache)] + [m(tokens[:, i:i + 1], cache) for i in range(6, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="context is 16"):
        KVCache(args, 1, 17, "cpu")


def test_the_inference_kernels_give_the_training_forwards_numbers_on_the_cpu():
    """Inference in fp32 takes fused forms (one RMS norm kernel, q and k rotated as one
    complex product on a cached step: fewer kernels for a GPU's one-token step). On the CPU
    they give the training forward's numbers bit for bit, so evaluation and generation there
    are what they were; training itself (gradients on) keeps the composite forms."""
    from noloco.model import RMSNorm, apply_rope, apply_rotation, rope_tables

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    for shape in [(1, 1, 48), (3, 17, 48), (2, 64, 48)]:
        x = torch.randn(shape, generator=g)
        composite = norm(x)  # gradients on: the training form
        with torch.no_grad():
            assert torch.equal(norm(x), composite)
    for b, h, t, d in [(1, 8, 1, 16), (2, 6, 13, 16), (1, 4, 64, 32)]:
        x = torch.randn(b, t, h, d, generator=g).transpose(1, 2)  # as attention holds q
        x = torch.cat((x, x.flip(0)), 1)  # and as a cached step rotates q and k together
        cos, sin = rope_tables(t, d, 10000.0, torch.device("cpu"), torch.float32)
        assert torch.equal(apply_rotation(x, torch.complex(cos, sin), cos, sin),
                           apply_rope(x, cos, sin))
        assert torch.equal(apply_rotation(x.bfloat16(), torch.complex(cos, sin), cos, sin),
                           apply_rope(x.bfloat16(), cos, sin))  # (not fp32: the real form)
    # the whole model: a forward without gradients equals one with them, bit for bit
    m = build(SMALL, seed=1)
    tokens = torch.randint(0, 257, (2, 20), generator=g)
    with torch.no_grad():
        inferred = m(tokens)
    assert torch.equal(inferred, m(tokens))


def test_a_cache_stacks_the_projections_with_the_same_numbers_on_the_cpu():
    """A cached step computes q, k and v in one product, and the feed-forward's gate and up
    in another (their weights stacked once a cache): on the CPU the logits equal those of
    one product each (``fuse=False``) bit for bit, so the cached sampler's tokens are
    what they were."""
    from noloco.model import KVCache

    m = build(SMALL, seed=2).eval()
    tokens = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    with torch.no_grad():
        for fuse in (False, True):
            cache = KVCache(SMALL, 2, 12, "cpu", fuse=fuse)
            parts = [m(tokens[:, :5], cache)] + [m(tokens[:, i:i + 1], cache)
                                                  for i in range(5, 12)]
            out[fuse] = torch.cat(parts, 1)
            assert len(cache._weights) == (2 * SMALL.n_layers if fuse else 0)
    assert torch.equal(out[True], out[False])


def test_a_one_token_step_adds_its_residuals_in_its_products_with_the_same_numbers():
    """A cached one-token step adds each block's residual in the output products (one kernel
    instead of two on a GPU): on the CPU its logits equal those of the separate sums bit for
    bit, step after step; a prompt's forward (more than one row) keeps the separate sums."""
    from noloco.model import KVCache

    m = build(SMALL, seed=5).eval()
    tokens = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(3))
    out = {}
    with torch.no_grad():
        for fused in (False, True):
            cache = KVCache(SMALL, 1, 12, "cpu")
            cache.add_in_product = fused
            parts = [m(tokens[:, :5], cache)] + [m(tokens[:, i:i + 1], cache)
                                                  for i in range(5, 12)]
            out[fused] = torch.cat(parts, 1)
    assert torch.equal(out[True], out[False])


def test_a_cache_stacks_weights_only_for_a_model_small_enough():
    from noloco.model import KVCache

    assert KVCache(preset("small"), 1, 8, "meta").fuse  # 0.22 GiB of copies
    assert not KVCache(preset("medium"), 1, 8, "meta").fuse  # 3.1 GiB
    assert not KVCache(preset("small"), 1, 8, "meta", fuse=False).fuse


def test_a_cached_one_token_step_dispatches_a_bounded_count_of_operations():
    """A GPU's one-token step is bound by its count of kernels, not by its arithmetic (the
    H200 replayed ~450 small kernels a token in 1.3 ms), and CI has no GPU to time it: so
    the operations the step dispatches are counted here, on the CPU. Per layer: four matrix
    products (q|k|v, the output, gate|up, down; the last two adding the residual), one complex
    product rotating q and k, two cache writes, one attention; the positions' tables and mask
    once for the forward, not per layer. Views are free (no kernel) and not counted."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu import step_launches  # (what benchmarks/gpu.py records of a generated token)

    # 8 layers: one more operation a layer (8) is more than the bound's slack (3)
    args = preset("tiny", vocab_size=257, n_layers=8)
    m = build(args, seed=0).eval()
    n = args.n_layers
    got = step_launches(m, [0] * 5)  # a prompt of 5, a step, then the step counted
    ops = Counter(got["by_operation"])
    assert got["operations"] == sum(ops.values())
    # q|k|v and gate|up, and the output head; the output and down products add the residual
    assert ops["mm"] == 2 * n + 1 and ops["addmm"] == 2 * n and ops["add"] <= 1, ops
    assert ops["cat"] == 0, ops  # the stacked weights made once, by the prompt's forward
    assert ops["index_copy_"] == 2 * n, ops
    assert ops["complex"] == 1 and ops["masked_fill_"] == 1 and ops["index"] == 2, ops
    assert sum(v for k, v in ops.items() if "scaled_dot_product" in k) == n, ops
    # The rest: the norms (one fused kernel each on a GPU; on the CPU six operations), the
    # rotation, the SwiGLU's two: 22 a layer and 17 more, as counted with torch 2.13 (the
    # version CI installs; another may decompose the CPU's norm otherwise).
    assert sum(ops.values()) <= 22 * n + 20, (sum(ops.values()), ops)


def test_a_caches_buffers_are_aligned_for_gpu_attention_with_the_same_logits():
    """The buffers hold a multiple of 16 positions (within the context), so a GPU's attention
    takes the mask as it is instead of copying it padded in every layer; the slots past the
    cache's size are masked out: the logits are those of a cache of the exact size, and the
    size still bounds what may be written."""
    from noloco.model import ALIGN_SLOTS, KVCache

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=50, max_seq_len=40)
    assert ALIGN_SLOTS == 16
    assert [KVCache(args, 1, n, "cpu").k.size(-2) for n in (1, 12, 16, 17, 33, 40)] == [
        16, 16, 16, 32, 40, 40]  # (40: the context, not 48)
    m = build(args, seed=4).eval()
    tokens = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = KVCache(args, 1, 12, "cpu")
        parts = [m(tokens[:, :5], cache)]
        assert cache.mask(1, torch.float32).shape == (1, 16)
        parts += [m(tokens[:, i:i + 1], cache) for i in range(5, 12)]
        with pytest.raises(ValueError, match="do not fit a cache of 12"):
            m(tokens[:, :1], cache)
        full = m(tokens)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
