"""A replica cut off from the run's store: how far it may train alone, and how it meets the
others again when the link returns (noloco.elastic.join.Joiner._wait_for_link, _realign)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from noloco.config import Config, ConfigError
from noloco.elastic.join import Joiner
from noloco.elastic.keys import live_key, missed_key


class Comm:
    """What the joiner reads of an elastic communicator after a cut."""

    def __init__(self, store, lonely: int, op_step: int) -> None:
        self.store, self.lonely, self.lonely_from_step, self.op_step = store, lonely, 3, op_step
        self.calls, self.events, self.backs = 12, [], 0

    def back(self) -> None:
        self.store.set(missed_key(0), "")
        self.backs += 1


def replica(store, lonely: int, op_step: int, step: int, peer_timeout: float = 2.0,
            stages: int = 1, cut: list[bool] | None = None) -> Joiner:
    cfg = Config()
    cfg.method.peer_timeout, cfg.method.max_lonely_outer_steps = peer_timeout, 2
    cfg.train.coordinator_timeout = 60.0
    cut = cut if cut is not None else [False]
    m = SimpleNamespace(replica=0, replicas=3, stages=stages, ns=None, store=store, cuts=[{}],
                        cut_off=lambda: cut[0], last_beat=time.monotonic(),
                        nudge=lambda: None, broken=False)
    store.set(missed_key(0), "")
    j = Joiner(m)
    j.attach(SimpleNamespace(cfg=cfg, comm=Comm(store, lonely, op_step),
                             lay=SimpleNamespace(replica=0, stages=stages),
                             state=SimpleNamespace(step=step),
                             status=SimpleNamespace(stop_signal=None)))
    return j


def live(store, **steps: int) -> None:
    """The monitor's live set: replica → its beat (replica 0 is this one)."""
    store.set(live_key(), json.dumps({r[1:]: {"step": s} for r, s in steps.items()}))


def test_a_replica_ahead_waits_out_of_new_snapshots_until_the_others_reach_it(store):
    """Ahead after a cut (its latest operation at step 40, the others at 30): it waits, marked
    as missed (new snapshots leave it out, so nobody waits for it at operations it did alone),
    until the others have passed step 40; then it is back, and the partition says how."""
    j = replica(store, lonely=6, op_step=40, step=44)
    live(store, r0=44, r1=30, r2=29)
    marks = []

    def the_others_train() -> None:
        for s in range(31, 43):
            time.sleep(0.05)
            marks.append(store.get(missed_key(0)).decode())
            live(store, r0=44, r1=s, r2=s - 1)

    t = threading.Thread(target=the_others_train)
    t.start()
    j._realign()
    t.join()
    comm = j.trainer.comm
    assert marks[0].startswith("m:") and comm.backs == 1
    assert store.get(missed_key(0)) == b""
    ev = comm.events[-1]
    assert ev["kind"] == "realigned" and ev["realigned"] == "waited" and ev["ahead_steps"] == 10
    assert ev["lonely_ops"] == 6 and ev["lonely_from_step"] == 3 and comm.lonely == 0
    assert j.membership.cuts[-1]["realigned"] == "waited"
    seen = json.loads(store.get(live_key()))
    assert int(seen["1"]["step"]) > 40  # it left the wait only once they passed its step


@pytest.mark.parametrize("others, how", [({"r1": 40}, "level"), ({"r1": 55}, "behind"),
                                         ({}, "alone")])
def test_level_behind_or_alone_it_goes_on_at_once(store, others, how):
    """Level (every replica was cut off alike: a coordinator outage), behind (it takes a live
    state at its next operation) or alone: no wait, and it says which."""
    j = replica(store, lonely=4, op_step=40, step=42)
    live(store, r0=42, **others)
    t0 = time.monotonic()
    j._realign()
    assert time.monotonic() - t0 < 1.0
    assert j.trainer.comm.events[-1]["realigned"] == how and j.trainer.comm.backs == 0


def test_the_wait_ends_when_the_others_stop_training(store):
    """Ahead of replicas that no longer move (stuck, or finishing): it waits one peer timeout
    without progress, not forever."""
    j = replica(store, lonely=3, op_step=40, step=41, peer_timeout=0.5)
    live(store, r0=41, r1=20)
    t0 = time.monotonic()
    j._realign()
    assert 0.4 < time.monotonic() - t0 < 3.0
    assert j.trainer.comm.events[-1]["realigned"] == "waited" and j.trainer.comm.backs == 1


def test_alone_for_the_bound_it_waits_for_the_link_then_realigns(store):
    """Cut off with --max-lonely-outer-steps (2) operations done alone: it trains no further
    until the link returns, says so, and then re-aligns."""
    cut = [True]
    j = replica(store, lonely=2, op_step=40, step=41, cut=cut)
    live(store, r0=41, r1=60)
    threading.Timer(0.5, lambda: cut.__setitem__(0, False)).start()
    t0 = time.monotonic()
    assert j.partition_check()
    assert time.monotonic() - t0 >= 0.45
    kinds = [e["kind"] for e in j.trainer.comm.events]
    assert kinds == ["waited_for_link", "realigned"], kinds
    assert j.trainer.comm.events[-1]["realigned"] == "behind"


def test_below_the_bound_a_replica_cut_off_trains_on(store):
    j = replica(store, lonely=1, op_step=40, step=41, cut=[True])
    t0 = time.monotonic()
    assert not j.partition_check()
    assert time.monotonic() - t0 < 0.2 and j.trainer.comm.events == []


def test_the_bound_is_checked():
    cfg = Config()
    cfg.method.elastic, cfg.method.max_lonely_outer_steps = True, -1
    cfg.method.method, cfg.method.replicas = "noloco", 2
    with pytest.raises(ConfigError, match="--max-lonely-outer-steps must be >= 0"):
        cfg.resolved()


def test_a_stop_signal_ends_the_wait_for_the_link(store):
    """Ctrl-C while it waits for the link: it stops waiting at once (the step boundary then
    saves and stops), instead of after --coordinator-timeout."""
    j = replica(store, lonely=2, op_step=40, step=41, cut=[True])
    threading.Timer(0.3, lambda: setattr(j.trainer.status, "stop_signal", 2)).start()
    t0 = time.monotonic()
    assert not j.partition_check()
    assert time.monotonic() - t0 < 2.0 and j.trainer.comm.lonely == 2


def test_pipeline_stages_cut_off_train_on_alone(store):
    """A replica's stages never wait at the bound: a stage that waited would hold the others
    past --comm-timeout."""
    j = replica(store, lonely=5, op_step=40, step=41, stages=2, cut=[True])
    t0 = time.monotonic()
    assert not j.partition_check()
    assert time.monotonic() - t0 < 0.2


def test_a_replica_that_missed_an_operation_leaves_a_decision_for_a_later_partner(store):
    """A replica marked as missed from operation 7 on (the others went on without it while
    it was cut off) arrives at operation 7, waits out the peer timeout and leaves: the
    operation was over long ago. Its arrival is on record, so it also leaves that decision: a
    partner coming later still (behind as well, or redoing the operation from a checkpoint)
    is late at once. It used to count the leaver in and wait for it to connect until the
    transfer timeout: a respawned replica lost two minutes so."""
    from noloco.elastic import ElasticCommunicator, Membership

    members = [Membership(store, r, 2, 0.5).start(beat_store=store, thread=False)
               for r in range(2)]
    comms = [ElasticCommunicator(m, 0.5) for m in members]
    for c in comms:
        c.calls = 7
    store.set(missed_key(1), "m:9")
    assert comms[1].agree([0, 1]) == []  # not in: the others went on without it
    assert comms[0].agree([0, 1]) == []  # late, at once: the decision stands
    assert comms[0].last_agree_seconds < 0.4
    # It marked nobody: not the partner (which may have done the operation long ago), nor
    # itself below the later operation its mark names.
    assert store.get(missed_key(1)) == b"m:9"
    assert store.get(missed_key(0)) == b""


def test_until_it_realigned_a_replica_back_from_a_cut_goes_no_further(store):
    """Back from operations alone, a replica that cannot re-align yet (its connection broke
    with the old store; or the store fails again) says it is not through (partition_check
    False: no heal, no serving this time) — a heal then could find nobody with more
    all-reduces yet and take its own state for the live one. A broken connection is renewed
    first; once the re-alignment goes through, it is."""
    import torch.distributed as dist

    j = replica(store, lonely=4, op_step=40, step=42)
    live(store, r0=42, r1=40)
    m = j.membership
    m.broken, renewals = True, []

    def renew() -> None:
        renewals.append(True)
        if len(renewals) == 1:
            raise dist.DistStoreError("still out of reach")
        m.broken = False

    m.renew = renew
    assert not j.partition_check()  # the renewal failed: not re-aligned
    assert j.trainer.comm.lonely == 4 and j.trainer.comm.events == []
    steps = j._steps_of_others
    j._steps_of_others = lambda: (_ for _ in ()).throw(dist.DistStoreError("gone again"))
    assert not j.partition_check()  # renewed, but the re-alignment failed
    assert j.trainer.comm.lonely == 4 and m.broken
    j._steps_of_others = steps
    assert j.partition_check()  # renewed again, and re-aligned
    assert len(renewals) == 3 and j.trainer.comm.lonely == 0
    assert j.trainer.comm.events[-1]["realigned"] == "level"
