"""Free TCP ports on 127.0.0.1 for the servers tests start (one helper for all of them).

Every port is drawn *below* the kernel's ephemeral range: a port from that range is what every client connection
takes as its local port, so between the moment a port is found free and the moment the server binds it, one of
the many connections the suite opens can take its number. Seen twice: a private RabbitMQ node restarted into
``eaddrinuse`` (a server killed and started again on its port), and an Airflow api-server that could not bind the
port picked before `airflow db migrate` ran (a kernel-chosen port, free at the pick, taken a minute later).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Ports are drawn from here up to the ephemeral range's start.
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


def free_port(*, also: tuple[int, ...] = ()) -> int:
    """A port free now, below the ephemeral range (see the module docstring). ``also``: offsets from it that must
    be free and below the range too (a Redis Cluster node's bus port is its port + 10000)."""
    top = _ephemeral_start() - 1 - max((0, *also))
    if top <= LOW:
        raise RuntimeError(f"no port below the ephemeral range ({_ephemeral_start()}) leaves room for offsets {also}")
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randint(LOW, top)
        if all(_bindable(port + offset) for offset in (0, *also)):
            return port
    raise RuntimeError("no free port below the ephemeral range")
