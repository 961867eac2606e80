"""The communicator: the only door between an algorithm and the network.

Algorithms receive a :class:`Communicator` explicitly (never the implicit default process
group), so a test can hand them an instrumented one and a single process can run with the
no-op :class:`NullCommunicator` through exactly the same code path.

Accounting, per rank:
- ``bytes_sent``: for point-to-point operations the payload actually sent. For an all-reduce
  of S bytes over N ranks, the bandwidth-optimal ring model, 2·(N−1)/N·S (a reduce-scatter
  and an all-gather, each sending (N−1)/N·S) — what the papers count, and independent of the
  algorithm gloo or NCCL happens to pick.
  A quantised all-reduce (:meth:`Communicator.all_reduce_mean_quantized_async`) counts the
  encoded messages really sent in both of its phases.
- ``sync_seconds``: wall-clock seconds this rank spent blocked waiting for communication
  (time inside a blocking call, or inside ``wait()`` of an asynchronous handle).
- ``ops``: a count of each operation kind, so tests can assert the communication schedule
  (for example that NoLoCo never issues a collective).

Every operation can time out (``timeout`` of the process group) instead of hanging forever.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from noloco import quant

if TYPE_CHECKING:
    from noloco.integrity import Sealer
    from noloco.watchdog import Watchdog


class CommError(RuntimeError):
    """A communication that failed or timed out, with the rank to blame when one is known."""

    def __init__(self, message: str, culprit: int | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit


SKIPPED = "skipped"
"""The result of an all-reduce that did not take place and must leave no trace: the replica
keeps its slow weights and fast weights as they are, as though the outer step were not due
(an elastic replica that cannot reach the run's store: the others cannot know whether it
stepped, so it does not). A string, not an object of its own: a sync in flight is saved with
its result in checkpoints and join states, which hold plain values — ask :func:`is_skipped`."""


def is_skipped(result: Any) -> bool:
    """Whether an operation's result is :data:`SKIPPED` (as computed, or read back from a
    checkpoint or a join state)."""
    return isinstance(result, str) and result == SKIPPED


class SharedGather(list):
    """An all-gather's result that every replica of one process reads alike (the simulator,
    :mod:`noloco.simulate.fabric`, hands its N replicas the same list). What is computed
    from the messages alone — the same on every replica by design, since every replica must
    reach the same bits — is computed once for all of them (:func:`computed_once`) instead
    of N times: N replicas decoding N messages each is N² work."""

    def __init__(self, items: Sequence[Any]) -> None:
        super().__init__(items)
        self.memo: dict[Any, Any] = {}


def computed_once(gathered: Sequence[Any], key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, or its value for ``key`` when ``gathered`` is a :class:`SharedGather`
    another replica computed it for. The value is shared: read it, never change it."""
    if not isinstance(gathered, SharedGather):
        return compute()
    if key not in gathered.memo:
        gathered.memo[key] = compute()
    return gathered.memo[key]


class Pending:
    """An operation in flight. ``wait()`` blocks (counted as sync time) and returns its result.

    ``op`` and ``ranks`` (the global ranks waited for) are what a stall warning or a failure
    reports; a failure raises :class:`CommError`.
    """

    def __init__(self, comm: Communicator, works: Sequence[Any],
                 finish: Callable[[], Any] | None = None, op: str = "",
                 ranks: Sequence[int] = ()) -> None:
        self._comm, self._works, self._finish = comm, list(works), finish
        self._op, self._ranks = op, tuple(ranks)
        self._done, self._result = False, None

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        if not self._done:
            t0 = time.perf_counter()
            try:
                wait_works(self._works, self._op, self._ranks, self._comm.watchdog)
            finally:
                self._comm.sync_seconds += time.perf_counter() - t0
            self._result = self._finish() if self._finish else None
            self._done = True
        return self._result


def wait_works(works: Sequence[Any], op: str, ranks: Sequence[int], watchdog: Watchdog | None = None
               ) -> None:
    """Wait for torch ``Work`` handles that wait on ``ranks`` (global ranks) in ``op``: the
    watchdog (a :class:`noloco.watchdog.Watchdog`, optional) sees the wait, and a failure is
    a :class:`CommError` that names the rank to blame when it can be told."""
    t0 = time.perf_counter()
    try:
        with watchdog.waiting(op, ranks) if watchdog else contextlib.nullcontext():
            for w in works:
                w.wait()
    except RuntimeError as e:
        raise comm_error(watchdog, op, ranks, e, time.perf_counter() - t0) from e


@contextlib.contextmanager
def posting(op: str, ranks: Sequence[int], watchdog: Watchdog | None = None) -> Iterator[None]:
    """Around the call that starts an operation: a peer already gone can make it fail at
    once (gloo: "Connection closed by peer"); that too is a :class:`CommError`."""
    try:
        yield
    except RuntimeError as e:
        raise comm_error(watchdog, op, ranks, e, 0.0) from e


def comm_error(watchdog: Watchdog | None, op: str, ranks: Sequence[int], error: RuntimeError,
               waited: float) -> CommError:
    """``error`` of an operation on ``ranks`` as a :class:`CommError`, naming the rank to
    blame when the watchdog can tell."""
    if isinstance(error, CommError):
        return error
    if watchdog is not None:
        culprit, line = watchdog.explain(op, ranks, error, waited)
        return CommError(line, culprit)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return CommError(f"{op} failed after {waited:.1f} s waiting for ranks {list(ranks)}: "
                     f"{first}")


class Communicator(ABC):
    """Collectives and point-to-point exchange among ``size`` ranks, indexed 0..size-1."""

    rank: int = 0
    size: int = 1
    may_skip: bool = False
    """an all-reduce or all-gather may come back :data:`SKIPPED` (nobody stepped): an
    elastic run's, when the store is out of reach or every attempt aborted"""
    host_phases: bool = False
    """the quantised all-reduce's two phases move host copies of the encoded messages, while
    encoding, decoding and the chunk means run where the tensor is (:func:`via_host`): set by
    :class:`noloco.staging.HostStaged`, so a GPU's codec work stays on the GPU and only a
    quarter byte a value crosses to the host"""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.sync_seconds = 0.0
        self.ops: Counter[str] = Counter()
        self.watchdog: Watchdog | None = None
        """a :class:`noloco.watchdog.Watchdog`: names the peer a stalled or failed wait is
        blocked on (None: plain errors)"""
        self.sealer: Sealer | None = None
        """a :class:`noloco.integrity.Sealer` when payloads carry MACs (an elastic run with a
        run secret); their tags' bytes are counted in ``mac_bytes``, not ``bytes_sent``"""
        self.mac_bytes = 0

    # ---- accounting --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The accounting (bytes, blocked seconds, operation counts), for checkpoints."""
        return {"bytes_sent": self.bytes_sent, "sync_seconds": self.sync_seconds,
                "ops": dict(self.ops), "mac_bytes": self.mac_bytes}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.bytes_sent = int(sd["bytes_sent"])
        self.sync_seconds = float(sd["sync_seconds"])
        self.ops = Counter(sd["ops"])
        self.mac_bytes = int(sd.get("mac_bytes", 0))

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Traffic that is not training traffic (metrics, final averages): the accounting is
        left as it was."""
        saved = self.state_dict()
        try:
            yield
        finally:
            self.load_state_dict(saved)

    # ---- collectives ---------------------------------------------------------------------
    def members(self) -> list[int] | None:
        """The ranks taking part in the next operation: None for all of them (a static
        group; an elastic one, :mod:`noloco.elastic`, says who is alive)."""
        return None

    def all_reduce_mean(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` in place over all ranks; blocks."""
        self.all_reduce_mean_async(tensor).wait()

    @abstractmethod
    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        """Start averaging ``tensor`` in place; the result is there after ``wait()``."""

    def all_reduce_mean_quantized_async(self, tensor: torch.Tensor, fmt: str,
                                        block_size: int = quant.DEFAULT_BLOCK_SIZE) -> Pending:
        """Start averaging the 1-D fp32 ``tensor`` in place, every message quantised to ``fmt``.

        ``fmt == "none"`` is the exact :meth:`all_reduce_mean_async`. Otherwise every rank
        ends with bit-identical values ≈ the mean (see :class:`TorchCommunicator` for the
        exchange and its error). A NaN or inf in ``tensor`` raises ``ValueError`` here, at
        the call, before anything is sent.
        """
        if fmt == "none":
            return self.all_reduce_mean_async(tensor)
        raise NotImplementedError(f"{type(self).__name__} has no quantised all-reduce")

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order; blocks."""
        return self.all_gather_async(tensor).wait()

    @abstractmethod
    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        """Start gathering; ``wait()`` returns the list of every rank's tensor."""

    # ---- point to point ------------------------------------------------------------------
    def exchange(self, tensor: torch.Tensor, peers: Sequence[int],
                 out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Send ``tensor`` to every peer and receive each peer's tensor of the same shape."""
        return self.exchange_async(tensor, peers, out).wait()

    @abstractmethod
    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int],
                       out: Sequence[torch.Tensor] | None = None) -> Pending:
        """Start an exchange; ``wait()`` returns the peers' tensors in ``peers`` order —
        received into ``out`` (one tensor per peer, like ``tensor``) when given: a caller
        that exchanges the same payload again and again keeps its receive buffers, instead
        of page-faulting fresh ones every time."""



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

    def all_reduce_mean_quantized_async(self, tensor: torch.Tensor, fmt: str,
                                        block_size: int = quant.DEFAULT_BLOCK_SIZE) -> Pending:
        # The mean of one rank is itself: nothing crosses a wire, so nothing is rounded, but a
        # non-finite value is refused as it would be with peers.
        if fmt == "none":
            return self.all_reduce_mean_async(tensor)
        self.ops["all_reduce_quantized"] += 1
        _check_quantizable(tensor, fmt, block_size)
        return Pending(self, [])

    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int],
                       out: Sequence[torch.Tensor] | None = None) -> Pending:
        if peers:
            raise ValueError("a single rank has no peers to exchange with")
        self.ops["exchange"] += 1
        return Pending(self, [], lambda: [])


class TorchCommunicator(Communicator):
    """A torch.distributed process group (gloo on CPU, NCCL on GPU).

    ``ranks`` are the global ranks of the group's members; this object speaks in group
    indices (0..size-1) so an algorithm never needs to know the global layout.

    The quantised all-reduce is a reduce-scatter then an all-gather, both on encoded bytes:
    the flat tensor (n values) is zero-padded to N equal chunks of c values, c a multiple of
    the quantiser's block so chunks never share a scale. Phase 1 (all-to-all): every rank
    encodes chunk j and sends it to rank j, which decodes the N messages and sums them in
    fp32 in rank order, then divides by N. Phase 2 (all-gather): rank j encodes its reduced
    chunk and every rank receives every chunk. Every rank decodes the same bytes, so all end
    bit-identical. Bytes sent per rank: 2·(N−1)·``quant.wire_bytes(c, fmt)``, about
    2·(N−1)/N·(n/2 + 4·n/256) for FP4 — the ring all-reduce's 2·(N−1)/N·S scaled by 4.125/32.
    Error: each value is quantised twice (its own contribution, then the reduced chunk).

    The phases run on one helper thread per communicator (the decode-sum-encode between them
    is computation, which gloo cannot chain), so the caller keeps computing while they
    progress; the caller's thread only encodes phase 1 (where a NaN raises at once).
    Protocol invariant: while a helper job runs, no other collective may be issued in this
    process — on this group or on any other (the metrics world group, another stage's group).
    Ranks must issue the collectives of every communicator in the same order, or they pair
    the wrong operations and deadlock; NCCL even requires one order across its communicators.
    A helper job's timing differs from rank to rank, so only "nothing else meanwhile" is the
    same everywhere. Every operation of every TorchCommunicator therefore first waits for the
    helper jobs of all of them (:func:`_drain_helpers`), by construction.
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
        self._helper: _HelperThread | None = None
        self._side: dict[int, torch.cuda.Stream] = {}  # the helper's own stream, per GPU

    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        self._drain()
        self.ops["all_reduce"] += 1
        self.bytes_sent += ring_all_reduce_bytes(tensor.numel() * tensor.element_size(),
                                                 self.size)
        with posting("all_reduce", self.ranks, self.watchdog):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group,
                                   async_op=True)
        size = self.size

        def finish() -> None:
            tensor.div_(size)

        return Pending(self, [work], finish, "all_reduce", self.ranks)

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        self._drain()
        self.ops["all_gather"] += 1
        self.bytes_sent += (self.size - 1) * tensor.numel() * tensor.element_size()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        with posting("all_gather", self.ranks, self.watchdog):
            work = dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True)
        return Pending(self, [work], lambda: out, "all_gather", self.ranks)

    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int],
                       out: Sequence[torch.Tensor] | None = None) -> Pending:
        self._drain()
        self.ops["exchange"] += 1
        tensor = tensor.contiguous()
        bufs = list(out) if out is not None else [torch.empty_like(tensor) for _ in peers]
        if any(b.shape != tensor.shape or b.dtype != tensor.dtype or not b.is_contiguous()
               or b.device != tensor.device for b in bufs):
            raise ValueError("exchange: every receive buffer must be contiguous, shaped like "
                             "the tensor sent and on its device")
        recvs, sends = [], []
        for peer, buf in zip(peers, bufs, strict=True):
            if not 0 <= peer < self.size or peer == self.rank:
                raise ValueError(f"bad peer {peer} for rank {self.rank} of {self.size}")
            # Sends and receives are posted together, so two peers sending to each other at
            # the same moment cannot deadlock waiting for the other's receive.
            recvs.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer))
            sends.append(dist.P2POp(dist.isend, tensor, group=self.group, group_peer=peer))
        self.bytes_sent += len(peers) * tensor.numel() * tensor.element_size()
        # Receives first: gloo starts a send only when the peer's "receive ready" notice has
        # arrived, on the same TCP stream as the peer's data. Posted after a send, that notice
        # queues behind this rank's whole payload and the two directions run one after the
        # other (2x slower on a slow link; benchmarks/wan.py measures it).
        with posting("exchange", [self.ranks[p] for p in peers], self.watchdog):
            works = dist.batch_isend_irecv(recvs + sends) if sends else []
        return Pending(self, works, lambda: bufs, "exchange", [self.ranks[p] for p in peers])


    def all_reduce_mean_quantized_async(self, tensor: torch.Tensor, fmt: str,
                                        block_size: int = quant.DEFAULT_BLOCK_SIZE) -> Pending:
        if fmt == "none":
            return self.all_reduce_mean_async(tensor)
        _check_quantizable(tensor, fmt, block_size)
        self._drain()
        self.ops["all_reduce_quantized"] += 1
        n, size, group = tensor.numel(), self.size, self.group
        if size == 1:
            return Pending(self, [])
        send = quantized_messages(tensor, size, fmt, block_size)
        self.bytes_sent += quantized_all_reduce_bytes(n, size, fmt, block_size)

        transport = (lambda recv, sent: dist.all_to_all_single(recv, sent, group=group),
                     lambda out, x: dist.all_gather(out, x, group=group))
        if self.host_phases:
            transport = via_host(*transport)

        ready = None
        if send.is_cuda:  # the encode, as queued on the caller's stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(send.device))

        def phases() -> tuple[torch.Tensor, Any]:
            if ready is None:
                return quantized_mean(send, n, size, fmt, block_size, *transport), None
            # This thread's own current device (NCCL calls run on it) and a stream of its
            # own: on the caller's, its copies, kernels and NCCL calls would wait for every
            # training kernel queued after the encode, and the overlap would be lost.
            torch.cuda.set_device(send.device)
            gpu = send.device.index or 0
            if gpu not in self._side:
                self._side[gpu] = torch.cuda.Stream(send.device)
            side = self._side[gpu]
            side.wait_event(ready)
            send.record_stream(side)  # not reused by the caller's stream before side read it
            with torch.cuda.stream(side):
                out = quantized_mean(send, n, size, fmt, block_size, *transport)
                done = torch.cuda.Event()
                done.record(side)
            return out, done

        if self._helper is None:
            self._helper = _HelperThread(f"noloco-comm-{id(self):x}")
        fut = self._helper.submit(phases)
        _HELPER_JOBS.append(fut)

        def finish() -> None:
            out, done = fut.result()
            if done is not None:  # the caller's stream waits for the helper's last kernel
                here = torch.cuda.current_stream(out.device)
                here.wait_event(done)
                out.record_stream(here)
            tensor.copy_(out)

        return Pending(self, [_FutureWork(fut)], finish, "all_reduce_quantized", self.ranks)

    def _drain(self) -> None:
        """Wait (as blocked time) until no helper job of any communicator can issue a
        collective (the protocol invariant in the class docstring)."""
        t0 = time.perf_counter()
        if _drain_helpers(self.watchdog, self.ranks):
            self.sync_seconds += time.perf_counter() - t0


_HELPER_JOBS: list[Future] = []
"""helper-thread jobs of every TorchCommunicator of this process, oldest first"""


def _drain_helpers(watchdog: Watchdog | None, ranks: Sequence[int]) -> bool:
    """Wait for every helper job in flight; True if there was one. A failure is raised by
    its own Pending.wait(), not here."""
    jobs = [f for f in _HELPER_JOBS if not f.done()]
    _HELPER_JOBS.clear()
    if jobs:
        wait_works([_FutureWork(f, raise_errors=False) for f in jobs], "all_reduce_quantized",
                   ranks, watchdog)
    return bool(jobs)


def quantized_chunk_numel(numel: int, size: int, block_size: int = quant.DEFAULT_BLOCK_SIZE
                          ) -> int:
    """Values per chunk of the quantised all-reduce: ceil(numel / size) rounded up to a whole
    number of blocks (at least one block)."""
    per_rank = max(-(-numel // size), 1)
    return -(-per_rank // block_size) * block_size


def quantized_messages(tensor: torch.Tensor, size: int, fmt: str,
                       block_size: int = quant.DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Phase 1's send buffer of the quantised all-reduce (class docstring of
    :class:`TorchCommunicator`): the tensor zero-padded to ``size`` chunks, each encoded."""
    n = tensor.numel()
    chunk = quantized_chunk_numel(n, size, block_size)
    padded = tensor.new_zeros(chunk * size)
    padded[:n] = tensor
    return torch.cat([quant.to_bytes(quant.quantize(c, fmt, block_size))
                      for c in padded.split(chunk)])


def via_host(all_to_all: Callable[[torch.Tensor, torch.Tensor], Any],
             all_gather: Callable[[list[torch.Tensor], torch.Tensor], Any]
             ) -> tuple[Callable[[torch.Tensor, torch.Tensor], None],
                        Callable[[list[torch.Tensor], torch.Tensor], None]]:
    """The quantised all-reduce's two phases (:func:`quantized_mean`) on host copies of
    their messages, the results copied back where the caller's buffers are: a transport that
    reads host memory only (gloo between workers that share a GPU, an elastic run's) carries
    a GPU's encoded bytes. On host buffers the copies change nothing."""
    def a2a(recv: torch.Tensor, sent: torch.Tensor) -> None:
        host = sent.cpu()
        got = torch.empty_like(host)
        all_to_all(got, host)
        recv.copy_(got)

    def gather(out: list[torch.Tensor], x: torch.Tensor) -> None:
        host = x.cpu()
        got = [torch.empty_like(host) for _ in out]
        all_gather(got, host)
        for o, g in zip(out, got, strict=True):
            o.copy_(g)

    return a2a, gather


def quantized_mean(send: torch.Tensor, n: int, size: int, fmt: str, block_size: int,
                   all_to_all: Callable[[torch.Tensor, torch.Tensor], Any],
                   all_gather: Callable[[list[torch.Tensor], torch.Tensor], Any]
                   ) -> torch.Tensor:
    """The two phases of the quantised all-reduce over whatever group ``all_to_all`` and
    ``all_gather`` (blocking) talk to: the mean of the ``n`` values, identical on every rank."""
    chunk = quantized_chunk_numel(n, size, block_size)
    m = send.numel() // size

    recv = torch.empty_like(send)
    all_to_all(recv, send)
    out = _reduce_quantized_chunk(recv.split(m), chunk, fmt, block_size)
    gathered = [torch.empty_like(out) for _ in range(size)]
    all_gather(gathered, out)
    return torch.cat([_decode_chunk(b, chunk, fmt, block_size) for b in gathered])[:n]


def quantized_mean_of(sends: Sequence[torch.Tensor], n: int, fmt: str, block_size: int
                      ) -> torch.Tensor:
    """What :func:`quantized_mean` returns on every rank, from every rank's send buffer at
    once (ranks that live in one process, :mod:`noloco.simulate`): the same decoding, sums in
    rank order and re-encoding, so the same bits."""
    size = len(sends)
    chunk = quantized_chunk_numel(n, size, block_size)
    m = sends[0].numel() // size
    outs = [_reduce_quantized_chunk([s[j * m:(j + 1) * m] for s in sends], chunk, fmt,
                                    block_size) for j in range(size)]
    return torch.cat([_decode_chunk(b, chunk, fmt, block_size) for b in outs])[:n]


def _decode_chunk(buf: torch.Tensor, chunk: int, fmt: str, block_size: int) -> torch.Tensor:
    return quant.dequantize(quant.from_bytes(buf, chunk, fmt, block_size))


def _reduce_quantized_chunk(received: Sequence[torch.Tensor], chunk: int, fmt: str,
                            block_size: int) -> torch.Tensor:
    """One chunk's owner: decode every rank's message of it, sum them in fp32 in rank order,
    divide by the ranks and encode the mean again (phase 2's message)."""
    parts = [_decode_chunk(b, chunk, fmt, block_size) for b in received]
    reduced = parts[0]
    for part in parts[1:]:  # fp32, in rank order
        reduced += part
    reduced /= len(received)
    return quant.to_bytes(quant.quantize(reduced, fmt, block_size))


def quantized_all_reduce_bytes(numel: int, size: int, fmt: str,
                               block_size: int = quant.DEFAULT_BLOCK_SIZE) -> int:
    """Bytes one rank sends in the quantised all-reduce of ``numel`` fp32 values."""
    if size <= 1:
        return 0
    if fmt == "none":
        return ring_all_reduce_bytes(4 * numel, size)
    return 2 * (size - 1) * quant.wire_bytes(quantized_chunk_numel(numel, size, block_size),
                                             fmt, block_size)


def _check_quantizable(tensor: torch.Tensor, fmt: str, block_size: int) -> None:
    if fmt not in quant.FORMATS:
        raise ValueError(f"unknown quantisation format {fmt!r}; expected one of {quant.FORMATS}")
    if tensor.dim() != 1 or tensor.dtype != torch.float32:
        raise ValueError(f"the quantised all-reduce takes a 1-D fp32 tensor, got "
                         f"{tuple(tensor.shape)} of {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum().item())
        raise ValueError(f"non-finite value in outer gradient: {bad} NaN/inf of "
                         f"{tensor.numel()} elements reached the {fmt} quantiser")
    quant.num_blocks(0, block_size)  # validates block_size


class _FutureWork:
    """A helper-thread job seen as a torch ``Work`` (what :class:`Pending` waits on)."""

    def __init__(self, fut: Future, raise_errors: bool = True) -> None:
        self._fut, self._raise = fut, raise_errors

    def wait(self) -> None:
        if self._raise:
            self._fut.result()
        else:
            self._fut.exception()

    def is_completed(self) -> bool:
        return self._fut.done()


class _HelperThread:
    """One daemon thread running submitted jobs one at a time, in submission order, so the
    ranks' collectives are issued in the same order everywhere."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._queue.put((fn, fut))
        return fut

    def _loop(self) -> None:
        while True:
            fn, fut = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the waiter, re-raised there
                fut.set_exception(e)


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
