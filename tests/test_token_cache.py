"""The machine's token file: the same tokens as tokenising in memory, built once (also when
several processes ask at once), rebuilt when its source changes or it does not verify, and
training on it is bit-identical to training without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from run_utils import summary, train

from noloco.cli import main
from noloco.data import ByteTokenizer, load_corpus
from noloco.rundir import TMP_SUFFIX
from noloco.token_cache import cache_key, cached_corpus, read


def corpus_dir(tmp_path: Path) -> Path:
    d = tmp_path / "texts"
    d.mkdir()
    for i in range(30):
        (d / f"doc{i:02d}.txt").write_text(f"document {i}: " + "lorem ipsum dolor " * (40 + i))
    return d


def same(a, b) -> bool:
    return a.dtype == b.dtype and np.array_equal(a, b)


def test_cached_tokens_are_the_tokens_and_map_read_only(tmp_path):
    src = corpus_dir(tmp_path)
    ref = load_corpus(str(src), ByteTokenizer(), 64)
    first, load1 = cached_corpus(str(src), ByteTokenizer(), 64, directory=tmp_path / "c")
    again, load2 = cached_corpus(str(src), ByteTokenizer(), 64, directory=tmp_path / "c")
    assert load1.tokenized and not load2.tokenized and load1.path == load2.path
    for c in (first, again):
        assert same(c.train, ref.train) and same(c.val, ref.val)
        assert c.vocab_size == ref.vocab_size and c.source == ref.source
    assert isinstance(again.train, np.memmap)
    with pytest.raises(ValueError):  # read-only: no worker can change another's tokens
        again.train[0] = 1
    # other limits, another file; off: in memory, nothing written
    _, other = cached_corpus(str(src), ByteTokenizer(), 32, directory=tmp_path / "c")
    assert other.tokenized and other.path != load1.path
    os.environ["NOLOCO_TOKEN_CACHE"], saved = "off", os.environ.get("NOLOCO_TOKEN_CACHE")
    try:
        c, off = cached_corpus(str(src), ByteTokenizer(), 64)
    finally:
        os.environ["NOLOCO_TOKEN_CACHE"] = saved
    assert off.tokenized and off.path is None and same(c.train, ref.train)


def test_a_changed_source_gets_a_new_key(tmp_path):
    src = corpus_dir(tmp_path)
    before = cache_key(str(src), ByteTokenizer(), 64, 1000, 0.05, False)
    assert before == cache_key(str(src), ByteTokenizer(), 64, 1000, 0.05, False)
    time.sleep(0.01)
    (src / "doc03.txt").write_text("changed")
    assert cache_key(str(src), ByteTokenizer(), 64, 1000, 0.05, False) != before
    c, load = cached_corpus(str(src), ByteTokenizer(), 64, directory=tmp_path / "c")
    ref = load_corpus(str(src), ByteTokenizer(), 64)
    assert same(c.train, ref.train)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "other-key"])
def test_a_file_that_does_not_verify_is_rebuilt_never_trusted(tmp_path, capfd, damage):
    src = corpus_dir(tmp_path)
    ref = load_corpus(str(src), ByteTokenizer(), 64)
    _, load = cached_corpus(str(src), ByteTokenizer(), 64, directory=tmp_path / "c")
    path = Path(load.path)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-10] ^= 0xFF  # one token of the validation stream
    elif damage == "truncate":
        raw = raw[:-2]
    elif damage == "header":
        raw[3] ^= 0xFF
    else:
        raw = raw.replace(path.stem.encode(), b"0" * len(path.stem), 1)
    path.write_bytes(bytes(raw))
    key = path.stem
    assert read(path, key) is None
    capfd.readouterr()
    c, again = cached_corpus(str(src), ByteTokenizer(), 64, directory=tmp_path / "c")
    assert again.tokenized and same(c.train, ref.train) and same(c.val, ref.val)
    assert "does not verify; rebuilding" in capfd.readouterr().err
    assert read(path, key) is not None


CONCURRENT = """
import json, sys, time
from pathlib import Path
from noloco.data import ByteTokenizer
from noloco.token_cache import cached_corpus
while time.time() < float(sys.argv[3]):
    time.sleep(0.001)
c, load = cached_corpus(sys.argv[1], ByteTokenizer(), 64, directory=Path(sys.argv[2]))
print(json.dumps({"tokenized": load.tokenized, "sum": int(c.train.sum()) + int(c.val.sum())}))
"""


@pytest.mark.slow("concurrent processes")
@pytest.mark.timeout(120)
def test_processes_asking_at_once_build_it_once(tmp_path):
    src = corpus_dir(tmp_path)
    ref = load_corpus(str(src), ByteTokenizer(), 64)
    go = time.time() + 3.0  # every process has imported torch by then
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(src), str(tmp_path / "c"),
                               str(go)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [json.loads(p.communicate(timeout=100)[0]) for p in procs]
    assert sum(o["tokenized"] for o in outs) == 1, outs
    assert {o["sum"] for o in outs} == {int(ref.train.sum()) + int(ref.val.sum())}
    left = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert [n for n in left if n.endswith(TMP_SUFFIX)] == [] and len(left) == 2  # file, lock


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(300)
def test_training_on_the_token_file_is_bit_identical(tmp_path, corpus, monkeypatch):
    import torch
    from safetensors.torch import load_file

    args = ["--method", "noloco", "--replicas", "2", "--sync-every", "4", "--steps", "8",
            "--eval-every", "4", "--checkpoint-every", "4"]
    monkeypatch.setenv("NOLOCO_TOKEN_CACHE", "off")
    assert train(tmp_path / "off", corpus, *args) == 0
    monkeypatch.setenv("NOLOCO_TOKEN_CACHE", str(tmp_path / "cache"))
    assert train(tmp_path / "on", corpus, *args) == 0
    off, on = summary(tmp_path / "off"), summary(tmp_path / "on")
    assert on["final_val_loss_per_replica"] == off["final_val_loss_per_replica"]
    for f in ("replica-0.safetensors", "replica-1.safetensors"):
        a, b = (load_file(str(tmp_path / r / "model" / f)) for r in ("off", "on"))
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the launcher tokenised once; both workers mapped its file
    st = on["startup"]
    assert st["launcher_tokenized"] and st["workers_tokenized"] == 0 and st["workers"] == 2
    assert st["tokenize_seconds"] == st["launcher_seconds"] > 0
    assert off["startup"]["workers_tokenized"] == 2 and off["startup"]["token_cache"] is None
    # a resumed run maps it too: nobody tokenises
    assert main(["train", "--resume", str(tmp_path / "on"), "--steps", "12"]) == 0
    st = summary(tmp_path / "on")["startup"]
    assert not st["launcher_tokenized"] and st["workers_tokenized"] == 0
    assert st["tokenize_seconds"] == 0
