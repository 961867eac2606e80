from __future__ import annotations

import atexit
import os
import secrets
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

# The run secret every `noloco coordinator` of the tests asks for, and every machine proves
# (noloco.elastic.auth): the multi-machine tests run the secure default end to end.
os.environ.setdefault("NOLOCO_SECRET", secrets.token_hex(32))

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def shakespeare() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not beside this checkout")
    return SHAKESPEARE
