"""Checkpoints: atomic, verified, written in the background, resumed bit for bit.

Layout inside the run directory::

    checkpoints/step-00000150/rank-00003.pt     the whole state of worker 3 at inner step 150
    checkpoints/step-00000150/rank-00003.json   its receipt: bytes, sha256, config hash
    model/replica-0.safetensors                 final weights (see :func:`save_final_weights`)

Every worker (replica × stage) saves its own state: model, inner optimizer, the method's whole
state (slow weights, momentum, exchange counters, exchanges in flight), data position, RNG
streams, step and the run's accounting. Tensors go through ``torch.save`` and are read back
with ``torch.load(weights_only=True)``: no pickled code ever runs on load.

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
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from noloco.rundir import atomic_write, fsync_dir, write_json_atomic

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def state_file(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.pt"


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


# ---- state trees --------------------------------------------------------------------------

def snapshot(tree: Any) -> Any:
    """A deep copy of a state tree with every tensor copied to CPU memory: what the
    background writer may read while training changes the originals."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(snapshot(v) for v in tree)
    return tree


def tree_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tree_bytes(v) for v in tree)
    return 0


class _HashingWriter:
    """A file object that hashes what passes through it (no second read of a big file)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None
        """the write error torch.save would otherwise hide behind a RuntimeError"""

    def write(self, b: Any) -> int:
        view = memoryview(b)
        self.sha.update(view)
        self.size += view.nbytes
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def write_state(path: Path, tree: Any) -> tuple[int, str]:
    """``torch.save`` to ``path`` atomically; returns (bytes, sha256)."""
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        w = _HashingWriter(f)
        try:
            torch.save(tree, w)
        except RuntimeError:
            if w.error is not None:  # a full disk, not a bug: say so
                raise OSError(w.error.errno, w.error.strerror, str(path)) from None
            raise
    return w.size, w.sha.hexdigest()


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


def read_state(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


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
    """Saves this worker's checkpoints every ``every`` inner steps (0: never).

    ``store`` (a c10d Store shared by the workers, optional for one worker) carries the
    "finished" announcements that make pruning safe; see the module docstring.
    """

    def __init__(self, root: Path, rank: int, world: int, config_hash: str, every: int,
                 keep: int = 2, store: Any = None) -> None:
        self.root, self.rank, self.world = Path(root), rank, world
        self.config_hash, self.every, self.keep = config_hash, every, max(1, keep)
        self.store = store
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self.saves = 0
        self.last_step: int | None = None
        """newest step whose write finished on this worker"""
        self.bytes = 0
        """size of the newest checkpoint file of this worker"""
        self.blocked_seconds = 0.0
        """seconds the training loop waited for checkpointing (copy + an unfinished write)"""
        self.write_seconds = 0.0
        """seconds the background thread spent writing"""

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Copy ``state`` now and write it in the background (after the previous write)."""
        t0 = time.perf_counter()
        self.wait()
        tree = snapshot(state)
        self.blocked_seconds += time.perf_counter() - t0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="noloco-ckpt")
        self._pending = self._pool.submit(self._write, step, tree)

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

    def _write(self, step: int, tree: Any) -> None:
        t0 = time.perf_counter()
        d = step_dir(self.root, step)
        new_dir = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        if new_dir:
            fsync_dir(self.root)
        size, sha = write_state(state_file(self.root, step, self.rank), tree)
        write_json_atomic(receipt_file(self.root, step, self.rank), {
            "format": FORMAT, "step": step, "rank": self.rank, "world": self.world,
            "bytes": size, "sha256": sha, "config_hash": self.config_hash,
            "saved_at": time.time()})
        with self._lock:
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
        ones. Runs after every write; call it once more when every worker has finished its
        last write (a barrier), which only then are all known complete."""
        mine = [s for s in steps_on_disk(self.root)
                if receipt_file(self.root, s, self.rank).is_file()]
        complete = [s for s in mine if self._complete_everywhere(s)]
        if len(complete) < self.keep:
            return
        oldest_kept = complete[self.keep - 1]
        for s in mine:
            if s < oldest_kept:
                for f in (receipt_file(self.root, s, self.rank),
                          state_file(self.root, s, self.rank)):
                    with contextlib.suppress(OSError):
                        f.unlink()  # the receipt first: a file without one is never used
                with contextlib.suppress(OSError):
                    step_dir(self.root, s).rmdir()  # the last worker out removes it

    def report(self) -> dict[str, Any]:
        return {"checkpoint_every": self.every, "checkpoint_saves": self.saves,
                "checkpoint_bytes": self.bytes,
                "checkpoint_blocked_seconds": self.blocked_seconds,
                "checkpoint_write_seconds": self.write_seconds,
                "newest_checkpoint_step": self.last_step}


# ---- RNG streams ------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Every random stream a worker may draw from (torch CPU and CUDA, numpy, Python)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")),
                     "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

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
        "format": "noloco-model/1", "model_args": asdict(model_args), "files": files,
        "default": "average" if "average" in files else names[0], **extra})


def load_model(path: Path | str, which: str | None = None) -> torch.nn.Module:
    """The trained model of a run directory (or its ``model/`` directory): ``which`` is
    ``"average"`` (the replicas' mean, where saved), ``"replica-K"``, or None for the
    default (the average if there is one, else replica 0)."""
    from safetensors.torch import load_file

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
        state.update(load_file(str(model_dir / f)))
    with torch.device("meta"):
        model = Transformer(ModelArgs(**index["model_args"]))
    model.load_state_dict(state, strict=True, assign=True)
    return model
