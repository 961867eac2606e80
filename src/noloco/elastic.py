"""Elastic training: a replica is a fault domain (``--elastic``).

In a static run all N workers share one ``torch.distributed`` world, and one dead or frozen
process stops every replica. Here replicas share nothing but the run's c10d ``TCPStore``
(hosted by the local launcher): no world process group, no collective over all replicas.

Membership
    Every replica writes a heartbeat into the store from a daemon thread (a frozen process
    stops writing). A replica is *alive* while its newest heartbeat is younger than
    ``--peer-timeout`` and it has not announced that it finished. Heartbeats carry wall-clock
    times: replicas on different machines need clocks agreeing to well within the timeout
    (NTP gives milliseconds).

Snapshots: who takes part in operation c
    Every replica issues the same sequence of operations (one per outer step or fragment
    sync: the schedule is a function of the step alone), numbered c = 0, 1, ... The first
    replica to reach operation c writes the list of replicas alive at that moment under the
    store key of c with compare-and-set; every later replica reads that value back. Invariant:
    the key is written once and never changed (compare-and-set on the store's server is
    atomic), so every replica that reaches c sees the same list, draws the same groups from
    it (a deterministic function of the list, the seed and c) and so the same partner — two
    replicas can never disagree on who their partner is. No barrier is needed: nobody waits
    for the snapshot, the first one fixes it.

Arrival: who actually comes
    A member of a group announces itself under the group's key for c and waits, at most
    ``--peer-timeout``, for the others. Whoever first sees everyone (or runs out of time)
    fixes the set of arrived members with compare-and-set; everyone reads that same set.
    A replica that arrives after the set was fixed without it goes on alone (its weights
    unchanged by the exchange). The members of the set build a gloo process group on a store
    prefix named after c, the group and the attempt — exactly those members, no call on any
    other process — and exchange. A member that dies during the exchange breaks the
    connection (kill) or lets it time out (stall): NoLoCo averages with the members whose data
    arrived; an all-reduce (DiLoCo) discards the step and retries among the survivors.

With nobody failing every snapshot holds all replicas, every set is the whole group, and the
values exchanged and summed are the static path's: elastic NoLoCo is bit-identical to static
NoLoCo (a test checks).
"""

from __future__ import annotations

import json
import threading
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

PREFIX = "noloco/elastic"


def heartbeat_key(replica: int, stage: int = 0) -> str:
    return f"{PREFIX}/hb/{replica}/{stage}"


def done_key(replica: int, stage: int = 0) -> str:
    return f"{PREFIX}/done/{replica}/{stage}"


def join_key(donor: int) -> str:
    """The counter of join requests made to ``donor`` (each request under ``KEY/N``)."""
    return f"{PREFIX}/join/{donor}"


class Membership:
    """Heartbeats of this worker (one stage of one replica) and which replicas are alive: a
    replica with pipeline stages is alive while every one of its stages is (they fail
    together: a stage cannot train without the others)."""

    def __init__(self, store: Any, replica: int, replicas: int, peer_timeout: float,
                 incarnation: int = 0, stage: int = 0, stages: int = 1) -> None:
        self.store, self.replica, self.replicas = store, replica, replicas
        self.stage, self.stages = stage, stages
        self.peer_timeout, self.incarnation = peer_timeout, incarnation
        self.interval = min(1.0, peer_timeout / 5)
        self.step = 0
        self.join_requests = 0
        """join requests made to this replica so far, as of the last heartbeat"""
        self.ready = False
        """training (a joining replica is not, until it has its state)"""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Membership:
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="noloco-membership",
                                        daemon=True)
        self._thread.start()
        return self

    def beat(self) -> None:
        self.store.set(heartbeat_key(self.replica, self.stage), json.dumps(
            {"t": time.time(), "step": self.step, "incarnation": self.incarnation,
             "ready": self.ready}))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                # Read here, off the training loop: a store round trip per inner step would
                # cost a network latency per step across machines.
                self.join_requests = int(self.store.add(join_key(self.replica), 0))
            except Exception:  # noqa: BLE001 - the store may be gone with the run
                return

    def finish(self) -> None:
        """Announce that this replica finished: nobody waits for it any more."""
        self._stop.set()
        try:
            self.store.set(done_key(self.replica, self.stage), "1")
        except Exception:  # noqa: BLE001
            pass

    def stop(self) -> None:
        self._stop.set()

    def alive(self) -> list[int]:
        """The replicas alive now (this one always)."""
        others = live_replicas(self.store, self.replicas, self.stages, self.peer_timeout)
        return sorted({*others, self.replica})

    def donors(self) -> list[int]:
        """Live replicas that train (not themselves joining), the furthest along first: the
        ones a joining or healing replica may take its state from."""
        live = live_replicas(self.store, self.replicas, self.stages, self.peer_timeout)
        ready = [(b["step"], r) for r, b in live.items() if r != self.replica and b["ready"]]
        return [r for _, r in sorted(ready, key=lambda x: (-x[0], x[1]))]


def live_replicas(store: Any, replicas: int, stages: int, peer_timeout: float
                  ) -> dict[int, dict[str, Any]]:
    """Replica → its stage 0's newest heartbeat, for every replica whose stages all beat
    within ``peer_timeout`` and none of which has finished."""
    now, out = time.time(), {}
    for r in range(replicas):
        keys = [heartbeat_key(r, s) for s in range(stages)]
        if not store.check(keys) or any(store.check([done_key(r, s)]) for s in range(stages)):
            continue
        beats = [json.loads(store.get(k)) for k in keys]
        if all(now - b["t"] <= peer_timeout for b in beats):
            out[r] = {"ready": False, **beats[0]}
    return out


def groups_of(members: Sequence[int], exchange: int, group_size: int, seed: int = 0
              ) -> list[list[int]]:
    """The groups of ``exchange`` among ``members`` (a snapshot): the static draw
    (:func:`noloco.methods.noloco.groups_at`) when every replica is a member; otherwise the
    same rule on the members, with the ones left over joining the last group."""
    from noloco.methods.noloco import permutation

    members = sorted(members)
    perm = permutation(exchange, len(members), seed)
    k = len(members) // group_size
    if k == 0:
        return [members]
    groups = [[members[int(perm[g + j * k])] for j in range(group_size)] for g in range(k)]
    groups[-1] += [members[int(i)] for i in perm[k * group_size:]]
    return [sorted(g) for g in groups]


class ElasticCommunicator(Communicator):
    """The method's communicator in an elastic run: every operation among the members of its
    snapshot that arrive in time (module docstring). Ranks are replica numbers."""

    def __init__(self, membership: Membership, peer_timeout: float) -> None:
        super().__init__()
        self.m, self.store = membership, membership.store
        self.rank, self.size = membership.replica, membership.replicas
        self.ranks = list(range(self.size))
        self.peer_timeout = peer_timeout
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
        """The snapshot of the next operation (fixed by the first replica to reach it)."""
        key = f"{PREFIX}/snap/s{self.m.stage}/{self.calls}"
        got = self.store.compare_set(key, "", json.dumps(self.m.alive()))
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
        return dist.ProcessGroupGloo(dist.PrefixStore(tag + "/pg", self.store),
                                     final.index(self.rank), len(final),
                                     timedelta(seconds=self.peer_timeout))

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
