"""Gradient accumulation: K microbatches of B sequences per inner step is a step on K x B."""

from __future__ import annotations

import pytest
import torch
from run_utils import summary, train, weights

FLAGS = ["--steps", "12", "--eval-every", "6", "--dropout", "0.0", "--grad-clip", "0"]


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", [["--method", "single"],
                                    ["--method", "ddp", "--replicas", "2"]],
                         ids=["single", "ddp"])
def test_four_microbatches_of_four_equal_one_batch_of_sixteen(tmp_path, corpus, method):
    big, acc = tmp_path / "big", tmp_path / "acc"
    assert train(big, corpus, *method, *FLAGS, "--batch-size", "16") == 0
    assert train(acc, corpus, *method, *FLAGS, "--batch-size", "4",
                 "--grad-accum", "4") == 0
    a, b = summary(big), summary(acc)
    assert abs(a["final_val_loss"] - b["final_val_loss"]) < 1e-5, (a, b)
    wa, wb = weights(big), weights(acc)
    for f in wa:
        for k in wa[f]:
            assert torch.allclose(wa[f][k], wb[f][k], atol=1e-5), (f, k)
    assert b["tokens_per_replica"] == a["tokens_per_replica"]
    if method[1] == "ddp":  # one all-reduce per inner step, not one per microbatch
        assert b["ops"] == a["ops"] and b["bytes_sent"] == a["bytes_sent"], (a["ops"], b["ops"])


@pytest.mark.slow("worker processes")
def test_grad_accum_with_pipeline_stages_is_one_line(tmp_path, corpus, capsys):
    from noloco.cli import main

    assert main(["train", "--data", str(corpus), "--stages", "2", "--grad-accum", "2",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "accumulates over its --microbatches" in err
    assert not (tmp_path / "r").exists()
