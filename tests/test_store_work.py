"""O(1) store work per replica per operation, and a bounded store: the real membership and
agreement code with many members (threads, each with its own store client) against one
TCPStore with the liveness monitor beside it, as ``benchmarks/elastic_scale.py`` runs it at
up to 1,024 members."""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from elastic_scale import CountingStore  # noqa: E402

from noloco.elastic import ElasticCommunicator, Membership, groups_of  # noqa: E402
from noloco.elastic.keys import live_key  # noqa: E402
from noloco.elastic.membership import Monitor, await_value, probe  # noqa: E402

PEER_TIMEOUT = 120.0
"""no member is ever late or silent here: only a starved thread on a loaded machine could
look so (the waits are the store's blocking waits: their length costs no requests)"""


def run_members(n: int, ops: int, mode: str) -> tuple[float, int, int]:
    """(store round trips per member per operation, keys held after the operations, keys
    before them)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30),
                           wait_for_workers=False)
    monitor = Monitor(server).start()
    beat = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))
    stores = [CountingStore(dist.TCPStore("127.0.0.1", server.port, None, False,
                                          timedelta(seconds=30))) for _ in range(n)]
    # No beat threads (their requests would be counted): the monitor judges a member dead
    # after the peer timeout without a beat, so it is longer than the run takes on a loaded
    # machine (at 10 s, a run slowed by the tests beside it lost members mid-run).
    members = [Membership(s, r, n, PEER_TIMEOUT).start(beat_store=beat, thread=False)
               for r, s in enumerate(stores)]
    deadline = time.monotonic() + 20
    while len(json.loads(probe(server, live_key()) or b"{}")) < n:
        assert time.monotonic() < deadline, "the monitor never saw every member"
        time.sleep(0.05)
    before = server.num_keys()
    counted = [s.requests for s in stores]

    late = [0] * n

    def run(i: int) -> None:
        comm = ElasticCommunicator(members[i], PEER_TIMEOUT)
        for c in range(ops):
            members[i].step = c + 1
            snap = comm.members()
            group = sorted(next((g for g in groups_of(snap, c, 2) if i in g), [i])
                           if mode == "exchange" else snap)
            final = comm.agree(group)
            # Nobody is slow here, but an agreement alone binds no member to wait for
            # another (a transfer would): a thread the loaded machine stalls between its
            # arrival and reading the decision, while its partner goes KEEP_OPS operations
            # on and collects the keys, is late by the protocol. It leaves out only itself.
            assert final in (group, [r for r in group if r != i]), (i, c, group, final)
            late[i] += final != group

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    per_op = sum(s.requests - c for s, c in zip(stores, counted, strict=True)) / (n * ops)
    after = server.num_keys()
    monitor.stop()
    assert not any(t.is_alive() for t in threads)
    assert sum(late) <= n * ops // 20, late  # a stall now and then, not the rule
    return per_op, after, before


# Beside the other lanes in CI this test took 122-126 s, its member threads' agreements
# running into the 120 s peer timeout (failed agreements in each of three CI logs of
# 2026-11-28, the request bound broken in one: 8.6 against 6.1 + 1.5; alone it passed in 6 s).
# The cause, found the next day: a thread stalled between its arrival and reading the decision
# while its partner went KEEP_OPS operations on and deleted it waited out the peer timeout and
# decided on nobody, marking its partner (a stall of 0.5 s in 2% of the waits reproduces it;
# the test below breaks it on purpose). Now such a thread is late within a slice of the wait
# and marks nobody, which the loop above allows; in the next CI run beside the other lanes it
# passed with no failed agreement.
@pytest.mark.slow("member threads at a real store")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["exchange", "all_reduce"])
def test_store_work_per_operation_does_not_grow_with_the_replicas(mode):
    """Requests per member per operation are the same at 4 and 24 members (the old code
    scanned every heartbeat: ~3 per member; and polled the store every 2 ms while waiting),
    and the keys held after 60 operations are those of a few operations, not of 60."""
    small, keys_small, base_small = run_members(4, 60, mode)
    big, keys_big, base_big = run_members(24, 60, mode)
    assert big <= 12 and small <= 12, (small, big)
    assert big <= small + 1.5, (small, big)
    for n, held, base in ((4, keys_small, base_small), (24, keys_big, base_big)):
        # a few operations' agreement keys (every operation's would be > 60 x (N/2) x 3)
        assert held - base <= 8 * n + 30, (n, held, base)
        assert held <= 20 * n + 30, (n, held)


@pytest.mark.slow("waits out real timeouts")
@pytest.mark.timeout(60)
def test_await_value_outlasts_wakes_that_write_nothing():
    """torch's TCPStore wakes a key's waiters on any compare-and-set of it, even one that
    writes nothing (a probe): a wait must not take such a wake for the key."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30),
                           wait_for_workers=False)
    a = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))
    b = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))

    def poke() -> None:
        for _ in range(5):
            time.sleep(0.1)
            assert probe(b, "k") is None  # wakes a's wait, writes nothing
        b.set("k", "v")

    t = threading.Thread(target=poke)
    t.start()
    t0 = time.monotonic()
    assert await_value(a, "k", 10.0) == b"v"
    assert time.monotonic() - t0 >= 0.45
    t.join()
    assert await_value(a, "absent", 0.3) is None


class Stalled:
    """A store client whose thread stalls at a wait (after the wake, or before waiting) until
    ``go`` is set, once: a thread the machine does not run for a while."""

    def __init__(self, store: dist.TCPStore, after_wake: bool) -> None:
        self.store, self.after_wake = store, after_wake
        self.waiting, self.go = threading.Event(), threading.Event()

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        stall = not self.go.is_set()
        if stall and not self.after_wake:
            self.waiting.set()
            self.go.wait(30)
        self.store.wait(keys, timeout)
        if stall and self.after_wake:
            self.waiting.set()
            self.go.wait(30)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("after_wake", [
    True, pytest.param(False, marks=pytest.mark.slow("waits out a 2.5 s slice of its wait"))],
    ids=["after_the_wake", "before_waiting"])
def test_a_member_stalled_until_its_agreement_was_collected_is_late_and_marks_nobody(
        store, after_wake):
    """Member 1 arrives; member 0 completes the agreement, decides, and goes KEEP_OPS
    operations on, deleting the agreement's keys, while member 1's thread stalls before reading
    the decision (after the wake, or before it began to wait). Member 1 then learns that it
    is late (its arrival is gone from the record) without waiting out the peer timeout, and
    without writing a decision of its own, which would mark member 0 as missing."""
    from noloco.elastic.communicator import KEEP_OPS
    from noloco.elastic.keys import missed_key

    peer_timeout = 20.0
    other = dist.TCPStore(store.host, store.port, None, False, timedelta(seconds=20))
    stalled = Stalled(other, after_wake)
    members = [Membership(s, r, 2, peer_timeout).start(thread=False)
               for r, s in enumerate([store, stalled])]
    comms = [ElasticCommunicator(m, peer_timeout) for m in members]
    got: list = []
    t = threading.Thread(target=lambda: got.append((comms[1].agree([0, 1]),
                                                    time.monotonic())))
    t.start()
    deadline = time.monotonic() + 20
    # member 1 arrived and counted itself in (else member 0 would count first and wait)
    tag = _tag(comms[1])
    while b"1," not in (probe(store, f"{tag}/in") or b"") or probe(store, f"{tag}/n") != b"1":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if after_wake:
        assert comms[0].agree([0, 1]) == [0, 1]  # completes the count: decides; wakes 1
        assert stalled.waiting.wait(20)
    else:
        assert stalled.waiting.wait(20)  # stalled before its wait
        assert comms[0].agree([0, 1]) == [0, 1]
    for _ in range(KEEP_OPS):
        assert comms[0].agree([0]) == [0]  # alone: its owned keys of call 0 are collected
    assert probe(store, f"{tag}/in") is None
    released = time.monotonic()
    stalled.go.set()
    t.join(30)
    final, at = got[0]
    assert final == [0]  # late: the others went on without it
    assert comms[1].events[-1]["kind"] == "late" and comms[1].events[-1]["missing"] == []
    assert probe(store, missed_key(0)) in (None, b"")  # member 0 is not marked as missing
    # no wait for the deadline (20 s): at the wake, or at the end of a slice (a deletion
    # wakes nobody; slices of max(timeout / 8, 1 s) = 2.5 s)
    assert at - released < (2.0 if after_wake else peer_timeout / 2), at - released
    for m in members:
        m.stop()


def _tag(comm: ElasticCommunicator) -> str:
    """The store prefix of ``comm``'s first operation, an agreement of members 0 and 1."""
    from noloco.elastic.keys import op_tag
    return op_tag(0, comm.m.stage, 0, [0, 1])


@pytest.mark.slow("waits out a 2.5 s slice of its wait")
@pytest.mark.timeout(60)
def test_a_member_marked_as_missed_learns_within_a_slice_that_its_operation_is_over(store):
    """Member 1 comes to operation 0 after it went on without it (its mark says so: a cut-off
    replica coming back behind the others). Nobody else will arrive: it learns that it is
    late at the end of the first slice of its wait (2.5 s of a 20 s peer timeout), not at the
    deadline, and marks nobody."""
    from noloco.elastic.keys import missed_key

    members = [Membership(store, r, 2, 20.0).start(thread=False) for r in range(2)]
    comm = ElasticCommunicator(members[1], 20.0)
    store.set(missed_key(1), "m:0")  # what member 0's decision without it wrote
    t0 = time.monotonic()
    assert comm.agree([0, 1]) == []  # late: the others went on
    assert time.monotonic() - t0 < 10.0
    assert comm.events[-1]["kind"] == "late"
    assert probe(store, missed_key(0)) == b""
    for m in members:
        m.stop()
