"""The lock that keeps an ``alone`` test alone in a parallel run (tests/lanes.py)."""

from __future__ import annotations

import threading
import time

from lanes import Lanes


def test_an_alone_test_waits_for_the_other_lane_and_then_runs_by_itself(tmp_path):
    """Each Lanes opens the files anew (one lane each): flock locks belong to an open file,
    so lanes in one process exclude each other as lanes in two do."""
    a, b, c = (Lanes(str(tmp_path)) for _ in range(3))
    events: list[str] = []

    def run(lanes: Lanes, alone: bool, name: str, hold: float) -> None:
        with lanes.hold(alone):
            events.append(f"{name} in")
            time.sleep(hold)
            events.append(f"{name} out")

    first = threading.Thread(target=run, args=(a, False, "shared", 0.6))
    first.start()
    time.sleep(0.1)
    alone = threading.Thread(target=run, args=(b, True, "alone", 0.3))
    alone.start()
    time.sleep(0.1)
    # A shared test asked for after the alone one waits behind it (the turnstile), though
    # the lock is only held shared at that moment.
    later = threading.Thread(target=run, args=(c, False, "later", 0.0))
    later.start()
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
