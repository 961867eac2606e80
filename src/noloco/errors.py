"""The errors a user sees as one line (exit code 2), below every other module so that any of
them may raise one without importing what raises it elsewhere.

Floor 0 of docs/architecture.md: foundations."""

from __future__ import annotations

import signal


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 worker``, ``2 workers``: a count with its noun, as a user reads it."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


class ConfigError(ValueError):
    """An impossible or malformed configuration (reported as one line, exit code 2)."""


SUPERSEDED_EXIT = 3
"""the exit code of an elastic worker whose replica a newer process took over"""


class Superseded(RuntimeError):
    """An elastic replica's id is owned by a newer process (a second launcher with the same
    ``--replica-ids``, or a machine's command run again while the old one still runs): this
    older one stops, in one line, without writing anything more."""

    def __init__(self, replica: int, stage: int, mine: int, owner: int) -> None:
        super().__init__(f"replica {replica}" + (f" stage {stage}" if stage else "")
                         + f": a newer process (start {owner + 1}) took this replica over; "
                         f"this one (start {mine + 1}) stops")
        self.replica = replica


STORE_LOST_EXIT = 4
"""the exit code of an elastic worker that could not reach its run's store (the coordinator)
for ``--coordinator-timeout``: it saved a checkpoint and stopped (not to be respawned)"""


class StoreLost(RuntimeError):
    """An elastic worker trained on without its run's store for ``--coordinator-timeout``."""


class Interrupted(Exception):
    """SIGTERM (or SIGINT) asked this worker to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
