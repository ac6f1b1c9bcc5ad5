"""Free TCP ports on 127.0.0.1 for the servers tests start (one helper for all of them).

A server a test kills and starts again on the same port (a private Redis, a Redis Cluster node, a RabbitMQ node,
a PostgreSQL) must get a port *below* the kernel's ephemeral range: a port from that range is what every client
connection takes as its local port, and once the server is down one of the many reconnecting clients can take
its number, so the server cannot bind it again (seen: a private RabbitMQ node restarted into ``eaddrinuse``).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Restartable ports are drawn from here up to the ephemeral range's start.
LOW = 10_000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, restartable: bool = False, also: tuple[int, ...] = ()) -> int:
    """A port free now; ``restartable``: outside the ephemeral range (see the module docstring). ``also``: offsets
    from it that must be free and restartable too (a Redis Cluster node's bus port is its port + 10000)."""
    if not restartable:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    top = _ephemeral_start() - 1 - max((0, *also))
    if top <= LOW:
        raise RuntimeError(f"no port below the ephemeral range ({_ephemeral_start()}) leaves room for offsets {also}")
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randint(LOW, top)
        if all(_bindable(port + offset) for offset in (0, *also)):
            return port
    raise RuntimeError("no free port below the ephemeral range")
