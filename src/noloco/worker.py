"""One worker process: builds the pieces, runs the inner/outer loop, writes the run directory.

Layout of the N·P workers (N replicas × P pipeline stages): global rank = replica·P + stage,
so the P stages of one replica are neighbours (one machine each under ``torchrun
--nproc-per-node P``). Each stage has its own group of N replicas; outer steps run inside it.

Two communicators per worker, never mixed:
- the *training* communicator of this stage's replicas, handed to the method; its bytes and
  blocked seconds are what a run reports;
- the *metrics* communicator over the whole world, used only to check the start-up weights,
  gather evaluation losses and measure weight spread (SPEC allows evaluation to gather).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from noloco import data as data_mod
from noloco.comm import Communicator, NullCommunicator, TorchCommunicator, flatten
from noloco.config import Config, ConfigError
from noloco.methods import build_method
from noloco.model import build, count_params, lm_loss, preset
from noloco.rundir import RunDir


@dataclass
class Layout:
    rank: int = 0
    world: int = 1
    local_world: int = 1
    replica: int = 0
    stage: int = 0
    replicas: int = 1
    stages: int = 1

    @classmethod
    def from_env(cls, replicas: int, stages: int) -> Layout:
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world != replicas * stages:
            raise ConfigError(f"world size {world} does not match --replicas {replicas} x "
                              f"--stages {stages} = {replicas * stages} workers")
        return cls(rank=rank, world=world,
                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                   replica=rank // stages, stage=rank % stages, replicas=replicas,
                   stages=stages)

    def stage_ranks(self, stage: int) -> list[int]:
        return [r * self.stages + stage for r in range(self.replicas)]

    def global_rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + stage


def lr_at(step: int, peak: float, warmup: int, total: int, floor_ratio: float = 0.1) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``peak·floor_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def limit_threads(local_world: int) -> int:
    """cores ÷ local workers (at least 1): N workers on a few cores must not oversubscribe."""
    n = max(1, data_mod.cpu_count() // max(local_world, 1))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass
    return n


def pick_device(spec: str, local_rank: int, local_world: int = 1) -> torch.device:
    """GPU when asked for (or ``auto`` and there are enough: one GPU per local worker, as
    NCCL requires), else CPU."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "cuda" and n < local_world:
        raise ConfigError(f"--device cuda needs one GPU per local worker: {local_world} "
                          f"workers, {n} GPUs visible")
    if spec == "cuda" or (spec == "auto" and n >= local_world):
        torch.cuda.set_device(local_rank % n)
        return torch.device("cuda", local_rank % n)
    return torch.device("cpu")


def weights_checksum(params: list[torch.Tensor]) -> int:
    crc = 0
    for p in params:
        crc = zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


class LocalRunner:
    """One stage holds the whole model: forward and backward in this process."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.activation_bytes = 0

    def parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.named_parameters())

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, step: int
                   ) -> float | None:
        loss = lm_loss(self.model(inputs), targets)
        loss.backward()
        return loss.item()

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        self.model.eval()
        total = sum(lm_loss(self.model(x), y).item() for x, y in batches)
        self.model.train()
        return total / len(batches)


def run(cfg: Config) -> dict[str, Any] | None:
    """Run one worker of the job ``cfg`` describes (rank from torchrun's environment)."""
    cfg = cfg.resolved()
    m, t = cfg.method, cfg.train
    lay = Layout.from_env(m.replicas, m.stages)
    threads = limit_threads(lay.local_world)
    device = pick_device(t.device, int(os.environ.get("LOCAL_RANK", 0)), lay.local_world)
    distributed = lay.world > 1
    if distributed and not dist.is_initialized():
        from datetime import timedelta
        # On GPUs the methods' tensors go through NCCL; the small CPU tensors of metrics
        # and start-up checks through gloo, in the same process group.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=m.comm_timeout))

    rundir = RunDir(Path(t.out))
    if lay.rank == 0 and os.environ.get("NOLOCO_RUNDIR_READY") != "1":
        rundir.prepare(cfg, overwrite=t.overwrite)  # started by an outside torchrun

    try:
        return _train(cfg, lay, device, threads, rundir)
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def _make_comms(cfg: Config, lay: Layout) -> tuple[Communicator, Communicator,
                                                   list[Communicator]]:
    if lay.world == 1:
        return NullCommunicator(), NullCommunicator(), []
    timeout = cfg.method.comm_timeout
    world = TorchCommunicator(list(range(lay.world)), group=dist.group.WORLD)
    # Every rank creates every stage group in the same order (new_group is world-collective).
    stage_groups = [TorchCommunicator(lay.stage_ranks(s), timeout=timeout)
                    for s in range(lay.stages)]
    mine = stage_groups[lay.stage] if lay.replicas > 1 else NullCommunicator()
    return mine, world, stage_groups


def _train(cfg: Config, lay: Layout, device: torch.device, threads: int, rundir: RunDir
           ) -> dict[str, Any] | None:
    m, d, o, t = cfg.method, cfg.data, cfg.optim, cfg.train
    t_start = time.perf_counter()
    tokenizer = data_mod.make_tokenizer(d.tokenizer)
    corpus = data_mod.load_corpus(d.data, tokenizer, d.seq_len, d.max_tokens)
    reader = data_mod.ShardedReader(corpus.train, d.seq_len, d.batch_size, lay.replica,
                                    lay.replicas, seed=t.seed)
    val = [(x.to(device), y.to(device)) for x, y in data_mod.validation_batches(
        corpus.val, d.seq_len, d.batch_size, t.eval_batches)]

    args = preset(cfg.model.preset, vocab_size=tokenizer.vocab_size, dropout=cfg.model.dropout)
    model = build(args, device=device, seed=t.seed)
    n_params_total = count_params(model)
    comm, world, _ = _make_comms(cfg, lay)
    if lay.stages > 1:
        from noloco.pipeline import PipelineRunner
        runner = PipelineRunner(model, cfg, lay, device)
    else:
        runner = LocalRunner(model)
    params = runner.parameters()
    _check_identical_start(params, lay, world)

    # Named parameters let streaming methods cut fragments by block (global block names).
    named = runner.named_parameters() if hasattr(runner, "named_parameters") else params
    method = build_method(m, named, comm, seed=t.seed, n_layers=args.n_layers)
    inner = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2),
                              weight_decay=o.weight_decay)
    torch.manual_seed(t.seed * 1009 + lay.rank)  # dropout differs per worker, on purpose

    tokens_per_step = d.batch_size * d.seq_len
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    log = Progress(enabled=lay.rank == 0, total=t.steps, log_every=t.log_every)
    compute_s = eval_s = 0.0
    peak_step_bytes = 0  # most bytes the method sent in any one inner step (this rank)
    last_train: list[float] = []
    t_loop = time.perf_counter()

    def evaluate(step: int) -> dict[str, Any]:
        nonlocal eval_s
        e0 = time.perf_counter()
        mine = runner.eval_loss(val)
        train_loss = sum(last_train) / len(last_train) if last_train else float("nan")
        rec = _gather_metrics(lay, world, comm, mine, train_loss, params, runner)
        wall = time.perf_counter() - t_loop
        rec.update(step=step, tokens=step * tokens_per_step * lay.replicas,
                   tokens_per_replica=step * tokens_per_step, wall_seconds=wall)
        if lay.rank == 0:
            rundir.append_metrics(rec)
            log.eval_line(rec)
        last_train.clear()
        eval_s += time.perf_counter() - e0
        return rec

    rec = evaluate(0)
    for step in range(t.steps):
        s0 = time.perf_counter()
        lr = lr_at(step, o.lr, o.warmup, t.steps)
        for g in inner.param_groups:
            g["lr"] = lr
        inputs, targets = reader.next_batch()
        loss = runner.train_step(inputs.to(device), targets.to(device), step)
        sync0, bytes0 = comm.sync_seconds, comm.bytes_sent
        method.sync_gradients()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        inner.step()
        inner.zero_grad(set_to_none=True)
        c1, blocked = time.perf_counter(), comm.sync_seconds - sync0
        method.after_inner_step()
        peak_step_bytes = max(peak_step_bytes, comm.bytes_sent - bytes0)
        # Inner-step compute excludes the seconds blocked in the method's communication
        # before c1; blocking inside after_inner_step (outer steps) lies outside (c1 - s0).
        compute_s += (c1 - s0) - blocked
        if loss is not None:
            last_train.append(loss)
        log.step(step + 1, loss, tokens_per_step * lay.replicas)
        if (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
            rec = evaluate(step + 1)
    method.finish()
    rec = evaluate(t.steps)
    loop_s = time.perf_counter() - t_loop
    log.close()

    stats = _gather_scalars(world, lay, [compute_s, loop_s - eval_s])
    summary = {
        "method": m.method,
        "replicas": lay.replicas,
        "stages": lay.stages,
        "steps": t.steps,
        "outer_steps": method.outer_steps,
        "sync_every": method.sync_every,
        "group_size": m.group_size if m.method == "noloco" else None,
        "params": n_params_total,
        "param_bytes": param_bytes if lay.stages == 1 else None,
        "tokens_per_replica": t.steps * tokens_per_step,
        "final_val_loss": rec["val_loss"],
        "final_val_loss_per_replica": rec["val_loss_per_replica"],
        "bytes_sent_per_replica": rec["bytes_sent_per_replica"],
        "bytes_sent": rec["bytes_sent"],
        # The most bytes any one worker sent in one inner step (max over all ranks).
        "peak_step_bytes": int(_gather_scalars(world, lay, [peak_step_bytes], "max")[0]),
        "activation_bytes": rec["activation_bytes"],
        "sync_seconds": rec["sync_seconds"],
        "compute_seconds": stats[0],
        "step_seconds": stats[0] / t.steps,
        "train_seconds": stats[1],
        "compute_utilisation": stats[0] / stats[1] if stats[1] > 0 else None,
        "wall_seconds": time.perf_counter() - t_start,
        "weight_spread": rec["weight_spread"],
        "tokens_per_second": t.steps * tokens_per_step * lay.replicas / max(stats[1], 1e-9),
        "threads_per_worker": threads,
        "device": str(device),
        "torch": torch.__version__,
    }
    if lay.stages > 1:
        summary["param_bytes"] = sum(_gather_scalars(world, lay, [param_bytes], "stage_sum"))
    if hasattr(runner, "report"):
        summary.update(runner.report())
    if hasattr(method, "report"):
        summary.update(method.report())
    if lay.rank == 0:
        rundir.write_summary(summary)
        log.final(summary)
        return summary
    return None


def _check_identical_start(params: list[torch.Tensor], lay: Layout, world: Communicator
                           ) -> None:
    """All replicas of a stage must start from bit-identical weights (SPEC §3)."""
    if lay.world == 1:
        return
    mine = torch.tensor([weights_checksum(params)], dtype=torch.int64)
    sums = world.all_gather(mine)
    for s in range(lay.stages):
        vals = {int(sums[r].item()) for r in lay.stage_ranks(s)}
        if len(vals) != 1:
            raise RuntimeError(f"replicas of stage {s} start from different weights")


def _gather_metrics(lay: Layout, world: Communicator, comm: Communicator, val_loss: float | None,
                    train_loss: float | None, params: list[torch.Tensor], runner: Any
                    ) -> dict[str, Any]:
    """Per-replica losses, bytes and blocked seconds, and the weight spread (SPEC §3)."""
    nan = float("nan")
    row = torch.tensor([
        nan if val_loss is None else val_loss,
        nan if train_loss is None else train_loss,
        float(comm.bytes_sent), comm.sync_seconds, float(runner.activation_bytes),
    ], dtype=torch.float64)
    rows = torch.stack(world.all_gather(row)) if lay.world > 1 else row[None]
    last = lay.stages - 1
    val = [float(rows[lay.global_rank(r, last), 0]) for r in range(lay.replicas)]
    train = [float(rows[lay.global_rank(r, last), 1]) for r in range(lay.replicas)]
    # A replica's bytes are those of all its stages together.
    per_replica_bytes = [int(sum(rows[lay.global_rank(r, s), 2] for s in range(lay.stages)))
                         for r in range(lay.replicas)]
    per_replica_sync = [float(sum(rows[lay.global_rank(r, s), 3] for s in range(lay.stages)))
                        / lay.stages for r in range(lay.replicas)]
    act = [int(sum(rows[lay.global_rank(r, s), 4] for s in range(lay.stages)))
           for r in range(lay.replicas)]
    return {
        "train_loss": _mean(train),
        "val_loss": _mean(val),
        "val_loss_per_replica": val,
        "bytes_sent": _mean(per_replica_bytes),
        "bytes_sent_per_replica": _mean(per_replica_bytes),
        "bytes_sent_by_replica": per_replica_bytes,
        "activation_bytes": _mean(act),
        "sync_seconds": _mean(per_replica_sync),
        "weight_spread": weight_spread(params, lay, world),
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


@torch.no_grad()
def weight_spread(params: list[torch.Tensor], lay: Layout, world: Communicator) -> float:
    """sqrt( Σ_params (p − mean over replicas)² / (#params · N) ), all stages together."""
    if lay.replicas == 1:
        return 0.0
    flat = flatten(params, torch.float64)
    if lay.stages == 1:
        # Two all-reduces (the mean, then the squared deviations) instead of gathering every
        # replica's weights: 2·S per rank whatever N, which matters on slow links.
        mean = flat.clone()
        world.all_reduce_mean(mean)
        sq_t = torch.tensor([((flat - mean) ** 2).sum().item()], dtype=torch.float64)
        world.all_reduce_mean(sq_t)
        sq = sq_t.item() * lay.world
        n = flat.numel()
    else:
        # Stages hold different parameters: gather per stage through the world, padded.
        size = torch.tensor([flat.numel()], dtype=torch.int64)
        sizes = [int(s) for s in world.all_gather(size)]
        pad = torch.zeros(max(sizes), dtype=torch.float64)
        pad[: flat.numel()] = flat
        allp = world.all_gather(pad)
        sq, n = 0.0, 0
        for s in range(lay.stages):
            ranks = lay.stage_ranks(s)
            st = torch.stack([allp[r][: sizes[r]] for r in ranks])
            sq += ((st - st.mean(0)) ** 2).sum().item()
            n += sizes[ranks[0]]
    return math.sqrt(sq / (n * lay.replicas))


def _gather_scalars(world: Communicator, lay: Layout, values: list[float],
                    how: str = "mean") -> list[float]:
    v = torch.tensor(values, dtype=torch.float64)
    if lay.world == 1:
        return [float(x) for x in v]
    rows = torch.stack(world.all_gather(v))
    if how == "max":
        return [float(x) for x in rows.max(0).values]
    if how == "stage_sum":
        return [float(rows[lay.global_rank(0, s)].sum()) for s in range(lay.stages)]
    return [float(x) for x in rows.mean(0)]


class Progress:
    """A rich progress bar on a terminal; plain lines otherwise (logs, CI)."""

    def __init__(self, enabled: bool, total: int, log_every: int = 10) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.tty = enabled and sys.stderr.isatty()
        self.total = total
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bar = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress
            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                    transient=True)
            self.task = self.bar.add_task("train", total=total, info="")
            self.bar.start()

    def step(self, step: int, loss: float | None, tokens: int) -> None:
        if not self.enabled:
            return
        self.tokens += tokens
        tps = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        info = f"loss {loss:.3f} | {tps:,.0f} tok/s" if loss is not None else f"{tps:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.log_every > 0 and step % self.log_every == 0:
            print(f"step {step:>6}/{self.total} | {info}", flush=True)

    def eval_line(self, rec: dict[str, Any]) -> None:
        msg = (f"step {rec['step']:>6} | train {rec['train_loss']:.4f} | val {rec['val_loss']:.4f}"
               f" | spread {rec['weight_spread']:.2e} | sent {rec['bytes_sent'] / 1e6:,.1f} MB"
               f" | blocked {rec['sync_seconds']:.2f} s | {rec['wall_seconds']:.1f} s")
        if self.bar is not None:
            self.bar.console.print(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def final(self, summary: dict[str, Any]) -> None:
        print(json.dumps({k: summary[k] for k in (
            "method", "replicas", "stages", "steps", "final_val_loss", "bytes_sent_per_replica",
            "sync_seconds", "compute_utilisation", "weight_spread", "wall_seconds")}),
            flush=True)
