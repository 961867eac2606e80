"""What a join's state carries: slow weights equal to the model are sent once, and a joining
replica's random streams are its own (not its first life's from step 0)."""

from __future__ import annotations

import io
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from noloco.comm import NullCommunicator
from noloco.config import Config, MethodConfig
from noloco.elastic.join import Joiner, join_streams
from noloco.methods import build_method


def replica(method: str, seed: int) -> Joiner:
    """The join component of a replica, on the parts of a trainer a join touches: a model, its
    method, counters."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    cfg = Config(method=MethodConfig(method=method, sync_every=4, replicas=2))
    cfg = cfg.resolved().method
    trainer = SimpleNamespace(
        model=model,
        method=build_method(cfg, list(model.named_parameters()), NullCommunicator()),
        runner=SimpleNamespace(named_parameters=model.named_parameters),
        params=list(model.parameters()),
        comm=SimpleNamespace(calls=3, commits=2, behind=True, unsure=False, back=lambda: None),
        state=SimpleNamespace(step=8), status=SimpleNamespace(step=8),
        lay=SimpleNamespace(replica=0, rank=0), cfg=SimpleNamespace(train=SimpleNamespace(seed=0)),
        resumed_from=None)
    joiner = Joiner(SimpleNamespace(step=8, replica=0, ns=None,
                                    store=SimpleNamespace(add=lambda key, n: 0)))
    joiner.attach(trainer)
    return joiner


def wire_bytes(state: dict) -> int:
    buf = io.BytesIO()
    torch.save(state, buf)
    return len(buf.getvalue())


@pytest.mark.parametrize("method", ["diloco", "noloco"])
def test_slow_weights_equal_to_the_model_are_sent_once(method):
    donor, joiner = replica(method, 0), replica(method, 1)
    fresh = donor.live_state()  # φ = θ, as right after an outer step
    assert fresh["phi_is_model"] == [0] and fresh["method"]["phi"] == [None]
    joiner._adopt(fresh, None)
    assert joiner.checksum() == donor.checksum()  # model, φ and outer momentum: the donor's
    with torch.no_grad():  # an inner step later: φ ≠ θ, sent in full
        for p in donor.trainer.model.parameters():
            p.add_(0.01)
    moved = donor.live_state()
    assert moved["phi_is_model"] == []
    joiner._adopt(moved, None)
    assert joiner.checksum() == donor.checksum()
    weights = sum(p.numel() for p in donor.trainer.params) * 4
    assert wire_bytes(moved) - wire_bytes(fresh) >= weights  # one copy of the weights less


def test_a_joiner_draws_its_own_random_numbers_not_its_first_lifes():
    def draws() -> tuple:
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    torch.manual_seed(0 * 1009 + 2)  # replica 2's first life, as the trainer seeds it
    first_life = draws()
    join_streams(None, seed=0, rank=2, step=40)
    at_40 = draws()
    assert at_40 != first_life
    join_streams(None, seed=0, rank=2, step=40)
    assert draws() == at_40  # keyed by seed, rank and step: reproducible
    join_streams(None, seed=0, rank=3, step=40)
    assert draws() != at_40  # another replica: another stream
    from noloco import checkpoint as ckpt_mod
    saved = ckpt_mod.rng_state()
    expected = draws()
    join_streams({"rng": saved}, seed=0, rank=2, step=40)  # its own checkpoint's streams
    assert draws() == expected


def test_a_replica_counts_the_join_requests_it_serves_from_when_its_trainer_is_built():
    """Requests made while the trainer was being built (to a previous life of the replica,
    which is gone) are skipped: the counter is read when the trainer attaches."""
    counter = {"n": 2}
    store = SimpleNamespace(add=lambda key, n: counter["n"])
    joiner = Joiner(SimpleNamespace(replica=0, ns=None, store=store))
    counter["n"] = 5  # three more requests while the model and data load
    joiner.attach(SimpleNamespace())
    assert joiner.served == joiner.next_serve == 5
