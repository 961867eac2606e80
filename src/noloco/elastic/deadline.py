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

A worker's connections also carry the run's :class:`Namespace`: every key is put under the
run's id and epoch (:mod:`noloco.elastic.keys`), and each new connection first checks the
store's boot token — a coordinator that restarted empty moves every worker to a new epoch.

Floor 2 of docs/architecture.md: communication and the methods.
"""

from __future__ import annotations

import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from noloco.elastic.keys import BOOT_KEY, RUNS_KEY, epoch_key, run_prefix

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


_ONE_KEY = frozenset({"set", "get", "add", "compare_set", "delete_key", "append",
                      "set_leased"})
_KEY_LIST = frozenset({"check", "multi_get", "multi_set", "wait", "read_many"})
_ABSENT = "\x00absent"


def _namespaced(name: str, args: tuple[Any, ...], prefix: str) -> tuple[Any, ...]:
    if name in _ONE_KEY:
        return (prefix + args[0], *args[1:])
    if name in _KEY_LIST:
        return ([prefix + k for k in args[0]], *args[1:])
    return args


class Prefixed:
    """A view of a store whose every key is under ``prefix`` (a run's epoch, for those who
    watch a run from outside it: the monitor, ``noloco status``)."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self.prefix = store, prefix

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        return lambda *args: attr(*_namespaced(name, args, self.prefix))


class Renewing:
    """A store client that makes a new connection (:func:`connect`) for the request after
    one failed: for a long-lived reader (the launcher) that must outlive a store's restart.
    Failed requests still raise."""

    def __init__(self, conn: Any, timeout: float) -> None:
        self._base, self._conn, self.timeout = conn, conn, timeout

    def __getattr__(self, name: str) -> Any:
        if not hasattr(self._base, name):  # an operation this kind of store lacks
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            if self._conn is None:
                self._conn = connect(self._base, self.timeout)
            try:
                return getattr(self._conn, name)(*args)
            except store_errors():
                self._conn = None
                raise
        return call


class Namespace:
    """Where this process's keys live in the store: under the run's id and its current epoch
    (:func:`noloco.elastic.keys.run_prefix`). One object shared by every connection of the
    process. The first connection made after the store was wiped — its boot token changed: a
    coordinator restarted empty — moves the process to the run's next epoch (the first
    proposal written stands: compare-and-set), and :attr:`generation` counts such moves so
    that whoever keeps local state tied to the store's (registration, join counters, keys to
    delete) can redo it. Within an epoch, keys are as write-once as the store makes them."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.epoch = 0
        self.boot: bytes | None = None
        self.generation = 0
        """epochs moved to after the first (each a store that was wiped under this process)"""
        self.moves: list[dict[str, Any]] = []
        """each move: the new epoch and when (this process's wall clock, for the summary)"""
        self._lock = threading.Lock()

    @property
    def prefix(self) -> str:
        return run_prefix(self.run_id, self.epoch)

    def enter(self, conn: DeadlineStore) -> None:
        """Check a new connection's store (``conn``: its keys not namespaced) before the
        connection serves this process. Raises ``DistStoreError`` while the store has no boot
        token yet (its host is starting: try again)."""
        import torch.distributed as dist

        boot = conn.compare_set(BOOT_KEY, _ABSENT, _ABSENT)
        if boot == _ABSENT.encode():
            raise dist.DistStoreError("the run's store is starting (no boot token yet)")
        with self._lock:
            if boot == self.boot:
                return
            moved = self.boot is not None
            # "EPOCH:TOKEN": the token tells the one process whose proposal stood (two may
            # propose the same epoch), and only that one registers the epoch.
            mine = f"{self.epoch + 1 if moved else 0}:{secrets.token_hex(6)}"
            got = conn.compare_set(epoch_key(self.run_id), "", mine).decode()
            epoch = int(got.partition(":")[0])
            if got == mine:  # this process opened the epoch: the store's host learns of it
                conn.append(RUNS_KEY, f"{self.run_id}/{epoch},")
            self.boot, self.epoch = boot, epoch
            if moved:
                self.generation += 1
                self.moves.append({"epoch": got, "t": time.time()})


    def open_next(self, conn: DeadlineStore) -> None:
        """Move the run to the epoch after the one this process is in (``conn``: a connection
        entered into this namespace), unless another process moved it first: then to that
        one. Every process that enters afterwards finds the new epoch (:meth:`enter`)."""
        def outside(name: str, *args: Any) -> Any:  # a key outside every run's namespace
            return conn._call(getattr(conn.tcp, name), *args)

        key = epoch_key(self.run_id)
        with self._lock:
            now = outside("get", key).decode()  # written when this process entered
            if int(now.partition(":")[0]) == self.epoch:
                mine = f"{self.epoch + 1}:{secrets.token_hex(6)}"
                now = outside("compare_set", key, now, mine).decode()
                if now == mine:
                    outside("append", RUNS_KEY, f"{self.run_id}/{self.epoch + 1},")
            self.epoch = int(now.partition(":")[0])


    def continue_stopped(self, conn: DeadlineStore, stopped: dict[str, Any] | None,
                         trains_on: Callable[[], bool], unknown_opens: bool = True) -> str:
        """Where a stopped run continues (``noloco train --resume`` at a coordinator,
        ``join_run(resume=True)``). ``stopped``: where the run stood in the store when this
        process's part of it stopped (``{"boot", "epoch"}``, or None where unknown);
        ``trains_on()``: other replicas train now (read only when it matters). Where they
        do, this process's replicas join them (new starts in the run's epoch, as after a
        crash). Where nobody trains, the run continues in a new epoch, whose keys no
        operation of the stopped run wrote: each replica continues from its own checkpoint
        and meets no record of the stopped run. The first process to continue opens it; one
        continuing later finds the run above the epoch it stopped in, and follows. A store
        that restarted empty since the stop (another boot token) holds nothing of the
        stopped run: nothing to move. What was decided: "new store", "followed", "trains
        on", "unknown" or "opened"."""
        if stopped is not None and self.boot is not None and stopped["boot"] != self.boot.decode():
            return "new store"
        if stopped is not None and stopped["epoch"] is not None and self.epoch > stopped["epoch"]:
            return "followed"  # another process continued the run first
        if trains_on():
            return "trains on"
        if stopped is None and not unknown_opens:
            return "unknown"
        self.open_next(conn)
        return "opened"


def stopped_record(got: Any) -> dict[str, Any] | None:
    """A record of where a run stood in its store (``{"boot": str, "epoch": int | None}``),
    checked: None for anything else (a missing, older or damaged record)."""
    if not (isinstance(got, dict) and isinstance(got.get("boot"), str)
            and isinstance(got.get("epoch"), int | None)):
        return None
    return got


def run_epoch(address: str, run_id: str, timeout: float) -> dict[str, Any] | None:
    """Where the run ``run_id`` stands in the store at ``address`` now, read on a connection of
    its own: the store's boot token (a store that restarted empty has another) and the run's
    epoch in it; None where the store cannot be reached."""
    try:
        conn = open_address(address, timeout)
        key = epoch_key(run_id)
        boot = conn.get(BOOT_KEY).decode() if conn.check([BOOT_KEY]) else None
        epoch = int(conn.get(key).decode().partition(":")[0]) if conn.check([key]) else None
    except store_errors():
        return None
    return {"boot": boot, "epoch": epoch}


class DeadlineStore:
    """A store connection whose every request is answered within ``timeout`` seconds (a
    ``wait`` within its own timeout plus that) or raises ``DistStoreError`` (module
    docstring); with a :class:`Namespace`, every key is the namespace's. ``raw`` is the c10d
    store (namespaced too), for process groups built on it."""

    def __init__(self, tcp: Any, timeout: float, thread: _Thread | None = None,
                 ns: Namespace | None = None) -> None:
        self.tcp, self.timeout, self.ns = tcp, timeout, ns
        self._thread = thread or _Thread()
        self._given_up = False

    @property
    def raw(self) -> Any:
        if self.ns is None:
            return self.tcp
        import torch.distributed as dist

        return dist.PrefixStore(self.ns.prefix.rstrip("/"), self.tcp)

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
        if self.ns is not None:
            keys = [self.ns.prefix + k for k in keys]
        if timeout is None:
            return self._call(self.tcp.wait, keys, extra=self.tcp.timeout.total_seconds())
        return self._call(self.tcp.wait, keys, timeout, extra=timeout.total_seconds())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.tcp, name)
        if not callable(attr):
            return attr
        if self.ns is None:
            return lambda *args: self._call(attr, *args)
        return lambda *args: self._call(attr, *_namespaced(name, args, self.ns.prefix))


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
    """A new :class:`DeadlineStore` to the same store as ``store`` (a TCPStore, or an etcd
    cluster), in its namespace (the store itself when it is of another kind: a test's).
    Connecting is bounded by the deadline too; raises ``DistStoreError`` when the store
    cannot be reached in it."""
    import torch.distributed as dist

    base = store.tcp if isinstance(store, DeadlineStore) else store
    ns = store.ns if isinstance(store, DeadlineStore) else None
    if hasattr(base, "fresh"):  # an etcd client: another one
        return _entered(base.fresh(), timeout, ns)
    if not isinstance(base, dist.TCPStore):
        return store
    return open_store(base.host, base.port, timeout, ns)


def _entered(store: Any, timeout: float, ns: Namespace | None,
             thread: _Thread | None = None) -> DeadlineStore:
    conn = DeadlineStore(store, timeout, thread)
    if hasattr(store, "fresh"):
        # Nobody hosts an etcd cluster for the run: the first client writes its boot token
        # (it never changes: etcd does not restart empty).
        conn.compare_set(BOOT_KEY, "", secrets.token_hex(8))
    if ns is not None:
        ns.enter(conn)
        conn.ns = ns
    return conn


def open_address(address: str, timeout: float, ns: Namespace | None = None,
                 lease_ttl: float = 10.0) -> DeadlineStore:
    """:func:`open_store` for ``HOST:PORT``, or a client of the etcd cluster at
    ``etcd://H1:P1,...`` (:mod:`noloco.elastic.etcd`; heartbeats live ``lease_ttl`` s)."""
    from noloco.addresses import ETCD_SCHEME as SCHEME
    from noloco.addresses import parse_endpoints
    from noloco.elastic.etcd import EtcdStore

    if address.startswith(SCHEME):
        return _entered(EtcdStore(parse_endpoints(address), timeout, lease_ttl), timeout, ns)
    host, _, port = address.rpartition(":")
    return open_store(host, int(port), timeout, ns)


def open_store(host: str, port: int, timeout: float, ns: Namespace | None = None,
               direct: bool = False) -> DeadlineStore:
    """A :class:`DeadlineStore` to the TCPStore at ``host:port``, entered into ``ns``
    (:meth:`Namespace.enter`) when given. Raises ``DistStoreError``/``DistNetworkError`` in
    ``timeout`` (about) when it cannot be reached, or while it is starting. With a run secret
    (:func:`noloco.elastic.auth.use_secret`) the connection goes through this process's door
    to the coordinator's gate, unless ``direct`` (the coordinator's own clients)."""
    import torch.distributed as dist

    from noloco.elastic import auth

    remote = auth.remote_of(host, port)  # a door's own address: the coordinator behind it
    # A plain connection first: while the store is out of reach, c10d's own failing connect
    # would print its error and a C++ stack trace at every try.
    try:
        socket.create_connection(remote, timeout).close()
    except OSError as e:
        raise dist.DistNetworkError(f"cannot reach the run's store at {remote[0]}:"
                                    f"{remote[1]} ({e})") from None
    if not direct:
        try:
            host, port = auth.door_to(*remote, timeout)
        except OSError as e:
            # It answered a connection just now: if it still sends no challenge, it is no
            # gate (an --insecure coordinator, or another service) — not worth retrying.
            if not auth.asks_for_secret(*remote, timeout=3.0):
                raise auth.AuthError(f"the coordinator at {remote[0]}:{remote[1]} did not "
                                     f"ask for the run secret (started with --insecure, or "
                                     f"not a noloco coordinator)") from None
            raise dist.DistNetworkError(f"cannot reach the run's store at {remote[0]}:"
                                        f"{remote[1]} ({e})") from None
    try:
        thread = _Thread()
        answered, result = thread.run(
            dist.TCPStore, (host, port, None, False, timedelta(seconds=timeout)),
            timeout + 1.0)
        if not answered or not result[0]:
            thread.stop()
        if not answered:
            raise dist.DistStoreError(f"cannot reach the run's store at {host}:{port} "
                                      f"within {timeout:g} s")
        ok, value = result
        if not ok:
            raise value
        return _entered(value, timeout, ns, thread)
    except store_errors():
        # A coordinator that asks for a secret this process does not have closes the
        # connection after a request or two: say so in one line, once, not "unreachable".
        if not direct and auth.current_secret() is None and auth.asks_for_secret(*remote):
            raise auth.AuthError(f"the coordinator at {remote[0]}:{remote[1]} asks for the "
                                 f"run secret: give it with --secret-file FILE or "
                                 f"{auth.ENV}") from None
        raise


def open_store_patiently(address: str, timeout: float, ns: Namespace | None,
                         patience: float, lease_ttl: float = 10.0) -> DeadlineStore:
    """:func:`open_address`, tried again for ``patience`` seconds: for a worker or launcher
    that may start before its coordinator does, or while it restarts."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return open_address(address, timeout, ns, lease_ttl)
        except store_errors():
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.3)
