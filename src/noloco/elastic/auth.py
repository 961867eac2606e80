"""Only the run's members reach its store: a run secret, proven by challenge and response.

torch's ``TCPStore`` serves any TCP client. ``noloco coordinator`` therefore keeps its store on
127.0.0.1 and listens in front of it with :class:`Gate`, which forwards a connection to the
store only once the client has proven that it knows the run secret. Every process that talks
to the coordinator reaches it through its own :class:`Door` — a forwarder on 127.0.0.1 that
does the handshake for each connection its store clients (and gloo's rendezvous through them)
open — so torch's store and its clients stay unchanged.

The handshake (the secret is never sent; both sides prove they know it)::

    gate → door   MAGIC ‖ gate nonce (16 bytes)
    door → gate   door nonce (16) ‖ HMAC-SHA256(secret, "door" ‖ gate nonce ‖ door nonce)
    gate → door   HMAC-SHA256(secret, "gate" ‖ door nonce ‖ gate nonce)

then the bytes flow unchanged both ways. The gate closes a connection whose proof is wrong,
that sends anything else (a plain store client, a port scanner), or that does not finish in
:data:`HANDSHAKE_SECONDS`; nothing reaches the store before a proof passed. A door that hears
no challenge, or a wrong proof back, refuses the coordinator (a stranger posing as it, or one
started with ``--insecure``). Fresh nonces on both sides: a recorded handshake replays
nowhere. This authenticates connections; it does not encrypt them (``docs/security.md``).

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from noloco.errors import ConfigError

MAGIC = b"NOLOCO-AUTH-1\n"
READY, NOT_READY = b"\x00", b"\x01"
"""the gate's first byte after a valid proof: its own proof follows, or its store is down"""
NONCE = 16
MAC = 32
HANDSHAKE_SECONDS = 10.0
"""how long the gate waits for a client's proof before closing the connection"""
ENV = "NOLOCO_SECRET"
MIN_SECRET = 16
"""characters a run secret has at least"""


class AuthError(ConfigError):
    """The coordinator and this process do not share the run secret (one line, exit 2)."""


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


# ---- the secret -----------------------------------------------------------------------------

def load_secret(path: str | None) -> bytes | None:
    """The run secret: ``NOLOCO_SECRET``, else the file ``path`` (stripped), else None."""
    value = os.environ.get(ENV)
    if value is None and path is not None:
        try:
            value = Path(path).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the secret file {path} ({e.strerror})") from None
        if Path(path).stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            print(f"noloco: warning: the secret file {path} is readable by others "
                  f"(chmod 600 {path})", file=sys.stderr, flush=True)
    if value is None:
        return None
    if len(value.strip()) < MIN_SECRET:
        raise ConfigError(f"the run secret is shorter than {MIN_SECRET} characters")
    return value.strip().encode()


def default_secret_file() -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "noloco" / "coordinator.secret"


def create_secret(path: Path) -> bytes:
    """A new random secret in ``path``, readable by its owner only — or the one already
    there (a coordinator started again keeps its secret)."""
    if path.is_file():
        got = load_secret_file(path)
        if got is not None:
            return got
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)
    return value.encode()


def load_secret_file(path: Path) -> bytes | None:
    value = path.read_text().strip()
    return value.encode() if len(value) >= MIN_SECRET else None


# ---- the event loop that serves gates and doors ------------------------------------------

class _Loop:
    """One asyncio loop in a daemon thread, shared by every gate and door of a process:
    thousands of connections cost no thread each."""

    _lock = threading.Lock()
    _instance: _Loop | None = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="noloco-auth", daemon=True).start()

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Loop()
            return cls._instance.loop

    @classmethod
    def run(cls, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, cls.get()).result(timeout)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                  b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    """Both directions until either side closes; then both close."""
    await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()


# ---- the coordinator's side -----------------------------------------------------------------

class Gate:
    """Listens on ``host:port`` (port 0: a free one, then :attr:`port`) and forwards each
    connection that proves ``secret`` to the store at 127.0.0.1:``store_port``."""

    def __init__(self, host: str, port: int, store_port: int, secret: bytes) -> None:
        self.secret, self.store_port = secret, store_port
        self.refused = 0
        """connections closed without a valid proof"""
        self.admitted = 0
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))  # OSError here: cannot listen (said by the caller)
        sock.listen(1024)
        self.port = sock.getsockname()[1]

        async def start() -> asyncio.AbstractServer:
            return await asyncio.start_server(self._serve, sock=sock)

        self.server = _Loop.run(start(), 10.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mine = os.urandom(NONCE)
        try:
            writer.write(MAGIC + mine)
            await writer.drain()
            got = await asyncio.wait_for(reader.readexactly(NONCE + MAC), HANDSHAKE_SECONDS)
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            self.refused += 1
            _close(writer)
            return
        theirs, proof = got[:NONCE], got[NONCE:]
        if not hmac.compare_digest(proof, _mac(self.secret, b"door", mine, theirs)):
            self.refused += 1
            _close(writer)
            return
        try:
            store = await asyncio.open_connection("127.0.0.1", self.store_port)
        except OSError:  # the store is not up (yet): a retryable answer, not a refusal
            with contextlib.suppress(OSError):
                writer.write(NOT_READY)
                await writer.drain()
            _close(writer)
            return
        try:
            writer.write(READY + _mac(self.secret, b"gate", theirs, mine))
            await writer.drain()
        except OSError:
            _close(writer)
            _close(store[1])
            return
        self.admitted += 1
        await _splice((reader, writer), store)

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()

        with contextlib.suppress(Exception):
            _Loop.run(close(), 5.0)


# ---- a client's side -----------------------------------------------------------------------

async def _prove(host: str, port: int, secret: bytes, timeout: float
                 ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the gate at ``host:port`` past its handshake; raises :class:`AuthError`
    when the other end does not prove the secret, ``OSError`` when it cannot be reached."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        try:
            hello = await asyncio.wait_for(reader.readexactly(len(MAGIC) + NONCE),
                                           min(timeout, 3.0))
        except TimeoutError:
            # A busy coordinator may be slow to greet: retryable, like an unreachable one;
            # one that never greets is said after the store client fails (open_store).
            raise OSError(f"the coordinator at {host}:{port} did not ask for the run secret "
                          f"in time") from None
        except asyncio.IncompleteReadError:
            raise OSError(f"the coordinator at {host}:{port} closed the connection") from None
        if not hello.startswith(MAGIC):
            raise AuthError(f"the coordinator at {host}:{port} did not ask for the run secret "
                            f"(not a noloco coordinator?)")
        theirs, mine = hello[len(MAGIC):], os.urandom(NONCE)
        writer.write(mine + _mac(secret, b"door", theirs, mine))
        await writer.drain()
        try:
            status = await asyncio.wait_for(reader.readexactly(1), timeout)
            if status == NOT_READY:
                raise OSError(f"the coordinator at {host}:{port} has no store up yet")
            proof = await asyncio.wait_for(reader.readexactly(MAC), timeout)
        except asyncio.IncompleteReadError:
            raise AuthError(f"the coordinator at {host}:{port} refused this machine: wrong "
                            f"run secret (NOLOCO_SECRET or --secret-file)") from None
        if not hmac.compare_digest(proof, _mac(secret, b"gate", mine, theirs)):
            raise AuthError(f"the coordinator at {host}:{port} does not know the run secret: "
                            f"not this run's coordinator")
    except BaseException:
        _close(writer)
        raise
    return reader, writer


def check(host: str, port: int, secret: bytes, timeout: float) -> None:
    """One handshake with the gate at ``host:port``: :class:`AuthError` (one line) when the
    secret is refused, ``OSError`` when it cannot be reached."""

    async def once() -> None:
        _, writer = await _prove(host, port, secret, timeout)
        _close(writer)

    try:
        _Loop.run(once(), timeout + 5.0)
    except TimeoutError as e:
        raise OSError(f"no answer from {host}:{port} within {timeout:g} s") from e


class Door:
    """A forwarder on 127.0.0.1 (:attr:`port`) to the gate at ``host:port``: every connection
    made to it goes through its own handshake."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 30.0) -> None:
        self.host, self.remote_port, self.secret, self.timeout = host, port, secret, timeout

        async def start() -> asyncio.AbstractServer:
            return await asyncio.start_server(self._serve, "127.0.0.1", 0)

        self.server = _Loop.run(start(), 10.0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.refused = 0
        """local connections of another user, closed"""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if peer is None or not same_user(peer[1], self.port):
            self.refused += 1  # another user of this machine: the door is not theirs
            _close(writer)
            return
        try:
            gate = await _prove(self.host, self.remote_port, self.secret, self.timeout)
        except (TimeoutError, OSError, AuthError):
            _close(writer)  # the store client sees a closed connection: unreachable
            return
        await _splice((reader, writer), gate)


def same_user(peer_port: int, port: int, table: str = "/proc/net/tcp") -> bool:
    """Whether the loopback connection from ``peer_port`` to ``port`` belongs to this
    process's user (or root): the kernel's socket tables (``table``, and its IPv6 twin, where
    torch's store client makes IPv4-mapped connections) name each socket's owner. Where there
    is no such table (not Linux), every local connection counts as this user's."""
    lines, found = [], False
    for path in (table, table + "6"):
        try:
            lines += Path(path).read_text().splitlines()[1:]
            found = True
        except OSError:
            pass
    if not found:
        return True
    loopback = ("0100007F", "0000000000000000FFFF00000100007F",
                "00000000000000000000000001000000")
    local = {f"{a}:{peer_port:04X}" for a in loopback}
    remote = {f"{a}:{port:04X}" for a in loopback}
    for line in lines:
        f = line.split()
        if len(f) > 7 and f[1] in local and f[2] in remote:
            return int(f[7]) in (os.getuid(), 0)
    return False  # not found: not a loopback connection of this machine's


_doors: dict[tuple[str, int], Door] = {}
_doors_lock = threading.Lock()
_secret: bytes | None = None
_to_coordinator = False
_probed: set[tuple[str, int]] = set()


def use_secret(secret: bytes | None) -> None:
    """This process reaches its coordinator with ``secret`` (None: directly, unauthenticated:
    then the first connection to each address checks that no gate greets it, so that a
    missing secret is one line, not c10d's retries). Set once, at start-up, by the commands
    that talk to a coordinator."""
    global _secret, _to_coordinator
    _secret, _to_coordinator = secret, True


def current_secret() -> bytes | None:
    return _secret


def door_to(host: str, port: int, timeout: float) -> tuple[str, int]:
    """Where this process's store clients connect to reach ``host:port``: the address itself
    without a secret; with one, this process's door to it (opened on first use, after one
    handshake that says in one line what is wrong)."""
    if _secret is None:
        if _to_coordinator and (host, port) not in _probed:
            if asks_for_secret(host, port, min(timeout, 2.0)):
                raise AuthError(f"the coordinator at {host}:{port} asks for the run secret: "
                                f"give it with --secret-file FILE or {ENV}")
            _probed.add((host, port))
        return host, port
    with _doors_lock:
        door = _doors.get((host, port))
        if door is None:
            check(host, port, _secret, timeout)
            door = _doors[(host, port)] = Door(host, port, _secret, timeout)
    return "127.0.0.1", door.port


def remote_of(host: str, port: int) -> tuple[str, int]:
    """The coordinator's address behind this process's door at ``host:port``, or the address
    itself (a store client reconnecting knows only the address it connected to)."""
    if host == "127.0.0.1":
        with _doors_lock:
            for door in _doors.values():
                if door.port == port:
                    return door.host, door.remote_port
    return host, port


def asks_for_secret(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether the server at ``host:port`` greets with the handshake (a gate)."""
    try:
        with socket.create_connection((host, port), timeout) as s:
            s.settimeout(timeout)
            return s.recv(len(MAGIC)) == MAGIC
    except OSError:
        return False
