"""The inner optimizer (noloco.optim): AdamW, or Muon for the block matrices (MuLoCo)."""

from __future__ import annotations

import math

import pytest
import torch
from run_utils import summary, train

from noloco.model import Transformer, preset
from noloco.optim import build_inner


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny", vocab_size=257))


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    model = tiny()
    named = list(model.named_parameters())
    inner = build_inner(named, "muon", 1e-3, (0.9, 0.95), 0.0)
    muon, adamw = inner.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    by_id = {id(p): n for n, p in named}
    in_muon = {by_id[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {by_id[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon | in_adamw == set(by_id.values()) and not in_muon & in_adamw
    assert all(n.startswith("layers.") and dict(named)[n].ndim == 2 for n in in_muon)
    assert {"tok_embeddings.weight", "output.weight"} <= in_adamw
    assert any("norm" in n for n in in_adamw)
    # one schedule drives both: the loop sets lr on every group
    for g in inner.param_groups:
        g["lr"] = 5e-4
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == 5e-4


def test_state_round_trips_resets_and_refuses_the_other_kind():
    model = tiny()
    inner = build_inner(list(model.named_parameters()), "muon", 1e-3, (0.9, 0.95), 0.0)
    x = torch.randint(0, 257, (2, 16))
    model(x).float().mean().backward()
    inner.step()
    sd = inner.state_dict()
    assert sd["kind"] == "muon" and all(len(p["state"]) > 0 for p in sd["parts"])
    other = build_inner(list(model.named_parameters()), "muon", 1e-3, (0.9, 0.95), 0.0)
    other.load_state_dict(sd)
    assert other.state_dict()["parts"][0]["state"].keys() == sd["parts"][0]["state"].keys()
    with pytest.raises(ValueError, match="muon"):
        build_inner(list(model.named_parameters()), "adamw", 1e-3, (0.9, 0.95),
                    0.0).load_state_dict(sd)
    inner.reset()
    assert all(len(opt.state) == 0 for opt in inner.parts)
    # AdamW's state stays the plain torch state (checkpoints of earlier runs load)
    plain = build_inner(list(model.named_parameters()), "adamw", 1e-3, (0.9, 0.95), 0.0)
    assert set(plain.state_dict()) == {"state", "param_groups"}


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(400)
@pytest.mark.parametrize("method", ["ddp", "diloco", "noloco", "streaming"])
def test_every_method_trains_with_muon(tmp_path, corpus, method):
    flags = ["--method", method, "--replicas", "2", "--steps", "40", "--sync-every", "10",
             "--eval-every", "40"]
    assert train(tmp_path / "muon", corpus, *flags, "--inner-optimizer", "muon") == 0
    assert train(tmp_path / "adamw", corpus, *flags) == 0
    muon, adamw = summary(tmp_path / "muon"), summary(tmp_path / "adamw")
    assert math.isfinite(muon["final_val_loss"]) and muon["final_val_loss"] < 4.5
    assert muon["final_val_loss"] != adamw["final_val_loss"]  # it is another optimizer
    assert muon["bytes_sent"] == adamw["bytes_sent"]  # and the same communication
