"""The method's communicator in an elastic run: snapshots, arrival agreement and a process
group per operation for exactly its members (see the package docstring).

Floor 2 of docs/architecture.md: communication and the methods."""

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
    SKIPPED,
    Communicator,
    Pending,
    _check_quantizable,
    is_skipped,
    quantized_all_reduce_bytes,
    quantized_mean,
    quantized_messages,
    ring_all_reduce_bytes,
    via_host,
)
from noloco.elastic.deadline import raw, store_errors
from noloco.elastic.keys import missed_key, op_tag, snapshot_key
from noloco.elastic.membership import Membership, await_value, live_replicas, probe
from noloco.integrity import (
    TAG_BYTES,
    Opened,
    WireFilter,
    finish_peer,
    open_messages,
    post_exchange,
    sealed_messages,
)
from noloco.methods.noloco import groups_of

__all__ = ["ElasticCommunicator", "groups_of"]

class Gloo:
    """An operation's group: a gloo group of its final members, on the run's store, whose
    connecting and whose transfer each have their own deadline. Every member of the group
    arrived moments ago, so one that has not connected within the connect deadline died,
    stalled or left since (or was counted in by mistake): the others give up on the operation
    then — gloo's one timeout would hold them for the whole ``--comm-timeout``, meant for
    moving the bytes over a slow link. Every operation's work waits at most the transfer
    deadline (gloo's own waits of a send or receive keep the connect deadline otherwise)."""

    def __init__(self, store: Any, rank: int, size: int, connect: float, transfer: float
                 ) -> None:
        self.pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=connect))
        self.transfer = timedelta(seconds=transfer)
        self.pg.set_timeout(self.transfer)

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.pg, name)
        if not callable(op):
            return op

        def call(*args: Any, **kwargs: Any) -> Any:
            got = op(*args, **kwargs)
            return _Bounded(got, self.transfer) if isinstance(got, dist.Work) else got
        return call


class _Bounded:
    """A gloo operation's work that waits at most the transfer deadline."""

    def __init__(self, work: dist.Work, timeout: timedelta) -> None:
        self.work, self.timeout = work, timeout

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self.work.wait(timeout or self.timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


CONNECT_FLOOR = 10.0
"""seconds an operation's members may take to connect, at least (a loaded machine may take
seconds to schedule a member between the agreement and its connecting)"""

KEEP_OPS = 4
"""an operation's agreement keys are deleted by their owners this many operations later (no
member of it can still be waiting: it would have been marked as missed long since)"""
MAX_ATTEMPTS = 4
"""attempts of one all-reduce; each failed one loses a member, typically (one that died,
stalled or lost its link misses the next attempt's arrival)"""
KEEP_SNAPSHOTS = 8
"""snapshots are kept longer: a replica that reads a deleted one would write another"""


class _Unreachable(Exception):
    """The run's store cannot be reached now: this worker is cut off (its beats fail), or a
    request failed and a new connection cannot be made."""


class ElasticCommunicator(Communicator):
    """The method's communicator in an elastic run: every operation among the members of its
    snapshot that arrive in time (module docstring). Ranks are replica numbers."""

    may_skip = True

    def __init__(self, membership: Membership, peer_timeout: float,
                 comm_timeout: float | None = None) -> None:
        super().__init__()
        self.m = membership
        self.rank, self.size = membership.replica, membership.replicas
        self.ranks = list(range(self.size))
        self.wire: WireFilter | None = None
        """what every payload this replica sends passes through after it was sealed
        (:meth:`outgoing`): nothing in a run; fault injection installs one from outside"""
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
        quorum's until it takes theirs (:meth:`noloco.elastic.join.Joiner.heal`)"""
        self.longest_wait = 0.0
        """the most seconds one operation blocked (arrival and transfer together)"""
        self.last_agree_seconds = 0.0
        self.arrival_seconds = 0.0
        """seconds spent waiting for the members of operations to arrive (the part of
        ``sync_seconds`` that other replicas' lateness costs, apart from moving bytes)"""
        self._marked = False
        """this replica learnt that an operation went on without it (so it has a mark)"""
        self.pace: float | None = None
        """this replica's fastest seconds per step between two operations"""
        self._seen: tuple[float, int] | None = None
        self._owned: dict[int, list[str]] = {}
        """operation → the store keys this replica deletes once it is old (:meth:`_collect`)"""
        self.unreachable_ops = 0
        """operations done alone (NoLoCo) or skipped (DiLoCo: behind) because the run's store
        could not be reached: a partition"""
        self._cut = False
        """the last operation could not reach the store (one event per such period)"""
        self.lonely = 0
        """operations done alone or skipped for want of the store since this replica last
        reached it (the trainer's elastic part reads and resets it: it bounds how far a replica
        cut off runs ahead, and re-aligns it when the link returns)"""
        self.lonely_from_step: int | None = None
        """the step of the first of them"""
        self._lonely_call = -1
        self.op_step = 0
        """the step of this replica's latest operation (alone or not)"""
        self._last_snapshot: list[int] = []
        self._left_out_said: dict[int, str] = {}
        self._regroup: set[int] = set() if membership.incarnation else set(self.ranks)
        """the replicas a snapshot this replica fixes waits a moment for (:meth:`_await_regroup`):
        at the run's start, all of them — workers started together register a moment apart
        (the monitor publishes who is live a few times per peer timeout), and the first to
        arrive would otherwise fix a snapshot of itself alone; after the store restarted
        empty, those of the last snapshot before it"""
        self._generation = self._store_generation()
        """the store's generation (restarts seen) this replica last regrouped for"""
        self.commits = 0
        """all-reduces this replica stepped with, as every member of their outcome did: a
        replica with fewer than a live one's has other slow weights — it is behind"""
        self.unsure = False
        """behind for want of the store (cut off, or an outcome it could not read): whether
        anyone stepped meanwhile is unknown, so it heals only from a replica with more
        commits — otherwise (it was late: the others stepped without it) from any donor,
        waiting for one (heartbeats may not show the others' new commits yet)"""
        self.unreachable_steps: list[int] = []
        """the step of each operation done alone or skipped for want of the store"""
        self._committed: list[int] | None = None
        """the members of the last all-reduce's attempt that committed with this replica"""

    @property
    def store(self) -> Any:
        # The membership's: it renews the training thread's connection after a failure.
        return self.m.store

    # ---- state (a joining replica takes the donor's operation count) -------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "calls": self.calls, "commits": self.commits}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in sd.items() if k not in ("calls", "commits")})
        self.calls = int(sd.get("calls", 0))
        self.commits = int(sd.get("commits", 0))

    # ---- who takes part ----------------------------------------------------------------------
    def members(self) -> list[int]:
        """The snapshot of the next operation (:meth:`_snapshot`); only this replica while the
        run's store cannot be reached (it exchanges with nobody: the others do not wait for
        it, and it writes nothing anyone reads — no split brain). Left out of the snapshot (it
        registered after it was fixed, or missed an arrival), this replica exchanges with
        nobody this time, and says so in an event."""
        self.op_step = self.m.step
        try:
            snap = self._snapshot()
        except (_Unreachable, *store_errors()) as e:
            self._unreachable(self.calls, e)
            return [self.rank]
        if self.rank not in snap:
            self.events.append({"call": self.calls, "step": self.m.step,
                                "kind": "not_in_snapshot"})
        return snap

    def _reachable(self) -> None:
        """Raise :class:`_Unreachable` while cut off; renew a failed connection first."""
        if self.m.cut_off():
            raise _Unreachable("cut off: no heartbeat went through for --peer-timeout")
        if self.m.broken:
            try:
                self.m.renew()
            except Exception as e:  # noqa: BLE001 - any failure to connect: still cut off
                raise _Unreachable(str(e)) from e

    def _unreachable(self, call: int, error: BaseException) -> None:
        """An operation that could not reach the run's store. Marked, this replica goes
        through :meth:`_left_out` when it reaches the store again (catching up first if it
        fell too far behind)."""
        if not isinstance(error, _Unreachable):
            self.m.broken = True
        self._marked = True
        if call != self._lonely_call:  # once per operation, however many requests failed
            self._lonely_call = call
            if self.lonely == 0:
                self.lonely_from_step = self.m.step
            self.lonely += 1
        self.unreachable_ops += 1
        self.unreachable_steps.append(self.m.step)
        if not self._cut:
            self._cut = True
            self.events.append({"call": call, "step": self.m.step, "kind": "unreachable",
                                "error": str(error).splitlines()[0][:200] if str(error)
                                else type(error).__name__})

    def _snapshot(self) -> list[int]:
        """The snapshot of the next operation, fixed by the first worker of any stage to reach
        it (the stages of a replica share it). One round trip when it is fixed already; the
        writer reads the eligible replicas first (:meth:`Membership.eligible`)."""
        self._reachable()
        # A new epoch seen first here (the connection renewed just now, between the trainer's
        # look and this operation): this snapshot is the epoch's first. Fixed at once, the
        # others not yet registered again, this replica would step alone an operation they
        # skipped while the store was down — slow weights apart for good (a CI failure of
        # the library's coordinator-restart test).
        self.epoch_check()
        key = snapshot_key(self.calls)
        got = probe(self.store, key)
        if got is None:
            # One writer computes it (the first to claim it); the others wait for its notice
            # (not for the snapshot's key, which every arrival probes: a probe wakes that
            # key's waiters) — and write it themselves if the writer died in between
            # (compare-and-set: one stands).
            if self.store.add(f"{key}/w", 1) > 1:
                # The claim counter gone: fixed and already collected while this replica
                # stalled. It writes another, below, as a replica does that comes this far
                # behind (KEEP_SNAPSHOTS): its partners of that operation, which waited for
                # it in vain, marked it, so its agreement takes the missed path and marks
                # nobody.
                await_value(self.store, f"{key}/ok", self.peer_timeout,
                            gone=lambda: probe(self.store, f"{key}/w") is None)
                got = probe(self.store, key)
            if got is None:
                self._await_regroup()
                mine = json.dumps(self.m.eligible())
                got = self.store.compare_set(key, "", mine)
                if got.decode() == mine and self.m.left_out != self._left_out_said:
                    # Who a snapshot this replica fixed left out, and why: said when that
                    # changes (a replica dead for good is not said at every operation).
                    self._left_out_said = dict(self.m.left_out)
                    self.events.append({"call": self.calls, "step": self.m.step,
                                        "kind": "snapshot_without",
                                        "why": {str(r): w for r, w in
                                                sorted(self.m.left_out.items())}})
                self.store.set(f"{key}/ok", "1")
                self._own(self.calls + KEEP_SNAPSHOTS - KEEP_OPS,
                          [key, f"{key}/w", f"{key}/ok"])
        snap = json.loads(got)
        self._cut = False
        self._last_snapshot, self._regroup = snap, set()
        now, step = time.monotonic(), self.m.step
        if self._seen is not None and step > self._seen[1]:
            pace = (now - self._seen[0]) / (step - self._seen[1])
            self.pace = pace if self.pace is None else min(self.pace, pace)
        self._seen = (now, step)
        if self._marked or (snap and self.rank not in snap):
            self._left_out()
        return snap

    def _left_out(self) -> None:
        """This replica missed an arrival, or is not in the snapshot (it missed one, or was
        joining or behind when the snapshot was fixed). One further behind the others than
        a partner would wait for it (``--peer-timeout``) — it hung — catches up by taking a
        live replica's state (it is ``behind``; :meth:`back` after): else it would be left
        out again at every operation. Otherwise it is back now: new snapshots hold it. (With
        pipeline stages a replica takes a state only with all its stages — as it starts, or
        an all-reduce method's stages together when one is behind an all-reduce
        (:meth:`noloco.elastic.join.Joiner._stages_heal_together`) — so here it is back.)"""
        self._marked = True
        if self.m.stages == 1 and self.behind_by() > self.peer_timeout:
            self.behind, self.unsure = True, False
        else:
            self.back()

    def behind_by(self) -> float:
        """Seconds of this replica's own training (at its best pace so far) between it and the
        live replica furthest along: what a partner of it would wait at every operation."""
        if self.pace is None:
            return 0.0
        live = live_replicas(self.store, self.size, self.m.stages)
        ahead = max((b.get("step", 0) for r, b in live.items() if r != self.rank), default=0)
        return max(0, ahead - self.m.step) * self.pace

    def back(self) -> None:
        """Clear this replica's missed mark (it arrives again, joined or healed)."""
        self.store.set(missed_key(self.rank), "")
        self._marked = False
        self._seen = None  # a join moved the step: the pace is measured afresh

    def epoch_check(self) -> bool:
        """Whether the store restarted empty (a new epoch) since this replica last looked;
        if so, enter it: the keys this replica owned went with the old store, and the epoch's
        first snapshot waits for the others to regroup (:meth:`_await_regroup`). The trainer
        looks at each step boundary, and each snapshot looks again."""
        if self._store_generation() == self._generation:
            return False  # (once entered, the epoch is not reported again)
        self._generation = self._store_generation()
        self._owned.clear()
        self._regroup = set(self._last_snapshot)
        return True

    def _store_generation(self) -> int:
        ns = getattr(self.m, "ns", None)
        return ns.generation if ns is not None else 0

    def _await_regroup(self) -> None:
        """The run's first snapshot, and the first of a new epoch, waits — at most half the
        peer timeout, which the others wait for a snapshot — until the replicas expected
        registered: every replica at the start; after an outage those of the last snapshot
        before it, which reconnect about a second apart. The first one there would otherwise
        step alone, and (DiLoCo) everyone would then heal from it, throwing their own
        progress away."""
        want, self._regroup = self._regroup, set()
        deadline = time.monotonic() + self.peer_timeout / 2
        while want and not want <= set(self.m.eligible()) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _own(self, call: int, keys: list[str]) -> None:
        self._owned.setdefault(call, []).extend(keys)

    def _collect(self) -> None:
        """Delete the keys this replica owns of operations ``KEEP_OPS`` or more before the
        current one: the store holds a few operations' keys, whatever the run's length. Each
        shared key has an owner among its writers (the first member of an agreement; a late
        member owns what it wrote after), each process-group key the member that wrote it."""
        if self._cut:
            return  # later: the store is out of reach
        for call in [c for c in self._owned if c <= self.calls - KEEP_OPS]:
            try:
                for key in self._owned.pop(call):
                    self.store.delete_key(key)
            except store_errors() as e:
                self._unreachable(call, e)
                return

    def _agree(self, call: int, group: Sequence[int], attempt: int) -> tuple[list[int], str]:
        """The members of ``group`` that arrived in time (the same list for all of them; this
        replica is not in it if it came too late), and the operation's store tag.

        O(1) requests: each member appends itself to the arrival list and counts itself in;
        the one that completes the count decides; the others wait (the store's blocking wait,
        no polling) for the decision, at most ``--peer-timeout``, then decide on whoever
        arrived. Deciding is compare-and-set: the first decision stands for everyone."""
        tag = op_tag(call, self.m.stage, attempt, list(group))
        if len(group) == 1:
            self.last_agree_seconds = 0.0
            return list(group), tag  # alone: nothing to agree on
        decided, arrivals, count = f"{tag}/set", f"{tag}/in", f"{tag}/n"
        t0 = time.perf_counter()
        self.store.append(arrivals, f"{self.rank},")
        if self.store.add(count, 1) >= len(group) and set(group) <= self._arrived(arrivals):
            final = self._decide(call, decided, list(group), group)
        elif (got := await_value(
                self.store, decided, self.peer_timeout,
                # the operation is over for everyone else: collected (below), or it went on
                # without this replica (its mark: the missed path below)
                gone=lambda: (self.rank not in self._arrived(arrivals)
                              or self._missed_since(call)))) is not None:
            final = json.loads(got)
        elif self.rank not in self._arrived(arrivals):
            # Collected: this replica's arrival is on record until the operation's owner
            # deletes its keys, KEEP_OPS operations later. So it was decided, and this
            # replica stalled between its arrival and reading the decision for that long:
            # whatever the decision, any transfer of it is over (the owner went on), so the
            # others went on without it — it is late. It decides nothing: a decision written
            # now would mark members that were never missing.
            final = [r for r in group if r != self.rank]
        elif self._missed_since(call):
            # Decided without this replica long ago (those keys may be deleted): the
            # operation is over, and it says so — unless a decision stands. Its arrival is on
            # record: a member coming later still (behind too, or redoing the operation from
            # a checkpoint) must find it closed, not count this one in and wait for it to
            # connect until the transfer timeout. It marks nobody: the others did this
            # operation long ago (their keys deleted, this arrival list is new), and its own
            # mark names a later operation that it must not lower.
            arrived = self._arrived(arrivals) - {self.rank}
            final = json.loads(self.store.compare_set(
                decided, "", json.dumps([r for r in group if r in arrived])))
        else:  # the deadline: decide on whoever came
            arrived = self._arrived(arrivals)
            final = self._decide(call, decided, [r for r in group if r in arrived], group)
        if self.rank not in final or self.rank == min(final):
            self._own(call, [decided, arrivals, count])
        self.last_agree_seconds = time.perf_counter() - t0
        self.sync_seconds += self.last_agree_seconds
        self.arrival_seconds += self.last_agree_seconds
        if len(final) < len(group):
            self.partial += 1
            late = self.rank not in final  # the others went on without this replica
            self._marked = self._marked or late
            self.events.append({"call": call, "step": self.m.step,
                                "kind": "late" if late else "absent", "group": list(group),
                                "missing": [r for r in group if r not in final and r != self.rank],
                                "alone": late or len(final) == 1})
        return final, tag

    def _missed_since(self, call: int) -> bool:
        """An operation from ``call`` on went on without this replica (its mark says so)."""
        mark = (probe(self.store, missed_key(self.rank)) or b"").decode()
        return mark.startswith("m:") and int(mark[2:]) >= call

    def _arrived(self, arrivals: str) -> set[int]:
        return {int(r) for r in (probe(self.store, arrivals) or b"").decode().split(",") if r}

    def _decide(self, call: int, decided: str, proposal: list[int], group: Sequence[int]
                ) -> list[int]:
        final = json.loads(self.store.compare_set(decided, "", json.dumps(proposal)))
        if final == proposal:  # this decision (or an identical one) stands
            for r in group:
                if r not in final:  # missed its arrival: out of new snapshots until back
                    self.store.set(missed_key(r), f"m:{call}")
        return final

    def agree(self, group: Sequence[int]) -> list[int]:
        """The next operation's arrival agreement alone, moving no bytes: the store's part of
        an operation (``benchmarks/elastic_scale.py`` measures it with many members)."""
        call = self.calls
        self.calls += 1
        self._collect()
        return self._agree(call, sorted(group), 0)[0]

    def _group(self, call: int, tag: str, final: list[int]) -> Gloo:
        # Everyone in ``final`` has arrived: what remains is connecting (bounded by twice the
        # peer timeout: they all come straight from the agreement) and moving the bytes,
        # which take as long as the link needs (the arrival deadline was peer_timeout).
        # gloo's rendezvous writes one key per member, "PREFIX/0/RANK" (device 0).
        self._own(call, [f"{tag}/pg/0/{final.index(self.rank)}"])
        return Gloo(dist.PrefixStore(tag + "/pg", raw(self.store)), final.index(self.rank),
                    len(final), min(max(2 * self.peer_timeout, CONNECT_FLOOR),
                                    self.transfer_timeout), self.transfer_timeout)

    # ---- operations ----------------------------------------------------------------------------
    def exchange_async(self, tensor: torch.Tensor, peers: Sequence[int],
                       out: Sequence[torch.Tensor] | None = None) -> Pending:
        """Like :meth:`TorchCommunicator.exchange_async`; the result has ``None`` for every
        peer that did not take part (absent, or lost during the exchange)."""
        call = self.calls
        self.calls += 1
        self.ops["exchange"] += 1
        self._collect()
        tensor = tensor.contiguous()
        bufs = list(out) if out is not None else [torch.empty_like(tensor) for _ in peers]
        group = sorted([self.rank, *peers])
        try:
            final, tag = self._agree(call, group, 0)
        except store_errors() as e:
            self._unreachable(call, e)
            return _Done(self, [None] * len(peers))
        present = [p for p in peers if p in final and self.rank in final]
        self.longest_wait = max(self.longest_wait, self.last_agree_seconds)
        if not present:
            return _Done(self, [None] * len(peers))
        try:
            pg = self._group(call, tag, final)
        except RuntimeError as e:  # a member that arrived died before connecting
            self.events.append({"call": call, "step": self.m.step, "kind": "lost",
                                "missing": present, "error": str(e).splitlines()[0][:200]})
            return _Done(self, [None] * len(peers))
        # Receives first (gloo's "ready" notice); with payload MACs in chunks, each hashed
        # as it lands (noloco.integrity). A peer that closed its group since raises on
        # posting: it is lost, like one that breaks the transfer later (_PeerWorks).
        works, sealed, lost = post_exchange(
            pg, tensor, [bufs[peers.index(p)] for p in present],
            [(p, final.index(p)) for p in present], self.rank, self.sealer,
            self.context(tag), self.wire)
        nbytes = tensor.numel() * tensor.element_size()
        if self.sealer is not None:
            self.mac_bytes += len(works) * TAG_BYTES
        if lost:
            self.partial += 1
            self.events.append({"call": call, "step": self.m.step, "kind": "lost",
                                "missing": lost})
        self.bytes_sent += len(works) * nbytes
        return _PeerWorks(self, call, pg, peers, bufs, works, self.last_agree_seconds, sealed)

    def outgoing(self, messages: torch.Tensor, channel: str) -> torch.Tensor:
        """The rows of ``messages`` as they leave this replica: through :attr:`wire` when one
        is installed (:class:`noloco.integrity.WireFilter`), else as they are."""
        return messages if self.wire is None else self.wire(messages, channel)

    def context(self, tag: str) -> str:
        """What a payload's MAC binds it to besides its bytes: the run, the store's epoch
        and the operation (its call, stage, attempt and group)."""
        ns = self.m.ns
        return f"{ns.run_id}/{ns.epoch}/{tag}" if ns is not None else tag

    def all_reduce_mean_async(self, tensor: torch.Tensor) -> Pending:
        """The mean over the snapshot's replicas that arrive; a member lost during the
        all-reduce discards it and the survivors retry among themselves. Done before
        returning (no overlap)."""

        def mean(pg: Gloo, final: list[int], context: str) -> int:
            # gloo sums inside its own messages: nothing here to seal (noloco.integrity)
            k = len(final)
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

        def mean(pg: Gloo, final: list[int], context: str) -> int:
            k = len(final)
            send = quantized_messages(tensor, k, fmt, block_size)
            if self.sealer is None:
                phases = (lambda recv, sent: pg.alltoall_base(recv, sent, [], []).wait(),
                          lambda out, x: pg.allgather([out], [x]).wait())
            else:
                phases = self._sealed_phases(pg, final, context)
            if self.host_phases:  # a GPU's encoded bytes through gloo (noloco.staging)
                phases = via_host(*phases)
            tensor.copy_(quantized_mean(send, n, k, fmt, block_size, *phases))
            return quantized_all_reduce_bytes(n, k, fmt, block_size)

        return self._quorum(tensor, "all_reduce_quantized", mean)

    def _sealed_phases(self, pg: Gloo, final: list[int], context: str
                       ) -> tuple[Callable[..., None], Callable[..., None]]:
        """The quantised all-reduce's two phases with every message sealed (its tag after
        it). A message whose tag fails makes the attempt fail on every member, like a lost
        one, and never hangs the others: the member that saw it still takes part in the
        all-gather, with a flag byte that says so, and every member raises :class:`BadMac`."""
        sealer, me, k = self.sealer, self.rank, len(final)
        assert sealer is not None
        seen: list[int] = []

        def all_to_all(recv: torch.Tensor, sent: torch.Tensor) -> None:
            out = self.outgoing(sealed_messages(sealer, sent, context + "/a2a", me, final)
                                .view(k, -1), "all_to_all").view(-1)
            got = torch.empty_like(out)
            pg.alltoall_base(got, out, [], []).wait()
            self.mac_bytes += (k - 1) * TAG_BYTES
            body, bad = open_messages(sealer, got, context + "/a2a", final, me)
            seen.extend(bad)
            if bad:  # what was received is not used; the attempt fails after phase 2
                body.zero_()
            recv.copy_(body)

        def all_gather(out: list[torch.Tensor], x: torch.Tensor) -> None:
            # Before the chunk: which members' phase-1 messages failed here (one byte each),
            # so that every member learns whom every other one blames.
            # (tags and flags are made on the host: beside a GPU payload they move to it)
            blame = torch.tensor([r in seen for r in final], dtype=torch.uint8,
                                 device=x.device)
            tag = sealer.seal(torch.cat([blame, x]), context + "/gather", me,
                              ["*"])[0].to(x.device)
            mine = torch.cat([blame, self.outgoing(x.reshape(1, -1), "all_gather").view(-1), tag])
            got = [torch.empty_like(mine) for _ in out]
            pg.allgather([got], [mine]).wait()
            self.mac_bytes += (k - 1) * (TAG_BYTES + k)
            body, bad = open_messages(sealer, torch.cat(got), context + "/gather", final, "*")
            rows = body.view(k, -1)
            ok = [j for j in range(k) if final[j] not in bad]
            blamed = {final[i] for j in ok for i in range(k) if rows[j, i]}
            if bad or blamed:
                # The same set on every member when the tampering is the sender's own (all
                # its messages altered); else the retry's agreement settles who is in.
                raise BadMac(sorted(blamed | set(bad)))
            for o, b in zip(out, rows[:, k:], strict=True):
                o.copy_(b)

        return all_to_all, all_gather

    def _quorum(self, tensor: torch.Tensor, op: str,
                mean: Callable[[Gloo, list[int], str], int]) -> Pending:
        """``mean(process group, members, context)`` (which leaves the mean in ``tensor`` and
        returns the bytes sent) among the snapshot's replicas that arrive."""
        call = self.calls
        self.op_step = self.m.step
        try:
            candidates = self._snapshot()
        except (_Unreachable, *store_errors()) as e:  # no quorum reachable: behind
            candidates = []
            self._unreachable(call, e)
        self.calls += 1
        self.ops[op] += 1
        self._collect()
        if self._cut:
            # Out of reach: no outer step at all (slow weights untouched). If the others
            # stepped meanwhile this replica has fewer commits and heals; if nobody could
            # (the coordinator was down), everyone's slow weights are still alike and the next
            # all-reduce takes every replica's progress since.
            self.behind = self.unsure = True
            return _Done(self, SKIPPED)
        if self.rank not in candidates:  # dropped while silent: this step alone
            self.events.append({"call": call, "step": self.m.step, "kind": "not_in_snapshot"})
            self.behind, self.unsure = len(candidates) > 0, False
            return _Done(self, None)
        original = tensor.clone()
        start = time.perf_counter()
        try:
            return self._all_reduce(call, tensor, original, candidates, mean)
        except store_errors() as e:  # the outcome is unknown here: take a committed state
            tensor.copy_(original)
            self.behind = self.unsure = True
            self._unreachable(call, e)
            return _Done(self, SKIPPED)
        finally:
            self.longest_wait = max(self.longest_wait, time.perf_counter() - start)

    def _all_reduce(self, call: int, tensor: torch.Tensor, original: torch.Tensor,
                    candidates: list[int], mean: Callable[[Gloo, list[int], str], int]
                    ) -> Pending:
        """One outcome for everyone (package docstring, *One outcome per operation*): each
        attempt among the members that arrived either commits — every member whose collective
        completed steps with its mean, the rest are behind and heal — or aborts, and all its
        members retry among themselves (the same list everywhere: an absent one misses the
        next arrival). Whichever member reports first fixes it by compare-and-set."""
        group = candidates
        self._committed = None
        for attempt in range(MAX_ATTEMPTS):
            final, tag = self._agree(call, group, attempt)
            if self.rank not in final or len(final) == 1:
                tensor.copy_(original)
                # Late: the others stepped without this replica. Alone by the others'
                # absence: nobody holds other slow weights to catch up with.
                self.behind = self.rank not in final
                self.unsure = False
                self.commits += not self.behind
                return _Done(self, None)
            t0 = time.perf_counter()
            error, forged = None, None
            try:
                nbytes = mean(self._group(call, tag, final), final, self.context(tag))
            except BadMac as e:  # dropped, as from a member that died
                error, forged = str(e), e.senders
            except RuntimeError as e:  # a member died, stalled or lost its link
                error = str(e).splitlines()[0][:200]
            committed, excluded = self._outcome(call, tag, final, error is None, forged or [])
            self.sync_seconds += time.perf_counter() - t0
            if committed and error is None:
                self.bytes_sent += nbytes
                self.commits += 1
                self._committed = final
                return _Done(self, None)
            tensor.copy_(original)
            event = {"call": call, "step": self.m.step, "attempt": attempt, "group": final}
            if error is not None:
                event["error"] = error
            if forged:
                event["bad_mac"] = forged
            if committed:  # it completed on other members, who stepped: take their state
                self.events.append({**event, "kind": "behind"})
                self.behind, self.unsure = True, False
                return _Done(self, None)
            self.retries += 1
            self.events.append({**event, "kind": "lost" if error else "aborted"})
            # A member whose payloads failed their MACs is left out of the retry, as one
            # that died would be — by the outcome that stands (the first report), so every
            # member retries with the same group (its key names the group).
            group = [r for r in final if r not in excluded]
            if self.rank not in group:
                tensor.copy_(original)
                self.behind, self.unsure = True, False
                return _Done(self, None)
        # Every attempt aborted (the same sequence of outcomes on every member that is still
        # here): no mean stands, so nobody steps — every member skips the outer step alike
        # and their slow weights stay identical; the next all-reduce takes the inner steps
        # since (a zeroed payload would not do: without --quantize it holds the fast weights,
        # and φ − 0 is no zero gradient).
        tensor.copy_(original)
        self.events.append({"call": call, "step": self.m.step, "kind": "gave_up",
                            "group": group})
        return _Done(self, SKIPPED)

    def _outcome(self, call: int, tag: str, final: list[int], completed: bool,
                 exclude: Sequence[int] = ()) -> tuple[bool, list[int]]:
        """Report this member's attempt and learn the attempt's outcome: committed, or
        aborted with the members to leave out of the retry (those whose payloads failed
        their MACs, as the reporter saw them). The first report stands (compare-and-set);
        one round trip."""
        key = f"{tag}/outcome"
        mine = ("commit" if completed else
                f"abort:{json.dumps(sorted(exclude))}" if exclude else "abort")
        got = self.store.compare_set(key, "", mine).decode()
        if self.rank == min(final):
            self._own(call, [key])
        excluded = json.loads(got[len("abort:"):]) if got.startswith("abort:") else []
        return got == "commit", [r for r in excluded if r in final]

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        """Every arriving member's ``tensor`` (the same size everywhere: a sparse message),
        as a list indexed by replica with ``None`` for each replica whose message is not in
        the outcome that stands. One outcome for everyone, as :meth:`all_reduce_mean_async`
        (the same agreement, attempts and commit): every member that commits holds the same
        messages. This replica alone (the others absent, or it was left out): its own message
        only. ``SKIPPED``: nobody stepped (out of reach, or every attempt aborted). Done
        before returning (no overlap). Bytes: (k − 1) × the message among k members."""
        rows: dict[str, Any] = {}

        def gather(pg: Gloo, final: list[int], context: str) -> int:
            k, nbytes = len(final), tensor.numel() * tensor.element_size()
            if self.sealer is None:
                got = [torch.empty_like(tensor) for _ in final]
                pg.allgather([got], [tensor]).wait()
            else:
                got = self._sealed_gather(pg, tensor, final, context)
            rows["members"], rows["got"] = final, got
            return (k - 1) * nbytes

        self._committed = None  # (_quorum may return before an attempt sets it)
        done = self._quorum(tensor, "all_gather", gather)
        result = done.wait()
        if is_skipped(result):
            return done
        out: list[torch.Tensor | None] = [None] * self.size
        if self._committed is not None and len(self._committed) > 1 \
                and rows.get("members") == self._committed:
            for r, x in zip(rows["members"], rows["got"], strict=True):
                out[r] = x
        else:  # alone, or left out (behind: it heals)
            out[self.rank] = tensor.clone()
        return _Done(self, out)

    def _sealed_gather(self, pg: Gloo, tensor: torch.Tensor, final: list[int], context: str
                       ) -> list[torch.Tensor]:
        """The all-gather with each member's message sealed (its tag after it, for every
        receiver at once). A message whose tag fails fails the attempt (:class:`BadMac`
        names its sender); the outcome that stands decides who retries (its first report)."""
        sealer, me = self.sealer, self.rank
        assert sealer is not None
        tag = sealer.seal(tensor, context + "/gather", me, ["*"])[0].to(tensor.device)
        mine = self.outgoing(torch.cat([tensor, tag]).view(1, -1), "all_gather").view(-1)
        got = [torch.empty_like(mine) for _ in final]
        pg.allgather([got], [mine]).wait()
        self.mac_bytes += (len(final) - 1) * TAG_BYTES
        body, bad = open_messages(sealer, torch.cat(got), context + "/gather", final, "*")
        if bad:
            raise BadMac(bad)
        return list(body.view(len(final), -1).clone().unbind(0))



class BadMac(RuntimeError):
    """Payloads whose MAC did not verify (altered on the way, or not from their sender)."""

    def __init__(self, senders: list[int]) -> None:
        who = (f"from replica {', '.join(map(str, senders))}" if senders
               else "to another member")
        super().__init__(f"a payload {who} failed its MAC check: dropped")
        self.senders = senders


class _Done(Pending):
    def __init__(self, comm: Communicator, result: Any) -> None:
        super().__init__(comm, [])
        self._done, self._result = True, result


class _PeerWorks(Pending):
    """An elastic exchange in flight: each peer's transfer succeeds or fails on its own."""

    def __init__(self, comm: ElasticCommunicator, call: int, pg: Gloo, peers: Sequence[int],
                 bufs: list[torch.Tensor], works: dict[int, list[Any]], agreed_in: float,
                 sealed: dict[int, Opened] | None = None) -> None:
        super().__init__(comm, [w for ws in works.values() for w in ws])
        self._ecomm, self._call, self._pg = comm, call, pg
        self._peers, self._bufs, self._by_peer = list(peers), bufs, works
        self._agreed_in = agreed_in
        self._sealed = sealed or {}

    def wait(self) -> Any:
        if self._done:
            return self._result
        t0 = time.perf_counter()
        result: list[torch.Tensor | None] = [None] * len(self._peers)
        lost, forged = [], []
        for p, works in self._by_peer.items():
            try:
                if not finish_peer(works, self._sealed.get(p)):
                    forged.append(p)  # as if it were absent
                    continue
                result[self._peers.index(p)] = self._bufs[self._peers.index(p)]
            except RuntimeError:
                lost.append(p)
        self._ecomm.sync_seconds += time.perf_counter() - t0
        self._ecomm.longest_wait = max(self._ecomm.longest_wait,
                                       self._agreed_in + time.perf_counter() - t0)
        self._ecomm.partial += bool(lost or forged)
        if lost:
            self._ecomm.events.append({"call": self._call, "step": self._ecomm.m.step,
                                       "kind": "lost", "missing": lost})
        if forged:
            self._ecomm.events.append({"call": self._call, "step": self._ecomm.m.step,
                                       "kind": "bad_mac", "missing": forged})
        self._pg = None  # its sockets close with it
        self._done, self._result = True, result
        return result
