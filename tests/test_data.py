from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from noloco import data as D


def test_byte_tokenizer_round_trip():
    tok = D.ByteTokenizer()
    text = "Héllo, wörld — ✓\nline two"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.vocab_size == 257
    assert tok.decode(ids) == text


def test_hf_tokenizer_from_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    t = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(["to be or not to be that is the question"] * 20,
                          trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    t.save(str(tmp_path / "tokenizer.json"))
    tok = D.make_tokenizer(str(tmp_path))
    ids = tok.encode("to be or not")
    assert len(ids) > 0 and ids.max() < tok.vocab_size - 1
    assert tok.decode(ids).replace(" ", "") == "tobeornot"


def _corpus(tmp_path, n_files=30):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(n_files):
        (d / f"doc{i:03d}.txt").write_text(f"document {i} " * 50)
    return d


def test_directory_source_split_is_deterministic(tmp_path):
    d = _corpus(tmp_path)
    a = D.load_corpus(str(d), D.ByteTokenizer(), seq_len=16)
    b = D.load_corpus(str(d), D.ByteTokenizer(), seq_len=16)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.val.size > 0 and a.train.size > a.val.size
    names = [n for n, _ in D.path_documents(str(d))]
    assert names == sorted(names)


def test_single_file_source_holds_out_its_tail(corpus):
    c = D.load_corpus(str(corpus), D.ByteTokenizer(), seq_len=64)
    raw = corpus.read_bytes()
    assert c.train.size + c.val.size == len(raw) + 1  # plus the end-of-document token
    assert 0.04 < c.val.size / (c.train.size + c.val.size) < 0.06
    assert bytes(c.train[:100].astype(np.uint8)) == raw[:100]


def test_builtin_source_is_python_stdlib():
    c = D.load_corpus("builtin", D.ByteTokenizer(), seq_len=128, max_tokens=2_000_000)
    assert c.train.size > 1_000_000 and c.val.size > 10_000
    text = bytes(c.train[:200_000].astype(np.uint8)).decode("utf-8", "replace")
    assert "def " in text and "import " in text
    names = [n for n, _ in zip(D.builtin_documents(), range(50), strict=False)]
    assert names == sorted(names)
    assert not any("site-packages" in n for n, _ in names)


def test_hf_source_from_local_jsonl(tmp_path):
    pytest.importorskip("datasets")
    f = tmp_path / "rows.jsonl"
    with open(f, "w") as fh:
        for i in range(200):
            fh.write(json.dumps({"text": f"row number {i} says hello " * 5, "id": i}) + "\n")
    c = D.load_corpus(f"hf:{f}", D.ByteTokenizer(), seq_len=32)
    assert c.train.size + c.val.size > 200 * 100
    assert b"row number 0 says" in bytes(np.concatenate([c.train, c.val]).astype(np.uint8))


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(D.DataError, match="not found"):
        D.load_corpus(str(tmp_path / "nope.txt"), D.ByteTokenizer(), 16)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(D.DataError, match="empty corpus"):
        D.load_corpus(str(tmp_path / "empty.txt"), D.ByteTokenizer(), 16)
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(D.DataError, match="too small"):
        D.load_corpus(str(tmp_path / "short.txt"), D.ByteTokenizer(), 16)


def test_shards_are_disjoint_deterministic_and_equal_length():
    tokens = np.arange(10_000, dtype=np.uint16)
    world, seq = 4, 10
    seen = []
    for r in range(world):
        a = D.ShardedReader(tokens, seq, 5, rank=r, world=world, seed=7)
        b = D.ShardedReader(tokens, seq, 5, rank=r, world=world, seed=7)
        idx = a.indices(a.per_replica)
        assert idx == b.indices(b.per_replica)
        seen.append(set(idx))
        assert len(idx) == a.per_replica == D.num_sequences(tokens, seq) // world
    for i in range(world):
        for j in range(i + 1, world):
            assert not seen[i] & seen[j]
    # A different seed gives a different order.
    other = D.ShardedReader(tokens, seq, 5, rank=0, world=world, seed=8)
    assert other.indices(20) != D.ShardedReader(tokens, seq, 5, 0, world, 7).indices(20)


def test_batches_are_shifted_targets_and_reader_resumes_exactly():
    tokens = np.arange(5_000, dtype=np.uint16) % 251
    r = D.ShardedReader(tokens, 8, 4, rank=1, world=2, seed=0)
    x, y = r.next_batch()
    assert x.shape == y.shape == (4, 8)
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    for _ in range(200):  # cross an epoch boundary
        r.next_batch()
    state = r.state_dict()
    expect = [r.next_batch() for _ in range(5)]
    r2 = D.ShardedReader(tokens, 8, 4, rank=1, world=2, seed=0)
    r2.load_state_dict(state)
    for (ex, ey), (gx, gy) in zip(expect, (r2.next_batch() for _ in range(5)), strict=True):
        assert np.array_equal(ex.numpy(), gx.numpy()) and np.array_equal(ey.numpy(), gy.numpy())
    with pytest.raises(ValueError):
        D.ShardedReader(tokens, 8, 4, rank=0, world=2, seed=0).load_state_dict(state)


def test_validation_batches_are_fixed():
    tokens = np.arange(1_000, dtype=np.uint16)
    a = D.validation_batches(tokens, 16, 12, 4)
    b = D.validation_batches(tokens, 16, 12, 4)
    assert len(a) == 3
    for (ax, ay), (bx, by) in zip(a, b, strict=True):
        assert np.array_equal(ax.numpy(), bx.numpy()) and np.array_equal(ay.numpy(), by.numpy())


def test_validation_set_does_not_depend_on_the_batch_size():
    tokens = np.arange(1_000, dtype=np.uint16)  # 58 sequences of 16 + 1: 100 wrap around
    sets = {bs: D.validation_batches(tokens, 16, 100, bs) for bs in (1, 7, 16, 100, 128)}
    for bs, batches in sets.items():
        assert [len(x) for x, _ in batches][:-1] == [bs] * (len(batches) - 1)
        x = torch.cat([x for x, _ in batches])
        assert x.shape == (100, 16)
        assert torch.equal(x, torch.cat([x for x, _ in sets[1]]))
