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
