"""Heartbeats of a replica's workers, and which replicas are alive (see the package
docstring: *Membership*).

Liveness is judged without comparing clocks: a heartbeat carries a counter ``n`` that its
writer increments at every beat, never a time. The :class:`Monitor`, which runs beside the
store (in the local launcher, or in ``noloco coordinator``), reads every heartbeat each
interval and notes on its *own* monotonic clock when each counter last moved; a replica is
alive while every stage's counter moved within ``--peer-timeout`` of the monitor's clock and
none of its stages announced that it finished. The monitor publishes the live set under one
key, so a replica learns who is alive with one read instead of scanning N heartbeats. Machines
whose wall clocks disagree by any amount — or jump — judge each other the same way.

Each worker beats from a thread with its own store connection (a training thread blocked in
a store wait cannot hold the heartbeat up), and a failed beat is retried with backoff on a new
connection (one that timed out may be out of step), never the end of the heartbeat. A worker
that has not beaten for ``--peer-timeout`` is *cut off* (:meth:`Membership.cut_off`): the
monitor has judged it dead, so it stops exchanging — it trains on alone, touching the store
not at all — until a beat goes through again; then it is back as a replica that missed
operations (see :mod:`noloco.elastic.communicator`). Every store request of the worker has a
deadline of ``--peer-timeout`` (waits have their own): a partition cannot hold it longer.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from noloco.elastic.deadline import Prefixed, connect, request_deadline
from noloco.elastic.keys import (
    heartbeat_key,
    join_key,
    join_seen_key,
    live_key,
    missed_key,
    owner_key,
    settings_key,
    starts_key,
)
from noloco.stop import StopEvent


def _stop_thread(event: threading.Event, thread: threading.Thread | None,
                 timeout: float) -> None:
    event.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


def own_client(store: Any, timeout: float = 30.0) -> Any:
    """A second connection to the same TCPStore, every request bounded by ``timeout`` (the
    store itself when it is of another kind or cannot be reached again)."""
    try:
        return connect(store, timeout)
    except Exception:  # noqa: BLE001 - share the caller's connection rather than fail
        return store


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
        self.behind = False
        """an all-reduce went on without this replica: it is no donor until it healed"""
        self.left_out: dict[int, str] = {}
        """why each replica was not in the last snapshot this one proposed"""
        self.commits = 0
        """all-reduces this replica stepped with (:attr:`ElasticCommunicator.commits`)"""
        self.info: dict[str, Any] = {}
        """what the heartbeat also tells a live view (:mod:`noloco.elastic.status`): outer
        steps, the last validation loss, seconds blocked, joins"""
        self.joining = incarnation > 0
        """taking a live replica's state (a respawn): no member of new snapshots until done"""
        self._stop = StopEvent()
        self._thread: threading.Thread | None = None
        self.beats = 0
        """heartbeats written so far: the counter the monitor watches move"""
        self.beat_failures = 0
        self._beat_store = store
        self.store_timeout = request_deadline(peer_timeout)
        """the deadline of one store request (not of a wait): longer, and the store is as good
        as unreachable — the monitor judges a worker dead after ``peer_timeout`` anyway"""
        self.last_beat = time.monotonic()
        """when the last beat went through (this process's monotonic clock)"""
        self.broken = False
        """a request of the training thread's connection failed: renew it before the next
        (:meth:`renew`); a timed-out connection may deliver an old answer to a new request"""
        self.cuts: list[dict[str, Any]] = []
        """periods this worker could not beat for longer than ``peer_timeout`` (cut off, or
        the whole process stopped): from and to which step, how many seconds"""
        self._beat_step = 0
        """the step of the last beat that went through"""
        self._failing = False
        """beats fail (rather than not being tried): the store is out of reach"""
        self._connect = lambda: connect(self.store, self.store_timeout)
        self._beat_lock = threading.Lock()
        self.owner: int | None = None
        """a newer incarnation that took this replica over (then this one writes nothing more
        and stops at its next step)"""
        self.ns = getattr(store, "ns", None)
        """the run's namespace in the store (:class:`noloco.elastic.deadline.Namespace`), when
        the store connection has one"""
        self._generation = self.ns.generation if self.ns is not None else 0
        self.outages: list[dict[str, Any]] = []
        """the store restarted empty under this worker (a coordinator that came back): when,
        between which steps, in which new epoch"""

    def claim(self, store: Any = None) -> None:
        """Own this replica's id: raise the owner key to this incarnation (compare-and-set,
        never lowered, so of two processes with one id the newer start owns it)."""
        store = self.store if store is None else store
        key, mine = owner_key(self.replica, self.stage), str(self.incarnation)
        cur = store.compare_set(key, "", mine)
        while int(cur) < self.incarnation:
            cur = store.compare_set(key, cur, mine)
        if int(cur) > self.incarnation:
            self.owner = int(cur)

    def _register(self, store: Any) -> None:
        """What a store must hold of this worker before it beats: its claim on the id, the
        run's settings (for the monitor) and an empty missed mark (a new life, or a new
        epoch, starts unmarked; a joining flag keeps it out of snapshots meanwhile)."""
        self.claim(store)
        store.compare_set(settings_key(), "", json.dumps(
            {"replicas": self.replicas, "stages": self.stages,
             "peer_timeout": self.peer_timeout}))
        store.set(missed_key(self.replica), "")

    def _new_epoch(self, store: Any, now: float) -> None:
        """The store was wiped (its host restarted) and this process is in a new epoch
        (:class:`~noloco.elastic.deadline.Namespace`): register again, and bring the start
        counter up to this life's, so that a later start is still a later incarnation."""
        assert self.ns is not None
        self._generation = self.ns.generation
        self.join_requests = 0  # the new epoch's requests are counted from zero
        self._register(store)
        key = starts_key(self.replica, self.stage)
        have = int(store.add(key, 0))
        if have <= self.incarnation:
            store.add(key, self.incarnation + 1 - have)
        self.outages.append({"replica": self.replica, "stage": self.stage,
                             "epoch": self.ns.epoch, "from_step": self._beat_step,
                             "to_step": self.step, "seconds": round(now - self.last_beat, 2)})
        print(f"noloco: replica {self.replica}: the run's store restarted empty; the run goes "
              f"on in epoch {self.ns.epoch} (steps {self._beat_step}-{self.step} without it)",
              file=sys.stderr, flush=True)

    def start(self, beat_store: Any = None, thread: bool = True) -> Membership:
        """Claim the id, register, beat once and go on beating from a thread of its own, on
        ``beat_store`` (default: a connection of its own). ``thread=False``: the caller beats
        (many light members of one process, in a benchmark, share one thread)."""
        self._register(self.store)
        self._beat_store = (own_client(self.store, self.store_timeout) if beat_store is None
                            else beat_store)
        self.beat()
        if thread:
            self._thread = threading.Thread(target=self._loop, name="noloco-membership",
                                            daemon=True)
            self._thread.start()
        return self

    def beat(self, done: bool = False, confirm: bool = True, stopped: bool = False
             ) -> int | None:
        """Write this worker's heartbeat and see it arrive; returns the join requests made to
        this replica so far (None when fenced: a newer incarnation owns the replica).
        ``confirm=False``: write it and go on (a nudge from the training thread, which must
        not wait a round trip); the beat loop's next beat confirms."""
        with self._beat_lock:
            if self.owner is not None:  # fenced: the newer owner's heartbeat is the replica's
                return None
            if self._beat_store is None:  # the last beat failed: a new connection
                self._beat_store = self._connect()
            now = time.monotonic()
            moved = self.ns is not None and self.ns.generation != self._generation
            if moved:
                self._new_epoch(self._beat_store, now)
            self.beats += 1
            # On etcd a heartbeat lives under a lease: the cluster deletes it when this
            # worker stops renewing (liveness on the cluster's clock, no monitor).
            write = getattr(self._beat_store, "set_leased", None) or self._beat_store.set
            write(heartbeat_key(self.replica, self.stage), json.dumps(
                {"n": self.beats, "step": self.step, "incarnation": self.incarnation,
                 "ready": self.ready, "behind": self.behind, "joining": self.joining,
                 "commits": self.commits, **self.info,
                 **({"done": True} if done else {}),
                 **({"stopped": True} if stopped else {})}))
            if not confirm:
                return None
            # A set gets no answer (the client writes it into its socket and goes on): over a
            # link that is down it "succeeds" until the socket's buffer fills. The beat went
            # through only once the store answers a request sent after it (answers come in
            # order on a connection); until then the worker is still cut off.
            requests = int(self._beat_store.add(join_key(self.replica), 0))
            if now - self.last_beat > self.peer_timeout:  # it was cut off meanwhile
                self.cuts.append({"replica": self.replica, "stage": self.stage,
                                  "from_step": self._beat_step, "to_step": self.step,
                                  "seconds": round(now - self.last_beat, 2),
                                  "cause": ("store restarted" if moved else "unreachable"
                                            if self._failing else "stopped"),
                                  "open": False})
                print(f"noloco: replica {self.replica}: beating again after "
                      f"{now - self.last_beat:.1f} s cut off (steps {self._beat_step}-"
                      f"{self.step} without the others)", file=sys.stderr, flush=True)
                if self._failing:  # it trained on meanwhile: eligible for the next snapshot
                    self._beat_store.set(missed_key(self.replica), "")
            self.last_beat, self._beat_step, self._failing = now, self.step, False
            return requests

    def await_visible(self) -> bool:
        """Wait until the monitor's published live set holds this replica (at most a few beat
        intervals): a replica that registered just after a publication is out of every
        snapshot until the next one, and with fast steps the others would fix several
        without it. Starting to train only once visible closes that window. False where it
        did not show in time (it trains anyway: a later snapshot takes it in)."""
        deadline = time.monotonic() + 3 * self.interval + 0.5
        try:
            while self.replica not in live_replicas(self.store, self.replicas, self.stages):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store out of reach: the training loop's to see
            return False
        return True

    def nudge(self) -> None:
        """Beat now, from the training thread, to publish a changed flag at once; a failure is
        the beat thread's to retry."""
        with contextlib.suppress(Exception):
            self.beat(confirm=False)

    def cut_off(self) -> bool:
        """No beat went through for ``peer_timeout``: the monitor has judged this worker dead,
        its partners no longer wait for it, and it must not wait for them (module
        docstring). Only a worker with a beat thread can tell."""
        return (self._thread is not None and self.owner is None
                and time.monotonic() - self.last_beat > self.peer_timeout)

    def renew(self) -> None:
        """A new connection for the training thread after one of its requests failed."""
        self.store = self._connect()
        self.broken = False

    def _loop(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            try:
                # Join requests are read with the beat, off the training loop: a store round
                # trip per inner step would cost a network latency per step across machines.
                requests = self.beat()
                if requests is None:  # fenced: this process stops at its next step
                    return
                seen = requests > self.join_requests
                self.join_requests = requests
                if seen and self.stage > 0:
                    # Said only once the training thread will look at them: stage 0 waits
                    # for this before the step it fixed for every stage to serve at.
                    self._beat_store.set(join_seen_key(self.replica, self.stage),
                                         str(requests))
                owner = int(self._beat_store.get(owner_key(self.replica, self.stage)))
                if owner > self.incarnation:
                    self.owner = owner
                    return  # no more beats: this process stops at its next step
                wait = self.interval
            except Exception as e:  # noqa: BLE001 - the store unreachable for a while
                self.beat_failures += 1
                if not self._failing:
                    self._failing = True
                    print(f"noloco: replica {self.replica}: a heartbeat failed "
                          f"({str(e).splitlines()[0][:120]}); retrying", file=sys.stderr,
                          flush=True)
                if self._beat_store is not self.store:  # a connection of its own: renew it
                    self._beat_store = None
                # Back off, never give up; at most a second apart: a store that restarts is
                # met within a second (a try costs a refused TCP connect while it is down).
                wait = min(2 * wait, max(self.interval, 1.0))

    def finish(self, stopped: bool = False) -> None:
        """Announce that this replica finished (``stopped``: was interrupted, to be resumed):
        nobody waits for it any more."""
        self.stop()
        with contextlib.suppress(Exception):  # the store may be gone with the run
            if self.broken:
                self.renew()
            self._beat_store = self.store  # the beat thread's connection may be gone with it
            self.beat(done=True, stopped=stopped)
        if self._thread is not None and time.monotonic() - self.last_beat > self.peer_timeout:
            # cut off to the end: the period is open
            self.cuts.append({"replica": self.replica, "stage": self.stage,
                              "from_step": self._beat_step, "to_step": self.step,
                              "seconds": round(time.monotonic() - self.last_beat, 2),
                              "cause": "unreachable" if self._failing else "stopped",
                              "open": True})

    def stop(self) -> None:
        """Stop beating, and wait for a beat in flight: a store call still running on the
        thread when the process exits aborts it (C++ ``terminate``)."""
        _stop_thread(self._stop, self._thread, self.peer_timeout)

    def eligible(self) -> list[int]:
        """The members of a new snapshot: the live replicas (the monitor's view) that train —
        none joining, none finished, none marked for a missed arrival — and this one (it is
        arriving). Flags and marks are read fresh, all
        in one read: a mark must keep a replica out of the very next snapshot, and a replica
        that healed beats at once to be in it."""
        live = live_replicas(self.store, self.replicas, self.stages)
        others = sorted(r for r in live if r != self.replica)
        got = read(self.store, [heartbeat_key(r) for r in others]
                   + [missed_key(r) for r in others])
        out = [self.replica]
        self.left_out = {r: "not live" for r in range(self.replicas)
                         if r not in live and r != self.replica}
        for r, beat, mark in zip(others, got[:len(others)], got[len(others):], strict=True):
            if beat is None or mark is None or mark:
                self.left_out[r] = ("no heartbeat" if beat is None else "no mark key"
                                    if mark is None else f"marked {mark}")
                continue
            b = json.loads(beat)
            # A behind replica stays in: it heals between two steps and arrives at the
            # operation its donor comes to next — left out, every snapshot fixed while it
            # took its state would leave it behind again.
            if not (b.get("joining") or b.get("done")):
                out.append(r)
            else:
                self.left_out[r] = "joining" if b.get("joining") else "finished"
        return sorted(out)

    def others_finished(self) -> bool:
        """Every other replica's last heartbeat says it finished: none will ever donate.
        (On etcd a finished replica's beat expires with its lease: then this says no.)"""
        others = [r for r in range(self.replicas) if r != self.replica]
        return all(b is not None and json.loads(b).get("done")
                   for b in read(self.store, [heartbeat_key(r) for r in others]))

    def donors(self, commits_above: int | None = None) -> list[int]:
        """Live replicas that train (neither joining nor behind an all-reduce that went on
        without them), the furthest along first: the ones a joining or healing replica may
        take its state from — with ``commits_above``, only those that stepped with more
        all-reduces (a DiLoCo replica that is behind heals from one of those)."""
        return self.donors_among(live_replicas(self.store, self.replicas, self.stages),
                                 commits_above)

    def donors_among(self, live: dict[int, dict[str, Any]], commits_above: int | None = None
                     ) -> list[int]:
        """:meth:`donors` among ``live`` (a :func:`live_replicas` read), judged by their own
        heartbeats read now, in one read. The published set is up to a beat interval old, and
        a replica that healed says so at once (it beats as it clears its flag): judged by the
        published flags, a healing replica found every other one still behind and took its
        own state for the live one — its slow weights apart from the run's from then on."""
        ready = [(b["step"], r) for r, b in self.beats_of(live).items()
                 if b.get("ready") and not (b.get("behind") or b.get("joining")
                                            or b.get("done"))
                 and (commits_above is None or b.get("commits", 0) > commits_above)]
        return [r for _, r in sorted(ready, key=lambda x: (-x[0], x[1]))]

    def catching_up(self, commits: int) -> list[int]:
        """Live replicas that stepped with more all-reduces than ``commits`` and whose
        heartbeat, read now, still says they are behind: each clears its flag at its next step
        — by a heal of its own, or finding that nobody holds more — and is then a donor for
        one that missed what they did (:meth:`noloco.elastic.join.Joiner.heal`)."""
        live = live_replicas(self.store, self.replicas, self.stages)
        return sorted(r for r, b in self.beats_of(live).items()
                      if b.get("behind") and not b.get("done")
                      and b.get("commits", 0) > commits)

    def beats_of(self, live: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Each other replica of ``live`` → its stage 0's heartbeat as it is now (those whose
        heartbeat is gone are left out: on etcd, a lease that expired)."""
        others = sorted(r for r in live if r != self.replica)
        got = read(self.store, [heartbeat_key(r) for r in others])
        return {r: json.loads(b) for r, b in zip(others, got, strict=True) if b is not None}


_ABSENT = "\x00absent"


def probe(store: Any, key: str) -> bytes | None:
    """The key's value, or None if it was never written: one round trip (compare-and-set
    expecting a value no key holds writes nothing and answers the current value, or the
    expected one back where there is none). A store's ``get`` is two: it waits first."""
    got = store.compare_set(key, _ABSENT, _ABSENT)
    return None if got == _ABSENT.encode() else got


def await_value(store: Any, key: str, timeout: float,
                gone: Callable[[], bool] | None = None) -> bytes | None:
    """The key's value once it is written, or None after ``timeout`` seconds. A store's
    ``wait`` can return before the key exists — torch's TCPStore wakes a key's waiters on any
    compare-and-set of it, one that writes nothing included (:func:`probe`) — so each wake is
    checked, and the wait resumed until the deadline.

    The key may also have been written and deleted again before this waiter read it (it
    stalled, after the wake or before it began to wait, while the key's owner went on and
    collected it). ``gone`` tells that apart — by another key the same owner deletes — and
    ends the wait with None: at the wake that found nothing, or (a deletion wakes no waiter)
    at the end of a slice of an eighth of the timeout, at least a second; not at the
    deadline, for a key that will not come back."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    slice_ = timeout if gone is None else max(timeout / 8, 1.0)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return probe(store, key)
        with contextlib.suppress(dist.DistStoreError):  # the slice or the deadline passed
            store.wait([key], timedelta(seconds=min(left, slice_)))
        got = probe(store, key)
        if got is not None:
            return got
        if gone is not None and time.monotonic() < deadline and gone():
            return None


def live_replicas(store: Any, replicas: int, stages: int) -> dict[int, dict[str, Any]]:
    """Replica → its stage 0's newest heartbeat, for every replica alive: the monitor's
    published set (one read). Before the monitor's first publication: every replica whose
    stages have all beaten and none finished."""
    got = probe(store, live_key())
    if got is not None:
        return {int(r): b for r, b in json.loads(got).items()}
    return scan(store, replicas, stages)


def read(store: Any, keys: list[str]) -> list[str | None]:
    """Each key's value, None where it was never written: two requests when all exist (the
    common case), one more per key otherwise."""
    if not keys:
        return []
    many = getattr(store, "read_many", None)
    if many is not None:  # etcd: one transaction (EtcdStore.read_many says why)
        return [None if v is None else v.decode() for v in many(keys)]
    if store.check(keys):
        return [v.decode() for v in store.multi_get(keys)]
    present = [k for k in keys if store.check([k])]
    got = dict(zip(present, store.multi_get(present) if present else [], strict=True))
    return [got[k].decode() if k in got else None for k in keys]


def scan(store: Any, replicas: int, stages: int) -> dict[int, dict[str, Any]]:
    """Every replica with a heartbeat of each stage and no stage finished: its stage 0's beat
    (no judgement of age: that is the monitor's). All heartbeats in one read."""
    keys = [heartbeat_key(r, s) for r in range(replicas) for s in range(stages)]
    values = read(store, keys)
    out = {}
    for r in range(replicas):
        got = values[r * stages:(r + 1) * stages]
        if any(v is None for v in got):
            continue
        beats = [json.loads(v) for v in got if v is not None]
        if any(b.get("done") for b in beats):
            continue
        out[r] = {"ready": False, **beats[0], "beats": [b["n"] for b in beats],
                  "incarnations": [b["incarnation"] for b in beats]}
    return out


class Monitor:
    """Judges every heartbeat on this process's monotonic clock and publishes the live set
    (module docstring). Runs beside the store, in a thread with its own connection; learns the
    run's size and timeout from the settings the first replica writes."""

    def __init__(self, store: Any, clock: Callable[[], float] = time.monotonic,
                 prefix: str = "") -> None:
        self.store, self.clock, self.prefix = store, clock, prefix
        """``prefix``: the run epoch's keys (:func:`noloco.elastic.keys.run_prefix`)"""
        self.moved: dict[tuple[int, int], tuple[tuple[int, int], float]] = {}
        """(replica, stage) → ((incarnation, counter) last seen, when it last changed)"""
        self.settings: dict[str, Any] | None = None
        self.published = 0
        self._stop = StopEvent()
        self._thread: threading.Thread | None = None

    def start(self) -> Monitor:
        self.store = own_client(self.store)
        if self.prefix:
            self.store = Prefixed(self.store, self.prefix)
        self._thread = threading.Thread(target=self._loop, name="noloco-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        _stop_thread(self._stop, self._thread, 5.0)

    def _loop(self) -> None:
        wait = 0.05
        while not self._stop.wait(wait):
            try:
                if self.settings is None:
                    if not self.store.check([settings_key()]):
                        continue
                    self.settings = json.loads(self.store.get(settings_key()))
                self.publish()
                wait = min(1.0, self.settings["peer_timeout"] / 5)
            except Exception:  # noqa: BLE001 - the store is going away; try again
                wait = 0.5

    def judge(self) -> dict[int, dict[str, Any]]:
        """The replicas alive now, on this monitor's clock."""
        st = self.settings
        assert st is not None
        now, out = self.clock(), {}
        for r, beat in scan(self.store, st["replicas"], st["stages"]).items():
            fresh = True
            for s, mark in enumerate(zip(beat.pop("incarnations"), beat.pop("beats"),
                                         strict=True)):
                seen = self.moved.get((r, s))
                if seen is None or seen[0] != mark:
                    self.moved[(r, s)] = (mark, now)
                elif now - seen[1] > st["peer_timeout"]:
                    fresh = False
            if fresh:
                out[r] = beat
        return out

    def publish(self) -> None:
        self.store.set(live_key(), json.dumps(self.judge()))
        self.published += 1
