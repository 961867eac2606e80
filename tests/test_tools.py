"""The user's tools around a finished run: generate, report, TensorBoard."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from run_utils import train

from noloco.cli import main
from noloco.generate import generate


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {"single": root / "single", "diloco": root / "diloco"}
    assert train(out["single"], corpus, "--steps", "4", "--eval-every", "2",
                 "--checkpoint-every", "0") == 0
    assert train(out["diloco"], corpus, "--method", "diloco", "--replicas", "2",
                 "--sync-every", "2", "--steps", "4", "--eval-every", "2",
                 "--checkpoint-every", "0") == 0
    return out


@pytest.mark.slow("a two-replica run (module fixture)")
@pytest.mark.timeout(240)
def test_generate_samples_text_deterministically(runs, capsys) -> None:
    a = generate(runs["single"], "ROMEO:", max_tokens=30, seed=1)
    assert a == generate(runs["single"], "ROMEO:", max_tokens=30, seed=1)
    assert 0 < len(a) <= 30  # byte tokens: at most one character each (bad UTF-8 → U+FFFD)
    assert generate(runs["single"], "x", max_tokens=5, temperature=0) == generate(
        runs["single"], "x", max_tokens=5, temperature=0, seed=99)  # greedy ignores the seed
    # DiLoCo's final weights: the average (default) and each replica.
    assert generate(runs["diloco"], "a", max_tokens=5, which="replica-1")
    assert main(["generate", str(runs["diloco"]), "--prompt", "To be", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("To be")


@pytest.mark.slow("a two-replica run (module fixture)")
@pytest.mark.timeout(60)
def test_generate_bad_input_is_one_line(runs, tmp_path, capsys) -> None:
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert main(["generate", str(runs["diloco"]), "--prompt", "x", "--which", "replica-7"]) == 2
    assert main(["generate", str(runs["single"]), "--prompt", "x", "--top-k", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("noloco: error: ") for e in err)


@pytest.mark.slow("a two-replica run (module fixture)")
@pytest.mark.timeout(120)
def test_report_compares_runs(runs, tmp_path, capsys) -> None:
    out = tmp_path / "report"
    assert main(["report", str(runs["single"]), str(runs["diloco"]), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    rows = [x for x in md.splitlines() if x.startswith("| single") or x.startswith("| diloco")]
    assert len(rows) == 2 and "| diloco | diloco | 2 | 1 | 2 | adamw | fp32 | fp32 |" in md
    if importlib.util.find_spec("matplotlib"):
        pngs = sorted(p.name for p in out.glob("*.png"))
        assert pngs == ["val_loss_bytes.png", "val_loss_tokens.png", "val_loss_wall.png",
                        "weight_spread.png"]
        assert all((out / p).stat().st_size > 5000 for p in pngs)
    assert main(["report", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "is not a run directory" in capsys.readouterr().err


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(240)
def test_tensorboard_events_hold_every_metric(tmp_path, corpus) -> None:
    pytest.importorskip("tensorboard", reason="the 'tb' extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    assert train(out, corpus, "--method", "noloco", "--replicas", "2", "--sync-every", "2",
                 "--steps", "4", "--eval-every", "2", "--checkpoint-every", "0",
                 "--tensorboard") == 0
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"val_loss", "train_loss", "bytes_sent", "sync_seconds", "weight_spread",
            "val_loss_per_replica/0", "val_loss_per_replica/1"} <= tags
    assert [e.step for e in acc.Scalars("val_loss")] == [0, 2, 4]
    assert [e.step for e in acc.Scalars("train_loss")] == [2, 4]  # none before training
    from run_utils import metrics
    last = metrics(out)[-1]
    assert acc.Scalars("val_loss")[-1].value == pytest.approx(last["val_loss"], rel=1e-6)


def _wandb_records(b: bytes) -> list[bytes]:
    """The protobuf records of a .wandb file: a 7-byte file header (":W&B", magic, version),
    then LevelDB-log framing — 32 KiB blocks of chunks, each with a 7-byte header (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last). Read here because wandb 0.31 no longer
    ships a Python reader."""
    import struct

    out, pos, buf, block = [], 7, b"", 32768
    while pos + 7 <= len(b):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", b[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left  # block padding
            continue
        data, pos = b[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(data)
        elif kind == 2:
            buf = data
        elif kind == 3:
            buf += data
        elif kind == 4:
            out.append(buf + data)
    return out


@pytest.mark.slow("worker processes")
@pytest.mark.timeout(240)
def test_wandb_offline_run_holds_every_evaluation(tmp_path, corpus) -> None:
    pytest.importorskip("wandb", reason="the 'wandb' extra")
    from run_utils import metrics
    from wandb.proto import wandb_internal_pb2

    out = tmp_path / "wb"
    assert train(out, corpus, "--method", "noloco", "--replicas", "2", "--sync-every", "2",
                 "--steps", "4", "--eval-every", "2", "--checkpoint-every", "0",
                 "--wandb") == 0
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((out / "wandb").rglob("*"))
    rows = []
    for data in _wandb_records(files[0].read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in rec.history.item})
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert [r["val_loss"] for r in rows] == pytest.approx([m["val_loss"] for m in metrics(out)])
    assert "train_loss" not in rows[0] and "val_loss_per_replica/1" in rows[-1]


@pytest.mark.slow("a two-replica run (module fixture)")
@pytest.mark.timeout(240)
def test_export_loads_in_transformers_with_the_same_logits(runs, tmp_path, capsys) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from noloco.checkpoint import load_model
    from noloco.data import ByteTokenizer

    out = tmp_path / "hf"
    assert main(["export", str(runs["diloco"]), str(out), "--which", "replica-1"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ours = load_model(runs["diloco"], "replica-1").eval()
    x = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=0, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "Thou art, wörld!\n\t\x01ÿ"
    ids = [int(i) for i in ByteTokenizer().encode(text)]
    assert tok.encode(text, add_special_tokens=False) == ids and tok.decode(ids) == text
    assert tok.eos_token_id == 256 == hf.config.eos_token_id
    # generate reads the exported directory too, and gives the run's own greedy text.
    assert generate(out, "ab", max_tokens=6, temperature=0) == generate(
        runs["diloco"], "ab", max_tokens=6, temperature=0, which="replica-1")
    # An existing non-empty directory is refused, nothing overwritten.
    before = (out / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["export", str(runs["single"]), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (out / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow("a two-replica run (module fixture)")
@pytest.mark.timeout(120)
def test_generate_with_the_kv_cache_samples_the_same_tokens(runs, monkeypatch) -> None:
    from noloco import generate as gen

    for kw in (dict(temperature=0.8, seed=3), dict(temperature=0, top_k=None)):
        cached = generate(runs["single"], "ROMEO:", max_tokens=40, **kw)
        assert cached == generate(runs["single"], "ROMEO:", max_tokens=40, cache=False, **kw)
    # past the context the window slides: still today's tokens (recomputed per token there)
    real = gen.load_sampler
    calls = {"cached": 0}

    class Counted:  # the built-in model, its cached forwards counted
        def __init__(self, model):
            self.model, self.args = model, model.args

        def parameters(self):
            return self.model.parameters()

        def __call__(self, x, kv=None):
            calls["cached"] += kv is not None
            return self.model(x, kv)

    def small_context(path, which=None):
        s = real(path, which)
        s.context = 16
        s.model = Counted(s.model)
        return s
    monkeypatch.setattr(gen, "load_sampler", small_context)
    a = generate(runs["single"], "To be", max_tokens=30, seed=5)
    assert a == generate(runs["single"], "To be", max_tokens=30, seed=5, cache=False)
    assert calls["cached"] == 16 - len("To be") + 1  # cached until the window slid


def test_progress_without_a_terminal_shows_percent_and_time_left(capsys) -> None:
    from noloco.metrics import Progress, duration

    assert [duration(x) for x in (4.4, 65, 3600 * 2 + 7 * 60 + 3)] == [
        "4 s", "1 min 05 s", "2 h 07 min"]
    p = Progress(enabled=True, total=400, start=100)  # resumed at step 100
    assert p.plain_line(100, "9 tok/s", 0.0) == "step    100/400 ( 25%) | 9 tok/s"
    # 100 steps in 50 s since the resume: 200 steps left take 100 s
    assert p.plain_line(200, "9 tok/s", 50.0) == (
        "step    200/400 ( 50%) | 9 tok/s | 1 min 40 s left")
    p.step(110, 2.5, 100)
    assert "step    110/400 ( 28%) | loss 2.500" in capsys.readouterr().out


def test_tokens_per_second_and_time_left_follow_a_slowdown_at_once(capsys) -> None:
    """300 steps at 0.1 s, then 60 at 1 s: the whole run's average (0.25 s a step) would say
    160 s left of 640 steps; the recent window says 640 s, and 1/10 of the tokens/s."""
    from noloco.metrics import Progress

    now = [0.0]
    p = Progress(enabled=True, total=1000, log_every=360, clock=lambda: now[0])
    for step in range(1, 361):
        now[0] += 0.1 if step <= 300 else 1.0
        p.step(step, 2.0, 1000)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == "step    360/1000 ( 36%) | loss 2.000 | 1,000 tok/s | 10 min 40 s left", line


def test_the_progress_line_reads_the_loss_only_when_it_prints_and_shows_mfu(capsys) -> None:
    """A loss tensor is read at the log interval only; on a GPU of known peak the line says
    the model FLOPs utilisation (tokens/s x FLOPs per token / peak)."""
    import torch

    from noloco import footprint
    from noloco.metrics import Progress

    reads = []

    class Loss(torch.Tensor):
        def __float__(self):
            reads.append(1)
            return 2.0

    now = [0.0]
    p = Progress(enabled=True, total=100, log_every=10, clock=lambda: now[0],
                 flops_per_token=6e6, peak_flops=1e12)
    for step in range(1, 21):
        now[0] += 0.1
        p.step(step, torch.zeros(()).as_subclass(Loss), 10_000)
    assert len(reads) == 2  # steps 10 and 20
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "loss 2.000 | 100,000 tok/s | MFU 60%" in line, line  # 1e5 x 6e6 / 1e12
    assert footprint.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert footprint.peak_flops("Some GPU", "bf16") is None
    from noloco.config import Config

    # tiny: d 128, 4 layers, SwiGLU 384, 256 tokens. Multiplying parameters: per layer
    # 4·d² + 3·d·f (+ 2 norms of d), the final norm and the output head V·d.
    n, layers, dim, vocab = footprint.model_shape(Config().resolved(), 256)
    multiplying = 4 * (4 * 128**2 + 3 * 128 * 384 + 2 * 128) + 128 + 256 * 128
    assert footprint.flops_per_token(n, layers, dim, vocab, 64) == (
        6 * multiplying + 12 * 4 * 128 * 64) == 5_708_544


@pytest.mark.slow("a two-replica run (module fixture)")
@pytest.mark.timeout(60)
def test_the_closing_summary_names_noloco_report(runs, capsys) -> None:
    from noloco.metrics import Progress

    Progress(enabled=True, total=4).final(json.loads(
        (runs["single"] / "summary.json").read_text()), "runs/x")
    out = capsys.readouterr().out
    assert "next: noloco report runs/x" in out and "noloco train --resume runs/x" in out


def test_the_report_names_what_each_run_exchanges() -> None:
    from noloco.report import exchange

    assert exchange({"method": "single", "replicas": 1}) == "—"
    assert exchange({"method": "diloco", "replicas": 4, "quantize": "none"}) == "fp32"
    assert exchange({"method": "ddp", "replicas": 4}) == "fp32"
    assert exchange({"method": "streaming", "replicas": 4, "quantize": "fp4"}) == "fp4"
    assert exchange({"method": "sparseloco", "replicas": 4, "compress": "topk:0.02:2",
                     "ef_decay": 0.95}) == "topk:0.02:2, EF 0.95"


def test_an_injected_kill_publishes_the_step_before_the_signal(monkeypatch) -> None:
    """The launcher names the step from the worker's heartbeat: the injector beats first, so
    "failed at step S" matches the worker's own "after step S"."""
    import signal

    from noloco import faults

    seen: list[str] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: seen.append(f"signal {sig}"))
    inj = faults.FaultInjector(faults.parse_faults("kill:0@5", 1, 1), 0, 0, 0, once=True,
                               publish=lambda: seen.append("beat"))
    inj.after_step(4)
    assert seen == []
    inj.after_step(5)
    assert seen == ["beat", f"signal {signal.SIGKILL}"]


def test_evaluation_lines_fit_80_columns(capsys):
    """An evaluation line within a terminal's 80 columns, whatever the sizes (issue 38)."""
    from noloco.metrics import Progress, short_bytes

    assert [short_bytes(n) for n in (0, 980, 9_949, 12_345, 1.234e6, 3.4e8, 999_600, 1.2e9,
                                     1.5e13, 2e16)] == [
        "0 B", "980 B", "9.9 kB", "12 kB", "1.2 MB", "340 MB", "1.0 MB", "1.2 GB", "15 TB",
        "20000 TB"]
    p = Progress(enabled=True, total=99_999)
    for rec, blocked in (({"step": 0, "train_loss": None}, 0.0),
                         ({"step": 99_999, "train_loss": 12.3456}, 99.94),
                         ({"step": 5, "train_loss": 2.34564}, 123.4)):
        p.eval_line({**rec, "val_loss": 10.1234, "weight_spread": 1.234e-3,
                     "bytes_sent": 123.4e9, "sync_seconds": blocked, "wall_seconds": 12345.6})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(len(x) <= 80 for x in lines), [len(x) for x in lines]
    assert lines[0].startswith("step     0  train   —     val 10.123  spread 1.2e-03")
    assert lines[1].startswith("step 99999  train 12.346")
    assert lines[1].endswith("sent 123 GB  blocked 99.9s")
    assert lines[2].startswith("step     5  train 2.3456") and lines[2].endswith("blocked 123s")
    # an elastic replica's own line: its number where the run's spread would be
    p.eval_line({"step": 99_999, "train_loss": 12.3456, "val_loss": 10.1234, "replica": 999,
                 "bytes_sent": 123.4e9, "sync_seconds": 99.94}, speaks=True)
    Progress(enabled=False, total=9).eval_line({**rec, "val_loss": 1.0, "weight_spread": 0.0,
                                               "bytes_sent": 0, "sync_seconds": 0.0})
    (line,) = capsys.readouterr().out.splitlines()
    assert len(line) <= 80 and line.startswith("step 99999  train 12.346  val 10.123  replica 999")
