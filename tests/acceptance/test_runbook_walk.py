"""The acceptance test of the toolkit: a scripted walk through every runbook, on PostgreSQL and Redis.

The walk executes every ``$ `` command of ``runbooks/01`` … ``runbooks/06``, in order (the runbook
format and its parser are in ``tests/unit/test_runbooks.py``):

* ``$ export NAME=value`` sets the variable to the test's value (the database, the bus, the workflow
  type; ``TASK_ID`` from a task the fallback dispatched), whatever example value the runbook shows;
* ``$ pollbridge … &`` starts the service as a background process (stderr to a file), and waits for its
  start-up line;
* every other ``$ pollbridge …`` command runs through the real CLI entry point and must exit with the
  code the runbook gives (``# exit N``, 0 otherwise); ``# until exit 0`` commands are repeated until
  they pass. By default these short commands run in this process (``click``'s runner: the same entry
  point without a Python start-up each); ``POLLBRIDGE_WALK_SUBPROCESS=1`` runs them as processes;
* the runbook's expected output is held against the real one where it is stable: every
  ``[ok|pass|FAIL] name:`` line (doctor, preflight, gates) must show the same verdict for that name, and
  every ``old -> new`` transition line (``flags set``, ``rollback``, ``preflight``'s header) the same
  phases;
* other commands (the capture benchmark) are not run.

While the walk runs, traffic flows: a thread seeds instances of the migrated type (and of a second
type that stays in ``polling``) every few hundred milliseconds, executed by the runbook's poller or
scheduler and the demo workers. Before each incident of ``06-incidents`` the fault named by its
``Fault:`` line is injected for real (the relay SIGKILLed, the namespace's Redis keys deleted,
PostgreSQL connections terminated, malformed entries on the bus, the scheduler paused until the sweep
caught its tasks, the flag table made unreadable, the scheduler killed over and over). A fault the
operator cannot remove with a pollbridge command (the flag table) is removed just before the
incident's ``Fix`` step. After each runbook and each incident every instance seeded so far must settle
with nothing lost, dispatched twice or early (:func:`bridge.reference.oracle.verify`).

Thresholds are small (``pollbridge.toml`` below) so the gates pass on real evidence within seconds. The demo
workers stand for the platform's: one whose connection is terminated while it reports a result leaves its task
``running`` (as a real worker that dies would), so the configuration sets a ``running_timeout`` that fails such a
task for a retry, as a platform's own timeout would (see ``docs/reliability.md`` and incident 6.3).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count, groupby
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Engine

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.db.schema import dispatch_log, outbox
from bridge.reference.oracle import verify
from bridge.reference.schema import create_demo_schema
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import TaskTable, reflect_tables
from tests.support import wait_for

TYPE = "payments"          # the type the walk migrates (the runbooks' examples say orders)
OTHER = "reports"          # a type that stays in polling the whole time
PARTITIONS = 4
UNTIL_TIMEOUT = 120.0      # seconds a `# until exit 0` command may take to pass
SETTLE_TIMEOUT = 120.0

CONFIG = """\
[bus]
namespace = "{namespace}"
partitions = {partitions}
visibility_timeout = 2
[relay]
lease_timeout = 1.0
retention = 60
purge_interval = 2.0
[scheduler]
lease_ttl = 2.0
claim_interval = 0.5
block = 0.2
[scheduler.defaults]
running_timeout = 15       # the platform's timeout for a task its worker stranded (see incident 6.3)
[poller]
interval = 2.0
[workers]
concurrency = 4
min_duration = 0.005
max_duration = 0.02
[router]
refresh_interval = 0.5
grace = 1.5
sweep_interval = 2.0
[gates]
window = 900
min_tasks = 15
miss_budget = 0.5
tolerance = 3.0
[guardian]
interval = 1.0
max_outbox_age = 120
max_lag = 1000000
min_tasks = 1000000
[preflight]
max_backlog_age = 5.0
max_lag = 300
heartbeat_timeouts = 2.0
"""

READY = {"relay": "relay partition", "scheduler": "scheduler ", "poller": "poller ", "workers": "workers on",
         "guardian": "guardian checking"}


def _runbook_format() -> ModuleType:
    """The runbook parser of ``tests/unit/test_runbooks.py`` (one definition of the format)."""
    path = Path(__file__).resolve().parents[1] / "unit" / "test_runbooks.py"
    spec = importlib.util.spec_from_file_location("pollbridge_runbook_format", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


# --- traffic -------------------------------------------------------------------------------------------

class Traffic:
    """Seeds a small chain of tasks for ``TYPE`` every ``period`` seconds (and one for ``OTHER`` every fourth
    time) until stopped; survives database outages (an instance whose insert failed is simply not counted)."""

    def __init__(self, engine: Engine, tables: TaskTable, period: float = 0.4) -> None:
        self.engine = engine
        self.tables = tables
        self.period = period
        self.ids: dict[str, list[str]] = {TYPE: [], OTHER: []}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="walk-traffic", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        n = count()
        while not self._stop.wait(self.period):
            k = next(n)
            specs = [WorkflowSpec(f"walk-{k:05d}", TYPE, (TaskSpec("a"), TaskSpec("b", ("a",)), TaskSpec("c", ("b",))))]
            if k % 4 == 0:
                specs.append(WorkflowSpec(f"walk-{k:05d}-r", OTHER, (TaskSpec("a"), TaskSpec("b", ("a",)))))
            try:
                with self.engine.begin() as conn:
                    seed(conn, self.tables, specs)
            except Exception:  # an injected database fault: this instance was not created
                self.errors += 1
                continue
            with self._lock:
                for s in specs:
                    self.ids[s.workflow_type].append(s.instance_id)

    def snapshot(self) -> list[str]:
        with self._lock:
            return [i for ids in self.ids.values() for i in ids]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


# --- the walk ------------------------------------------------------------------------------------------

@dataclass
class Walk:
    cwd: Path
    values: dict[str, str]                      # the test's value of each runbook variable
    engine: Engine
    tables: TaskTable
    namespace: str
    redis_url: str
    admin_url: str
    dbname: str
    fmt: ModuleType
    traffic: Traffic
    variables: dict[str, str] = field(default_factory=dict)  # exported so far
    services: dict[str, list[subprocess.Popen[bytes]]] = field(default_factory=dict)
    killed: set[int] = field(default_factory=set)
    starting: list[tuple[subprocess.Popen[bytes], Path, list[str]]] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)
    started: int = 0
    commands_run: int = 0
    subprocess_mode: bool = os.environ.get("POLLBRIDGE_WALK_SUBPROCESS") == "1"
    exe: str = field(default_factory=lambda: shutil.which("pollbridge") or "")
    t0: float = field(default_factory=time.monotonic)

    # -- environment ---------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
        base.update({k: v for k, v in self.variables.items() if k.startswith("POLLBRIDGE_")})
        return base

    def log(self, text: str) -> None:
        self.transcript.append(f"[{time.monotonic() - self.t0:6.1f} s] {text}")

    # -- commands ------------------------------------------------------------------------------------
    def execute(self, step: Any, command: Any) -> None:
        if command.background:
            self.start_service(shlex.split(self.fmt.expand(command.text, self.variables)))
            return
        if command.export:
            name, _example = command.export
            self.variables[name] = self.value_of(name)
            self.log(f"$ export {name}={self.variables[name]}")
            return
        self.await_services()
        if not command.is_pollbridge:
            self.log(f"$ {command.text}   [not run by the walk: {self.fmt.EXTERNAL[command.text.split(' --')[0]]}]")
            return
        words = shlex.split(self.fmt.expand(command.text, self.variables))
        deadline = time.monotonic() + UNTIL_TIMEOUT
        while True:
            code, output = self.run_cli(words)
            self.commands_run += 1
            self.log(f"$ {' '.join(words)}  -> exit {code}\n{output.rstrip()}")
            if not command.until_ok or code == 0 or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert code == command.exit_code, (f"{step.name}: `{command.text}` exited {code}, the runbook says "
                                           f"{command.exit_code}:\n{output}")
        self.compare(step, command, output)

    def run_cli(self, words: list[str]) -> tuple[int, str]:
        assert words[0] == "pollbridge"
        if self.subprocess_mode:
            done = subprocess.run([self.exe, *words[1:]], cwd=self.cwd, env=self.env(), capture_output=True,
                                  text=True, timeout=120)
            assert "Traceback" not in done.stderr, done.stderr
            return done.returncode, done.stdout + done.stderr
        from bridge.cli.main import cli

        env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("POLLBRIDGE_")}
        env.update({k: v for k, v in self.variables.items() if k.startswith("POLLBRIDGE_")})
        result = CliRunner().invoke(cli, words[1:], env=env, prog_name="pollbridge", catch_exceptions=True)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            import traceback

            trace = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info else ""
            raise AssertionError(f"`{' '.join(words)}` raised:\n{trace}")
        return result.exit_code, result.stdout + result.stderr

    def compare(self, step: Any, command: Any, output: str) -> None:
        """The runbook's expected output against the real one, where it is stable (see the module docstring)."""
        import re

        actual = output.splitlines()
        verdict = re.compile(r"^\s*\[(ok|pass|FAIL)\] ([a-z_]+):")
        change = re.compile(r"^(?:preflight )?\S+: (.+? -> .+?)(?: \(forced\))?(?: by .*| \(rollback by .*)?$")
        for line in command.output:
            if m := verdict.match(line):
                wanted = f"[{m.group(1)}] {m.group(2)}:"
                assert any(a.strip().startswith(wanted) for a in actual), \
                    f"{step.name}: `{command.text}` should print a line starting {wanted!r}:\n{output}"
            elif (m := change.match(line)) and "->" in line and not line.startswith("gate "):
                wanted = m.group(1)
                assert any((n := change.match(a)) and n.group(1) == wanted for a in actual), \
                    f"{step.name}: `{command.text}` should show {wanted!r}:\n{output}"

    def start_service(self, words: list[str], *, wait: bool = False) -> subprocess.Popen[bytes]:
        """Start a service. Services started one after the other come up together (as an operator starts
        them): the walk waits for their start-up lines before the next command that is not a service."""
        name = words[1]
        self.started += 1
        log = self.cwd / f"{self.started:02d}-{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([self.exe, *words[1:]], cwd=self.cwd, env=self.env(), stdout=subprocess.DEVNULL,
                                    stderr=out)
        self.services.setdefault(name, []).append(proc)
        self.starting.append((proc, log, words))
        self.log(f"$ {' '.join(words)} &   [pid {proc.pid}, stderr in {log.name}]")
        if wait:
            self.await_services()
        return proc

    def await_services(self) -> None:
        while self.starting:
            proc, log, words = self.starting.pop(0)
            name = words[1]
            wait_for(_ready_check(proc, log, READY[name]), 90, what=f"`{' '.join(words)}` to start")
            assert proc.poll() is None, f"`{' '.join(words)}` exited:\n{log.read_text(errors='replace')}"
            if name == "workers":
                self.traffic.start()  # the platform runs: traffic flows from now on

    def value_of(self, name: str) -> str:
        if name == "TASK_ID":
            dl = dispatch_log.c
            with self.engine.connect() as conn:
                task_id = conn.execute(sa.select(dl.task_id).where(dl.workflow_type == TYPE, dl.path == "fallback")
                                       .order_by(dl.id.desc()).limit(1)).scalar()
            assert task_id is not None, "no task was dispatched by the fallback: the misses incident did not happen"
            return str(task_id)
        return self.values[name]

    def live(self, name: str) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.services.get(name, []) if p.poll() is None]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        procs = self.live(name)
        assert procs, f"no {name} process is running"
        for proc in procs:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait(10)
                self.killed.add(proc.pid)

    # -- checks --------------------------------------------------------------------------------------
    def settle(self, after: str) -> None:
        """Every instance seeded so far finishes, with nothing lost, doubled or early."""
        ids = self.traffic.snapshot()
        if not ids:
            return

        def settled() -> bool:
            with self.engine.connect() as conn:
                return verify(conn, self.tables, ids).unsettled == 0
        try:
            wait_for(settled, SETTLE_TIMEOUT, interval=0.3, what=f"every instance to settle after {after}")
        finally:
            with self.engine.connect() as conn:
                verdict = verify(conn, self.tables, ids)
            self.log(f"--- after {after}: {verdict.tasks} tasks, {verdict.completed} completed, lost "
                     f"{verdict.lost}, double {verdict.double_dispatched}, early {verdict.early}")
        assert verdict.lost == 0 and verdict.completed == verdict.tasks, (after, verdict, self.unsettled(ids))
        assert verdict.double_dispatched == 0, (after, verdict.problems)
        assert verdict.early == 0, (after, verdict.problems)

    def unsettled(self, ids: list[str]) -> list[Any]:
        """The tasks of ``ids`` that are not completed, with their dispatches (for a failure message)."""
        tt, dl = self.tables, dispatch_log.c
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(tt.col("id"), tt.col("instance_id"), tt.col("task_key"), tt.col("status"),
                                          tt.col("attempts"), tt.col("updated_at"))
                                .where(tt.col("instance_id").in_(ids), tt.col("status") != tt.statuses.completed)
                                .limit(20)).all()
            paths = {str(r.task_id): (r.path, str(r.dispatched_at)) for r in conn.execute(
                sa.select(dl.task_id, dl.path, dl.dispatched_at).where(dl.task_id.in_([str(r[0]) for r in rows])))}
        return [(*r, paths.get(str(r[0]))) for r in rows]

    def outbox_age(self) -> float:
        o = outbox.c
        with self.engine.connect() as conn:
            oldest = sa.func.min(o.created_at)
            age = conn.execute(sa.select(sa.func.extract("epoch", sa.func.clock_timestamp() - oldest))
                               .where(o.published_at.is_(None))).scalar()
        return float(age or 0.0)

    def fallbacks(self) -> int:
        dl = dispatch_log.c
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(dl.workflow_type == TYPE,
                                                                      dl.path == "fallback")).scalar_one())

    def admin(self) -> psycopg.Connection[tuple[Any, ...]]:
        return psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5)

    def bus_client(self) -> redis.Redis[bytes]:
        return redis.Redis.from_url(self.redis_url)


def _ready_check(proc: subprocess.Popen[bytes], log: Path, marker: str) -> Callable[[], bool]:
    return lambda: marker in log.read_text(errors="replace") or proc.poll() is not None


# --- the faults ----------------------------------------------------------------------------------------

Lift = Callable[[], None] | None


def relay_killed(walk: Walk) -> Lift:
    walk.kill("relay")
    # Until the relay's heartbeat is stale and the oldest unpublished row is past max_backlog_age (5 s).
    wait_for(lambda: walk.outbox_age() > 6.0, 30, interval=0.2, what="the outbox backlog to age")
    return None


def redis_flushed(walk: Walk) -> Lift:
    client = walk.bus_client()
    try:
        keys = list(client.scan_iter(match=f"{walk.namespace}:*", count=1000))  # this test's keys only
        assert keys, "the bus has no key to lose"
        client.delete(*keys)
    finally:
        client.close()
    time.sleep(1.5)  # the relay's epoch check runs every second
    return None


def postgres_connections_terminated(walk: Walk) -> Lift:
    with walk.admin() as conn:
        rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = %s AND pid <> pg_backend_pid()", (walk.dbname,)).fetchall()
    assert len(rows) >= 3, f"expected the services' connections to terminate, found {len(rows)}"
    return None


def malformed_events(walk: Walk) -> Lift:
    client = walk.bus_client()
    try:
        for n in range(3):
            client.xadd(_stream_key(walk, n % PARTITIONS), {"id": f"walk-malformed-{n}", "payload": "{not json"})
    finally:
        client.close()

    def dead() -> bool:
        from bridge.bus import open_bus

        bus = open_bus(walk.redis_url, partitions=PARTITIONS, namespace=walk.namespace)
        try:
            return len(bus.dead_letters(100)) >= 3
        finally:
            bus.close()
    wait_for(dead, 30, interval=0.2, what="the scheduler to dead-letter the malformed entries")
    return None


def _stream_key(walk: Walk, partition: int) -> str:
    from bridge.bus.keys import BusKeys

    return BusKeys(walk.namespace).stream(partition)


def scheduler_paused(walk: Walk) -> Lift:
    before = walk.fallbacks()
    walk.kill("scheduler", signal.SIGSTOP)
    try:
        wait_for(lambda: walk.fallbacks() > before, 30, interval=0.2,
                 what="the safety sweep to dispatch a task the paused scheduler missed")
    finally:
        for proc in walk.live("scheduler"):
            proc.send_signal(signal.SIGCONT)
    return None


def flag_store_unreadable(walk: Walk) -> Lift:
    engine = walk.engine
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE pollbridge_flags RENAME TO pollbridge_flags_walk_fault")

    def lift() -> None:
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE pollbridge_flags_walk_fault RENAME TO pollbridge_flags")
    return lift


def scheduler_crash_loop(walk: Walk) -> Lift:
    walk.kill("scheduler")
    for _ in range(2):  # the supervisor restarts it, and it dies again soon after ...
        walk.start_service(["pollbridge", "scheduler", "run"])
        time.sleep(1.0)
        walk.starting.clear()
        walk.kill("scheduler")
    # ... until the supervisor gives up
    time.sleep(2.0 * 2.0 + 0.5)  # heartbeat_timeouts x lease_ttl: its heartbeat is stale
    return None


FAULTS: dict[str, Callable[[Walk], Lift]] = {f.__name__: f for f in (
    relay_killed, redis_flushed, postgres_connections_terminated, malformed_events, scheduler_paused,
    flag_store_unreadable, scheduler_crash_loop)}


# --- the test ------------------------------------------------------------------------------------------

@pytest.fixture
def walk(tmp_path: Path, pg_empty_url: str, redis_server: str, redis_namespace: str) -> Iterator[Walk]:
    """An existing platform (the reference task tables, nothing of pollbridge yet) and a walk over it."""
    engine = create_engine(pg_empty_url)
    with engine.begin() as conn:
        create_demo_schema(conn)
    tables = reflect_tables(engine, TaskTableMapping())
    (tmp_path / "pollbridge.toml").write_text(CONFIG.format(namespace=redis_namespace, partitions=PARTITIONS))
    w = Walk(cwd=tmp_path,
             values={"POLLBRIDGE_DATABASE_URL": pg_empty_url, "POLLBRIDGE_BUS_URL": redis_server, "TYPE": TYPE},
             engine=engine, tables=tables, namespace=redis_namespace, redis_url=redis_server,
             admin_url=pg_empty_url.replace("postgresql+psycopg://", "postgresql://"),
             dbname=pg_empty_url.rsplit("/", 1)[1], fmt=_runbook_format(),
             traffic=Traffic(engine, tables))
    assert w.exe, "the `pollbridge` console script is not installed"
    try:
        yield w
    finally:
        w.traffic.stop()
        for procs in w.services.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)  # a paused one must be able to stop
                    proc.send_signal(signal.SIGTERM)
        for procs in w.services.values():
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        engine.dispose()


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
def test_walk_through_every_runbook_on_postgresql_and_redis(walk: Walk, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(walk.cwd)  # commands run where pollbridge.toml is, as the runbooks say
    fmt = walk.fmt
    books = fmt.load_runbooks()
    started = time.monotonic()
    try:
        for steps in books.values():
            for incident, group in groupby(steps, key=lambda s: s.incident):
                members = list(group)
                lift: Lift = None
                if incident is not None:
                    fault = members[0].fault
                    assert fault in FAULTS, f"incident {incident}: the walk cannot inject fault {fault!r}"
                    walk.await_services()
                    walk.log(f"=== incident {incident}: injecting {fault}")
                    lift = FAULTS[fault](walk)
                for step in members:
                    if lift is not None and step.title.startswith("Fix"):
                        lift()
                        lift = None
                    walk.log(f"--- {step.name}")
                    for command in step.commands:
                        walk.execute(step, command)
                if lift is not None:
                    lift()
                walk.await_services()
                if incident is not None:
                    walk.settle(f"incident {incident}")
        walk.traffic.stop()
        walk.settle("the walk")
        _final_checks(walk)
    except BaseException:
        print("\n".join(walk.transcript[-80:]))
        for log in sorted(walk.cwd.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}")
        raise
    finally:
        text = "\n".join(walk.transcript)
        (walk.cwd / "walk-transcript.txt").write_text(text)
        if os.environ.get("POLLBRIDGE_WALK_TRANSCRIPT"):  # keep it beyond pytest's temporary directories
            Path(os.environ["POLLBRIDGE_WALK_TRANSCRIPT"]).write_text(text)
    print(f"walk: {walk.commands_run} commands, {walk.started} services started, "
          f"{time.monotonic() - started:.0f} s; transcript in {walk.cwd / 'walk-transcript.txt'}")
    print("\n".join(line for line in walk.transcript if "--- after" in line))


def _final_checks(walk: Walk) -> None:
    # Every service the walk did not kill stops cleanly on SIGTERM.
    for name, procs in walk.services.items():
        for proc in procs:
            if proc.pid in walk.killed:
                continue
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, f"{name} (pid {proc.pid}) did not stop cleanly"
    dl = dispatch_log.c
    with walk.engine.connect() as conn:
        paths = {(t, p): int(n) for t, p, n in conn.execute(
            sa.select(dl.workflow_type, dl.path, sa.func.count()).group_by(dl.workflow_type, dl.path))}
        ids = walk.traffic.snapshot()
        verdict = verify(conn, walk.tables, ids)
    # The migrated type went through both paths; the other type never left the poller.
    assert paths.get((TYPE, "events"), 0) > 0 and paths.get((TYPE, "poller"), 0) > 0, paths
    assert {p for (t, p) in paths if t == OTHER} == {"poller"}, paths
    assert verdict.tasks > 300 and verdict.lost == 0 and verdict.double_dispatched == 0 and verdict.early == 0, verdict
