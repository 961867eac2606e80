"""The store layout of an elastic run: every key the replicas read and write, in one place."""

from __future__ import annotations

PREFIX = "noloco/elastic"


def heartbeat_key(replica: int, stage: int = 0) -> str:
    """JSON: the beat counter ``n`` (never a time), step, incarnation, and the flags ready,
    joining, behind and, in the last beat of a replica that finished, done."""
    return f"{PREFIX}/hb/{replica}/{stage}"


def missed_key(replica: int) -> str:
    """``m:C`` once an operation C was decided without this replica (it missed its arrival),
    empty again when it is back (:mod:`noloco.elastic.communicator`). A replica with a mark is
    left out of new snapshots: nobody waits for it twice."""
    return f"{PREFIX}/missed/{replica}"


def op_tag(call: int, stage: int, attempt: int, group: list[int]) -> str:
    """The store prefix of one group's agreement in operation ``call`` (one per stage: each
    stage's replicas exchange their own part of the model) and its process group."""
    return f"{PREFIX}/op/{call}/s{stage}/{attempt}/" + "-".join(map(str, group))


def join_key(donor: int) -> str:
    """The counter of join requests made to ``donor`` (each request under ``KEY/N``)."""
    return f"{PREFIX}/join/{donor}"


def snapshot_key(call: int) -> str:
    """The members of operation ``call``, written once. One key for every stage: a replica's
    stages take part together or not at all, with the same partners."""
    return f"{PREFIX}/snap/{call}"


def owner_key(replica: int, stage: int = 0) -> str:
    """The incarnation that owns this replica's stage: the newest start (never lowered)."""
    return f"{PREFIX}/owner/{replica}/{stage}"


def live_key() -> str:
    """The live set, published by the store host's :class:`~noloco.elastic.membership.Monitor`
    (JSON: replica → its stage 0's newest heartbeat, for every replica judged alive)."""
    return f"{PREFIX}/live"


def settings_key() -> str:
    """What the monitor needs to know of the run (replicas, stages, peer timeout), written by
    the first replica to start (compare-and-set: every replica has the same settings)."""
    return f"{PREFIX}/settings"
