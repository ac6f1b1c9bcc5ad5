"""The processes a chaos run starts: a private ``redis-server`` and the pollbridge fleet, one process group
each, with the configuration they share; also the ``pollbridge`` commands a fault may cut."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tests.support.ports import free_port

#: The bus of the run: partitions, and the namespace of its keys on the private Redis.
PARTITIONS = 4
NAMESPACE = "chaos"
#: The ``application_name`` of this harness's own connections (spared by ``pg:terminate``).
HARNESS_APP = "pollbridge-chaos"

#: (command, the start-up line it prints on stderr once it is up) of every process of the fleet.
ROLES: dict[str, tuple[tuple[str, ...], re.Pattern[str]]] = {
    "relay": (("relay", "run"), re.compile(r"^relay partition \d+ ", re.M)),
    "scheduler-a": (("scheduler", "run"), re.compile(r"^scheduler \S+ on ", re.M)),
    "scheduler-b": (("scheduler", "run"), re.compile(r"^scheduler \S+ on ", re.M)),
    "poller": (("poller", "run"), re.compile(r"^poller scanning ", re.M)),
    "guardian": (("guardian", "run"), re.compile(r"^guardian checking ", re.M)),
    "workers": (("workers", "run"), re.compile(r"^\d+ workers on ", re.M)),
}

#: The ``pollbridge.toml`` of the fleet (short timeouts, so faults are noticed and healed quickly).
CONFIG = """\
[bus]
namespace = "{namespace}"
partitions = {partitions}
visibility_timeout = 2
[relay]
retention = {retention}
epoch_check_interval = 0.5
lease_timeout = 3
[scheduler]
lease_ttl = 3
claim_interval = 1
max_deliveries = 5
[scheduler.defaults]
retry_base = 0.2
retry_max = 2
retry_jitter = 0.5
running_timeout = 5
[router]
refresh_interval = 0.5
grace = 3
sweep_interval = 2
[poller]
interval = 0.5
running_timeout = 5
[workers]
concurrency = 4
min_duration = 0.005
max_duration = 0.03
failure_rate = 0.15
[guardian]
interval = 2
max_miss_rate = 0.2
min_tasks = 50
window = 30
"""


_PRCTL: Any = None
with contextlib.suppress(OSError, AttributeError):
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # resolved here, not in the forked child


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it dies (Linux), so nothing is left
    running even if this harness is killed. Only ever started from the main thread."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(args: list[str], *, cwd: Path, env: dict[str, str] | None, log: Path) -> subprocess.Popen[bytes]:
    """A child in a process group of its own (so it and anything it starts can be killed as one),
    stdout and stderr to ``log`` (a pipe nobody drains would block it)."""
    with log.open("ab") as out:
        return subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, preexec_fn=_die_with_parent)


def _killpg(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


#: Counts of ``pollbridge`` commands (flag changes, signals) that failed because a fault hit them.
CLI_FAILURES: Counter[str] = Counter()
_CLI_LOCK = threading.Lock()


def classify_cli_failure(returncode: int, stderr: str) -> str | None:
    """A command that exits 1 because a fault cut it (pg_terminate_backend, Redis down) changed nothing (flag
    changes and signals are one transaction each): it is counted, by how it told the user, and is not a
    problem; any other exit code is (``None``). ``traceback`` and ``missing table`` are known bugs (the CLI
    lets an ``OperationalError`` escape; reflection reports a cut connection as a missing table)."""
    if returncode != 1:
        return None
    if "Traceback" in stderr:
        kind = "traceback"
    elif "named by the mapping does not exist" in stderr:
        kind = "missing table"
    else:
        kind = "one-line error"
    with _CLI_LOCK:
        CLI_FAILURES[kind] += 1
    return kind


def tail(path: Path, lines: int = 8) -> str:
    """The last ``lines`` lines of a log (empty if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class PrivateRedis:
    """A ``redis-server`` of this run only: no RDB, no AOF, so a restart loses everything, like FLUSHALL."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.exe = exe
        self.workdir = workdir
        self.port = port or free_port()  # it is killed and started again on it
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis[bytes]:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=2)

    def start(self) -> None:
        self.starts += 1
        self.proc = _spawn([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", str(self.workdir)],
                           cwd=self.workdir, env=None, log=self.workdir / "redis.log")
        deadline = time.monotonic() + 20
        client = self.client()
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {self.port} did not start: "
                                           f"{tail(self.workdir / 'redis.log')}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None:
            _killpg(self.proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        self.kill()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class PrivateCluster:
    """A private Redis Cluster of this run (3 primaries, 3 replicas; tests/support/redis_cluster.py) in the place of
    :class:`PrivateRedis`: :meth:`kill` SIGKILLs one primary, whose replica takes over (what asynchronous
    replication had not copied is lost); :meth:`start` brings the killed nodes back, as replicas. The URL's node
    is never killed: a pollbridge process restarted meanwhile must reach the cluster through it."""

    def __init__(self, workdir: Path) -> None:
        from tests.support.redis_cluster import new_cluster

        self.cluster = new_cluster()
        self.down: list[int] = []
        self.starts = 0

    @property
    def url(self) -> str:
        return self.cluster.url

    def client(self) -> Any:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def start(self) -> None:
        from tests.support.redis_cluster import start_cluster

        self.starts += 1
        if not self.cluster.processes:
            start_cluster(self.cluster)
            return
        for port in self.down:
            self.cluster.restart(port)
        self.down = []

    def kill(self) -> None:
        """SIGKILL a primary (not the URL's node) whose replica is in sync; RuntimeError when none is (a node
        killed before has not finished coming back): killing then would take the cluster down, not fail over."""
        if self.cluster.synced_replicas() < len(self.cluster.primaries()):
            raise RuntimeError("a replica is still syncing: no failover possible yet")
        victims = [p for p in self.cluster.primaries() if p != self.cluster.ports[0]]
        if not victims:
            raise RuntimeError("no primary to kill but the URL's node")
        victim = victims[0]
        self.cluster.kill(victim)
        self.down.append(victim)

    def stop(self) -> None:
        self.cluster.stop()

    @property
    def running(self) -> bool:
        return not self.down


class Fleet:
    """The pollbridge processes, one process group each; knows which deaths it caused."""

    def __init__(self, workdir: Path, env: dict[str, str], say: Callable[[str], None]) -> None:
        exe = shutil.which("pollbridge")
        if exe is None:
            raise RuntimeError("the `pollbridge` console script is not installed: `pip install -e .`")
        self.exe = exe
        self.workdir = workdir
        self.env = env
        self.say = say
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.all: list[subprocess.Popen[bytes]] = []
        self.killed: set[int] = set()
        self.starts: Counter[str] = Counter()
        self.start_failures: Counter[str] = Counter()
        self.crashes: list[str] = []
        self.failure_lines: list[str] = []
        self._retry_at: dict[str, float] = {}

    def start(self, role: str) -> None:
        """Start ``role`` (without waiting for it to be up) unless it is running already."""
        if role in self.procs and self.procs[role].poll() is None and self.procs[role].pid not in self.killed:
            return
        args, _ready = ROLES[role]
        self.starts[role] += 1
        log = self.workdir / f"{role}-{self.starts[role]}.log"
        proc = _spawn([self.exe, *args], cwd=self.workdir, env=self.env, log=log)
        self.procs[role] = proc
        self.logs[role] = log
        self.all.append(proc)
        self._retry_at.pop(role, None)

    def ready(self, role: str) -> bool:
        try:
            return ROLES[role][1].search(self.logs[role].read_text(errors="replace")) is not None
        except OSError:
            return False

    def wait_ready(self, roles: list[str], timeout: float = 90.0) -> None:
        """Wait until every role is up; a role whose process exits first is left to :meth:`supervise`."""
        deadline = time.monotonic() + timeout
        waiting = list(roles)
        while waiting:
            waiting = [r for r in waiting if not self.ready(r) and self.procs[r].poll() is None]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"not up after {timeout:g} s: {', '.join(waiting)}")
            time.sleep(0.05)

    def kill(self, role: str) -> int:
        proc = self.procs[role]
        self.killed.add(proc.pid)
        _killpg(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        return proc.pid

    def supervise(self) -> None:
        """Like a service manager: restart a process that died without being killed by us (a crash, or
        a start that failed, e.g. while Redis was down), with a short backoff. Crashes are recorded."""
        now = time.monotonic()
        for role, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or proc.pid in self.killed:
                continue
            if role not in self._retry_at:
                lines = [line for line in self.logs[role].read_text(errors="replace").splitlines() if line.strip()]
                first = lines[-1] if lines else ""
                if self.ready(role):
                    self.crashes.append(f"{role} (pid {proc.pid}) exited with {code} while running: "
                                        f"{tail(self.logs[role], 3)}")
                    self.say(f"CRASH {role} exited with {code}; restarting")
                else:
                    self.start_failures[role] += 1
                    self.failure_lines.append(f"{role}: exit {code}: {first.strip()[:300]}")
                    self.say(f"{role} failed to start (exit {code}: {first.strip()[:160]}); retrying in 1 s")
                self._retry_at[role] = now + 1.0
            elif now >= self._retry_at[role]:
                del self._retry_at[role]
                self.start(role)

    def alive(self, role: str) -> bool:
        return self.procs[role].poll() is None

    def ensure_all_up(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.supervise()
            if all(self.alive(r) and self.ready(r) for r in self.procs):
                return
            if time.monotonic() > deadline:
                down = [r for r in self.procs if not (self.alive(r) and self.ready(r))]
                raise RuntimeError(f"processes not up after {timeout:g} s: {', '.join(down)}")
            time.sleep(0.1)

    def stop_all(self) -> dict[str, int | None]:
        """SIGTERM every live process, wait (then SIGKILL); return each role's exit code."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for role, proc in self.procs.items():
            try:
                codes[role] = proc.wait(30)
            except subprocess.TimeoutExpired:
                _killpg(proc)
                proc.wait(10)
                codes[role] = None
        return codes

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run one ``pollbridge`` command with the fleet's configuration and environment."""
        return subprocess.run([self.exe, *args], cwd=self.workdir, env=self.env, capture_output=True,
                              text=True, timeout=120)

    def kill_all(self) -> None:
        for proc in self.all:
            _killpg(proc)
        for proc in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def new_workdir(base: Path | None = None) -> Path:
    """A directory for one run's logs and configuration (kept: the logs explain a failure)."""
    return Path(tempfile.mkdtemp(prefix="pollbridge-chaos-", dir=base))


def log_tails(path: Path, lines: int = 15) -> str:
    """The last lines of every log of a run."""
    return "\n".join(f"--- {p.name}\n{tail(p, lines)}" for p in sorted(path.glob("*.log")))

