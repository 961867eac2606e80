"""The run's store in an etcd cluster: ``--coordinator etcd://H1:P1,H2:P2,H3:P3``.

etcd (3.4 and later) keeps the run's coordination replicated: with three members, one can be
lost and the run goes on without noticing. We speak its v3 API through its JSON gateway
(HTTP POSTs on ``/v3/...``), so no client library is needed. :class:`EtcdStore` is a c10d
``Store`` (a Python subclass torch accepts) with the operations the elastic code uses, each
built on etcd's own primitives:

- ``compare_set`` is one transaction (compare the value, or that the key was never created);
- ``add`` and ``append`` are a read and a transaction on the key's modification revision,
  repeated while another writer got in between (optimistic concurrency);
- ``check`` and ``multi_get`` read many keys in one transaction;
- ``wait`` polls (etcd's watch is a stream, which the gateway does not serve per request);
- a heartbeat is written with a lease (:meth:`EtcdStore.set_leased`): etcd deletes it when
  the writer stops renewing the lease, so liveness is judged by the cluster's own clock and
  no monitor is needed: a replica is alive while its heartbeat key exists.

gloo's rendezvous runs on it like on any c10d store. A request goes to one member and, when
that member does not answer, to the next: the cluster's loss of a member costs a request's
connect timeout once.

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from noloco.addresses import ETCD_SCHEME as SCHEME
from noloco.addresses import parse_endpoints as parse_endpoints  # re-exported
from noloco.errors import ConfigError


def _b64(x: str | bytes) -> str:
    return base64.b64encode(x.encode() if isinstance(x, str) else bytes(x)).decode()


def _unb64(x: str | None) -> bytes:
    return base64.b64decode(x) if x else b""


USER_ENV, PASSWORD_ENV = "NOLOCO_ETCD_USER", "NOLOCO_ETCD_PASSWORD"


def credentials_from_env() -> tuple[str, str] | None:
    """(user, password) of etcd's own authentication: ``NOLOCO_ETCD_USER`` and
    ``NOLOCO_ETCD_PASSWORD``, or None."""
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if user is None and password is None:
        return None
    if not user or password is None:
        raise EtcdAuthError(f"etcd authentication needs both {USER_ENV} and {PASSWORD_ENV}")
    return user, password


class EtcdAuthError(ConfigError):
    """The etcd cluster refused this process's user, or asks for one it does not have."""


class _Unauthenticated(Exception):
    """etcd answered that the request's user or token is missing, wrong or expired."""


def _auth_failure(status: int, raw: bytes) -> bool:
    """An answer of etcd's gateway that says the request was not authenticated (gRPC codes
    16 Unauthenticated and 7 PermissionDenied; the user/token messages)."""
    if status not in (400, 401, 403, 500):
        return False
    try:
        err = json.loads(raw)
    except ValueError:
        return False
    text = str(err.get("error") or err.get("message") or "")
    return err.get("code") in (7, 16) or any(
        m in text for m in ("user name is empty", "invalid auth token", "authentication failed",
                            "permission denied", "user name not found"))


class EtcdStore(dist.Store):
    """A c10d store on an etcd cluster (module docstring). ``timeout``: how long a ``get`` or
    ``wait`` waits for its keys (a third of it, at most 2 s: how long one member may take to
    answer before the next is asked)."""

    def __init__(self, endpoints: list[tuple[str, int]], timeout: float = 60.0,
                 lease_ttl: float = 10.0,
                 credentials: tuple[str, str] | None | bool = True) -> None:
        super().__init__()
        self.endpoints = list(endpoints)
        self.credentials = credentials_from_env() if credentials is True else credentials
        """etcd's own authentication (user, password), or None: the cluster's users, roles
        and tokens decide who reads and writes (docs/security.md)"""
        self._token: str | None = None
        self.set_timeout(timedelta(seconds=timeout))
        self.lease_ttl = max(2, math.ceil(lease_ttl))
        self._first = 0
        """the member that answered last: asked first"""
        self._local = threading.local()  # one HTTP connection per thread and member
        self._lease: str | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def fresh(self) -> EtcdStore:
        """Another client of the same cluster (a new connection)."""
        return EtcdStore(self.endpoints, self.timeout.total_seconds(), self.lease_ttl,
                         self.credentials or None)

    # ---- HTTP ------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any], once: bool = False) -> dict[str, Any]:
        """POST to the first member that answers. ``once``: the request must not be applied
        twice (a read-modify-write): a member that took it and then fell silent leaves its
        outcome unknown, which raises instead of asking the next member. With credentials,
        under a token (fetched again when etcd says it expired: nothing was applied)."""
        if self.credentials and self._token is None:
            self._authenticate()
        try:
            return self._post_once(path, body, once)
        except _Unauthenticated:
            if not self.credentials:
                raise EtcdAuthError(f"the etcd cluster at {self.address} asks for a user: "
                                    f"set {USER_ENV} and {PASSWORD_ENV}") from None
            self._authenticate()  # the token expired (etcd's --auth-token-ttl)
            try:
                return self._post_once(path, body, once)
            except _Unauthenticated as e:
                raise EtcdAuthError(f"the etcd cluster at {self.address} does not let user "
                                    f"{self.credentials[0]!r} do this ({e})") from None

    def _authenticate(self) -> None:
        assert self.credentials
        user, password = self.credentials
        try:
            got = self._post_once("/v3/auth/authenticate", {"name": user, "password": password})
        except _Unauthenticated:
            got = {}
        except dist.DistNetworkError as e:
            if "authentication is not enabled" not in str(e):
                raise
            self.credentials = None  # the cluster admits everyone: no token to send
            return
        if not got.get("token"):
            raise EtcdAuthError(f"the etcd cluster at {self.address} refused user {user!r} "
                                f"(wrong {PASSWORD_ENV}?)")
        self._token = got["token"]

    def _post_once(self, path: str, body: dict[str, Any], once: bool = False
                   ) -> dict[str, Any]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._token is not None and path != "/v3/auth/authenticate":
            headers["Authorization"] = self._token
        conns = self._local.__dict__.setdefault("conns", {})
        last: Exception | None = None
        n = len(self.endpoints)
        # A member that does not answer is left for the next well within the request's
        # deadline (a third of it, at most 2 s): a killed member refuses at once, but one
        # cut off by the network, or a request caught in its leader's loss, is silent.
        per_member = max(0.5, min(2.0, self.timeout.total_seconds() / 3))
        for k in range(n):
            i = (self._first + k) % n
            host, port = self.endpoints[i]
            for attempt in range(2):  # a kept-alive connection the member closed: once more
                conn = conns.get(i)
                if conn is None:
                    conn = conns[i] = http.client.HTTPConnection(host, port, timeout=per_member)
                sent = False
                try:
                    conn.request("POST", path, data, headers)
                    sent = True
                    resp = conn.getresponse()
                    raw = resp.read()
                except (OSError, http.client.HTTPException) as e:
                    conn.close()
                    conns.pop(i, None)
                    last = e
                    closed = isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError,
                                            ConnectionResetError, ConnectionRefusedError))
                    if once and sent and not closed:  # taken, maybe applied: unknown
                        raise dist.DistStoreError(f"etcd member {host}:{port} fell silent "
                                                  f"during a write ({e})") from None
                    if attempt == 0 and closed:
                        continue
                    break
                if resp.status != 200:
                    if _auth_failure(resp.status, raw):
                        raise _Unauthenticated(raw[:200].decode(errors="replace"))
                    last = RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
                    break  # a member without quorum answers 503: ask the next
                self._first = i
                return json.loads(raw)
        raise dist.DistNetworkError(f"no etcd member answers at {self.address} ({last})")

    def _range(self, key: str) -> dict[str, Any] | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]]) -> dict[str, Any]:
        return self._post("/v3/kv/txn", {"compare": compare, "success": success,
                                         "failure": failure})

    def _update(self, key: str, change: Any) -> bytes:
        """Replace the key's value by ``change(old value or None)`` atomically (a retry when
        another writer got in between)."""
        while True:
            kv = self._range(key)
            new = change(_unb64(kv.get("value")) if kv else None)
            cmp = ({"key": _b64(key), "target": "MOD", "result": "EQUAL",
                    "mod_revision": kv["mod_revision"]} if kv else
                   {"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                    "create_revision": "0"})
            got = self._post("/v3/kv/txn", {
                "compare": [cmp], "success": [{"request_put": {"key": _b64(key),
                                                               "value": _b64(new)}}],
                "failure": []}, once=True)
            if got.get("succeeded"):
                return new

    # ---- the c10d store --------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})

    def set_leased(self, key: str, value: str | bytes) -> None:
        """Write ``key`` under this client's lease, and renew the lease: the key disappears
        ``lease_ttl`` seconds after the last call (a heartbeat)."""
        with self._lock:
            if self._lease is not None:
                got = self._post("/v3/lease/keepalive", {"ID": self._lease})
                if not got.get("result", {}).get("TTL"):
                    self._lease = None  # expired (a long cut): a new one
            if self._lease is None:
                self._lease = self._post("/v3/lease/grant", {"TTL": self.lease_ttl})["ID"]
            lease = self._lease
        self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": lease})

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self._range(key)
        if kv is None:  # deleted in between
            raise dist.DistStoreError(f"key {key!r} is gone")
        return _unb64(kv.get("value"))

    def add(self, key: str, amount: int) -> int:
        if amount == 0:
            kv = self._range(key)
            if kv is not None:
                return int(_unb64(kv.get("value")) or b"0")
        return int(self._update(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: str | bytes) -> None:
        extra = value.encode() if isinstance(value, str) else bytes(value)
        self._update(key, lambda old: (old or b"") + extra)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As torch's TCPStore: ``desired`` when the key held ``expected`` (or was absent and
        ``expected`` is empty); else the key's value, or ``expected`` when it is absent."""
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        want = desired.encode() if isinstance(desired, str) else bytes(desired)
        cmp = ({"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                "create_revision": "0"} if not exp else
               {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(exp)})
        while True:
            got = self._txn([cmp], [{"request_put": {"key": _b64(key), "value": _b64(want)}}],
                            [{"request_range": {"key": _b64(key)}}])
            if got.get("succeeded"):
                return want
            kvs = got["responses"][0].get("response_range", {}).get("kvs")
            if not kvs:
                return exp
            value = _unb64(kvs[0].get("value"))
            if exp or value:
                return value
            # The key holds the empty value: TCPStore matches that as it matches absence (a
            # writer that cleared a key to "" compares-and-sets from "" again). Put only if
            # it still holds that very version; else look again.
            cmp = {"key": _b64(key), "target": "MOD", "result": "EQUAL",
                   "mod_revision": kvs[0]["mod_revision"]}

    def _many(self, keys: list[str]) -> list[dict[str, Any] | None]:
        got = self._txn([], [{"request_range": {"key": _b64(k)}} for k in keys], [])
        out = []
        for r in got.get("responses", []):
            kvs = r.get("response_range", {}).get("kvs")
            out.append(kvs[0] if kvs else None)
        return out

    def check(self, keys: list[str]) -> bool:
        return all(kv is not None for kv in self._many(list(keys)))

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, None where there is none, in one transaction. What
        :func:`noloco.elastic.membership.read` asks of etcd: a lease may expire a heartbeat
        at any moment, so a check followed by a get could wait the whole request deadline for
        a key that vanished in between."""
        return [None if kv is None else _unb64(kv.get("value")) for kv in self._many(list(keys))]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(list(keys))
        kvs = self._many(list(keys))
        if any(kv is None for kv in kvs):
            raise dist.DistStoreError("a key is gone")
        return [_unb64(kv.get("value")) for kv in kvs if kv is not None]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._txn([], [{"request_put": {"key": _b64(k), "value": _b64(v)}}
                       for k, v in zip(keys, values, strict=True)], [])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = 0.005
        while not self.check(list(keys)):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"wait timeout after {limit:g} s for {keys}")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(0.1, pause * 2)

    def delete_key(self, key: str) -> bool:
        got = self._post("/v3/kv/deleterange", {"key": _b64(key)})
        return int(got.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        got = self._post("/v3/kv/range", {"key": _b64(b"\0"), "range_end": _b64(b"\0"),
                                          "count_only": True})
        return int(got.get("count", 0))
