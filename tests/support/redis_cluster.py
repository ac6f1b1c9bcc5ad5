"""A real Redis Cluster for tests: 3 primaries and 3 replicas on free local ports, started from the
``redis-server`` binary (``--cluster-enabled yes``), joined by ``redis-cli --cluster create`` and torn down.

Nothing is persisted (``--save '' --appendonly no``): a killed primary's data survives only on its
replica, as in a production cluster whose replication is asynchronous. :meth:`LocalCluster.kill` and
:meth:`LocalCluster.wait_failover` drive a failover.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.ports import free_port

PRIMARIES = 3
#: How long a node may be unreachable before the others count it failed (ms). Short, so a failover test
#: does not wait long; above the pauses a loaded 2-core machine gives a node.
NODE_TIMEOUT_MS = 2000


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ports(n: int) -> list[int]:
    """``n`` distinct ports whose cluster-bus ports (+10000) are free too; restartable: a killed node comes back on
    its own port (tests/support/ports.py)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(also=(10000,))
        if not {port, port + 10000} & {q for p in ports for q in (p, p + 10000)}:
            ports.append(port)
    return ports


@dataclass
class LocalCluster:
    ports: list[int]
    workdir: Path
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    _before: set[int] = field(default_factory=set)  # the primaries before the last kill

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node(self, port: int) -> redis.Redis[bytes]:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=2)

    def start_node(self, port: int) -> None:
        d = self.workdir / str(port)
        d.mkdir(exist_ok=True)
        log = open(d / "redis.log", "ab")  # noqa: SIM115 - kept open for the server's life
        self.processes[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--save", "", "--appendonly", "no", "--dir", str(d), "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            try:
                if self.node(port).ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start: see {d / 'redis.log'}")
            time.sleep(0.05)

    def primaries(self) -> dict[int, tuple[int, int]]:
        """Live primaries: port -> (first slot, last slot) of their first range."""
        for port in self.ports:
            if port not in self.processes or self.processes[port].poll() is not None:
                continue
            try:
                slots = self.node(port).execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                continue
            return {int(s[2][1]): (int(s[0]), int(s[1])) for s in slots}
        return {}

    def primary_of(self, key: str) -> int:
        slot = int(self.node(self.alive()[0]).execute_command("CLUSTER KEYSLOT", key))
        for port, (lo, hi) in self.primaries().items():
            if lo <= slot <= hi:
                return port
        raise RuntimeError(f"no primary serves slot {slot}")

    def alive(self) -> list[int]:
        return [p for p in self.ports if p in self.processes and self.processes[p].poll() is None]

    def kill(self, port: int) -> None:
        """SIGKILL one node (no shutdown, nothing saved)."""
        self._before = set(self.primaries())
        proc = self.processes[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def wait_ok(self, timeout: float = 60.0, primaries: int = PRIMARIES) -> None:
        """Until every live node says the cluster is ok and sees ``primaries`` live primaries covering all slots."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                states = []
                for port in self.alive():
                    info = self.node(port).execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
                    states.append(_text(info.get("cluster_state") if isinstance(info, dict) else info) in
                                  ("ok", "cluster_state:ok"))
                covered = sum(hi - lo + 1 for lo, hi in self._all_ranges())
                if all(states) and covered == 16384 and len(self.primaries()) >= primaries:
                    return
                last = f"states={states} covered={covered}"
            except redis.RedisError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise RuntimeError(f"the cluster did not settle within {timeout:.0f} s ({last})")

    def _all_ranges(self) -> list[tuple[int, int]]:
        for port in self.alive():
            try:
                return [(int(s[0]), int(s[1])) for s in self.node(port).execute_command("CLUSTER SLOTS")]
            except redis.RedisError:
                continue
        return []

    def wait_failover(self, victim: int, timeout: float = 60.0) -> int:
        """After :meth:`kill` of the primary ``victim``: until a replica took its slots over and the cluster is
        ok again; the new primary's port."""
        deadline = time.monotonic() + timeout
        while True:
            primaries = self.primaries()
            if primaries and victim not in primaries and len(primaries) == PRIMARIES:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replica took over from {victim} within {timeout:.0f} s ({primaries})")
            time.sleep(0.1)
        self.wait_ok(max(1.0, deadline - time.monotonic()))
        (successor,) = set(self.primaries()) - set(primaries) or set(primaries) - set(self._before)
        return successor

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Until every primary has a replica whose link to it is up (a failover then keeps its data)."""
        deadline = time.monotonic() + timeout
        while self.synced_replicas() < PRIMARIES:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replicas did not sync within {timeout:.0f} s")
            time.sleep(0.1)

    def synced_replicas(self) -> int:
        synced = 0
        for port in self.alive():
            try:
                info = self.node(port).info("replication")
            except redis.RedisError:
                continue
            if info.get("role") == "slave" and info.get("master_link_status") == "up":
                synced += 1
        return synced

    def restart(self, port: int) -> None:
        """Start a killed node again: it rejoins (as a replica of whoever took its slots)."""
        self.start_node(port)

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.processes.values():
            with contextlib.suppress(Exception):
                proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def new_cluster() -> LocalCluster:
    """A cluster's ports and directory, nothing started yet (its :attr:`LocalCluster.url` is known already)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise FileNotFoundError("redis-server and redis-cli")
    return LocalCluster(ports=_ports(2 * PRIMARIES),
                        workdir=Path(tempfile.mkdtemp(prefix="pb-redis-cluster-")))


def start_cluster(cluster: LocalCluster | None = None) -> LocalCluster:
    """Start 3 primaries and 3 replicas, join them and wait until the cluster is ok and the replicas synced."""
    cluster = cluster or new_cluster()
    try:
        for port in cluster.ports:
            cluster.start_node(port)
        made = subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in cluster.ports],
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {(made.stderr or made.stdout).strip()[-500:]}")
        cluster.wait_ok()
        cluster.wait_synced()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def running_cluster() -> Iterator[LocalCluster]:
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
