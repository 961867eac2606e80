"""An elastic operation's gloo group has two deadlines (noloco.elastic.communicator.Gloo):
connecting, bounded near the peer timeout (every member comes straight from the agreement),
and moving the bytes, bounded by --comm-timeout (a slow link)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from noloco.elastic import ElasticCommunicator, Membership
from noloco.elastic import communicator as comm_mod


def members(store, n: int, peer_timeout: float, comm_timeout: float
            ) -> list[ElasticCommunicator]:
    """``n`` members, each with its own client of the store (as each replica has)."""
    from datetime import timedelta

    import torch.distributed as dist

    clients = [dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=20))
               for _ in range(n)]
    ms = [Membership(c, r, n, peer_timeout).start(beat_store=c, thread=False)
          for r, c in enumerate(clients)]
    return [ElasticCommunicator(m, peer_timeout, comm_timeout) for m in ms]


def test_a_member_that_never_connects_is_given_up_at_the_connect_deadline(store, monkeypatch):
    """Replica 1 arrived (it is in the final list) but never connects: killed, stalled, or
    counted in by mistake. Replica 0 gives up after the connect deadline, not after the
    transfer's --comm-timeout (60 s here): that wait once held a run for two minutes."""
    monkeypatch.setattr(comm_mod, "CONNECT_FLOOR", 1.0)
    c = members(store, 2, 0.5, 60.0)[0]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        c._group(3, "noloco/test/op/3", [0, 1])
    assert time.monotonic() - t0 < 10


def test_a_slow_transfer_outlasts_the_connect_deadline(store, monkeypatch):
    """Connected, the bytes may take longer than the connect deadline (here a sender that
    starts 2 s late, past the 1 s connect deadline): every send, receive and collective
    waits for the transfer's deadline."""
    monkeypatch.setattr(comm_mod, "CONNECT_FLOOR", 1.0)
    cs = members(store, 2, 0.5, 30.0)
    got: dict[int, object] = {}

    def member(r: int) -> None:
        try:
            pg = cs[r]._group(5, "noloco/test/op/5", [0, 1])
            t = torch.full((8,), float(r + 1))
            if r == 1:
                time.sleep(2)
                pg.send([t], 0, 0).wait()
                time.sleep(2)
            else:
                pg.recv([t], 1, 0).wait()
                got["recv"] = t.tolist()
            pg.allreduce([t]).wait()
            got[r] = t.tolist()
        except RuntimeError as e:
            got[r] = str(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got["recv"] == [2.0] * 8
    assert got[0] == got[1] == [4.0] * 8, got
