"""--precision bf16: bf16 autocast for forward and backward, fp32 everywhere else."""

from __future__ import annotations

import pytest
import torch
from run_utils import summary, train, weights


@pytest.mark.slow("two 300-step training runs")
@pytest.mark.timeout(300)
def test_bf16_ends_within_two_percent_of_fp32(tmp_path, corpus):
    runs = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        assert train(out, corpus, "--method", "single", "--steps", "300",
                     "--eval-every", "150", "--precision", precision) == 0
        runs[precision] = summary(out)
    fp32, bf16 = runs["fp32"]["final_val_loss"], runs["bf16"]["final_val_loss"]
    assert abs(bf16 / fp32 - 1) <= 0.02, (fp32, bf16)
    assert bf16 != fp32  # autocast did run: the numbers moved
    w = weights(tmp_path / "bf16")["replica-0.safetensors"]
    assert all(t.dtype == torch.float32 for t in w.values())  # master weights stay fp32


@pytest.mark.slow("worker processes in pipeline stages")
@pytest.mark.timeout(300)
def test_bf16_halves_the_activations_between_stages_and_nothing_else(tmp_path, corpus):
    runs = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        assert train(out, corpus, "--method", "noloco", "--replicas", "2", "--stages",
                     "2", "--routing", "fixed", "--sync-every", "5", "--steps", "10",
                     "--eval-every", "10", "--precision", precision) == 0
        runs[precision] = summary(out)
    a, b = runs["fp32"], runs["bf16"]
    assert b["activation_bytes"] * 2 == a["activation_bytes"] > 0
    assert a["bytes_sent"] == b["bytes_sent"] > 0  # the replicas' exchanges stay fp32


def test_an_unknown_precision_is_one_line(tmp_path, corpus, capsys):
    from noloco.cli import main

    assert main(["train", "--data", str(corpus), "--precision", "fp8",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown --precision 'fp8'" in err
