"""The training loop of one worker, and what a checkpoint of it holds.

Per inner step: forward/backward → the method's gradient sync → clip → AdamW → the method's
outer step (if due) → evaluate (if due) → checkpoint (if due). A checkpoint holds everything
the next step depends on, so a resumed run is bit-identical to one that never stopped (on
the same machine and thread count).

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from noloco import checkpoint as ckpt_mod
from noloco import data as data_mod
from noloco.comm import Communicator, flatten, unflatten_into
from noloco.config import Config, ConfigError, checkpoint_cadence, local_replicas
from noloco.distributed import DistContext, Layout, host_staged, make_comms
from noloco.errors import Interrupted
from noloco.faults import FaultInjector, parse_faults
from noloco.methods import build_method
from noloco.metrics import (
    Progress,
    TensorBoard,
    WandB,
    gather_metrics,
    gather_scalars,
    process_age_seconds,
    run_summary,
)
from noloco.model import Forward, autocast, build, count_params, lm_loss, preset
from noloco.optim import build_inner
from noloco.rundir import RunDir
from noloco.staging import HostStaged, upload
from noloco.token_cache import cached_corpus
from noloco.watchdog import Watchdog

STOP_PAUSE_SECONDS = 0.2
"""how long a worker asked to stop waits at a step boundary for the others' steps before it
takes one more step (one may be in a collective that needs this worker to go on)"""
STOP_AGREE_SECONDS = 10.0
"""how long the workers may take to agree on the step they stop at after a signal (they all
got it within a step: 3 steps where a step is longer); past it, they stop at once without a
checkpoint"""
STOP_AGREE_MAX_SECONDS = 20.0
"""and never longer: torchrun kills a worker 30 s after it asked it to stop"""
ABANDONED = -1
"""the stop step of workers that could not agree on one: stop at once"""


@dataclass(frozen=True)
class StopBoard:
    """Where the workers that must stop at one step agree on it (:meth:`Trainer.agree_stop_step`):
    a store key they all post to. A static run's workers, all of them (its store); an elastic
    replica's pipeline stages (the run's store; the replicas themselves stop alone)."""

    store: Any
    key: str
    members: int
    me: int
    """this worker's index among the ``members``; 0 speaks for them"""
    unreachable: tuple[type[BaseException], ...] = ()
    """what a store request raises when the store is out of reach (a partition): no answer
    yet, as while a member has not posted"""
STEADY_AFTER_STEPS = 3
"""steps of a process before its steady rate is measured (``summary.json``'s
``steady_tokens_per_second``, and the GPU's MFU): the first compile the model under
``--compile``, and warm the allocator and the kernels' autotuning"""

AVERAGED_METHODS = ("diloco", "noloco", "streaming", "sparseloco")
"""methods whose replicas end with different weights: their mean is saved as a model too"""


def lr_at(step: int, peak: float, warmup: int, total: int, floor_ratio: float = 0.1) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``peak·floor_ratio`` at ``total``
    (and that floor after it)."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def weights_checksum(params: list[torch.Tensor]) -> int:
    crc = 0
    for p in params:
        crc = zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


class LocalRunner:
    """One stage holds the whole model: forward and backward in this process."""

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None,
                 precision: str = "fp32", compile: bool = False) -> None:
        self.model = model
        self.forward = Forward(model, compile)
        self.activation_bytes = 0
        self.watchdog = None
        self.device = device or next(model.parameters()).device
        self.precision = precision

    def parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.named_parameters())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm before clipping, left on the device (reading it would wait for it)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, step: int,
                   scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one batch; its gradient, times ``scale``, is added to the
        parameters' (``1/K`` for each of K accumulated microbatches). The loss comes back as
        a tensor on the device: the loop reads it at the log interval, not every step (on a
        GPU a read waits for the step's kernels and the host stops running ahead)."""
        with autocast(self.device, self.precision):
            loss = lm_loss(self.forward(inputs), targets)
        (loss * scale if scale != 1.0 else loss).backward()
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        self.model.eval()
        # Weighted by sequences: the last batch may be smaller.
        with autocast(self.device, self.precision):
            total = sum(lm_loss(self.forward(x), y).item() * len(x) for x, y in batches)
        self.model.train()
        return total / sum(len(x) for x, _ in batches)

    def state_dict(self) -> dict[str, Any]:
        return {"activation_bytes": self.activation_bytes}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.activation_bytes = sd["activation_bytes"]


@dataclass
class LoopState:
    """The run's own counters: checkpointed, so a resumed run reports as if it never stopped."""

    step: int = 0
    compute_s: float = 0.0
    eval_s: float = 0.0
    peak_step_bytes: int = 0
    last_train: list[float] = field(default_factory=list)
    """training losses since the last evaluation (read from the device in batches:
    :meth:`Trainer.train_losses`)"""
    metric_lines: int = 0
    """lines of metrics.jsonl written so far (rank 0)"""
    last_eval_step: int = -1
    loop_s: float = 0.0
    """wall seconds in the training loop so far"""
    wall_s: float = 0.0
    """wall seconds of the run so far, start-up included"""


def make_checkpointer(cfg: Config, root: Path, rank: int, world: int, store: Any = None
                      ) -> ckpt_mod.Checkpointer:
    """The checkpointer of ``--checkpoint-every`` (steps, or a duration aligned to the outer
    step)."""
    t = cfg.train
    steps, seconds = checkpoint_cadence(t.checkpoint_every if t.checkpoint_every is not None
                                        else 0)
    return ckpt_mod.Checkpointer(root, rank, world, cfg.math_hash(), steps, t.keep_checkpoints,
                                 store=store, every_seconds=seconds,
                                 align=cfg.method.sync_every or 1)


class Elastic(Protocol):
    """What an elastic run adds to the trainer, asked at a few points of the one loop
    (:class:`noloco.elastic.worker.ElasticReplica`); None in a static run."""

    membership: Any
    """its :class:`noloco.elastic.Membership` (heartbeats carry the step)"""

    def attach(self, trainer: Trainer) -> None:
        """The trainer it serves, once every piece of it is built."""

    def make_comms(self, cfg: Config, device: torch.device, staged: bool
                   ) -> tuple[Communicator, Communicator]:
        """(the method's communicator, the metrics communicator)"""

    def pipeline_layout(self, lay: Layout) -> Layout:
        """The layout a replica's pipeline stages run in."""

    def checkpoint_root(self) -> Path:
        """Where this replica (stage) saves its own checkpoints."""

    def gather_stages(self, x: int) -> list[int]:
        """Every stage's ``x`` of this replica (collective over its stages): they resume
        from one step (:func:`noloco.checkpoint.agree_on_step`)."""

    def between_steps(self) -> None:
        """Before every inner step: serve joins, heal (may move the step)."""

    def record(self, step: int, val: float | None, losses: list[float], log: Progress
               ) -> dict[str, Any]:
        """An evaluation's record, kept by this replica alone."""

    def end(self, rec: dict[str, Any]) -> dict[str, Any]:
        """After the final evaluation ``rec``: the replica's own weights and summary."""

    def stop_board(self) -> StopBoard | None:
        """Where this replica's stages agree on the step they stop at after a signal; None:
        it stops alone (one stage)."""


class Trainer:
    """One worker's training: the pieces, the loop, and what a checkpoint holds. ``elastic``:
    the component of an elastic replica (:class:`Elastic`), None in a static run."""

    def __init__(self, cfg: Config, lay: Layout, device: torch.device, threads: int,
                 rundir: RunDir, ctx: DistContext, status: Any,
                 elastic: Elastic | None = None) -> None:
        m, d, o, t = cfg.method, cfg.data, cfg.optim, cfg.train
        self.cfg, self.lay, self.device, self.threads = cfg, lay, device, threads
        self.rundir, self.ctx = rundir, ctx
        self.elastic = elastic
        self.status = status
        """the worker's :class:`noloco.worker.WorkerStatus` (its spec, :mod:`noloco.spec`):
        the loop keeps its step current"""
        self.t_start = time.perf_counter()
        self.import_seconds = process_age_seconds()
        """from this process's start to here: mostly importing torch"""
        tokenizer = data_mod.make_tokenizer(d.tokenizer)
        # the machine's token file, mapped (tokenised here only if no one has yet)
        corpus, self.corpus_load = cached_corpus(d.data, tokenizer, d.seq_len, d.max_tokens,
                                                 allow_binary=d.allow_binary)
        self.corpus_private_bytes = sum(a.nbytes for a in (corpus.train, corpus.val)
                                        if not isinstance(a, np.memmap))
        self.first_step_seconds: float | None = None
        """from this process's start to the end of its first inner step"""
        self.steady_from: tuple[int, float] | None = None
        """(step, training seconds so far) once this process has done
        :data:`STEADY_AFTER_STEPS` steps: the steady rate is measured from there"""
        self.reader = data_mod.ShardedReader(corpus.train, d.seq_len, d.batch_size, lay.replica,
                                             lay.replicas, seed=t.seed)
        self.val = [(x.to(device), y.to(device)) for x, y in data_mod.validation_batches(
            corpus.val, d.seq_len, t.eval_sequences, d.batch_size)]
        self.tokenizer_name = tokenizer.name
        if cfg.model.hf_model is not None:
            from noloco import hf

            model = hf.build(cfg.model.hf_model, seed=t.seed, device=device)
            vocab = int(model.config.vocab_size)
            if tokenizer.vocab_size > vocab:
                raise data_mod.DataError(
                    f"the tokenizer has {tokenizer.vocab_size} tokens but --hf-model "
                    f"{cfg.model.hf_model} only {vocab} embeddings")
            self.args: Any = None
            n_layers = hf.n_layers(model.config)
        else:
            self.args = preset(cfg.model.preset, vocab_size=tokenizer.vocab_size,
                               dropout=cfg.model.dropout)
            model = build(self.args, device=device, seed=t.seed)
            n_layers = self.args.n_layers
        self.model_module = model
        self.n_params_total = count_params(model)
        self.membership = elastic.membership if elastic is not None else None
        self.comm, self.world = self.make_comms()
        self.host_staged = isinstance(self.comm, HostStaged) or isinstance(self.world, HostStaged)
        """whether this worker's traffic goes through host copies (noloco.staging)"""
        if lay.stages > 1:
            from noloco.pipeline import PipelineRunner
            self.runner: Any = PipelineRunner(
                model, cfg, elastic.pipeline_layout(lay) if elastic is not None else lay,
                device)
        else:
            self.runner = LocalRunner(model, device, t.precision, t.compile)
        self.params = self.runner.parameters()
        # Named parameters let streaming methods cut fragments by block (global block names).
        self.method = build_method(m, self.runner.named_parameters(), self.comm, seed=t.seed,
                                   n_layers=n_layers, backward_passes=o.grad_accum)
        self.inner = build_inner(self.runner.named_parameters(), o.inner_optimizer, o.lr,
                                 (o.beta1, o.beta2), o.weight_decay)
        torch.manual_seed(t.seed * 1009 + lay.rank)  # dropout differs per worker, on purpose
        self.watchdog = None
        self.tensorboard: TensorBoard | None = None
        self.wandb: WandB | None = None
        if ctx.store is not None:
            self.watchdog = Watchdog(ctx.store, lay.rank, ctx.attempt, lay.describe,
                                     m.stall_warning).start()
            for c in (self.comm, self.world, self.runner):
                c.watchdog = self.watchdog
        if elastic is not None:
            elastic.attach(self)  # (the pieces it reads are built)
            self.ckpt = make_checkpointer(cfg, elastic.checkpoint_root(), 0, 1)
        else:
            self.ckpt = make_checkpointer(cfg, rundir.path / "checkpoints", lay.rank,
                                          lay.world, ctx.store)
        self.state = LoopState()
        self.unread_losses: list[Any] = []
        """training losses of the steps since they were last read: device tensors (a
        pipeline's last stage: numbers)"""
        self.resumed_from: int | None = None
        self.stop_step: int | None = None
        self.speaker = local_replicas(t.replica_ids, lay.replicas)[0]
        """the replica that speaks for this machine (replica 0 where it runs here): its first
        stage prints the evaluations and the end, its last stage (the loss) the progress"""
        """the step every worker stops at after a SIGINT/SIGTERM (once they agreed on it)"""
        self.t_loop = time.perf_counter()
        self.tokens_per_step = d.batch_size * d.seq_len * o.grad_accum
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)

    def accumulate(self, step: int) -> float | None:
        """The inner step's gradient: the mean over ``--grad-accum`` microbatches, each read
        in turn (the reader's position counts microbatches, so a resume stays bit-exact) and
        weighted 1/K — equal microbatches make it the gradient of their concatenation. The
        method syncs once, after the last (DDP: one all-reduce per inner step)."""
        k = self.cfg.optim.grad_accum
        losses = []
        scale = () if k == 1 else (1.0 / k,)  # a pipeline runner takes no scale (k is 1)
        for _ in range(k):
            inputs, targets = self.reader.next_batch()
            losses.append(self.runner.train_step(upload(inputs, self.device),
                                                 upload(targets, self.device), step, *scale))
        if losses[0] is None:  # a pipeline stage before the last: no loss here
            return None
        return sum(losses) / k

    def make_comms(self) -> tuple[Communicator, Communicator]:
        """(the method's communicator, the metrics communicator over all workers)"""
        staged = host_staged(self.device, self.lay.local_world, self.status.spec.host_staging)
        if self.elastic is not None:
            return self.elastic.make_comms(self.cfg, self.device, staged)
        return make_comms(self.cfg, self.lay, self.device if staged else None)

    # ---- checkpoints ------------------------------------------------------------------------
    def mfu_terms(self) -> dict[str, float | None]:
        """On GPUs of known peak, with noloco's own model: the training FLOPs per token and
        the peak FLOP/s of every GPU the run's workers use (noloco.footprint), else Nones."""
        from noloco import distributed, footprint

        none: dict[str, float | None] = {"flops_per_token": None, "peak_flops": None}
        if self.device.type != "cuda" or self.args is None:
            return none
        peak = footprint.peak_flops(torch.cuda.get_device_name(self.device),
                                    self.cfg.train.precision)
        if peak is None:
            return none
        a = self.args
        gpus = -(-self.lay.world // max(1, distributed.workers_per_gpu(self.lay.local_world)))
        return {"flops_per_token": float(footprint.flops_per_token(
                    self.n_params_total, a.n_layers, a.dim, a.vocab_size, self.cfg.data.seq_len)),
                "peak_flops": peak * gpus}

    def train_losses(self) -> list[float]:
        """The training losses since the last evaluation, as numbers: those still on the
        device are read now, together (one wait)."""
        if self.unread_losses:
            tensors = [x.float() for x in self.unread_losses if isinstance(x, torch.Tensor)]
            read = iter(torch.stack(tensors).tolist() if tensors else [])
            self.state.last_train.extend(next(read) if isinstance(x, torch.Tensor) else float(x)
                                         for x in self.unread_losses)
            self.unread_losses.clear()
        return self.state.last_train

    def capture(self) -> dict[str, Any]:
        """Everything the next inner step depends on (live tensors: the checkpointer copies)."""
        self.train_losses()
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

    def agree_max(self, x: float) -> float:
        """The max of every checkpointing worker's ``x`` (collective over the checkpointer's
        world: the run's workers; an elastic replica alone)."""
        if self.ckpt.world == 1:
            return x
        return max(float(v) for v in self.world.all_gather(torch.tensor([x],
                                                                      dtype=torch.float64)))

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
        """Continue from the newest checkpoint every worker of the checkpointer's world holds
        whole (collective over it: the run's workers; an elastic replica's stages, each from
        its own checkpoints)."""
        root = self.ckpt.root

        def gather(x: int) -> list[int]:
            if self.elastic is not None:
                return self.elastic.gather_stages(x)
            if self.ckpt.world == 1:
                return [x]
            return [int(v) for v in self.world.all_gather(torch.tensor([x]))]

        def report(msg: str) -> None:
            print(f"noloco: {self.lay.describe(self.lay.rank)}: {msg}", file=sys.stderr,
                  flush=True)

        step, sd = ckpt_mod.agree_on_step(root, self.ckpt.rank, self.cfg.math_hash(), gather,
                                          report)
        if step is None:
            if required:
                raise ConfigError(f"no complete checkpoint in {root} to resume from")
            if self.lay.rank == 0 and self.elastic is None:
                self.rundir.truncate_metrics(0)  # a restart before any checkpoint: anew
            return
        if step >= self.cfg.train.steps and required:
            raise ConfigError(f"the run in {self.rundir.path} already reached step {step}: "
                              f"pass --steps above it to train further")
        self.restore(sd)
        self.resumed_from = step
        self.ckpt.saved_step = step  # on disk already: a stop right here saves nothing new
        if self.elastic is not None:  # its own metrics file: a step's newest record counts
            print(f"noloco: replica {self.lay.replica}"
                  f"{f' stage {self.lay.stage}' if self.lay.stages > 1 else ''}: resuming "
                  f"from step {step}", file=sys.stderr, flush=True)
        elif self.lay.rank == 0:
            self.rundir.truncate_metrics(self.state.metric_lines)
            print(f"noloco: resuming from {root.name}/{ckpt_mod.step_dir(root, step).name} "
                  f"(step {step}){self.redone(step)}", file=sys.stderr, flush=True)

    def redone(self, step: int) -> str:
        """The steps past the checkpoint of ``step`` that the run had already trained (its
        summary's last step, read before this start overwrites it): trained again now."""
        try:
            reached = int(self.rundir.read_summary().get("last_step") or 0)
        except (OSError, ValueError, TypeError, AttributeError):
            return ""
        if reached <= step:
            return ""
        n = reached - step
        return (f"; the run had reached step {reached}: {n} step{'s' * (n > 1)} "
                f"({step + 1}-{reached}) will be redone")

    # ---- evaluation -------------------------------------------------------------------------
    def evaluate(self, step: int, log: Progress) -> dict[str, Any]:
        e0 = time.perf_counter()
        st = self.state
        mine = self.runner.eval_loss(self.val)  # None on a stage before the last
        losses = self.train_losses()
        if self.elastic is not None:
            rec = self.elastic.record(step, mine, losses, log)  # this replica's alone
        else:
            rec = self.record(step, mine, losses, log)
        st.metric_lines += 1
        st.last_eval_step = step
        st.last_train.clear()
        st.eval_s += time.perf_counter() - e0
        return rec

    def record(self, step: int, mine: float | None, losses: list[float], log: Progress
               ) -> dict[str, Any]:
        """The run's evaluation record, gathered from every worker (collective); rank 0
        appends it to metrics.jsonl and the loggers."""
        train_loss = sum(losses) / len(losses) if losses else float("nan")
        rec = gather_metrics(self.lay, self.world, self.comm, mine, train_loss, self.params,
                             self.runner)
        rec.update(step=step, tokens=step * self.tokens_per_step * self.lay.replicas,
                   tokens_per_replica=step * self.tokens_per_step,
                   wall_seconds=self.loop_seconds())
        if self.lay.rank == 0:
            self.rundir.append_metrics(rec)
            if self.cfg.train.tensorboard:
                if self.tensorboard is None:  # the first evaluation of this (resumed) run
                    self.tensorboard = TensorBoard(str(self.cfg.train.out), start_step=step)
                self.tensorboard.log(rec)
            if self.cfg.train.wandb:
                if self.wandb is None:
                    self.wandb = WandB(str(self.cfg.train.out), self.cfg.to_dict(), step)
                self.wandb.log(rec)
            log.eval_line(rec)
        return rec

    def publish_step(self) -> None:
        """A heartbeat now, with the step reached (the beat threads lag by up to an
        interval): before an injected kill, so the launcher names the step the worker did."""
        if self.watchdog is not None:
            self.watchdog.publish()
        if self.membership is not None:
            self.membership.nudge()

    # ---- training -----------------------------------------------------------------------------
    def train(self) -> dict[str, Any] | None:
        cfg, lay, st = self.cfg, self.lay, self.state
        o, t = cfg.optim, cfg.train
        faults = FaultInjector(parse_faults(t.inject_fault, lay.replicas, lay.stages),
                               lay.replica, lay.stage, lay.rank,
                               once=self.ctx.attempt == 0 and self.resumed_from is None,
                               publish=self.publish_step)
        log = Progress(enabled=lay.rank == lay.global_rank(self.speaker, 0), total=t.steps,
                       log_every=t.log_every, start=st.step,
                       show_steps=lay.rank == lay.global_rank(self.speaker, lay.stages - 1),
                       **self.mfu_terms())
        running = {"status": "running", "last_step": st.step, "attempt": self.ctx.attempt,
                   "resumed_from_step": self.resumed_from, "updated_at": time.time()}
        if lay.rank == 0:
            self.rundir.write_summary(running)
        # A stop waits for the step boundary, where a checkpoint holds the whole state: alone,
        # or under a launcher that signals every worker, ours or torchrun (the workers agree
        # on the step in its store). Elsewhere a signal may reach some workers only.
        # An elastic replica stops on its own: it saves its own step (a resume takes each
        # replica's own newest checkpoint); its pipeline stages agree on that step (the
        # launcher signals every one).
        elastic = self.elastic is not None
        self.status.graceful = elastic or lay.world == 1 or (
            self.ctx.store is not None
            and (self.status.spec.supervised or "TORCHELASTIC_RUN_ID" in os.environ))
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
        self.ckpt.start(st.step, self.loop_seconds())
        done_here = 0  # steps of this process
        while st.step < t.steps:
            if self.elastic is not None:
                self.elastic.between_steps()  # may move the step (a replica catching up)
            if st.step >= t.steps:
                break
            step = st.step
            s0 = time.perf_counter()
            lr = lr_at(step, o.lr, o.warmup, o.schedule_steps)
            for g in inner.param_groups:
                g["lr"] = lr
            loss = self.accumulate(step)
            sync0, bytes0 = comm.sync_seconds, comm.bytes_sent
            method.sync_gradients()
            if o.grad_clip > 0:
                runner.clip_grad_norm_(o.grad_clip)
            inner.step()
            inner.zero_grad(set_to_none=True)
            faults.pace(time.perf_counter() - s0)
            c1, blocked = time.perf_counter(), comm.sync_seconds - sync0
            st.step = self.status.step = step + 1
            if self.first_step_seconds is None:
                self.first_step_seconds = process_age_seconds()
            done_here += 1
            if self.steady_from is None and done_here == STEADY_AFTER_STEPS:
                self.steady_from = (st.step, self.loop_seconds() - st.eval_s)
            for beat in (self.watchdog, self.membership):
                if beat is not None:
                    beat.step = st.step
            method.after_inner_step()
            guard = method.guard
            if guard is not None and guard.restart_inner:
                # Its own update was bad (NaN, huge): it took the synced weights, and the
                # inner optimizer's state, poisoned by the same gradients, starts afresh.
                inner.reset()
                guard.restart_inner = False
                print(f"noloco: replica {lay.replica} (stage {lay.stage}): its own update "
                      f"was rejected at step {st.step}; it took the synced weights and "
                      f"restarted its inner optimizer", file=sys.stderr, flush=True)
            st.peak_step_bytes = max(st.peak_step_bytes, comm.bytes_sent - bytes0)
            # Inner-step compute excludes the seconds blocked in the method's communication
            # before c1; blocking inside after_inner_step (outer steps) lies outside (c1 - s0).
            st.compute_s += (c1 - s0) - blocked
            if loss is not None:
                self.unread_losses.append(loss)
            log.step(st.step, loss, self.tokens_per_step * lay.replicas)
            last = st.step == t.steps
            if st.step % t.eval_every == 0 and not last:
                self.evaluate(st.step, log)
            if self.ckpt.due(st.step) or (last and self.ckpt.enabled):
                self.ckpt.save(st.step, self.capture())
            self.ckpt.plan(st.step, self.loop_seconds(), self.agree_max)
            self.ckpt.poll()
            faults.after_step(st.step, self.params, self.comm)
            if lay.rank == 0 and (last or (t.log_every > 0 and st.step % t.log_every == 0)
                                  or st.step % t.eval_every == 0
                                  or self.ckpt.saved_step == st.step):
                # `noloco status` and other terminals read the step from here
                running.update(last_step=st.step, updated_at=time.time())
                self.rundir.write_summary(running)
            if self.status.stop_signal is not None and st.step < t.steps:
                self.stop_step = self.stop_step or self.agree_stop_step()
                if self.stop_step is None and time.monotonic() - self.status.signalled_at \
                        > min(max(STOP_AGREE_SECONDS, 3 * (c1 - s0)), STOP_AGREE_MAX_SECONDS):
                    # Not every worker got the signal (one died, and torchrun stops the
                    # rest to restart them): no common step to save. Said in the key, so a
                    # worker that posts later stops at once too instead of saving alone.
                    self.stop_step = self.agree_stop_step(abandon=True)
                if self.stop_step == ABANDONED:
                    raise Interrupted(self.status.stop_signal)
                if self.stop_step is not None and st.step >= self.stop_step:
                    self.stop_here()
        self.status.graceful = False
        return self.end(log)

    def stop_board(self) -> StopBoard | None:
        """Where this worker agrees with others on its stop step; None: it stops alone."""
        if self.elastic is not None:
            return self.elastic.stop_board()
        if self.lay.world == 1 or self.ctx.store is None:
            return None
        return StopBoard(self.ctx.store, f"noloco/stop/{self.ctx.attempt}", self.lay.world,
                         self.lay.rank)

    def agree_stop_step(self, abandon: bool = False) -> int | None:
        """The step every worker stops at after a SIGINT/SIGTERM, or None while not all of
        them have said how far they are (call again at the next step boundary). ``abandon``:
        fix it as :data:`ABANDONED` (stop at once, no checkpoint) unless it is fixed already.

        Every worker of the board (:meth:`stop_board`) posts the step it is at into one store
        key (a compare-and-set, so the posts and the decision are in one order). The post that
        completes the set fixes the stop step: the largest posted. A worker waits a little at
        its boundary for the others; past that it posts the next step *before* taking it, so
        no worker is ever beyond a step it posted, and none can pass the stop step. Those
        behind train up to it: every collective they still need, the workers ahead of them
        have already entered (an elastic replica's operations with other replicas wait for
        nobody that stopped). A store out of reach at the moment answers None (not known
        yet): asked again at the next boundary, on a renewed connection. A worker that
        cannot post abandons nothing alone — the others would train on into a step it never
        takes — so where the store stays out of reach, none agrees, and the launcher's
        second signal stops them all at once."""
        board = self.stop_board()
        if board is None:
            return self.state.step
        try:
            return self._agree_on(board, abandon)
        except board.unreachable:
            return None

    def _agree_on(self, board: StopBoard, abandon: bool) -> int | None:
        step, store, key = self.state.step, board.store, board.key

        def post(at: int | None) -> int | None:
            while True:
                raw = store.get(key) if store.check([key]) else b""
                posts = json.loads(raw) if raw else {}
                if "stop_at" in posts:
                    return int(posts["stop_at"])
                if abandon:
                    posts["stop_at"] = ABANDONED
                elif at is None:
                    return None
                else:
                    posts[str(board.me)] = at
                if not abandon and len(posts) == board.members:
                    posts["stop_at"] = max(posts.values())
                new = json.dumps(posts).encode()
                if store.compare_set(key, raw.decode(), new.decode()) == new:
                    return posts.get("stop_at")

        if abandon:
            return post(None)
        found = post(step)
        deadline = time.monotonic() + STOP_PAUSE_SECONDS
        while found is None and time.monotonic() < deadline:
            time.sleep(0.01)
            found = post(None)
        return found if found is not None else post(step + 1)

    def stop_here(self) -> None:
        """Stop at this step boundary (the agreed stop step): its checkpoint first, so that
        ``--resume`` continues from here (every worker saves the same step)."""
        self.status.graceful = False  # a second signal from here on stops at once
        st = self.state
        if self.ckpt.enabled:
            if self.ckpt.saved_step != st.step:  # else this step's own is being written
                self.ckpt.save(st.step, self.capture())
            self.ckpt.wait()
            board = self.stop_board()
            if board is not None:
                # The first member speaks for the others (rank 0 under torchrun): its line
                # advises the resume only once every member's checkpoint of this step is
                # complete, not while one is still being written or trained up to.
                key = f"{board.key}/saved"
                with contextlib.suppress(*board.unreachable):
                    board.store.add(key, 1)
                    deadline = time.monotonic() + STOP_AGREE_MAX_SECONDS
                    while (board.me == 0 and int(board.store.add(key, 0)) < board.members
                           and time.monotonic() < deadline):
                        time.sleep(0.05)
        raise Interrupted(self.status.stop_signal or 2)

    def end(self, log: Progress) -> dict[str, Any] | None:
        """After the last inner step: the last checkpoint, the final evaluation, the weights
        and the summary."""
        lay, t, method = self.lay, self.cfg.train, self.method
        w0 = time.perf_counter()
        self.ckpt.wait()  # the last checkpoint is on disk before the run says it completed
        self.ckpt.final_wait_seconds = time.perf_counter() - w0
        method.finish()
        rec = self.evaluate(t.steps, log)
        log.close()
        if self.elastic is not None:
            return self.elastic.end(rec)  # its own weights and summary
        self.save_final_weights()  # ends with a barrier: every checkpoint write is done
        self.ckpt.prune()
        summary = run_summary(self, rec)
        if lay.rank == 0:
            self.rundir.write_summary(summary)
            log.final(summary, str(t.out), self.cfg.optim.schedule_steps)
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
            hf_config = (self.model_module.config.to_dict() if self.args is None else None)
            ckpt_mod.write_model_index(self.rundir.path, self.args, names, lay.stages, {
                "hf_config": hf_config,
                "tokenizer": cfg.data.tokenizer, "tokenizer_name": self.tokenizer_name,
                "preset": cfg.model.preset, "step": self.state.step,
                "method": cfg.method.method})

    def close(self, ok: bool) -> None:
        for logger in (self.tensorboard, self.wandb):
            if logger is not None:
                logger.close()
        try:
            self.ckpt.close(wait=ok)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()


def check_identical_start(params: list[torch.Tensor], lay: Layout, world: Communicator
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
