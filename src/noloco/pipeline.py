"""Pipeline stages with random routing: NoLoCo's grid of N replicas × P stages (SPEC §3).

Each of the N·P workers holds one stage of one replica (:func:`build_stage`: stage 0 the input
embedding and the first blocks, the last stage the last blocks, final norm and output head;
blocks balanced by :func:`noloco.split.stage_blocks`). A step's batch of B sequences is cut into
M microbatches; activations travel forward and their gradients backward between stages with
torch.distributed point-to-point operations.

Schedule: one-forward-one-backward (1F1B). Stage s first runs P−1−s forwards (warm-up), then
alternates one forward and one backward, then drains the remaining backwards; the last stage
runs each backward right after its forward. With equal stage times every stage idles for
(P−1) microbatch-slots of forward+backward per step, the same bubble as GPipe,
(P−1)/(M+P−1) of the step, while holding at most P−s microbatches' activations instead of M.

Routing (SWARM / DiPaCo, NoLoCo §3.1): for microbatch m of step t the global sample counter
is g = t·M + m; at the boundary b between stages b and b+1 the permutation
:func:`route` (g, b) of the N replicas sends replica r's microbatch to replica perm[r] of
stage b+1. Every worker computes the same permutation from the seed, so sender and receiver
agree without talking, and every replica of stage b+1 receives exactly one microbatch per slot.
Labels travel with the activations; gradients retrace the path (the receiver of the
gradient of slot m at boundary b is perm⁻¹ of the sender). ``fixed`` routing is the identity
(each sample stays in its own replica's pipeline) and is what evaluation always uses.

Loss: each microbatch's mean token loss is weighted by its share of the batch, so a step's
loss and gradients are the mean over all B sequences, exactly as with one stage.

Traffic: ``activation_bytes`` counts what this worker sent to other stages in training
(activations forward, gradients backward, labels with the activations); evaluation traffic
is counted apart (``eval_activation_bytes``). Synchronisation bytes stay with the method's
communicator, so the two never mix.

Deadlock freedom: every receive of a step is posted up front (``irecv``), sends never block
(``isend``, waited for only at the end of the step), and each message of a step has its own
tag, so matching never depends on the order in which two workers post their operations; the
only waits are for data that an earlier operation of the (acyclic) 1F1B schedule produces.
The messages use a dedicated gloo group over all ranks, created in :class:`PipelineRunner`'s
constructor, which every rank calls at the same point (``new_group`` is world-collective).

On a GPU (untested here: no GPU in this project's machines) the messages are staged through
host memory, since the group is gloo: each send copies to the host and so waits for the
device; the microbatches' losses stay on the device until the end of the step, one
synchronisation per step rather than one per microbatch.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from noloco.comm import posting, wait_works
from noloco.config import Config
from noloco.model import Forward, Transformer, autocast, lm_loss
from noloco.split import stage_blocks

if TYPE_CHECKING:
    from noloco.distributed import Layout

_ROUTE_SALT = 0x726F757465  # "route": keeps routing draws apart from other seeded streams
# Message kinds; tag = 4·slot + kind, unique per pair of workers within one call.
_ACT, _LABEL, _GRAD, _EVAL = range(4)
_ACCOUNTING = ("activation_bytes", "eval_activation_bytes", "wait_seconds", "step_seconds",
               "steps")


def default_microbatches(batch_size: int, stages: int) -> int:
    """``--microbatches 0``: 2·P microbatches (bubble (P−1)/(3P−1), a fifth for P = 2), at
    most one per sequence."""
    return max(1, min(batch_size, 2 * stages))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a step for every stage of a 1F1B (or GPipe) pipeline with equal stages."""
    return (stages - 1) / (microbatches + stages - 1)


def route(sample: int, boundary: int, replicas: int, seed: int = 0) -> list[int]:
    """perm[r]: the replica of stage ``boundary`` + 1 that receives sample slot ``sample`` from
    replica r of stage ``boundary``. A permutation, identical on every worker that asks."""
    rng = np.random.default_rng([seed, sample, boundary, _ROUTE_SALT])
    return [int(q) for q in rng.permutation(replicas)]


class Router:
    """Who sends to whom: ``random`` (a fresh permutation per slot and boundary) or ``fixed``."""

    def __init__(self, routing: str, replicas: int, seed: int = 0) -> None:
        if routing not in ("random", "fixed"):
            raise ValueError(f"unknown routing {routing!r}")
        self.routing, self.replicas, self.seed = routing, replicas, seed

    def perm(self, sample: int, boundary: int) -> list[int]:
        if self.routing == "fixed" or self.replicas == 1:
            return list(range(self.replicas))
        return route(sample, boundary, self.replicas, self.seed)

    def next_replica(self, sample: int, boundary: int, replica: int) -> int:
        """Receiver in stage boundary+1 of what ``replica`` of stage ``boundary`` sends."""
        return self.perm(sample, boundary)[replica]

    def prev_replica(self, sample: int, boundary: int, replica: int) -> int:
        """Sender in stage ``boundary`` of what ``replica`` of stage boundary+1 receives."""
        return self.perm(sample, boundary).index(replica)

    def origin(self, sample: int, stage: int, replica: int) -> int:
        """The stage-0 replica whose sequences reach ``replica`` of ``stage`` in this slot."""
        for b in range(stage - 1, -1, -1):
            replica = self.prev_replica(sample, b, replica)
        return replica


def one_f_one_b(stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of forward ("F", m) and backward ("B", m) operations of one stage."""
    warm = min(stages - 1 - stage, microbatches)
    ops = [("F", m) for m in range(warm)]
    f = warm
    for b in range(microbatches):
        if f < microbatches:
            ops.append(("F", f))
            f += 1
        ops.append(("B", b))
    return ops


class Stage(nn.Module):
    """One pipeline stage cut out of a :class:`~noloco.model.Transformer` (shared modules).

    Parameter names keep the full model's (``tok_embeddings``, ``layers.K`` with the global
    block index K, ``norm``, ``output``), so name-based splitting (fragments) still works.
    """

    def __init__(self, model: Transformer, stages: int, stage: int) -> None:
        super().__init__()
        n_layers = len(model.layers)
        self.blocks = stage_blocks(n_layers, stages, stage)
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(k): model.layers[k] for k in self.blocks})
        if self.last:
            self.norm = model.norm
            self.output = model.output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (stage 0) or hidden states → hidden states, or logits on the last stage."""
        h = self.tok_embeddings(x) if self.first else x
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.last else h


def build_stage(model: Any, stages: int, stage: int, prune: bool = True) -> nn.Module:
    """Stage ``stage`` of ``stages``; with ``prune`` the other stages' modules are dropped
    from ``model`` (replaced by ``nn.Identity``) so their memory is freed. ``model`` is
    noloco's Transformer or a Llama-family Hugging Face model (:class:`noloco.hf.LlamaStage`)."""
    if not isinstance(model, Transformer):
        from noloco.hf import LlamaStage, llama_like, n_layers

        why = llama_like(model)
        if why is not None:
            raise ValueError(f"cannot cut this model into pipeline stages: {why}")
        blocks = stage_blocks(n_layers(model.config), stages, stage)
        st = LlamaStage(model, blocks, stage == 0, stage == stages - 1)
        if prune:
            base = model.hf.model
            for k in range(len(base.layers)):
                if k not in blocks:
                    base.layers[k] = nn.Identity()
        return st
    st = Stage(model, stages, stage)
    if prune:
        for k in range(len(model.layers)):
            if k not in st.blocks:
                model.layers[k] = nn.Identity()
        if not st.first:
            model.tok_embeddings = nn.Identity()
        if not st.last:
            model.norm, model.output = nn.Identity(), nn.Identity()
    return st


class PipelineRunner:
    """This worker's stage: the same interface as :class:`noloco.train.LocalRunner`.

    ``train_step`` runs forward and backward of the whole step's batch through the pipeline
    and leaves the gradients in this stage's parameters; the last stage returns the mean loss
    of the microbatches it processed, the other stages ``None``.
    """

    def __init__(self, model: Transformer, cfg: Config, lay: Layout, device: torch.device) -> None:
        m = cfg.method
        self.lay, self.device = lay, device
        self.stage = build_stage(model, lay.stages, lay.stage)
        self.dim = model.args.dim if isinstance(model, Transformer) else model.config.hidden_size
        self.precision = cfg.train.precision
        self.forward = Forward(self.stage, cfg.train.compile)
        self.wire = torch.bfloat16 if self.precision == "bf16" else torch.float32
        """the dtype of activations and their gradients between stages (bytes counted so)"""
        self.batch_size = cfg.data.batch_size
        self.microbatches = m.microbatches or default_microbatches(self.batch_size, lay.stages)
        if self.microbatches > self.batch_size:
            raise ValueError(f"{self.microbatches} microbatches exceed batch size "
                             f"{self.batch_size}")
        self.routing = m.routing
        self.router = Router(m.routing, lay.replicas, seed=cfg.train.seed)
        self.schedule = one_f_one_b(lay.stages, lay.stage, self.microbatches)
        # Every rank creates this group at the same point (world-collective). Always gloo:
        # the messages are staged through host memory, so NCCL's in-order matching of
        # point-to-point operations never applies.
        self.group = dist.new_group(list(range(lay.world)), backend="gloo",
                                    timeout=timedelta(seconds=m.comm_timeout))
        # The groups of each replica's stages, for the gradient norm (created by every rank in
        # the same order, like the group above). Gloo for the same reason.
        replica_groups = [dist.new_group([lay.global_rank(r, s) for s in range(lay.stages)],
                                         backend="gloo",
                                         timeout=timedelta(seconds=m.comm_timeout))
                          for r in range(lay.replicas)]
        self.replica_group = replica_groups[lay.replica]
        self.watchdog: Any = None
        """names the peer stage a stalled receive waits for (see noloco.watchdog)"""
        self.activation_bytes = 0
        self.eval_activation_bytes = 0
        self.wait_seconds = 0.0
        """seconds blocked waiting for another stage's activations or gradients (training)"""
        self.step_seconds = 0.0
        self.steps = 0
        self.slot_losses: list[float] = []
        """last stage: the loss of each microbatch slot of the latest training step"""

    # ---- the LocalRunner interface ---------------------------------------------------------
    def parameters(self) -> list[torch.Tensor]:
        return list(self.stage.parameters())

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.stage.named_parameters())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients of this replica's whole model (all its stages) by their joint
        norm, as the one-stage model clips: each stage's squared norm is summed over the
        replica's stages, so every stage scales by the same factor. Blocks on the replica's
        other stages (which already wait on this one's activations every step)."""
        params = [p for p in self.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        local = (torch.nn.utils.get_total_norm(grads, 2.0).double() ** 2 if grads
                 else torch.zeros((), dtype=torch.float64))
        total_sq = local.cpu().reshape(1).clone()
        t0 = time.perf_counter()
        work = dist.all_reduce(total_sq, group=self.replica_group, async_op=True)
        peers = [self.lay.global_rank(self.lay.replica, s) for s in range(self.lay.stages)]
        wait_works([work], "gradient norm across the replica's stages", peers, self.watchdog)
        self.wait_seconds += time.perf_counter() - t0
        total = total_sq.sqrt().to(torch.float32).reshape(())
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(grads[0].device))
        return float(total)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, step: int
                   ) -> float | None:
        t0 = time.perf_counter()
        lay, st, M = self.lay, self.stage, self.microbatches
        s, me = lay.stage, lay.replica
        xs, ys = inputs.tensor_split(M), targets.tensor_split(M)
        carry_labels = self.routing == "random"
        sends: list[tuple[Any, torch.Tensor, int]] = []
        # Post every receive of the step before any compute.
        act_in: dict[int, tuple[Any, torch.Tensor, Any, torch.Tensor | None, int]] = {}
        grad_in: dict[int, tuple[Any, torch.Tensor, int]] = {}
        for m in range(M):
            g = step * M + m
            n, t = xs[m].shape
            if not st.first:
                src = lay.global_rank(self.router.prev_replica(g, s - 1, me), s - 1)
                buf = torch.empty(n, t, self.dim, dtype=self.wire)
                w = self._recv(buf, src, 4 * m + _ACT)
                lw, lbuf = None, None
                if carry_labels:
                    lbuf = torch.empty(n, t, dtype=torch.int32)
                    lw = self._recv(lbuf, src, 4 * m + _LABEL)
                act_in[m] = (w, buf, lw, lbuf, src)
            if not st.last:
                src = lay.global_rank(self.router.next_replica(g, s, me), s + 1)
                buf = torch.empty(n, t, self.dim, dtype=self.wire)
                grad_in[m] = (self._recv(buf, src, 4 * m + _GRAD), buf, src)

        stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses: list[tuple[torch.Tensor, float]] = []  # on the device: one sync per step
        for op, m in self.schedule:
            g = step * M + m
            if op == "F":
                if st.first:
                    x, labels = None, ys[m]
                    with autocast(self.device, self.precision):
                        out = self.forward(xs[m])
                else:
                    w, buf, lw, lbuf, src = act_in.pop(m)
                    self._wait([w] if lw is None else [w, lw], src, "pipeline receive")
                    labels = lbuf.to(self.device, torch.int64) if lbuf is not None else ys[m]
                    # fp32 inside the stage whatever travelled (the residual stream stays fp32)
                    x = buf.to(self.device, torch.float32).requires_grad_(True)
                    with autocast(self.device, self.precision):
                        out = self.forward(x)
                if st.last:
                    weight = xs[m].shape[0] / self.batch_size
                    with autocast(self.device, self.precision):
                        loss = lm_loss(out, labels)
                    (loss * weight).backward()
                    losses.append((loss.detach(), weight))
                    if x is not None:  # P ≥ 2 here: the last stage is never the first
                        dst = lay.global_rank(self.router.prev_replica(g, s - 1, me), s - 1)
                        sends.append(self._send(x.grad, dst, 4 * m + _GRAD))
                else:
                    dst = lay.global_rank(self.router.next_replica(g, s, me), s + 1)
                    sends.append(self._send(out.detach(), dst, 4 * m + _ACT))
                    if carry_labels:
                        sends.append(self._send(labels.to(torch.int32), dst, 4 * m + _LABEL))
                    stash[m] = (x, out)
            else:
                if st.last:
                    continue  # already done right after the forward
                x, out = stash.pop(m)
                w, buf, src = grad_in.pop(m)
                self._wait([w], src, "pipeline receive")
                out.backward(buf.to(self.device, out.dtype))
                if x is not None:
                    dst = lay.global_rank(self.router.prev_replica(g, s - 1, me), s - 1)
                    sends.append(self._send(x.grad, dst, 4 * m + _GRAD))
        for w, _, dst in sends:
            self._wait([w], dst, "pipeline send")
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0
        if not st.last:
            return None
        self.slot_losses = torch.stack([x for x, _ in losses]).tolist() if losses else []
        return sum(v * w for v, (_, w) in zip(self.slot_losses, losses, strict=True))

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Fixed routing (each replica's own pipeline), one message per batch: stage s works
        on batch b while stage s+1 works on batch b−1. Every worker holds the same validation
        batches, so the labels need not travel."""
        lay, st = self.lay, self.stage
        s, me = lay.stage, lay.replica
        self.stage.eval()
        ins = []
        src = lay.global_rank(me, s - 1) if not st.first else -1
        if not st.first:
            for b, (x, _) in enumerate(batches):
                buf = torch.empty(*x.shape, self.dim, dtype=self.wire)
                ins.append((self._recv(buf, src, 4 * b + _EVAL), buf))
        sends, total = [], 0.0
        for b, (x, y) in enumerate(batches):
            if st.first:
                with autocast(self.device, self.precision):
                    h = self.forward(x)
            else:
                w, buf = ins[b]
                wait_works([w], "pipeline receive (evaluation)", [src], self.watchdog)
                with autocast(self.device, self.precision):
                    h = self.forward(buf.to(self.device, torch.float32))
            if st.last:
                with autocast(self.device, self.precision):  # weighted: a last batch may be smaller
                    total += lm_loss(h, y).item() * len(y)
            else:
                work, h, dst = self._send(h, lay.global_rank(me, s + 1), 4 * b + _EVAL,
                                          count=False)
                self.eval_activation_bytes += h.numel() * h.element_size()
                sends.append((work, h, dst))
        for w, _, dst in sends:
            wait_works([w], "pipeline send (evaluation)", [dst], self.watchdog)
        self.stage.train()
        return total / sum(len(y) for _, y in batches) if st.last else None

    def report(self) -> dict[str, Any]:
        """Schedule facts for summary.json; gathers every worker's waits (call on all ranks)."""
        mine = torch.tensor([self.wait_seconds, self.step_seconds], dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.lay.world)]
        dist.all_gather(rows, mine, group=self.group)
        per_stage = []
        for s in range(self.lay.stages):
            ranks = self.lay.stage_ranks(s)
            wait = sum(float(rows[r][0]) for r in ranks)
            busy = sum(float(rows[r][1]) for r in ranks)
            per_stage.append(wait / busy if busy > 0 else None)
        return {
            "schedule": "1f1b",
            "routing": self.routing,
            "microbatches": self.microbatches,
            "bubble_fraction": bubble_fraction(self.lay.stages, self.microbatches),
            "pipeline_wait_fraction_per_stage": per_stage,
        }

    # ---- plumbing --------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dst: int, tag: int, count: bool = True
              ) -> tuple[Any, torch.Tensor, int]:
        # kept alive until the send is waited for; labels keep their integer type
        t = t.detach().to("cpu", t.dtype if not t.is_floating_point() else self.wire)
        t = t.contiguous()
        if count:
            self.activation_bytes += t.numel() * t.element_size()
        with posting("pipeline send", [dst], self.watchdog):  # a peer gone fails at once
            return dist.isend(t, dst=dst, group=self.group, tag=tag), t, dst

    def _recv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        with posting("pipeline receive", [src], self.watchdog):
            return dist.irecv(buf, src=src, group=self.group, tag=tag)

    def _wait(self, works: list[Any], peer: int, op: str) -> None:
        t0 = time.perf_counter()
        try:
            wait_works(works, op, [peer], self.watchdog)
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def state_dict(self) -> dict[str, Any]:
        """The traffic and timing accounting (the stage holds no other state of its own)."""
        return {k: getattr(self, k) for k in _ACCOUNTING}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k in _ACCOUNTING:
            setattr(self, k, sd[k])
