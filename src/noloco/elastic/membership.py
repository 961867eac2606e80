"""Heartbeats of a replica's workers, and which replicas are alive (see the package
docstring: *Membership*)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from noloco.elastic.keys import done_key, heartbeat_key, join_key


class Membership:
    """Heartbeats of this worker (one stage of one replica) and which replicas are alive: a
    replica with pipeline stages is alive while every one of its stages is (they fail
    together: a stage cannot train without the others)."""

    def __init__(self, store: Any, replica: int, replicas: int, peer_timeout: float,
                 incarnation: int = 0, stage: int = 0, stages: int = 1) -> None:
        self.store, self.replica, self.replicas = store, replica, replicas
        self.stage, self.stages = stage, stages
        self.peer_timeout, self.incarnation = peer_timeout, incarnation
        self.interval = min(1.0, peer_timeout / 5)
        self.step = 0
        self.join_requests = 0
        """join requests made to this replica so far, as of the last heartbeat"""
        self.ready = False
        """training (a joining replica is not, until it has its state)"""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Membership:
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="noloco-membership",
                                        daemon=True)
        self._thread.start()
        return self

    def beat(self) -> None:
        self.store.set(heartbeat_key(self.replica, self.stage), json.dumps(
            {"t": time.time(), "step": self.step, "incarnation": self.incarnation,
             "ready": self.ready}))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                # Read here, off the training loop: a store round trip per inner step would
                # cost a network latency per step across machines.
                self.join_requests = int(self.store.add(join_key(self.replica), 0))
            except Exception:  # noqa: BLE001 - the store may be gone with the run
                return

    def finish(self) -> None:
        """Announce that this replica finished: nobody waits for it any more."""
        self._stop.set()
        try:
            self.store.set(done_key(self.replica, self.stage), "1")
        except Exception:  # noqa: BLE001
            pass

    def stop(self) -> None:
        self._stop.set()

    def alive(self) -> list[int]:
        """The replicas alive now (this one always)."""
        others = live_replicas(self.store, self.replicas, self.stages, self.peer_timeout)
        return sorted({*others, self.replica})

    def donors(self) -> list[int]:
        """Live replicas that train (not themselves joining), the furthest along first: the
        ones a joining or healing replica may take its state from."""
        live = live_replicas(self.store, self.replicas, self.stages, self.peer_timeout)
        ready = [(b["step"], r) for r, b in live.items() if r != self.replica and b["ready"]]
        return [r for _, r in sorted(ready, key=lambda x: (-x[0], x[1]))]


def live_replicas(store: Any, replicas: int, stages: int, peer_timeout: float
                  ) -> dict[int, dict[str, Any]]:
    """Replica → its stage 0's newest heartbeat, for every replica whose stages all beat
    within ``peer_timeout`` and none of which has finished."""
    now, out = time.time(), {}
    for r in range(replicas):
        keys = [heartbeat_key(r, s) for s in range(stages)]
        if not store.check(keys) or any(store.check([done_key(r, s)]) for s in range(stages)):
            continue
        beats = [json.loads(store.get(k)) for k in keys]
        if all(now - b["t"] <= peer_timeout for b in beats):
            out[r] = {"ready": False, **beats[0]}
    return out
