"""Naming the peer that stopped answering.

A worker blocked in a collective or an exchange cannot tell, from inside the wait, whether
its peers are slow, stuck or dead: gloo only reports a timeout, or a broken connection by
address, and the rank it names is often a healthy one. So every worker keeps a heartbeat in
the run's key-value store (the c10d store its process group was built on):

    noloco/hb/<attempt>/<rank> = {"step", "t" (wall clock), "pid", "op", "since"}

published by a daemon thread every ``interval`` seconds. A stopped process (SIGSTOP, a frozen
or partitioned machine) stops its heartbeat with it; a slow one keeps beating but falls behind
in steps. The training thread marks every blocking wait with :meth:`Watchdog.waiting`; when a
wait lasts longer than ``stall_warning``, the daemon reads the heartbeats of exactly the ranks
being waited for and prints, once per wait, which of them is to blame. When the wait then
fails (``--comm-timeout``, or a connection reset), :meth:`Watchdog.explain` turns gloo's error
into a :class:`~noloco.comm.CommError` naming that rank.

The heartbeat is written by the daemon thread, never the training thread, so a slow store
(across machines) never slows a step; wall clocks of different machines only need to agree
to well within ``stall_warning``.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from noloco.stop import StopEvent


def heartbeat_key(attempt: int, rank: int) -> str:
    return f"noloco/hb/{attempt}/{rank}"


class Watchdog:
    def __init__(self, store: Any, rank: int, attempt: int, describe: Callable[[int], str],
                 stall_warning: float = 30.0, interval: float | None = None,
                 out: TextIO | None = None) -> None:
        self.store, self.rank, self.attempt = store, rank, attempt
        self.describe, self.stall_warning = describe, stall_warning
        self.interval = interval or max(0.05, min(1.0, stall_warning / 3))
        self.stale_after = max(3 * self.interval, 1.0)
        self.out = out or sys.stderr
        self.step = 0
        self._wait: tuple[str, tuple[int, ...], float] | None = None
        self._warned: float | None = None
        self._stop = StopEvent()
        self._thread: threading.Thread | None = None

    # ---- the training thread -------------------------------------------------------------
    @contextlib.contextmanager
    def waiting(self, op: str, ranks: Sequence[int]) -> Iterator[None]:
        """Mark a blocking wait for ``ranks`` (global ranks) in operation ``op``."""
        outer = self._wait
        if outer is None:
            self._wait = (op, tuple(r for r in ranks if r != self.rank), time.time())
        try:
            yield
        finally:
            if outer is None:
                self._wait = None

    def start(self) -> Watchdog:
        self.publish()
        self._thread = threading.Thread(target=self._loop, name="noloco-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    # ---- the daemon thread -----------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return heartbeat_key(self.attempt, rank)

    def publish(self) -> None:
        w = self._wait
        beat = {"step": self.step, "t": time.time(), "pid": os.getpid(),
                "op": w[0] if w else None, "since": w[2] if w else None}
        with contextlib.suppress(Exception):  # a store that went away must not kill training
            self.store.set(self._key(self.rank), json.dumps(beat))

    def _loop(self) -> None:
        tick = time.monotonic()
        while not self._stop.wait(self.interval):
            self.publish()
            last, tick = tick, time.monotonic()
            if tick - last > self.stale_after:
                continue  # this process was the one stopped (SIGSTOP): the stall is ours
            w = self._wait
            if w is None or self._warned == w[2]:
                continue
            waited = time.time() - w[2]
            if waited >= self.stall_warning:
                self._warned = w[2]
                culprit, why = self.diagnose(w[1])
                whom = (f"{self.describe(culprit)}: {why}" if culprit is not None
                        else f"ranks {list(w[1])}: {why}")
                print(f"noloco: warning: {self.describe(self.rank)} has waited {waited:.0f} s "
                      f"in {w[0]} at step {self.step} for {whom}", file=self.out, flush=True)

    # ---- reading the others' heartbeats --------------------------------------------------
    def heartbeat(self, rank: int) -> dict[str, Any] | None:
        key = self._key(rank)
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001 - unreadable: as if it had never beaten
            return None

    def diagnose(self, ranks: Sequence[int]) -> tuple[int | None, str]:
        """(the rank to blame, why) among ``ranks``: first one whose heartbeat stopped, else
        one that is behind this worker's step; (None, a summary) if all look alive."""
        now = time.time()
        behind = None
        alive = []
        for r in ranks:
            hb = self.heartbeat(r)
            if hb is None:
                return r, "it has sent no heartbeat at all"
            age = now - hb["t"]
            if age > self.stale_after:
                return r, f"no heartbeat for {age:.1f} s (last at step {hb['step']})"
            if behind is None and hb["step"] < self.step and not hb.get("op"):
                behind = (r, f"it is at step {hb['step']}, behind this worker's {self.step}")
            alive.append(f"{r}@{hb['step']}" + (f" in {hb['op']}" if hb.get("op") else ""))
        if behind is not None:
            return behind
        return None, "all alive (" + ", ".join(alive) + "): a slow link?"

    def explain(self, op: str, ranks: Sequence[int], error: BaseException, waited: float
                ) -> tuple[int | None, str]:
        """(culprit, one line) for a wait that failed with ``error`` after ``waited`` s."""
        ranks = [r for r in ranks if r != self.rank]
        culprit, why = self.diagnose(ranks)
        if culprit is None and waited < self.stale_after:
            # A broken connection is noticed at once, before the dead peer's heartbeat is
            # old enough to tell it from the living: look again once it would be.
            time.sleep(self.stale_after)
            culprit, why = self.diagnose(ranks)
        me = self.describe(self.rank)
        if culprit is not None:
            return culprit, (f"{self.describe(culprit)} stopped answering ({why}); {me} "
                             f"waited {waited:.1f} s in {op} at step {self.step}")
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return None, (f"{op} at step {self.step} failed after {waited:.1f} s on {me}, waiting "
                      f"for ranks {ranks} ({why}): {first}")
