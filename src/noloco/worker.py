"""One worker process: builds the pieces, runs the inner/outer loop, saves and resumes.

Layout of the N·P workers (N replicas × P pipeline stages): global rank = replica·P + stage,
so the P stages of one replica are neighbours (one machine each under ``torchrun
--nproc-per-node P``). Each stage has its own group of N replicas; outer steps run inside it.

Two communicators per worker, never mixed:
- the *training* communicator of this stage's replicas, handed to the method; its bytes and
  blocked seconds are what a run reports;
- the *metrics* communicator over the whole world, used only to check the start-up weights,
  agree on a checkpoint, gather evaluation losses and measure weight spread.

The loop, per inner step: forward/backward → the method's gradient sync → clip → AdamW →
the method's outer step (if due) → evaluate (if due) → checkpoint (if due). A checkpoint
holds everything the next step depends on, so a resumed run is bit-identical to one that
never stopped (on the same machine and thread count).
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import socket
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from noloco import checkpoint as ckpt_mod
from noloco import data as data_mod
from noloco.comm import (
    CommError,
    Communicator,
    NullCommunicator,
    TorchCommunicator,
    flatten,
    unflatten_into,
)
from noloco.config import Config, ConfigError
from noloco.faults import FaultInjector, parse_faults
from noloco.methods import build_method
from noloco.metrics import Progress, gather_metrics, gather_scalars
from noloco.model import build, count_params, lm_loss, preset
from noloco.rundir import RunDir, os_error_line
from noloco.watchdog import Watchdog

AVERAGED_METHODS = ("diloco", "noloco", "streaming")
"""methods whose replicas end with different weights: their mean is saved as a model too"""


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

    def describe(self, rank: int) -> str:
        return f"rank {rank} (replica {rank // self.stages}, stage {rank % self.stages})"


def lr_at(step: int, peak: float, warmup: int, total: int, floor_ratio: float = 0.1) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``peak·floor_ratio`` at ``total``
    (and that floor after it)."""
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


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(spec: str, local_world: int) -> None:
    """ConfigError if ``--device cuda`` cannot be honoured (one GPU per local worker)."""
    n = cuda_devices()
    if spec == "cuda" and n < local_world:
        raise ConfigError(f"--device cuda needs one GPU per local worker: {local_world} "
                          f"workers, {n} GPUs visible")


def pick_device(spec: str, local_rank: int, local_world: int = 1) -> torch.device:
    """GPU when asked for (or ``auto`` and there are enough: one GPU per local worker, as
    NCCL requires), else CPU."""
    check_device(spec, local_world)
    n = cuda_devices()
    if spec == "cuda" or (spec == "auto" and n >= local_world and n > 0):
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
        self.watchdog = None

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

    def state_dict(self) -> dict[str, Any]:
        return {"activation_bytes": self.activation_bytes}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.activation_bytes = sd["activation_bytes"]


# ---- process group and store -----------------------------------------------------------------

def attempt_number(store: Any = None, rank: int = 0) -> int:
    """0 for a first start; k after the k-th restart.

    Our launcher says which (``NOLOCO_ATTEMPT``). Under torchrun every rank number counts its
    own starts in the store all nodes share: a restart starts every rank number once, so the
    counts move in lockstep. (``TORCHELASTIC_RESTART_COUNT`` does not: each node's agent
    counts only its own workers' failures, and a replacement node starts from 0.)"""
    if os.environ.get("NOLOCO_ATTEMPT") is not None:
        return int(os.environ["NOLOCO_ATTEMPT"])
    if store is not None:
        return store.add(f"noloco/starts/{rank}", 1) - 1
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


@dataclass
class DistContext:
    store: Any = None
    """the run's key-value store (heartbeats, checkpoint receipts, failure reports)"""
    attempt: int = 0
    owns_group: bool = False

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(lay: Layout, timeout_s: float, device: torch.device) -> DistContext:
    """Join the process group of this attempt.

    The store is torchrun's (or our launcher's) agent store when the environment says so,
    else rank 0 hosts it, listening on MASTER_ADDR only. The process group is built on a
    prefix of the store named after the attempt: a restarted attempt reuses the same store,
    and without the prefix its gloo ranks would read the dead attempt's addresses and fail
    (``connectFullMesh ... Connection refused`` on torch 2.13).
    """
    if lay.world == 1:
        return DistContext(attempt=attempt_number())
    if dist.is_initialized():  # a caller (a test) built the group already
        return DistContext(store=dist.distributed_c10d._get_default_store(),
                           attempt=attempt_number())
    timeout = timedelta(seconds=timeout_s)
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        base = dist.TCPStore(host, port, lay.world, False, timeout)
    elif lay.rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((socket.gethostbyname(host), port))
        sock.listen(1024)
        base = dist.TCPStore(host, port, lay.world, True, timeout, wait_for_workers=False,
                             master_listen_fd=sock.detach())
    else:
        base = dist.TCPStore(host, port, lay.world, False, timeout)
    attempt = attempt_number(base, lay.rank)
    # On GPUs the methods' tensors go through NCCL; the small CPU tensors of metrics and
    # start-up checks through gloo, in the same process group (untested: no GPU here).
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(f"noloco/attempt-{attempt}", base),
                            rank=lay.rank, world_size=lay.world, timeout=timeout)
    return DistContext(store=base, attempt=attempt, owns_group=True)


def _make_comms(cfg: Config, lay: Layout) -> tuple[Communicator, Communicator]:
    if lay.world == 1:
        return NullCommunicator(), NullCommunicator()
    timeout = cfg.method.comm_timeout
    world = TorchCommunicator(list(range(lay.world)), group=dist.group.WORLD)
    # Every rank creates every stage group in the same order (new_group is world-collective).
    stage_groups = [TorchCommunicator(lay.stage_ranks(s), timeout=timeout)
                    for s in range(lay.stages)]
    mine = stage_groups[lay.stage] if lay.replicas > 1 else NullCommunicator()
    return mine, world


# ---- the loop ---------------------------------------------------------------------------------

@dataclass
class LoopState:
    """The run's own counters: checkpointed, so a resumed run reports as if it never stopped."""

    step: int = 0
    compute_s: float = 0.0
    eval_s: float = 0.0
    peak_step_bytes: int = 0
    last_train: list[float] = field(default_factory=list)
    """training losses since the last evaluation"""
    metric_lines: int = 0
    """lines of metrics.jsonl written so far (rank 0)"""
    last_eval_step: int = -1
    loop_s: float = 0.0
    """wall seconds in the training loop so far"""
    wall_s: float = 0.0
    """wall seconds of the run so far, start-up included"""


class Trainer:
    """One worker's training: the pieces, the loop, and what a checkpoint holds."""

    def __init__(self, cfg: Config, lay: Layout, device: torch.device, threads: int,
                 rundir: RunDir, ctx: DistContext, status: WorkerStatus) -> None:
        m, d, o, t = cfg.method, cfg.data, cfg.optim, cfg.train
        self.cfg, self.lay, self.device, self.threads = cfg, lay, device, threads
        self.rundir, self.ctx, self.status = rundir, ctx, status
        self.t_start = time.perf_counter()
        tokenizer = data_mod.make_tokenizer(d.tokenizer)
        corpus = data_mod.load_corpus(d.data, tokenizer, d.seq_len, d.max_tokens,
                                      allow_binary=d.allow_binary)
        self.reader = data_mod.ShardedReader(corpus.train, d.seq_len, d.batch_size, lay.replica,
                                             lay.replicas, seed=t.seed)
        self.val = [(x.to(device), y.to(device)) for x, y in data_mod.validation_batches(
            corpus.val, d.seq_len, d.batch_size, t.eval_batches)]
        self.tokenizer_name = tokenizer.name
        self.args = preset(cfg.model.preset, vocab_size=tokenizer.vocab_size,
                           dropout=cfg.model.dropout)
        model = build(self.args, device=device, seed=t.seed)
        self.n_params_total = count_params(model)
        self.comm, self.world = _make_comms(cfg, lay)
        if lay.stages > 1:
            from noloco.pipeline import PipelineRunner
            self.runner: Any = PipelineRunner(model, cfg, lay, device)
        else:
            self.runner = LocalRunner(model)
        self.params = self.runner.parameters()
        # Named parameters let streaming methods cut fragments by block (global block names).
        self.method = build_method(m, self.runner.named_parameters(), self.comm, seed=t.seed,
                                   n_layers=self.args.n_layers)
        self.inner = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2),
                                       weight_decay=o.weight_decay)
        torch.manual_seed(t.seed * 1009 + lay.rank)  # dropout differs per worker, on purpose
        self.watchdog = None
        if ctx.store is not None:
            self.watchdog = Watchdog(ctx.store, lay.rank, ctx.attempt, lay.describe,
                                     m.stall_warning).start()
            for c in (self.comm, self.world, self.runner):
                c.watchdog = self.watchdog
        self.ckpt = ckpt_mod.Checkpointer(
            rundir.path / "checkpoints", lay.rank, lay.world, cfg.math_hash(),
            t.checkpoint_every, t.keep_checkpoints, store=ctx.store)
        self.state = LoopState()
        self.resumed_from: int | None = None
        self.t_loop = time.perf_counter()
        self.tokens_per_step = d.batch_size * d.seq_len
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)

    # ---- checkpoints ------------------------------------------------------------------------
    def capture(self) -> dict[str, Any]:
        """Everything the next inner step depends on (live tensors: the checkpointer copies)."""
        return {
            "format": ckpt_mod.FORMAT, "step": self.state.step, "rank": self.lay.rank,
            "config_hash": self.cfg.math_hash(),
            "model": dict(self.runner.named_parameters()),
            "optimizer": self.inner.state_dict(),
            "method": self.method.state_dict(),
            "reader": self.reader.state_dict(),
            "rng": ckpt_mod.rng_state(),
            "comm": self.comm.state_dict(),
            "runner": self.runner.state_dict(),
            "loop": {**asdict(self.state), "loop_s": self.loop_seconds(),
                     "wall_s": self.wall_seconds()},
        }

    def loop_seconds(self) -> float:
        """Wall seconds in the training loop, earlier processes of this run included."""
        return self.state.loop_s + time.perf_counter() - self.t_loop

    def wall_seconds(self) -> float:
        return self.state.wall_s + time.perf_counter() - self.t_start

    @torch.no_grad()
    def restore(self, sd: dict[str, Any]) -> None:
        named = dict(self.runner.named_parameters())
        if set(named) != set(sd["model"]):
            raise ConfigError("the checkpoint holds other parameters than this model")
        for name, p in named.items():
            p.copy_(sd["model"][name])
        self.inner.load_state_dict(sd["optimizer"])
        self.method.load_state_dict(sd["method"])
        self.reader.load_state_dict(sd["reader"])
        ckpt_mod.set_rng_state(sd["rng"])
        self.comm.load_state_dict(sd["comm"])
        self.runner.load_state_dict(sd["runner"])
        self.state = LoopState(**sd["loop"])

    def resume(self, required: bool) -> None:
        """Continue from the newest checkpoint every worker holds whole (collective)."""
        root = self.rundir.path / "checkpoints"

        def gather(x: int) -> list[int]:
            if self.lay.world == 1:
                return [x]
            return [int(v) for v in self.world.all_gather(torch.tensor([x]))]

        def report(msg: str) -> None:
            print(f"noloco: {self.lay.describe(self.lay.rank)}: {msg}", file=sys.stderr,
                  flush=True)

        step, sd = ckpt_mod.agree_on_step(root, self.lay.rank, self.cfg.math_hash(), gather,
                                          report)
        if step is None:
            if required:
                raise ConfigError(f"no complete checkpoint in {root} to resume from")
            if self.lay.rank == 0:
                self.rundir.truncate_metrics(0)  # a restart before any checkpoint: anew
            return
        if step >= self.cfg.train.steps and required:
            raise ConfigError(f"the run in {self.rundir.path} already reached step {step}: "
                              f"pass --steps above it to train further")
        self.restore(sd)
        self.resumed_from = step
        if self.lay.rank == 0:
            self.rundir.truncate_metrics(self.state.metric_lines)
            print(f"noloco: resuming from {root.name}/{ckpt_mod.step_dir(root, step).name} "
                  f"(step {step})", file=sys.stderr, flush=True)

    # ---- evaluation -------------------------------------------------------------------------
    def evaluate(self, step: int, log: Progress) -> dict[str, Any]:
        e0 = time.perf_counter()
        st = self.state
        mine = self.runner.eval_loss(self.val)
        train_loss = sum(st.last_train) / len(st.last_train) if st.last_train else float("nan")
        rec = gather_metrics(self.lay, self.world, self.comm, mine, train_loss, self.params,
                             self.runner)
        rec.update(step=step, tokens=step * self.tokens_per_step * self.lay.replicas,
                   tokens_per_replica=step * self.tokens_per_step,
                   wall_seconds=self.loop_seconds())
        if self.lay.rank == 0:
            self.rundir.append_metrics(rec)
            log.eval_line(rec)
        st.metric_lines += 1
        st.last_eval_step = step
        st.last_train.clear()
        st.eval_s += time.perf_counter() - e0
        return rec

    # ---- training -----------------------------------------------------------------------------
    def train(self) -> dict[str, Any] | None:
        cfg, lay, st = self.cfg, self.lay, self.state
        o, t = cfg.optim, cfg.train
        faults = FaultInjector(parse_faults(t.inject_fault, lay.replicas, lay.stages),
                               lay.replica, lay.stage, lay.rank,
                               once=self.ctx.attempt == 0 and self.resumed_from is None)
        log = Progress(enabled=lay.rank == 0, total=t.steps, log_every=t.log_every,
                       start=st.step)
        if lay.rank == 0:
            self.rundir.write_summary({"status": "running", "last_step": st.step,
                                       "attempt": self.ctx.attempt,
                                       "resumed_from_step": self.resumed_from})
        self.t_loop = time.perf_counter()
        comm, method, inner, runner = self.comm, self.method, self.inner, self.runner
        if self.resumed_from is None:
            self.evaluate(0, log)
        elif (st.step % t.eval_every == 0 and st.last_eval_step != st.step
              and st.step < t.steps):
            # The checkpoint was the last step of its run, where the regular evaluation gives
            # way to the final one (after any sync in flight lands): do it now, as an
            # uninterrupted run would have.
            self.evaluate(st.step, log)
        for step in range(st.step, t.steps):
            s0 = time.perf_counter()
            lr = lr_at(step, o.lr, o.warmup, o.schedule_steps)
            for g in inner.param_groups:
                g["lr"] = lr
            inputs, targets = self.reader.next_batch()
            loss = runner.train_step(inputs.to(self.device), targets.to(self.device), step)
            sync0, bytes0 = comm.sync_seconds, comm.bytes_sent
            method.sync_gradients()
            if o.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, o.grad_clip)
            inner.step()
            inner.zero_grad(set_to_none=True)
            faults.pace(time.perf_counter() - s0)
            c1, blocked = time.perf_counter(), comm.sync_seconds - sync0
            st.step = self.status.step = step + 1
            if self.watchdog is not None:
                self.watchdog.step = st.step
            method.after_inner_step()
            st.peak_step_bytes = max(st.peak_step_bytes, comm.bytes_sent - bytes0)
            # Inner-step compute excludes the seconds blocked in the method's communication
            # before c1; blocking inside after_inner_step (outer steps) lies outside (c1 - s0).
            st.compute_s += (c1 - s0) - blocked
            if loss is not None:
                st.last_train.append(loss)
            log.step(st.step, loss, self.tokens_per_step * lay.replicas)
            last = st.step == t.steps
            if st.step % t.eval_every == 0 and not last:
                self.evaluate(st.step, log)
            if self.ckpt.due(st.step) or (last and self.ckpt.every > 0):
                self.ckpt.save(st.step, self.capture())
            self.ckpt.poll()
            faults.after_step(st.step)
        w0 = time.perf_counter()
        self.ckpt.wait()  # the last checkpoint is on disk before the run says it completed
        self.ckpt.final_wait_seconds = time.perf_counter() - w0
        method.finish()
        rec = self.evaluate(t.steps, log)
        log.close()
        self.save_final_weights()  # ends with a barrier: every checkpoint write is done
        self.ckpt.prune()
        summary = self.summarise(rec)
        if lay.rank == 0:
            self.rundir.write_summary(summary)
            log.final(summary)
            return summary
        return None

    @torch.no_grad()
    def save_final_weights(self) -> None:
        """``model/``: every replica's weights and, for the local-SGD methods, their mean
        (stages write their own shards). Collective."""
        lay, cfg = self.lay, self.cfg
        model_dir = self.rundir.path / ckpt_mod.MODEL_DIR
        named = self.runner.named_parameters()
        meta = {"step": str(self.state.step), "method": cfg.method.method}
        ckpt_mod.save_weights(
            model_dir / ckpt_mod.shard_name(f"replica-{lay.replica}", lay.stage, lay.stages),
            dict(named), meta)
        names = [f"replica-{r}" for r in range(lay.replicas)]
        if lay.replicas > 1 and cfg.method.method in AVERAGED_METHODS:
            flat = flatten([p for _, p in named], torch.float32)
            with self.comm.uncounted():  # an export, not training traffic
                self.comm.all_reduce_mean(flat)
            if lay.replica == 0:
                avg = [torch.empty_like(p, dtype=torch.float32) for _, p in named]
                unflatten_into(flat, avg)
                ckpt_mod.save_weights(
                    model_dir / ckpt_mod.shard_name("average", lay.stage, lay.stages),
                    {n: a for (n, _), a in zip(named, avg, strict=True)}, meta)
            names.append("average")
        gather_scalars(self.world, lay, [0.0])  # every shard is on disk before the index
        if lay.rank == 0:
            ckpt_mod.write_model_index(self.rundir.path, self.args, names, lay.stages, {
                "tokenizer": cfg.data.tokenizer, "tokenizer_name": self.tokenizer_name,
                "preset": cfg.model.preset, "step": self.state.step,
                "method": cfg.method.method})

    def summarise(self, rec: dict[str, Any]) -> dict[str, Any]:
        cfg, lay, st, t = self.cfg, self.lay, self.state, self.cfg.train
        m = cfg.method
        train_s = self.loop_seconds() - st.eval_s
        stats = gather_scalars(self.world, lay, [st.compute_s, train_s])
        tps = self.tokens_per_step
        summary = {
            "status": "completed",
            "method": m.method,
            "replicas": lay.replicas,
            "stages": lay.stages,
            "steps": t.steps,
            "outer_steps": self.method.outer_steps,
            "sync_every": self.method.sync_every,
            "group_size": m.group_size if m.method == "noloco" else None,
            "params": self.n_params_total,
            "param_bytes": self.param_bytes if lay.stages == 1 else None,
            "tokens_per_replica": t.steps * tps,
            "final_val_loss": rec["val_loss"],
            "final_val_loss_per_replica": rec["val_loss_per_replica"],
            "bytes_sent_per_replica": rec["bytes_sent_per_replica"],
            "bytes_sent": rec["bytes_sent"],
            # The most bytes any one worker sent in one inner step (max over all ranks).
            "peak_step_bytes": int(gather_scalars(self.world, lay, [st.peak_step_bytes],
                                                  "max")[0]),
            "activation_bytes": rec["activation_bytes"],
            "sync_seconds": rec["sync_seconds"],
            "compute_seconds": stats[0],
            "step_seconds": stats[0] / t.steps,
            "train_seconds": stats[1],
            "compute_utilisation": stats[0] / stats[1] if stats[1] > 0 else None,
            "wall_seconds": self.wall_seconds(),
            "weight_spread": rec["weight_spread"],
            "tokens_per_second": t.steps * tps * lay.replicas / max(stats[1], 1e-9),
            "threads_per_worker": self.threads,
            "device": str(self.device),
            "torch": torch.__version__,
            "resumed_from_step": self.resumed_from,
            "attempt": self.ctx.attempt,
            "model_dir": ckpt_mod.MODEL_DIR,
        }
        if lay.stages > 1:
            summary["param_bytes"] = sum(gather_scalars(self.world, lay, [self.param_bytes],
                                                        "stage_sum"))
        ck = self.ckpt.report()
        ck["checkpoint_blocked_seconds"] = gather_scalars(
            self.world, lay, [ck["checkpoint_blocked_seconds"]])[0]
        summary.update(ck)
        if hasattr(self.runner, "report"):
            summary.update(self.runner.report())
        if hasattr(self.method, "report"):
            summary.update(self.method.report())
        return summary

    def close(self, ok: bool) -> None:
        try:
            self.ckpt.close(wait=ok)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()


@dataclass
class WorkerStatus:
    """What the error path needs to know about a worker that stopped."""

    lay: Layout = field(default_factory=Layout)
    step: int = 0
    out: str = ""
    store: Any = None
    attempt: int = 0


def run(cfg: Config, resume: bool = False, must_resume: bool = False,
        status: WorkerStatus | None = None, rundir_ready: bool = False
        ) -> dict[str, Any] | None:
    """Run one worker of the job ``cfg`` describes (rank from torchrun's environment).

    ``resume``: continue from the newest complete checkpoint in the run directory (if there
    is none: start afresh, unless ``must_resume``). ``rundir_ready``: a launcher prepared the
    run directory (else rank 0 does; also said by ``NOLOCO_RUNDIR_READY=1``). Returns rank
    0's summary.
    """
    status = status or WorkerStatus()
    cfg = cfg.resolved()
    m, t = cfg.method, cfg.train
    lay = Layout.from_env(m.replicas, m.stages)
    status.lay, status.out = lay, t.out
    threads = limit_threads(lay.local_world)
    device = pick_device(t.device, int(os.environ.get("LOCAL_RANK", 0)), lay.local_world)
    ctx = init_distributed(lay, m.comm_timeout, device)
    status.store, status.attempt = ctx.store, ctx.attempt
    rundir = RunDir(Path(t.out))
    trainer = None
    ok = False
    try:
        # The pieces first (bad data fails here, before anything is written), then the run
        # directory.
        trainer = Trainer(cfg, lay, device, threads, rundir, ctx, status)
        ready = rundir_ready or os.environ.get("NOLOCO_RUNDIR_READY") == "1"
        resume, required = _prepare_rundir(cfg, lay, rundir, resume, must_resume, ready,
                                           ctx.attempt, trainer.world)
        if resume:
            trainer.resume(required=required)
        else:
            _check_identical_start(trainer.params, lay, trainer.world)
        status.step = trainer.state.step
        summary = trainer.train()
        ok = True
        return summary
    finally:
        if trainer is not None:
            trainer.close(ok)
        ctx.close()


def _prepare_rundir(cfg: Config, lay: Layout, rundir: RunDir, resume: bool,
                    must_resume: bool, ready: bool, attempt: int, world: Communicator
                    ) -> tuple[bool, bool]:
    """Whether this start resumes (and must find a checkpoint), decided by rank 0 for all.

    Under our launcher (``ready``) the run directory is prepared and the attempt number
    tells a restart. Under torchrun, rank 0 tells a restart by the job marker: the run
    directory names the torchrun job (``TORCHELASTIC_RUN_ID``) that started it, and a
    restart of that job — after a crash, or with a node replaced — finds its own id there and
    resumes; it never prepares (or, with ``--overwrite``, empties) the directory again. A new
    job prepares the directory (or, with ``--resume``, continues it) and writes its id.
    Every rank learns the decision, and whether it failed (else the others would wait for
    rank 0 until the timeout)."""
    error = None
    required = must_resume
    if lay.rank == 0:
        try:
            run_id = os.environ.get("TORCHELASTIC_RUN_ID")
            if ready:
                resume, required = resume or attempt > 0, must_resume and attempt == 0
            elif run_id is not None and rundir.job() == run_id:
                resume, required = True, False  # torchrun restarted this job
            else:
                if resume:
                    rundir.write_config(cfg)
                else:
                    rundir.prepare(cfg, overwrite=cfg.train.overwrite)
                if run_id is not None:
                    rundir.set_job(run_id)
            rundir.remove_stale_tmp()
        except ConfigError as e:
            error = e
        except OSError as e:
            error = ConfigError(os_error_line(e))
    if lay.world > 1:
        mine = [float(error is not None), float(resume), float(required)]
        rows = world.all_gather(torch.tensor(mine, dtype=torch.float64))
        failed, resume, required = (bool(x) for x in rows[0].tolist())
        if failed and error is None:
            raise QuietExit(2)  # rank 0 says why
    if error is not None:
        raise error
    return resume, required


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


# ---- how a worker ends ------------------------------------------------------------------------

class Interrupted(Exception):
    """SIGTERM (or SIGINT) asked this worker to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class QuietExit(Exception):
    """Stop with this exit code; another worker reports why."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _raise_interrupted(signum: int, _frame: Any) -> None:
    # Once: a second SIGTERM while the first one unwinds (the launcher stopping every
    # worker) would interrupt the clean-up, even inside a finaliser.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def report_key(attempt: int, rank: int) -> str:
    """Where a worker that stopped leaves its report (read by the local launcher)."""
    return f"noloco/report/{attempt}/{rank}"


def classify(e: BaseException, status: WorkerStatus) -> tuple[int, str, str, int | None]:
    """(exit code, kind, one line, rank to blame) for how a worker ended."""
    from noloco.data import DataError

    if isinstance(e, QuietExit):
        return e.code, "quiet", "", None
    if isinstance(e, (ConfigError, DataError)):
        return 2, "usage", f"noloco: error: {e}", None
    if isinstance(e, (Interrupted, KeyboardInterrupt)):
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun may be stopping us to restart us
            return 128 + signum, "interrupted", (
                f"noloco: stopped by {signal.Signals(signum).name} at step {status.step} "
                f"(torchrun restarts the workers if its --max-restarts allows; else continue "
                f"with: noloco train --resume {status.out})"), None
        return 128 + signum, "interrupted", (
            f"noloco: interrupted at step {status.step}; continue with: "
            f"noloco train --resume {status.out}"), None
    if isinstance(e, CommError):
        return 1, "comm", f"noloco: error: {e}", e.culprit
    if isinstance(e, OSError):
        kind = "disk" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
        newest = ckpt_mod.complete_steps(Path(status.out) / "checkpoints", status.lay.world)
        keep = f" (the newest complete checkpoint, step {newest[0]}, is intact)" if newest else ""
        return 1, kind, f"noloco: error: {os_error_line(e)}{keep}", status.lay.rank
    return 1, "crash", f"noloco: error: {type(e).__name__}: {e}", status.lay.rank


def main(cfg: Config, resume: bool = False, must_resume: bool = False,
         rundir_ready: bool = False) -> int:
    """A worker process from start to exit code. Errors end as one line (a bug also with its
    traceback); the run directory's summary.json says how the run ended.

    Under our local launcher (``NOLOCO_SUPERVISED=1``) the worker only reports to the store
    and the launcher speaks for the run; elsewhere (one process, torchrun) rank 0 writes the
    run's status and every worker prints its own error line.
    """
    supervised = os.environ.get("NOLOCO_SUPERVISED") == "1"
    status = WorkerStatus(out=cfg.train.out)
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        run(cfg, resume, must_resume, status, rundir_ready)
        signal.signal(signal.SIGTERM, previous)
        return 0
    except BaseException as e:  # noqa: BLE001 - every ending becomes an exit code
        if isinstance(e, SystemExit):
            raise
        code, kind, line, culprit = classify(e, status)
        if kind == "crash":
            traceback.print_exc()
        _report(status, {"kind": kind, "line": line, "culprit": culprit, "code": code,
                         "step": status.step, "restartable": kind in ("comm", "crash"),
                         "t": time.time()})
        speak = kind in ("comm", "disk", "io", "crash") or status.lay.rank == 0
        if line and not supervised and speak:
            print(line, file=sys.stderr, flush=True)
        if not supervised and status.lay.rank == 0 and kind not in ("usage", "quiet"):
            _write_status(status, kind, line, culprit, code)
        # SIGTERM stays ignored once it came (a checkpoint write may still be finishing on
        # its thread, joined at exit); otherwise back to what the caller had.
        if kind != "interrupted":
            signal.signal(signal.SIGTERM, previous)
        return code


def _report(status: WorkerStatus, report: dict[str, Any]) -> None:
    if status.store is None:
        return
    try:
        status.store.set(report_key(status.attempt, status.lay.rank), json.dumps(report))
    except Exception:  # noqa: BLE001 - the store may be gone with the run
        pass


def _write_status(status: WorkerStatus, kind: str, line: str, culprit: int | None,
                  code: int) -> None:
    rundir = RunDir(status.out)
    if not rundir.path.is_dir():
        return
    newest = ckpt_mod.complete_steps(rundir.path / "checkpoints", status.lay.world)
    fields: dict[str, Any] = {
        "status": "interrupted" if kind == "interrupted" else "failed",
        "reason": line.removeprefix("noloco: error: ").removeprefix("noloco: "),
        "last_step": status.step, "exit_code": code,
        "newest_checkpoint": f"checkpoints/{ckpt_mod.step_dir(Path(), newest[0]).name}"
        if newest else None}
    if kind != "interrupted":
        fields["failed_rank"] = culprit if culprit is not None else status.lay.rank
    try:
        rundir.update_summary(**fields)
    except OSError:
        pass


def _die_with_launcher() -> None:
    """A worker of the local launcher never outlives it (no orphans when it is killed)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(os.environ.get("NOLOCO_LAUNCHER_PID", os.getppid())):
        os._exit(1)  # the launcher died before the line above took effect


if __name__ == "__main__":
    # A worker of the local launcher (noloco.launch): argv = the resolved config as JSON.
    _die_with_launcher()
    sys.exit(main(Config.from_dict(json.loads(sys.argv[1])),
                  resume=os.environ.get("NOLOCO_RESUME") == "1",
                  must_resume=os.environ.get("NOLOCO_RESUME_REQUIRED") == "1",
                  rundir_ready=os.environ.get("NOLOCO_RUNDIR_READY") == "1"))
