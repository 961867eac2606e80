"""The store layout of an elastic run: every key the replicas read and write, in one place."""

from __future__ import annotations

PREFIX = "noloco/elastic"


def heartbeat_key(replica: int, stage: int = 0) -> str:
    return f"{PREFIX}/hb/{replica}/{stage}"


def done_key(replica: int, stage: int = 0) -> str:
    return f"{PREFIX}/done/{replica}/{stage}"


def join_key(donor: int) -> str:
    """The counter of join requests made to ``donor`` (each request under ``KEY/N``)."""
    return f"{PREFIX}/join/{donor}"
