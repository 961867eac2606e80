"""Run-level numbers: evaluation gathering, weight spread, scalars over workers, progress lines.

Everything here runs on the *metrics* communicator (the whole world) — except the weight
spread with pipeline stages, which averages each stage over its replicas on the method's stage
group inside ``uncounted()`` — so a run's reported training bytes and blocked seconds stay
exactly what the method sent and waited for.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from noloco.comm import Communicator
from noloco.config import Config
from noloco.errors import plural

if TYPE_CHECKING:
    from noloco.distributed import Layout


class Runner(Protocol):
    """What runs a worker's passes (:class:`noloco.train.LocalRunner`,
    :class:`noloco.pipeline.PipelineRunner`), as its metrics read it."""

    activation_bytes: int
    """what it sent to other stages in training (none without stages)"""


def gather_metrics(lay: Layout, world: Communicator, comm: Communicator, val_loss: float | None,
                   train_loss: float | None, params: list[torch.Tensor], runner: Runner
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
        "train_loss": mean(train),
        "val_loss": mean(val),
        "val_loss_per_replica": val,
        "bytes_sent": mean(per_replica_bytes),
        "bytes_sent_per_replica": mean(per_replica_bytes),
        "bytes_sent_by_replica": per_replica_bytes,
        "activation_bytes": mean(act),
        "sync_seconds": mean(per_replica_sync),
        "sync_seconds_by_replica": per_replica_sync,
        "weight_spread": weight_spread(params, lay, world, comm),
    }


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


SPREAD_CHUNK = 1 << 24
"""values per piece of :func:`weight_spread`'s float64 work (128 MB)"""


@torch.no_grad()
def weight_spread(params: list[torch.Tensor], lay: Layout, world: Communicator,
                  stage_comm: Communicator | None = None, chunk: int = SPREAD_CHUNK) -> float:
    """sqrt( Σ_params (p − mean over replicas)² / (#params · N) ), all stages together.

    Two reductions instead of gathering every replica's weights: the mean over replicas of
    each parameter, then the squared deviations summed — 2·S per rank and O(S) memory
    whatever N, which matters on slow links and for large models. Each stage's mean is taken
    over that stage's replicas through the method's own communicator (``stage_comm``, its
    accounting left untouched; needed with stages), then the scalars are summed over the
    world. (Not the world's group for the means: on NCCL its kernels could run beside a sync
    still in flight on the method's group (τ > 0), and two communicators' kernels at once can
    deadlock; on the method's own group they queue behind the sync.)

    The float64 work goes ``chunk`` values at a time (one all-reduce each; every replica of a
    stage cuts its parameters alike): its memory is two chunks, not four float64 copies of the
    model, which on a GPU would be 16 bytes a parameter at an evaluation."""
    if lay.replicas == 1:
        return 0.0
    if lay.stages > 1 and stage_comm is None:
        raise ValueError("weight_spread with stages needs the stage group")
    device = params[0].device if params else torch.device("cpu")
    means = stage_comm if stage_comm is not None else world
    sq = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for pieces in _chunks(params, chunk):
        n = sum(x.numel() for x in pieces)
        flat = torch.empty(n, dtype=torch.float64, device=device)
        at = 0
        for x in pieces:
            flat[at:at + x.numel()].copy_(x)
            at += x.numel()
        avg = flat.clone()
        with means.uncounted():
            means.all_reduce_mean(avg)
        sq += avg.sub_(flat).square_().sum()
        count += n
    mine = torch.tensor([float(sq), float(count)], dtype=torch.float64)
    rows = torch.stack(world.all_gather(mine))
    total = float(rows[:, 0].sum())
    n = sum(float(rows[lay.global_rank(0, s), 1]) for s in range(lay.stages))
    return math.sqrt(total / (n * lay.replicas))


def _chunks(params: list[torch.Tensor], size: int) -> Iterator[list[torch.Tensor]]:
    """The parameters' values in order, as lists of 1-D pieces of ``size`` values in all (the
    last list shorter); a parameter may be cut across two lists."""
    buf: list[torch.Tensor] = []
    n = 0
    for p in params:
        v = p.detach().reshape(-1)
        while v.numel():
            take = min(size - n, v.numel())
            buf.append(v[:take])
            n += take
            v = v[take:]
            if n == size:
                yield buf
                buf, n = [], 0
    if buf:
        yield buf


def gather_scalars(world: Communicator, lay: Layout, values: list[float],
                   how: str = "mean") -> list[float]:
    """``values`` of every worker reduced by ``how``: mean, max, sum, or stage_sum (one number
    per stage: the sum of replica 0's worker of that stage's values)."""
    v = torch.tensor(values, dtype=torch.float64)
    if lay.world == 1:
        return [float(x) for x in v]
    rows = torch.stack(world.all_gather(v))
    if how == "max":
        return [float(x) for x in rows.max(0).values]
    if how == "sum":
        return [float(x) for x in rows.sum(0)]
    if how == "stage_sum":
        return [float(rows[lay.global_rank(0, s)].sum()) for s in range(lay.stages)]
    return [float(x) for x in rows.mean(0)]


def gather_json(world: Communicator, lay: Layout, obj: Any) -> list[Any]:
    """``obj`` (JSON-able) of every worker, in rank order. Collective."""
    blob = json.dumps(obj).encode()
    if lay.world == 1:
        return [obj]
    size = int(gather_scalars(world, lay, [len(blob)], "max")[0])
    buf = torch.zeros(size + 8, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(blob)], dtype=torch.int64).view(torch.uint8)
    buf[8:8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = []
    for row in world.all_gather(buf):
        n = int(row[:8].view(torch.int64)[0])
        out.append(json.loads(bytes(row[8:8 + n].tolist())))
    return out


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _loss(x: float) -> str:
    """A loss in 6 characters: 2.3456, 12.346."""
    return f"{x:.4f}" if abs(x) < 9.99995 else f"{x:.3f}"


def short_bytes(n: float) -> str:
    """Bytes in at most 6 characters: 0 B, 980 B, 12 kB, 1.2 MB, 340 MB, 1.2 GB, 15 TB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 999.5 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" and n < 9.95 else f"{n:.0f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


class Progress:
    """A rich progress bar on a terminal; plain lines otherwise (logs, CI)."""

    WINDOW_SECONDS = 30.0
    """tokens/s and the time left are measured over about the last this many seconds: a run
    that slows down says so at once, not once the slowdown outweighs the whole run's average"""

    def __init__(self, enabled: bool, total: int, log_every: int = 10, start: int = 0,
                 show_steps: bool | None = None, clock: Callable[[], float] = time.perf_counter,
                 flops_per_token: float | None = None, peak_flops: float | None = None
                 ) -> None:
        """``enabled``: this worker prints the evaluation lines and the end of the run;
        ``show_steps`` (default: the same): it prints the per-step progress — with pipeline
        stages the worker that has the loss (replica 0's last stage). With
        ``flops_per_token`` and the ``peak_flops`` of the run's GPUs, the line shows the
        model FLOPs utilisation (noloco.footprint)."""
        self.enabled = enabled
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.bar_drawn = -math.inf
        self.show_steps = enabled if show_steps is None else show_steps
        self.log_every = log_every
        self.tty = self.show_steps and sys.stderr.isatty()
        self.total = total
        self.start = start
        self.clock = clock
        self.t0 = clock()
        self.tokens = 0
        self.recent: collections.deque[tuple[float, int, int]] = collections.deque(
            [(self.t0, start, 0)])
        """(time, step, tokens so far) of the recent steps: the window of WINDOW_SECONDS"""
        self.bar = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress
            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                    transient=True)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    BAR_SECONDS = 0.25
    """the bar is redrawn at most this often: each redraw reads the loss, which on a GPU
    waits for the step's kernels"""

    def step(self, step: int, loss: Any, tokens: int) -> None:
        """``loss``: a number, a tensor (read only when shown), or None."""
        if not self.show_steps:
            return
        self.tokens += tokens
        now = self.clock()
        self.recent.append((now, step, self.tokens))
        while len(self.recent) > 2 and now - self.recent[1][0] >= self.WINDOW_SECONDS:
            self.recent.popleft()
        if self.bar is not None:
            if now - self.bar_drawn < self.BAR_SECONDS and step < self.total:
                return
            self.bar_drawn = now
        elif not (self.log_every > 0 and step % self.log_every == 0):
            return
        then, then_step, then_tokens = self.recent[0]
        tps = (self.tokens - then_tokens) / max(now - then, 1e-9)
        pace = (now - then) / (step - then_step) if step > then_step else None
        info = f"{tps:,.0f} tok/s"
        if self.flops_per_token and self.peak_flops:
            info += f" | MFU {100 * tps * self.flops_per_token / self.peak_flops:.0f}%"
        if loss is not None:
            info = f"loss {float(loss):.3f} | {info}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        else:
            print(self.plain_line(step, info, now - self.t0, pace), flush=True)

    def plain_line(self, step: int, info: str, elapsed: float, pace: float | None = None
                   ) -> str:
        """Without a terminal: the step, percent done and time left — at ``pace`` (seconds
        per step over the recent window) when given, else at this run's pace since it
        started or resumed."""
        done = step - self.start
        pct = 100 * step / max(self.total, 1)
        per = pace if pace is not None else elapsed / done if done > 0 else None
        left = f" | {duration(per * (self.total - step))} left" if per is not None else ""
        return f"step {step:>6}/{self.total} ({pct:3.0f}%) | {info}{left}"

    def line(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(msg)
        else:
            print(msg, flush=True)

    def eval_line(self, rec: dict[str, Any], speaks: bool | None = None) -> None:
        """One line per evaluation, within 80 columns (a terminal's width; the time so far
        is the progress line's): the run's (the replicas' spread), or in an elastic run the
        speaking replica's own (its number instead). ``speaks``: this worker prints it
        (default: the worker that prints the evaluations)."""
        if not (self.enabled if speaks is None else speaks):
            return
        train = rec["train_loss"]
        train = "  —   " if train is None or train != train else _loss(train)  # none at step 0
        b = rec["sync_seconds"]
        who = (f"spread {rec['weight_spread']:.1e}" if "weight_spread" in rec
               else f"replica {rec['replica']:<3}")
        msg = (f"step {rec['step']:>5}  train {train}  val {_loss(rec['val_loss'])}  {who}  "
               f"sent {short_bytes(rec['bytes_sent'])}  blocked "
               + (f"{b:.1f}s" if b < 99.95 else f"{b:.0f}s"))
        if self.bar is not None:
            self.bar.console.print(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def final(self, summary: dict[str, Any], out: str, schedule_steps: int | None = None
              ) -> None:
        print(final_report(summary, out, schedule_steps), flush=True)


def final_report(s: dict[str, Any], out: str, schedule_steps: int | None = None,
                 local: int | None = None) -> str:
    """A short human summary of a completed run (its summary.json ``s``), static or elastic,
    and the next commands to try. ``schedule_steps``: where the run's learning-rate schedule
    ends (its --schedule-steps, which a resume cannot change). ``local``: an elastic run's
    replicas on this machine (default: all)."""
    el = s.get("elastic")
    per = [v for v in (s.get("final_val_loss_per_replica") or {}).values() if v is not None]
    spread = f" (replicas {min(per):.4f}–{max(per):.4f})" if len(per) > 1 else ""
    util = s.get("compute_utilisation")
    computing = (f" (computing {util:.1%} of the training loop's time)"
                 if util is not None else "")
    if el is None:
        stages = f" × {s['stages']} stages" if s["stages"] > 1 else ""
        outer = f", {s['outer_steps']} outer steps" if s.get("outer_steps") else ""
        head = (f"done: {s['method']}, {plural(s['replicas'], 'replica')}{stages}, "
                f"{s['steps']} steps{outer}")
        blocked = f"blocked {s['sync_seconds']:.2f} s"
        files = "summary.json, metrics.jsonl, config.json, model/, checkpoints/"
        if s.get("simulated"):
            head = head.replace("done: ", "done (simulated in one process): ", 1)
            blocked = "no network: blocked 0 s"
            files = "summary.json, metrics.jsonl, config.json, model/"
    else:
        n = s["replicas"] if local is None else local
        here = "" if n == s["replicas"] else " here"
        failures = s.get("failures") or []
        lost = f", {len(failures)} failure(s)" if failures else ""
        head = (f"done: elastic {s['method']}, {len(el['replicas_finished'])} of "
                f"{plural(n, 'replica')}{here} finished{lost}")
        most = max((v for v in (s.get("sync_seconds_per_replica") or {}).values()),
                   default=0.0)
        blocked = f"blocked up to {most:.2f} s"
        files = "summary.json, metrics/replica-K.jsonl, model/"
    lines = [
        f"{head} in {s['wall_seconds']:.1f} s",
        f"  validation loss {s['final_val_loss']:.4f}{spread}, weight spread "
        f"{s['weight_spread']:.2e}",
        f"  sent {(s.get('bytes_sent') or 0) / 1e6:,.1f} MB per replica, {blocked} in "
        f"communication{computing}",
        f"  files: {out}/ ({files})",
        f"  next: noloco report {out}   (a table and plots of this run, or of several)",
        f"        noloco netsim predict {out} --bandwidth 1Gbit --latency 50ms",
    ]
    if el is None and not s.get("simulated"):  # (a simulation keeps no checkpoints)
        lines.append(f"        {more_steps(out, s['steps'], schedule_steps)}")
    return "\n".join(lines)


def more_steps(out: str, steps: int, schedule_steps: int | None) -> str:
    """The advice on training a completed run further. A resume keeps the run's
    --schedule-steps (it is part of the run's math): past its end the learning rate stays at
    its floor (lr/10), which trains little, so the advice is the resume only while the
    schedule has steps left, and otherwise says what a resume would do and what does better."""
    if schedule_steps is not None and schedule_steps > steps:
        return (f"noloco train --resume {out} --steps {schedule_steps}   (to the end of its "
                f"learning-rate schedule, --schedule-steps {schedule_steps})")
    return (f"noloco train --resume {out} --steps {2 * steps} would train on at the final "
            f"learning rate (lr/10: the schedule ended at step {steps}); for {2 * steps} steps "
            f"train anew with --steps {2 * steps} --overwrite (or plan a pause ahead with "
            f"--schedule-steps)")


def summary_writer() -> Any:
    """TensorBoard's ``SummaryWriter`` class (the 'tb' extra), or a one-line ConfigError."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from noloco.config import ConfigError
        raise ConfigError("--tensorboard needs the 'tb' extra: "
                          "pip install 'noloco[tb]'") from None
    return SummaryWriter


def wandb_module() -> Any:
    """The ``wandb`` module (the 'wandb' extra), or a one-line ConfigError."""
    try:
        import wandb
    except ImportError:
        from noloco.config import ConfigError
        raise ConfigError("--wandb needs the 'wandb' extra: pip install 'noloco[wandb]'"
                          ) from None
    return wandb


def check_extras(tensorboard: bool, wandb: bool) -> None:
    """Import the loggers' extras that a run asks for, before anything is written: found
    missing at the first evaluation instead, a worker fails after the run directory was made,
    leaving its summary at status "running" and its --out refused to the next try."""
    if tensorboard:
        summary_writer()
    if wandb:
        wandb_module()


class TensorBoard:
    """Every metric of every evaluation as TensorBoard scalars in ``OUT/tensorboard/`` (rank
    0): losses (and each replica's validation loss), bytes, blocked seconds, weight spread,
    activation bytes, against the inner step. A resumed run purges the events after its
    checkpoint, as it rewrites metrics.jsonl."""

    SCALARS = ("train_loss", "val_loss", "bytes_sent", "sync_seconds", "weight_spread",
               "activation_bytes", "tokens", "wall_seconds")

    def __init__(self, out: str, start_step: int = 0) -> None:
        self.writer = summary_writer()(str(Path(out) / "tensorboard"),
                                       purge_step=start_step or None)

    def log(self, rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        for key in self.SCALARS:
            v = rec.get(key)
            if v is not None and v == v:  # no NaN (no training loss at step 0)
                self.writer.add_scalar(key, float(v), step)
        for r, v in enumerate(rec.get("val_loss_per_replica") or []):
            if v is not None and v == v:
                self.writer.add_scalar(f"val_loss_per_replica/{r}", float(v), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """The same metrics as :class:`TensorBoard`, into a Weights & Biases run in offline mode
    under ``OUT/wandb/`` (rank 0): nothing leaves the machine; ``wandb sync OUT/wandb/offline-*``
    uploads it later if the user wants to."""

    def __init__(self, out: str, config: dict[str, Any], start_step: int = 0) -> None:
        wandb = wandb_module()
        self.wandb = wandb
        self.run = wandb.init(mode="offline", dir=str(out), project="noloco",
                              name=Path(out).name, config=config, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        self.start_step = start_step

    def log(self, rec: dict[str, Any]) -> None:
        row = {k: float(rec[k]) for k in TensorBoard.SCALARS
               if rec.get(k) is not None and rec[k] == rec[k]}
        for r, v in enumerate(rec.get("val_loss_per_replica") or []):
            if v is not None and v == v:
                row[f"val_loss_per_replica/{r}"] = float(v)
        row["step"] = int(rec["step"])
        self.run.log(row)

    def close(self) -> None:
        self.run.finish()


def gpu_summary(trainer: Any, tokens_per_second: float, peak: float) -> dict[str, Any]:
    """Where the workers trained, what they held on the GPU, and the model FLOPs
    utilisation: steady tokens/s (from each process's third step: no compilation in it) ×
    training FLOPs per token ÷ the peak FLOP/s of the run's GPUs (noloco.footprint:
    6·N + 12·L·d·s per token; the vendor's dense peak at the precision).
    ``peak``: the most GPU memory any worker allocated (gathered by the caller)."""
    from noloco import distributed, footprint

    lay = trainer.lay
    shape = (footprint.model_shape(trainer.cfg, trainer.args.vocab_size)
             if trainer.args is not None else None)
    est = footprint.estimate(trainer.cfg, *shape).total if shape is not None else None
    terms = trainer.mfu_terms()
    return {"name": torch.cuda.get_device_name(trainer.device),
            "gpus": distributed.cuda_devices(),
            "workers_per_gpu": distributed.workers_per_gpu(lay.local_world),
            "host_staged": trainer.host_staged,
            "peak_memory_bytes": int(peak),
            "estimated_bytes_per_worker": est,
            "flops_per_token": terms["flops_per_token"],
            "peak_flops": terms["peak_flops"],
            "mfu": (tokens_per_second * terms["flops_per_token"] / terms["peak_flops"]
                    if terms["peak_flops"] else None)}


def _peak_rss_bytes() -> float:
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux: /proc), else None."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def startup_summary(trainer: Any) -> dict[str, Any]:
    """Where start-up time went, per worker process (collective). ``tokenize_seconds`` sums
    the seconds every worker spent tokenising (0 for a worker that mapped the machine's token
    file; the launcher's own share is added by the launcher); ``import_seconds`` is the most
    any worker took from its start to building its trainer (importing torch, mostly)."""
    load = trainer.corpus_load
    lay = trainer.lay
    mem = _memory()
    vals = [float(load.tokenized), load.seconds if load.tokenized else 0.0, load.seconds,
            trainer.import_seconds or 0.0, trainer.first_step_seconds or 0.0,
            float(trainer.corpus_private_bytes), mem.get("Pss", 0.0), mem.get("Rss", 0.0)]
    total = [v * lay.world for v in gather_scalars(trainer.world, lay, vals)]
    peak = gather_scalars(trainer.world, lay, vals, "max")
    return {"workers": lay.world, "workers_tokenized": round(total[0]),
            "tokenize_seconds": total[1], "corpus_seconds": total[2],
            "import_seconds_max": peak[3] if trainer.import_seconds is not None else None,
            "first_step_seconds_max": peak[4] if trainer.first_step_seconds else None,
            # the corpus's tokens held privately (not a shared mapping of the token file)
            "corpus_private_bytes_sum": int(total[5]),
            # at the end of the run, summed over workers (Linux; 0 elsewhere): shared pages
            # count once in the PSS sum, once per process in the RSS sum
            "pss_bytes_sum": int(total[6]), "rss_bytes_sum": int(total[7]),
            "token_cache": load.path}


def _memory() -> dict[str, float]:
    """This process's resident (Rss) and proportional (Pss) set sizes in bytes (Linux)."""
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 3 and parts[0].rstrip(":") in ("Rss", "Pss") and parts[2] == "kB":
            out[parts[0].rstrip(":")] = float(parts[1]) * 1024
    return out


def shared_summary(cfg: Config, per_replica: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The keys of every completed run's summary.json, static or elastic (one key set,
    :data:`noloco.rundir.SUMMARY_FORMAT`): the run's settings, and from ``per_replica`` (each
    replica that finished: its final ``val_loss``, ``bytes_sent`` and ``sync_seconds``) the
    numbers of each, keyed by replica id, and their means. A static run adds its collective
    measurements (:func:`run_summary`), an elastic one its section
    (:func:`noloco.elastic.worker.combine`)."""
    from noloco.checkpoint import MODEL_DIR
    from noloco.rundir import SUMMARY_FORMAT

    m, o, t = cfg.method, cfg.optim, cfg.train
    ids = sorted(per_replica)

    def by(key: str) -> dict[str, Any]:
        return {str(r): per_replica[r][key] for r in ids}

    def avg(key: str) -> float | None:
        # a replica's loss that was not finite reads back from JSON as null: NaN, as in the
        # mean of a static run
        return mean([math.nan if per_replica[r][key] is None else per_replica[r][key]
                     for r in ids]) if ids else None

    return {
        "format": SUMMARY_FORMAT, "status": "completed", "method": m.method,
        "replicas": m.replicas, "stages": m.stages, "steps": t.steps,
        "sync_every": m.sync_every,
        "final_val_loss": avg("val_loss"), "final_val_loss_per_replica": by("val_loss"),
        # one replica's bytes and blocked seconds (the mean over the replicas), and each's
        "bytes_sent": avg("bytes_sent"), "bytes_sent_per_replica": by("bytes_sent"),
        "sync_seconds": avg("sync_seconds"), "sync_seconds_per_replica": by("sync_seconds"),
        "precision": t.precision, "grad_accum": o.grad_accum,
        "inner_optimizer": o.inner_optimizer, "model_dir": MODEL_DIR,
    }


def run_summary(trainer: Any, rec: dict[str, Any]) -> dict[str, Any]:
    """summary.json of a completed run (:class:`noloco.train.Trainer` at its end, ``rec`` its
    final evaluation). Collective: every worker calls it."""

    cfg, lay, st, t = trainer.cfg, trainer.lay, trainer.state, trainer.cfg.train
    m = cfg.method
    train_s = trainer.loop_seconds() - st.eval_s
    stats = gather_scalars(trainer.world, lay, [st.compute_s, train_s])
    tps = trainer.tokens_per_step
    # The steady rate: from the third step of each worker's process on (the first compiles
    # under --compile), the slowest worker's seconds a step; the whole run where it is short.
    mark = trainer.steady_from
    steady = (train_s - mark[1]) / (t.steps - mark[0]) if mark and t.steps > mark[0] \
        else train_s / max(t.steps, 1)
    steady = gather_scalars(trainer.world, lay, [steady], "max")[0]
    summary = shared_summary(cfg, {r: {"val_loss": rec["val_loss_per_replica"][r],
                                       "bytes_sent": rec["bytes_sent_by_replica"][r],
                                       "sync_seconds": rec["sync_seconds_by_replica"][r]}
                                   for r in range(lay.replicas)})
    summary.update({
        "outer_steps": trainer.method.outer_steps,
        "sync_every": trainer.method.sync_every,
        "group_size": m.group_size if m.method == "noloco" else None,
        "params": trainer.n_params_total,
        "param_bytes": trainer.param_bytes if lay.stages == 1 else None,
        "tokens_per_replica": t.steps * tps,
        # The most bytes any one worker sent in one inner step (max over all ranks).
        "peak_step_bytes": int(gather_scalars(trainer.world, lay, [st.peak_step_bytes],
                                              "max")[0]),
        "activation_bytes": rec["activation_bytes"],
        "ops": dict(trainer.comm.ops),  # rank 0's: every replica issues the same sequence
        "compute_seconds": stats[0],
        "step_seconds": stats[0] / t.steps,
        "train_seconds": stats[1],
        "compute_utilisation": stats[0] / stats[1] if stats[1] > 0 else None,
        "wall_seconds": trainer.wall_seconds(),
        "weight_spread": rec["weight_spread"],
        "tokens_per_second": t.steps * tps * lay.replicas / max(stats[1], 1e-9),
        "steady_tokens_per_second": tps * lay.replicas / max(steady, 1e-9),
        "threads_per_worker": trainer.threads,
        # The largest resident set of any worker over the run (Linux reports kB).
        "peak_rss_bytes": int(gather_scalars(trainer.world, lay, [_peak_rss_bytes()], "max")[0]),
        "device": str(trainer.device),
        "host_staged": trainer.host_staged,
        "torch": torch.__version__,
        "resumed_from_step": trainer.resumed_from,
        "attempt": trainer.ctx.attempt,
        "startup": startup_summary(trainer),
    })
    # collective on every worker (a CPU worker beside GPU ones reports 0)
    peak_gpu = gather_scalars(trainer.world, lay, [
        torch.cuda.max_memory_allocated(trainer.device) if trainer.device.type == "cuda"
        else 0], "max")[0]
    if trainer.device.type == "cuda":
        summary["gpu"] = gpu_summary(trainer, summary["steady_tokens_per_second"], peak_gpu)
    if lay.stages > 1:
        summary["param_bytes"] = sum(gather_scalars(trainer.world, lay, [trainer.param_bytes],
                                                    "stage_sum"))
    ck = trainer.ckpt.report()
    ck["checkpoint_blocked_seconds"] = gather_scalars(
        trainer.world, lay, [ck["checkpoint_blocked_seconds"]])[0]
    summary.update(ck)
    if hasattr(trainer.runner, "report"):
        summary.update(trainer.runner.report())
    summary.update(trainer.method.report())
    guard = trainer.method.guard
    if guard is not None:  # every worker's rejections, not rank 0's alone
        mine = [{"replica": lay.replica, "stage": lay.stage, **r} for r in guard.rejected]
        summary["update_guard"] = {
            "factor": guard.factor,
            "checked": int(sum(gather_scalars(trainer.world, lay, [guard.checked], "sum"))),
            "rejected": sorted((r for rs in gather_json(trainer.world, lay, mine) for r in rs),
                               key=lambda r: (r["step"], r["replica"], r["stage"]))}
    return summary
