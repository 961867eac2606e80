"""Checkpoint files, the run directory's write rules, and the pieces of resuming (no training)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from noloco import checkpoint as C
from noloco.config import RESUMABLE, Config, ConfigError
from noloco.faults import parse_faults
from noloco.model import build, preset
from noloco.rundir import RunDir, append_line, read_jsonl, write_json_atomic


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"step": 7, "model": {"w": torch.randn(4, 3, generator=g)},
            "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]},
            "rng": C.rng_state(), "inflight": [(1, 8, torch.arange(3.0), [0, 1], (2, 3))]}


def _eq(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_eq, a, b))
    return a == b


def _save(root, step, rank, state, world=1, config_hash="h"):
    ck = C.Checkpointer(root, rank, world, config_hash, every=1, keep=10)
    ck.save(step, state)
    ck.close()
    return ck


def test_state_round_trips_exactly_and_loads_without_pickle(tmp_path):
    state = _state()
    ck = _save(tmp_path, 7, 0, state)
    data, why = C.verify(tmp_path, 7, 0, "h")
    assert why == "" and ck.bytes == len(data) and ck.last_step == 7
    back = C.read_state(data)  # no pickle: tensors and a JSON tree
    assert _eq(back, state)
    receipt = json.loads(C.receipt_file(tmp_path, 7, 0).read_text())
    assert receipt["bytes"] == len(data) and receipt["config_hash"] == "h"
    assert not list(tmp_path.rglob("*.tmp"))


def test_equal_tensors_are_stored_once_and_load_as_two(tmp_path):
    p = torch.randn(300, 10)
    moments = {"exp_avg": torch.zeros(300, 10), "exp_avg_sq": torch.zeros(300, 10)}
    tree = {"model": {"w": p}, "slow": [p.clone()], "optimizer": moments}
    ck = C.Checkpointer(tmp_path, 0, 1, "h", every=1)
    ck.save(1, tree)
    ck.close()
    assert ck.bytes < 3 * 300 * 10 * 4  # two distinct tensors of the four are written
    back = C.read_state(C.verify(tmp_path, 1, 0, "h")[0])
    assert _eq(back, tree)
    a, b = back["optimizer"]["exp_avg"], back["optimizer"]["exp_avg_sq"]
    a.add_(1.0)  # an optimizer updates its moments in place: they must not share memory
    assert b.abs().sum() == 0 and back["slow"][0].data_ptr() != back["model"]["w"].data_ptr()


def test_minus_zero_is_not_stored_as_zero(tmp_path):
    a = torch.zeros(1000)
    b = torch.zeros(1000)
    b[777] = -0.0  # equal in value, not in bits
    C.write_state(tmp_path / "z", {"a": a, "b": b})
    back = C.read_state((tmp_path / "z").read_bytes())
    assert torch.equal(_raw_bits(back["b"]), _raw_bits(b))


def _raw_bits(t):
    return t.view(torch.int32)


def test_the_copy_is_taken_at_save_time(tmp_path):
    w = torch.zeros(1000)
    ck = C.Checkpointer(tmp_path, 0, 1, "h", every=1)
    ck.save(1, {"w": w})
    w.add_(1.0)  # training goes on while the file is written
    ck.close()
    assert torch.equal(C.read_state(C.verify(tmp_path, 1, 0, "h")[0])["w"], torch.zeros(1000))


def test_corrupt_truncated_unfinished_and_foreign_checkpoints_are_refused(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, 0, _state(step))
    f = C.state_file(tmp_path, 2, 0)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    C.state_file(tmp_path, 3, 0).write_bytes(C.state_file(tmp_path, 3, 0).read_bytes()[:100])
    C.receipt_file(tmp_path, 4, 0).unlink()
    assert "corrupt" in C.verify(tmp_path, 2, 0, "h")[1]
    assert "corrupt" in C.verify(tmp_path, 3, 0, "h")[1]
    assert "never finished" in C.verify(tmp_path, 4, 0, "h")[1]
    assert "other settings" in C.verify(tmp_path, 1, 0, "other")[1]
    notes = []
    step, state = C.agree_on_step(tmp_path, 0, "h", lambda x: [x], notes.append)
    assert step == 1 and _eq(state["model"], _state(1)["model"])
    assert len(notes) == 3 and all("step-0000000" in n for n in notes)


def test_workers_agree_on_the_newest_step_every_one_holds(tmp_path):
    # rank 0 holds 5, 10, 15; rank 1 holds 5, 10 and a corrupt 15; rank 2 holds 5 and 10
    # but its 10 lacks a receipt (it was killed while writing).
    for rank in range(3):
        for step in (5, 10, 15):
            if rank == 2 and step == 15:
                continue
            _save(tmp_path, step, rank, {"rank": rank, "step": step}, world=3)
    C.state_file(tmp_path, 15, 1).write_bytes(b"garbage")
    C.receipt_file(tmp_path, 10, 2).unlink()
    barrier = threading.Barrier(3)
    slots: list[int] = [0, 0, 0]
    results: dict[int, tuple] = {}

    def gather(rank: int):
        def g(x: int) -> list[int]:
            slots[rank] = x
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return g

    def work(rank: int) -> None:
        results[rank] = C.agree_on_step(tmp_path, rank, "h", gather(rank))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert {r: (s, st) for r, (s, st) in results.items()} == {
        r: (5, {"rank": r, "step": 5}) for r in range(3)}
    # What an outside observer sees from receipts alone (no hashing): only 5 has all three.
    assert C.complete_steps(tmp_path, 3) == [5]


def test_no_checkpoint_is_none(tmp_path):
    assert C.agree_on_step(tmp_path / "missing", 0, "h", lambda x: [x]) == (None, None)


class _Store:
    """A dict with the two calls of a c10d store that pruning uses."""

    def __init__(self) -> None:
        self.d: dict[str, str] = {}

    def set(self, k: str, v: str) -> None:
        self.d[k] = v

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)


def test_pruning_keeps_the_newest_complete_checkpoints_of_every_worker(tmp_path):
    store = _Store()
    fast = C.Checkpointer(tmp_path, 0, 2, "h", every=1, keep=2, store=store)
    slow = C.Checkpointer(tmp_path, 1, 2, "h", every=1, keep=2, store=store)
    for step in (1, 2, 3):
        fast.save(step, {"x": torch.zeros(1)})
        fast.wait()
    # Worker 1 has finished nothing: worker 0 must keep everything, or a crash now would
    # leave no step that both hold.
    assert C.steps_on_disk(tmp_path) == [3, 2, 1]
    slow.save(1, {"x": torch.zeros(1)})
    slow.save(2, {"x": torch.zeros(1)})
    slow.save(3, {"x": torch.zeros(1)})
    slow.wait()
    fast.prune()
    assert C.complete_steps(tmp_path, 2) == [3, 2] and C.steps_on_disk(tmp_path) == [3, 2]
    fast.close()
    slow.close()


def test_rng_streams_round_trip(tmp_path):
    import random

    import numpy as np

    state = C.rng_state()
    a = (torch.rand(3), random.random(), np.random.rand())
    C.write_state(tmp_path / "rng.pt", state)
    C.set_rng_state(C.read_state((tmp_path / "rng.pt").read_bytes()))
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_a_checkpoint_file_is_a_safetensors_file(tmp_path):
    from safetensors.torch import load_file

    state = {"w": torch.arange(6.0).reshape(2, 3), "m": {0: torch.ones(2, dtype=torch.bfloat16)},
             "b": torch.tensor(True), "e": torch.empty(0, 4), "n": float("nan"), "t": (1, "x")}
    C.write_state(tmp_path / "s.pt", state)
    raw = load_file(str(tmp_path / "s.pt"))
    assert torch.equal(raw["0"], state["w"]) and raw["1"].dtype == torch.bfloat16
    back = C.read_state((tmp_path / "s.pt").read_bytes())
    assert back["t"] == (1, "x") and back["n"] != back["n"] and back["e"].shape == (0, 4)
    assert _eq({k: v for k, v in back.items() if k != "n"},
               {k: v for k, v in state.items() if k != "n"})
    with pytest.raises(TypeError, match="cannot hold a object"):
        C.write_state(tmp_path / "bad.pt", {"x": object()})


def test_final_weights_load_back_as_a_model(tmp_path):
    args = preset("tiny", vocab_size=257)
    model = build(args, seed=3)
    C.save_weights(tmp_path / "model" / "replica-0.safetensors", dict(model.named_parameters()))
    C.write_model_index(tmp_path, args, ["replica-0"], 1, {"tokenizer": "bytes"})
    back = C.load_model(tmp_path)
    x = torch.randint(0, 257, (2, 16))
    assert torch.equal(back(x), model(x))
    with pytest.raises(KeyError, match="no model 'average'"):
        C.load_model(tmp_path, "average")
    with pytest.raises(FileNotFoundError):
        C.load_model(tmp_path / "nothing")


# ---- the run directory ------------------------------------------------------------------------

def test_metrics_lines_are_whole_and_a_torn_last_line_is_skipped(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    append_line(path, json.dumps({"step": 0}))
    append_line(path, json.dumps({"step": 1}))
    with open(path, "a") as f:
        f.write('{"step": 2, "val')  # a machine that lost power mid-write
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]
    assert "torn last line" in capsys.readouterr().err
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(path)


def test_truncating_metrics_keeps_whole_lines(tmp_path):
    rd = RunDir(tmp_path)
    for i in range(4):
        rd.append_metrics({"step": i})
    rd.truncate_metrics(2)
    assert [r["step"] for r in rd.read_metrics()] == [0, 1]
    with pytest.raises(ConfigError, match="fewer than"):
        rd.truncate_metrics(3)


def test_a_failed_atomic_write_leaves_the_old_file_and_no_tmp(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["summary.json"]


def test_remove_stale_tmp(tmp_path):
    (tmp_path / "checkpoints" / "step-00000001").mkdir(parents=True)
    stale = tmp_path / "checkpoints" / "step-00000001" / ".rank-00000.safetensors.123.tmp"
    stale.write_bytes(b"half")
    keep = tmp_path / "metrics.jsonl"
    keep.write_text("")
    RunDir(tmp_path).remove_stale_tmp()
    assert not stale.exists() and keep.exists()


def test_unwritable_out_is_refused_before_writing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        RunDir(blocker / "run").check(overwrite=False)


# ---- config: what a resume may change -----------------------------------------------------------

def test_math_hash_ignores_only_the_resumable_settings():
    a = Config().resolved()
    b = Config.from_dict(a.to_dict())
    for key in RESUMABLE:
        sec, name = key.split(".")
        v = getattr(getattr(b, sec), name)
        setattr(getattr(b, sec), name, (not v) if isinstance(v, bool) else
                ("x" if isinstance(v, str) or v is None else v + 1))
    assert a.math_hash() == b.math_hash()
    b.optim.lr *= 2
    assert a.math_hash() != b.math_hash()


def test_schedule_and_checkpoint_defaults_resolve():
    cfg = Config.from_dict({"method": {"method": "noloco", "replicas": 2}, "train": {"steps": 7}})
    r = cfg.resolved()
    assert r.optim.schedule_steps == 7 and r.train.checkpoint_every == "50"
    cfg.method.method, cfg.method.replicas = "single", 1
    assert cfg.resolved().train.checkpoint_every == "100"
    cfg.model.preset = "small"  # a save costs seconds: a cadence in time
    assert cfg.resolved().train.checkpoint_every == "10min"


@pytest.mark.parametrize("spec,cadence", [
    ("50", (50, None)), (50, (50, None)), ("0", (0, None)), ("90s", (0, 90.0)),
    ("10min", (0, 600.0)), ("1.5h", (0, 5400.0)), (" 2 m", (0, 120.0)),
    ("-1", None), ("10 days", None), ("0min", None), ("1.5", None), ("soon", None)])
def test_checkpoint_every_takes_steps_or_a_duration(spec, cadence):
    from noloco.config import checkpoint_cadence

    if cadence is None:
        with pytest.raises(ConfigError, match="--checkpoint-every takes inner steps"):
            checkpoint_cadence(spec)
    else:
        assert checkpoint_cadence(spec) == cadence


def test_a_time_cadence_is_planned_in_agreed_outer_steps(tmp_path):
    """Two workers of different speeds plan the same steps (the slower one's pace), at
    multiples of H, and the plan follows the pace of the last stretch."""
    agreed = []

    def agree(x):  # the other worker is 1.5x slower at every plan
        agreed.append(x)
        return x * 1.5

    c = C.Checkpointer(tmp_path, 0, 2, "h", 0, every_seconds=30.0, align=4)
    assert c.enabled and not c.due(0)
    c.start(2, now=0.0)  # resumed at step 2: the probe plan at step 24 (22 on, up to H)
    for step in range(3, 24):
        c.plan(step, now=0.1 * step, agree=agree)
    assert c.next_due is None and not agreed
    c.plan(24, now=2.2, agree=agree)  # 0.1 s a step here, 0.15 s agreed: 200 steps
    assert agreed == [pytest.approx(0.1)] and c.next_due == 224 and c.due(224)
    assert not any(c.due(s) for s in range(25, 224))
    c.plan(224, now=2.2 + 200 * 0.5, agree=agree)  # slower now: 0.75 s a step: 40 steps
    assert c.next_due == 264
    c.plan(264, now=1e6, agree=agree)  # slower than the cadence: still one outer step on
    assert c.next_due == 268
    assert not C.Checkpointer(tmp_path, 0, 1, "h", 0).enabled
    # an elastic replica that healed jumps to its donor's step, past the planned one: it
    # saves and plans there, instead of never again
    assert c.due(300)
    c.plan(300, now=1e6 + 3.6, agree=lambda x: x)  # 0.1 s a step: 300 steps on
    assert c.next_due == 600 and not c.due(301)
    assert Config.from_dict({"model": {"preset": "small"}, "method": {
        "method": "noloco", "replicas": 2, "stages": 2, "elastic": True, "routing": "fixed"}}
        ).resolved().train.checkpoint_every == "50"  # its stages save alone: steps


@pytest.mark.parametrize("spec,ok", [
    ("kill:1@40", True), ("stall:0@3:2.5", True), ("slow:1:2", True), ("kill:1.1@4", True),
    ("kill:1", False), ("stall:0@3", False), ("slow:1:0.5", False), ("boom:1@2", False),
    ("kill:9@1", False), ("kill:0.5@1", False), ("kill:0@0", False),
    ("hang:1@4", True), ("hang:1@4:2.5", True), ("hang:1@4:2:3", False), ("kill:1@4:2", False),
    ("pace:1:0.2", True), ("pace:1.0:0.05", True), ("pace:1:0", False), ("pace:1:inf", False),
    ("pace:1@3:0.2", False), ("pace:2:0.2", False),
])
def test_fault_specs(spec, ok):
    if ok:
        assert parse_faults(spec, replicas=2, stages=2)
    else:
        with pytest.raises(ConfigError, match="inject-fault"):
            parse_faults(spec, replicas=2, stages=2)


def test_pace_holds_a_step_to_its_shortest_time_and_slow_stretches_it(monkeypatch):
    from noloco.faults import FaultInjector

    slept: list[float] = []
    monkeypatch.setattr("noloco.faults.time.sleep", slept.append)
    faults = parse_faults("pace:0:0.2,slow:1:3,pace:1:0.5", replicas=2, stages=1)
    paced = FaultInjector(faults, replica=0, stage=0, rank=0, once=True)
    for took in (0.05, 0.15, 0.3):  # a loaded machine's longer step sleeps less
        paced.pace(took)
    assert slept == pytest.approx([0.15, 0.05])  # 0.3 s is past the pace: no sleep
    slept.clear()
    both = FaultInjector(faults, replica=1, stage=0, rank=1, once=True)
    both.pace(0.1)  # stretched 3x to 0.3 s, then to the pace's 0.5 s
    both.pace(0.2)  # stretched to 0.6 s: past the pace
    assert slept == pytest.approx([0.4, 0.4])
    slept.clear()
    FaultInjector(faults, replica=0, stage=0, rank=0, once=False).pace(0.05)
    assert slept == pytest.approx([0.15])  # a pace holds after a restart too
