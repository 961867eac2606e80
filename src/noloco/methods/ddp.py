"""Synchronous data parallel (SPEC §1), the baseline every claim is measured against.

After every backward pass the gradients of all N replicas are averaged (S bytes of all-reduce
per inner step), so every replica takes the same optimizer step and the replicas never drift
apart. It is done the way ``torch.nn.parallel.DistributedDataParallel`` does it, so that the
baseline is not handicapped:

- gradients go into buckets of about ``bucket_mb`` MiB (the first 1 MiB, to start early),
  filled in reverse parameter order — roughly the order the backward pass produces them;
- a bucket's all-reduce starts as soon as its last gradient has been accumulated (a
  post-accumulate-grad hook), overlapping with the rest of the backward pass, and
  :meth:`DDP.sync_gradients` only waits for what is still in flight;
- the buckets' flat buffers are allocated once and reused.

Invariant: buckets are started in one fixed order on every rank — a ready bucket waits for
the ones before it — because collectives must be issued in the same order everywhere, and
the order in which gradients become ready may differ between ranks. The overlap assumes
one backward pass per optimizer step: with more (a pipeline stage runs one per microbatch;
gradient accumulation) pass ``overlap=False``, which starts every bucket in
:meth:`DDP.sync_gradients`.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from noloco.comm import Communicator, Pending
from noloco.methods.base import Method

FIRST_BUCKET_MB = 1.0


def bucket_layout(numels: Sequence[int], bucket_mb: float = 25.0) -> list[list[int]]:
    """Parameter indices per bucket, in the order buckets start: from the last parameter
    (whose gradient is ready first in backward) to the first; the first bucket holds up to
    FIRST_BUCKET_MB, the others up to ``bucket_mb`` (fp32 gradients)."""
    buckets: list[list[int]] = []
    size, cap = 0, min(FIRST_BUCKET_MB, bucket_mb) * 2**20
    for i in reversed(range(len(numels))):
        nbytes = numels[i] * 4
        if buckets and size + nbytes <= cap:
            buckets[-1].append(i)
            size += nbytes
        else:
            if buckets:
                cap = bucket_mb * 2**20
            buckets.append([i])
            size = nbytes
    return buckets


class DDP(Method):
    name = "ddp"

    def __init__(self, model: nn.Module | Iterable[torch.Tensor], comm: Communicator,
                 bucket_mb: float = 25.0, overlap: bool = True) -> None:
        super().__init__(model, comm)
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.buckets = bucket_layout([p.numel() for p in self.params], bucket_mb)
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        dev = self.params[0].device
        self.flat = [torch.zeros(sum(self.params[i].numel() for i in b), device=dev)
                     for b in self.buckets]
        self._missing = [len(b) for b in self.buckets]
        self._pending: list[Pending] = []
        if overlap and comm.size > 1:
            for i, p in enumerate(self.params):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))

    def _ready(self, i: int) -> None:
        k = self.bucket_of[i]
        self._missing[k] -= 1
        while len(self._pending) < len(self.buckets) and self._missing[len(self._pending)] == 0:
            self._start(len(self._pending))

    @torch.no_grad()
    def _start(self, k: int) -> None:
        offset = 0
        for i in self.buckets[k]:
            p, view = self.params[i], self.flat[k][offset: offset + self.params[i].numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            offset += p.numel()
        self._pending.append(self.comm.all_reduce_mean_async(self.flat[k]))

    @torch.no_grad()
    def sync_gradients(self) -> None:
        if self.comm.size == 1:
            return
        for k in range(len(self._pending), len(self.buckets)):
            self._start(k)  # in bucket order, whatever was not started during backward
        for k, pending in enumerate(self._pending):
            pending.wait()
            offset = 0
            for i in self.buckets[k]:
                p = self.params[i]
                mean = self.flat[k][offset: offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = mean.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(mean)
                offset += p.numel()
        self._pending.clear()
        self._missing = [len(b) for b in self.buckets]
