"""Tests side by side without starving one: the lock that keeps an ``alone`` test alone.

The suite runs in three lanes (``-n 3``, pytest-xdist) on two cores: most multi-process tests
wait much of the time (a peer timeout, a cut link, a restarted coordinator, paced steps), so
three of them side by side keep the two cores busy. A test that keeps both cores busy by
itself (four replicas training flat out) gains nothing from a neighbour and would starve one:
the neighbour's replicas would miss their peer timeouts. Such a test is marked
``@pytest.mark.alone("why")`` and runs with nothing beside it.

How: a readers-writer lock over one file that the lanes of a run share. Every test holds it
shared from its setup to its teardown, an ``alone`` test holds it exclusive. A second file
is the turnstile that keeps an ``alone`` test from waiting forever behind a lane that takes
one shared test after another: whoever wants the lock passes the turnstile first, and an
``alone`` test holds the turnstile while it waits, so the other lane's next test waits behind
it. ``flock`` locks are released by the kernel when their process dies, so a lane killed in
the middle of a test leaves nothing locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator


class Lanes:
    def __init__(self, folder: str) -> None:
        self._lock = os.open(os.path.join(folder, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        self._turnstile = os.open(os.path.join(folder, "turnstile"), os.O_RDWR | os.O_CREAT,
                                  0o600)

    @contextlib.contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)


ENV = "NOLOCO_TEST_LANES"
"""the folder of the lock files, made by the controller of a parallel run before it starts
its lanes (they inherit its environment)"""


def make_folder() -> str:
    folder = tempfile.mkdtemp(prefix="noloco-lanes-")
    os.environ[ENV] = folder
    return folder


def for_this_lane() -> Lanes | None:
    """The lock of this parallel run; None outside a lane of one."""
    folder = os.environ.get(ENV)
    if not folder or not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return Lanes(folder)
