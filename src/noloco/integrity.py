"""Payload MACs: what a replica sends another replica carries a keyed MAC of its bytes.

The run's store is reached only by machines that prove the run secret
(:mod:`noloco.elastic.auth`), but the payloads themselves — NoLoCo's exchanges, the quantised
all-reduce's messages, a join's state — travel on gloo's own TCP connections, which anyone on
the path can alter. With a run secret each payload is followed by a 32-byte tag: HMAC-SHA256,
under a key derived from the secret, of the payload's bytes and of a context naming the run,
the operation, the sender and the receiver — so a payload cannot be altered, moved to another
operation, replayed from an earlier one or passed off as another sender's. A payload whose tag
does not verify is dropped as if its sender were absent, with an event.

Cost: hashing runs at ~1.7 GB/s here (SHA-NI), 14x a 1 Gbit/s link. The sender hashes after
posting its payload's sends (gloo moves the bytes meanwhile; hashlib releases the GIL), then
sends the tag; the receiver takes the payload in chunks (:func:`chunk_bounds`) and hashes
each as it lands while the next ones are still on the wire, so only the last chunk's hash
follows the transfer (``benchmarks/payload_mac.py`` measures it). Tag bytes are counted apart
from the payload's (``mac_bytes``), so runs with and without a secret compare byte for byte.

Not covered: gloo's own all-reduce messages (an unquantised DiLoCo all-reduce sums inside
gloo, never in noloco's hands), and confidentiality — payloads are not encrypted
(docs/security.md: a WireGuard tunnel between the machines gives both).

Floor 0 of docs/architecture.md: foundations.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

TAG_BYTES = 32
CHUNKS = 8
"""a payload goes in this many pieces, within the bounds below (so one over 128 MiB in more,
of 16 MiB each): the receiver hashes one while the next arrives"""
MIN_CHUNK = 1 << 18
MAX_CHUNK = 1 << 24


class WireFilter(Protocol):
    """What payloads pass through on their way out of a replica, after they were sealed: the
    one seam where something outside the communicator may alter them (none in a run; fault
    injection installs :class:`noloco.faults.Tamper`, as a machine on the path could alter
    them).

    ``messages``: uint8, one row per message as it goes on the wire (its tag in it where the
    tag travels inside the message). ``channel``: what they are — ``exchange`` (a pair
    exchange's payload), ``all_to_all`` and ``all_gather`` (the quantised all-reduce's and a
    sealed all-gather's messages), ``state`` (a join's state). Returns the rows to send: the
    same tensor when nothing alters them, else an altered copy — never ``messages`` altered in
    place (it may be the caller's own tensor)."""

    def __call__(self, messages: torch.Tensor, channel: str) -> torch.Tensor: ...


def payload_key(secret: bytes) -> bytes:
    """The key of payload MACs: derived from the run secret, never the secret itself (the
    secret also answers the coordinator's challenges)."""
    return hmac.new(secret, b"noloco payload mac v1", hashlib.sha256).digest()


def chunk_bounds(nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges a payload of ``nbytes`` moves in: the same on both ends."""
    size = min(MAX_CHUNK, max(MIN_CHUNK, -(-nbytes // CHUNKS)))
    return [(a, min(a + size, nbytes)) for a in range(0, max(nbytes, 1), size)]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 tensor sharing its memory."""
    return t.reshape(-1).view(torch.uint8)


def _bytes(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu":  # a GPU payload is hashed from a host copy (untested)
        t = t.cpu()
    return memoryview(byte_view(t.contiguous()).numpy())


class Sealer:
    """Seals and opens the payloads of one run (one key)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def _context(self, context: str, sender: int, receiver: int | str, nbytes: int) -> bytes:
        return f"|{context}|{sender}>{receiver}|{nbytes}".encode()

    def seal(self, payload: torch.Tensor, context: str, sender: int,
             receivers: Sequence[int | str]) -> list[torch.Tensor]:
        """One tag per receiver (a uint8 tensor of :data:`TAG_BYTES`); the payload is hashed
        once."""
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        h.update(_bytes(payload))
        n = payload.numel() * payload.element_size()
        tags = []
        for r in receivers:
            t = h.copy()
            t.update(self._context(context, sender, r, n))
            tags.append(torch.frombuffer(bytearray(t.digest()), dtype=torch.uint8))
        return tags

    def sign(self, context: str, message: str) -> str:
        """The MAC of a short message (a join request written to the store), as hex."""
        return hmac.new(self.key, f"|{context}|{message}".encode(), hashlib.sha256).hexdigest()

    def signed(self, context: str, message: str, mac: object) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(self.sign(context, message), mac)

    def opener(self, context: str, sender: int, receiver: int | str, nbytes: int) -> Opener:
        return Opener(self, self._context(context, sender, receiver, nbytes))

    def check(self, payload: torch.Tensor, tag: torch.Tensor, context: str, sender: int,
              receiver: int | str) -> bool:
        """Whether ``tag`` is ``sender``'s seal of ``payload`` for ``receiver``."""
        o = self.opener(context, sender, receiver, payload.numel() * payload.element_size())
        o.update(payload)
        return o.verify(tag)


class Opener:
    """The receiving end: the payload's chunks in order (:meth:`update`), then the tag."""

    def __init__(self, sealer: Sealer, context: bytes) -> None:
        self._h = hmac.new(sealer.key, digestmod=hashlib.sha256)
        self._context = context

    def update(self, chunk: torch.Tensor) -> None:
        self._h.update(_bytes(chunk))

    def verify(self, tag: torch.Tensor) -> bool:
        self._h.update(self._context)
        return hmac.compare_digest(self._h.digest(), bytes(_bytes(tag)))


def sealed_messages(sealer: Sealer, messages: torch.Tensor, context: str, sender: int,
                    receivers: Sequence[int | str]) -> torch.Tensor:
    """``messages`` (a uint8 tensor of ``len(receivers)`` equal messages, one per receiver)
    with each message's tag after it: what a sealed all-to-all sends."""
    k = len(receivers)
    msgs = messages.view(k, -1)
    out = torch.empty(k, msgs.shape[1] + TAG_BYTES, dtype=torch.uint8)
    out[:, :msgs.shape[1]] = msgs
    for j, r in enumerate(receivers):
        out[j, msgs.shape[1]:] = sealer.seal(msgs[j], context, sender, [r])[0]
    return out.view(-1)


def open_messages(sealer: Sealer, received: torch.Tensor, context: str,
                  senders: Sequence[int], receiver: int | str) -> tuple[torch.Tensor, list[int]]:
    """The messages of a sealed all-to-all (or all-gather) without their tags, and the
    senders whose tag failed."""
    k = len(senders)
    rows = received.view(k, -1)
    body = rows[:, :-TAG_BYTES]
    bad = [s for j, s in enumerate(senders)
           if not sealer.check(body[j], rows[j, -TAG_BYTES:], context, s, receiver)]
    return body.contiguous().view(-1), bad


class Opened(NamedTuple):
    """A sealed payload being received: its chunks (views of the receive buffer), in order,
    and its tag's buffer."""

    opener: Opener
    parts: list[torch.Tensor]
    mac: torch.Tensor


def post_exchange(pg: dist.ProcessGroupGloo, tensor: torch.Tensor, bufs: Sequence[torch.Tensor],
                  peers: Sequence[tuple[int, int]], me: int, sealer: Sealer | None,
                  context: str, wire: WireFilter | None = None
                  ) -> tuple[dict[int, list[Any]], dict[int, Opened], list[int]]:
    """Post a pair exchange on the gloo group ``pg``: ``tensor`` to every peer, each peer's
    tensor into its buffer. ``peers``: (id, index in ``pg``); ``me``: this member's id.
    Receives are posted first (gloo's "ready" notice; :class:`noloco.comm.TorchCommunicator`).
    Sealed, the payload moves in :func:`chunk_bounds` pieces (gloo tags 0..k-1) and its tag
    after it (tag k), hashed once the payload's sends are posted. Returns each peer's works
    (its receives, then its sends: :func:`finish_peer` takes them in that order), the
    openers, and the peers that failed already at posting (a group closed on their side).
    ``wire``: what the payload passes through on its way out (:class:`WireFilter`), if
    anything."""
    nbytes = tensor.numel() * tensor.element_size()
    chunks = chunk_bounds(nbytes) if sealer is not None else [(0, nbytes)]
    works: dict[int, list[Any]] = {}
    sealed: dict[int, Opened] = {}
    lost: list[int] = []
    for (p, index), buf in zip(peers, bufs, strict=True):
        try:
            if sealer is None:
                works[p] = [pg.recv([buf], index, 0)]
                continue
            mac = torch.empty(TAG_BYTES, dtype=torch.uint8)
            parts = [byte_view(buf)[a:b] for a, b in chunks]
            works[p] = [pg.recv([x], index, i) for i, x in enumerate(parts)]
            works[p].append(pg.recv([mac], index, len(chunks)))
            sealed[p] = Opened(sealer.opener(context, p, me, nbytes), parts, mac)
        except RuntimeError:
            lost.append(p)
            works.pop(p, None)
    out = byte_view(tensor)
    if wire is not None:  # altered on the wire, after its tag is computed below
        out = wire(out.view(1, -1), "exchange").view(-1)
    index_of = dict(peers)
    for p in list(works):
        try:
            works[p] += [pg.send([out[a:b] if sealer is not None or wire is not None else tensor],
                                 index_of[p], i) for i, (a, b) in enumerate(chunks)]
        except RuntimeError:
            lost.append(p)
            works.pop(p)
    if sealer is not None and works:
        # Hashed while gloo moves the payload (hashlib releases the GIL).
        for p, mac in zip(list(works), sealer.seal(tensor, context, me, list(works)),
                          strict=True):
            try:
                works[p].append(pg.send([mac], index_of[p], len(chunks)))
            except RuntimeError:
                lost.append(p)
                works.pop(p)
    return works, sealed, lost


def finish_peer(works: Sequence[Any], opened: Opened | None) -> bool:
    """Wait for one peer's part of :func:`post_exchange` — each chunk hashed as it lands,
    while the next ones are still on the wire — and say whether its payload verified
    (always, unsealed). A failed transfer raises ``RuntimeError``. Each work is waited for
    once: a second wait on a gloo receive waits for another message."""
    rest = list(works)
    if opened is not None:
        for w, part in zip(works, opened.parts, strict=False):
            w.wait()
            opened.opener.update(part)
        rest = rest[len(opened.parts):]
    for w in rest:
        w.wait()
    return opened is None or opened.opener.verify(opened.mac)
