"""Hugging Face models in (--hf-model): every method trains one; weights are loaded when
present; a run's model goes out (export) and comes back in unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_utils import metrics, summary, train

from noloco.cli import main

pytest.importorskip("transformers", reason="the 'hf' extra")


def _tiny_llama(path: Path, tie: bool = False, layers: int = 2) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                tie_word_embeddings=tie).save_pretrained(path)
    return path


METHODS = {
    "single": [],
    "ddp": ["--replicas", "2"],
    "diloco": ["--replicas", "2", "--sync-every", "2"],
    "noloco": ["--replicas", "2", "--sync-every", "4", "--fragments", "2"],
    "streaming": ["--replicas", "2", "--sync-every", "4", "--fragments", "2", "--overlap-steps",
                  "1", "--quantize", "fp4"],
}


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(400)
def test_every_method_trains_a_hf_llama(tmp_path, corpus) -> None:
    cfg = _tiny_llama(tmp_path / "llama")
    for method, extra in METHODS.items():
        out = tmp_path / method
        assert train(out, corpus, "--hf-model", str(cfg), "--method", method, *extra,
                     "--steps", "4", "--eval-every", "4", "--checkpoint-every", "0") == 0, method
        s = summary(out)
        # embeddings and head (untied), final norm, 2 blocks of attention, MLP and 2 norms
        assert s["params"] == 32 * 257 * 2 + 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32)
        first, last = metrics(out)[0]["val_loss"], s["final_val_loss"]
        assert last < first, method  # it learns
        if method != "single":
            assert s["bytes_sent"] > 0
            assert s["outer_steps"] >= 1 or method == "ddp"
    index = json.loads((tmp_path / "diloco" / "model" / "model.json").read_text())
    assert index["model_args"] is None and index["hf_config"]["model_type"] == "llama"


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(300)
def test_weights_are_loaded_and_export_round_trips(tmp_path, corpus) -> None:
    src = tmp_path / "src"
    assert train(src, corpus, "--method", "noloco", "--replicas", "2", "--sync-every", "2",
                 "--steps", "4", "--eval-every", "4", "--checkpoint-every", "0") == 0
    assert main(["export", str(src), str(tmp_path / "hf")]) == 0
    # The exported model, trained further with lr 0: its step-0 evaluation is the source run's
    # final one (same weights, same validation sequences).
    again = tmp_path / "again"
    assert train(again, corpus, "--hf-model", str(tmp_path / "hf"), "--steps", "1",
                 "--lr", "0", "--warmup", "0", "--checkpoint-every", "0") == 0
    assert metrics(again)[0]["val_loss"] == pytest.approx(summary(src)["final_val_loss"],
                                                          rel=1e-5)


def test_hf_model_bad_input_is_one_line(tmp_path, corpus, capsys) -> None:
    cfg = _tiny_llama(tmp_path / "llama", tie=True)
    assert main(["train", "--hf-model", str(cfg), "--stages", "2", "--replicas", "1",
                 "--data", str(corpus), "--out", str(tmp_path / "x")]) == 2
    assert main(["train", "--hf-model", str(tmp_path / "nowhere"), "--data", str(corpus),
                 "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "input and output embeddings are tied" in err[0]
    assert "--hf-model" in err[1]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_llama_stages_chained_give_the_whole_model_s_logits(tmp_path) -> None:
    import torch

    from noloco import hf
    from noloco.pipeline import build_stage

    cfg = _tiny_llama(tmp_path / "llama", layers=3)
    whole = hf.build(cfg, seed=0)
    tokens = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        ref = whole(tokens)
        stages = [build_stage(hf.build(cfg, seed=0), 3, s) for s in range(3)]
        h = tokens
        for st in stages:
            h = st(h)
    torch.testing.assert_close(h, ref, rtol=0, atol=1e-5)
    # the whole model's parameter names, each on exactly one stage
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())


@pytest.mark.slow("worker processes in pipeline stages")
@pytest.mark.timeout(400)
def test_a_hf_llama_trains_in_pipeline_stages(tmp_path, corpus) -> None:
    cfg = _tiny_llama(tmp_path / "llama")
    common = ["--hf-model", str(cfg), "--steps", "4", "--eval-every", "4",
              "--checkpoint-every", "0", "--lr", "3e-3"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert train(one, corpus, *common, "--method", "single") == 0
    assert train(two, corpus, *common, "--method", "single", "--stages", "2") == 0
    # The same model, data and optimizer cut in two: the same losses up to float rounding.
    assert summary(two)["final_val_loss"] == pytest.approx(summary(one)["final_val_loss"],
                                                           rel=1e-4)
    noloco = tmp_path / "noloco"
    assert train(noloco, corpus, *common, "--method", "noloco", "--replicas", "2",
                 "--stages", "2", "--sync-every", "2") == 0
    s = summary(noloco)
    assert s["final_val_loss"] < metrics(noloco)[0]["val_loss"] and s["activation_bytes"] > 0
    bf16 = tmp_path / "bf16"  # --precision bf16 through a Hugging Face model's stages
    assert train(bf16, corpus, *common, "--method", "noloco", "--replicas", "2",
                 "--stages", "2", "--sync-every", "2", "--precision", "bf16") == 0
    b = summary(bf16)
    assert b["final_val_loss"] < metrics(bf16)[0]["val_loss"] and b["precision"] == "bf16"
    assert b["bytes_sent"] == s["bytes_sent"]  # the exchanges stay fp32
    assert b["activation_bytes"] < s["activation_bytes"]  # bf16 between the stages
    assert main(["export", str(noloco), str(tmp_path / "hf")]) == 0  # the stages' shards join
    assert (tmp_path / "hf" / "model.safetensors").is_file()
