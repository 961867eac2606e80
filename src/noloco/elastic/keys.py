"""The store layout of an elastic run: every key the replicas read and write, in one place.

Floor 0 of docs/architecture.md: foundations."""

from __future__ import annotations

PREFIX = "noloco/elastic"


def heartbeat_key(replica: int, stage: int = 0) -> str:
    """JSON: the beat counter ``n`` (never a time), step, incarnation, and the flags ready,
    joining, behind and, in the last beat of a replica that finished, done (with stopped
    where it was interrupted)."""
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


def join_seen_key(donor: int, stage: int) -> str:
    """How many join requests to ``donor`` its stage ``stage`` (> 0) has seen: with pipeline
    stages, stage 0 fixes the step every stage serves at only once the others will look
    (:meth:`noloco.elastic.join.Joiner._serve_staged`)."""
    return f"{PREFIX}/join/{donor}/seen/{stage}"


def snapshot_key(call: int) -> str:
    """The members of operation ``call``, written once. One key for every stage: a replica's
    stages take part together or not at all, with the same partners."""
    return f"{PREFIX}/snap/{call}"


def owner_key(replica: int, stage: int = 0) -> str:
    """The incarnation that owns this replica's stage: the newest start (never lowered)."""
    return f"{PREFIX}/owner/{replica}/{stage}"


def starts_key(replica: int, stage: int = 0) -> str:
    """How many times this replica's stage was started (a counter): a start's number is its
    incarnation; a respawn, or a machine's command run again, is a later one."""
    return f"{PREFIX}/starts/{replica}/{stage}"


def stop_key(replica: int, incarnation: int) -> str:
    """JSON: the steps a replica's pipeline stages are at after a stop signal, and the step
    they stop at once every stage posted (:meth:`noloco.train.Trainer.agree_stop_step`)."""
    return f"{PREFIX}/stop/{replica}/{incarnation}"


def live_key() -> str:
    """The live set, published by the store host's :class:`~noloco.elastic.membership.Monitor`
    (JSON: replica → its stage 0's newest heartbeat, for every replica judged alive)."""
    return f"{PREFIX}/live"


def settings_key() -> str:
    """What the monitor needs to know of the run (replicas, stages, peer timeout), written by
    the first replica to start (compare-and-set: every replica has the same settings)."""
    return f"{PREFIX}/settings"


# ---- the namespace of every key above -------------------------------------------------------
# A worker's store connection (noloco.elastic.deadline.Namespace) puts every key of the run
# under ``run/RUN_ID/EPOCH/``: runs sharing one coordinator never see each other's keys, and a
# coordinator that restarts empty starts a new epoch whose keys no operation of the old one can
# meet. Only the keys below live outside any run.

BOOT_KEY = "noloco/boot"
"""A token the store's host writes once as it starts (before any worker reads it): a worker
that reconnects and finds another one knows the store was wiped — a coordinator restarted."""

RUNS_KEY = "noloco/runs"
"""``RUN_ID/EPOCH,`` appended once per epoch of each run: what the coordinator monitors and
``noloco status`` lists."""


def run_prefix(run_id: str, epoch: int) -> str:
    return f"run/{run_id}/{epoch}/"


def epoch_key(run_id: str) -> str:
    """The run's current epoch in this store, written once per store life (compare-and-set)."""
    return f"run/{run_id}/epoch"
