"""The device paths of issue 34, as far as a machine without a GPU can check them: ``noloco
generate --device`` and the smoke run of ``benchmarks/gpu.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_utils import train

from noloco.cli import main
from noloco.generate import generate, load_sampler

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "single"
    assert train(out, "builtin", "--max-tokens", "100000", "--steps", "4",
                 "--eval-every", "4", "--checkpoint-every", "0", "--device", "cpu") == 0
    return out


def reference_sample(path: Path, prompt: str, max_tokens: int, temperature: float, top_k: int,
                     seed: int) -> str:
    """The sampling rule written out plainly (CPU, no key/value cache, no tensors where a list
    will do): every token recomputes the whole window; the seed's generator draws one uniform
    per token up front; the token is the first of the top-k, likeliest first, whose cumulative
    probability exceeds that draw times the top-k's total."""
    s = load_sampler(path)
    draws = torch.rand(max_tokens, generator=torch.Generator().manual_seed(seed)).tolist()
    ids, new = s.encode(prompt) or [0], []
    with torch.no_grad():
        for u in draws:
            window = (ids + new)[-s.context:]
            logits = s.logits(torch.tensor([window], dtype=torch.long))[0].float() / temperature
            top = torch.topk(logits, top_k)
            total, chosen = 0.0, None
            probs = torch.softmax(top.values, -1).tolist()
            for p, token in zip(probs, top.indices.tolist(), strict=True):
                total += p
                if total > u * sum(probs) and chosen is None:
                    chosen = token
            new.append(top.indices.tolist()[-1] if chosen is None else chosen)
    return s.decode(new)


@pytest.mark.timeout(240)
def test_generate_on_the_cpu_keeps_its_tokens(run, capsys) -> None:
    cpu = generate(run, "def ", max_tokens=24, seed=7, device="cpu")
    assert cpu == reference_sample(run, "def ", 24, 0.8, 40, 7)
    if not torch.cuda.is_available():  # auto is the CPU here
        assert generate(run, "def ", max_tokens=24, seed=7) == cpu
    assert main(["generate", str(run), "--prompt", "def ", "--max-tokens", "24", "--seed", "7",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "def " + cpu + "\n"


def test_the_draw_picks_by_cumulative_probability() -> None:
    from noloco.generate import pick

    logits = torch.log(torch.tensor([0.1, 0.5, 0.0, 0.4]))  # likeliest first: 1, 3, 0 (2: never)
    picks = [int(pick(logits, torch.tensor([u]), 1.0, None)) for u in (0.0, 0.49, 0.51, 0.89,
                                                                        0.91, 0.999)]
    assert picks == [1, 1, 3, 3, 0, 0]
    # top-k 2 renormalises over tokens 1 and 3 (0.5 / 0.9 = 0.556 of the mass is token 1)
    assert [int(pick(logits, torch.tensor([u]), 1.0, 2)) for u in (0.55, 0.56, 0.999)] == [1, 3, 3]
    assert int(pick(logits, torch.tensor([0.99]), 0.0, 2)) == 1  # greedy
    # a low temperature sharpens towards the likeliest
    assert int(pick(logits, torch.tensor([0.9]), 0.05, None)) == 1


@pytest.mark.timeout(120)
def test_the_cached_sampler_equals_recomputing_every_window(capsys) -> None:
    """The static cache (sampled on the model's device, read once) gives the tokens that
    recomputing each window gives, across the point where the text outgrows the context
    (the cached part ends and the window slides), sampled and greedy. A capture that fails
    is said in one line, leaves the state as it was, and the step runs eagerly."""
    from noloco.generate import _capture, _Sampler, sample
    from noloco.model import ModelArgs, build

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=40, max_seq_len=24)
    model = build(args, seed=5).eval()
    s = _Sampler(lambda x: model(x)[:, -1], None, None, args.max_seq_len, model=model)
    ids = [3, 1, 4, 1, 5, 9, 2]
    n = s.context - len(ids) + 6  # 5 tokens past the context's end
    with torch.no_grad():
        for temperature, top_k in ((0.8, 40), (0.0, None), (1.0, None)):
            slow = sample(s, ids, n, temperature, top_k, seed=3, cache=False)
            assert sample(s, ids, n, temperature, top_k, seed=3) == slow
        short = sample(s, ids, 9, 0.8, 40, seed=4, cache=False)
        assert sample(s, ids, 9, 0.8, 40, seed=4, graph=True) == short  # (no graph on a CPU)
    capsys.readouterr()
    kv = type("KV", (), {"position": torch.tensor(5), "length": 5})()
    token, at = torch.tensor([[7]]), torch.tensor([2])

    def step():
        kv.position += 1
        kv.length += 1
        token.add_(1)
        at.add_(1)

    assert _capture(step, kv, token, at) is None  # CPU tensors: no graph
    assert (int(kv.position), kv.length, int(token), int(at)) == (5, 5, 7, 2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA graph capture failed" in err, err


@pytest.mark.timeout(240)
def test_generate_on_a_gpu_is_refused_in_one_line_without_one(run, capsys) -> None:
    assert main(["generate", str(run), "--prompt", "x", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device" in err
    if torch.cuda.is_available():  # a GPU here: it must work (its logits may differ from
        # the CPU's in the last bits, so the tokens are not compared: benchmarks/gpu.py does)
        assert isinstance(generate(run, "def ", max_tokens=24, seed=7, device="cuda"), str)
        return
    assert main(["generate", str(run), "--prompt", "x", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no GPU" in err, err


@pytest.mark.slow("the benchmark's training runs")
@pytest.mark.timeout(540)
def test_gpu_benchmark_smoke_run_on_the_cpu(tmp_path) -> None:
    """benchmarks/gpu.py --quick on the CPU: every step runs tiny and records a result."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--quick", "--device", "cpu",
         "--out", str(tmp_path), "--budget-s", "420"], capture_output=True, text=True,
        timeout=520, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "gpu_quick.json").read_text())
    assert rec["benchmark"] == "gpu" and rec["failed_steps"] == []
    steps = rec["results"]
    for name in ("train_fp32", "train_bf16", "checkpoint", "generate", "codecs"):
        assert steps[name]["ok"], steps[name]
    assert steps["train_fp32"]["result"]["ratio"] > 0
    assert steps["generate"]["result"]["same_sampled_tokens"]  # cpu against cpu
    assert set(steps["codecs"]["result"]["inputs"]) == {"randn", "distinct", "zeros"}
    assert steps["codecs"]["result"]["gpu"] is None  # said so, not measured
    assert rec["device"]["cuda"] is False and rec["total_seconds"] > 0
    # replicas sharing the device: every method and a pipeline finish; staged through host
    # buffers, a run equals the plain one; an elastic replica killed rejoins
    shared = steps["shared"]["result"]["runs"]
    assert set(shared) == {"ddp", "diloco", "streaming_fp4", "noloco", "sparseloco",
                           "pipeline_2x2"}
    for method in ("diloco", "noloco", "streaming_fp4"):
        vs = steps["shared_vs_cpu"]["result"][method]
        assert vs["device"]["forced_host_staging"] and vs["device"]["host_staged"]
        assert vs["bytes_equal"] and vs["val_loss_relative_difference"] == 0
    assert steps["shared_elastic"]["result"]["replicas_finished"] == [0, 1]
    assert "the same weights on every replica" in steps["library"]["result"]["output"][-1]
    sim = steps["simulate"]["result"]  # cpu against cpu: the same run twice
    assert sim["val_loss_relative_difference"] == 0 and sim["replicas"] == 4


def test_gpu_benchmark_explains_a_difference_in_codec_bytes() -> None:
    """The codec comparison of benchmarks/gpu.py, run here with the CPU on both sides and the
    'GPU' side altered: a tie broken otherwise, and one scale off by an ulp."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu

    from noloco import quant, sparse

    x = gpu.codec_inputs(1 << 14)["zeros"]
    cpu = sparse.compress(x, 0.02, 2)
    same = gpu.compare_topk(x, cpu, cpu, 0.02, 2)
    assert same["bytes_equal"] and same["index_sets_equal"]
    assert same["mirror_matches_compress_on_cpu"] and same["same_entries_codes_differing"] == 0
    # chunk 0 has fewer non-zeros than k: swap one kept zero for another zero
    row = x[:4096]
    kept = set(cpu.indices[0].tolist())
    zero_kept = next(i for i in cpu.indices[0].tolist() if row[i] == 0)
    zero_free = next(i for i in range(4096) if row[i] == 0 and i not in kept)
    idx = sorted((kept - {zero_kept}) | {zero_free})
    other = sparse.Sparse(cpu.numel, cpu.chunk, cpu.bits, cpu.indices.clone(),
                          cpu.values.clone(), cpu.scales.clone() * (1 + 2**-23))
    other.indices[0] = torch.tensor(idx)
    r = gpu.compare_topk(x, cpu, other, 0.02, 2)
    assert not r["bytes_equal"] and not r["index_sets_equal"]
    assert r["chunks_with_other_indices"] == 1 and r["positions_in_one_set_only"] == 2
    assert r["all_index_differences_are_ties"] and r["tied_magnitudes"] == [0.0]
    assert r["scales_differing"] > 0 and r["scale_max_abs_diff"] > 0
    q = quant.quantize(x, "fp4")
    assert gpu.compare_fp4(x, q, q)["bytes_equal"]
    q2 = quant.Quantized(q.payload.clone(), q.scales.clone(), q.numel, q.fmt, q.block_size)
    q2.payload[0] ^= 0x01
    f = gpu.compare_fp4(x, q, q2)
    assert not f["bytes_equal"] and f["codes_differing"] == 1 and f["examples"][0]["index"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the copy to "
                    "pinned memory on a side stream)")
def test_a_gpu_snapshot_holds_the_state_as_of_the_save_while_training_goes_on(tmp_path) -> None:
    """The checkpointer's copy of CUDA tensors runs on a side stream without the host waiting:
    the work queued after the save (a long matmul chain, then in-place updates, as an
    optimizer step does) must neither be seen by the copy nor overtake it, and the file holds
    the state as of the save."""
    from noloco import checkpoint as C
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = {f"w{i}": torch.randn(1024, 1024, device=dev, generator=g) for i in range(24)}
    buf = C.SnapshotBuffer()
    x = torch.randn(4096, 4096, device=dev, generator=g)
    for _ in range(20):  # queue work ahead of the save: the copy must wait for it
        x = torch.tanh(x @ x / 64.0)  # bounded: no inf or NaN (NaN != NaN)
    for v in w.values():
        v.add_(x[:1024, :1024])  # part of the state as of the save
    ref = {k: v.clone() for k, v in w.items()}  # queued too: no host wait before the save
    tree = {"model": w, "again": w["w0"], "step": 7, "half": w["w1"].to(torch.bfloat16)}
    snap = buf.copy(tree)
    assert snap.data.is_pinned() and snap.copied is not None
    for v in w.values():  # "the next inner step": in place, right behind the copy
        v.mul_(-3.0).add_(1.0)
    size, _ = C.write_state(tmp_path / "s.safetensors", snap)
    back = C.read_state((tmp_path / "s.safetensors").read_bytes())
    expected = {k: v.cpu() for k, v in ref.items()}
    assert all(torch.equal(back["model"][k], expected[k]) for k in w)
    assert torch.equal(back["again"], expected["w0"]) and back["step"] == 7
    assert len(snap.stored) == 25  # w0 stored once (the same memory), the bf16 copy apart
    torch.cuda.synchronize()
    assert all(torch.equal(w[k].cpu(), expected[k] * -3.0 + 1.0) for k in w)


@pytest.mark.slow("two training runs in this process")
@pytest.mark.timeout(240)
def test_the_inner_loop_reads_nothing_back_per_step(tmp_path, monkeypatch) -> None:
    """Issue 34 item 2: on a GPU every read of a tensor's value waits for the device. A run of
    twice the steps (no log lines, no evaluation or checkpoint between) reads as many values
    in noloco's code as the shorter one: the losses are read together, at the evaluation.
    Every way to read a value counts: item, tolist, float/bool/int/index conversions, numpy,
    cpu. (torch's AdamW reads its step counters, host tensors by design: not counted.)"""
    import sys

    src = str(REPO / "src" / "noloco")
    reads = {"n": 0}
    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "__index__", "numpy",
                 "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            if sys._getframe(1).f_code.co_filename.startswith(src):
                reads["n"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def run(steps: int) -> int:
        reads["n"] = 0
        assert train(tmp_path / str(steps), "builtin", "--max-tokens", "100000", "--steps",
                     str(steps), "--eval-every", str(steps), "--log-every", "0",
                     "--checkpoint-every", "0", "--device", "cpu") == 0
        return reads["n"]

    short, long = run(8), run(16)
    assert short > 0 and long == short, (short, long)


def test_a_batch_goes_to_a_gpu_pinned_and_without_a_host_wait(tmp_path, monkeypatch) -> None:
    """A copy to a GPU from pageable memory waits for every kernel queued before it, so a loop
    that uploads its batch that way syncs at every step. noloco's loop uploads through pinned
    memory with non_blocking (checked here with the two calls recorded: no GPU), and the
    training loop takes that path for every batch."""
    from noloco import staging
    from noloco import train as train_mod

    calls: list = []

    def to(self, *a, **k):
        calls.append(("to", str(a[0]), k.get("non_blocking", False)))
        return self

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
        m.setattr(torch.Tensor, "to", to)
        staging.upload(torch.arange(6), torch.device("cuda"))
        assert calls == ["pin", ("to", "cuda", True)]
        calls.clear()
        staging.upload(torch.arange(6), torch.device("cpu"))
        assert calls == [("to", "cpu", False)]
    uploads = {"n": 0}

    def counted(t, device, _upload=staging.upload):
        uploads["n"] += 1
        return _upload(t, device)

    monkeypatch.setattr(train_mod, "upload", counted)
    assert train(tmp_path / "run", "builtin", "--max-tokens", "100000", "--steps", "3",
                 "--eval-every", "3", "--checkpoint-every", "0", "--device", "cpu") == 0
    assert uploads["n"] == 6  # inputs and targets of each of the 3 steps
