"""The run-directory contract every method writes (README, "The run directory").

- ``config.json``: the resolved config;
- ``metrics.jsonl``: one JSON object per evaluation;
- ``summary.json``: how the run ended (``status``), and for a completed run its results;
- ``checkpoints/`` (see :mod:`noloco.checkpoint`) and ``model/`` (the final weights);
- ``metrics/`` (an elastic run): each replica's own metrics and summary.

Nothing is ever half-written:
- JSON files are replaced atomically: a temporary file in the same directory, fsync, rename,
  fsync of the directory. A failed write removes its temporary file.
- A metrics line is one ``write`` of the complete line to a file opened for appending; if the
  write fails (a full disk) the file is cut back to its previous length, so it only ever holds
  whole lines. A reader still skips a torn last line (a machine that lost power) with a
  warning.

An existing, non-empty run directory is never overwritten silently: :meth:`RunDir.prepare`
refuses unless asked to overwrite, and then replaces only what this contract names.

Floor 1 of docs/architecture.md: a run's description.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from noloco.config import Config, ConfigError

OWNED_FILES = ("config.json", "metrics.jsonl", "summary.json", "job.json")
OWNED_DIRS = ("checkpoints", "model", "metrics")
"""``metrics/`` holds an elastic run's files of each replica, which the run's end combines: a
previous run's must not count as this one's (--overwrite)"""
TMP_SUFFIX = ".tmp"


class RunDir:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    def check(self, overwrite: bool) -> None:
        """Raise ConfigError if writing here would overwrite a run without --overwrite."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise ConfigError(f"run directory {p} exists and is not a directory")
        if p.is_dir() and any(p.iterdir()) and not overwrite:
            raise ConfigError(f"run directory {p} already exists and is not empty "
                              f"(use --overwrite to replace it, --resume {p} to continue it, "
                              f"or another --out)")
        ancestor = p
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise ConfigError(f"cannot create run directory {p}: {ancestor} is not a directory")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot create run directory {p}: {ancestor} is not writable")

    def prepare(self, cfg: Config, overwrite: bool) -> None:
        """Create the directory (or empty what a previous run left in it) and write
        config.json. A failure is a one-line ConfigError and leaves nothing behind."""
        self.check(overwrite)
        created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            for name in OWNED_FILES:
                (self.path / name).unlink(missing_ok=True)
            for name in OWNED_DIRS:
                shutil.rmtree(self.path / name, ignore_errors=True)
            self.write_config(cfg)
        except OSError as e:
            if created:
                shutil.rmtree(self.path, ignore_errors=True)
            raise ConfigError(f"cannot write run directory {self.path}: "
                              f"{e.strerror or e}") from None

    def write_config(self, cfg: Config) -> None:
        write_json_atomic(self.path / "config.json", cfg.to_dict())

    def read_config(self) -> Config:
        p = self.path / "config.json"
        try:
            return Config.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"{self.path} is not a run directory (no config.json)") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {p}: {e}") from None

    # ---- job.json: which torchrun job last started this run ------------------------------
    def job(self) -> str | None:
        try:
            return json.loads((self.path / "job.json").read_text()).get("torchelastic_run_id")
        except (OSError, ValueError):
            return None

    def set_job(self, run_id: str) -> None:
        write_json_atomic(self.path / "job.json", {"torchelastic_run_id": run_id})

    # ---- metrics.jsonl --------------------------------------------------------------------
    def append_metrics(self, rec: dict[str, Any]) -> None:
        append_line(self.metrics_path, json.dumps(_clean(rec)))

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def truncate_metrics(self, lines: int) -> None:
        """Keep the first ``lines`` lines (a resumed run rewrites what came after its
        checkpoint)."""
        if not self.metrics_path.exists():
            if lines:
                raise ConfigError(f"{self.metrics_path} is missing: cannot resume")
            return
        keep = self.metrics_path.read_bytes().split(b"\n")[:lines]
        if len(keep) < lines or (keep and not keep[-1].strip()):
            raise ConfigError(f"{self.metrics_path} holds fewer than the {lines} lines the "
                              f"checkpoint expects")
        write_bytes_atomic(self.metrics_path, b"".join(x + b"\n" for x in keep))

    # ---- summary.json ---------------------------------------------------------------------
    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary_path, {"format": SUMMARY_FORMAT, **summary})

    def read_summary(self) -> dict[str, Any]:
        """summary.json in the current format (:func:`upgrade_summary`)."""
        return upgrade_summary(json.loads(self.summary_path.read_text()))

    def update_summary(self, **fields: Any) -> None:
        """Merge ``fields`` into summary.json (created if missing)."""
        try:
            summary = self.read_summary()
        except (OSError, ValueError):
            summary = {}
        summary.update(fields)
        self.write_summary(summary)

    def remove_stale_tmp(self) -> None:
        """Delete the temporary files (:func:`tmp_path`) a killed writer left: never a
        complete file, and nothing else."""
        for f in self.path.rglob(f".*{TMP_SUFFIX}"):
            if _TMP_NAME.match(f.name):
                with contextlib.suppress(OSError):
                    f.unlink()


def _clean(x: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


_TMP_NAME = re.compile(r"^\..+\.\d+\.tmp$")


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[Path]:
    """Yields a temporary path beside ``path`` to write to; when the block ends without an
    error the file is fsynced and renamed over ``path`` (then the directory is fsynced), so
    ``path`` holds either its old content or the new, never a mix. On an error the temporary
    file is removed."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.filename in (None, str(tmp)):
            raise OSError(e.errno, e.strerror, str(path)) from None  # name the file
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_write(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(_clean(obj), indent=2) + "\n").encode())


def append_line(path: Path, line: str) -> None:
    """Append one whole line: a single write, cut back if it fails part-way."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole line of a JSON-lines file; a torn last line is skipped with a warning."""
    lines = Path(path).read_text().split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: a write that never finished
                print(f"noloco: warning: {path}: skipping a torn last line", file=sys.stderr)
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return out


def os_error_line(e: OSError) -> str:
    """One line for a failed file operation: what, where, why."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full writing {e.filename or 'the run directory'} ({e.strerror})"
    if e.filename:
        return f"cannot write {e.filename}: {e.strerror or e}"
    return str(e.strerror or e)


# ---- summary.json's format ----------------------------------------------------------------

SUMMARY_FORMAT = 2
"""summary.json's format. 2: one key set for static and elastic runs — per-replica numbers
keyed by replica id (``"0"``, ``"1"``, ...), ``bytes_sent`` and ``sync_seconds`` a replica's
mean, an elastic run's own keys in its ``elastic`` section. 1 (no ``format`` key): a static
run's per-replica losses as a list and only the mean of its bytes; an elastic run's keys at
the top, its ``bytes_sent`` the replicas' sum and its ``sync_seconds`` their max."""

ELASTIC_KEYS = ("peer_timeout", "replicas_finished", "steps_per_replica", "partial_operations",
                "retries", "longest_wait_seconds", "arrival_seconds_per_replica", "events",
                "payload_mac", "mac_bytes_per_replica", "partitions", "unreachable_operations",
                "store_restarts", "run_id", "joins", "saved_steps", "reached_steps",
                "store")
"""what only an elastic run has: the keys of its summary's ``elastic`` section"""


def _mean(xs: Any) -> float | None:
    xs = [x for x in xs if isinstance(x, int | float)]
    return sum(xs) / len(xs) if xs else None


def upgrade_summary(doc: Any) -> Any:
    """A summary.json of any noloco version in the current format (:data:`SUMMARY_FORMAT`):
    every reader goes through here, so a run directory of an older version still reads."""
    if not isinstance(doc, dict) or doc.get("format", 1) >= SUMMARY_FORMAT:
        return doc
    d = dict(doc)
    if d.get("elastic") is True:  # format 1 of an elastic run
        d["elastic"] = {k: d.pop(k) for k in ELASTIC_KEYS if k in d}
        for key in ("bytes_sent", "sync_seconds"):  # its sum and its max: now the mean
            per = d.get(f"{key}_per_replica")
            if isinstance(per, dict):
                d[key] = _mean(per.values())  # (None where no replica finished)
    else:
        per = d.get("final_val_loss_per_replica")
        if isinstance(per, list):
            d["final_val_loss_per_replica"] = {str(r): v for r, v in enumerate(per)}
        if "bytes_sent_per_replica" in d and not isinstance(d["bytes_sent_per_replica"], dict):
            # format 1 kept only the mean (bytes_sent, where it wrote that too)
            d.setdefault("bytes_sent", d["bytes_sent_per_replica"])
            d["bytes_sent_per_replica"] = None
    d["format"] = SUMMARY_FORMAT
    return d
