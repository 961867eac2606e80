"""A connection to the run's store whose every request has a deadline.

torch's ``TCPStore`` bounds the time a request waits *for a key* (``wait``, ``get``), not the
time its bytes take: a request sent into a partition — the link down, no reset, only
silence — blocks until the link comes back and TCP's retransmission timer fires again, which
after a long cut is up to a minute later (measured here in network namespaces: an ``add``
blocked for the whole 8 s cut whatever the store's timeout). A worker must notice a cut in
``--peer-timeout`` and train on without the store meanwhile, so its connections are
:class:`DeadlineStore`: each request runs on the connection's own thread and the caller waits
at most the deadline. A request that misses it leaves that thread stuck with the connection,
which is given up (every later request fails at once); the owner makes a new one
(:func:`connect`) once the store answers again — a fresh connection works at once.

Invariant: one connection, one thread, requests in order: a request is never sent on a
connection while an earlier one may still be waiting for its answer.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from datetime import timedelta
from typing import Any

_abandoned: list[Any] = []
"""connections given up with a request stuck in them: referenced until the process exits, so
that no destructor runs while their thread still uses them"""


def request_deadline(peer_timeout: float) -> float:
    """Seconds a store request of a worker may take: past ``--peer-timeout`` the monitor has
    judged the worker dead anyway (at least a second: loopback under load)."""
    return max(peer_timeout, 1.0)


def store_errors() -> tuple[type[BaseException], ...]:
    """What a store request raises when the store cannot be reached in time (a timeout, a
    reset or refused connection, a connection given up)."""
    import torch.distributed as dist

    return (dist.DistStoreError, dist.DistNetworkError)


class _Thread:
    """One daemon thread running a connection's requests in order."""

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="noloco-store", daemon=True).start()

    def _loop(self) -> None:
        while True:
            item = self.requests.get()
            if item is None:  # its connection is gone
                return
            fn, args, box, done = item
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()

    def stop(self) -> None:
        self.requests.put(None)

    def run(self, fn: Any, args: tuple[Any, ...], seconds: float) -> tuple[bool, Any]:
        """(answered in time, (ok, value or exception))."""
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self.requests.put((fn, args, box, done))
        if not done.wait(seconds):
            return False, None
        return True, box[0]


class DeadlineStore:
    """A store connection whose every request is answered within ``timeout`` seconds (a
    ``wait`` within its own timeout plus that) or raises ``DistStoreError`` (module
    docstring). ``raw`` is the c10d store, for process groups built on it."""

    def __init__(self, raw: Any, timeout: float, thread: _Thread | None = None) -> None:
        self.raw, self.timeout = raw, timeout
        self._thread = thread or _Thread()
        self._given_up = False

    def __del__(self) -> None:
        self._thread.stop()

    def _call(self, fn: Any, *args: Any, extra: float = 0.0) -> Any:
        import torch.distributed as dist

        if self._given_up:
            raise dist.DistNetworkError("this connection to the run's store was given up")
        answered, result = self._thread.run(fn, args, self.timeout + extra)
        if not answered:
            self._given_up = True
            _abandoned.append(self)
            raise dist.DistStoreError(f"the run's store did not answer within "
                                      f"{self.timeout:g} s")
        ok, value = result
        if not ok:
            raise value
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            return self._call(self.raw.wait, keys, extra=self.raw.timeout.total_seconds())
        return self._call(self.raw.wait, keys, timeout, extra=timeout.total_seconds())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.raw, name)
        if not callable(attr):
            return attr
        return lambda *args: self._call(attr, *args)


def raw(store: Any) -> Any:
    """The c10d store under a :class:`DeadlineStore` (process groups need one)."""
    return store.raw if isinstance(store, DeadlineStore) else store


def wait_reachable(host: str, port: int, timeout: float) -> None:
    """Wait until a plain TCP connection to ``host:port`` succeeds (retrying), at most
    ``timeout`` seconds; then raise ``DistNetworkError``. c10d's own connect retries print its
    error and a C++ stack trace when they give up: this says it in one line instead."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), max(0.1, min(5.0, timeout))).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise dist.DistNetworkError(f"nothing answers at {host}:{port} after "
                                            f"{timeout:g} s ({e})") from None
            time.sleep(0.5)


def connect(store: Any, timeout: float) -> Any:
    """A new :class:`DeadlineStore` to the same TCPStore as ``store`` (the store itself when
    it is of another kind: a test's). Connecting is bounded by the deadline too; raises
    ``DistStoreError`` when the store cannot be reached in it."""
    import torch.distributed as dist

    base = raw(store)
    if not isinstance(base, dist.TCPStore):
        return store
    # A plain connection first: while the store is out of reach, c10d's own failing connect
    # would print its error and a C++ stack trace at every try.
    try:
        socket.create_connection((base.host, base.port), timeout).close()
    except OSError as e:
        raise dist.DistNetworkError(f"cannot reach the run's store at {base.host}:{base.port} "
                                    f"({e})") from None
    thread = _Thread()
    answered, result = thread.run(
        dist.TCPStore, (base.host, base.port, None, False, timedelta(seconds=timeout)),
        timeout + 1.0)
    if not answered or not result[0]:
        thread.stop()
    if not answered:
        raise dist.DistStoreError(f"cannot reach the run's store at {base.host}:{base.port} "
                                  f"within {timeout:g} s")
    ok, value = result
    if not ok:
        raise value
    return DeadlineStore(value, timeout, thread)
