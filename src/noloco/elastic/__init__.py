"""Elastic training: a replica is a fault domain (``--elastic``).

The package, in the order data flows: :mod:`.keys` (the store layout), :mod:`.membership`
(heartbeats, who is alive), :mod:`.communicator` (snapshots, arrival agreement and the
per-operation process groups), :mod:`.join` (a replica taking a live replica's state),
:mod:`.worker` (one replica's training), :mod:`.launcher` (this machine's replicas) and
:mod:`.coordinator` (the store of a run across machines).

In a static run all N workers share one ``torch.distributed`` world, and one dead or frozen
process stops every replica. Here replicas share nothing but the run's c10d ``TCPStore``
(hosted by the local launcher): no world process group, no collective over all replicas.

Membership
    Every worker writes a heartbeat into the store from a daemon thread with its own store
    connection (a frozen process stops writing; a training thread blocked in the store does
    not). A heartbeat holds a counter, never a time. The store host's monitor (the local
    launcher, or ``noloco coordinator``) notes on its own monotonic clock when each counter
    last moved: a replica is *alive* while every stage's counter moved within
    ``--peer-timeout`` and none announced that it finished. It publishes that set under one
    key; replicas read it in one request. No two clocks are ever compared, so machines whose
    wall clocks disagree (or jump) see each other as they are.

Snapshots: who takes part in operation c
    Every replica issues the same sequence of operations (one per outer step or fragment
    sync: the schedule is a function of the step alone), numbered c = 0, 1, ... The first
    replica to reach operation c claims it and writes the list of *eligible* replicas — alive,
    training (not joining), not marked for a missed arrival — under the store key
    of c with compare-and-set; every later replica reads that value back. Invariant: the key
    is written once and never changed (compare-and-set on the store's server is atomic), so
    every replica that reaches c sees the same list, draws the same groups from it (a
    deterministic function of the list, the seed and c) and so the same partner — two
    replicas can never disagree on who their partner is.

Arrival: who actually comes
    A member of a group appends itself to the group's arrival list for c and counts itself
    in; the one completing the count fixes the set, the others wait (the store's blocking
    wait) at most ``--peer-timeout`` and then fix the set of whoever arrived, with
    compare-and-set: everyone reads that same set. Whoever fixes a set without a member marks
    it as missed: it is left out of new snapshots until it arrives again (caught up first by
    taking a live state if it is further behind than a partner would wait). A replica that
    arrives after the set was fixed without it goes on alone (its weights unchanged by the
    exchange). The members of the set build a gloo process group on a store prefix named
    after c, the group and the attempt — exactly those members, no call on any other
    process — and exchange; the transfer gets ``--comm-timeout``. A member that dies during
    the exchange breaks the connection (kill) or lets it time out (stall): NoLoCo averages
    with the members whose data arrived; an all-reduce (DiLoCo) has one outcome (below).

One outcome per all-reduce
    Each member reports its attempt by compare-and-set on the attempt's outcome key: the
    first report stands. ``commit`` (a member's collective completed): every member whose
    collective completed steps with the mean — a ring's result is the same bits on each —
    and the others are *behind* and take a committed replica's state. ``abort`` (a member's
    collective failed first): every member discards its result, also one that completed, and
    all retry among the same list (the attempt's members, not each one's own view of who is
    alive); whoever does not arrive at the retry misses it. After ``MAX_ATTEMPTS`` aborts the
    members skip the outer step alike — still identical to each other. So the replicas
    that step stay bit-identical whatever breaks when.

Cut off
    Every store request of a worker has a deadline (:mod:`noloco.elastic.deadline`). A
    worker whose heartbeat has not gone through for ``--peer-timeout`` is cut off: it is
    judged dead, nobody waits for it, and it touches the store not at all — NoLoCo
    exchanges with nobody, DiLoCo skips its outer steps and is behind — so a partitioned
    replica writes nothing anyone reads (no split brain). When a beat goes through again
    it is a replica that missed operations (above): back in the next snapshot, or healed.

Store work
    O(1) round trips per replica per operation, whatever the number of replicas; every key
    of an operation has an owner that deletes it a few operations later, so the store holds
    a bounded number of keys whatever the run's length.

With nobody failing every snapshot holds all replicas, every set is the whole group, and the
values exchanged and summed are the static path's: elastic NoLoCo is bit-identical to static
NoLoCo (a test checks).

Floor 2 of docs/architecture.md: communication and the methods.
"""

from noloco.elastic.communicator import ElasticCommunicator, groups_of
from noloco.elastic.keys import PREFIX, heartbeat_key, join_key
from noloco.elastic.membership import Membership, Monitor, live_replicas

__all__ = ["PREFIX", "ElasticCommunicator", "Membership", "Monitor", "groups_of",
           "heartbeat_key", "join_key", "live_replicas"]
