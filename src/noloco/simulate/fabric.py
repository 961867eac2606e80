"""The replicas' network inside one process: a :class:`Fabric` and one
:class:`SimulatedCommunicator` per replica.

Every replica's method talks to its own communicator, exactly as in a distributed run; the
communicators of one fabric post into shared operations instead of a network. Operations
match by position — the k-th operation a replica posts is the k-th of every other replica —
which is the invariant every distributed run already keeps (collectives are issued in the
same order on every rank). An operation's result is computed once, when it is first read,
from every replica's posted tensor, as a tensor operation across the replicas:

- an all-reduce: the sum in rank order, divided by the replicas (what the ring's
  ``SUM`` and ``div_`` give, up to the order of float additions);
- the quantised all-reduce: :func:`noloco.comm.quantized_mean_of`, the very encoding,
  rank-order sums and re-encoding of the distributed one, so the same bits;
- an all-gather: every replica's tensor (shared, read-only), in one
  :class:`noloco.comm.SharedGather` every replica reads, so what a method computes from the
  messages alone is computed once, not once per replica;
- an exchange: each peer's tensor, copied into the receive buffers.

Bytes are counted by the distributed communicator's formulas (:mod:`noloco.comm`), so a
simulated run reports what the same run sends over a network.

Reading a result before every replica has posted its part is a bug of the driver (it must
call every replica's :meth:`noloco.methods.Method.start_outer` before any
:meth:`~noloco.methods.Method.complete_outer`): it raises at once instead of hanging.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from noloco import quant
from noloco.comm import (
    Communicator,
    Pending,
    SharedGather,
    _check_quantizable,
    quantized_all_reduce_bytes,
    quantized_mean_of,
    quantized_messages,
    ring_all_reduce_bytes,
)


class _Op:
    """One operation: its members (the replicas in the run when it started), what each
    posted, and its result once computed."""

    def __init__(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                 members: list[int]) -> None:
        self.kind, self.shape, self.dtype = kind, shape, dtype
        self.members = members
        self.posts: dict[int, torch.Tensor] = {}
        self.unread = set(members)
        self._result: Any = None
        self._done = False

    def result(self, compute: Callable[[], Any]) -> Any:
        if not self._done:
            self._result, self._done = compute(), True
        return self._result


class Fabric:
    """The operations in flight among ``size`` replicas of one process."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a fabric needs at least one replica, got {size}")
        self.size = size
        self._ops: dict[int, _Op] = {}
        self.live = list(range(size))
        """the replicas in the run now, in rank order (churn: :meth:`leave`, :meth:`join`)"""
        self.elastic = False
        """whether members come and go: the communicators say who takes part (members())"""

    def leave(self, rank: int) -> None:
        """``rank`` leaves the run: later operations go on without it; what it posted before
        counts, and what it has not read yet nobody waits for."""
        self.live.remove(rank)
        for seq, op in list(self._ops.items()):
            op.unread.discard(rank)
            if not op.unread and len(op.posts) == len(op.members):
                del self._ops[seq]

    def join(self, rank: int) -> None:
        """``rank`` is in the run again, from the next operation on."""
        self.live = sorted({*self.live, rank})

    def communicators(self) -> list[SimulatedCommunicator]:
        return [SimulatedCommunicator(self, r) for r in range(self.size)]

    def in_flight(self) -> int:
        """Operations not yet read by every replica."""
        return len(self._ops)

    def post(self, seq: int, rank: int, kind: str, tensor: torch.Tensor) -> _Op:
        op = self._ops.get(seq)
        if op is None:
            op = self._ops[seq] = _Op(kind, tuple(tensor.shape), tensor.dtype, list(self.live))
        elif (op.kind, op.shape, op.dtype) != (kind, tuple(tensor.shape), tensor.dtype):
            raise RuntimeError(
                f"replica {rank} posted {kind} {tuple(tensor.shape)} {tensor.dtype} as "
                f"operation {seq}, which the others posted as {op.kind} {op.shape} {op.dtype}: "
                f"the replicas' schedules differ")
        op.posts[rank] = tensor
        return op

    def read(self, seq: int, rank: int, op: _Op, compute: Callable[[list[torch.Tensor]], Any]
             ) -> Any:
        """The result of operation ``seq`` for ``rank``; the operation is forgotten once
        every replica has read it."""
        missing = [r for r in op.members if r not in op.posts and r in self.live]
        if missing:
            raise RuntimeError(f"replica {rank} waited for {op.kind} (operation {seq}) before "
                               f"replicas {missing} started it: the driver must start every "
                               f"replica's operations before it completes any")
        out = op.result(lambda: compute({r: op.posts[r] for r in op.members if r in op.posts}))
        op.unread.discard(rank)
        if not op.unread:
            del self._ops[seq]
        return out


class SimulatedCommunicator(Communicator):
    """Replica ``rank``'s door to a :class:`Fabric` (the module docstring)."""

    def __init__(self, fabric: Fabric, rank: int) -> None:
        super().__init__()
        self.fabric, self.rank, self.size = fabric, rank, fabric.size
        self._seq = 0

    def members(self) -> list[int] | None:
        """None while every replica is always in (a static run); with churn, the replicas in
        the run now (as an elastic run's snapshot)."""
        return list(self.fabric.live) if self.fabric.elastic else None

    @property
    def seq(self) -> int:
        """operations started so far (a joining replica takes its donor's)"""
        return self._seq

    @seq.setter
    def seq(self, value: int) -> None:
        self._seq = value

    def _start(self, kind: str, tensor: torch.Tensor,
               compute: Callable[[dict[int, torch.Tensor]], Any],
               finish: Callable[[Any], Any]) -> Pending:
        self.ops[kind] += 1
        seq, self._seq = self._seq, self._seq + 1
        op = self.fabric.post(seq, self.rank, kind, tensor)
        return Pending(self, [], lambda: finish(self.fabric.read(seq, self.rank, op, compute)))

    def _taking_part(self) -> int:
        """How many replicas the operation about to start has."""
        return len(self.fabric.live)

    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        self.bytes_sent += ring_all_reduce_bytes(tensor.numel() * tensor.element_size(),
                                                 self._taking_part())
        return self._start("all_reduce", tensor, _mean, tensor.copy_)

    def all_reduce_mean_quantized_async(self, tensor: torch.Tensor, fmt: str,
                                        block_size: int = quant.DEFAULT_BLOCK_SIZE) -> Pending:
        if fmt == "none":
            return self.all_reduce_mean_async(tensor)
        _check_quantizable(tensor, fmt, block_size)
        k = self._taking_part()
        if self.size == 1:  # the mean of one is itself (TorchCommunicator does the same)
            self.ops["all_reduce_quantized"] += 1
            return Pending(self, [])
        n = tensor.numel()
        send = quantized_messages(tensor, k, fmt, block_size)
        self.bytes_sent += quantized_all_reduce_bytes(n, k, fmt, block_size)
        return self._start("all_reduce_quantized", send,
                           lambda sends: quantized_mean_of(list(sends.values()), n, fmt,
                                                           block_size),
                           tensor.copy_)

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        self.bytes_sent += (self._taking_part() - 1) * tensor.numel() * tensor.element_size()
        size = self.size

        def gathered(sends: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
            # by replica, None for one not in the operation (as an elastic all-gather);
            # every replica reads the same list: the messages are read, never changed
            return SharedGather([sends.get(r) for r in range(size)])

        return self._start("all_gather", tensor.contiguous(), gathered, lambda got: got)

    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int],
                       out: Sequence[torch.Tensor] | None = None) -> Pending:
        tensor = tensor.contiguous()
        bufs = list(out) if out is not None else [torch.empty_like(tensor) for _ in peers]
        for peer, buf in zip(peers, bufs, strict=True):
            if not 0 <= peer < self.size or peer == self.rank:
                raise ValueError(f"bad peer {peer} for rank {self.rank} of {self.size}")
            if buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                raise ValueError("exchange: every receive buffer must be shaped like the "
                                 "tensor sent")
        self.bytes_sent += len(peers) * tensor.numel() * tensor.element_size()
        peers = list(peers)

        def finish(everyone: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            for peer, buf in zip(peers, bufs, strict=True):
                buf.copy_(everyone[peer])
            return bufs

        return self._start("exchange", tensor, dict, finish)


def _mean(posts: dict[int, torch.Tensor]) -> torch.Tensor:
    """Σ in rank order, then ÷ the replicas taking part: one buffer, whatever N."""
    xs = [posts[r] for r in sorted(posts)]
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    return total.div_(len(xs))
