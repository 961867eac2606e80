"""--compile: torch.compile of the model (each stage), the same numbers as eager."""

from __future__ import annotations

import os

import pytest
from run_utils import SMALL, cli, summary, train

pytestmark = pytest.mark.slow("torch.compile builds C++ kernels (a minute)")

FLAGS = ["--method", "single", "--steps", "20", "--eval-every", "10"]


@pytest.mark.timeout(600)
def test_compiled_ends_where_eager_ends(tmp_path, corpus, capfd):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert train(eager, corpus, *FLAGS) == 0
    assert train(compiled, corpus, *FLAGS, "--compile") == 0
    assert "running eagerly" not in capfd.readouterr().err  # it did compile
    a, b = summary(eager)["final_val_loss"], summary(compiled)["final_val_loss"]
    assert abs(a - b) < 1e-3, (a, b)


@pytest.mark.timeout(600)
def test_without_a_working_compiler_it_says_so_once_and_runs_eagerly(tmp_path, corpus):
    eager = tmp_path / "eager"
    assert train(eager, corpus, *FLAGS) == 0
    env = dict(os.environ, CXX="/bin/false", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    r = cli("train", "--data", str(corpus), *SMALL, *FLAGS, "--compile", "--out",
            str(tmp_path / "broken"), "--log-every", "0", env=env, timeout=500)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "--compile" in x]
    assert len(lines) == 1 and "running eagerly" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    # eager from the first step on: the same bits as the eager run
    assert summary(tmp_path / "broken")["final_val_loss"] == summary(eager)["final_val_loss"]
