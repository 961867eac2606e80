"""The method's communicator in an elastic run: snapshots, arrival agreement and a process
group per operation for exactly its members (see the package docstring)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from noloco import quant
from noloco.comm import (
    Communicator,
    Pending,
    _check_quantizable,
    quantized_all_reduce_bytes,
    quantized_mean,
    quantized_messages,
    ring_all_reduce_bytes,
)
from noloco.elastic.keys import PREFIX, snapshot_key
from noloco.elastic.membership import Membership
from noloco.methods.noloco import groups_of

__all__ = ["ElasticCommunicator", "groups_of"]


class ElasticCommunicator(Communicator):
    """The method's communicator in an elastic run: every operation among the members of its
    snapshot that arrive in time (module docstring). Ranks are replica numbers."""

    def __init__(self, membership: Membership, peer_timeout: float,
                 comm_timeout: float | None = None) -> None:
        super().__init__()
        self.m, self.store = membership, membership.store
        self.rank, self.size = membership.replica, membership.replicas
        self.ranks = list(range(self.size))
        self.peer_timeout = peer_timeout
        """how long a member's arrival is awaited"""
        self.transfer_timeout = max(peer_timeout, comm_timeout or peer_timeout)
        """how long the transfer itself may take once the members agreed (``--comm-timeout``):
        a slow link must not make every exchange fail"""
        self.calls = 0
        """operations issued so far: the same sequence on every replica, so call c names the
        same outer step (or fragment sync) everywhere"""
        self.events: list[dict[str, Any]] = []
        """who was missing from which operation (the run's summary lists them)"""
        self.partial = 0
        """operations done with fewer members than drawn"""
        self.retries = 0
        self.behind = False
        """an all-reduce went on without this replica: its slow weights differ from the
        quorum's until it takes theirs (:meth:`ElasticTrainer.heal`)"""
        self.longest_wait = 0.0
        """the most seconds one operation blocked (arrival and transfer together)"""

    # ---- state (a joining replica takes the donor's operation count) -------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "calls": self.calls}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in sd.items() if k != "calls"})
        self.calls = int(sd.get("calls", 0))

    # ---- who takes part ----------------------------------------------------------------------
    def members(self) -> list[int]:
        """The snapshot of the next operation (fixed by the first worker of any stage to reach
        it: the stages of a replica share it)."""
        got = self.store.compare_set(snapshot_key(self.calls), "", json.dumps(self.m.alive()))
        return json.loads(got)

    def _agree(self, call: int, group: Sequence[int], attempt: int) -> tuple[list[int], str]:
        """The members of ``group`` that arrived in time (the same list for all of them; this
        replica is not in it if it came too late), and the operation's store tag."""
        # Each stage's replicas exchange among themselves (their own fragment of the model).
        tag = f"{PREFIX}/op/{call}/s{self.m.stage}/{attempt}/" + "-".join(map(str, group))
        decided = f"{tag}/set"
        arrived = {r: f"{tag}/in/{r}" for r in group}
        self.store.set(arrived[self.rank], "1")
        deadline = time.monotonic() + self.peer_timeout
        t0 = time.perf_counter()
        while True:
            if self.store.check(list(arrived.values())):
                proposal = list(group)
                break
            if self.store.check([decided]):
                proposal = []  # somebody decided already: take theirs
                break
            if time.monotonic() > deadline:
                proposal = [r for r in group if self.store.check([arrived[r]])]
                break
            time.sleep(0.002)
        final = json.loads(self.store.compare_set(decided, "", json.dumps(proposal)))
        self.last_agree_seconds = time.perf_counter() - t0
        self.sync_seconds += self.last_agree_seconds
        if len(final) < len(group):
            self.partial += 1
            late = self.rank not in final  # the others went on without this replica
            self.events.append({"call": call, "step": self.m.step,
                                "kind": "late" if late else "absent", "group": list(group),
                                "missing": [r for r in group if r not in final and r != self.rank],
                                "alone": late or len(final) == 1})
        return final, tag

    def _group(self, tag: str, final: list[int]) -> Any:
        # Everyone in ``final`` has arrived: what remains is connecting and moving the bytes,
        # which take as long as the link needs (the arrival deadline was peer_timeout).
        return dist.ProcessGroupGloo(dist.PrefixStore(tag + "/pg", self.store),
                                     final.index(self.rank), len(final),
                                     timedelta(seconds=self.transfer_timeout))

    # ---- operations ----------------------------------------------------------------------------
    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int],
                       out: Sequence[torch.Tensor] | None = None) -> Pending:
        """Like :meth:`TorchCommunicator.exchange_async`; the result has ``None`` for every
        peer that did not take part (absent, or lost during the exchange)."""
        call = self.calls
        self.calls += 1
        self.ops["exchange"] += 1
        tensor = tensor.contiguous()
        bufs = list(out) if out is not None else [torch.empty_like(tensor) for _ in peers]
        group = sorted([self.rank, *peers])
        final, tag = self._agree(call, group, 0)
        present = [p for p in peers if p in final and self.rank in final]
        self.longest_wait = max(self.longest_wait, self.last_agree_seconds)
        if not present:
            return _Done(self, [None] * len(peers))
        try:
            pg = self._group(tag, final)
        except RuntimeError as e:  # a member that arrived died before connecting
            self.events.append({"call": call, "step": self.m.step, "kind": "lost",
                                "missing": present, "error": str(e).splitlines()[0][:200]})
            return _Done(self, [None] * len(peers))
        works: dict[int, list[Any]] = {}
        lost = []
        # Receives first, as in TorchCommunicator.exchange_async (gloo's "ready" notice). A
        # peer that closed its group since raises on posting: it is lost, like one that
        # breaks the transfer later (_PeerWorks).
        for p in present:
            try:
                works[p] = [pg.recv([bufs[peers.index(p)]], final.index(p), 0)]
            except RuntimeError:
                lost.append(p)
        for p in [p for p in present if p not in lost]:
            try:
                works[p].append(pg.send([tensor], final.index(p), 0))
            except RuntimeError:
                lost.append(p)
                works.pop(p)
        if lost:
            self.partial += 1
            self.events.append({"call": call, "step": self.m.step, "kind": "lost",
                                "missing": lost})
        self.bytes_sent += len(works) * tensor.numel() * tensor.element_size()
        return _PeerWorks(self, call, pg, peers, bufs, works, self.last_agree_seconds)

    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        """The mean over the snapshot's replicas that arrive; a member lost during the
        all-reduce discards it and the survivors retry among themselves. Done before
        returning (no overlap)."""

        def mean(pg: Any, k: int) -> int:
            pg.allreduce([tensor]).wait()
            tensor.div_(k)
            return ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), k)

        return self._quorum(tensor, "all_reduce", mean)

    def all_reduce_mean_quantized_async(self, tensor: torch.Tensor, fmt: str,
                                        block_size: int = quant.DEFAULT_BLOCK_SIZE) -> Pending:
        """The quantised all-reduce of :class:`noloco.comm.TorchCommunicator` (the same two
        phases, so the same bits) among the replicas that arrive, as
        :meth:`all_reduce_mean_async` runs the plain one."""
        if fmt == "none":
            return self.all_reduce_mean_async(tensor)
        _check_quantizable(tensor, fmt, block_size)
        n = tensor.numel()

        def mean(pg: Any, k: int) -> int:
            send = quantized_messages(tensor, k, fmt, block_size)
            tensor.copy_(quantized_mean(
                send, n, k, fmt, block_size,
                lambda recv, sent: pg.alltoall_base(recv, sent, [], []).wait(),
                lambda out, x: pg.allgather([out], [x]).wait()))
            return quantized_all_reduce_bytes(n, k, fmt, block_size)

        return self._quorum(tensor, "all_reduce_quantized", mean)

    def _quorum(self, tensor: torch.Tensor, op: str, mean: Callable[[Any, int], int]
                ) -> Pending:
        """``mean(process group, members)`` (which leaves the mean in ``tensor`` and returns
        the bytes sent) among the snapshot's replicas that arrive."""
        call = self.calls
        candidates = self.members()
        self.calls += 1
        self.ops[op] += 1
        if self.rank not in candidates:  # dropped while silent: this step alone
            self.events.append({"call": call, "step": self.m.step, "kind": "not_in_snapshot"})
            self.behind = len(candidates) > 0
            return _Done(self, None)
        original = tensor.clone()
        start = time.perf_counter()
        try:
            return self._all_reduce(call, tensor, original, candidates, mean)
        finally:
            self.longest_wait = max(self.longest_wait, time.perf_counter() - start)

    def _all_reduce(self, call: int, tensor: torch.Tensor, original: torch.Tensor,
                    candidates: list[int], mean: Callable[[Any, int], int]) -> Pending:
        for attempt in range(len(candidates) + 1):
            final, tag = self._agree(call, candidates, attempt)
            if self.rank not in final or len(final) == 1:
                tensor.copy_(original)
                # Late: the others stepped without this replica. Alone by the others'
                # absence: nobody holds other slow weights to catch up with.
                self.behind = self.rank not in final
                return _Done(self, None)
            t0 = time.perf_counter()
            try:
                nbytes = mean(self._group(tag, final), len(final))
            except RuntimeError as e:  # a member died or stalled: discard, retry
                self.retries += 1
                self.events.append({"call": call, "step": self.m.step, "kind": "lost",
                                    "group": final, "error": str(e).splitlines()[0][:200]})
                tensor.copy_(original)
                # Did the all-reduce complete on another member? (A ring can finish on some
                # members and break on others.) Then they stepped without this replica,
                # which must take their state rather than step apart.
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:
                    if any(self.store.check([f"{tag}/ok/{r}"]) for r in final):
                        self.sync_seconds += time.perf_counter() - t0
                        self.behind = True
                        return _Done(self, None)
                    time.sleep(0.02)
                self.sync_seconds += time.perf_counter() - t0
                alive = set(self.m.alive())
                candidates = [r for r in final if r in alive]
                continue
            self.store.set(f"{tag}/ok/{self.rank}", "1")
            self.sync_seconds += time.perf_counter() - t0
            self.bytes_sent += nbytes
            return _Done(self, None)
        tensor.copy_(original)
        return _Done(self, None)

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        # Not an operation of any elastic path: the methods exchange or all-reduce, and the
        # run's metrics are per replica (combined at the end, never gathered in training).
        raise TypeError("an elastic run gathers nothing over all replicas: every replica "
                        "writes its own metrics")



class _Done(Pending):
    def __init__(self, comm: Communicator, result: Any) -> None:
        super().__init__(comm, [])
        self._done, self._result = True, result


class _PeerWorks(Pending):
    """An elastic exchange in flight: each peer's transfer succeeds or fails on its own."""

    def __init__(self, comm: ElasticCommunicator, call: int, pg: Any, peers: Sequence[int],
                 bufs: list[torch.Tensor], works: dict[int, list[Any]], agreed_in: float
                 ) -> None:
        super().__init__(comm, [w for ws in works.values() for w in ws])
        self._ecomm, self._call, self._pg = comm, call, pg
        self._peers, self._bufs, self._by_peer = list(peers), bufs, works
        self._agreed_in = agreed_in

    def wait(self) -> Any:
        if self._done:
            return self._result
        t0 = time.perf_counter()
        result: list[torch.Tensor | None] = [None] * len(self._peers)
        lost = []
        for p, works in self._by_peer.items():
            try:
                for w in works:
                    w.wait()
                result[self._peers.index(p)] = self._bufs[self._peers.index(p)]
            except RuntimeError:
                lost.append(p)
        self._ecomm.sync_seconds += time.perf_counter() - t0
        self._ecomm.longest_wait = max(self._ecomm.longest_wait,
                                       self._agreed_in + time.perf_counter() - t0)
        if lost:
            self._ecomm.partial += 1
            self._ecomm.events.append({"call": self._call, "step": self._ecomm.m.step,
                                       "kind": "lost", "missing": lost})
        self._pg = None  # its sockets close with it
        self._done, self._result = True, result
        return result
