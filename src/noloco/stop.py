"""A stop flag for the periodic threads (heartbeats, the liveness monitor, status writers).

Its timed :meth:`StopEvent.wait` sleeps in short slices instead of one timed lock wait. A
timed lock wait (``sem_clockwait`` on the monotonic clock) is computed from a reading of that
clock; under libfaketime 0.9.10, which fakes the monotonic clock but does not wrap
``sem_clockwait``, it waits for minutes instead of the interval, so a heartbeat thread stops
beating while its training thread runs on (measured: no beat in 5 s at a 0.6 s interval,
``faketime -f +120s``). ``time.sleep`` is wrapped consistently. The tests of liveness under
skewed clocks run under libfaketime, and a beat thread must beat there as anywhere.

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import threading
import time

SLICE = 0.05
"""the longest sleep between two looks at the flag: the latency of a stop"""


class StopEvent(threading.Event):
    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return super().wait()
        end = time.monotonic() + timeout
        while not self.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, SLICE))
        return True
