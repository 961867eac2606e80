"""The papers' equivalences and the communication schedule, on real gloo ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from noloco.comm import NullCommunicator, TorchCommunicator, ring_all_reduce_bytes
from noloco.methods import DDP, DiLoCo, NoLoCo, Single, groups_at, stability_bounds
from noloco.model import ModelArgs, build, lm_loss

ARGS = ModelArgs(dim=16, n_layers=1, n_heads=2, ffn_dim=32, vocab_size=64, max_seq_len=16)
BATCH, SEQ = 2, 8


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=g)


def make_opt(kind: str, params, lr: float = 0.05):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train(model, method, opt, rank: int, steps: int, clip: bool = False) -> None:
    for step in range(steps):
        tok = batch(rank, step)
        lm_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
        method.sync_gradients()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        method.after_inner_step()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---- DDP equals one process with an N× batch -----------------------------------------------

def _ddp_rank(rank: int, world: int, steps: int) -> dict[str, torch.Tensor]:
    out = {}
    for opt_kind in ("sgd", "adamw"):
        model = build(ARGS, seed=0)
        comm = TorchCommunicator()
        method = DDP(model, comm)
        train(model, method, make_opt(opt_kind, model.parameters()), rank, steps, clip=True)
        assert comm.bytes_sent == steps * ring_all_reduce_bytes(4 * sum(
            p.numel() for p in model.parameters()), world)
        out[opt_kind] = flat_params(model)
    return out


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(180)
def test_ddp_equals_one_process_with_n_times_batch():
    world, steps = 3, 4
    results = run_ranks(_ddp_rank, world, steps)
    for opt_kind in ("sgd", "adamw"):
        for r in results[1:]:
            assert torch.equal(r[opt_kind], results[0][opt_kind])  # replicas stay identical
        model = build(ARGS, seed=0)
        opt = make_opt(opt_kind, model.parameters())
        for step in range(steps):
            tok = torch.cat([batch(r, step) for r in range(world)])
            lm_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(results[0][opt_kind], flat_params(model), atol=1e-5, rtol=0)


def _ddp_buckets_rank(rank: int, world: int, steps: int) -> dict:
    model = build(ARGS, seed=0)
    comm = TorchCommunicator()
    method = DDP(model, comm, bucket_mb=0.002)  # ~2 KiB buckets: many of them
    opt = make_opt("adamw", model.parameters())
    started_in_backward = []
    for step in range(steps):
        tok = batch(rank, step)
        lm_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
        started_in_backward.append(len(method._pending))  # launched by the hooks already
        method.sync_gradients()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        method.after_inner_step()
    return {"params": flat_params(model), "buckets": len(method.buckets),
            "started": started_in_backward, "ops": dict(comm.ops), "bytes": comm.bytes_sent}


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
def test_ddp_buckets_overlap_backward_and_still_equal_one_big_batch():
    world, steps = 2, 3
    res = run_ranks(_ddp_buckets_rank, world, steps)
    model = build(ARGS, seed=0)
    opt = make_opt("adamw", model.parameters())
    for step in range(steps):
        tok = torch.cat([batch(r, step) for r in range(world)])
        lm_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    n_buckets = res[0]["buckets"]
    assert n_buckets > 3
    for r in res:
        assert torch.equal(r["params"], res[0]["params"])
        torch.testing.assert_close(r["params"], flat_params(model), atol=1e-5, rtol=0)
        # Every bucket whose gradients were all ready started during backward.
        assert all(s == n_buckets for s in r["started"]), r["started"]
        assert r["ops"] == {"all_reduce": steps * n_buckets}


# ---- NoLoCo with one group of everyone equals DiLoCo with heavy-ball momentum ----------------

def _noloco_vs_diloco_rank(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    out = []
    ops = {}
    for kind in ("diloco", "noloco"):
        model = build(ARGS, seed=0)
        comm = TorchCommunicator()
        if kind == "diloco":
            method = DiLoCo(model, comm, sync_every=3, outer_lr=0.7, momentum=0.5,
                            nesterov=False)
        else:
            method = NoLoCo(model, comm, sync_every=3, outer_lr=0.7, momentum=0.5,
                            group_size=world)
        train(model, method, make_opt("adamw", model.parameters()), rank, 12)
        assert method.outer_steps == 4
        ops[kind] = dict(comm.ops)
        out.append(flat_params(model))
    return out[0], out[1], ops


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_noloco_one_group_equals_heavy_ball_diloco(world):
    for diloco, noloco, ops in run_ranks(_noloco_vs_diloco_rank, world):
        torch.testing.assert_close(noloco, diloco, atol=1e-6, rtol=0)
        assert ops["noloco"] == {"exchange": 4} and ops["diloco"] == {"all_reduce": 4}


# ---- DiLoCo (lr 1, no momentum, H = 1, SGD) equals DDP with SGD ----------------------------

def _diloco_vs_ddp_rank(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for kind in ("ddp", "diloco"):
        model = build(ARGS, seed=0)
        comm = TorchCommunicator()
        method = (DDP(model, comm) if kind == "ddp" else
                  DiLoCo(model, comm, sync_every=1, outer_lr=1.0, momentum=0.0))
        train(model, method, make_opt("sgd", model.parameters()), rank, 5)
        out.append(flat_params(model))
    return out[0], out[1]


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
def test_diloco_h1_lr1_sgd_equals_ddp():
    for ddp, diloco in run_ranks(_diloco_vs_ddp_rank, 2):
        torch.testing.assert_close(diloco, ddp, atol=1e-6, rtol=0)


# ---- NoLoCo never uses a collective; groups agree and change --------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "barrier", "gather", "scatter", "all_gather_object", "broadcast_object_list")


def _noloco_schedule_rank(rank: int, world: int, gamma: float) -> dict:
    model = build(ARGS, seed=0)
    comm = TorchCommunicator()
    method = NoLoCo(model, comm, sync_every=2, outer_lr=0.7, momentum=0.5, gamma=gamma)
    # Instrument torch.distributed itself: any collective during training is recorded.
    called = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in saved.items():
        def spy(*a, _name=name, _fn=fn, **k):
            called.append(_name)
            return _fn(*a, **k)
        setattr(dist, name, spy)
    groups = []
    try:
        opt = make_opt("adamw", model.parameters())
        for step in range(16):
            tok = batch(rank, step)
            lm_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            before = method.outer_steps
            method.after_inner_step()
            if method.outer_steps > before:
                groups.append(list(method.last_group))
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    n_params = sum(p.numel() for p in model.parameters())
    return {"called": called, "ops": dict(comm.ops), "groups": groups,
            "bytes": comm.bytes_sent, "n_params": n_params}


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("gamma", [0.7, 0.9])
def test_noloco_uses_no_collective_and_groups_agree(gamma):
    world = 4
    res = run_ranks(_noloco_schedule_rank, world, gamma)
    outer = 8
    for rank, r in enumerate(res):
        assert r["called"] == [], f"rank {rank} issued collectives: {r['called']}"
        assert r["ops"] == {"exchange": outer}
        # Bytes: one partner, fast weights (and slow weights when gamma != beta), fp32.
        per_exchange = r["n_params"] * 4 * (2 if gamma != 0.7 else 1)
        assert r["bytes"] == outer * per_exchange
        for t, g in enumerate(r["groups"]):
            assert rank in g and len(g) == 2
            assert g in groups_at(t, world, 2, seed=0)
            # My partner saw the same group at the same outer step.
            partner = next(x for x in g if x != rank)
            assert res[partner]["groups"][t] == g
    partners = {tuple(g) for g in res[0]["groups"]}
    assert len(partners) > 1, "partners never changed between outer steps"


def test_groups_are_a_partition_and_seeded():
    for t in range(20):
        gs = groups_at(t, 8, 2, seed=3)
        assert sorted(x for g in gs for x in g) == list(range(8))
        assert gs == groups_at(t, 8, 2, seed=3)
    assert any(groups_at(t, 8, 2, seed=3) != groups_at(t, 8, 2, seed=4) for t in range(5))
    gs = groups_at(0, 12, 3, seed=0)
    assert len(gs) == 4 and all(len(g) == 3 for g in gs)
    with pytest.raises(ValueError):
        groups_at(0, 6, 4)


# ---- single-process behaviour ----------------------------------------------------------------

def test_one_replica_runs_every_method_without_special_path():
    for make in (lambda m, c: Single(m, c), lambda m, c: DDP(m, c),
                 lambda m, c: DiLoCo(m, c, sync_every=2)):
        model = build(ARGS, seed=0)
        comm = NullCommunicator()
        method = make(model, comm)
        train(model, method, make_opt("sgd", model.parameters()), 0, 4)
        assert comm.bytes_sent == 0


def test_diloco_single_replica_nesterov_math():
    # One replica, H = 1: mean θ is the replica's own θ, so the outer gradient is φ − θ.
    p = torch.nn.Parameter(torch.tensor([1.0]))
    m = DiLoCo([p], NullCommunicator(), sync_every=1, outer_lr=0.5, momentum=0.9)
    with torch.no_grad():
        p.sub_(0.2)  # an "inner step": θ = 0.8, φ = 1
    m.after_inner_step()
    g = 0.2
    buf = g
    expect = 1.0 - 0.5 * (g + 0.9 * buf)
    assert p.item() == pytest.approx(expect)
    # state_dict round trip
    sd = m.state_dict()
    m2 = DiLoCo([torch.nn.Parameter(torch.tensor([0.0]))], NullCommunicator(), sync_every=1)
    m2.load_state_dict(sd)
    assert m2.slow[0].item() == pytest.approx(expect) and m2.outer_steps == 1


def test_noloco_warns_outside_stability_interval():
    lo, hi = stability_bounds(0.5, 2)
    assert (lo, hi) == pytest.approx((0.5, 1.5))
    model = build(ARGS, seed=0)
    with pytest.warns(UserWarning, match="stability"):
        NoLoCo(model, _FakeComm(4), gamma=0.2, momentum=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NoLoCo(model, _FakeComm(4), gamma=0.7, momentum=0.5)


def test_method_arguments_are_validated():
    model = build(ARGS, seed=0)
    with pytest.raises(ValueError, match="divisible"):
        NoLoCo(model, _FakeComm(6), group_size=4)
    with pytest.raises(ValueError, match="larger"):
        NoLoCo(model, _FakeComm(2), group_size=4)
    with pytest.raises(ValueError):
        DiLoCo(model, NullCommunicator(), sync_every=0)


class _FakeComm(NullCommunicator):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
