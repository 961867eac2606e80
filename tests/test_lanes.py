"""The lock that keeps an ``alone`` test alone in a parallel run (tests/lanes.py)."""

from __future__ import annotations

import fcntl
import os
import threading
import time

from lanes import Lanes


def _held(path: str) -> bool:
    """Whether another open file holds an flock on ``path``."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _until(what, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_alone_test_waits_for_the_other_lane_and_then_runs_by_itself(tmp_path):
    """Each Lanes opens the files anew (one lane each): flock locks belong to an open file,
    so lanes in one process exclude each other as lanes in two do."""
    a, b, c = (Lanes(str(tmp_path)) for _ in range(3))
    events: list[str] = []
    release = threading.Event()

    def run(lanes: Lanes, alone: bool, name: str, hold: threading.Event | None) -> None:
        with lanes.hold(alone):
            events.append(f"{name} in")
            if hold is not None:
                hold.wait(10)
            events.append(f"{name} out")

    first = threading.Thread(target=run, args=(a, False, "shared", release))
    first.start()
    _until(lambda: events == ["shared in"])
    alone = threading.Thread(target=run, args=(b, True, "alone", None))
    alone.start()
    # it waits for the lock holding the turnstile
    _until(lambda: _held(str(tmp_path / "turnstile")))
    # A shared test asked for after the alone one waits behind it (the turnstile), though
    # the lock is only held shared at this moment.
    later = threading.Thread(target=run, args=(c, False, "later", None))
    later.start()
    time.sleep(0.2)
    assert events == ["shared in"]  # neither got in beside the first
    release.set()
    for t in (first, alone, later):
        t.join(10)
    assert events == ["shared in", "shared out", "alone in", "alone out", "later in",
                      "later out"]


def test_shared_tests_run_side_by_side(tmp_path):
    a, b = Lanes(str(tmp_path)), Lanes(str(tmp_path))
    inside = threading.Event()

    def other() -> None:
        with b.hold(False):
            inside.set()

    with a.hold(False):
        t = threading.Thread(target=other)
        t.start()
        assert inside.wait(2)  # while this lane still holds it
    t.join(2)
