"""The run-directory contract every method writes (README, "Run directory").

- ``config.json``: the resolved config;
- ``metrics.jsonl``: one JSON object per evaluation;
- ``summary.json``: written once at the end.

An existing, non-empty run directory is never overwritten silently: :meth:`RunDir.prepare`
refuses unless asked to overwrite, and then replaces only the files this contract names.
Files are written atomically (temporary file, then rename) so a crash never leaves half a JSON.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from noloco.config import Config, ConfigError

OWNED = ("config.json", "metrics.jsonl", "summary.json")


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def check(self, overwrite: bool) -> None:
        """Raise ConfigError if writing here would overwrite a run without --overwrite."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise ConfigError(f"run directory {p} exists and is not a directory")
        if p.is_dir() and any(p.iterdir()) and not overwrite:
            raise ConfigError(f"run directory {p} already exists and is not empty "
                              f"(use --overwrite to replace it, or another --out)")

    def prepare(self, cfg: Config, overwrite: bool) -> None:
        self.check(overwrite)
        self.path.mkdir(parents=True, exist_ok=True)
        for name in OWNED:
            (self.path / name).unlink(missing_ok=True)
        write_json_atomic(self.path / "config.json", cfg.to_dict())

    def append_metrics(self, rec: dict[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(_clean(rec)) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.path / "summary.json", summary)

    def read_metrics(self) -> list[dict[str, Any]]:
        with open(self.path / "metrics.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]

    def read_summary(self) -> dict[str, Any]:
        return json.loads((self.path / "summary.json").read_text())


def _clean(x: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2) + "\n")
    os.replace(tmp, path)
