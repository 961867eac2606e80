from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests run many worker processes on few cores: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def shakespeare() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not beside this checkout")
    return SHAKESPEARE
