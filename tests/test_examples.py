"""Every example under examples/ runs, with few steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.timeout(120)
def test_noloco_plain_loop_example() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "noloco_loop.py"), "--replicas", "2",
                           "--steps", "20", "--sync-every", "10"], capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "outer steps 2" in proc.stdout and "in 2 pair exchanges" in proc.stdout


@pytest.mark.timeout(240)
def test_hf_diloco_example(tmp_path) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "hf_diloco.py"), "--steps", "4",
                           "--sync-every", "2", "--replicas", "2", "--out", str(out),
                           "--extra", "--batch-size", "2", "--seq-len", "32",
                           "--eval-sequences", "2", "--log-every", "0"],
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: diloco, 2 replicas" in proc.stdout and proc.stdout.rstrip().splitlines()[-1]
    assert (out / "model" / "model.json").is_file()
