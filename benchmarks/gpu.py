"""noloco on a GPU (issue 34, item 6): one script, one device, every step recorded.

Steps (each in its own try: an error is recorded and the others still run; the script exits
1 if any step failed or was skipped for time):

- ``train_fp32`` / ``train_bf16`` (/ ``train_compile`` with ``--compile``): a bare PyTorch loop
  of noloco's own model (``noloco.model.build``, seed 0: random windows of the same tokens,
  forward, cross-entropy, backward, clip 1.0, AdamW, zero_grad; the loss read at the end
  only, as a loop that logs now and then) against ``noloco train --method single`` of the
  same model, batch and sequence (its real command line, in this process; the progress
  reporter's step hook notes the time). Steady-state tokens/s of each = the tokens of the
  steps after ``--warmup-steps`` ÷ their time, the device synchronised at both ends and
  nowhere between; the ratio noloco ÷ bare; the peak GPU memory of each; noloco's model
  FLOPs utilisation (summary.json's ``gpu.mfu``). On a GPU the bare loop runs twice: with a
  plain ``.to(device)`` of each batch (a copy from pageable memory, which waits for the
  kernels queued before it: a host–device sync per step), and uploading from pinned memory
  with ``non_blocking`` as noloco does (``ratio_to_pinned``, the fairer comparison).
- ``checkpoint``: DiLoCo, one replica, H = ``--sync-every`` (50) for ``--diloco-steps`` (150),
  with the default checkpointing (10min for small, every H for tiny) and every H steps
  against ``--checkpoint-every 0``: the wall
  time of each and the share of the checkpointed run's wall the checkpoints cost.
- ``generate``: ``--new-tokens`` (200) sampled from the model the checkpoint step trained, on
  the CPU, on the GPU with the one-token step replayed as a CUDA graph, and on the GPU stepping
  eagerly (``noloco.generate``, static key/value cache, the same seed): tokens/s of each, the
  graphed GPU's ratio to the CPU (issue target ≥ 10×) and the eager one's, and whether the
  texts agree. Each side also times a call of 8 tokens: the difference per token is a token's
  own cost (``marginal_tokens_per_second``, ``marginal_ratio``), the rest the call's fixed
  cost (the prompt's forward; on the GPU the graph's capture). ``one_token_step``: what one
  eager cached step launches (on the GPU its kernels, by the profiler; on the CPU its
  dispatched operations): a GPU's token is bound by that count.
- ``codecs``: FP4 block quantisation (``noloco.quant``) and chunk-wise top-k
  (``noloco.sparse``, ``--topk``, default 2 % with 2-bit values) of the same random input on
  CPU and GPU tensors: the time of each, and whether the encoded bytes agree. Three inputs:
  ``randn``; ``distinct`` (magnitudes a random permutation of distinct exact values: no ties
  anywhere, so a difference there is rounding); ``zeros`` (99 % exact zeros: chunks with fewer
  non-zeros than k tie at zero). Where bytes differ it says why: whether the chosen index sets
  agree (and whether every disagreement is among magnitudes equal to the chunk's k-th largest,
  i.e. a tie), how far the scales differ, how many codes differ, the same with the GPU
  quantising the CPU's chosen entries (rounding alone), and whether the decoded tensors agree.
- ``simulate``: ``noloco simulate`` of 16 tiny NoLoCo replicas in one process on the GPU and
  on the CPU, the same config: bytes and operations must agree; the losses' relative
  difference (float order) and the GPU's tokens/s against the CPU's.
- ``library``: ``examples/elastic_loop.py`` on the device: four processes of a plain loop
  around ``noloco.library.join_run`` share it (their tensors staged through host buffers),
  one killed and started again; it must rejoin and all end on the same weights.
- the device itself (head of the record): GPU name, capability, memory, torch / CUDA / cuDNN
  versions; every step records its peak GPU memory.

The JSON record (``benchmarks/common.py``: command, config, machine, versions, date) is written
after every step, so a run cut short keeps what it measured (``complete`` says whether it
ended). ``--quick`` runs every step tiny (the tiny preset, a few steps, 64 Ki floats) to check
the script itself, on the CPU in under a minute; there the generate step compares the CPU with
itself and the codec step skips the GPU side, saying so.

    PYTHONPATH=src python3 benchmarks/gpu.py --quick --device cpu --out /tmp/x

Every step at once came to ~8 to 9 minutes by the step times of the H100 and H200 records
(the shared step alone ~170 s, each of its runs ~13 s of start-up). The shared runs are now 40
steps instead of 60 (the elastic one keeps 60: its killed replica must find the others still
training after a fresh process's CUDA start), which by those records brings the whole script to
~7.5 minutes: one device call, its timeout with room (not yet confirmed on a GPU):

    PYTHONPATH=src python3 benchmarks/gpu.py --compile --out $OUT      # --budget-s 450

Steps that would start past ``--budget-s`` are skipped (recorded, exit 1). Where a session
must keep time for a rerun, the same in two calls of ~4 minutes, each writing its own record:

    # the loop against the bare loop (eager bf16, compiled), checkpoints, generation, the
    # codecs, the library's elastic loop on the GPU
    PYTHONPATH=src python3 benchmarks/gpu.py --compile --out $OUT \
        --only train_fp32,train_bf16,train_compile,checkpoint,generate,codecs,library
    # four replicas sharing the GPU (every method, a pipeline, the CPU comparison, an
    # elastic run with a replica killed), and the simulator
    PYTHONPATH=src python3 benchmarks/gpu.py --out $OUT \
        --only shared,shared_vs_cpu,shared_elastic,simulate
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHORT_GENERATION = 8
"""tokens of the generate step's second, short call (its fixed cost apart)"""
GENERATE_TARGET = 10.0
"""issue 34: the GPU samples at least 10x as many tokens per second as the CPU"""
STEPS = ("train_fp32", "train_bf16", "train_compile", "checkpoint", "generate", "codecs",
         "shared", "shared_vs_cpu", "shared_elastic", "simulate", "library")
SHARED = {
    "ddp": ["--method", "ddp"],
    "diloco": ["--method", "diloco"],
    "streaming_fp4": ["--method", "streaming", "--fragments", "2", "--overlap-steps", "1",
                      "--quantize", "fp4"],
    "noloco": ["--method", "noloco"],
    "sparseloco": ["--method", "sparseloco"],
    "pipeline_2x2": ["--method", "diloco", "--stages", "2"],
}
"""the shared step's runs: every method, and a pipeline of 2 stages (half the replicas)"""
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to train and measure (default auto: the GPU where there is one)")
    p.add_argument("--quick", action="store_true",
                   help="every step tiny (tiny preset, a few steps): a smoke run of the script")
    p.add_argument("--preset", default=None, help="model preset (default small; tiny --quick)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (1024)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (8)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps of each throughput run (30; 8 --quick)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps left out of the steady state (5; 2 --quick)")
    p.add_argument("--sync-every", type=int, default=None, help="DiLoCo H (50; 4 --quick)")
    p.add_argument("--diloco-steps", type=int, default=None, help="DiLoCo steps (150; 12)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens to generate (200; 24)")
    p.add_argument("--codec-numel", type=int, default=None,
                   help="floats per codec input (4194304; 65536 --quick)")
    p.add_argument("--codec-repeats", type=int, default=None, help="timed codec calls (5; 2)")
    p.add_argument("--topk", default="topk:0.02:2", help="the top-k setting compared "
                   "(default topk:0.02:2)")
    p.add_argument("--shared-replicas", type=int, default=None,
                   help="replicas sharing the device in the shared steps (4; 2 --quick)")
    p.add_argument("--shared-steps", type=int, default=None,
                   help="steps of each shared run (40; 30 --quick); H is a fifth of it")
    p.add_argument("--elastic-steps", type=int, default=None,
                   help="steps of the shared elastic run (60; 30 --quick)")
    p.add_argument("--shared-seq-len", type=int, default=None,
                   help="tokens per sequence in the shared runs (256; 64 --quick)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens read from the built-in corpus (2000000; 200000 --quick)")
    p.add_argument("--no-bf16", action="store_true", help="leave the bf16 step out")
    p.add_argument("--compile", action="store_true", help="also train_compile: both loops "
                   "through torch.compile (slow to warm up; off by default)")
    p.add_argument("--only", default=None, help="run these steps alone (comma-separated: "
                   + ", ".join(STEPS) + ")")
    p.add_argument("--budget-s", type=float, default=None, help="steps that would start after "
                   "this many seconds are skipped (recorded as such; default 450, --quick 240)")
    p.add_argument("--out", "--out-dir", dest="out", default=None, help="folder for the JSON "
                   "and PNG (default: the scratch directory, or benchmarks/results/ with "
                   "--record)")
    common.add_record_flag(p)
    a = p.parse_args(argv)
    quick = {"preset": "tiny", "seq_len": 64, "batch_size": 4, "steps": 8, "warmup_steps": 2,
             "sync_every": 4, "diloco_steps": 12, "new_tokens": 24, "codec_numel": 1 << 16,
             "codec_repeats": 2, "max_tokens": 200_000, "budget_s": 240.0,
             "shared_replicas": 2, "shared_steps": 30, "elastic_steps": 30, "shared_seq_len": 64}
    full = {"preset": "small", "seq_len": 1024, "batch_size": 8, "steps": 30, "warmup_steps": 5,
            "sync_every": 50, "diloco_steps": 150, "new_tokens": 200, "codec_numel": 1 << 22,
            "codec_repeats": 5, "max_tokens": 2_000_000, "budget_s": 450.0,
            "shared_replicas": 4, "shared_steps": 40, "elastic_steps": 60, "shared_seq_len": 256}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.steps < a.warmup_steps + 3:
        p.error("--steps must exceed --warmup-steps by at least 3")
    for k in ("seq_len", "batch_size", "sync_every", "diloco_steps", "new_tokens",
              "codec_numel", "codec_repeats", "max_tokens", "shared_steps", "shared_seq_len"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.shared_replicas < 2:
        p.error("--shared-replicas must be >= 2 (the elastic run kills replica 1; the pipeline "
                "run has 2 stages)")
    if a.elastic_steps < 6:
        p.error("--elastic-steps must be >= 6 (a replica is killed at a third of them)")
    if a.codec_numel >= 1 << 24:
        p.error("--codec-numel must be below 2^24 (the distinct input's values are exact)")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible to torch")
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    return a


# ---- measuring ------------------------------------------------------------------------------

def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def steady(marks: list[float], warmup: int, tokens_per_step: int) -> dict[str, Any]:
    """Tokens/s over the steps after the first ``warmup``: from the end of step ``warmup`` to
    the end of the last, the device synchronised at both (:func:`sync_points`; nothing
    waits for the device in between, as in a loop that reads its loss only now and then).
    The host's own step intervals are kept too (on a GPU they time launches, not steps)."""
    steps = [b - a for a, b in zip(marks, marks[1:], strict=False)][max(warmup - 1, 0):]
    if not steps:
        raise RuntimeError(f"no steady-state steps ({len(marks)} marks, warm-up {warmup})")
    tps = tokens_per_step * len(steps) / sum(steps)
    return {"tokens_per_second": tps, "host_step_seconds": common.quartiles(steps),
            "median_host_tokens_per_second": tokens_per_step / statistics.median(steps)}


def sync_points(a: argparse.Namespace) -> set[int]:
    """The steps (1-based) after which the device is synchronised before the time is noted:
    the end of the warm-up and the last step."""
    return {max(a.warmup_steps, 1), a.steps}


def device_facts(device: str) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "device": device, "cuda": device == "cuda", "torch": torch.__version__,
        "cuda_version": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        facts.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                     capability=list(torch.cuda.get_device_capability(0)),
                     gpu_memory_bytes=int(prop.total_memory),
                     multiprocessors=int(prop.multi_processor_count),
                     bf16_supported=bool(torch.cuda.is_bf16_supported()))
    return facts


# ---- step: training throughput --------------------------------------------------------------

def corpus_tokens(a: argparse.Namespace) -> Any:
    """The training tokens noloco reads (the built-in corpus, byte tokens), from its cache."""
    from noloco.data import make_tokenizer
    from noloco.token_cache import cached_corpus

    corpus, _ = cached_corpus("builtin", make_tokenizer("bytes"), a.seq_len, a.max_tokens)
    return corpus.train


def bare_loop(a: argparse.Namespace, precision: str, compile: bool, pinned: bool = False
              ) -> dict[str, Any]:
    """noloco's model in the plainest loop: what noloco's own loop is compared with.
    ``pinned``: the batch goes up from pinned memory with ``non_blocking`` (as noloco's loop
    does it) instead of a plain ``.to(device)``, which waits for the queued kernels."""
    import numpy as np
    import torch

    from noloco.model import autocast, build, lm_loss, preset

    device = torch.device(a.device)
    tokens = torch.from_numpy(np.asarray(corpus_tokens(a), dtype=np.int64))
    model = build(preset(a.preset, vocab_size=257), device=device, seed=0)
    forward = torch.compile(model) if compile else model
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(a.seq_len + 1)
    marks: list[float] = []
    reset_peak(a.device)
    at = sync_points(a)
    for i in range(a.steps):
        starts = torch.randint(len(tokens) - a.seq_len - 1, (a.batch_size, 1), generator=gen)
        rows = tokens[starts + offsets]
        rows = (rows.pin_memory().to(device, non_blocking=True) if pinned and device.type == "cuda"
                else rows.to(device))
        with autocast(device, precision):
            loss = lm_loss(forward(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i + 1 in at:  # the loss is read at the end only: no wait per step
            sync(a.device)
        marks.append(time.perf_counter())
    out = steady(marks, a.warmup_steps, a.batch_size * a.seq_len)
    out.update(peak_gpu_bytes=peak_bytes(a.device), final_loss=float(loss.detach()))
    del model, forward, opt, params
    return out


def noloco_argv(a: argparse.Namespace, out: Path, *extra: str) -> list[str]:
    return ["train", "--preset", a.preset, "--data", "builtin", "--max-tokens",
            str(a.max_tokens), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
            "--lr", "1e-3", "--warmup", "0", "--weight-decay", "0", "--grad-clip", "1.0",
            "--eval-sequences", str(a.batch_size), "--seed", "0", "--device", a.device,
            "--log-every", "0", "--out", str(out), "--overwrite", *extra]


def run_noloco(argv: list[str], sync_at: set[int] | frozenset[int] = frozenset(),
               device: str = "cpu") -> tuple[list[float], dict[str, Any], float]:
    """``noloco train ARGV`` in this process: the time after every inner step (the device
    synchronised first after the steps in ``sync_at``), its summary.json and its wall
    seconds. Its own output is kept out of ours."""
    from noloco import cli, metrics

    marks: list[float] = []
    step = metrics.Progress.step

    def timed_step(self: Any, *args: Any, **kw: Any) -> None:
        if len(marks) + 1 in sync_at:
            sync(device)
        marks.append(time.perf_counter())
        step(self, *args, **kw)

    metrics.Progress.step = timed_step  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(argv)
    finally:
        metrics.Progress.step = step  # type: ignore[method-assign]
    wall = time.perf_counter() - t0
    if rc:
        raise RuntimeError(f"noloco {' '.join(argv)} exited {rc}")
    out = Path(argv[argv.index("--out") + 1])
    return marks, json.loads((out / "summary.json").read_text()), wall


def train_step(a: argparse.Namespace, tmp: Path, precision: str, compile: bool
               ) -> dict[str, Any]:
    bare = bare_loop(a, precision, compile)
    free_memory()
    pinned = bare_loop(a, precision, compile, pinned=True) if a.device == "cuda" else None
    free_memory()
    extra = ["--method", "single", "--steps", str(a.steps), "--eval-every", str(a.steps),
             "--checkpoint-every", "0", "--precision", precision]
    reset_peak(a.device)
    marks, summary, wall = run_noloco(noloco_argv(a, tmp / "single", *extra,
                                                  *(["--compile"] if compile else [])),
                                      sync_points(a), a.device)
    noloco = steady(marks, a.warmup_steps, a.batch_size * a.seq_len)
    noloco.update(peak_gpu_bytes=peak_bytes(a.device), process_wall_seconds=wall,
                  summary_tokens_per_second=summary["tokens_per_second"],
                  final_val_loss=summary["final_val_loss"], device=summary["device"],
                  params=summary["params"], gpu=summary.get("gpu"))
    shutil.rmtree(tmp / "single", ignore_errors=True)
    out = {"precision": precision, "compile": compile, "bare": bare, "noloco": noloco,
           "ratio": noloco["tokens_per_second"] / bare["tokens_per_second"]}
    if pinned is not None:  # the same loop uploading as noloco does: the fairer comparison
        out["bare_pinned"] = pinned
        out["ratio_to_pinned"] = noloco["tokens_per_second"] / pinned["tokens_per_second"]
    return out


# ---- step: checkpoint cost ------------------------------------------------------------------

def checkpoint_step(a: argparse.Namespace, tmp: Path, precision: str) -> dict[str, Any]:
    # A short run first, not timed: the token cache, the CUDA context and the kernels' first
    # launches would otherwise be paid by whichever timed run came first (with --only
    # checkpoint the run without checkpoints took 4-6 s longer than the loop it timed).
    run_noloco(noloco_argv(a, tmp / "diloco_warmup", "--method", "diloco", "--replicas", "1",
                           "--sync-every", str(a.sync_every), "--steps", "4",
                           "--eval-every", "4", "--checkpoint-every", "0",
                           "--precision", precision))
    shutil.rmtree(tmp / "diloco_warmup", ignore_errors=True)
    runs: dict[str, Any] = {}
    cadences = (("no_checkpoints", ["--checkpoint-every", "0"]), ("default", []),
                ("every_outer_step", ["--checkpoint-every", str(a.sync_every)]))
    for name, every in cadences:
        out = tmp / f"diloco_{name}"
        reset_peak(a.device)
        _, s, wall = run_noloco(noloco_argv(
            a, out, "--method", "diloco", "--replicas", "1", "--sync-every", str(a.sync_every),
            "--steps", str(a.diloco_steps), "--eval-every", str(a.diloco_steps),
            "--precision", precision, *every))
        runs[name] = {"process_wall_seconds": wall, "wall_seconds": s["wall_seconds"],
                      "train_seconds": s["train_seconds"], "peak_gpu_bytes": peak_bytes(a.device),
                      **{k: v for k, v in s.items() if k.startswith("checkpoint")}}
        # the checkpointed run's model is the one generate samples from; the rest goes
        shutil.rmtree(out / "checkpoints" if name == "default" else out, ignore_errors=True)
    d, z = runs["default"]["process_wall_seconds"], runs["no_checkpoints"]["process_wall_seconds"]
    td, tz = runs["default"]["train_seconds"], runs["no_checkpoints"]["train_seconds"]
    # whole process (start-up, final evaluation and model save alike in both) and the
    # training loop alone (evaluations left out; what checkpoints block of it counts)
    return {"precision": precision, "sync_every": a.sync_every, "steps": a.diloco_steps,
            "runs": runs, "wall_ratio": d / z, "checkpoint_share_of_wall": (d - z) / d,
            "train_ratio": td / tz, "checkpoint_share_of_train": (td - tz) / td,
            # what the loop waits for at each save (the copy), against the loop: the cost a
            # long run pays; the wait for the last write is paid once per run
            "blocked_share_of_train": runs["default"]["checkpoint_blocked_seconds"] / td,
            "blocked_seconds_per_save": runs["default"]["checkpoint_blocked_seconds"]
            / max(1, runs["default"]["checkpoint_saves"]),
            "model_run": str(tmp / "diloco_default"),
            # each cadence's cost against no checkpoints (the default of the bigger presets is
            # a time, 10min: in a short run only the end's save)
            "cadences": {name: {
                "checkpoint_every": r.get("checkpoint_every"),
                "checkpoint_every_seconds": r.get("checkpoint_every_seconds"),
                "saves": r.get("checkpoint_saves"),
                "share_of_wall": (r["process_wall_seconds"] - z) / r["process_wall_seconds"],
                "share_of_train": (r["train_seconds"] - tz) / r["train_seconds"],
                "blocked_seconds_per_save": r["checkpoint_blocked_seconds"]
                / max(1, r["checkpoint_saves"])}
                for name, r in runs.items() if name != "no_checkpoints"}}


# ---- steps: replicas sharing the device ------------------------------------------------------

def shared_argv(a: argparse.Namespace, out: Path, preset: str, device: str, *extra: str,
                steps: int | None = None) -> list[str]:
    steps = a.shared_steps if steps is None else steps
    h = max(4, steps // 5)
    argv = noloco_argv(a, out, "--replicas", str(a.shared_replicas), "--steps",
                       str(steps), "--sync-every", str(h), "--eval-every",
                       str(steps), "--checkpoint-every", "0", *extra)
    argv[argv.index("--preset") + 1] = preset
    argv[argv.index("--seq-len") + 1] = str(a.shared_seq_len)
    argv[argv.index("--device") + 1] = device
    if "--stages" in extra:  # replicas x stages workers share the device as before
        argv[argv.index("--replicas") + 1] = str(max(1, a.shared_replicas // 2))
    return argv


def shared_facts(s: dict[str, Any], wall: float) -> dict[str, Any]:
    return {"process_wall_seconds": wall, "final_val_loss": s["final_val_loss"],
            # one replica's, the mean (the field's meaning in the earlier records), and each's
            "bytes_sent_per_replica": s["bytes_sent"],
            "bytes_sent_by_replica": s["bytes_sent_per_replica"], "ops": s.get("ops"),
            "device": s.get("device"), "gpu": s.get("gpu"), "host_staged": s.get("host_staged"),
            "tokens_per_second": s.get("tokens_per_second"),
            "compute_utilisation": s.get("compute_utilisation")}


def shared_step(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Every method with ``--shared-replicas`` replicas on the one device (the GPU: gloo on
    host copies), and a 2-stage pipeline: each must finish with a finite loss; the record
    holds the GPU's estimate against its measured peak."""
    import math

    runs: dict[str, Any] = {}
    for name, extra in SHARED.items():
        out = tmp / f"shared_{name}"
        _, s, wall = run_noloco(shared_argv(a, out, a.preset, a.device, *extra))
        runs[name] = shared_facts(s, wall)
        if not math.isfinite(s["final_val_loss"]):
            raise RuntimeError(f"{name}: final validation loss {s['final_val_loss']}")
        shutil.rmtree(out, ignore_errors=True)
    return {"replicas": a.shared_replicas, "preset": a.preset, "seq_len": a.shared_seq_len,
            "steps": a.shared_steps, "runs": runs}


@contextlib.contextmanager
def env(**values: str | None) -> Any:
    """The environment with ``values`` set (None: unset), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def shared_vs_cpu_step(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The tiny preset, DiLoCo, NoLoCo and Streaming fp4 (its quantised all-reduce coded on
    the device, on the helper thread's own stream), on the CPU and on the shared device, the
    same config: bytes and operations must be equal; the losses differ by float order only
    (on the CPU alone: not at all, the other side being staged through host buffers)."""
    out: dict[str, Any] = {}
    for method in ("diloco", "noloco", "streaming_fp4"):
        sides = {}
        for side in ("cpu", "device"):
            run = tmp / f"vs_{method}_{side}"
            # without a GPU the other side is the CPU with its traffic staged through host
            # buffers: the GPU path's code, which must then equal the plain run bit for bit
            staged = side == "device" and a.device == "cpu"
            with env(NOLOCO_HOST_STAGING="1" if staged else None):
                _, s, wall = run_noloco(shared_argv(a, run, "tiny", "cpu" if side == "cpu"
                                                    else a.device, *SHARED[method]))
            sides[side] = {**shared_facts(s, wall), "forced_host_staging": staged}
            shutil.rmtree(run, ignore_errors=True)
        c, g = sides["cpu"], sides["device"]
        same_bytes = c["bytes_sent_by_replica"] == g["bytes_sent_by_replica"]
        if not same_bytes or c["ops"] != g["ops"]:
            raise RuntimeError(f"{method}: bytes or operations differ between cpu and "
                               f"{a.device}: {c['bytes_sent_by_replica']} {c['ops']} against "
                               f"{g['bytes_sent_by_replica']} {g['ops']}")
        out[method] = {"cpu": c, "device": g, "bytes_equal": same_bytes,
                       "val_loss_relative_difference":
                       abs(g["final_val_loss"] - c["final_val_loss"]) / c["final_val_loss"]}
        if g["host_staged"] is not True or c["host_staged"] is not False:
            raise RuntimeError(f"{method}: host staging {c['host_staged']} on the CPU side, "
                               f"{g['host_staged']} on the other (expected off, on)")
        if a.device == "cpu" and g["final_val_loss"] != c["final_val_loss"]:
            raise RuntimeError(f"{method}: staged through host buffers on the CPU, the loss "
                               f"moved: {c['final_val_loss']} against {g['final_val_loss']}")
    return out


def library_step(a: argparse.Namespace) -> dict[str, Any]:
    """examples/elastic_loop.py on the device: four processes of a plain loop around
    ``noloco.library.join_run`` share it, one is killed (SIGKILL) and started again; it must
    rejoin and every replica end on the same weights. On the CPU every tensor is staged
    through host buffers anyway (``NOLOCO_HOST_STAGING=1``): the code a GPU's model takes."""
    example = Path(__file__).resolve().parents[1] / "examples" / "elastic_loop.py"
    # The others must still train when the killed one's new process has started and joins:
    # 20 steps of 0.2 s after the kill were too few for a fresh process's CUDA start on the
    # H200 machine, and for its start on a loaded CI machine (tests/test_examples.py's 40
    # steps of 0.3 s pass there).
    steps = 60
    argv = [sys.executable, str(example), "--steps", str(steps), "--kill-at", "10",
            "--sync-every", "5", "--step-seconds", "0.3", "--device", a.device]
    proc, wall = common.run_checked(argv, "examples/elastic_loop.py",
                                    {**os.environ, "NOLOCO_HOST_STAGING": "1"})
    out = proc.stdout
    if not ("replica 2 rejoined at step" in out and "the same weights on every replica" in out):
        raise RuntimeError(f"elastic_loop.py: {(out + proc.stderr).strip()[-1500:]}")
    return {"device": a.device, "wall_seconds": wall, "replicas": 4, "steps": steps,
            "output": [line for line in out.splitlines() if line.startswith(("replica", "all"))]}


def simulate_step(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """``noloco simulate`` (issue 35) of 16 tiny NoLoCo replicas on the device and on the
    CPU, the same config: bytes and operations equal, the losses apart by float order only
    (the GPU's kernels sum in other orders), and the tokens/s of each."""
    n = 4 if a.quick else 16
    steps = 6 if a.quick else 40
    sides = {}
    for side, device in (("cpu", "cpu"), ("device", a.device)):
        run = tmp / f"simulate_{side}"
        argv = ["simulate", "--method", "noloco", "--replicas", str(n), "--preset", "tiny",
                "--data", "builtin", "--max-tokens", str(a.max_tokens), "--batch-size", "4",
                "--seq-len", "64", "--steps", str(steps), "--sync-every", str(steps // 2),
                "--eval-every", str(steps), "--eval-sequences", "8", "--device", device,
                "--log-every", "0", "--out", str(run), "--overwrite"]
        _, s, wall = run_noloco(argv)
        sides[side] = {"process_wall_seconds": wall, "final_val_loss": s["final_val_loss"],
                       "bytes_sent_by_replica": s["bytes_sent_per_replica"], "ops": s["ops"],
                       "tokens_per_second": s["tokens_per_second"]}
        shutil.rmtree(run, ignore_errors=True)
    c, g = sides["cpu"], sides["device"]
    if c["bytes_sent_by_replica"] != g["bytes_sent_by_replica"] or c["ops"] != g["ops"]:
        raise RuntimeError(f"simulate: bytes or operations differ between cpu and {a.device}")
    return {"replicas": n, "steps": steps, "sides": sides,
            "val_loss_relative_difference":
            abs(g["final_val_loss"] - c["final_val_loss"]) / c["final_val_loss"],
            "speedup": g["tokens_per_second"] / c["tokens_per_second"]}


def shared_elastic_step(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Elastic NoLoCo, the replicas sharing the device; one is killed and respawned: it must
    rejoin from a donor (its state sent through host buffers) and every replica finish."""
    run = tmp / "shared_elastic"
    kill_at = a.elastic_steps // 3
    # every step paced (0.25 s at least): the others are still training when the killed
    # replica's new process has started, so it has someone to join
    faults = [f"kill:1@{kill_at}"] + [f"pace:{r}:0.25" for r in range(a.shared_replicas)]
    argv = shared_argv(a, run, a.preset, a.device, "--method", "noloco", "--elastic",
                       "--inject-fault", ",".join(faults), "--respawn", "1",
                       steps=a.elastic_steps)
    with env(NOLOCO_HOST_STAGING="1" if a.device == "cpu" else None):  # the GPU's path
        _, s, wall = run_noloco(argv)
    el = s.get("elastic") or {}
    finished = el.get("replicas_finished")
    joined = [j for j in el.get("joins", []) if j.get("kind") == "joined"]
    if finished != list(range(a.shared_replicas)) or not joined or not s.get("host_staged"):
        raise RuntimeError(f"elastic: finished {finished}, joins {el.get('joins')}")
    shutil.rmtree(run, ignore_errors=True)
    return {"killed": f"replica 1 at step {kill_at}", "steps": a.elastic_steps,
            "replicas_finished": finished,
            "peak_gpu_memory_bytes": s.get("peak_gpu_memory_bytes"),
            "join": joined[0], **shared_facts(s, wall)}


# ---- step: generation -----------------------------------------------------------------------

def generate_step(a: argparse.Namespace, tmp: Path, run: Path | None) -> dict[str, Any]:
    import torch

    from noloco.generate import load_sampler, resolve_device, sample

    trained = run is not None and (run / "model" / "model.json").is_file()
    if not trained:  # the checkpoint step failed: a short run of its own
        run = tmp / "gen_model"
        run_noloco(noloco_argv(a, run, "--method", "single", "--steps", str(a.warmup_steps + 3),
                               "--eval-every", "1000", "--checkpoint-every", "0"))
    # (device, CUDA graph): the CPU; the GPU with its step captured as a graph; the GPU
    # stepping eagerly (what the graph saves). On the CPU the script checks itself: CPU twice.
    sides = ([("cpu", False), ("cuda", True), ("cuda", False)] if a.device == "cuda"
             else [("cpu", False), ("cpu", False)])
    out: dict[str, Any] = {"model_run": str(run), "trained_by_checkpoint_step": trained,
                           "new_tokens": a.new_tokens, "cpu_threads": torch.get_num_threads(),
                           "sides": []}
    texts = []
    for dev, graph in sides:
        s = load_sampler(run).to(resolve_device(dev))
        ids = s.encode(PROMPT)
        with torch.no_grad():
            sample(s, ids, 4, 0.8, 40, seed=1, graph=graph)  # warm-up: kernels, cuBLAS, pools
            sync(dev)
            reset_peak(dev)
            t0 = time.perf_counter()
            new = sample(s, ids, a.new_tokens, 0.8, 40, seed=0, graph=graph)
            sync(dev)
            sec = time.perf_counter() - t0
            peak = peak_bytes(dev)
            # a call's fixed cost (the prompt's forward, the graph's capture) apart from a
            # token's: the same call for a few tokens, then the difference per token
            t0 = time.perf_counter()
            sample(s, ids, SHORT_GENERATION, 0.8, 40, seed=0, graph=graph)
            sync(dev)
            short = time.perf_counter() - t0
            greedy = sample(s, ids, min(a.new_tokens, 32), 0.0, None, seed=0, graph=graph)
        texts.append((new, greedy))
        per_token = (sec - short) / max(1, a.new_tokens - SHORT_GENERATION)
        out["sides"].append({"device": dev, "cuda_graph": graph, "seconds": sec,
                             "tokens_per_second": a.new_tokens / sec,
                             f"seconds_for_{SHORT_GENERATION}_tokens": short,
                             "fixed_seconds": max(0.0, sec - per_token * a.new_tokens),
                             "marginal_tokens_per_second": 1 / per_token if per_token > 0
                             else None,
                             "peak_gpu_bytes": peak})
        del s
        free_memory()
    # in a process of its own: the profiler (CUPTI) may slow this process's later timings
    out["one_token_step"] = {dev: launches_in_child(run, dev)
                             for dev in dict.fromkeys(d for d, _ in sides)}
    cpu_tps = out["sides"][0]["tokens_per_second"]
    out["ratio"] = out["sides"][1]["tokens_per_second"] / cpu_tps
    m = [x["marginal_tokens_per_second"] for x in out["sides"]]
    out["marginal_ratio"] = m[1] / m[0] if m[0] and m[1] else None
    if len(sides) > 2:
        out["eager_ratio"] = out["sides"][2]["tokens_per_second"] / cpu_tps
    out["same_sampled_tokens"] = all(t[0] == texts[0][0] for t in texts)
    out["same_greedy_tokens"] = all(t[1] == texts[0][1] for t in texts)
    out["target_ratio"] = GENERATE_TARGET
    out["meets_target"] = out["ratio"] >= GENERATE_TARGET if a.device == "cuda" else None
    out["sample_text"] = bytes(t for t in texts[-1][0] if t < 256).decode("utf-8", "replace")
    return out


def launches_in_child(run: Path, device: str) -> dict[str, Any]:
    """:func:`step_launches` of ``run``'s model on ``device``, in a fresh process (an error
    there is recorded, never raised: a diagnostic does not fail the step)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import gpu; "
            "from noloco.generate import load_sampler, resolve_device; "
            "s = load_sampler(sys.argv[2]).to(resolve_device(sys.argv[3])); "
            "print(json.dumps(gpu.step_launches(s.model, s.encode(gpu.PROMPT))))")
    try:
        proc, _ = common.run_checked([sys.executable, "-c", code,
                                      str(Path(__file__).resolve().parent), str(run), device],
                                     "the one-token step's count")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        if got.get("kernels") == 0 or got.get("operations") == 0:
            raise RuntimeError(f"nothing counted: {got}")
        return got
    except Exception as e:  # noqa: BLE001 - a diagnostic: never fail the step for it
        return {"error": f"{type(e).__name__}: {e}"[-300:]}


def step_launches(model: Any, ids: list[int]) -> dict[str, Any]:
    """What one eager cached one-token step launches: on a GPU its kernels (the profiler's
    device events, copies and fills included: a replayed graph holds the same), on the CPU
    the operations it dispatches, views left out, each by name (tests/test_model.py bounds
    them)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from noloco.model import KVCache

    p = next(model.parameters())
    kv = KVCache(model.args, 1, len(ids) + 2, p.device, p.dtype)
    token = torch.tensor([ids[-1:]], device=p.device)
    with torch.no_grad():
        model(torch.tensor([ids], device=p.device), kv)
        model(token, kv)  # warm: the stacked weights made, the kernels chosen
        if p.is_cuda:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize(p.device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model(token, kv)
                torch.cuda.synchronize(p.device)
            kernels = [e.name for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA]
            return {"kernels": len(kernels), "layers": model.args.n_layers,
                    "distinct": sorted(set(kernels))[:60]}
        ops: Counter[str] = Counter()

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                if not func.is_view and func.overloadpacket.__name__ != "_unsafe_view":
                    ops[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        with Ops():
            model(token, kv)
    return {"operations": sum(ops.values()), "layers": model.args.n_layers,
            "by_operation": dict(ops)}


# ---- step: exchange codecs on CPU and GPU tensors -------------------------------------------

def codec_inputs(n: int, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    randn = torch.randn(n, generator=g)
    # magnitudes (k + 1)·2^-22 for a random permutation k of 0..n-1: exact in fp32 (n < 2^24),
    # all distinct, so top-k has no ties to break; random signs
    perm = torch.randperm(n, generator=g)
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    distinct = (perm + 1).to(torch.float32) * 2.0**-22 * sign
    zeros = randn * (torch.rand(n, generator=g) < 0.01)  # ~41 non-zeros per 4096: ties at 0
    return {"randn": randn, "distinct": distinct, "zeros": zeros}


def timed(fn: Callable[[], Any], device: str, repeats: int) -> tuple[Any, dict[str, float]]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return out, {"first_seconds": first, "median_seconds": statistics.median(times)}


def _nibbles(payload: Any) -> Any:
    import torch

    return torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1)


def compare_fp4(x: Any, cpu: Any, gpu: Any) -> dict[str, Any]:
    """Where FP4 bytes differ: scales, normalised values and codes."""
    import torch

    from noloco import quant

    q_c, q_g = cpu, quant.Quantized(gpu.payload.cpu(), gpu.scales.cpu(), gpu.numel, gpu.fmt,
                                    gpu.block_size)
    codes_c, codes_g = _nibbles(q_c.payload)[:x.numel()], _nibbles(q_g.payload)[:x.numel()]
    diff = (codes_c != codes_g).nonzero().flatten()
    out: dict[str, Any] = {
        "bytes_equal": torch.equal(quant.to_bytes(q_c), quant.to_bytes(q_g)),
        "scales_differing": int((q_c.scales != q_g.scales).sum()),
        "scale_max_abs_diff": float((q_c.scales - q_g.scales).abs().max()),
        "codes_differing": int(diff.numel()),
        "decoded_max_abs_diff": float((quant.dequantize(q_c) - quant.dequantize(q_g))
                                      .abs().max()),
    }
    if diff.numel():
        i = diff[:5]
        out["examples"] = [{"index": int(j), "x": float(x[j]), "cpu_code": int(codes_c[j]),
                            "gpu_code": int(codes_g[j])} for j in i]
    return out


def mirror_quantise(rows: Any, idx: Any, bits: int) -> tuple[Any, Any]:
    """``noloco.sparse.compress``'s quantiser on given kept positions (the same operations in
    the same order; checked against ``compress`` on the CPU): codes and scales."""
    import torch

    kept = rows.gather(1, idx)
    levels = 1 << (bits - 1)
    scales = kept.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    m = torch.floor(kept.abs() / safe[:, None] * levels + 0.5).clamp_(1, levels) - 1
    codes = m.to(torch.int64) | ((kept < 0).to(torch.int64) << (bits - 1))
    return codes, scales


def compare_topk(x: Any, cpu: Any, gpu: Any, fraction: float, bits: int) -> dict[str, Any]:
    """Where top-k bytes differ: the index sets (ties or not), scales, codes, and the GPU's
    quantiser on the CPU's chosen entries (rounding alone)."""
    import torch

    from noloco import sparse

    c, chunk = cpu.indices.shape[0], cpu.chunk
    k = cpu.indices.shape[1]
    flat = torch.zeros(c * chunk)
    flat[:x.numel()] = x
    rows = flat.view(c, chunk)
    gi, gv = gpu.indices.cpu(), gpu.values.cpu()
    gs = gpu.scales.cpu() if gpu.scales is not None else None
    g_cpu = sparse.Sparse(gpu.numel, gpu.chunk, gpu.bits, gi, gv, gs)
    mask_c = torch.zeros(c, chunk, dtype=torch.bool).scatter_(1, cpu.indices, True)
    mask_g = torch.zeros(c, chunk, dtype=torch.bool).scatter_(1, gi, True)
    sym = mask_c ^ mask_g
    kth = rows.abs().topk(k, dim=1).values[:, -1:]  # the chunk's k-th largest magnitude
    chunks_differ = sym.any(dim=1)
    same_idx = ~chunks_differ
    out: dict[str, Any] = {
        "bytes_equal": torch.equal(sparse.to_bytes(cpu), sparse.to_bytes(g_cpu)),
        "index_sets_equal": not bool(chunks_differ.any()),
        "chunks_with_other_indices": int(chunks_differ.sum()),
        "positions_in_one_set_only": int(sym.sum()),
        "all_index_differences_are_ties": bool(
            (rows.abs().expand_as(sym)[sym] == kth.expand_as(sym)[sym]).all()),
        "tied_magnitudes": sorted({float(v) for v in rows.abs()[sym][:50]}),
        "decoded_max_abs_diff": float((sparse.decompress(cpu) - sparse.decompress(g_cpu))
                                      .abs().max()),
    }
    if bits < 32:
        assert cpu.scales is not None and gs is not None
        out["scales_differing"] = int((cpu.scales != gs).sum())
        out["scale_max_abs_diff"] = float((cpu.scales - gs).abs().max())
        out["codes_differing_where_indices_agree"] = int(
            (cpu.values[same_idx] != gv[same_idx]).sum())
        # rounding alone: the GPU quantises the entries the CPU chose
        mc, ms = mirror_quantise(rows, cpu.indices, bits)
        out["mirror_matches_compress_on_cpu"] = bool(torch.equal(mc, cpu.values)
                                                     and torch.equal(ms, cpu.scales))
        dev_rows = rows.to(gpu.indices.device)
        rc, rs = mirror_quantise(dev_rows, cpu.indices.to(dev_rows.device), bits)
        out["same_entries_codes_differing"] = int((rc.cpu() != cpu.values).sum())
        out["same_entries_scales_differing"] = int((rs.cpu() != cpu.scales).sum())
        out["same_entries_scale_max_abs_diff"] = float((rs.cpu() - cpu.scales).abs().max())
    return out


def codecs_step(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from noloco import quant, sparse

    fraction, bits = sparse.parse(a.topk)
    gpu = a.device == "cuda"
    out: dict[str, Any] = {"numel": a.codec_numel, "topk": a.topk, "fp4_block": 256,
                           "gpu": torch.cuda.get_device_name(0) if gpu else None,
                           "repeats": a.codec_repeats, "inputs": {}}
    if not gpu:
        out["note"] = "no GPU: only the CPU side was measured"
    for name, x in codec_inputs(a.codec_numel).items():
        res: dict[str, Any] = {}
        sides = [("cpu", x)] + ([("cuda", x.cuda())] if gpu else [])
        enc: dict[str, dict[str, Any]] = {"fp4": {}, "topk": {}}
        for dev, t in sides:
            enc["fp4"][dev], tf = timed(lambda t=t: quant.quantize(t, "fp4"), dev,
                                        a.codec_repeats)
            enc["topk"][dev], tt = timed(lambda t=t: sparse.compress(t, fraction, bits), dev,
                                         a.codec_repeats)
            res.setdefault("fp4", {})[f"{dev}_seconds"] = tf
            res.setdefault("topk", {})[f"{dev}_seconds"] = tt
        res["fp4"]["bytes"] = enc["fp4"]["cpu"].nbytes
        res["topk"]["bytes"] = sparse.wire_bytes(x.numel(), fraction, bits)
        if gpu:
            res["fp4"].update(compare_fp4(x, enc["fp4"]["cpu"], enc["fp4"]["cuda"]))
            res["topk"].update(compare_topk(x, enc["topk"]["cpu"], enc["topk"]["cuda"],
                                            fraction, bits))
            for codec in ("fp4", "topk"):
                r = res[codec]
                r["speedup"] = r["cpu_seconds"]["median_seconds"] / r["cuda_seconds"][
                    "median_seconds"]
        out["inputs"][name] = res
    return out


# ---- the driver -----------------------------------------------------------------------------

def summary_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, r in results.items():
        if not r["ok"]:
            lines.append(f"{name:<14} FAILED: {r['error'].splitlines()[0][:120]}")
            continue
        v = r["result"]
        if name.startswith("train_"):
            mfu = (v["noloco"].get("gpu") or {}).get("mfu")
            pin = (f" | bare pinned {v['bare_pinned']['tokens_per_second']:,.0f} tok/s, ratio "
                   f"{v['ratio_to_pinned']:.3f}" if "bare_pinned" in v else "")
            lines.append(f"{name:<14} bare {v['bare']['tokens_per_second']:,.0f} tok/s | noloco "
                         f"{v['noloco']['tokens_per_second']:,.0f} tok/s | ratio "
                         f"{v['ratio']:.3f}{pin}" + (f" | noloco MFU {100 * mfu:.1f}%" if mfu
                                                     else ""))
        elif name == "checkpoint":
            for cad, c in v.get("cadences", {}).items():
                lines.append(f"checkpoint/{cad:<16} {c['saves']} saves: "
                             f"{100 * c['share_of_wall']:.1f}% of wall, "
                             f"{100 * c['share_of_train']:.1f}% of the loop, blocked "
                             f"{1e3 * c['blocked_seconds_per_save']:.0f} ms a save")
            lines.append(f"{name:<14} with checkpoints: wall x{v['wall_ratio']:.3f} "
                         f"({100 * v['checkpoint_share_of_wall']:.1f}% of wall), loop "
                         f"x{v['train_ratio']:.3f} ({100 * v['checkpoint_share_of_train']:.1f}%), "
                         f"blocked {1e3 * v['blocked_seconds_per_save']:.1f} ms a save "
                         f"({100 * v['blocked_share_of_train']:.2f}% of the loop)")
        elif name == "generate":
            s = v["sides"]
            sides = " | ".join(f"{x['device']}{' graph' if x.get('cuda_graph') else ''} "
                               f"{x['tokens_per_second']:,.1f} tok/s "
                               f"({x.get('fixed_seconds', 0):.2f} s fixed)" for x in s)
            marginal = (f", {v['marginal_ratio']:.1f} a token past the fixed cost"
                        if v.get("marginal_ratio") else "")
            step = (v.get("one_token_step") or {}).get(s[-1]["device"]) or {}
            launched = (f" | a step {step['kernels']} kernels" if "kernels" in step else
                        f" | a step {step['operations']} operations" if "operations" in step
                        else "")
            lines.append(f"{name:<14} {sides} | ratio {v['ratio']:.1f}{marginal} (target "
                         f"{GENERATE_TARGET:g}) | same tokens {v['same_sampled_tokens']}"
                         f"{launched}")
        elif name == "shared":
            for run, x in v["runs"].items():
                g = x.get("gpu") or {}
                mem = (f", peak {g['peak_memory_bytes'] / 2**30:.1f} GiB (estimate "
                       f"{(g.get('estimated_bytes_per_worker') or 0) / 2**30:.1f})" if g else "")
                lines.append(f"shared/{run:<13} {v['replicas']} replicas on {x['device']}: loss "
                             f"{x['final_val_loss']:.4f}, {x['tokens_per_second']:,.0f} tok/s, "
                             f"{x['process_wall_seconds']:.1f} s{mem}")
        elif name == "shared_vs_cpu":
            for method, x in v.items():
                lines.append(f"vs_cpu/{method:<13} bytes equal {x['bytes_equal']}, loss "
                             f"{x['cpu']['final_val_loss']:.5f} cpu vs "
                             f"{x['device']['final_val_loss']:.5f} (rel. diff "
                             f"{x['val_loss_relative_difference']:.1e})")
        elif name == "shared_elastic":
            lines.append(f"{name:<14} {v['killed']} killed, rejoined at step "
                         f"{v['join'].get('step')}; finished {v['replicas_finished']}, loss "
                         f"{v['final_val_loss']:.4f}")
        elif name == "codecs":
            for inp, res in v["inputs"].items():
                parts = []
                for codec in ("fp4", "topk"):
                    c = res[codec]
                    eq = f", bytes equal {c['bytes_equal']}" if "bytes_equal" in c else ""
                    sp = f", x{c['speedup']:.1f}" if "speedup" in c else ""
                    parts.append(f"{codec} {1e3 * c['cpu_seconds']['median_seconds']:.1f} ms"
                                 f"{sp}{eq}")
                lines.append(f"codecs/{inp:<7} " + " | ".join(parts))
            if v.get("note"):
                lines.append(f"codecs         {v['note']}")
        elif name == "library":
            lines.append(f"{name:<14} {v['output'][-1]} on {v['device']} "
                         f"({v['wall_seconds']:.0f} s)")
    return lines


def plot(rec: dict[str, Any], path: Path) -> None:
    """One panel for each kind of step the record holds: training throughput, generation,
    and the shared device (each run's measured peak against its estimate)."""
    plt = common.pyplot()
    if plt is None:
        return
    res = rec["results"]
    train = {k: v["result"] for k, v in res.items() if k.startswith("train_") and v["ok"]}
    gen = res.get("generate", {})
    shared = res.get("shared", {})
    panels = [p for p, present in (("train", train), ("generate", gen.get("ok")),
                                   ("shared", shared.get("ok"))) if present]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "train":
            names = list(train)
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [train[n]["bare"]["tokens_per_second"] for n in names],
                   0.4, label="bare PyTorch")
            ax.bar([x + 0.2 for x in xs],
                   [train[n]["noloco"]["tokens_per_second"] for n in names], 0.4,
                   label="noloco single")
            ax.set_xticks(list(xs), [n.removeprefix("train_") for n in names])
            ax.set_ylabel("tokens / second")
            ax.set_title(f"training, {rec['config']['preset']}, "
                         f"{rec['device'].get('gpu', 'cpu')}")
            ax.legend()
        elif panel == "generate":
            s = gen["result"]["sides"]
            ax.bar([f"{x['device']}{' graph' if x.get('cuda_graph') else ''} ({i})"
                    for i, x in enumerate(s)],
                   [x["tokens_per_second"] for x in s])
            ax.set_title(f"generate: {gen['result']['ratio']:.1f}x")
            ax.set_ylabel("tokens / second")
        else:
            runs = shared["result"]["runs"]
            names = [n for n in runs if runs[n].get("gpu")]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs],
                   [runs[n]["gpu"]["peak_memory_bytes"] / 2**30 for n in names], 0.4,
                   label="measured peak")
            ax.bar([x + 0.2 for x in xs],
                   [(runs[n]["gpu"]["estimated_bytes_per_worker"] or 0) / 2**30 for n in names],
                   0.4, label="estimate")
            ax.set_xticks(list(xs), names, rotation=30, ha="right")
            ax.set_ylabel("GiB per worker")
            ax.set_title(f"{shared['result']['replicas']} replicas sharing the device")
            ax.legend()
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    unknown = sorted(set(a.only.split(",")) - set(STEPS)) if a.only else []
    if unknown:
        print(f"gpu.py: no step {', '.join(unknown)} (--only takes {', '.join(STEPS)})",
              file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    import torch

    json_path, png_path = common.out_paths("gpu", a.out, a.quick, a.record)
    tmp = Path(tempfile.mkdtemp(prefix="noloco-gpu-"))
    # the token cache beside the runs: nothing is left in the user's cache by a benchmark
    os.environ.setdefault("NOLOCO_TOKEN_CACHE", str(tmp / "tokens"))
    rec = common.start_record("gpu", {k: v for k, v in vars(a).items()})
    rec.update(device=device_facts(a.device), complete=False, results={}, failed_steps=[])
    bf16 = not a.no_bf16 and (a.device != "cuda" or torch.cuda.is_bf16_supported())
    fast = "bf16" if bf16 else "fp32"
    model_run: list[Path | None] = [None]

    def checkpoint() -> dict[str, Any]:
        r = checkpoint_step(a, tmp, fast)
        model_run[0] = Path(r["model_run"])
        return r

    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("train_fp32", lambda: train_step(a, tmp, "fp32", False))]
    if bf16:
        steps.append(("train_bf16", lambda: train_step(a, tmp, "bf16", False)))
    if a.compile:
        steps.append(("train_compile", lambda: train_step(a, tmp, fast, True)))
    steps += [("checkpoint", checkpoint),
              ("generate", lambda: generate_step(a, tmp, model_run[0])),
              ("codecs", lambda: codecs_step(a)),
              ("shared", lambda: shared_step(a, tmp)),
              ("shared_vs_cpu", lambda: shared_vs_cpu_step(a, tmp)),
              ("shared_elastic", lambda: shared_elastic_step(a, tmp)),
              ("simulate", lambda: simulate_step(a, tmp)),
              ("library", lambda: library_step(a))]
    if a.only:
        steps = [(n, fn) for n, fn in steps if n in a.only.split(",")]
    try:
        for name, fn in steps:
            t0 = time.perf_counter()
            entry: dict[str, Any] = {"ok": False}
            if t0 - t_start > a.budget_s:
                entry["error"] = (f"skipped: {t0 - t_start:.0f} s had passed, over --budget-s "
                                  f"{a.budget_s:g}")
            else:
                print(f"[{t0 - t_start:6.1f} s] {name} ...", flush=True)
                reset_peak(a.device)
                try:
                    entry.update(ok=True, result=fn())
                except Exception as e:  # noqa: BLE001 - every failure is recorded, then on
                    entry["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
                    print(f"  {name} failed: {type(e).__name__}: {e}", file=sys.stderr,
                          flush=True)
                entry["seconds"] = time.perf_counter() - t0
                entry["peak_gpu_bytes"] = peak_bytes(a.device)
                free_memory()
            rec["results"][name] = entry
            if not entry["ok"]:
                rec["failed_steps"].append(name)
            rec["total_seconds"] = time.perf_counter() - t_start
            common.write_json(json_path, rec)  # after every step: a cut-short run keeps it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rec["complete"] = True
    common.finish_record(rec, rec["results"], time.perf_counter() - t_start)
    rec["total_seconds"] = time.perf_counter() - t_start
    common.write_json(json_path, rec)
    try:
        plot(rec, png_path)
    except Exception as e:  # noqa: BLE001 - a plot is a nicety: never fail the record for it
        print(f"note: no plot ({type(e).__name__}: {e})", file=sys.stderr)
    dev = rec["device"]
    print(f"\n{dev.get('gpu', 'cpu')} | torch {dev['torch']} | CUDA {dev['cuda_version']} | "
          f"{a.preset}, seq {a.seq_len}, batch {a.batch_size}")
    for line in summary_lines(rec["results"]):
        print(line)
    print(f"total {rec['total_seconds']:.1f} s; failed: {rec['failed_steps'] or 'none'}")
    print(f"wrote {json_path}")
    return 1 if rec["failed_steps"] else 0


if __name__ == "__main__":
    sys.exit(main())
