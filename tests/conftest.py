from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Tests run many worker processes on few cores: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The machine's token cache of this test session: its own, never the user's ~/.cache.
if "NOLOCO_TOKEN_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="noloco-tokens-")
    os.environ["NOLOCO_TOKEN_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def shakespeare() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not beside this checkout")
    return SHAKESPEARE
