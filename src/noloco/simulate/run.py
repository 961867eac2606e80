"""One simulated run: N replicas of a config in one process, the distributed run's math.

Per inner step, as every replica of a distributed run does it (:mod:`noloco.train`):

    every replica reads its own batch (its :class:`noloco.data.ShardedReader`, rank r of N)
    one batched forward/backward (:class:`StackedReplicas`)
    DDP: the gradients' mean over the replicas
    each replica's gradient clipped by its own norm; AdamW on the stacks
    the outer steps: every replica's method (the methods' own code, :mod:`noloco.methods`)
        over a :class:`noloco.simulate.fabric.Fabric` — first every replica starts what
        starts now, then every replica applies what is due now

Evaluations, metrics.jsonl, summary.json (the shared key set of :func:`noloco.metrics.
shared_summary`, with ``"simulated": true``) and ``model/`` (every replica's weights and
their mean) are those of a distributed run, so ``noloco report``, ``generate`` and
``export`` read a simulated run as any other.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from noloco import checkpoint as ckpt_mod
from noloco import data as data_mod
from noloco.comm import ring_all_reduce_bytes
from noloco.config import Config, ConfigError
from noloco.methods import build_method
from noloco.methods.base import Method, shared_state
from noloco.methods.ddp import bucket_layout
from noloco.metrics import Progress, mean, shared_summary
from noloco.model import build, count_params, preset
from noloco.rundir import RunDir
from noloco.simulate.churn import Churn
from noloco.simulate.fabric import Fabric
from noloco.simulate.link import LinkModel
from noloco.simulate.replicas import StackedReplicas
from noloco.staging import upload
from noloco.token_cache import cached_corpus
from noloco.train import AVERAGED_METHODS, lr_at

ACTIVATIONS_BATCHED = 1.3
"""the batched forward's activations per replica against :mod:`noloco.footprint`'s estimate
for a lone replica (:func:`memory_plan`)"""
SAVED_REPLICAS = 64
"""model/ holds every replica's weights up to this many replicas (then replica 0's and the
mean only: a study of a thousand replicas wants its curves, not a thousand files)"""


@dataclass
class _Clock:
    loop_s: float = 0.0
    eval_s: float = 0.0


class Simulation:
    """A resolved config's N replicas in this process (:func:`simulate` runs it)."""

    def __init__(self, cfg: Config, rundir: RunDir, link: LinkModel | None = None,
                 device: torch.device | None = None, churn: Churn | None = None) -> None:
        m, d, o, t = cfg.method, cfg.data, cfg.optim, cfg.train
        self.cfg, self.rundir = cfg, rundir
        self.n = m.replicas
        self.device = device or torch.device("cpu")
        tokenizer = data_mod.make_tokenizer(d.tokenizer)
        corpus, _ = cached_corpus(d.data, tokenizer, d.seq_len, d.max_tokens,
                                  allow_binary=d.allow_binary)
        self.readers = [data_mod.ShardedReader(corpus.train, d.seq_len, d.batch_size, r,
                                               self.n, seed=t.seed) for r in range(self.n)]
        self.val = [(x.to(self.device), y.to(self.device)) for x, y in
                    data_mod.validation_batches(corpus.val, d.seq_len, t.eval_sequences,
                                                d.batch_size)]
        self.tokenizer_name = tokenizer.name
        self.args = preset(cfg.model.preset, vocab_size=tokenizer.vocab_size,
                           dropout=cfg.model.dropout)
        model = build(self.args, device=self.device, seed=t.seed)
        self.n_params = count_params(model)
        self.n_layers = self.args.n_layers
        self.replicas = StackedReplicas(model, self.n)
        self.inner = torch.optim.AdamW(self.replicas.params, lr=o.lr, betas=(o.beta1, o.beta2),
                                       weight_decay=o.weight_decay)
        self.fabric = Fabric(self.n)
        self.churn = churn
        """replicas leaving and joining (``--churn``), or None"""
        self._kept_moments: dict[int, list[dict[str, torch.Tensor]]] = {}
        """a replica away: its AdamW moments when it left, per parameter"""
        self.fabric.elastic = churn is not None
        self.comms = self.fabric.communicators()
        self.ddp = m.method == "ddp"
        self.methods: list[Method] = []
        if not self.ddp:
            self.methods = [build_method(m, self.replicas.named_views(r), self.comms[r],
                                         seed=t.seed, n_layers=self.n_layers)
                            for r in range(self.n)]
        # DDP's buckets (noloco.methods.ddp): one ring all-reduce each per inner step
        numels = [p[0].numel() for p in self.replicas.params]
        self.ddp_bucket_bytes = [sum(numels[i] for i in b) * 4 for b in bucket_layout(numels)]
        self.tokens_per_step = d.batch_size * d.seq_len * o.grad_accum
        self.clock = _Clock()
        self.link = link
        """the modelled network (``--bandwidth``), or None"""
        if link is not None:
            link.overlap_steps = m.overlap_steps if m.method in ("streaming", "noloco") else 0
            link.start(self.comms)
        self.step = 0
        self.tokens = 0
        """tokens trained on by the replicas in the run, so far"""
        self.unread_losses: list[torch.Tensor] = []

    # ---- one inner step ----------------------------------------------------------------------
    def inner_step(self) -> torch.Tensor:
        cfg = self.cfg
        o = cfg.optim
        for g in self.inner.param_groups:
            g["lr"] = lr_at(self.step, o.lr, o.warmup, o.schedule_steps)
        k = o.grad_accum
        total = torch.zeros(self.n, device=self.device)
        live = self.fabric.live
        for _ in range(k):
            # (a replica away reads nothing: its rows compute on zeros, and are replaced
            # when it joins)
            batches = [self.readers[r].next_batch() if r in live else self._idle()
                       for r in range(self.n)]
            x = upload(torch.stack([b[0] for b in batches]), self.device)
            y = upload(torch.stack([b[1] for b in batches]), self.device)
            losses = self.replicas.losses(x, y)
            (losses.sum() * (1.0 / k) if k > 1 else losses.sum()).backward()
            total += losses.detach()
        if len(live) < self.n:  # a replica away trained on nothing: no loss of it
            away = torch.ones(self.n, dtype=torch.bool, device=self.device)
            away[live] = False
            total[away] = float("nan")
        if self.ddp and self.n > 1:
            self.replicas.mean_gradients()
            for comm in self.comms:
                comm.ops["all_reduce"] += len(self.ddp_bucket_bytes)
                comm.bytes_sent += sum(ring_all_reduce_bytes(b, self.n)
                                       for b in self.ddp_bucket_bytes)
        if o.grad_clip > 0:
            self.replicas.clip_grad_norm_(o.grad_clip)
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.step += 1
        # every replica starts what starts now before any applies what is due now
        running = [r for r in live if self.methods]  # (DDP has no outer steps)
        for r in running:
            self.methods[r].start_outer()
        for r in running:
            self.methods[r].complete_outer()
        for r in running:
            guard = self.methods[r].guard
            if guard is not None and guard.restart_inner:
                self.restart_inner(r)
                guard.restart_inner = False
        return total / k

    def _idle(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.data
        z = torch.zeros(d.batch_size, d.seq_len, dtype=torch.long)
        return z, z

    # ---- churn -------------------------------------------------------------------------------
    def churn_step(self) -> None:
        """At an outer-step boundary: the replicas whose time away is over join, then each
        replica in the run may leave (:mod:`noloco.simulate.churn`)."""
        churn, step = self.churn, self.step
        assert churn is not None and self.cfg.method.sync_every is not None
        if step % self.cfg.method.sync_every or step >= self.cfg.train.steps:
            return
        donor = self.fabric.live[0]  # (chosen among those that stayed, before anyone joins)
        for r in churn.joining(step):
            self.join(r, donor)
            churn.record(step, r, "joined", donor)
        for r in churn.leaving(step, list(self.fabric.live), self.cfg.method.sync_every):
            self.leave(r)
            churn.record(step, r, "left")

    @torch.no_grad()
    def leave(self, replica: int) -> None:
        """``replica`` leaves the run; its AdamW moments are kept for its return (what an
        elastic replica's own checkpoint holds when it comes back)."""
        self.fabric.elastic = True  # (who takes part is asked from now on)
        self.fabric.leave(replica)
        self._kept_moments[replica] = [
            {k: state[k][replica].clone() for k in ("exp_avg", "exp_avg_sq") if k in state}
            for state in self._adam_states()]

    @torch.no_grad()
    def join(self, replica: int, donor: int) -> None:
        """``replica`` takes ``donor``'s state as an elastic join does (the module docstring
        of :mod:`noloco.simulate.churn`)."""
        for p in self.replicas.params:
            p[replica].copy_(p[donor])
        mine, theirs = self.methods[replica], self.methods[donor]
        guard = mine.guard
        judged = (list(guard.rejected), guard.checked) if guard is not None else None
        # A copy, as a join over a network receives: state_dict holds the donor's live
        # tensors, and an optimizer's load_state_dict keeps a tensor of the right device and
        # dtype as it is — the two replicas' outer momentum would be one buffer.
        mine.load_state_dict(copy.deepcopy(shared_state(theirs.state_dict())))
        for e in mine.errors:
            e.zero_()  # the donor's debt is not this replica's
        if guard is not None and judged is not None:
            guard.rejected, guard.checked = judged
        self.comms[replica].seq = self.comms[donor].seq
        kept = self._kept_moments.pop(replica, None)
        if kept is None:
            self._zero_moments(replica)
        else:  # its own moments, from when it left
            for state, rows in zip(self._adam_states(), kept, strict=True):
                for key, row in rows.items():
                    state[key][replica].copy_(row)
        self.fabric.join(replica)

    def _adam_states(self) -> list[dict[str, Any]]:
        return [self.inner.state[p] for p in self.replicas.params if p in self.inner.state]

    def _zero_moments(self, replica: int) -> None:
        for state in self._adam_states():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key][replica].zero_()

    @torch.no_grad()
    def restart_inner(self, replica: int) -> None:
        """The update guard rejected ``replica``'s own update: it took the synced weights
        (its method did that), and its inner optimizer's moments start afresh. One
        difference from a distributed replica, which also restarts its AdamW step count:
        the stacks share one count, so its bias correction does not restart."""
        self._zero_moments(replica)
        print(f"noloco: replica {replica}: its own update was rejected at step {self.step}; "
              f"it took the synced weights and restarted its inner optimizer's moments",
              file=sys.stderr, flush=True)

    # ---- evaluation --------------------------------------------------------------------------
    def evaluate(self, step: int, log: Progress) -> dict[str, Any]:
        e0 = time.perf_counter()
        live = self.fabric.live
        val = [v if r in live else None
               for r, v in enumerate(self.replicas.eval_losses(self.val))]
        train = (torch.stack(self.unread_losses).nanmean(0).cpu().tolist()
                 if self.unread_losses else [float("nan")] * self.n)
        self.unread_losses.clear()
        sent = [c.bytes_sent for c in self.comms]
        ours = [sent[r] for r in live]  # (one replica's bytes: the mean over those in the run)
        rec = {
            # (a replica back from away has no loss of the steps it missed: NaN, left out)
            "train_loss": mean([train[r] for r in live if train[r] == train[r]]),
            "val_loss": mean([val[r] for r in live]), "val_loss_per_replica": val,
            "bytes_sent": mean(ours), "bytes_sent_per_replica": mean(ours),
            "bytes_sent_by_replica": sent, "activation_bytes": 0.0,
            "sync_seconds": 0.0, "sync_seconds_by_replica": [0.0] * self.n,
            "weight_spread": self.replicas.weight_spread(live),
            "replicas_in_run": len(live),
            "step": step, "tokens": self.tokens,
            "tokens_per_replica": step * self.tokens_per_step,
            "wall_seconds": self.clock.loop_s,
            "modelled_seconds": self.link.seconds if self.link is not None else None,
        }
        self.rundir.append_metrics(rec)
        log.eval_line(rec)
        self.clock.eval_s += time.perf_counter() - e0
        return rec

    # ---- the run -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t = self.cfg.train
        log = Progress(enabled=True, total=t.steps, log_every=t.log_every)
        t0 = time.perf_counter()
        self.evaluate(0, log)
        while self.step < t.steps:
            s0 = time.perf_counter()
            loss = self.inner_step()
            if self.link is not None:
                self.link.step(self.comms, self.fabric.live,
                               (time.perf_counter() - s0) / self.n)
            if self.churn is not None:
                self.churn_step()
            self.unread_losses.append(loss)
            log.step(self.step, loss.nanmean(), self.tokens_per_step * len(self.fabric.live))
            self.tokens += self.tokens_per_step * len(self.fabric.live)
            self.clock.loop_s = time.perf_counter() - t0
            if self.step % t.eval_every == 0 and self.step != t.steps:
                self.evaluate(self.step, log)
        for r in self.fabric.live if self.methods else []:
            self.methods[r].finish()  # the syncs still in flight (their parts were all posted)
        self.clock.loop_s = time.perf_counter() - t0
        rec = self.evaluate(t.steps, log)
        log.close()
        self.save_weights()
        summary = self.summary(rec)
        self.rundir.write_summary(summary)
        log.final(summary, str(t.out), self.cfg.optim.schedule_steps)
        return summary

    def summary(self, rec: dict[str, Any]) -> dict[str, Any]:
        m, t = self.cfg.method, self.cfg.train
        # (the replicas in the run at its end: an elastic run's summary has those that finished)
        out = shared_summary(self.cfg, {r: {"val_loss": rec["val_loss_per_replica"][r],
                                            "bytes_sent": rec["bytes_sent_by_replica"][r],
                                            "sync_seconds": 0.0} for r in self.fabric.live})
        first = self.methods[self.fabric.live[0]] if self.methods else None
        out.update({
            "simulated": True,
            "outer_steps": first.outer_steps if first is not None else 0,
            "group_size": m.group_size if m.method == "noloco" else None,
            "params": self.n_params,
            "param_bytes": self.n_params * 4,
            "tokens_per_replica": t.steps * self.tokens_per_step,
            "ops": dict(self.comms[self.fabric.live[0]].ops),
            "weight_spread": rec["weight_spread"],
            "wall_seconds": self.clock.loop_s,
            "eval_seconds": self.clock.eval_s,
            # one replica's share of this process's compute: what a replica of its own on
            # this machine would take (what `noloco netsim predict` models a network around)
            "compute_seconds": (self.clock.loop_s - self.clock.eval_s) / self.n,
            "step_seconds": (self.clock.loop_s - self.clock.eval_s) / self.n / t.steps,
            "tokens_per_second": self.tokens / max(self.clock.loop_s - self.clock.eval_s, 1e-9),
        })
        if first is not None:
            out.update(first.settings())
        out["modelled"] = self.link.report() if self.link is not None else None
        out["churn"] = self.churn.report() if self.churn is not None else None
        return out

    @torch.no_grad()
    def save_weights(self) -> None:
        """``model/``: the replicas' weights (up to :data:`SAVED_REPLICAS`) and their mean."""
        cfg = self.cfg
        model_dir = self.rundir.path / ckpt_mod.MODEL_DIR
        meta = {"step": str(self.step), "method": cfg.method.method}
        live = self.fabric.live
        saved = live if len(live) <= SAVED_REPLICAS else live[:1]
        names = []
        for r in saved:
            ckpt_mod.save_weights(model_dir / ckpt_mod.shard_name(f"replica-{r}", 0, 1),
                                  {n: v.detach().cpu().clone() for n, v in
                                   self.replicas.named_views(r)}, meta)
            names.append(f"replica-{r}")
        if self.n > 1 and cfg.method.method in AVERAGED_METHODS:
            ckpt_mod.save_weights(model_dir / ckpt_mod.shard_name("average", 0, 1),
                                  {n: p.detach()[live].mean(0).cpu() for n, p in
                                   zip(self.replicas.names, self.replicas.params, strict=True)},
                                  meta)
            names.append("average")
        ckpt_mod.write_model_index(self.rundir.path, self.args, names, 1, {
            "hf_config": None, "tokenizer": cfg.data.tokenizer,
            "tokenizer_name": self.tokenizer_name, "preset": cfg.model.preset,
            "step": self.step, "method": cfg.method.method})


def check_simulable(cfg: Config) -> None:
    """Refuse, in one line, what a simulation cannot serve (before anything is written)."""
    m, o, t = cfg.method, cfg.optim, cfg.train
    refusals = [
        (m.stages > 1, "--stages: pipeline stages are not simulated (replicas only)"),
        (m.elastic, "--elastic: an elastic run is not simulated"),
        (o.inner_optimizer != "adamw",
         f"--inner-optimizer {o.inner_optimizer}: only AdamW is batched across replicas "
         f"(Muon's orthogonalisation is per matrix)"),
        (cfg.model.hf_model is not None, "--hf-model is not simulated (noloco's own presets)"),
        (cfg.model.dropout > 0, "--dropout: each replica's dropout draws differ from a "
                                "distributed run's"),
        (t.inject_fault != "", "--inject-fault is not simulated"),
        (t.compile, "--compile is not simulated"),
        (t.precision != "fp32", f"--precision {t.precision} is not simulated"),
        (t.coordinator is not None or t.replica_ids is not None,
         "--coordinator/--replica-ids: a simulation runs every replica here"),
        (t.tensorboard or t.wandb, "--tensorboard/--wandb are not simulated"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"noloco simulate: {why}")


def memory_plan(cfg: Config, vocab_size: int, device: torch.device) -> tuple[int, int, str]:
    """(bytes per replica, bytes available, the line that says so) before the run starts:
    :func:`noloco.footprint.estimate` for one replica (weights, gradients, the inner
    optimizer, the method's state and buffers, the activations of its batch), times N.
    Available: the GPU's memory, or the machine's MemAvailable. ConfigError when N replicas
    cannot fit."""
    from noloco import footprint

    shape = footprint.model_shape(cfg, vocab_size)
    assert shape is not None  # (--hf-model is refused before)
    fp = footprint.estimate(cfg, *shape)
    fp.overhead = 0
    # The batched forward keeps more per replica than a lone one (the copies that fold the
    # replicas into attention's batch and back): measured 1.26x the estimate's activations,
    # 16 tiny replicas at batch 4 and 16 (peak RSS, less the bare process's).
    fp.activations = int(fp.activations * ACTIVATIONS_BATCHED)
    per = fp.total
    if device.type == "cuda":
        free = torch.cuda.get_device_properties(device).total_memory - footprint.CUDA_OVERHEAD
        where = torch.cuda.get_device_name(device)
    else:
        free, where = available_memory(), "this machine"
    need = per * cfg.method.replicas
    parts = ", ".join(f"{name} {getattr(fp, name) / 2**20:.1f}" for name in
                      ("weights", "gradients", "optimizer", "outer", "activations"))
    line = (f"noloco simulate: {cfg.method.replicas} replicas in one process on "
            f"{device.type}: about {need / footprint.GIB:.2f} GiB "
            f"({per / 2**20:.1f} MiB each: {parts} MiB) of {free / footprint.GIB:.1f} "
            f"GiB available")
    if need > free:
        raise ConfigError(
            f"noloco simulate: {cfg.method.replicas} replicas need about "
            f"{need / footprint.GIB:.1f} GiB ({per / 2**20:.1f} MiB each), {where} has "
            f"{free / footprint.GIB:.1f} GiB available: at most {max(free // per, 0)} fit "
            f"(or a smaller --batch-size or --seq-len)")
    return per, free, line


def available_memory() -> int:
    """The machine's MemAvailable (bytes): what a process may take without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
