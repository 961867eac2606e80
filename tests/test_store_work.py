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

    def run(i: int) -> None:
        comm = ElasticCommunicator(members[i], PEER_TIMEOUT)
        for c in range(ops):
            members[i].step = c + 1
            snap = comm.members()
            group = (next((g for g in groups_of(snap, c, 2) if i in g), [i])
                     if mode == "exchange" else snap)
            assert comm.agree(group) == sorted(group)  # nobody is late here

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    per_op = sum(s.requests - c for s, c in zip(stores, counted, strict=True)) / (n * ops)
    after = server.num_keys()
    monitor.stop()
    return per_op, after, before


# Alone: beside the other lanes in CI this test took 122-126 s, its member threads' agreements
# running into the 120 s peer timeout (failed agreements in each of the session's three CI
# logs of 2026-11-28, the request bound broken in one: 8.6 against 6.1 + 1.5). Alone, and
# beside three busy loops, it passes in 6 s with none. The cause is not found yet.
@pytest.mark.slow("member threads at a real store")
@pytest.mark.alone("24 member threads whose agreements ran into the peer timeout beside "
                   "other lanes")
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
