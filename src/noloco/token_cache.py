"""Tokenise a corpus once per machine: a memory-mapped token file that every worker, every
respawned replica and every ``--resume`` maps read-only.

The file's name is a hash of everything the tokens depend on — the source (for local files:
each file's path, size and modification time; for the built-in corpus: the standard library's
files; for a ``hf:`` hub name: the name alone), the tokenizer (for a ``tokenizer.json``: its
bytes), ``seq_len`` (it decides the validation fallback), ``max_tokens``, ``val_fraction`` and
``allow_binary``. Layout::

    b"NOLOCOTK" | u32 version | u32 header length | header (JSON) | padding to 64 bytes
    | train tokens | validation tokens

The header repeats the key and holds the dtype, both lengths, the vocabulary size and a CRC-32
of the token bytes. A file is trusted only when its key, its size and its checksum all match;
anything else is rebuilt. Building happens under an exclusive ``flock`` on ``KEY.lock``, into a
temporary file renamed into place, so two runs (or two workers) at once never see a partial
file: the first builds, the others wait and map what it wrote.

Where the cache lives: ``$NOLOCO_TOKEN_CACHE`` (a directory, or ``off`` to tokenise in memory
as before), else ``$XDG_CACHE_HOME/noloco/tokens``, else ``~/.cache/noloco/tokens``. A cache
directory that cannot be written falls back to tokenising in memory.

Floor 1 of docs/architecture.md: a run's description.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from noloco.data import ByteTokenizer, Corpus, HFTokenizer, builtin_files, load_corpus
from noloco.rundir import atomic_write

MAGIC = b"NOLOCOTK"
VERSION = 1
ALIGN = 64


@dataclass
class CorpusLoad:
    """How this process got its corpus: tokenised it (and how long that took) or mapped it."""

    tokenized: bool
    seconds: float
    path: str | None
    """the cache file, or None when the cache is off"""


def cache_dir() -> Path | None:
    env = os.environ.get("NOLOCO_TOKEN_CACHE")
    if env:
        return None if env.lower() == "off" else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "noloco" / "tokens"


def _files_fingerprint(root: Path) -> list:
    if root.is_file():
        st = root.stat()
        return [[str(root.resolve()), st.st_size, st.st_mtime_ns]]
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            out.append([p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns])
    return [str(root.resolve()), out]


def source_fingerprint(source: str) -> object:
    if source == "builtin":
        root, files = builtin_files()
        return ["builtin", sys.version, str(root),
                [[p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns]
                 for p in files]]
    if source.startswith("hf:"):
        name = source[3:].partition(":")[0]
        local = Path(name)
        return [source, _files_fingerprint(local) if local.exists() else None]
    return _files_fingerprint(Path(source))


def tokenizer_fingerprint(tokenizer: ByteTokenizer | HFTokenizer) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return "bytes"
    p = Path(tokenizer.name)
    file = p / "tokenizer.json" if p.is_dir() else p
    return hashlib.sha256(file.read_bytes()).hexdigest()


def cache_key(source: str, tokenizer: ByteTokenizer | HFTokenizer, seq_len: int,
              max_tokens: int, val_fraction: float, allow_binary: bool) -> str:
    spec = json.dumps([VERSION, source_fingerprint(source), tokenizer_fingerprint(tokenizer),
                       tokenizer.vocab_size, seq_len, max_tokens, val_fraction, allow_binary])
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


def write(path: Path, key: str, corpus: Corpus) -> None:
    """The corpus's tokens to ``path`` (atomically: a temporary file renamed into place)."""
    data = [np.ascontiguousarray(corpus.train), np.ascontiguousarray(corpus.val)]
    crc = zlib.crc32(data[1], zlib.crc32(data[0]))
    header = json.dumps({"key": key, "dtype": corpus.train.dtype.str,
                         "n_train": int(corpus.train.size), "n_val": int(corpus.val.size),
                         "vocab_size": corpus.vocab_size, "source": corpus.source,
                         "crc32": crc}).encode()
    head = MAGIC + struct.pack("<II", VERSION, len(header)) + header
    head += b"\0" * (-len(head) % ALIGN)
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        f.write(head)
        for a in data:
            f.write(a.tobytes())


def read(path: Path, key: str) -> Corpus | None:
    """The corpus mapped read-only from ``path``; None if it is missing, of another key,
    truncated or its checksum fails (then the caller rebuilds it)."""
    try:
        with open(path, "rb") as f:
            fixed = f.read(len(MAGIC) + 8)
            if len(fixed) < len(MAGIC) + 8 or fixed[:len(MAGIC)] != MAGIC:
                return None
            version, n = struct.unpack("<II", fixed[len(MAGIC):])
            if version != VERSION or n > 1 << 20:
                return None
            h = json.loads(f.read(n))
        if h.get("key") != key:
            return None
        offset = len(fixed) + n
        offset += -offset % ALIGN
        dtype = np.dtype(h["dtype"])
        count = int(h["n_train"]) + int(h["n_val"])
        if path.stat().st_size != offset + count * dtype.itemsize:
            return None
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if zlib.crc32(tokens) != h["crc32"]:
        return None
    n_train = int(h["n_train"])
    return Corpus(train=tokens[:n_train], val=tokens[n_train:], vocab_size=int(h["vocab_size"]),
                  source=h["source"])


def cached_corpus(source: str, tokenizer: ByteTokenizer | HFTokenizer, seq_len: int,
                  max_tokens: int = 50_000_000, val_fraction: float = 0.05,
                  allow_binary: bool = False, directory: Path | None = None
                  ) -> tuple[Corpus, CorpusLoad]:
    """The same :class:`Corpus` as :func:`noloco.data.load_corpus`, from the machine's token
    cache (built first if it is missing or does not verify)."""
    t0 = time.perf_counter()

    def tokenize() -> Corpus:
        return load_corpus(source, tokenizer, seq_len, max_tokens, val_fraction, allow_binary)

    d = directory if directory is not None else cache_dir()
    if d is None:
        return tokenize(), CorpusLoad(True, time.perf_counter() - t0, None)
    key = cache_key(source, tokenizer, seq_len, max_tokens, val_fraction, allow_binary)
    path = d / f"{key}.tokens"
    corpus = read(path, key)  # the common case: built already, no lock needed
    if corpus is not None:
        return corpus, CorpusLoad(False, time.perf_counter() - t0, str(path))
    try:
        d.mkdir(parents=True, exist_ok=True)
        lock = open(d / f"{key}.lock", "a")  # noqa: SIM115 - held until the file is in place
    except OSError as e:
        print(f"noloco: note: token cache {d} is not writable ({e.strerror}); tokenising in "
              f"memory", file=sys.stderr)
        return tokenize(), CorpusLoad(True, time.perf_counter() - t0, None)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        corpus = read(path, key)  # built by another process while this one waited
        if corpus is not None:
            return corpus, CorpusLoad(False, time.perf_counter() - t0, str(path))
        if path.exists():
            print(f"noloco: note: token cache {path} does not verify; rebuilding it",
                  file=sys.stderr)
        built = tokenize()
        try:
            write(path, key, built)
        except OSError as e:
            print(f"noloco: note: cannot write token cache {path} ({e.strerror}); tokenising "
                  f"in memory", file=sys.stderr)
            return built, CorpusLoad(True, time.perf_counter() - t0, None)
        mapped = read(path, key)
    if mapped is None:  # pragma: no cover - the file just written does not read back
        return built, CorpusLoad(True, time.perf_counter() - t0, None)
    return mapped, CorpusLoad(True, time.perf_counter() - t0, str(path))
