"""Where a run's store is: the ``--coordinator`` addresses, parsed. A leaf: it imports nothing
of noloco's but its errors, so the config (below) and the elastic machinery (above) share it.

- ``HOST:PORT``: a noloco coordinator (``noloco coordinator``), or any c10d TCPStore;
- ``etcd://H1:P1,H2:P2``: an etcd cluster's client endpoints.

Floor 0 of docs/architecture.md: foundations."""

from __future__ import annotations

from noloco.errors import ConfigError

ETCD_SCHEME = "etcd://"


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port); a ConfigError names the flag otherwise."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator must be HOST:PORT, got {text!r}")
    return host, int(port)


def parse_endpoints(address: str) -> list[tuple[str, int]]:
    """``etcd://H1:P1,H2:P2`` → [(H1, P1), (H2, P2)]; ValueError when malformed."""
    if not address.startswith(ETCD_SCHEME):
        raise ValueError(f"not an etcd address: {address!r}")
    out = []
    for part in address[len(ETCD_SCHEME):].split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoints are HOST:PORT, comma-separated; got {part!r}")
        out.append((host, int(port)))
    return out
