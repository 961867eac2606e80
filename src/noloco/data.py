"""Tokenizers, corpora and the sharded, resumable stream of packed training sequences.

A corpus is a list of documents, each tokenized and joined into one token stream with an
end-of-document token; a fixed set of documents (chosen by a hash of their name, so the split
never depends on order or on the machine) is held out for validation. The stream is cut into
non-overlapping sequences of ``seq_len + 1`` tokens (inputs and shifted targets).

Replica r of N reads a disjoint shard: each epoch all sequences are permuted with a seed every
replica knows, and replica r takes every N-th. The reader's whole position is two integers
(epoch, cursor) behind ``state_dict()``, so a resumed run continues with the exact next batch.

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from noloco.errors import plural

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text", ".json", ".jsonl", ".csv", ".tex",
                 ".html", ".xml", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ""}
VAL_MODULUS = 20  # one document in 20 (by name hash) is validation
MAX_INVALID_UTF8 = 0.02
"""a file with a larger share of bytes that are not UTF-8 is refused (without --allow-binary)"""


class DataError(ValueError):
    """Missing, empty or unreadable data (reported as one line, exit code 2)."""


# ---- tokenizers ---------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes are the tokens (0..255); 256 marks the end of a document. No download."""

    vocab_size = 257
    eos_id = 256
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(
            np.int32
        )

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local path (a tokenizer.json file or a folder)."""

    def __init__(self, path: str) -> None:
        p = Path(path)
        if not p.exists():
            raise DataError(f"tokenizer path not found: {path}")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("HF tokenizers need the 'hf' extra: pip install 'noloco[hf]'") from None
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise DataError(f"no tokenizer.json in {path}")
        self._tok = Tokenizer.from_file(str(file))
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size() + 1
        self.eos_id = self.vocab_size - 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eos_id])


def make_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


# ---- documents ----------------------------------------------------------------------------

def builtin_documents() -> Iterator[tuple[str, str]]:
    """Python's own standard library sources: present on every machine that runs Python.

    Deterministic order (sorted relative paths); installed third-party packages and the
    regression-test package are left out so the corpus is the same on every install of one
    Python version.
    """
    root, files = builtin_files()
    for p in files:
        yield str(p.relative_to(root).as_posix()), p.read_text(encoding="utf-8", errors="replace")


def builtin_files() -> tuple[Path, list[Path]]:
    """The standard library's directory and the files of the built-in corpus, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip]  # never walk into installed packages
        files.extend(Path(d) / n for n in names if n.endswith(".py"))
    return root, sorted(files)


def path_documents(path: str, allow_binary: bool = False) -> Iterator[tuple[str, str]]:
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path not found: {path}")
    if p.is_file():
        yield p.name, _read_text(p, allow_binary)
        return
    files = sorted(
        f for f in p.rglob("*")
        if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES and not f.name.startswith(".")
    )
    if not files:
        raise DataError(f"no text files in directory {path}")
    for f in files:
        yield str(f.relative_to(p).as_posix()), _read_text(f, allow_binary)


def _read_text(p: Path, allow_binary: bool = False) -> str:
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {p}: {e.strerror}") from None
    text = raw.decode("utf-8", errors="replace")
    if not allow_binary and raw:
        invalid = len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))
        if invalid > MAX_INVALID_UTF8 * len(raw):
            raise DataError(f"{p} is not text: {invalid / len(raw):.0%} of its bytes are not "
                            f"UTF-8 (pass --allow-binary to train on it anyway)")
    return text


def hf_documents(spec: str, split: str = "train") -> Iterator[tuple[str, str]]:
    """``hf:NAME[:CONFIG]`` through `datasets` in streaming mode; NAME may be a hub id or a
    local dataset folder or file. Rows give their ``text`` column (else the first string one)."""
    try:
        import datasets
    except ImportError:
        raise DataError("hf: data needs the 'hf' extra: pip install 'noloco[hf]'") from None
    name, _, config = spec[3:].partition(":")
    if not name:
        raise DataError("hf: data needs a name, as in hf:NAME[:CONFIG]")
    kwargs = {}
    local = Path(name)
    if local.is_file():
        kind = {".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv",
                ".parquet": "parquet"}.get(local.suffix.lower())
        if kind is None:
            raise DataError(f"cannot tell the format of {name}")
        name, kwargs = kind, {"data_files": {"train": str(local)}}
    try:
        ds = datasets.load_dataset(name, config or None, split=split, streaming=True, **kwargs)
    except Exception as e:  # datasets raises many types; one line is enough for the user
        raise DataError(f"cannot load dataset {spec!r}: {str(e).splitlines()[0]}") from None
    for i, row in enumerate(ds):
        text = row.get("text")
        if not isinstance(text, str):
            text = next((v for v in row.values() if isinstance(v, str)), None)
        if text:
            yield f"{i}", text


def documents(source: str, allow_binary: bool = False) -> Iterator[tuple[str, str]]:
    if source == "builtin":
        return builtin_documents()
    if source.startswith("hf:"):
        return hf_documents(source)
    return path_documents(source, allow_binary)


# ---- corpus -------------------------------------------------------------------------------

@dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str

    @property
    def tokens(self) -> int:
        return int(self.train.size + self.val.size)


def is_validation(name: str) -> bool:
    return zlib.crc32(name.encode()) % VAL_MODULUS == 0


def load_corpus(source: str, tokenizer: ByteTokenizer | HFTokenizer, seq_len: int,
                max_tokens: int = 50_000_000, val_fraction: float = 0.05,
                allow_binary: bool = False) -> Corpus:
    """Tokenize a source into train and validation streams.

    Validation documents are picked by name hash; when that leaves either side without a full
    sequence (a single file, a few files), the last ``val_fraction`` of the stream (at least a
    few sequences) is held out instead. Both rules are deterministic.
    """
    train_parts: list[np.ndarray] = []
    val_parts: list[np.ndarray] = []
    total = 0
    eos = np.asarray([tokenizer.eos_id], dtype=np.int32)
    for name, text in documents(source, allow_binary):
        ids = tokenizer.encode(text)
        if ids.size == 0:
            continue
        (val_parts if is_validation(name) else train_parts).extend((ids, eos))
        total += ids.size + 1
        if total >= max_tokens:
            break
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.int32
    train = np.concatenate(train_parts).astype(dtype) if train_parts else np.zeros(0, dtype)
    val = np.concatenate(val_parts).astype(dtype) if val_parts else np.zeros(0, dtype)
    if train.size + val.size == 0:
        raise DataError(f"empty corpus: {source} holds no text")
    need = seq_len + 1
    if train.size < need or val.size < need:
        stream = np.concatenate([train, val])
        n_val = max(int(stream.size * val_fraction), 2 * need)
        if stream.size < n_val + need:
            raise DataError(
                f"corpus too small: {stream.size} tokens cannot hold training and validation "
                f"sequences of {seq_len} tokens"
            )
        train, val = stream[:-n_val], stream[-n_val:]
    return Corpus(train=train, val=val, vocab_size=tokenizer.vocab_size, source=source)


def num_sequences(tokens: np.ndarray, seq_len: int) -> int:
    return max((tokens.size - 1) // seq_len, 0)


def sequence(tokens: np.ndarray, seq_len: int, i: int) -> np.ndarray:
    return tokens[i * seq_len: i * seq_len + seq_len + 1]


def stack_batch(tokens: np.ndarray, seq_len: int, idx: Iterable[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([sequence(tokens, seq_len, int(i)) for i in idx]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class ShardedReader:
    """Replica ``rank`` of ``world``'s endless, disjoint stream of training batches.

    Every epoch draws a permutation of all sequences from ``seed + epoch`` (the same on every
    replica, no communication) and gives replica r the entries r, r + N, ... — cut to the same
    length on every replica so all replicas take the same number of steps per epoch.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, rank: int = 0,
                 world: int = 1, seed: int = 0) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world, self.seed = rank, world, seed
        self.per_replica = num_sequences(tokens, seq_len) // world
        if self.per_replica < 1:
            raise DataError(
                f"training data holds {num_sequences(tokens, seq_len)} sequences of {seq_len} "
                f"tokens: too few for {plural(world, 'replica')}"
            )
        self.epoch, self.cursor = 0, 0
        self._order = self._shard(0)

    def _shard(self, epoch: int) -> np.ndarray:
        g = np.random.default_rng([self.seed, epoch])
        perm = g.permutation(num_sequences(self.tokens, self.seq_len))
        # (a copy: a view would keep the whole permutation alive in every reader, N of them
        # in one process when a simulation holds every replica's)
        return perm[self.rank:: self.world][: self.per_replica].copy()

    def indices(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            if self.cursor >= self.per_replica:
                self.epoch += 1
                self.cursor = 0
                self._order = self._shard(self.epoch)
            take = min(count - len(out), self.per_replica - self.cursor)
            out.extend(self._order[self.cursor: self.cursor + take].tolist())
            self.cursor += take
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return stack_batch(self.tokens, self.seq_len, self.indices(self.batch_size))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "rank": self.rank,
                "world": self.world, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if (sd["rank"], sd["world"], sd["seed"]) != (self.rank, self.world, self.seed):
            raise ValueError("reader state belongs to another rank, world size or seed")
        self.epoch, self.cursor = int(sd["epoch"]), int(sd["cursor"])
        self._order = self._shard(self.epoch)


def validation_batches(tokens: np.ndarray, seq_len: int, sequences: int, batch_size: int
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation set: the first ``sequences`` sequences (wrapping when the validation
    text holds fewer), identical for every replica and every batch size, cut into batches of
    at most ``batch_size`` (only memory depends on it; the loss weights each sequence alike)."""
    n = num_sequences(tokens, seq_len)
    if n < 1:
        raise DataError(f"validation data is shorter than one sequence of {seq_len} tokens")
    idx = [i % n for i in range(sequences)]
    return [stack_batch(tokens, seq_len, idx[b:b + batch_size])
            for b in range(0, sequences, batch_size)]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
