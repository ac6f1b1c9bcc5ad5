"""A private RabbitMQ node for the fault tests: its own node name, ports and data directory, so a test may SIGKILL
it, wipe its data and start it again without touching the machine's shared broker (127.0.0.1:5672, used by every
other test).

The node is this machine's RabbitMQ (``rabbitmq-server`` and ``rabbitmqctl`` from ``/usr/lib/rabbitmq/bin`` or the
``PATH``) started with ``RABBITMQ_NODENAME``, ``RABBITMQ_NODE_PORT``, ``RABBITMQ_DIST_PORT``, ``RABBITMQ_MNESIA_BASE``
and ``RABBITMQ_LOG_BASE`` of its own (a temporary directory), a configuration file of its own (only the AMQP listener
on 127.0.0.1 and no plugins: the machine's ``/etc/rabbitmq`` files name the shared node's port) and the machine's
Erlang cookie (copied into the node's ``HOME``, which ``rabbitmqctl`` reads too). Both ports are free ones picked at
start. Everything it started is ended by process group id when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import wait_for
from tests.support.ports import free_port

SBIN = Path("/usr/lib/rabbitmq/bin")
#: Where a packaged broker keeps the cookie every local node and CLI tool shares.
MACHINE_COOKIE = Path("/var/lib/rabbitmq/.erlang.cookie")
HINT = ("a private RabbitMQ node needs this machine's RabbitMQ 3.9+ (`rabbitmq-server` and `rabbitmqctl`, e.g. "
        "`apt-get install rabbitmq-server`) and a readable Erlang cookie ({cookie})")


def _tool(name: str) -> str | None:
    packaged = SBIN / name
    if packaged.exists():
        return str(packaged)
    return shutil.which(name)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def unavailable_reason() -> str | None:
    """Why a private node cannot be started here, or ``None``."""
    if _tool("rabbitmq-server") is None or _tool("rabbitmqctl") is None:
        return HINT.format(cookie=MACHINE_COOKIE)
    cookie = Path(os.environ.get("POLLBRIDGE_TEST_RABBITMQ_COOKIE", MACHINE_COOKIE))
    if not os.access(cookie, os.R_OK):
        return HINT.format(cookie=cookie) + f": {cookie} is not readable by this user"
    return None


@dataclass
class PrivateNode:
    """One private RabbitMQ node. ``url`` is its AMQP URL (guest on loopback)."""

    base: Path
    name: str = field(default_factory=lambda: f"pbfault{uuid.uuid4().hex[:8]}@localhost")
    port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    @property
    def data_dir(self) -> Path:
        return self.base / "mnesia"

    def _env(self) -> dict[str, str]:
        return {**{k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))},
                "HOME": str(self.base),
                "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
                "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
                "RABBITMQ_NODENAME": self.name,
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_MNESIA_BASE": str(self.data_dir),
                "RABBITMQ_LOG_BASE": str(self.base / "log"),
                "RABBITMQ_PID_FILE": str(self.base / "node.pid"),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
                "ERL_EPMD_ADDRESS": "127.0.0.1"}

    def prepare(self) -> None:
        cookie = Path(os.environ.get("POLLBRIDGE_TEST_RABBITMQ_COOKIE", MACHINE_COOKIE))
        target = self.base / ".erlang.cookie"
        target.write_bytes(cookie.read_bytes())
        target.chmod(0o400)
        (self.base / "rabbitmq-env.conf").write_text("")  # not the machine's (it names the shared node)
        (self.base / "enabled_plugins").write_text("[].\n")
        (self.base / "rabbitmq.conf").write_text(f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
                                                 "loopback_users.guest = true\n")

    def ctl(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        ctl = _tool("rabbitmqctl")
        assert ctl is not None
        return subprocess.run([ctl, "-q", "-n", self.name, *args], env=self._env(), capture_output=True, text=True,
                              timeout=timeout, check=False)

    def start(self, timeout: float = 120) -> None:
        """Start the node (again, on the same data directory unless it was wiped) and wait until it serves."""
        assert self.proc is None or self.proc.poll() is not None, "the node is running"
        server = _tool("rabbitmq-server")
        assert server is not None
        self.starts += 1
        log = (self.base / f"server-{self.starts}.log").open("wb")
        try:
            self.proc = subprocess.Popen([server], env=self._env(), cwd=self.base, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        proc = self.proc
        # rabbitmqctl fails at once while the node is not registered with epmd: wait for that first ...
        wait_for(lambda: proc.poll() is not None or _registered(self), timeout, what="the node to register with epmd")
        if proc.poll() is None:
            # ... then it waits for the boot itself.
            result = self.ctl("await_startup", "--timeout", str(max(1, int(deadline - time.monotonic()))),
                              timeout=max(5.0, deadline - time.monotonic() + 10))
        if proc.poll() is not None:
            raise RuntimeError(f"the private RabbitMQ node exited with {proc.returncode}: {self.tail_log()}")
        if result.returncode != 0 or not _port_open(self.port):
            raise RuntimeError(f"the private RabbitMQ node did not start within {timeout:.0f} s: "
                               f"{result.stderr[-2000:]}\n{self.tail_log()}")

    def kill(self) -> None:
        """SIGKILL the node (every process it started), as a crash would; wait until its port is closed."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        wait_for(lambda: not _port_open(self.port), 30, what="the killed node's port to close")
        # Its name must be gone from epmd before a node of the same name can start.
        wait_for(lambda: not _registered(self), 30, what="epmd to forget the killed node")

    def wipe(self) -> None:
        """The node's disk lost: every queue, stream and message gone (the node must be down)."""
        assert self.proc is None or self.proc.poll() is not None, "wipe a stopped node only"
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def tail_log(self, chars: int = 3000) -> str:
        logs = sorted(self.base.glob("server-*.log")) + sorted((self.base / "log").glob("*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def _registered(node: PrivateNode) -> bool:
    """Whether epmd lists the node's name."""
    short = node.name.split("@", 1)[0]
    epmd = shutil.which("epmd") or "/usr/bin/epmd"
    try:
        out = subprocess.run([epmd, "-names"], capture_output=True, text=True, timeout=10, check=False).stdout
    except OSError:
        return False
    return any(line.startswith(f"name {short} ") for line in out.splitlines())


@contextlib.contextmanager
def private_rabbitmq() -> Iterator[PrivateNode]:
    """A started private node, stopped and deleted afterwards. Fails under ``POLLBRIDGE_REQUIRE_SERVICES=1`` (skips
    otherwise) when this machine cannot run one."""
    from tests.conftest import service_unavailable

    reason = unavailable_reason()
    if reason is not None:
        service_unavailable(reason)
    base = Path(tempfile.mkdtemp(prefix="pbrabbit-"))
    node = PrivateNode(base)
    try:
        node.prepare()
        node.start()
        yield node
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)
