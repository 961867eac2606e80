"""Pipeline stages and random routing (SPEC §3, "Random pipeline routing").

Unit tests of the routing, the 1F1B schedule and the stage split; multi-rank gloo runs that
compare a pipelined model against the one-stage model it was cut from, check that labels
travel with the activations and gradients retrace their path under random routing, and one
full worker run of NoLoCo on 2 replicas × 2 stages through :func:`noloco.worker.run`.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from noloco.cli import main
from noloco.config import Config, ConfigError
from noloco.model import build, lm_loss, preset
from noloco.pipeline import (
    Router,
    bubble_fraction,
    build_stage,
    default_microbatches,
    one_f_one_b,
    route,
)
from noloco.split import stage_blocks

ARGS = preset("tiny", vocab_size=257)
B, T = 8, 32


# ---- helpers ---------------------------------------------------------------------------

def _batches(steps: int, replica: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + replica)
    out = []
    for _ in range(steps):
        t = torch.randint(0, ARGS.vocab_size, (B, T + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _cfg(replicas: int, stages: int, routing: str, microbatches: int) -> Config:
    cfg = Config()
    cfg.data.batch_size, cfg.data.seq_len = B, T
    cfg.method.replicas, cfg.method.stages = replicas, stages
    cfg.method.routing, cfg.method.microbatches = routing, microbatches
    return cfg


def _runner(cfg: Config):
    from noloco.distributed import Layout
    from noloco.pipeline import PipelineRunner

    lay = Layout.from_env(cfg.method.replicas, cfg.method.stages)
    model = build(ARGS, seed=0)
    return PipelineRunner(model, cfg, lay, torch.device("cpu")), lay


# ---- routing, schedule, split (no processes) -------------------------------------------

def test_route_is_a_permutation_both_ends_agree_and_changes_per_slot():
    n = 8
    perms = set()
    for sample in range(50):
        for boundary in range(3):
            perm = route(sample, boundary, n, seed=3)
            assert sorted(perm) == list(range(n))  # every receiver gets exactly one per slot
            assert perm == route(sample, boundary, n, seed=3)  # no communication needed
            perms.add(tuple(perm))
    assert len(perms) > 100  # fresh draws per slot and boundary, not one fixed shuffle
    assert route(0, 0, n, seed=3) != route(0, 0, n, seed=4)

    r = Router("random", n, seed=3)
    for sample in range(20):
        for boundary in range(3):
            for rep in range(n):
                to = r.next_replica(sample, boundary, rep)
                assert r.prev_replica(sample, boundary, to) == rep  # the gradient's way back
    # origin() retraces every boundary, and is itself a permutation of the replicas per slot
    for sample in range(20):
        origins = [r.origin(sample, 3, q) for q in range(n)]
        assert sorted(origins) == list(range(n))
    fixed = Router("fixed", n)
    assert all(fixed.perm(s, b) == list(range(n)) for s in range(10) for b in range(3))
    assert Router("random", 1).perm(5, 0) == [0]


def _simulate(stages: int, microbatches: int, fwd: float = 1.0, bwd: float = 2.0):
    """Run every stage's 1F1B op list against the data dependencies; returns the makespan.

    Raises if some stage waits on something no stage will ever produce (a deadlock)."""
    ops = [one_f_one_b(stages, s, microbatches) for s in range(stages)]
    pos, clock, done = [0] * stages, [0.0] * stages, {}
    while any(pos[s] < len(ops[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(ops[s]):
                continue
            op, m = ops[s][pos[s]]
            if op == "F":
                dep = ("F", s - 1, m) if s > 0 else None
            else:
                dep = ("B", s + 1, m) if s < stages - 1 else ("F", s, m)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done.get(dep, 0.0))
            clock[s] = start + (fwd if op == "F" else bwd)
            done[(op, s, m)] = clock[s]
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("deadlock")
    return max(clock)


@pytest.mark.slow("stage threads")
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (3, 2), (4, 8), (4, 3)])
def test_1f1b_schedule_is_complete_deadlock_free_and_has_the_documented_bubble(
        stages, microbatches):
    for s in range(stages):
        ops = one_f_one_b(stages, s, microbatches)
        assert Counter(ops) == Counter([("F", m) for m in range(microbatches)]
                                       + [("B", m) for m in range(microbatches)])
        in_flight, peak = 0, 0
        for op, m in ops:
            if op == "B":
                assert ops.index(("F", m)) < ops.index(("B", m))
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= min(stages - s, microbatches)  # 1F1B's memory bound
    makespan = _simulate(stages, microbatches)
    busy = 3.0 * microbatches
    assert 1 - busy / makespan == pytest.approx(bubble_fraction(stages, microbatches))


def test_default_microbatches():
    assert default_microbatches(16, 2) == 4
    assert default_microbatches(3, 2) == 3
    assert default_microbatches(1, 4) == 1


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_stages_partition_the_model_and_compose_to_its_forward(stages):
    full = build(ARGS, seed=0)
    names = [n for n, _ in full.named_parameters()]
    x = torch.randint(0, ARGS.vocab_size, (2, 16))
    want = full(x)
    parts = [build_stage(build(ARGS, seed=0), stages, s) for s in range(stages)]
    got = [n for st in parts for n, _ in st.named_parameters()]
    assert got == names  # disjoint, complete, in model order, with the full model's names
    h = x
    for st in parts:
        h = st(h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    sizes = [len(stage_blocks(ARGS.n_layers, stages, s)) for s in range(stages)]
    assert max(sizes) - min(sizes) <= 1
    # pruning frees the other stages' modules from the model that was cut
    model = build(ARGS, seed=0)
    st = build_stage(model, stages, stages - 1)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in st.parameters())


# ---- multi-rank: one replica, two stages against the one-stage model -------------------

@torch.no_grad()
def _sgd(params: list[torch.Tensor], lr: float = 0.5) -> None:
    # Plain SGD by hand: torch.optim's first use imports torch._dynamo, seconds per process.
    for p in params:
        p.sub_(lr * p.grad)
        p.grad = None


def _train(runner, params, steps: int, replica: int = 0):
    losses, first_grads, emb0 = [], None, None
    for i, (x, y) in enumerate(_batches(steps, replica)):
        if emb0 is None:
            emb0 = params[0].detach().clone()
        loss = runner.train_step(x, y, i)  # a tensor (LocalRunner), a number or None
        losses.append(float(loss) if loss is not None else None)
        if first_grads is None:
            first_grads = [p.grad.clone() for p in params]
        _sgd(params)
    return losses, first_grads, emb0


def _one_replica_two_stages(rank: int, world: int, steps: int) -> dict:
    out = {}
    for routing in ("fixed", "random"):
        runner, _ = _runner(_cfg(1, 2, routing, microbatches=2))
        params = runner.parameters()
        losses, grads, before = _train(runner, params, steps)
        out[routing] = {
            "losses": losses,
            "names": [n for n, _ in runner.named_parameters()],
            "grads": grads,
            "emb_change": (params[0].detach() - before).abs().max().item() if rank == 0
            else None,
            "activation_bytes": runner.activation_bytes,
        }
    return out


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(240)
def test_two_stages_equal_one_stage_and_random_routing_with_one_replica_equals_fixed():
    steps = 4
    res = run_ranks(_one_replica_two_stages, 2, steps)

    from noloco.train import LocalRunner
    model = build(ARGS, seed=0)
    params = list(model.parameters())
    ref_losses, ref_grads, _ = _train(LocalRunner(model), params, steps)
    ref = dict(zip([n for n, _ in model.named_parameters()], ref_grads, strict=True))

    fixed, random = res[1]["fixed"], res[1]["random"]
    assert res[0]["fixed"]["losses"] == [None] * steps  # only the last stage reports a loss
    assert fixed["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert random["losses"] == fixed["losses"]  # one replica: random routing is the identity
    # Every stage's first-step gradients are the one-stage model's, embedding included.
    for rank in (0, 1):
        names, grads = res[rank]["fixed"]["names"], res[rank]["fixed"]["grads"]
        for name, g in zip(names, grads, strict=True):
            torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6, msg=name)
    assert res[0]["fixed"]["names"][0] == "tok_embeddings.weight"
    emb_grad = res[0]["fixed"]["grads"][0]
    assert emb_grad.abs().sum() > 0  # the reference code's defect: a zero gradient here
    assert res[0]["fixed"]["emb_change"] > 0 and res[0]["random"]["emb_change"] > 0
    # Stage 0 sends activations (B·T·dim floats a step); stage 1 sends their gradients back;
    # with random routing the labels (B·T int32) travel too.
    act = B * T * ARGS.dim * 4 * steps
    assert res[0]["fixed"]["activation_bytes"] == act
    assert res[0]["random"]["activation_bytes"] == act + B * T * 4 * steps
    assert res[1]["fixed"]["activation_bytes"] == res[1]["random"]["activation_bytes"] == act


# ---- multi-rank: two replicas × two stages, random routing -----------------------------

def _two_by_two_random(rank: int, world: int, step: int, microbatches: int) -> dict:
    from noloco.comm import TorchCommunicator
    from noloco.methods import NoLoCo

    cfg = _cfg(2, 2, "random", microbatches)
    runner, lay = _runner(cfg)
    stage_comms = [TorchCommunicator(lay.stage_ranks(s)) for s in range(lay.stages)]
    x, y = _batches(1, lay.replica)[0]
    loss = runner.train_step(x, y, step)  # identical weights on every replica here
    out = {"loss": loss, "slot_losses": list(runner.slot_losses),
           "names": [n for n, _ in runner.named_parameters()],
           "grads": [p.grad.clone() for p in runner.parameters()]}
    # Then NoLoCo over this stage's replicas for a few steps: outer steps and routing together.
    params = runner.parameters()
    method = NoLoCo(params, stage_comms[lay.stage], sync_every=2, group_size=2)
    for i, (x, y) in enumerate(_batches(5, lay.replica)):
        runner.train_step(x, y, step + 1 + i)
        method.sync_gradients()
        _sgd(params)
        method.after_inner_step()
    out["outer_steps"] = method.outer_steps
    out["eval"] = runner.eval_loss(_batches(2, 7))
    return out


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(240)
def test_random_routing_carries_labels_and_retraces_gradients_on_two_replicas():
    step, microbatches = 3, 4
    res = run_ranks(_two_by_two_random, 4, step, microbatches)
    router = Router("random", 2, seed=0)
    model = build(ARGS, seed=0)
    names = [n for n, _ in model.named_parameters()]

    def ref_microbatch(replica: int, m: int):
        x, y = _batches(1, replica)[0]
        return x.tensor_split(microbatches)[m], y.tensor_split(microbatches)[m]

    crossed = 0
    for q in range(2):  # last-stage replica q: rank q·2 + 1
        last = res[2 * q + 1]
        assert len(last["slot_losses"]) == microbatches  # exactly one microbatch per slot
        for m in range(microbatches):
            origin = router.origin(step * microbatches + m, 1, q)
            crossed += origin != q
            xm, ym = ref_microbatch(origin, m)
            with torch.no_grad():
                want = lm_loss(model(xm), ym).item()
            assert last["slot_losses"][m] == pytest.approx(want, abs=1e-5)  # labels travelled
        assert last["loss"] == pytest.approx(sum(last["slot_losses"]) / microbatches)
    assert crossed > 0  # the chosen step really sends sequences across replicas

    # Gradients retrace the path: replica r's stage-0 gradients are exactly those of the
    # one-stage model on replica r's own batch, wherever its microbatches went.
    for r in range(2):
        model.zero_grad()
        x, y = _batches(1, r)[0]
        lm_loss(model(x), y).backward()
        ref = dict(zip(names, [p.grad for p in model.parameters()], strict=True))
        first = res[2 * r]
        for name, g in zip(first["names"], first["grads"], strict=True):
            torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6, msg=name)
    assert all(r["outer_steps"] == 2 for r in res)
    evals = [res[1]["eval"], res[3]["eval"]]
    assert res[0]["eval"] is None and all(torch.isfinite(torch.tensor(evals)))


# ---- a whole worker run: summary.json for P > 1 ----------------------------------------

def _worker(rank: int, world: int, cfg_dict: dict) -> dict | None:
    from noloco.spec import WorkerSpec
    from noloco.worker import run
    return run(WorkerSpec.under_torchrun(Config.from_dict(cfg_dict), rundir_ready=True))


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(240)
def test_noloco_two_replicas_two_stages_worker_run_writes_a_right_summary(tmp_path,
                                                                          corpus):
    from noloco.rundir import RunDir

    steps, sync_every, bsz, seq = 5, 2, 4, 32
    argv = ["--method", "noloco", "--replicas", "2", "--stages", "2", "--routing", "random",
            "--sync-every", str(sync_every), "--data", str(corpus), "--steps", str(steps),
            "--eval-every", "2", "--batch-size", str(bsz), "--seq-len", str(seq),
            "--eval-sequences", "8", "--microbatches", "2", "--out", str(tmp_path / "run")]
    from noloco.cli import build_parser, config_from_args
    cfg = config_from_args(build_parser().parse_args(["train", *argv])).resolved()
    RunDir(tmp_path / "run").prepare(cfg, overwrite=False)
    run_ranks(_worker, 4, cfg.to_dict())

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(x) for x in lines]
    assert summary["stages"] == 2 and summary["replicas"] == 2
    per_rep = list(summary["final_val_loss_per_replica"].values())
    assert len(per_rep) == 2 and all(v is not None and 0 < v < 10 for v in per_rep)
    assert per_rep == metrics[-1]["val_loss_per_replica"]
    assert summary["final_val_loss"] == pytest.approx(sum(per_rep) / 2)
    assert summary["params"] == summary["param_bytes"] / 4
    # Synchronisation: each outer step exchanges every stage's fast weights once (γ = β).
    outer = steps // sync_every
    assert summary["outer_steps"] == outer
    assert summary["bytes_sent"] == outer * summary["param_bytes"]
    # Activation traffic, counted apart: per step, stage 0 sends activations and labels,
    # stage 1 the activations' gradients.
    dim = preset("tiny").dim
    assert summary["activation_bytes"] == steps * (2 * bsz * seq * dim * 4 + bsz * seq * 4)
    assert summary["schedule"] == "1f1b" and summary["microbatches"] == 2
    assert summary["bubble_fraction"] == pytest.approx(1 / 3)
    assert summary["weight_spread"] > 0  # one inner step after the last outer step


# ---- bad input -------------------------------------------------------------------------

def test_more_stages_than_blocks_is_a_one_line_error(tmp_path, capsys):
    rc = main(["train", "--stages", "5", "--steps", "1", "--out", str(tmp_path / "x")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("noloco: error: --stages 5 is more than the 4 blocks")
    assert err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_world_size_that_is_not_replicas_times_stages_is_a_one_line_error(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")  # as if started by torchrun with 3 workers
    rc = main(["train", "--method", "ddp", "--replicas", "2", "--stages", "2", "--steps", "1",
               "--out", str(tmp_path / "x")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err == ("noloco: error: world size 3 does not match --replicas 2 x --stages 2 "
                   "= 4 workers\n")
    from noloco.distributed import Layout
    with pytest.raises(ConfigError):
        Layout.from_env(2, 2)


@pytest.mark.slow("worker processes in pipeline stages")
@pytest.mark.timeout(300)
def test_two_stages_clip_like_one_stage_with_the_default_optimizer(tmp_path, corpus):
    """With the defaults (AdamW, --grad-clip 1.0) two stages train the same model as one:
    the gradient is clipped by the norm of the replica's whole model, not stage by stage."""
    from run_utils import summary, train, weights

    args = ("--method", "single", "--steps", "6", "--preset", "tiny", "--eval-every", "6",
            "--checkpoint-every", "0", "--warmup", "0", "--lr", "3e-3")
    assert train(tmp_path / "one", corpus, *args) == 0
    assert train(tmp_path / "two", corpus, *args, "--stages", "2",
                 "--routing", "fixed") == 0
    one, two = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], abs=2e-5)
    w1 = weights(tmp_path / "one")["replica-0.safetensors"]
    w2 = {k: v for f, sd in weights(tmp_path / "two").items() if f.startswith("replica-0.")
          for k, v in sd.items()}
    assert set(w1) == set(w2)
    # Microbatching changes the float rounding of the gradients, which Adam's normalisation
    # magnifies where the second moment is tiny: a few elements move ~5e-5, clipped or not.
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=2e-4, msg=k)


def _spread_rank(rank: int, world: int) -> dict:
    from noloco.comm import TorchCommunicator
    from noloco.distributed import Layout
    from noloco.metrics import weight_spread

    lay = Layout(rank=rank, world=world, local_world=world, replica=rank // 2, stage=rank % 2,
                 replicas=2, stages=2)
    gathered: list[int] = []

    class World(TorchCommunicator):
        def all_gather(self, tensor):  # records what every rank must hold from all others
            gathered.append(tensor.numel())
            return super().all_gather(tensor)

    world_comm = World(list(range(world)), group=dist.group.WORLD)
    # new_group is world-collective: every rank creates every stage group, in one order.
    stage_comm = [TorchCommunicator(lay.stage_ranks(s)) for s in range(2)][lay.stage]
    g = torch.Generator().manual_seed(rank)
    sizes = (300, 500) if lay.stage == 0 else (700,)
    params = [torch.randn(n, generator=g) for n in sizes]
    spread = weight_spread(params, lay, world_comm, stage_comm)
    # in pieces of 7, 512 and 1000 values (parameters cut across pieces): the same spread
    pieces = [weight_spread(params, lay, world_comm, stage_comm, chunk=c) for c in (7, 512, 1000)]
    return {"spread": spread, "pieces": pieces, "params": params, "gathered": gathered,
            "stage_bytes": stage_comm.bytes_sent}


def _spread_one_stage(rank: int, world: int) -> dict:
    from noloco.comm import TorchCommunicator
    from noloco.distributed import Layout
    from noloco.metrics import weight_spread

    lay = Layout(rank=rank, world=world, local_world=world, replica=rank, replicas=world)
    used: list[str] = []

    class Recording(TorchCommunicator):
        def all_reduce_mean_async(self, tensor):
            used.append(self.name)
            return super().all_reduce_mean_async(tensor)

    world_comm = Recording(list(range(world)), group=dist.group.WORLD)
    world_comm.name = "world"
    method_comm = Recording(list(range(world)))
    method_comm.name = "method"
    params = [torch.randn(n, generator=torch.Generator().manual_seed(rank)) for n in (300, 70)]
    spread = weight_spread(params, lay, world_comm, method_comm, chunk=128)
    return {"spread": spread, "params": params, "used": used,
            "method_bytes": method_comm.bytes_sent}


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
def test_weight_spread_takes_its_means_on_the_methods_own_group():
    """Not on the world's group: on NCCL its kernels could run beside a sync still in flight
    on the method's group (two communicators' kernels at once can deadlock); on the method's
    own group they queue behind it. The accounting of the method's group is untouched."""
    res = run_ranks(_spread_one_stage, 2)
    st = torch.stack([torch.cat(r["params"]).double() for r in res])
    expected = (float(((st - st.mean(0)) ** 2).sum()) / (st[0].numel() * 2)) ** 0.5
    for r in res:
        assert r["spread"] == pytest.approx(expected, rel=1e-12)
        assert r["used"] == ["method"] * 3  # 370 values in pieces of 128
        assert r["method_bytes"] == 0


@pytest.mark.slow("gloo ranks in worker processes")
@pytest.mark.timeout(120)
def test_weight_spread_with_stages_is_reduced_not_gathered():
    res = run_ranks(_spread_rank, 4)
    # Expected: each stage's parameters against that stage's mean over the 2 replicas.
    sq, n = 0.0, 0
    for stage in (0, 1):
        reps = [torch.cat(res[r * 2 + stage]["params"]).double() for r in (0, 1)]
        st = torch.stack(reps)
        sq += float(((st - st.mean(0)) ** 2).sum())
        n += reps[0].numel()
    expected = (sq / (n * 2)) ** 0.5
    for r in res:
        assert r["spread"] == pytest.approx(expected, rel=1e-12)
        assert r["pieces"] == pytest.approx([expected] * 3, rel=1e-12)
        # Only scalars go through the world: no rank gathers another's weights.
        assert max(r["gathered"]) <= 2
        assert r["stage_bytes"] == 0  # the method's accounting is untouched
