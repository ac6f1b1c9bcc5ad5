"""The fault-injection engine behind ``tests/faults/test_chaos.py`` and ``python -m bench.faults``.

What runs: a private ``redis-server`` (no persistence, its own port, so it can be flushed and restarted
without touching anybody else's data) and, each as its own process group, ``pollbridge relay run``, two
``pollbridge scheduler run``, ``pollbridge poller run``, ``pollbridge guardian run`` and ``pollbridge
workers run`` on one PostgreSQL database. This process plays the users of the platform: it seeds a
mixed workload (four workflow types; chains, fan-out/fan-in and stacked diamonds; due times; tasks that
await a callback or an approval, signalled later, some rejected; workers that fail 15% of the attempts,
so tasks are retried), and injects faults at random moments, drawn from a seeded generator whose seed
is printed (the schedule of faults replays; the timing of the processes around them does not):

============================  ==================================================================
``kill:<role>``               SIGKILL of the relay, a scheduler (sometimes both), the poller, the
                              guardian or the workers, restarted after 0-3 s
``redis:flushall``            ``FLUSHALL`` on the private Redis: every stream, group and dead
                              letter gone
``redis:restart``             the private Redis SIGKILLed and started again empty after 0.5-3 s
``pg:terminate``              ``pg_terminate_backend`` of every connection pollbridge's processes
                              hold on the test database (``datname`` filtered; this harness's own
                              connections are spared by their ``application_name``)
``pg:long_transaction``       a transaction holding row locks on live tasks for 2-6 s, which also
                              records a signal and so commits an outbox row out of id order
``bus:duplicate``             recent (or the oldest) entries of a partition stream added again,
                              shuffled: duplicated, reordered and stale events
``bus:malformed``             entries that are not CloudEvents (no payload field, not UTF-8, not
                              JSON, missing attributes, wrong specversion, bad time, bad depth,
                              non-object data), well-formed events about nothing (an unknown
                              instance, garbage data) and sometimes an outbox row the relay cannot
                              publish
``flags:flip``                ``pollbridge flags set TYPE PHASE [--percent P] --force --reason chaos``
``flags:rollback``            ``pollbridge rollback (TYPE | --all) --reason chaos``
============================  ==================================================================

Every kind is injected at least once (a shuffled round of all of them first, then weighted draws).
When the fault window ends every process is brought back, the remaining signals are sent and the
workload must settle; then SQL over the task table, the dispatch log, the outbox and the audit trail,
and :func:`bridge.reference.oracle.verify` independently, must show no lost trigger, no attempt dispatched twice,
no dispatch before its readiness, every dispatch in the log, no outbox row unpublished, every dead
letter with a reason and every malformed entry dead-lettered (unless Redis lost it afterwards).
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.db.schema import dispatch_log
from bridge.flags.store import FlagStore
from bridge.reference.oracle import Verdict, percentile, verify
from bridge.reference.workload import SHAPES, WorkflowSpec, make_shape, seed
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.exceptions import SignalError
from event_scheduler.signals import record_signal

KINDS = (
    "kill:relay", "kill:scheduler", "kill:poller", "kill:guardian", "kill:workers",
    "redis:flushall", "redis:restart", "pg:terminate", "pg:long_transaction",
    "bus:duplicate", "bus:malformed", "flags:flip", "flags:rollback",
)
#: Relative weights of the draws after the first round.
WEIGHTS = {
    "kill:relay": 2, "kill:scheduler": 3, "kill:poller": 1, "kill:guardian": 1, "kill:workers": 2,
    "redis:flushall": 1, "redis:restart": 1, "pg:terminate": 2, "pg:long_transaction": 2,
    "bus:duplicate": 2, "bus:malformed": 2, "flags:flip": 3, "flags:rollback": 1,
}
#: Well-formed events that mean nothing (an unknown instance, garbage in ``data``): acknowledged, not dead-lettered.
BENIGN = ("unknown instance", "garbage data")
TYPES = ("orders", "reports", "etl", "billing")
PHASES = ("polling", "dual_write", "selective", "cutover")
PARTITIONS = 4
NAMESPACE = "chaos"
HARNESS_APP = "pollbridge-chaos"
STATUS = {"pending": "pending", "dispatched": "queued", "running": "running", "completed": "completed",
          "failed": "failed"}

#: (command, the start-up line it prints on stderr once it is up) of every process of the fleet.
ROLES: dict[str, tuple[tuple[str, ...], re.Pattern[str]]] = {
    "relay": (("relay", "run"), re.compile(r"^relay partition \d+ ", re.M)),
    "scheduler-a": (("scheduler", "run"), re.compile(r"^scheduler \S+ on ", re.M)),
    "scheduler-b": (("scheduler", "run"), re.compile(r"^scheduler \S+ on ", re.M)),
    "poller": (("poller", "run"), re.compile(r"^poller scanning ", re.M)),
    "guardian": (("guardian", "run"), re.compile(r"^guardian checking ", re.M)),
    "workers": (("workers", "run"), re.compile(r"^\d+ workers on ", re.M)),
}

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

# --- SQL checks (PostgreSQL, the reference schema) ---------------------------------------------------

#: Tasks neither completed, nor terminally failed, nor pending behind a terminally failed dependency
#: (transitively): each one is a lost trigger once the workload had time to settle.
UNSETTLED_SQL = """
WITH RECURSIVE dead(id, instance_id, task_key) AS (
    SELECT id, instance_id, task_key FROM tasks WHERE status = 'failed' AND attempts >= max_attempts
  UNION
    SELECT t.id, t.instance_id, t.task_key FROM tasks t
    JOIN dead d ON d.instance_id = t.instance_id AND t.depends_on::jsonb ? d.task_key
    WHERE t.status = 'pending'
)
SELECT t.id, t.instance_id, t.task_key, t.status, t.attempts FROM tasks t
WHERE t.status <> 'completed' AND t.id NOT IN (SELECT id FROM dead)
ORDER BY t.id
"""

#: Attempts with more than one row in the dispatch log.
DOUBLE_SQL = """
SELECT task_id, attempt, count(*) FROM pollbridge_dispatch_log GROUP BY task_id, attempt HAVING count(*) > 1
"""

#: Dispatches before the task's due time, before its awaited signal, or before a dependency completed.
EARLY_SQL = """
SELECT l.task_id, l.path, l.dispatched_at FROM pollbridge_dispatch_log l JOIN tasks t ON t.id::text = l.task_id
WHERE (t.due_at IS NOT NULL AND t.due_at > l.dispatched_at)
   OR (t.awaits_signal IS NOT NULL AND (t.signal_received_at IS NULL OR t.signal_received_at > l.dispatched_at))
   OR EXISTS (SELECT 1 FROM tasks d
              WHERE d.instance_id = t.instance_id AND t.depends_on::jsonb ? d.task_key
                AND (d.status <> 'completed' OR d.completed_at IS NULL OR d.completed_at > l.dispatched_at))
"""

#: Every worker claim increments ``attempts`` and every claim follows one dispatch: a task whose
#: attempts differ from its dispatch-log rows was dispatched outside the compare-and-set (or its log row
#: went missing). A rejected task's attempts are set to the maximum without a dispatch.
UNLOGGED_SQL = """
SELECT t.id, t.attempts, coalesce(l.n, 0) FROM tasks t
LEFT JOIN (SELECT task_id, count(*) AS n FROM pollbridge_dispatch_log GROUP BY task_id) l ON l.task_id = t.id::text
WHERE coalesce(l.n, 0) <> t.attempts
  AND t.id::text NOT IN (SELECT task_id FROM pollbridge_signals WHERE kind = 'rejection')
"""

LIVE_SQL = "SELECT count(*) FROM tasks WHERE status IN ('queued', 'running')"
UNPUBLISHED_SQL = "SELECT count(*) FROM pollbridge_outbox WHERE published_at IS NULL"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def _tail(path: Path, lines: int = 8) -> str:
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
        self.port = port or _free_port()
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
                                           f"{_tail(self.workdir / 'redis.log')}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None:
            _killpg(self.proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


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
                                        f"{_tail(self.logs[role], 3)}")
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

    def kill_all(self) -> None:
        for proc in self.all:
            _killpg(proc)
        for proc in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


@dataclass
class ChaosOptions:
    db_url: str
    workdir: Path
    seconds: float = 60.0
    seed: int | None = None
    rate: float = 2.0                 # instances seeded per second during the window
    initial_instances: int = 40
    fault_gap: tuple[float, float] = (1.0, 3.0)
    warmup: float = 3.0
    settle_timeout: float = 120.0
    retention: float = 3600.0         # the relay's retention window (bus-loss replay)
    progress_every: float = 30.0
    cli_signal_every: int = 12        # one signal in this many through `pollbridge signal`
    say: Callable[[str], None] = field(default=print)


@dataclass
class ChaosReport:
    seed: int
    window_s: float
    elapsed_s: float
    faults: Counter[str]
    fault_errors: Counter[str]
    instances: int
    tasks: int
    completed: int
    failed: int
    blocked: int
    dispatches: dict[str, int]
    lost: int
    double: int
    early: int
    unlogged: int
    unpublished: int
    dead_letters: dict[str, int]
    outbox_dead: int
    signals: dict[str, int]
    guardian_demotions: int
    latency_ms: dict[str, dict[str, float | None]]
    load: dict[str, float]
    verdict: Verdict | None
    problems: list[str]
    notes: list[str]
    unexplained: int = 0
    cli_failures: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and self.lost == self.double == self.early == self.unlogged == self.unpublished == 0

    def figure_line(self) -> str:
        faults = ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items()))
        paths = ", ".join(f"{k} {n}" for k, n in sorted(self.dispatches.items()))
        dead = ", ".join(f"{k} {n}" for k, n in sorted(self.dead_letters.items())) or "none"
        return (f"chaos figures: seed {self.seed}, {self.window_s:g} s of faults, {sum(self.faults.values())} faults "
                f"({faults}); {self.tasks} tasks in {self.instances} instances ({self.completed} completed, "
                f"{self.failed} failed, {self.blocked} blocked); {sum(self.dispatches.values())} dispatches "
                f"({paths}); lost {self.lost}, double {self.double}, early {self.early}, unlogged {self.unlogged}, "
                f"unpublished {self.unpublished}; dead letters: {dead} (every one with a reason: "
                f"{'NO' if self.unexplained else 'yes'}); "
                f"guardian demotions {self.guardian_demotions}")

    def latency_line(self) -> str:
        parts = [f"{path} p50 {_fmt(v['p50'])} / p99 {_fmt(v['p99'])} / max {_fmt(v['max'])} ms"
                 for path, v in sorted(self.latency_ms.items())]
        return "ready->dispatch under faults: " + ("; ".join(parts) or "none")

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "window_s": self.window_s, "elapsed_s": round(self.elapsed_s, 1),
            "faults": dict(self.faults), "fault_errors": dict(self.fault_errors), "instances": self.instances,
            "tasks": self.tasks, "completed": self.completed, "failed": self.failed, "blocked": self.blocked,
            "dispatches": self.dispatches, "lost": self.lost, "double": self.double, "early": self.early,
            "unlogged": self.unlogged, "unpublished": self.unpublished, "dead_letters": self.dead_letters,
            "outbox_dead": self.outbox_dead, "signals": self.signals, "guardian_demotions": self.guardian_demotions,
            "latency_ms": self.latency_ms, "load": self.load, "problems": self.problems, "notes": self.notes,
            "ok": self.ok, "figure_line": self.figure_line(), "unexplained_dead_letters": self.unexplained,
            "cli_failures_under_faults": self.cli_failures,
        }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


class Workload:
    """Seeds instances and sends the signals their tasks await (a thread each)."""

    def __init__(self, engine: Engine, tables: TaskTable, opts: ChaosOptions, fleet_env: dict[str, str],
                 workdir: Path, rng_seed: int) -> None:
        self.engine = engine
        self.tables = tables
        self.opts = opts
        self.env = fleet_env
        self.workdir = workdir
        self.rng = random.Random(rng_seed)
        self.signal_rng = random.Random(rng_seed + 1)
        self.prefix = f"c{rng_seed % 100000:05d}"
        self.instances: list[str] = []
        self.tasks = 0
        self.lock = threading.Lock()
        self.pending_signals: list[tuple[float, int, str]] = []  # (monotonic due, task id, awaited kind)
        self.signals_sent: Counter[str] = Counter()
        self.problems: list[str] = []
        self.seeding_stopped = threading.Event()
        self.flush_signals = threading.Event()
        self.stop = threading.Event()
        self._n = 0

    def spec(self) -> WorkflowSpec:
        rng = self.rng
        workflow_type = rng.choice(TYPES)
        shape = {"orders": "chain", "reports": "fanout", "etl": "diamond"}.get(workflow_type) or rng.choice(SHAPES)
        tasks = make_shape(shape, rng.randint(3, 7), rng, due_fraction=0.25, max_due=4.0)
        tasks = tuple(replace(t, awaits_signal=rng.choice(("callback", "approval"))) if rng.random() < 0.1 else t
                      for t in tasks)
        self._n += 1
        return WorkflowSpec(f"{self.prefix}-{self._n:06d}", workflow_type, tasks)

    def seed_batch(self, count: int) -> None:
        specs = [self.spec() for _ in range(count)]
        for attempt in range(20):
            try:
                with self.engine.begin() as conn:
                    added = seed(conn, self.tables, specs)
                    ids = [s.instance_id for s in specs]
                    awaiting = conn.execute(sa.text(
                        "SELECT id, awaits_signal FROM tasks WHERE instance_id = ANY(:ids) "
                        "AND awaits_signal IS NOT NULL"), {"ids": ids}).all()
                break
            except sa.exc.OperationalError:
                if attempt == 19:
                    raise
                time.sleep(0.5)
        now = time.monotonic()
        with self.lock:
            self.instances.extend(ids)
            self.tasks += added
            for task_id, kind in awaiting:
                heapq.heappush(self.pending_signals, (now + self.signal_rng.uniform(0.3, 4.0), int(task_id), str(kind)))

    def take_signal_task(self) -> int | None:
        """Hand one not yet signalled task to someone else (the long transaction records its signal)."""
        with self.lock:
            if not self.pending_signals:
                return None
            index = self.rng.randrange(len(self.pending_signals))
            _, task_id, _ = self.pending_signals.pop(index)
            heapq.heapify(self.pending_signals)
            return task_id

    def give_back(self, task_id: int) -> None:
        with self.lock:
            heapq.heappush(self.pending_signals, (time.monotonic(), task_id, "callback"))

    def seeder(self, until: float) -> None:
        try:
            interval = 0.5
            per_tick = max(self.opts.rate * interval, 0.0)
            carry = 0.0
            while not self.stop.is_set() and time.monotonic() < until:
                carry += per_tick
                count = int(carry)
                carry -= count
                if count:
                    self.seed_batch(count)
                self.stop.wait(interval)
        except Exception as exc:
            self.problems.append(f"seeder failed: {type(exc).__name__}: {exc}")
        finally:
            self.seeding_stopped.set()

    def signaller(self) -> None:
        n = 0
        while not self.stop.is_set():
            with self.lock:
                due = self.pending_signals and (self.flush_signals.is_set()
                                                or self.pending_signals[0][0] <= time.monotonic())
                item = heapq.heappop(self.pending_signals) if due else None
                done = not self.pending_signals and self.seeding_stopped.is_set()
            if item is None:
                if done and self.flush_signals.is_set():
                    return
                self.stop.wait(0.05)
                continue
            _, task_id, awaited = item
            n += 1
            kind = "rejection" if self.signal_rng.random() < 0.08 else ("approval" if awaited == "approval"
                                                                          else "callback")
            payload = json.dumps({"chaos": n, "note": "signal é ✓"}) if self.signal_rng.random() < 0.5 else None
            via_cli = self.opts.cli_signal_every > 0 and n % self.opts.cli_signal_every == 0
            try:
                self._send(task_id, kind, payload, via_cli)
                self.signals_sent[f"{kind}{' (cli)' if via_cli else ''}"] += 1
            except SignalError as exc:
                if "already received" in str(exc):
                    self.signals_sent["already received"] += 1
                else:
                    self.problems.append(f"signal for task {task_id} refused: {exc}")
            except Exception as exc:  # the database is being disturbed: try again shortly
                with self.lock:
                    heapq.heappush(self.pending_signals, (time.monotonic() + 0.5, task_id, awaited))
                self.signals_sent["retried"] += 1
                if not isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError | RuntimeError):
                    self.problems.append(f"signal for task {task_id} failed: {type(exc).__name__}: {exc}")

    def _send(self, task_id: int, kind: str, payload: str | None, via_cli: bool) -> None:
        if not via_cli:
            record_signal(self.engine, self.tables, str(task_id), kind, payload=payload, actor="chaos")
            return
        args = [shutil.which("pollbridge") or "pollbridge", "signal", str(task_id), "--kind", kind, "--actor", "chaos"]
        if payload is not None:
            args += ["--payload", payload]
        done = subprocess.run(args, cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=120)
        if done.returncode == 2 and "already received" in done.stderr:
            raise SignalError(done.stderr.strip())
        if done.returncode != 0:
            if classify_cli_failure(done.returncode, done.stderr) is None:
                self.problems.append(f"`pollbridge signal {task_id}` exited {done.returncode}: "
                                     f"{done.stderr.strip()[-500:]}")
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")


class Chaos:
    def __init__(self, opts: ChaosOptions) -> None:
        self.opts = opts
        self.seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(1, 10**9)
        self.rng = random.Random(self.seed)
        self.t0 = time.monotonic()
        self.workdir = opts.workdir
        self.faults: Counter[str] = Counter()
        self.fault_errors: Counter[str] = Counter()
        self.data_losses: list[float] = []
        self.malformed: list[tuple[str, float]] = []  # (marker, injected at)
        self.benign: list[str] = []  # well-formed events about nothing: acknowledged, never dead letters
        self.outbox_garbage = 0
        self.notes: list[str] = []
        self.problems: list[str] = []
        self.long_txn: threading.Thread | None = None
        self.pending: list[tuple[float, Callable[[], None]]] = []  # restarts due after a fault's downtime
        self.cli_busy = threading.Event()
        self.cli_thread: threading.Thread | None = None
        self.load_samples: list[float] = []
        self.redis = PrivateRedis(self.workdir)

    # --- output ------------------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        self.opts.say(f"[{time.monotonic() - self.t0:7.1f}s] {message}")

    # --- the run -------------------------------------------------------------------------------------------
    def run(self) -> ChaosReport:
        opts = self.opts
        self.say(f"chaos: seed {self.seed} (set it again to replay the fault schedule), {opts.seconds:g} s of "
                 f"faults, logs in {self.workdir}")
        (self.workdir / "pollbridge.toml").write_text(CONFIG.format(
            namespace=NAMESPACE, partitions=PARTITIONS, retention=opts.retention))
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
        env.update({"POLLBRIDGE_DATABASE_URL": opts.db_url, "POLLBRIDGE_BUS_URL": self.redis.url,
                    "POLLBRIDGE_LOG_LEVEL": "INFO", "POLLBRIDGE_ACTOR": "chaos"})
        self.env = env
        sep = "&" if "?" in opts.db_url else "?"
        self.engine = create_engine(f"{opts.db_url}{sep}application_name={HARNESS_APP}")
        self.fleet = Fleet(self.workdir, env, self.say)
        threads: list[threading.Thread] = []
        workload: Workload | None = None
        try:
            self.redis.start()
            self.tables = reflect_tables(self.engine, TaskTableMapping())
            store = FlagStore(self.engine)
            for workflow_type, phase, percent in (("orders", "cutover", None), ("reports", "selective", 50.0),
                                                  ("etl", "dual_write", None), ("billing", "polling", None)):
                store.change(workflow_type, phase, actor="chaos", reason="chaos: initial phases", percent=percent,
                             forced=True)
            workload = self.workload = Workload(self.engine, self.tables, opts, env, self.workdir, self.seed)
            for role in ROLES:
                self.fleet.start(role)
            self.fleet.wait_ready(list(ROLES))
            self.fleet.ensure_all_up()
            self.say("fleet up: " + ", ".join(f"{r} pid {p.pid}" for r, p in self.fleet.procs.items()))
            workload.seed_batch(opts.initial_instances)
            started = time.monotonic()
            window_end = started + opts.warmup + opts.seconds
            threads = [threading.Thread(target=workload.seeder, args=(window_end,), name="chaos-seeder",
                                        daemon=True),
                       threading.Thread(target=workload.signaller, name="chaos-signaller", daemon=True)]
            for t in threads:
                t.start()
            self._fault_loop(started + opts.warmup, window_end)
            self._recover()
            settled = self._settle()
            codes = self.fleet.stop_all()
            for role, code in codes.items():
                if self.fleet.procs[role].pid not in self.fleet.killed and code != 0:
                    self.problems.append(f"{role} exited with {code} on SIGTERM: {_tail(self.fleet.logs[role], 5)}")
            workload.stop.set()
            for t in threads:
                t.join(30)
            return self._check(settled, time.monotonic() - started)
        finally:
            if workload is not None:
                workload.stop.set()
            self.fleet.kill_all()
            self.redis.kill()
            if self.long_txn is not None:
                self.long_txn.join(15)
            self.engine.dispose()

    def _fault_loop(self, first: float, end: float) -> None:
        """Inject faults until ``end``. Nothing here waits for a process to come back: restarts are
        queued (:meth:`_run_due`) and CLI faults run on a thread, so faults keep coming at their pace
        even when starting a Python process takes seconds on a loaded machine."""
        schedule = list(KINDS)
        self.rng.shuffle(schedule)
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        next_progress = time.monotonic() + self.opts.progress_every
        wait_until = first
        while True:
            while time.monotonic() < wait_until:
                self._run_due()
                self.fleet.supervise()
                time.sleep(0.05)
            if time.monotonic() >= end:
                return
            kind = schedule.pop(0) if schedule else self.rng.choices(kinds, weights)[0]
            try:
                detail = self._inject(kind)
                self.faults[kind] += 1
                self.say(f"fault {kind}: {detail}")
            except Exception as exc:
                self.fault_errors[kind] += 1
                self.say(f"fault {kind} could not be injected now ({type(exc).__name__}: {exc}); later again")
                if kind not in self.faults:
                    schedule.append(kind)  # every kind is injected at least once
            self._run_due()
            self.fleet.supervise()
            self.load_samples.append(os.getloadavg()[0])
            if time.monotonic() >= next_progress:
                next_progress = time.monotonic() + self.opts.progress_every
                self.say(self._progress())
            wait_until = time.monotonic() + self.rng.uniform(*self.opts.fault_gap)

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        self.pending.append((time.monotonic() + delay, action))

    def _run_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        due = [a for a in self.pending if everything or a[0] <= now]
        self.pending = [a for a in self.pending if a not in due]
        for _, action in sorted(due, key=lambda a: a[0]):
            try:
                action()
            except Exception as exc:
                self.problems.append(f"restart after a fault failed: {type(exc).__name__}: {exc}")

    def _progress(self) -> str:
        with self.engine.connect() as conn:
            by_path = {str(k): int(v) for k, v in conn.execute(
                sa.select(dispatch_log.c.path, sa.func.count()).group_by(dispatch_log.c.path)).all()}
            unpublished = conn.execute(sa.text(UNPUBLISHED_SQL)).scalar_one()
        return (f"progress: {sum(self.faults.values())} faults, {self.workload.tasks} tasks seeded, dispatches "
                f"{dict(sorted(by_path.items()))}, {unpublished} outbox rows unpublished, "
                f"load {os.getloadavg()[0]:.1f}")

    # --- faults ----------------------------------------------------------------------------------------
    def _inject(self, kind: str) -> str:
        family, _, what = kind.partition(":")
        if family == "kill":
            return self._kill(what)
        handler: Callable[[], str] = {
            "redis:flushall": self._flushall, "redis:restart": self._redis_restart, "pg:terminate": self._terminate,
            "pg:long_transaction": self._long_transaction, "bus:duplicate": self._duplicate,
            "bus:malformed": self._malformed, "flags:flip": self._flip, "flags:rollback": self._rollback,
        }[kind]
        return handler()

    def _kill(self, what: str) -> str:
        roles = [r for r in ROLES if r == what or r.startswith(what + "-")]
        if len(roles) > 1 and self.rng.random() >= 0.25:
            roles = [self.rng.choice(roles)]
        downtime = self.rng.uniform(0.0, 3.0)
        pids = [self.fleet.kill(r) for r in roles]
        for r in roles:
            self._later(downtime, lambda r=r: self.fleet.start(r))  # type: ignore[misc]
        return f"SIGKILL {', '.join(f'{r} (pid {p})' for r, p in zip(roles, pids, strict=True))}, " \
               f"restarted in {downtime:.1f} s"

    def _flushall(self) -> str:
        client = self.redis.client()
        try:
            keys = client.dbsize()
            client.flushall()
        finally:
            client.close()
        self.data_losses.append(time.monotonic())
        return f"{keys} keys gone"

    def _redis_restart(self) -> str:
        if not self.redis.running:
            raise RuntimeError("redis-server is down already")
        downtime = self.rng.uniform(0.5, 3.0)
        self.redis.kill()
        self.data_losses.append(time.monotonic())
        self._later(downtime, self.redis.start)
        return f"redis-server killed, started again empty in {downtime:.1f} s"

    def _terminate(self) -> str:
        with self.engine.connect() as conn:
            killed = conn.execute(sa.text(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                "AND coalesce(application_name, '') NOT LIKE :harness"), {"harness": f"{HARNESS_APP}%"}).scalar_one()
            conn.commit()
        return f"{killed} backend(s) of pollbridge's processes terminated"

    def _long_transaction(self) -> str:
        if self.long_txn is not None and self.long_txn.is_alive():
            self.long_txn.join(10)
        hold = self.rng.uniform(2.0, 6.0)
        rows = self.rng.randint(5, 30)
        signal_task = self.workload.take_signal_task()
        ready = threading.Event()
        info: dict[str, Any] = {}

        def body() -> None:
            url = make_url(self.opts.db_url).set(drivername="postgresql")
            try:
                with psycopg.connect(url.render_as_string(hide_password=False), connect_timeout=10,
                                     application_name=f"{HARNESS_APP}-lock") as conn:
                    locked = conn.execute(
                        "SELECT id FROM tasks WHERE status IN ('pending', 'queued', 'running') "
                        "ORDER BY random() LIMIT %s FOR UPDATE", (rows,)).fetchall()
                    info["locked"] = len(locked)
                    if signal_task is not None:
                        # A signal recorded by the legacy side in this long transaction: its outbox row gets
                        # its id now and commits seconds later, after many larger ids were published.
                        info["signalled"] = conn.execute(
                            "UPDATE tasks SET signal_received_at = clock_timestamp(), updated_at = clock_timestamp() "
                            "WHERE id = %s AND status = 'pending' AND signal_received_at IS NULL",
                            (signal_task,)).rowcount
                    ready.set()
                    time.sleep(hold)
                info["committed"] = True
            except Exception as exc:
                info["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                ready.set()
                if signal_task is not None and not (info.get("committed") and info.get("signalled")):
                    self.workload.give_back(signal_task)  # not recorded here: the signaller sends it

        self.long_txn = threading.Thread(target=body, name="chaos-long-transaction", daemon=True)
        self.long_txn.start()
        ready.wait(30)
        if "error" in info:
            raise RuntimeError(info["error"])
        extra = f", signal of task {signal_task} recorded in it" if info.get("signalled") else ""
        return f"{info.get('locked', 0)} task rows locked for {hold:.1f} s{extra}"

    def _duplicate(self) -> str:
        client = self.redis.client()
        try:
            partition = self.rng.randrange(PARTITIONS)
            stream = f"{NAMESPACE}:events:{{{NAMESPACE}:p{partition}}}"
            stale = self.rng.random() < 0.3
            count = self.rng.randint(5, 40)
            entries = client.xrange(stream, count=count) if stale else client.xrevrange(stream, count=count)
            picked = [fields for _, fields in entries if b"payload" in fields]
            # Each entry once or twice, in a shuffled order.
            picked += [f for f in picked if self.rng.random() < 0.5]
            self.rng.shuffle(picked)
            pipe = client.pipeline(transaction=False)
            for fields in picked:
                pipe.xadd(stream, fields)
            pipe.execute()
        finally:
            client.close()
        return f"{len(picked)} {'oldest' if stale else 'recent'} entries of partition {partition} added again, shuffled"

    def _malformed(self, final: bool = False) -> str:
        client = self.redis.client()
        made: list[str] = []
        try:
            pipe = client.pipeline(transaction=False)
            for n in range(self.rng.randint(1, 4) + (2 if final else 0)):
                marker = f"chaos-malformed-{uuid.uuid4().hex[:12]}"
                partition = self.rng.randrange(PARTITIONS)
                stream = f"{NAMESPACE}:events:{{{NAMESPACE}:p{partition}}}"
                variant, fields = self._malformed_entry(marker, harmful=final and n < 2)
                pipe.xadd(stream, fields)
                made.append(variant)
                if variant in BENIGN:
                    self.benign.append(marker)
                else:
                    self.malformed.append((marker, time.monotonic()))
            pipe.execute()
        finally:
            client.close()
        if self.rng.random() < 0.3:  # and an outbox row the relay cannot turn into an event
            with self.engine.begin() as conn:
                conn.execute(sa.text(
                    "INSERT INTO pollbridge_outbox (event_id, task_id, instance_id, task_key, change, old_status, "
                    "new_status, created_at, relay_partition) VALUES (:e, NULL, 'chaos-ghost', 'k', 'status', "
                    "'pending', 'no-such-status', clock_timestamp(), 0)"), {"e": str(uuid.uuid4())})
            self.outbox_garbage += 1
            made.append("unpublishable outbox row")
        return ", ".join(made)

    def _malformed_entry(self, marker: str, harmful: bool = False) -> tuple[str, dict[str, Any]]:
        instance = self.rng.choice(self.workload.instances) if self.workload.instances else "none"
        base = {"specversion": "1.0", "id": marker, "source": "chaos", "type": "task.status_changed",
                "subject": "1", "time": "2024-01-01T00:00:00Z", "partitionkey": instance, "data": {}}
        variants: list[tuple[str, dict[str, Any]]] = [
            ("no payload field", {"id": marker, "junk": "x"}),
            ("not UTF-8", {"id": marker, "payload": b"\xff\xfe\xfa" + marker.encode()}),
            ("not JSON", {"id": marker, "payload": "{not json " + marker}),
            ("JSON array", {"id": marker, "payload": json.dumps([marker])}),
            ("missing attributes", {"id": marker, "payload": json.dumps({"specversion": "1.0", "id": marker})}),
            ("wrong specversion", {"id": marker, "payload": json.dumps({**base, "specversion": "0.3"})}),
            ("bad time", {"id": marker, "payload": json.dumps({**base, "time": "yesterday"})}),
            ("negative depth", {"id": marker, "payload": json.dumps({**base, "depth": -1})}),
            ("data not an object", {"id": marker, "payload": json.dumps({**base, "data": [1, 2]})}),
            ("unknown instance", {"id": marker, "payload": json.dumps({**base, "partitionkey": f"ghost-{marker}"})}),
            ("garbage data", {"id": marker, "payload": json.dumps(
                {**base, "data": {"task_key": 12, "change": "status", "new_status": None, "workflow_type": []}})}),
        ]
        return self.rng.choice([v for v in variants if v[0] not in BENIGN] if harmful else variants)

    def _cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.fleet.exe, *args], cwd=self.workdir, env=self.env, capture_output=True,
                              text=True, timeout=120)

    def _cli_fault(self, kind: str, args: list[str]) -> str:
        """Run a ``pollbridge`` command on the CLI thread (starting Python takes seconds under load); its
        outcome is printed when it finished (see :func:`classify_cli_failure` for a failed one)."""
        if self.cli_busy.is_set():
            raise RuntimeError("the previous flag command is still running")
        self.cli_busy.set()

        def body() -> None:
            try:
                done = self._cli(*args)
                if done.returncode != 0 and classify_cli_failure(done.returncode, done.stderr) is None:
                    self.problems.append(f"`pollbridge {' '.join(args)}` exited {done.returncode}: "
                                         f"{done.stderr.strip()[-400:]}")
                out = "; ".join(done.stdout.strip().splitlines()) or done.stderr.strip().splitlines()[-1:]
                self.say(f"  {kind} done (exit {done.returncode}): {out}")
            except Exception as exc:
                self.problems.append(f"`pollbridge {' '.join(args)}` failed: {type(exc).__name__}: {exc}")
            finally:
                self.cli_busy.clear()

        self.cli_thread = threading.Thread(target=body, name="chaos-cli", daemon=True)
        self.cli_thread.start()
        return "pollbridge " + " ".join(args)

    def _flip(self) -> str:
        workflow_type = self.rng.choice(TYPES)
        # Mostly towards the event path: rollbacks and the guardian pull the other way.
        phase = self.rng.choices(PHASES, (1, 1, 2, 3))[0]
        args = ["flags", "set", workflow_type, phase, "--force", "--reason", "chaos", "--actor", "chaos"]
        if phase == "selective" and self.rng.random() < 0.6:
            args += ["--percent", self.rng.choice(("10", "50", "90", "33.33"))]
        return self._cli_fault("flags:flip", args)

    def _rollback(self) -> str:
        target = ["--all"] if self.rng.random() < 0.3 else [self.rng.choice(TYPES)]
        return self._cli_fault("flags:rollback", ["rollback", *target, "--reason", "chaos rollback",
                                                  "--actor", "chaos"])

    # --- the end -----------------------------------------------------------------------------------------
    def _recover(self) -> None:
        self.say("fault window over: every process back, remaining signals sent")
        self._run_due(everything=True)
        if self.cli_thread is not None:
            self.cli_thread.join(120)
        if not self.redis.running:
            self.redis.start()
        if self.long_txn is not None:
            self.long_txn.join(15)
        self.fleet.ensure_all_up()
        self.workload.seeding_stopped.wait(30)
        self.workload.flush_signals.set()
        # One more round of bad and repeated entries after the last data loss, so the dead-letter and
        # duplicate checks always have something to check.
        final: list[tuple[str, Callable[[], str]]] = [("bus:malformed", lambda: self._malformed(final=True)),
                                                      ("bus:duplicate", self._duplicate)]
        for kind, inject in final:
            try:
                detail = inject()
                self.faults[kind] += 1
                self.say(f"fault {kind} (after the window): {detail}")
            except Exception as exc:
                self.problems.append(f"the final {kind} could not be injected: {type(exc).__name__}: {exc}")

    def _settle(self) -> bool:
        deadline = time.monotonic() + self.opts.settle_timeout
        next_say = time.monotonic() + 10
        while True:
            self.fleet.supervise()
            with self.engine.connect() as conn:
                unsettled = conn.execute(sa.text(UNSETTLED_SQL)).all()
                live = conn.execute(sa.text(LIVE_SQL)).scalar_one()
                unpublished = conn.execute(sa.text(UNPUBLISHED_SQL)).scalar_one()
            with self.workload.lock:
                signals_left = len(self.workload.pending_signals)
            if not unsettled and not live and not unpublished and not signals_left:
                self.say("settled: every task finished, every outbox row published")
                return True
            now = time.monotonic()
            if now > deadline:
                sample = ", ".join(f"{r.id} ({r.instance_id}/{r.task_key} {r.status}, attempts {r.attempts})"
                                   for r in unsettled[:10])
                self.problems.append(f"not settled after {self.opts.settle_timeout:g} s: {len(unsettled)} task(s) "
                                     f"unsettled ({sample}), {live} queued/running, {unpublished} unpublished, "
                                     f"{signals_left} signals unsent")
                return False
            if now >= next_say:
                next_say = now + 10
                self.say(f"settling: {len(unsettled)} unsettled, {live} queued/running, {unpublished} unpublished, "
                         f"{signals_left} signals to send")
            time.sleep(0.5)

    def _dead_letters(self) -> list[dict[str, Any]]:
        done = self._cli("dlq", "list", "--json", "--limit", "100000")
        if done.returncode != 0:
            self.problems.append(f"`pollbridge dlq list` exited {done.returncode}: {done.stderr.strip()[-300:]}")
            return []
        letters: list[dict[str, Any]] = json.loads(done.stdout)
        return letters

    def _check(self, settled: bool, elapsed: float) -> ChaosReport:
        problems = self.problems + self.workload.problems
        problems += [f"crash: {c}" for c in self.fleet.crashes]
        with self.engine.connect() as conn:
            unsettled = conn.execute(sa.text(UNSETTLED_SQL)).all()
            double = conn.execute(sa.text(DOUBLE_SQL)).all()
            early = conn.execute(sa.text(EARLY_SQL)).all()
            unlogged = conn.execute(sa.text(UNLOGGED_SQL)).all()
            unpublished = int(conn.execute(sa.text(UNPUBLISHED_SQL)).scalar_one())
            by_path = {str(k): int(v) for k, v in conn.execute(sa.text(
                "SELECT path, count(*) FROM pollbridge_dispatch_log GROUP BY path")).all()}
            outbox_dead = conn.execute(sa.text("SELECT reason FROM pollbridge_outbox_dead")).scalars().all()
            blank_audit = int(conn.execute(sa.text(
                "SELECT count(*) FROM pollbridge_flag_audit WHERE trim(actor) = '' OR trim(reason) = ''")).scalar_one())
            demotions = int(conn.execute(sa.text(
                "SELECT count(*) FROM pollbridge_flag_audit WHERE action = 'guardian'")).scalar_one())
            verdict = verify(conn, self.tables, self.workload.instances)
        for row in double[:10]:
            problems.append(f"task {row[0]} attempt {row[1]} dispatched {row[2]} times")
        for row in early[:10]:
            problems.append(f"task {row[0]} dispatched early by {row[1]} at {row[2]}")
        for row in unlogged[:10]:
            problems.append(f"task {row[0]}: {row[1]} attempts but {row[2]} dispatch-log rows")
        if unpublished:
            problems.append(f"{unpublished} outbox row(s) never published")
        if blank_audit:
            problems.append(f"{blank_audit} flag change(s) without an actor or a reason")
        # The independent check must agree with the SQL one.
        if (verdict.lost, verdict.double_dispatched, verdict.early) != (len(unsettled), len(double), len(early)):
            problems.append(f"bridge.reference.oracle disagrees with the SQL checks: verify lost/double/early "
                            f"{verdict.lost}/{verdict.double_dispatched}/{verdict.early}, SQL "
                            f"{len(unsettled)}/{len(double)}/{len(early)}")
        problems += [f"verify: {p}" for p in verdict.problems[:10]]
        if not settled and not unsettled:
            problems.append("the run did not settle (see above)")

        # Dead letters: every one has a reason; every malformed entry is one, unless Redis lost it later.
        letters = self._dead_letters()
        kinds: Counter[str] = Counter()
        markers = {m for m, _ in self.malformed}
        found: set[str] = set()
        unexplained = 0
        for letter in letters:
            reason = str(letter.get("reason") or "").strip()
            payload = str(letter.get("payload") or "")
            if not reason:
                unexplained += 1
                problems.append(f"dead letter {letter.get('id')} has no reason: {payload[:200]}")
            mine = next((m for m in markers if m in payload), None)
            if any(m in payload for m in self.benign):
                problems.append(f"a well-formed event was dead-lettered ({reason}): {payload[:200]}")
            if mine is not None:
                found.add(mine)
                kinds["malformed"] += 1
            else:
                kinds[reason.split(":")[0][:40] or "no reason"] += 1
        for marker, at in self.malformed:
            if marker not in found and not any(loss > at for loss in self.data_losses):
                problems.append(f"malformed entry {marker} was not dead-lettered")
        if len(outbox_dead) != self.outbox_garbage:
            problems.append(f"{self.outbox_garbage} unpublishable outbox row(s) injected, {len(outbox_dead)} set "
                            "aside by the relay")
        if any(not str(r or "").strip() for r in outbox_dead):
            unexplained += sum(1 for r in outbox_dead if not str(r or "").strip())
            problems.append("an outbox dead letter has no reason")
        if outbox_dead:
            kinds["outbox (relay)"] = len(outbox_dead)

        latency: dict[str, dict[str, float | None]] = {}
        for path, values in verdict.latencies_ms.items():
            latency[path] = {"p50": percentile(values, 50), "p99": percentile(values, 99),
                             "max": max(values) if values else None}
        if self.fleet.start_failures:
            self.notes.append("starts that failed (restarted like a service manager would): "
                              + "; ".join(self.fleet.failure_lines[:5]))
        if self.fault_errors:
            self.notes.append(f"faults that could not be injected: {dict(self.fault_errors)}")
        cli_failures = dict(CLI_FAILURES)
        CLI_FAILURES.clear()
        if cli_failures:
            self.notes.append(f"pollbridge commands (flag changes, signals) a fault cut, exit 1, nothing changed: "
                              f"{cli_failures} ('traceback' and 'missing table' are known bugs)")
        loads = self.load_samples or [os.getloadavg()[0]]
        return ChaosReport(
            seed=self.seed, window_s=self.opts.seconds, elapsed_s=elapsed, faults=self.faults,
            fault_errors=self.fault_errors, instances=len(self.workload.instances), tasks=verdict.tasks,
            completed=verdict.completed, failed=verdict.failed, blocked=verdict.blocked, dispatches=by_path,
            lost=len(unsettled), double=len(double), early=len(early), unlogged=len(unlogged),
            unpublished=unpublished, dead_letters=dict(kinds), outbox_dead=len(outbox_dead),
            signals=dict(self.workload.signals_sent), guardian_demotions=demotions, latency_ms=latency,
            load={"mean": round(sum(loads) / len(loads), 2), "max": round(max(loads), 2)},
            verdict=verdict, problems=problems, notes=self.notes, unexplained=unexplained,
            cli_failures=cli_failures,
        )


def run_chaos(opts: ChaosOptions) -> ChaosReport:
    """Run the whole scenario (see the module docstring); every process it started is gone when it returns."""
    chaos = Chaos(opts)
    try:
        return chaos.run()
    except BaseException:
        chaos.say("chaos run failed:\n" + traceback.format_exc())
        raise


def new_workdir(base: Path | None = None) -> Path:
    """A directory for one run's logs and configuration (kept: the logs explain a failure)."""
    return Path(tempfile.mkdtemp(prefix="pollbridge-chaos-", dir=base))


def log_tails(path: Path, lines: int = 15) -> str:
    return "\n".join(f"--- {p.name}\n{_tail(p, lines)}" for p in sorted(path.glob("*.log")))


__all__ = ["KINDS", "ChaosOptions", "ChaosReport", "log_tails", "new_workdir", "run_chaos"]
