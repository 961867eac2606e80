"""SparseLoCo (noloco.methods.sparseloco): top-k messages, error feedback, an all-gather."""

from __future__ import annotations

import json
import math

import pytest
import torch
from run_utils import summary, train

from noloco import sparse
from noloco.cli import main

RUN = ["--replicas", "2", "--steps", "40", "--sync-every", "10", "--eval-every", "20"]


def weights(run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "model" / "average.safetensors"))


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(300)
def test_a_lossless_compressor_is_diloco_without_outer_momentum(tmp_path, corpus):
    """topk:1.0:32 sends every entry exactly: the error feedback stays zero whatever its
    decay, and the outer step is DiLoCo's with momentum 0 at the same outer lr."""
    assert train(tmp_path / "sparse", corpus, "--method", "sparseloco", *RUN,
                 "--compress", "topk:1.0:32", "--outer-lr", "0.8", "--ef-decay", "0.5") == 0
    assert train(tmp_path / "diloco", corpus, "--method", "diloco", *RUN,
                 "--outer-momentum", "0", "--outer-lr", "0.8") == 0
    a, b = weights(tmp_path / "sparse"), weights(tmp_path / "diloco")
    assert a.keys() == b.keys()
    # mean(φ − θ_r) against φ − mean(θ_r): the same up to fp32 rounding
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    sa, sb = summary(tmp_path / "sparse"), summary(tmp_path / "diloco")
    assert sa["outer_steps"] == sb["outer_steps"] == 4
    assert abs(sa["final_val_loss"] - sb["final_val_loss"]) < 1e-4


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(300)
def test_sparse_messages_train_and_are_counted_as_sent(tmp_path, corpus):
    assert train(tmp_path / "run", corpus, "--method", "sparseloco", "--replicas", "4",
                 "--steps", "60", "--sync-every", "10", "--eval-every", "30") == 0
    s = summary(tmp_path / "run")
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["method"]["compress"] == "topk:0.02:2" and s["outer_steps"] == 6
    assert s["ops"] == {"all_gather": 6}
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(s["final_val_loss"]) and s["final_val_loss"] < first["val_loss"] - 1
    numel = s["params"]
    # an all-gather: each replica sends its message to each of the 3 others, per outer step
    per_step = 3 * sparse.wire_bytes(numel, 0.02, 2)
    assert s["bytes_sent"] == 6 * per_step
    assert 4 * numel * 2 * 3 / 4 / per_step > 20  # against a ring all-reduce of fp32


@pytest.mark.parametrize("argv,msg", [
    (["--method", "ddp", "--compress", "topk:0.1"], "--compress applies to"),
    (["--method", "streaming", "--quantize", "fp4", "--compress", "topk:0.1"],
     "two encodings"),
    (["--method", "diloco", "--compress", "topk:0.1:5"], "bits must be one of"),
    (["--method", "diloco", "--compress", "topk:0"], "fraction"),
    (["--method", "sparseloco", "--compress", "topk:2"], "fraction"),
    (["--method", "sparseloco", "--compress", "top:0.1"], "expected topk"),
    (["--method", "sparseloco", "--outer-momentum", "0.9"], "no --outer-momentum"),
    (["--method", "sparseloco", "--ef-decay", "1.5"], "--ef-decay"),
    (["--method", "diloco", "--ef-decay", "0.9"], "--ef-decay applies to a sparse exchange"),
])
def test_bad_sparse_settings_are_one_line(tmp_path, capfd, argv, msg):
    assert main(["train", "--replicas", "2", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err
