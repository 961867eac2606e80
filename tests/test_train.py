"""End-to-end runs through the real CLI and launcher."""

from __future__ import annotations

import json

import pytest

from noloco.cli import main

KEYS_METRICS = {"step", "tokens", "train_loss", "val_loss", "val_loss_per_replica", "bytes_sent",
                "sync_seconds", "wall_seconds"}
KEYS_SUMMARY = {"method", "replicas", "stages", "steps", "params", "tokens_per_replica",
                "final_val_loss", "final_val_loss_per_replica", "bytes_sent_per_replica",
                "sync_seconds", "wall_seconds", "weight_spread", "compute_utilisation"}


def _read(out):
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(240)
def test_single_run_lowers_validation_loss_and_writes_contract(tmp_path, corpus):
    out = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--steps", "40", "--eval-every", "20",
            "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3", "--warmup", "5",
            "--eval-sequences", "32", "--out", str(out)]
    assert main(argv) == 0
    metrics, summary = _read(out)
    assert [m["step"] for m in metrics] == [0, 20, 40]
    assert all(KEYS_METRICS <= set(m) for m in metrics)
    assert KEYS_SUMMARY <= set(summary)
    assert metrics[-1]["val_loss"] < metrics[0]["val_loss"] - 1.0
    assert summary["final_val_loss"] == metrics[-1]["val_loss"]
    assert summary["weight_spread"] == 0.0 and summary["bytes_sent"] == 0
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 40
    # The same command again refuses to overwrite; with --overwrite it replaces the run.
    assert main(argv) == 2
    assert main([*argv, "--overwrite", "--steps", "2", "--eval-every", "1"]) == 0
    assert _read(out)[1]["steps"] == 2


@pytest.mark.timeout(240)
def test_same_seed_repeats_exactly(tmp_path, corpus):
    losses = []
    for name in ("a", "b"):
        argv = ["train", "--data", str(corpus), "--steps", "6", "--eval-every", "3",
                "--batch-size", "4", "--seq-len", "32", "--eval-sequences", "8",
                "--out", str(tmp_path / name)]
        assert main(argv) == 0
        losses.append([m["val_loss"] for m in _read(tmp_path / name)[0]])
    assert losses[0] == losses[1]


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(300)
def test_noloco_two_replicas_end_to_end(tmp_path, corpus):
    out = tmp_path / "run"
    argv = ["train", "--method", "noloco", "--replicas", "2", "--sync-every", "5",
            "--data", str(corpus), "--steps", "12", "--eval-every", "6",
            "--batch-size", "4", "--seq-len", "32", "--eval-sequences", "8", "--out", str(out)]
    assert main(argv) == 0
    metrics, s = _read(out)
    assert s["method"] == "noloco" and s["replicas"] == 2 and s["outer_steps"] == 2
    assert len(s["final_val_loss_per_replica"]) == 2
    assert s["final_val_loss"] == pytest.approx(sum(s["final_val_loss_per_replica"].values()) / 2)
    # Two outer steps, each one exchange of the fast weights (fp32) with the one partner.
    assert s["bytes_sent"] == 2 * s["params"] * 4
    assert s["bytes_sent_per_replica"] == {"0": s["bytes_sent"], "1": s["bytes_sent"]}
    assert s["weight_spread"] > 0 and s["sync_seconds"] > 0
    assert 0 < s["compute_utilisation"] <= 1


@pytest.mark.timeout(240)
def test_validation_set_is_the_same_for_every_batch_size(tmp_path, corpus):
    """Runs that differ only in --batch-size are scored on the same sequences: the same
    validation loss at step 0 (same initial weights)."""
    from run_utils import metrics

    losses = []
    for bs in ("3", "8"):
        out = tmp_path / bs
        assert main(["train", "--data", str(corpus), "--steps", "1", "--eval-every", "1",
                     "--batch-size", bs, "--seq-len", "32", "--eval-sequences", "20",
                     "--checkpoint-every", "0", "--log-every", "0", "--out", str(out)]) == 0
        first = next(m for m in metrics(out) if m.get("val_loss") is not None)
        assert first["step"] == 0
        losses.append(first["val_loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_default_threads_divide_the_cores_and_honour_omp_num_threads(monkeypatch):
    """A run's workers share the machine's cores; OMP_NUM_THREADS, where set (the user's, a
    scheduler's, or a test lane's: two lanes share two cores), caps each one — two threads of
    one process spinning in OpenMP's barriers beside other busy processes cost ~10x."""
    from noloco import data as data_mod
    from noloco.distributed import default_threads

    monkeypatch.setattr(data_mod, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [default_threads(w) for w in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert [default_threads(w) for w in (1, 2, 8)] == [2, 2, 1]
    for junk in ("", "0", "auto", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert default_threads(1) == 8
    # torchrun sets OMP_NUM_THREADS=1 for every worker of a multi-worker node on its own
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert default_threads(2) == 4


class _Store:
    """The part of a c10d store the stop agreement uses, in memory."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def get(self, key):
        return self.kv[key]

    def compare_set(self, key, expected, desired):
        cur = self.kv.get(key, b"").decode()
        if cur == expected:
            self.kv[key] = desired.encode()
        return self.kv[key] if key in self.kv else b""


def _worker(store, rank: int, step: int):
    from types import SimpleNamespace

    from noloco.distributed import Layout

    me = SimpleNamespace(state=SimpleNamespace(step=step), lay=Layout(world=2, replicas=2),
                         ctx=SimpleNamespace(store=store, attempt=0), elastic=None)
    me.lay = SimpleNamespace(world=2, rank=rank)
    return _bound(me)


def _bound(me):
    from noloco.train import Trainer

    me.stop_board = lambda: Trainer.stop_board(me)
    me._agree_on = lambda board, abandon: Trainer._agree_on(me, board, abandon)
    return lambda **kw: Trainer.agree_stop_step(me, **kw)


def _elastic_stage(store, stage: int, step: int, incarnation: int = 0, stages: int = 2):
    """Pipeline stage ``stage`` of elastic replica 3, at ``step``: its stop board is its
    ElasticReplica's, in the run's store."""
    from types import SimpleNamespace

    from noloco.elastic.worker import ElasticReplica

    lay = SimpleNamespace(replica=3, stage=stage, stages=stages)
    elastic = ElasticReplica(SimpleNamespace(store=store, incarnation=incarnation))
    me = SimpleNamespace(state=SimpleNamespace(step=step), lay=lay, elastic=elastic,
                         ctx=SimpleNamespace(store=None, attempt=incarnation))
    elastic.trainer = me
    return _bound(me)


class _CutStore(_Store):
    def check(self, keys):
        import torch.distributed as dist

        raise dist.DistStoreError("wait timeout after 1000ms")


def test_stop_agreement_the_largest_step_or_abandoned_for_everyone(monkeypatch):
    """Two workers stop at the larger step they posted; a worker that gives up waiting
    (its partner never got the signal) fixes the stop as abandoned, and a partner that posts
    afterwards stops at once too instead of checkpointing alone."""
    import noloco.train as train_mod

    monkeypatch.setattr(train_mod, "STOP_PAUSE_SECONDS", 0.0)
    store = _Store()
    a, b = _worker(store, 0, 7), _worker(store, 1, 9)
    assert a() is None  # rank 1 has not posted: rank 0 posts 8 and takes one more step
    assert b() == 9  # its post completes the set: the largest
    assert a() == 9
    store = _Store()
    a, b = _worker(store, 0, 7), _worker(store, 1, 9)
    assert a() is None
    assert a(abandon=True) == train_mod.ABANDONED
    assert b() == train_mod.ABANDONED
    store = _Store()
    a, b = _worker(store, 0, 7), _worker(store, 1, 9)
    a(), b()
    assert a(abandon=True) == 9  # fixed already: giving up comes too late to change it


def test_an_elastic_replicas_stages_agree_on_their_stop_step_in_the_runs_store(monkeypatch):
    """An elastic replica's pipeline stages stop at one step (each step passes through all
    of them), agreed under the replica's incarnation in the run's store; a replica of one
    stage stops where it is, alone; a store out of reach gives no answer yet (a stage that
    abandoned alone would leave the others training into a step it never takes)."""
    import noloco.train as train_mod
    from noloco.elastic.keys import stop_key

    monkeypatch.setattr(train_mod, "STOP_PAUSE_SECONDS", 0.0)
    store = _Store()
    a, b = _elastic_stage(store, 0, 12), _elastic_stage(store, 1, 11)
    assert b() is None  # stage 0 has not posted: stage 1 posts 12 and takes one more step
    assert a() == 12 and b() == 12
    assert set(store.kv) == {stop_key(3, 0)}
    assert _elastic_stage(store, 0, 30, incarnation=1)() is None  # a respawn agrees anew
    assert _elastic_stage(store, 0, 17, stages=1)() == 17  # alone: where it is
    assert set(store.kv) == {stop_key(3, 0), stop_key(3, 1)}
    # Out of reach: not known yet (asked again at the next boundary), never abandoned alone.
    assert _elastic_stage(_CutStore(), 1, 11)() is None
    assert _elastic_stage(_CutStore(), 1, 11)(abandon=True) is None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hang_at, slower", [(1, True), (12, False)])
def test_the_steady_rate_leaves_the_first_steps_out(tmp_path, corpus, hang_at, slower):
    """summary.json's steady_tokens_per_second (the GPU's MFU is computed from it) leaves a
    process's first steps out, where --compile compiles: a 3 s stop after step 1 slows the
    whole run's tokens/s alone; the same stop after step 12 slows both."""
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--steps", "20", "--eval-every", "20",
                 "--batch-size", "4", "--seq-len", "32", "--eval-sequences", "4",
                 "--checkpoint-every", "0", "--inject-fault", f"hang:0@{hang_at}:3",
                 "--out", str(out)]) == 0
    s = _read(out)[1]
    ratio = s["steady_tokens_per_second"] / s["tokens_per_second"]
    assert (ratio > 2) if slower else (ratio < 1.3), (ratio, s["tokens_per_second"])
