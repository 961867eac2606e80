"""The communicator: the only door between an algorithm and the network.

Algorithms receive a :class:`Communicator` explicitly (never the implicit default process
group), so a test can hand them an instrumented one and a single process can run with the
no-op :class:`NullCommunicator` through exactly the same code path.

Accounting, per rank:
- ``bytes_sent``: for point-to-point operations the payload actually sent. For an all-reduce
  of S bytes over N ranks, the bandwidth-optimal ring model, 2·(N−1)/N·S (a reduce-scatter
  and an all-gather, each sending (N−1)/N·S) — what the papers count, and independent of the
  algorithm gloo or NCCL happens to pick.
- ``sync_seconds``: wall-clock seconds this rank spent blocked waiting for communication
  (time inside a blocking call, or inside ``wait()`` of an asynchronous handle).
- ``ops``: a count of each operation kind, so tests can assert the communication schedule
  (for example that NoLoCo never issues a collective).

Every operation can time out (``timeout`` of the process group) instead of hanging forever.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Pending:
    """An operation in flight. ``wait()`` blocks (counted as sync time) and returns its result."""

    def __init__(self, comm: Communicator, works: Sequence[Any],
                 finish: Callable[[], Any] | None = None) -> None:
        self._comm, self._works, self._finish = comm, list(works), finish
        self._done, self._result = False, None

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        if not self._done:
            t0 = time.perf_counter()
            for w in self._works:
                w.wait()
            self._comm.sync_seconds += time.perf_counter() - t0
            self._result = self._finish() if self._finish else None
            self._done = True
        return self._result


class Communicator(ABC):
    """Collectives and point-to-point exchange among ``size`` ranks, indexed 0..size-1."""

    rank: int = 0
    size: int = 1

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.sync_seconds = 0.0
        self.ops: Counter[str] = Counter()

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce_mean(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` in place over all ranks; blocks."""
        self.all_reduce_mean_async(tensor).wait()

    @abstractmethod
    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        """Start averaging ``tensor`` in place; the result is there after ``wait()``."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order; blocks."""
        return self.all_gather_async(tensor).wait()

    @abstractmethod
    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        """Start gathering; ``wait()`` returns the list of every rank's tensor."""

    # ---- point to point ------------------------------------------------------------------
    def exchange(self, tensor: torch.Tensor, peers: Sequence[int]) -> list[torch.Tensor]:
        """Send ``tensor`` to every peer and receive each peer's tensor of the same shape."""
        return self.exchange_async(tensor, peers).wait()

    @abstractmethod
    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int]) -> Pending:
        """Start an exchange; ``wait()`` returns the peers' tensors in ``peers`` order."""

    def stats(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent, "sync_seconds": self.sync_seconds,
                "ops": dict(self.ops)}


def ring_all_reduce_bytes(nbytes: int, size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``size`` ranks."""
    return 0 if size <= 1 else (2 * (size - 1) * nbytes) // size


class NullCommunicator(Communicator):
    """One rank alone: every operation is a no-op that completes at once and sends nothing."""

    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        self.ops["all_reduce"] += 1
        return Pending(self, [])

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        self.ops["all_gather"] += 1
        return Pending(self, [], lambda: [tensor.clone()])

    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int]) -> Pending:
        if peers:
            raise ValueError("a single rank has no peers to exchange with")
        self.ops["exchange"] += 1
        return Pending(self, [], lambda: [])


class TorchCommunicator(Communicator):
    """A torch.distributed process group (gloo on CPU, NCCL on GPU).

    ``ranks`` are the global ranks of the group's members; this object speaks in group
    indices (0..size-1) so an algorithm never needs to know the global layout.
    """

    def __init__(self, ranks: Sequence[int] | None = None, group: Any = None,
                 timeout: float | None = None, backend: str | None = None) -> None:
        super().__init__()
        if ranks is None:
            ranks = list(range(dist.get_world_size()))
        self.ranks = list(ranks)
        if group is None:
            # new_group is collective over the WORLD: every rank must create the same groups
            # in the same order, members or not, or the job deadlocks.
            kw = {"timeout": timedelta(seconds=timeout)} if timeout else {}
            group = dist.new_group(self.ranks, backend=backend, **kw)
        self.group = group
        me = dist.get_rank()
        self.size = len(self.ranks)
        self.rank = self.ranks.index(me) if me in self.ranks else -1

    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        self.ops["all_reduce"] += 1
        self.bytes_sent += ring_all_reduce_bytes(tensor.numel() * tensor.element_size(),
                                                 self.size)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        size = self.size

        def finish() -> None:
            tensor.div_(size)

        return Pending(self, [work], finish)

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        self.ops["all_gather"] += 1
        self.bytes_sent += (self.size - 1) * tensor.numel() * tensor.element_size()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        work = dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True)
        return Pending(self, [work], lambda: out)

    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int]) -> Pending:
        self.ops["exchange"] += 1
        tensor = tensor.contiguous()
        bufs = [torch.empty_like(tensor) for _ in peers]
        ops = []
        for peer, buf in zip(peers, bufs, strict=True):
            if not 0 <= peer < self.size or peer == self.rank:
                raise ValueError(f"bad peer {peer} for rank {self.rank} of {self.size}")
            # Sends and receives are posted together, so two peers sending to each other at
            # the same moment cannot deadlock waiting for the other's receive.
            ops.append(dist.P2POp(dist.isend, tensor, group=self.group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer))
        self.bytes_sent += len(peers) * tensor.numel() * tensor.element_size()
        works = dist.batch_isend_irecv(ops) if ops else []
        return Pending(self, works, lambda: bufs)


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One contiguous 1-D copy of ``tensors`` (one message instead of many)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (inverse of flatten)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset: offset + n].view_as(t))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat buffer holds {flat.numel()} values, tensors need {offset}")
