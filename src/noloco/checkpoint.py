"""Checkpoints: atomic, verified, written in the background, resumed bit for bit.

Layout inside the run directory::

    checkpoints/step-00000150/rank-00003.safetensors  worker 3's whole state at inner step 150
    checkpoints/step-00000150/rank-00003.json         its receipt: bytes, sha256, config hash
    model/replica-0.safetensors                       final weights (the worker writes them)

Every worker (replica × stage) saves its own state: model, inner optimizer, the method's whole
state (slow weights, momentum, exchange counters, exchanges in flight), data position, RNG
streams, step and the run's accounting. The file is a safetensors file: raw tensors, and the
shape of the state tree as JSON in its header, so loading one runs no pickled code.

Writing: the worker copies its state (a memory copy, the only part the training loop waits
for) and a background thread writes it: temporary file, fsync, rename, directory fsync, then
the receipt the same way. A file without its receipt is an unfinished write; a file whose
bytes do not hash to its receipt is corrupt. Either way that checkpoint is not used.

Which checkpoint to resume: every worker verifies its own files, newest first, and the
workers agree on the newest step that verified on all of them (:func:`agree_on_step`). This
needs one small collective per candidate, so a crash in the middle of a save (some workers
finished step k, others not) falls back to step k − K on every worker alike.

Keeping ``keep`` checkpoints: a worker deletes its own file of step j only once ``keep``
newer steps are complete on *every* worker (each worker announces its finished writes in the
run's key-value store). Deleting on local knowledge alone would be unsafe: NoLoCo's workers
are not in lockstep, so one may finish step k while another has not yet begun it.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import numbers
import os
import re
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from noloco.rundir import atomic_write, fsync_dir, write_json_atomic

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def state_file(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.safetensors"


def receipt_file(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.json"


def steps_on_disk(root: Path) -> list[int]:
    """Step numbers of the checkpoint directories under ``root``, newest first."""
    if not Path(root).is_dir():
        return []
    steps = [int(m.group(1)) for d in Path(root).iterdir() if (m := _STEP_DIR.match(d.name))]
    return sorted(steps, reverse=True)


def complete_steps(root: Path, world: int) -> list[int]:
    """Steps for which every one of ``world`` workers left a receipt (newest first). Receipts
    are not verified here (see :func:`verify`); this is what an outside observer can tell."""
    return [s for s in steps_on_disk(root)
            if all(receipt_file(root, s, r).is_file() for r in range(world))]


def interrupted_line(out: Path | str, step: int, world: int, how: str = "interrupted",
                     note: str = "") -> str:
    """The one line of a run interrupted at ``step``: the resume command only where one works
    (every worker finished a checkpoint), and which steps it redoes when its checkpoint is
    older than ``step``; without a checkpoint, how to start again instead. ``how`` it
    stopped, and a ``note`` after the step."""
    newest = complete_steps(Path(out) / "checkpoints", world)
    if not newest:
        return (f"noloco: {how} at step {step}{note}, with no checkpoint to resume from; "
                f"start again with the same command and --overwrite")
    redo = (f"; its newest checkpoint is of step {newest[0]}: the resume redoes steps "
            f"{newest[0] + 1}-{step}" if newest[0] < step else "")
    return (f"noloco: {how} at step {step}{note}{redo}; continue with: noloco train --resume "
            f"{out}")


# ---- copying a state tree -------------------------------------------------------------------

def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


def _raw(t: torch.Tensor) -> Any:
    """A contiguous CPU tensor's bytes as a numpy array (no copy)."""
    return _bytes(t).numpy()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a uint8 tensor (no copy)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _fingerprint(t: torch.Tensor) -> tuple:
    """Shape, dtype and ~64 sampled values: equal tensors share it, most others do not."""
    flat = t.reshape(-1)
    sample = flat[:: max(1, flat.numel() // 64)].to("cpu")
    return (tuple(t.shape), t.dtype, _raw(sample).tobytes() if sample.numel() else b"")


@dataclass
class Snapshot:
    """A copy of a state tree in one flat block of memory, laid out as the file stores it."""

    tree: Any
    """the state tree, its tensors views into ``data`` (a tensor stored once may appear
    twice)"""
    data: torch.Tensor
    """uint8, page-aligned, a whole number of ``BLOCK`` bytes"""
    stored: list[torch.Tensor]
    """the distinct views, in the order of their bytes in ``data``"""
    offsets: list[int]
    """where each stored tensor's bytes begin in ``data``"""
    copied: Any = None
    """a CUDA event recorded after the device-to-host copies (None: copied already)"""

    def wait(self) -> None:
        """Block until ``data`` holds the copied bytes (the writer calls it first)."""
        if self.copied is not None:
            self.copied.synchronize()

    def span(self, k: int) -> tuple[int, int]:
        """First and past-the-end byte of stored tensor k in ``data``."""
        v = self.stored[k]
        return self.offsets[k], self.offsets[k] + v.numel() * v.element_size()


BLOCK = 4096
"""file offsets and sizes are whole blocks, as direct I/O wants"""
_ALIGN = 8
"""tensors start at multiples of the largest element size, as dtype views want"""


class SnapshotBuffer:
    """Copies a state tree into one flat block of memory, reused from save to save.

    - The block is mapped apart from the heap (``mmap``): copying hundreds of tensors into
      heap buffers fragmented the heap the training step allocates from, and made the step
      after the first save twice as slow.
    - From the second save on the copy goes to memory already mapped: no page faults.
    - A tensor equal to one copied before is copied and stored once (slow weights equal the
      fast weights right after an outer step): the tree holds that copy twice.
    - The block is laid out exactly as the file's data section, page-aligned, so the writer
      can hand it to the disk with direct I/O, bypassing the page cache (whose copying and
      write-back competed with training for cores and memory bandwidth).
    - A tree with CUDA tensors is copied into pinned host memory on a side stream, without
      the host waiting: the side stream starts after the work queued so far (the copy sees
      the state as of this call) and the training stream waits for the copy before any work
      queued after this call (an in-place update cannot overtake it). The writer waits for
      the copy's event. CUDA tensors are deduplicated by identity (the same memory), not by
      content: comparing contents would make the host wait for the device once per tensor.
    """

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self._data: torch.Tensor | None = None
        self._pinned = False
        self._side: Any = None
        """the side stream device-to-host copies run on (created on first use)"""

    def copy(self, tree: Any) -> Snapshot:
        unique: list[torch.Tensor] = []
        index: dict[int, int] = {}  # id of a tree tensor → index in ``unique``
        buckets: dict[tuple, list[int]] = {}

        def find(t: torch.Tensor) -> None:
            d = t.detach()
            # A CUDA tensor's key is its memory viewed alike: a match is the same bytes, with
            # no comparison (which would make the host wait for the device).
            key = _fingerprint(d) if not d.is_cuda else (
                "cuda", d.device.index, d.data_ptr(), tuple(d.shape), tuple(d.stride()), d.dtype)
            for k in buckets.get(key, ()):
                # Bytes, not values: -0.0 == 0.0, and a stored copy must be bit for bit.
                if d.is_cuda or torch.equal(_bytes(unique[k]), _bytes(d)):
                    index[id(t)] = k
                    return
            buckets.setdefault(key, []).append(len(unique))
            index[id(t)] = len(unique)
            unique.append(d)

        _map_tensors(tree, find)
        starts, offset = [], 0
        for t in unique:
            starts.append(offset)
            offset = -(-(offset + t.numel() * t.element_size()) // _ALIGN) * _ALIGN
        size = max(BLOCK, -(-offset // BLOCK) * BLOCK)
        devices = {t.device for t in unique if t.is_cuda}
        if len(devices) > 1:
            raise ValueError(f"a checkpoint's state lives on one device, not {sorted(devices)}")
        device = next(iter(devices), None)
        # (is_pinned() itself is not asked: on a machine with a GPU it would create a CUDA
        # context in a CPU worker)
        if self._data is None or self._data.numel() != size or self._pinned != (
                device is not None):
            self._pinned = device is not None
            if device is None:
                self._mm = mmap.mmap(-1, size)
                self._data = torch.frombuffer(self._mm, dtype=torch.uint8)
            else:  # page-locked: the copy runs at the link's speed and asynchronously
                self._mm = None
                # zeroed: the padding between tensors goes to disk too, and the host
                # allocator may hand back memory that held something else
                self._data = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
        data = self._data
        views = [data[b:b + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                 for t, b in zip(unique, starts, strict=True)]
        copied = None
        if device is None:
            for v, t in zip(views, unique, strict=True):
                v.copy_(t)
        else:
            copied = self._copy_from_device(device, views, unique)
        return Snapshot(_map_tensors(tree, lambda t: views[index[id(t)]]), data, views, starts,
                        copied)

    def _copy_from_device(self, device: torch.device, views: list[torch.Tensor],
                          unique: list[torch.Tensor]) -> Any:
        if self._side is None or self._side.device != device:
            self._side = torch.cuda.Stream(device)
        # Ordered against the current stream only: noloco queues all its work there (no
        # stream of its own but this one), so the state as of now is what that stream holds.
        train = torch.cuda.current_stream(device)
        self._side.wait_stream(train)
        with torch.cuda.stream(self._side):
            for v, t in zip(views, unique, strict=True):
                v.copy_(t, non_blocking=t.is_cuda)
        copied = torch.cuda.Event(blocking=True)  # the writer sleeps on it instead of spinning
        copied.record(self._side)
        train.wait_stream(self._side)
        return copied


# ---- the file format: safetensors, with the state tree's shape in its metadata ----------------

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}


def _encode(x: Any, ids: dict[int, int]) -> Any:
    """The tree as JSON, each tensor replaced by its index (``ids``: id of a tensor → index
    of its stored copy)."""
    if isinstance(x, torch.Tensor):
        return {"__tensor__": ids[id(x)]}
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, ids) for v in x]}
    if isinstance(x, list):
        return [_encode(v, ids) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: _encode(v, ids) for k, v in x.items()}
        return {"__dict__": [[_encode(k, ids), _encode(v, ids)] for k, v in x.items()]}
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    raise TypeError(f"a checkpoint cannot hold a {type(x).__name__}")


def _decode(x: Any, tensors: dict[int, torch.Tensor], used: set[int]) -> Any:
    """Inverse of :func:`_encode`. A tensor stored once for two places comes back as two
    tensors: a loader may keep what it gets (``Optimizer.load_state_dict`` does), and two
    optimizer moments sharing memory would corrupt each other."""
    if isinstance(x, list):
        return [_decode(v, tensors, used) for v in x]
    if isinstance(x, dict):
        if "__tensor__" in x:
            i = x["__tensor__"]
            if i in used:
                return tensors[i].clone()
            used.add(i)
            return tensors[i]
        if "__tuple__" in x:
            return tuple(_decode(v, tensors, used) for v in x["__tuple__"])
        if "__dict__" in x:
            return {_decode(k, tensors, used): _decode(v, tensors, used)
                    for k, v in x["__dict__"]}
        return {k: _decode(v, tensors, used) for k, v in x.items()}
    return x


def _header(snap: Snapshot) -> bytes:
    """The file's first block(s): the 8-byte length and the JSON header, space-padded to a
    whole number of blocks. Gaps between tensors are covered by ``pad.K`` entries, so the
    data section has no holes (a safetensors rule)."""
    ids = {id(v): k for k, v in enumerate(snap.stored)}
    meta = {"format": f"noloco-checkpoint/{FORMAT}", "tree": json.dumps(_encode(snap.tree, ids))}
    header: dict[str, Any] = {"__metadata__": meta}
    cursor, end = 0, 0
    for k, v in enumerate(snap.stored):
        if v.dtype not in _DTYPES:
            raise TypeError(f"a checkpoint cannot hold {v.dtype} tensors")
        begin, end = snap.span(k)
        if begin > cursor:
            header[f"pad.{k}"] = {"dtype": "U8", "shape": [begin - cursor],
                                  "data_offsets": [cursor, begin]}
        header[str(k)] = {"dtype": _DTYPES[v.dtype], "shape": list(v.shape),
                          "data_offsets": [begin, end]}
        cursor = end
    if snap.data.numel() > cursor:
        header["pad.end"] = {"dtype": "U8", "shape": [snap.data.numel() - cursor],
                             "data_offsets": [cursor, snap.data.numel()]}
    head = json.dumps(header).encode()
    head += b" " * (-(8 + len(head)) % BLOCK)
    return struct.pack("<Q", len(head)) + head


def write_state(path: Path, state: Any) -> tuple[int, str]:
    """Write a state tree (or a :class:`Snapshot` of one) to ``path`` atomically; returns
    (bytes, sha256).

    The file is a safetensors file (any safetensors reader opens it): the tensors, and the
    tree itself as JSON in the header's metadata. The data section is the snapshot's memory
    block, written in chunks, each hashed and written without holding the GIL; with direct
    I/O where the file system has it (not tmpfs)."""
    snap = state if isinstance(state, Snapshot) else SnapshotBuffer().copy(state)
    snap.wait()
    head = _header(snap)
    head_block = mmap.mmap(-1, len(head))  # page-aligned, as direct I/O wants
    head_block.write(head)
    parts = [memoryview(head_block), memoryview(snap.data.numpy())]
    with atomic_write(path) as tmp:
        try:
            return _write_parts(tmp, parts, direct=True)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return _write_parts(tmp, parts, direct=False)


def _write_parts(path: Path, parts: list[memoryview], direct: bool) -> tuple[int, str]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)
    sha, size = hashlib.sha256(), 0
    fd = os.open(path, flags, 0o644)
    try:
        for whole in parts:
            for begin in range(0, whole.nbytes, _CHUNK):
                view = whole[begin:begin + _CHUNK]
                sha.update(view)
                size += view.nbytes
                while view.nbytes:  # a write may write less than asked
                    view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return size, sha.hexdigest()


_CHUNK = 8 << 20


def read_state(data: bytes) -> Any:
    """The state tree of a file :func:`write_state` wrote (its bytes, already verified)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__")
    if meta.get("format") != f"noloco-checkpoint/{FORMAT}":
        raise ValueError(f"not a noloco checkpoint (format {meta.get('format')!r})")
    base = 8 + n
    tensors = {}
    for name, h in header.items():
        if not name.isdigit():
            continue  # padding
        begin, end = h["data_offsets"]
        t = torch.empty(h["shape"], dtype=_FROM_NAME[h["dtype"]])
        if end > begin:
            _raw(t)[:] = np.frombuffer(data, dtype=np.uint8, count=end - begin,
                                       offset=base + begin)
        tensors[int(name)] = t
    return _decode(json.loads(meta["tree"]), tensors, set())


def verify(root: Path, step: int, rank: int, config_hash: str) -> tuple[bytes | None, str]:
    """(the file's bytes, "") if worker ``rank``'s checkpoint of ``step`` is whole and belongs
    to this config, else (None, why not)."""
    pt, receipt = state_file(root, step, rank), receipt_file(root, step, rank)
    try:
        meta = json.loads(receipt.read_text())
    except FileNotFoundError:
        return None, f"{pt.name} was never finished (no receipt)"
    except (OSError, ValueError):
        return None, f"{receipt.name} is unreadable"
    if meta.get("config_hash") != config_hash:
        return None, "it was saved by a run with other settings"
    try:
        data = pt.read_bytes()
    except OSError as e:
        return None, f"{pt.name} is unreadable ({e.strerror})"
    if len(data) != meta.get("bytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return None, f"{pt.name} is corrupt (its bytes do not match the receipt's sha256)"
    return data, ""


def agree_on_step(root: Path, rank: int, config_hash: str,
                  gather: Callable[[int], list[int]],
                  report: Callable[[str], None] | None = None) -> tuple[int | None, Any]:
    """The newest step whose checkpoint verifies on every worker, and this worker's state of
    it (None, None when there is none). Collective: every worker calls it, and ``gather(x)``
    must return every worker's ``x``.

    Each round, every worker proposes its newest verified step not above the bound (at first
    none); when all proposals are equal that is the answer, else their minimum becomes the
    bound. Proposals only go down and each is verified by its proposer, and every worker sees
    the same proposals, so all leave the loop in the same round with the same step."""
    steps = steps_on_disk(root)
    verified: dict[int, bytes] = {}
    failed: set[int] = set()
    bound = None
    while True:
        mine = -1
        for s in steps:
            if (bound is not None and s > bound) or s in failed:
                continue
            if s not in verified:
                data, why = verify(root, s, rank, config_hash)
                if data is None:
                    failed.add(s)
                    if report:
                        report(f"checkpoint {step_dir(root, s).name}: {why}")
                    continue
                verified = {s: data}  # hold the bytes of one candidate at a time
            mine = s
            break
        proposals = gather(mine)
        if min(proposals) == max(proposals):
            break
        bound = min(proposals)
    if mine < 0:
        return None, None
    return mine, read_state(verified[mine])


# ---- the background writer ------------------------------------------------------------------

class Checkpointer:
    """Saves this worker's checkpoints every ``every`` inner steps (0: never), or about every
    ``every_seconds`` of the loop.

    ``store`` (a c10d Store shared by the workers, optional for one worker) carries the
    "finished" announcements that make pruning safe; see the module docstring.

    A cadence in time must still name the same steps on every worker (a checkpoint is one
    step, everywhere). So it is planned in steps: at a planning step every worker measures
    its seconds per step since the last plan, the workers agree on the slowest (``agree``:
    a max over them, collective), and the next save is the step that many seconds ahead,
    rounded to a multiple of ``align`` (the outer step: a save between outer steps holds a
    sync in flight) and at least one ``align`` away. Each save is also the next planning
    step, so the cadence follows the run's speed. The first plan comes after
    :data:`PROBE_STEPS` steps (rounded up to ``align``) and saves nothing.
    """

    PROBE_STEPS = 20

    def __init__(self, root: Path, rank: int, world: int, config_hash: str, every: int,
                 keep: int = 2, store: Any = None, every_seconds: float | None = None,
                 align: int = 1) -> None:
        self.root, self.rank, self.world = Path(root), rank, world
        self.config_hash, self.every, self.keep = config_hash, every, max(1, keep)
        self.every_seconds, self.align = every_seconds, max(1, align)
        self.saved_step: int | None = None
        """the step of the newest save started (its write may still run)"""
        self.next_due: int | None = None
        """time cadence: the step of the next save (None: not planned yet)"""
        self._plan_at: int | None = None
        self._plan_from: tuple[int, float] = (0, 0.0)
        self.store = store
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._buffer = SnapshotBuffer()
        """the copy of the state being written, reused by the next save (which waits for
        that write first)"""
        self.saves = 0
        self.last_step: int | None = None
        """newest step whose write finished on this worker"""
        self.bytes = 0
        """size of the newest checkpoint file of this worker"""
        self.blocked_seconds = 0.0
        """seconds the training loop waited for checkpointing (copy + an unfinished write)"""
        self.write_seconds = 0.0
        """seconds the background thread spent writing"""
        self.final_wait_seconds = 0.0
        """seconds the end of the run waited for the last write (once per run)"""

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.every_seconds is not None

    def due(self, step: int) -> bool:
        """Whether the loop saves after ``step``. In time, at or past the planned step: an
        elastic replica that healed jumps to its donor's step, perhaps past it."""
        if self.every_seconds is not None:
            return self.next_due is not None and step >= self.next_due
        return self.every > 0 and step % self.every == 0

    def start(self, step: int, now: float) -> None:
        """Time cadence: the loop starts (or resumes) at ``step``; the first plan is due
        :data:`PROBE_STEPS` steps on, at a multiple of ``align``."""
        if self.every_seconds is not None:
            first = step + self.PROBE_STEPS
            self._plan_at = -(-first // self.align) * self.align
            self._plan_from = (step, now)

    def plan(self, step: int, now: float, agree: Callable[[float], float]) -> None:
        """At the planning step (every worker alike): fix the next save (class docstring).
        ``agree(x)`` returns the max of every worker's ``x``."""
        if self.every_seconds is None or self._plan_at is None or step < self._plan_at:
            return
        s0, t0 = self._plan_from
        per_step = agree((now - t0) / max(step - s0, 1))
        steps = self.every_seconds / max(per_step, 1e-9)
        k = max(1, round(steps / self.align))
        self.next_due = self._plan_at = step + k * self.align
        self._plan_from = (step, now)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Copy ``state`` now and write it in the background (after the previous write)."""
        self.saved_step = step
        t0 = time.perf_counter()
        self.wait()
        snap = self._buffer.copy(state)
        self.blocked_seconds += time.perf_counter() - t0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="noloco-ckpt")
        self._pending = self._pool.submit(self._write, step, snap)

    def poll(self) -> None:
        """Raise the error of a background write that failed (cheap: call every step)."""
        if self._pending is not None and self._pending.done():
            fut, self._pending = self._pending, None
            fut.result()

    def wait(self) -> None:
        """Wait for the write in flight (if any); raise its error."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()

    def close(self, wait: bool = True) -> None:
        try:
            if wait:
                self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=wait, cancel_futures=not wait)
                self._pool = None

    def _write(self, step: int, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        d = step_dir(self.root, step)
        new_dir = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        if new_dir:
            fsync_dir(self.root)
        size, sha = write_state(state_file(self.root, step, self.rank), snap)
        write_json_atomic(receipt_file(self.root, step, self.rank), {
            "format": FORMAT, "step": step, "rank": self.rank, "world": self.world,
            "bytes": size, "sha256": sha, "config_hash": self.config_hash,
            "saved_at": time.time()})
        # Read by the training thread only after wait(): no lock needed.
        self.saves += 1
        self.bytes = size
        self.last_step = step
        self.write_seconds += time.perf_counter() - t0
        self._announce(step)
        self.prune()

    # ---- which checkpoints are complete everywhere ------------------------------------------
    def _key(self, step: int, rank: int) -> str:
        return f"noloco/ckpt/{self.config_hash}/{step}/{rank}"

    def _announce(self, step: int) -> None:
        if self.store is not None and self.world > 1:
            with contextlib.suppress(Exception):  # pruning waits; never fail a run over it
                self.store.set(self._key(step, self.rank), "1")

    def _complete_everywhere(self, step: int) -> bool:
        if self.world == 1:
            return True
        if self.store is None:
            return False
        try:
            return bool(self.store.check([self._key(step, r) for r in range(self.world)]))
        except Exception:  # noqa: BLE001 - a store that went away: keep everything
            return False

    def prune(self) -> None:
        """Delete this worker's files of checkpoints older than the newest ``keep`` complete
        ones (finished or not: an unfinished write of an old step is never needed). Runs
        after every write; call it once more when every worker has finished its last write
        (a barrier), which only then are all known complete."""
        steps = steps_on_disk(self.root)
        mine = [s for s in steps if receipt_file(self.root, s, self.rank).is_file()]
        complete = [s for s in mine if self._complete_everywhere(s)]
        if len(complete) < self.keep:
            return
        oldest_kept = complete[self.keep - 1]
        for s in steps:
            if s < oldest_kept:
                for f in (receipt_file(self.root, s, self.rank),
                          state_file(self.root, s, self.rank)):
                    with contextlib.suppress(OSError):
                        f.unlink()  # the receipt first: a file without one is never used
                with contextlib.suppress(OSError):
                    step_dir(self.root, s).rmdir()  # the last worker out removes it

    def report(self) -> dict[str, Any]:
        return {"checkpoint_every": self.every, "checkpoint_every_seconds": self.every_seconds,
                "checkpoint_saves": self.saves,
                "checkpoint_bytes": self.bytes,
                "checkpoint_blocked_seconds": self.blocked_seconds,
                "checkpoint_write_seconds": self.write_seconds,
                "checkpoint_final_wait_seconds": self.final_wait_seconds,
                "newest_checkpoint_step": self.last_step}


# ---- RNG streams ------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Every random stream a worker may draw from (torch CPU and CUDA, numpy, Python)."""
    import random

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")),
                     "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"],
                         n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- final weights ----------------------------------------------------------------------------

MODEL_DIR = "model"


def save_weights(path: Path, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, written atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        try:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                      str(tmp), metadata=metadata)
        except Exception as e:  # safetensors reports an I/O error as its own type
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None


def shard_name(name: str, stage: int, stages: int) -> str:
    """``replica-0.safetensors``, or ``replica-0.stage-1.safetensors`` for pipeline stages."""
    return f"{name}.safetensors" if stages == 1 else f"{name}.stage-{stage}.safetensors"


def write_model_index(run_dir: Path, model_args: Any, names: list[str], stages: int,
                      extra: dict[str, Any]) -> None:
    """``model/model.json``: how to rebuild the model and which files hold each version."""
    files = {n: [shard_name(n, s, stages) for s in range(stages)] for n in names}
    write_json_atomic(Path(run_dir) / MODEL_DIR / "model.json", {
        "format": "noloco-model/1",
        "model_args": asdict(model_args) if model_args is not None else None, "files": files,
        "default": "average" if "average" in files else names[0], **extra})


def load_model(path: Path | str, which: str | None = None) -> torch.nn.Module:
    """The trained model of a run directory (or its ``model/`` directory): ``which`` is
    ``"average"`` (the replicas' mean, where saved), ``"replica-K"``, or None for the
    default (the average if there is one, else replica 0)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from noloco.errors import ConfigError
    from noloco.model import ModelArgs, Transformer

    path = Path(path)
    model_dir = path / MODEL_DIR if (path / MODEL_DIR / "model.json").is_file() else path
    index_path = model_dir / "model.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"no trained model in {path} (model/model.json is missing)")
    index = json.loads(index_path.read_text())
    which = which or index["default"]
    if which not in index["files"]:
        raise KeyError(f"{path} has no model {which!r} (choose from "
                       f"{', '.join(index['files'])})")
    state: dict[str, torch.Tensor] = {}
    for f in index["files"][which]:
        try:
            state.update(load_file(str(model_dir / f)))
        except (OSError, SafetensorError) as e:  # truncated, overwritten or gone
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise ConfigError(f"cannot read model weights {model_dir / f}: {why}") from None
    if not index["model_args"]:  # a Hugging Face model (--hf-model)
        from noloco.hf import from_config_dict

        hf_model = from_config_dict(index["hf_config"])
        missing, _ = hf_model.load_state_dict(state, strict=False)
        hf_model.hf.tie_weights()  # tied weights are saved once
        tied = ({n for n, _ in hf_model.named_parameters(remove_duplicate=False)}
                - {n for n, _ in hf_model.named_parameters()})  # aliases of a saved weight
        if set(missing) - tied:
            raise ValueError(f"{path}: the saved weights lack {sorted(set(missing))[:3]}")
        return hf_model
    with torch.device("meta"):
        model = Transformer(ModelArgs(**index["model_args"]))
    model.load_state_dict(state, strict=True, assign=True)
    return model
