"""Host staging: a communicator's traffic moved through host memory, for a backend that reads
only host memory.

Workers that share a GPU cannot use NCCL (it refuses two ranks on one device), and gloo
cannot send a CUDA tensor point to point (the process dies in ``writev``). An elastic run's
traffic is gloo's always (it crosses the internet). :class:`HostStaged` wraps any
:class:`~noloco.comm.Communicator` so that what the inner one sees is host memory:

- a payload is copied device → host into a pinned buffer, on a side stream that first waits
  for the work queued so far (the copy reads what the training stream wrote), and the host
  waits for that copy only — the host must hold the bytes before gloo may read them;
- the inner communicator runs its operation, with its own accounting, on the host copy
  (bytes are counted on what it sends, so they are the unstaged run's to the byte);
- when the operation is waited for, its result is copied back host → device on the caller's
  stream (asynchronous: pinned memory), into the caller's tensor or receive buffers;
- buffers are pooled by shape and dtype: one is in use by at most one operation in flight,
  and goes back to the pool with the event of its last copy, which its next user waits for.

The quantised all-reduce is the exception: its fp32 values never cross. The inner
communicator encodes, takes the chunk means and decodes where the tensor is (on the GPU: the
codec is ~50x faster there than on the host), and only the encoded messages of its two phases
go through host memory (``host_phases``, :func:`noloco.comm.via_host`): an eighth of the
bytes at 4 bits.

The arithmetic is the inner communicator's, on the same values: a staged run equals an
unstaged one bit for bit on CPU (the same code runs with host tensors on both sides, which
is how the tests check it without a GPU), and on a GPU it differs only by the reduction
running on the host instead of the device.

Everything that is not an operation (the counters, an elastic communicator's state and
protocol) is the inner communicator's: attribute reads and writes pass through.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from noloco import quant
from noloco.comm import Communicator, Pending, is_skipped


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch) on ``device`` without the host waiting for the device: to a GPU
    through pinned memory with ``non_blocking`` (a copy from pageable memory waits for every
    kernel queued before it, so a loop that uploads its batch that way stops running ahead of
    the GPU at every step). The pinned block is the caching host allocator's: it is not reused
    before the copy that reads it has run. Elsewhere a plain ``to``."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class _Pool:
    """Host buffers by (shape, dtype); pinned when the device is a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[torch.Tensor, Any]]] = (
            defaultdict(list))
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        free = self._free[(tuple(shape), dtype)]
        if free:
            buf, event = free.pop()
            if event is not None:
                event.synchronize()  # its last copy back to the device read it
            return buf
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.cuda)

    def give(self, buf: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        self._free[(tuple(buf.shape), buf.dtype)].append((buf, event))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (complete when this returns)."""
        buf = self.take(t.shape, t.dtype)
        if self.cuda and t.device.type == "cuda":
            assert self.side is not None
            self.side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.side):
                buf.copy_(t, non_blocking=True)
                t.record_stream(self.side)
            self.side.synchronize()
        else:
            buf.copy_(t)
        return buf

    def back(self, bufs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
        """Copy each host buffer into its device tensor, then return the buffers."""
        for b, d in zip(bufs, dsts, strict=True):
            d.copy_(b, non_blocking=self.cuda)
        event = None
        if self.cuda and bufs:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        for b in bufs:
            self.give(b, event)


class _Staged(Pending):
    """The inner operation in flight; ``after`` turns its host result into the caller's."""

    def __init__(self, comm: Communicator, inner: Pending, after: Callable[[Any], Any],
                 release: Callable[[], Any]) -> None:
        super().__init__(comm, [])
        self._inner, self._after, self._release = inner, after, release

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()

    def wait(self) -> Any:
        if not self._done:
            try:
                got = self._inner.wait()
            except BaseException:  # failed: its buffers go back, nothing was copied
                self._release()
                raise
            self._result = self._after(got)
            self._done = True
        return self._result


class HostStaged(Communicator):
    """``inner``'s operations on host copies of ``device`` tensors (module docstring)."""

    def __init__(self, inner: Communicator, device: torch.device) -> None:
        # No Communicator.__init__: the counters are the inner communicator's.
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_pool", _Pool(device))
        inner.host_phases = True  # the quantised all-reduce: only encoded bytes cross

    # ---- everything but the operations is the inner communicator's ---------------------------
    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    @property
    def inner(self) -> Communicator:
        return self._inner

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self._inner.rank

    @property
    def size(self) -> int:  # type: ignore[override]
        return self._inner.size

    @property
    def may_skip(self) -> bool:  # type: ignore[override]
        return self._inner.may_skip

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._inner.load_state_dict(sd)

    def members(self) -> list[int] | None:
        return self._inner.members()

    # ---- the operations, staged ---------------------------------------------------------------
    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        host = self._pool.to_host(tensor)
        try:
            inner = self._inner.all_reduce_mean_async(host)
        except BaseException:
            self._pool.give(host)
            raise
        return self._in_place(tensor, host, inner)

    def all_reduce_mean_quantized_async(self, tensor: torch.Tensor, fmt: str,
                                        block_size: int = quant.DEFAULT_BLOCK_SIZE) -> Pending:
        if fmt == "none":
            return self.all_reduce_mean_async(tensor)
        # Not the fp32 values: the inner communicator encodes, reduces and decodes where the
        # tensor is (on a GPU, ~50x faster than the host's codec) and moves only the encoded
        # messages through host memory (its host_phases, set above).
        return self._inner.all_reduce_mean_quantized_async(tensor, fmt, block_size)

    def _in_place(self, tensor: torch.Tensor, host: torch.Tensor, inner: Pending) -> Pending:
        def after(result: Any) -> Any:
            if is_skipped(result):  # nobody stepped: no trace
                self._pool.give(host)
            else:
                self._pool.back([host], [tensor])
            return result

        return _Staged(self, inner, after, lambda: self._pool.give(host))

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        host = self._pool.to_host(tensor)
        device = tensor.device
        try:
            inner = self._inner.all_gather_async(host)
        except BaseException:
            self._pool.give(host)
            raise

        def after(result: Any) -> Any:
            self._pool.give(host)
            if is_skipped(result):
                return result
            # None: a replica that took no part (an elastic all-gather's outcome)
            return [r.to(device, non_blocking=True) if r is not None else None
                    for r in result]

        return _Staged(self, inner, after, lambda: self._pool.give(host))

    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int],
                       out: Sequence[torch.Tensor] | None = None) -> Pending:
        host = self._pool.to_host(tensor)
        recv = [self._pool.take(tensor.shape, tensor.dtype) for _ in peers]
        dsts = list(out) if out is not None else [torch.empty_like(tensor) for _ in peers]
        try:
            inner = self._inner.exchange_async(host, peers, recv)
        except BaseException:
            for b in (host, *recv):
                self._pool.give(b)
            raise

        def after(result: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
            got = [i for i, r in enumerate(result) if r is not None]  # None: absent peer
            self._pool.back([recv[i] for i in got], [dsts[i] for i in got])
            for i in set(range(len(recv))) - set(got):
                self._pool.give(recv[i])
            self._pool.give(host)
            return [dsts[i] if r is not None else None for i, r in enumerate(result)]

        return _Staged(self, inner, after,
                       lambda: [self._pool.give(b) for b in (host, *recv)])
