"""A real Apache Airflow 3.3 for tests: PostgreSQL, LocalExecutor, started as its own processes.

:class:`AirflowRig` creates a fresh database owned by a *legacy role* of its own (LOGIN, no superuser, no
other grants: Airflow has rights on its own objects only, as a production scheduler would), migrates it as
that role, and starts ``airflow api-server``, ``airflow dag-processor`` and ``airflow scheduler``, each in
its own process group with ``AIRFLOW_HOME`` in a temporary folder and all configuration in ``AIRFLOW__…``
environment variables. It triggers DAG runs with the exact run ids a test asks for (through the REST API:
one CLI call costs seconds of CPU on a 2-core machine), waits on Airflow's own tables with deadlines, and
reads back every task-instance try Airflow dispatched (``task_instance`` plus ``task_instance_history``).
:meth:`AirflowRig.stop` ends every process tree and drops the database and the role, also when a test failed.

Airflow itself runs from a separate virtualenv (:func:`airflow_venv`): its dependencies are not
pollbridge's, and the harness only talks to it through processes, HTTP and the database.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import psycopg
from psycopg import sql

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
#: The Airflow DAGs folder of the acceptance test (not a Python package; pytest never collects it).
DAGS_FOLDER = REPO / "tests" / "acceptance" / "airflow_dags"
#: The SQL views pollbridge's Airflow integration reads (named blocks: install, uninstall, check).
VIEWS_SQL = REPO / "integrations" / "airflow" / "pollbridge.sql"
#: What the harness installs when it has to create the virtualenv itself (CI, the first time).
AIRFLOW_REQUIREMENT = "apache-airflow[postgres]==3.3.*"
DEFAULT_VENV = Path.home() / ".cache" / "pollbridge" / "airflow-3.3"
#: The DAGs of pollbridge_shapes.py.
SHAPE_DAGS = ("pb_chain", "pb_diamond", "pb_fan", "pb_branch", "pb_retry")
FINISHED_RUN_STATES = frozenset({"success", "failed"})
PR_SET_PDEATHSIG = 1  # linux/prctl.h
#: How often the waits look at the database again: short, so a wait ends soon after its condition holds.
POLL_INTERVAL = 0.2


class AirflowUnavailable(RuntimeError):
    """Airflow cannot be provided here (the virtualenv cannot be created); the message says how to fix it."""


class AirflowError(RuntimeError):
    """Airflow did not do what the harness waited for; the message carries the end of the relevant log."""


# --- the virtualenv -----------------------------------------------------------------------------------


def airflow_venv(install_timeout: float = 1200) -> Path:
    """The virtualenv with Airflow: ``$POLLBRIDGE_AIRFLOW_VENV``, else ``~/.cache/pollbridge/airflow-3.3``.

    Created with ``pip install "apache-airflow[postgres]==3.3.*"`` when it has no ``bin/airflow`` (about two
    minutes; what CI does the first time), logging pip's output to ``<venv>-install.log`` beside it, under a file
    lock (two test processes never install into one folder at once). Raises :class:`AirflowUnavailable`, naming
    that log and the command that installs Airflow, when the install fails.
    """
    venv = Path(os.environ.get("POLLBRIDGE_AIRFLOW_VENV") or DEFAULT_VENV).expanduser()
    if (venv / "bin" / "airflow").exists():
        return venv
    hint = (f"install it with `python3 -m venv {venv} && {venv}/bin/pip install \"{AIRFLOW_REQUIREMENT}\"`, "
            "or point POLLBRIDGE_AIRFLOW_VENV at a virtualenv that has it")
    log_path = venv.parent / f"{venv.name}-install.log"
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        lock = (venv.parent / f"{venv.name}-install.lock").open("w")
    except OSError as exc:
        raise AirflowUnavailable(f"cannot create the Airflow virtualenv {venv} ({exc}); {hint}") from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / "bin" / "airflow").exists():  # another process installed it while this one waited
            return venv
        _install(venv, log_path, install_timeout, hint)
    return venv


def _install(venv: Path, log_path: Path, timeout: float, hint: str) -> None:
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--upgrade", "pip"],
        [str(venv / "bin" / "python"), "-m", "pip", "install", AIRFLOW_REQUIREMENT],
    ]
    with log_path.open("w", encoding="utf-8") as log:
        for step in steps:
            log.write(f"$ {' '.join(step)}\n")
            log.flush()
            try:
                done = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                failure = f"timed out after {timeout:.0f} s"
            else:
                failure = "" if done.returncode == 0 else f"exited with {done.returncode}"
            if failure:
                # A half-made virtualenv would be taken for a good one next time (its bin/airflow may exist).
                shutil.rmtree(venv, ignore_errors=True)
                raise AirflowUnavailable(f"could not install Airflow into {venv}: `{' '.join(step)}` {failure} "
                                         f"(see {log_path}: {' / '.join(_tail(log_path, 2).splitlines())}); {hint}")


# --- small helpers ------------------------------------------------------------------------------------


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def load_sql_blocks(path: Path = VIEWS_SQL) -> dict[str, str]:
    """The named blocks of a SQL file (``-- name: NAME`` lines, as bridge/db/sqlblocks.py reads them)."""
    parts = re.split(r"^-- name: ([a-z0-9_]+)\s*$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].strip() for i in range(1, len(parts), 2)}


def wait_until(condition: Callable[[], bool], deadline: float, what: str,
               on_timeout: Callable[[], str] = lambda: "") -> None:
    """Poll ``condition`` every :data:`POLL_INTERVAL` until it holds; :class:`AirflowError` after ``deadline`` s."""
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() >= end:
            raise AirflowError(f"timed out after {deadline:.0f} s waiting for {what}{on_timeout()}")
        time.sleep(POLL_INTERVAL)


@dataclass(frozen=True)
class Dispatch:
    """One task-instance try Airflow sent to its executor, as Airflow recorded it."""

    ti_id: str  # task_instance.id of that try (task_instance_history.task_instance_id for an earlier try)
    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    state: str | None
    scheduled_dttm: datetime | None
    queued_dttm: datetime | None
    start_date: datetime | None
    end_date: datetime | None
    dag_version_id: str | None
    source: str  # "task_instance" (the latest try) or "task_instance_history" (an earlier one)


_DISPATCH_COLUMNS = ("dag_id, run_id, task_id, map_index, try_number, state, scheduled_dttm, queued_dttm, "
                     "start_date, end_date, dag_version_id::text")
#: Every try that reached the executor: queued_dttm is set when the scheduler queues a try. A skipped task
#: (try_number 0) and an EmptyOperator that Airflow marks successful without running it never have one.
DISPATCHES_SQL = f"""
SELECT id::text, {_DISPATCH_COLUMNS}, 'task_instance' FROM task_instance WHERE queued_dttm IS NOT NULL
UNION ALL
SELECT task_instance_id::text, {_DISPATCH_COLUMNS}, 'task_instance_history' FROM task_instance_history
 WHERE queued_dttm IS NOT NULL
ORDER BY 2, 3, 4, 5, 6
"""


#: The first try of every task instance Airflow dispatched (``first_try``), as a ``WITH`` clause.
FIRST_TRIES_CTE = """WITH tries AS (
  SELECT dag_id, run_id, task_id, map_index, try_number, scheduled_dttm, dag_version_id
    FROM task_instance WHERE queued_dttm IS NOT NULL
  UNION ALL
  SELECT dag_id, run_id, task_id, map_index, try_number, scheduled_dttm, dag_version_id
    FROM task_instance_history WHERE queued_dttm IS NOT NULL
), first_try AS (
  SELECT DISTINCT ON (dag_id, run_id, task_id, map_index) *
    FROM tries ORDER BY dag_id, run_id, task_id, map_index, try_number
)"""


#: Airflow's own readiness latency, per dispatched task that has upstream tasks: the first try's
#: ``scheduled_dttm`` (the scheduler found it ready) minus the latest ``end_date`` of its upstream task instances
#: in the same run (when the last of them finished: success, or skipped by a branch). Needs pollbridge's views
#: (the edges come from ``pollbridge_airflow_edges``, keyed by the try's dag_version_id). Tasks without an
#: upstream (ready when their run is created) are left out.
READINESS_SQL = FIRST_TRIES_CTE + """
SELECT f.dag_id, f.run_id, f.task_id, EXTRACT(EPOCH FROM f.scheduled_dttm - max(up.end_date))::float8
  FROM first_try f
  JOIN pollbridge_airflow_edges e ON e.dag_version_id = f.dag_version_id AND e.task_id = f.task_id
  JOIN task_instance up ON up.dag_id = f.dag_id AND up.run_id = f.run_id AND up.task_id = e.upstream_task_id
 GROUP BY f.dag_id, f.run_id, f.task_id, f.map_index, f.scheduled_dttm
 ORDER BY 1, 2, 3
"""


@dataclass(frozen=True)
class Latency:
    """Airflow's readiness latency of one task (see :data:`READINESS_SQL`), in seconds."""

    dag_id: str
    run_id: str
    task_id: str
    seconds: float


@dataclass
class _Component:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


@dataclass
class AirflowRig:
    """A real Airflow on its own PostgreSQL database; a context manager (``with AirflowRig(url) as rig:``).

    ``admin_url`` is a PostgreSQL URL of a role that may create databases and roles (its database part is
    replaced). ``home`` is AIRFLOW_HOME (a new temporary folder, removed by :meth:`stop`, when None).
    ``timings`` records how long each start-up step took, in seconds.
    """

    admin_url: str
    venv: Path | None = None
    dags_folder: Path = DAGS_FOLDER
    home: Path | None = None
    start_deadline: float = 150.0
    extra_config: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        suffix = secrets.token_hex(4)
        self.database = f"pb_af_{suffix}"
        self.role = f"pb_af_legacy_{suffix}"
        self._password = secrets.token_hex(16)
        self._components: list[_Component] = []
        self._own_home = self.home is None
        self._created_role = self._created_database = False
        self.port = 0
        parts = urllib.parse.urlsplit(self.admin_url.replace("postgresql+psycopg://", "postgresql://"))
        self._pg = parts
        self.host = parts.hostname or "127.0.0.1"
        self.pg_port = parts.port or 5432

    # --- URLs ---

    def _url(self, user: str | None, password: str | None, database: str, scheme: str = "postgresql") -> str:
        auth = ""
        if user:
            auth = urllib.parse.quote(user, safe="")
            if password:
                auth += ":" + urllib.parse.quote(password, safe="")
            auth += "@"
        query = f"?{self._pg.query}" if self._pg.query else ""
        return f"{scheme}://{auth}{self.host}:{self.pg_port}/{database}{query}"

    @property
    def superuser_url(self) -> str:
        """The admin role on Airflow's database (what installs pollbridge's views here)."""
        return self._url(self._pg.username, self._pg.password, self.database)

    @property
    def legacy_url(self) -> str:
        """The legacy role on Airflow's database: what Airflow itself connects as."""
        return self._url(self.role, self._password, self.database)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- start and stop ---

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> Self:
        """Create the database and the role, migrate, start the three components; :meth:`stop` on any failure."""
        # Also at interpreter exit, should the caller's own cleanup not run (an exception escaping a fixture's set-up).
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        began = time.monotonic()
        if self.venv is None:
            self.venv = airflow_venv()
        if self.home is None:
            self.home = Path(tempfile.mkdtemp(prefix="pb-airflow-"))
        self.home.mkdir(parents=True, exist_ok=True)
        self._create_database()
        self.port = free_port()
        env = self._environment()

        mark = time.monotonic()
        self._migrate(env)
        self.timings["db_migrate"] = time.monotonic() - mark

        mark = time.monotonic()
        self._spawn("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                    env)
        self._spawn("dag-processor", ["dag-processor"], env)
        # --skip-serve-logs: the log server would listen on a fixed port (8793) that two rigs would share.
        self._spawn("scheduler", ["scheduler", "--skip-serve-logs"], env)
        wait_until(self._api_healthy, self.start_deadline, "the api-server to answer /api/v2/monitor/health",
                   lambda: self._diagnose("api-server"))
        self.timings["components_up"] = time.monotonic() - mark
        self.timings["start_total"] = time.monotonic() - began

    def stop(self, deadline: float = 20.0) -> None:
        """End every component's process tree (SIGTERM, SIGKILL after ``deadline`` s), drop database and role."""
        atexit.unregister(self.stop)
        mark = time.monotonic()
        errors: list[str] = []
        for component in self._components:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(component.process.pid, signal.SIGTERM)
        end = time.monotonic() + deadline
        for component in self._components:
            if not _wait_group_gone(component.process, end):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(component.process.pid, signal.SIGKILL)
                if not _wait_group_gone(component.process, time.monotonic() + 10):
                    errors.append(f"the process group of {component.name} (pid {component.process.pid}) survived "
                                  "SIGKILL")
            component.log_file.close()
        if self._components:
            self.timings["stop"] = time.monotonic() - mark
        self._components.clear()
        try:
            self._drop_database()
        except psycopg.Error as exc:
            errors.append(f"could not drop {self.database} / {self.role}: {exc}")
        if self._own_home and self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None
        if errors:
            raise AirflowError("; ".join(errors))

    def _admin(self) -> psycopg.Connection[tuple[Any, ...]]:
        return psycopg.connect(self._url(self._pg.username, self._pg.password, self._pg.path.lstrip("/")
                                         or "postgres"), autocommit=True, connect_timeout=5)

    def _create_database(self) -> None:
        with self._admin() as conn:
            # No superuser, no CREATEDB/CREATEROLE, no grant: the role's rights come from owning the database
            # (on PostgreSQL 15 the owner of a database also owns its public schema's rights through
            # pg_database_owner), which is all a scheduler normally has.
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD {}").format(
                sql.Identifier(self.role), sql.Literal(self._password)))
            self._created_role = True
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(self.database),
                                                                       sql.Identifier(self.role)))
            self._created_database = True

    def _drop_database(self) -> None:
        if not (self._created_database or self._created_role):
            return
        with self._admin() as conn:
            if self._created_database:
                # pollbridge's WAL capture leaves a replication slot in the database, which keeps it from being
                # dropped (its readers are stopped by now).
                for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s "
                                            "AND NOT active", (self.database,)).fetchall():
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.database)))
                self._created_database = False
            if self._created_role:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(self.role)))
                self._created_role = False

    def _environment(self) -> dict[str, str]:
        assert self.venv is not None and self.home is not None
        # Nothing of the caller's Airflow or Python set-up leaks in: the components see only this rig's settings.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV", "POLLBRIDGE_"))}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.venv)
        env["AIRFLOW_HOME"] = str(self.home)
        # No __pycache__ written into the repository's DAGs folder when the dag-processor imports the DAG file.
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        config = {
            "DATABASE__SQL_ALCHEMY_CONN": self._url(self.role, self._password, self.database,
                                                    scheme="postgresql+psycopg2"),
            "CORE__EXECUTOR": "LocalExecutor",
            "CORE__LOAD_EXAMPLES": "False",
            "CORE__DAGS_FOLDER": str(self.dags_folder),
            "CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            # The default, stated: the views read serialized_dag.data, which compression leaves NULL.
            "CORE__COMPRESS_SERIALIZED_DAGS": "False",
            # Airflow 3 task processes talk to the api-server's execution API, never to the database.
            "CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
            "API__BASE_URL": self.api_url,
            "API__HOST": "127.0.0.1",
            "API__PORT": str(self.port),
            "API__WORKERS": "1",
            # Secrets of this rig alone, so nothing asks for input and all components sign/verify alike.
            "API__SECRET_KEY": secrets.token_hex(16),
            "API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
            # Every request is an admin's: the api-server only listens on 127.0.0.1 of a throwaway rig.
            "CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            # Find the DAG files at once, parse them once (they do not change during a test), one parser.
            "DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
            "DAG_PROCESSOR__PARSING_PROCESSES": "1",
            "DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH": str(self.home / "bundles"),
            "SCHEDULER__USE_JOB_SCHEDULE": "False",
            "LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
            "LOGGING__LOGGING_LEVEL": "INFO",
        }
        config.update(self.extra_config)
        env.update({f"AIRFLOW__{key}": value for key, value in config.items()})
        return env

    def _airflow(self) -> str:
        assert self.venv is not None
        return str(self.venv / "bin" / "airflow")

    def _migrate(self, env: dict[str, str]) -> None:
        assert self.home is not None
        log_path = self.home / "db-migrate.log"
        with log_path.open("wb") as log:
            try:
                done = subprocess.run([self._airflow(), "db", "migrate"], env=env, cwd=self.home, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=self.start_deadline, check=False,
                                      start_new_session=True)
            except subprocess.TimeoutExpired as exc:
                raise AirflowError(f"`airflow db migrate` timed out after {self.start_deadline:.0f} s; "
                                   f"{log_path}:\n{_tail(log_path)}") from exc
        if done.returncode != 0:
            raise AirflowError(f"`airflow db migrate` (as the role {self.role}) exited with {done.returncode}; "
                               f"{log_path}:\n{_tail(log_path)}")

    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str]) -> None:
        assert self.home is not None
        log_path = self.home / f"{name}.log"
        log_file = log_path.open("wb")
        # A session (and process group) of its own: stop() signals the whole tree, the executor's workers and
        # the task processes included, and a Ctrl-C in the terminal does not reach it half-way.
        process = subprocess.Popen([self._airflow(), *args], env=env, cwd=self.home, stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=_terminate_with_parent)
        self._components.append(_Component(name, process, log_path, log_file))

    def _diagnose(self, name: str | None = None) -> str:
        """The components that exited, and the end of the log of ``name`` (or of every exited one)."""
        notes = []
        for component in self._components:
            code = component.process.poll()
            if code is not None or component.name == name:
                state = "running" if code is None else f"exited with {code}"
                notes.append(f"\n--- {component.name} ({state}), {component.log_path}:\n{_tail(component.log_path)}")
        return "".join(notes)

    def pids(self) -> list[int]:
        """The process (and process group) ids of the running components."""
        return [component.process.pid for component in self._components]

    def check_alive(self) -> None:
        """:class:`AirflowError` with its log when a component has exited."""
        for component in self._components:
            if component.process.poll() is not None:
                raise AirflowError(f"airflow {component.name} exited{self._diagnose()}")

    # --- HTTP ---

    def _request(self, method: str, path: str, body: object | None = None, timeout: float = 30) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.api_url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def _api_healthy(self) -> bool:
        self.check_alive()
        try:
            health = self._request("GET", "/api/v2/monitor/health", timeout=5)
        except (OSError, ValueError):
            return False
        return isinstance(health, dict) and health.get("metadatabase", {}).get("status") == "healthy"

    # --- the database ---

    def connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        """A connection to Airflow's database as the admin role (autocommit)."""
        return psycopg.connect(self.superuser_url, autocommit=True, connect_timeout=5)

    def query(self, statement: str, params: Sequence[object] | None = None) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            return conn.execute(statement.encode(), params).fetchall()

    # --- what tests do ---

    def wait_serialized(self, dag_ids: Iterable[str], deadline: float = 90.0) -> None:
        """Wait (at most ``deadline`` s) until every DAG is serialized and unpaused: it can then be triggered."""
        wanted = sorted(set(dag_ids))

        def ready() -> bool:
            self.check_alive()
            rows = self.query(
                "SELECT d.dag_id FROM dag d WHERE d.dag_id = ANY(%s) AND NOT d.is_paused AND EXISTS "
                "(SELECT 1 FROM serialized_dag s WHERE s.dag_id = d.dag_id)", [wanted])
            return len(rows) == len(wanted)

        def missing() -> str:
            found = {row[0] for row in self.query("SELECT dag_id FROM serialized_dag WHERE dag_id = ANY(%s)",
                                                  [wanted])}
            return (f"; not serialized: {sorted(set(wanted) - found)}{self._diagnose('dag-processor')}"
                    f"{self._dag_import_errors()}")

        mark = time.monotonic()
        wait_until(ready, deadline, f"the DAGs {wanted} to be serialized", missing)
        self.timings.setdefault("dags_serialized", time.monotonic() - mark)

    def _dag_import_errors(self) -> str:
        with contextlib.suppress(psycopg.Error):
            errors = self.query("SELECT filename, stacktrace FROM import_error")
            if errors:
                return "\n--- import errors:\n" + "\n".join(f"{name}:\n{trace}" for name, trace in errors)
        return ""

    def trigger(self, dag_id: str, run_id: str, conf: dict[str, Any] | None = None) -> None:
        """Create a DAG run with exactly this run id (REST API; ``logical_date`` null, so many runs may share it)."""
        body = {"dag_run_id": run_id, "logical_date": None, "conf": conf or {}}
        try:
            created = self._request("POST", f"/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}/dagRuns", body)
        except urllib.error.HTTPError as exc:
            raise AirflowError(f"triggering {dag_id} run {run_id!r} failed: HTTP {exc.code} "
                               f"{exc.read().decode(errors='replace')[:2000]}") from exc
        if not isinstance(created, dict) or created.get("dag_run_id") != run_id:
            raise AirflowError(f"triggering {dag_id} run {run_id!r}: unexpected answer {created!r}")

    def dag_runs(self) -> list[tuple[str, str, str]]:
        """(dag_id, run_id, state) of every DAG run."""
        return [(str(d), str(r), str(s)) for d, r, s in
                self.query("SELECT dag_id, run_id, state FROM dag_run ORDER BY dag_id, run_id")]

    def wait_finished(self, deadline: float = 120.0) -> None:
        """Wait (at most ``deadline`` s) until there is a DAG run and every DAG run is success or failed."""

        def finished() -> bool:
            self.check_alive()
            runs = self.dag_runs()
            return bool(runs) and all(state in FINISHED_RUN_STATES for _, _, state in runs)

        def states() -> str:
            unfinished = [run for run in self.dag_runs() if run[2] not in FINISHED_RUN_STATES]
            tis = self.query("SELECT dag_id, run_id, task_id, state, try_number FROM task_instance "
                             "WHERE state IS NULL OR state NOT IN ('success', 'failed', 'skipped') "
                             "ORDER BY 1, 2, 3")
            return (f"; unfinished runs: {unfinished}; their unfinished task instances: {tis}"
                    f"{self._diagnose('scheduler')}")

        mark = time.monotonic()
        wait_until(finished, deadline, "every DAG run to finish", states)
        self.timings["runs_finished"] = time.monotonic() - mark

    def dispatches(self) -> list[Dispatch]:
        """Every task-instance try Airflow dispatched: ``task_instance`` plus ``task_instance_history`` rows with a
        ``queued_dttm`` (the scheduler queued that try to the executor)."""
        return [Dispatch(*row) for row in self.query(DISPATCHES_SQL)]

    def readiness_latencies(self) -> list[Latency]:
        """Airflow's own upstream ``end_date`` → downstream ``scheduled_dttm`` per task (needs the views installed)."""
        return [Latency(*row) for row in self.query(READINESS_SQL)]

    def install_views(self, path: Path = VIEWS_SQL) -> dict[str, str]:
        """Install pollbridge's views as the admin role (``-- name: install``); the blocks, for the caller."""
        blocks = load_sql_blocks(path)
        with self.connect() as conn:
            conn.execute(blocks["install"].encode())
        return blocks


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, even by SIGKILL (no cleanup of ours runs then);
    the component then stops the processes it started itself."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait_group_gone(process: subprocess.Popen[bytes], end: float) -> bool:
    """Whether the process group led by ``process`` is empty by ``end`` (reaping the leader on the way)."""
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0)
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)


@contextlib.contextmanager
def airflow_rig(admin_url: str, **options: Any) -> Iterator[AirflowRig]:
    """``with airflow_rig(url) as rig:`` (a pytest fixture can ``yield from`` it)."""
    with AirflowRig(admin_url, **options) as rig:
        yield rig
