"""Security, in-process: what reaches SQL and Redis from configuration and data, URLs with credentials and TLS,
HTTP listeners, ``uninstall``, and the actor and reason of every flag change.

* **Injection.** Every configurable name (the mapping's tables, columns and schemas, the dependency edges, the
  workflow-type source, the bus namespace, the consumer group) is tried with SQL and Redis injections: each is
  refused before anything runs, and a canary table (and a canary Redis key) survives. Status values are values,
  not names: mapped to injection strings they are bound parameters everywhere, and a whole workload (capture,
  poller, workers, relay, event scheduler, then the CLI's views) runs on them with the canary intact.
* **URLs.** Redis AUTH (user and password) and TLS (``rediss://`` and its query options) and PostgreSQL
  ``sslmode``/``sslrootcert`` reach the drivers unchanged; a ``rediss://`` URL to a server that does not speak
  TLS is a clean error.
* **Listeners.** Every ``--host`` option and the configured serve host default to 127.0.0.1 (the processes
  themselves are checked in ``tests/acceptance/test_security.py``).
* **uninstall** leaves the scheduler's tables exactly as they were: columns, indexes, constraints, its own
  triggers, every row, even when the task table carries the ``pollbridge_`` prefix.
* **Flag changes** always carry an actor and a reason: the store and the CLI refuse blanks, nothing is written.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import Engine

from bridge.app import install
from bridge.bus.embedded import EmbeddedBus
from bridge.capture.relay import Relay
from bridge.cli.main import cli
from bridge.core.errors import FlagError, PollbridgeError
from bridge.core.phases import FixedRouter
from bridge.core.settings import RelaySettings, SchedulerSettings, Settings, load_settings
from bridge.core.urls import mask_url
from bridge.db.engine import create_engine, normalize_url
from bridge.flags.store import FlagStore
from bridge.reference.oracle import verify
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from event_scheduler.scheduler import EventScheduler
from legacy_poller.poller import LegacyPoller
from legacy_poller.workers import WorkerPool

INJECTIONS = [
    'tasks"; DROP TABLE canary; --',
    "tasks'; DROP TABLE canary; --",
    "tasks; DROP TABLE canary",
    "x\" OR \"1\"=\"1",
    "canary--",
    "tasks/**/",
    "tasks`",
    "tasks\\",
    "pg_catalog.pg_class",
    "tasks\x00; DROP TABLE canary",
    "$$; DROP TABLE canary; $$",
    "tasks\nDROP TABLE canary",
]

#: Every name a configuration file can give that pollbridge uses as an SQL identifier.
NAMES = [
    "table", "schema", "columns.id", "columns.instance_id", "columns.task_key", "columns.status", "columns.depends_on",
    "columns.due_at", "columns.awaits_signal", "columns.signal_received_at", "columns.dispatched_at",
    "columns.completed_at", "columns.updated_at", "columns.attempts", "columns.max_attempts", "columns.workflow_type",
    "instances.table", "instances.id", "instances.workflow_type", "instances.schema", "dependencies.table",
    "dependencies.task_id", "dependencies.depends_on_id", "dependencies.schema",
]


def invoke(args: list[str], cwd: Path) -> Result:
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("POLLBRIDGE_")}
    old = Path.cwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(cli, args, env=env, catch_exceptions=True)
    finally:
        os.chdir(old)


def _clean(result: Result, allowed: tuple[int, ...]) -> None:
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"a traceback: {result.exception!r}\n{result.stderr}")
    assert result.exit_code in allowed, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr


def _canary(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE canary (id INTEGER PRIMARY KEY, note TEXT)"))
        conn.execute(sa.text("INSERT INTO canary (id, note) VALUES (1, 'alive')"))


def _canary_alive(engine: Engine) -> bool:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT note FROM canary WHERE id = 1")).scalar() == "alive"


def _mapping_toml(name: str, value: str) -> str:
    section, _, key = name.rpartition(".")
    extra = ""
    if section == "dependencies":  # the edges table is read only in edges mode: ask for it
        extra = '\nmode = "edges"' + ('\ntable = "task_dependencies"' if key != "table" else "")
    header = f"[mapping.{section}]" if section else "[mapping]"
    return f"{header}\n{key} = {json.dumps(value)}{extra}\n"


@pytest.fixture
def canary_db(db_url: str) -> Iterator[tuple[str, Engine]]:
    engine = create_engine(db_url)
    _canary(engine)
    yield db_url, engine
    engine.dispose()


# --------------------------------------------------------------------------------------------------
# injection through configured names


def test_every_configured_name_refuses_injection_and_nothing_runs(canary_db: tuple[str, Engine],
                                                                   tmp_path: Path) -> None:
    url, engine = canary_db
    commands = [["init"], ["doctor"], ["flags", "list"], ["status", "--json"], ["explain", "1"], ["uninstall", "--yes"]]
    for n, name in enumerate(NAMES):
        for m, value in enumerate(INJECTIONS):
            (tmp_path / "pollbridge.toml").write_text(_mapping_toml(name, value), encoding="utf-8")
            try:
                load_settings(tmp_path / "pollbridge.toml", environ={})
            except PollbridgeError as exc:
                assert exc.exit_code == 2 and f"mapping.{name.split('.')[0]}" in str(exc), (name, value, str(exc))
            else:
                raise AssertionError(f"mapping.{name} = {value!r} was accepted")
            args = commands[(n + m) % len(commands)]
            result = invoke(["--database-url", url, *args], tmp_path)
            _clean(result, (2,))
            assert result.stderr.startswith("pollbridge: error: ") and len(result.stderr.splitlines()) == 1
    assert _canary_alive(engine)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM tasks")).scalar() is not None


@pytest.mark.parametrize("namespace", ["x:*", "a b", "ns\r\nFLUSHALL", "{p}", "*", "", "ns:other", "a\x00b",
                                       "n" * 101, "ns?", "[ns]"])
def test_a_bus_namespace_that_could_reach_other_keys_is_refused(namespace: str, tmp_path: Path) -> None:
    (tmp_path / "pollbridge.toml").write_text(f"[bus]\nnamespace = {json.dumps(namespace)}\n", encoding="utf-8")
    with pytest.raises(PollbridgeError) as raised:
        load_settings(tmp_path / "pollbridge.toml", environ={})
    assert raised.value.exit_code == 2 and "namespace" in str(raised.value)
    result = invoke(["status"], tmp_path)
    _clean(result, (2,))


@pytest.mark.redis
def test_redis_commands_cannot_be_smuggled_through_names(redis_server: str, redis_namespace: str,
                                                         tmp_path: Path) -> None:
    """Redis speaks a length-prefixed protocol: a group name or an event with CR LF in it stays one argument.
    A canary key beside the namespace survives everything the bus is asked to do with hostile names."""
    import redis

    from bridge.bus.redis_streams import RedisStreamsBus
    from bridge.core.events import CloudEvent

    client = redis.Redis.from_url(redis_server)
    canary = f"{redis_namespace}-canary"
    client.set(canary, "alive")
    bus = RedisStreamsBus(redis_server, partitions=2, namespace=redis_namespace)
    try:
        hostile = "g\r\nFLUSHALL\r\n"
        with pytest.raises(ValueError):  # whitespace in a group name is refused
            bus.ensure_group(hostile)
        bus.ensure_group("g")
        event = CloudEvent(id="e\r\nFLUSHALL\r\n", type="task.status_changed", subject="1\r\nDEL x",
                           partitionkey="i\r\nFLUSHDB\r\n", time=datetime.now(UTC), data={"x": "\r\nFLUSHALL\r\n"})
        bus.publish([event])
        got = bus.read("g", "c", [0, 1], 10, 0.1)
        assert [d.event.id for d in got if d.event] == [event.id]
        assert client.get(canary) == b"alive"
    finally:
        client.delete(canary)
        bus.close()
        client.close()


def test_scheduler_group_with_whitespace_is_refused_by_the_settings(tmp_path: Path) -> None:
    (tmp_path / "pollbridge.toml").write_text('[scheduler]\ngroup = "a b"\n', encoding="utf-8")
    with pytest.raises(PollbridgeError) as raised:
        load_settings(tmp_path / "pollbridge.toml", environ={})
    assert raised.value.exit_code == 2


# --------------------------------------------------------------------------------------------------
# values are bound: hostile status values and workflow types run a whole workload

HOSTILE_STATUSES = {
    "pending": "pending'; DROP TABLE canary; --",
    "dispatched": 'queued"; DROP TABLE canary; --',
    "running": "run') OR 1=1; --",
    "completed": "done$$; DROP TABLE canary; $$",
    "failed": "failed'||(SELECT 1)||'",
}
HOSTILE_TYPE = "orders'); DROP TABLE canary; --"

LEGACY_DDL = """
CREATE TABLE runs (run_id VARCHAR(100) PRIMARY KEY, kind VARCHAR(200) NOT NULL);
CREATE TABLE jobs (
    job_id INTEGER PRIMARY KEY {autoinc},
    run_id VARCHAR(100) NOT NULL,
    step VARCHAR(100) NOT NULL,
    state VARCHAR(100) NOT NULL,
    deps JSON NOT NULL,
    not_before {ts},
    tries INTEGER NOT NULL DEFAULT 0,
    max_tries INTEGER NOT NULL DEFAULT 3,
    touched {ts},
    finished {ts}
)
"""


def _hostile_config() -> str:
    statuses = "\n".join(f"{k} = {json.dumps(v)}" for k, v in HOSTILE_STATUSES.items())
    return f"""
[mapping]
table = "jobs"
[mapping.columns]
id = "job_id"
instance_id = "run_id"
task_key = "step"
status = "state"
depends_on = "deps"
due_at = "not_before"
awaits_signal = ""
signal_received_at = ""
dispatched_at = ""
completed_at = "finished"
updated_at = "touched"
attempts = "tries"
max_attempts = "max_tries"
[mapping.instances]
table = "runs"
id = "run_id"
workflow_type = "kind"
[mapping.statuses]
{statuses}
"""


def test_hostile_status_values_and_type_names_are_bound_never_executed(db_url: str, tmp_path: Path) -> None:
    engine = create_engine(db_url)
    try:
        _canary(engine)
        pg = engine.dialect.name == "postgresql"
        with engine.begin() as conn:
            for statement in LEGACY_DDL.format(autoinc="GENERATED BY DEFAULT AS IDENTITY" if pg else "",
                                               ts="TIMESTAMP WITH TIME ZONE" if pg else "TIMESTAMP").split(";"):
                if statement.strip():
                    conn.execute(sa.text(statement))
        (tmp_path / "pollbridge.toml").write_text(_hostile_config(), encoding="utf-8")
        settings = load_settings(tmp_path / "pollbridge.toml", environ={})
        assert settings.mapping.statuses.pending == HOSTILE_STATUSES["pending"]
        install.init(engine, mapping=settings.mapping)
        tables = reflect_tables(engine, settings.mapping)
        specs = [WorkflowSpec(f"r-{n}", HOSTILE_TYPE if n % 2 else "[bold]x", (
            TaskSpec("a"), TaskSpec("b", ("a",)), TaskSpec("c", ("a",)), TaskSpec("d", ("b", "c"))))
            for n in range(4)]
        with engine.begin() as conn:
            seed(conn, tables, specs)
        ids = [s.instance_id for s in specs]
        # The legacy path: poller and workers.
        poller = LegacyPoller(engine, tables)
        workers = WorkerPool(engine, tables, settings.workers, seed=1)
        deadline = time.monotonic() + 60
        while True:
            poller.scan_once()
            while workers.work_one():
                pass
            with engine.connect() as conn:
                verdict = verify(conn, tables, ids)
            if verdict.unsettled == 0 or time.monotonic() > deadline:
                break
        assert verdict.completed == verdict.tasks == 16 and verdict.lost == verdict.early == 0, verdict
        # The event path over the captured changes: relay, then the scheduler (nothing left to dispatch).
        bus = EmbeddedBus(engine, partitions=2)
        try:
            relay = Relay(engine, bus, RelaySettings(), statuses=settings.mapping.statuses)
            while relay.publish_batch():
                pass
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT count(*) FROM pollbridge_outbox_dead")).scalar() == 0
                assert conn.execute(sa.text("SELECT count(*) FROM pollbridge_outbox WHERE published_at IS NULL")) \
                    .scalar() == 0
            sched = EventScheduler(engine, tables, bus, SchedulerSettings(block=0.01), FixedRouter("cutover"))
            sched.refresh_leases()
            while sched.poll_once(block=0.01):
                pass
            assert bus.dead_letters() == []
        finally:
            bus.close()
        # The operators' views with that configuration.
        for args in (["doctor"], ["status", "--json"], ["flags", "list", "--json"], ["explain", "1", "--json"],
                     ["reconcile", "--format", "json"], ["flags", "history", "--json"],
                     ["guardian", "check", "--dry-run", "--json"]):
            result = invoke(["--database-url", db_url, *args], tmp_path)
            _clean(result, (0, 1))
        refused = invoke(["--database-url", db_url, "flags", "set", HOSTILE_TYPE, "cutover", "--reason", "x",
                          "--force"], tmp_path)
        _clean(refused, (2,))
        assert "invalid workflow type name" in refused.stderr
        assert _canary_alive(engine)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == 16
            assert conn.execute(sa.text("SELECT count(*) FROM runs")).scalar() == 4
    finally:
        engine.dispose()


@pytest.mark.parametrize("command", ["flags list", "dlq list"])
def test_markup_in_data_is_shown_not_interpreted(command: str, sqlite_url: str, tmp_path: Path) -> None:
    engine = create_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('m', '[/]')"))
            conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key) VALUES ('m', 'a')"))
            conn.execute(sa.text("INSERT INTO pollbridge_bus_dead (group_name, entry_id, partition, payload, reason, "
                                 "created_at) VALUES ('g', '1', 0, '[/] not json', 'unparseable entry: [/]', "
                                 "CURRENT_TIMESTAMP)"))
    finally:
        engine.dispose()
    result = invoke(["--database-url", sqlite_url, *command.split()], tmp_path)
    _clean(result, (0,))
    assert "[/]" in result.stdout


# --------------------------------------------------------------------------------------------------
# URLs: credentials, TLS and sslmode pass through; secrets are never shown


def test_postgresql_sslmode_and_credentials_reach_the_driver() -> None:
    url = ("postgresql://app:s3cr%40t@db.example.com:5433/prod?sslmode=verify-full&sslrootcert=/etc/ca.pem"
           "&application_name=pb")
    settings = load_settings(environ={}, database_url=url)
    assert settings.database_url == url
    parsed = normalize_url(url)
    assert parsed.drivername == "postgresql+psycopg"
    assert parsed.query["sslmode"] == "verify-full" and parsed.query["sslrootcert"] == "/etc/ca.pem"
    engine = create_engine(url)
    try:
        _args, kwargs = engine.dialect.create_connect_args(engine.url)
    finally:
        engine.dispose()
    assert kwargs["sslmode"] == "verify-full" and kwargs["sslrootcert"] == "/etc/ca.pem"
    assert kwargs["password"] == "s3cr@t" and kwargs["user"] == "app" and kwargs["port"] == 5433
    assert "s3cr" not in mask_url(url) and "sslmode=verify-full" in mask_url(url)
    assert "s3cr" not in repr(engine.url) and "s3cr" not in str(engine.url)


@pytest.mark.parametrize("url,ssl,username,password,db", [
    ("redis://:pa%3Ass@cache:6379/2", False, None, "pa:ss", 2),
    ("redis://alice:wonder%40land@cache:6380/0", False, "alice", "wonder@land", 0),
    ("rediss://bob:pw@cache:6390/3?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem", True, "bob", "pw", 3),
    ("rediss://:only-password@cache/1", True, None, "only-password", 1),
])
def test_redis_auth_and_tls_reach_the_client(url: str, ssl: bool, username: str | None, password: str,
                                             db: int) -> None:
    import redis

    from bridge.bus.redis_streams import RedisStreamsBus, single_client

    settings = load_settings(environ={}, bus_url=url)
    assert settings.bus_url == url
    # Nothing is sent here: the bus connects on first use (asking the server whether it is a cluster), and the
    # client it opens for a server connects lazily too.
    bus = RedisStreamsBus(url, partitions=1)
    client = single_client(url)
    try:
        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        assert kwargs.get("username") == username and kwargs["password"] == password and kwargs["db"] == db
        assert issubclass(pool.connection_class, redis.SSLConnection) == ssl
        if "ssl_ca_certs" in url:
            assert kwargs["ssl_ca_certs"] == "/etc/ca.pem" and kwargs["ssl_cert_reqs"] == "required"
        assert password not in repr(bus)
    finally:
        client.close()
        bus.close()


@pytest.fixture
def plaintext_server() -> Iterator[int]:
    """A TCP server that answers like a Redis without TLS: plain text, at once (so a TLS handshake fails fast)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"-ERR this server does not speak TLS\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join(5)
    server.close()


def test_a_rediss_url_to_a_server_without_tls_is_a_clean_error(plaintext_server: int, sqlite_url: str,
                                                               tmp_path: Path) -> None:
    bus_url = f"rediss://:tls-secret-{uuid.uuid4().hex[:8]}@127.0.0.1:{plaintext_server}/0"
    password = bus_url.split(":")[2].split("@")[0]
    # status still prints every other figure, and exits 1 because the bus it was asked for could not be read
    for args, allowed in ((["doctor"], (1,)), (["status"], (1,)), (["status", "--json"], (1,))):
        started = time.monotonic()
        result = invoke(["--database-url", sqlite_url, "--bus-url", bus_url, *args], tmp_path)
        _clean(result, allowed)
        assert time.monotonic() - started < 60
        assert password not in result.stdout + result.stderr
        assert "127.0.0.1" in result.stdout + result.stderr  # says which bus


def test_dlq_list_over_a_rediss_url_to_a_server_without_tls_is_one_line(plaintext_server: int, sqlite_url: str,
                                                                        tmp_path: Path) -> None:
    result = invoke(["--database-url", sqlite_url, "--bus-url", f"rediss://127.0.0.1:{plaintext_server}/0",
                     "dlq", "list"], tmp_path)
    _clean(result, (1,))
    assert result.stderr.startswith("pollbridge: error: ")


@pytest.mark.postgres
def test_postgresql_sslmode_require_against_a_server_without_ssl_is_one_line(pg_url: str, tmp_path: Path) -> None:
    """The local test server has no SSL: ``sslmode=require`` must reach libpq and fail cleanly, not be dropped."""
    for mode, allowed in (("require", (0, 1)), ("bogus", (1,)), ("disable", (0,))):
        result = invoke(["--database-url", f"{pg_url}?sslmode={mode}", "flags", "history"], tmp_path)
        _clean(result, allowed)
        if result.exit_code:
            assert result.stderr.startswith("pollbridge: error: ") and len(result.stderr.splitlines()) == 1
            assert ("SSL" in result.stderr) or ("sslmode" in result.stderr), result.stderr


# --------------------------------------------------------------------------------------------------
# HTTP listeners default to this host only


def _walk(group: click.Group, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # the lazy subcommands too (not in .commands until loaded)
        command = group.get_command(ctx, name)
        assert command is not None, name
        yield f"{prefix}{name}", command
        if isinstance(command, click.Group):
            yield from _walk(command, f"{prefix}{name} ")


def test_every_listener_option_defaults_to_this_host_only() -> None:
    listeners = []
    for path, command in _walk(cli):
        for param in command.params:
            names = {n.lstrip("-") for n in param.opts}
            if names & {"host", "bind", "addr", "address", "listen"}:
                listeners.append(path)
                default = param.default
                if default is None:  # the configuration decides: its default must be loopback
                    default = getattr(getattr(Settings(), path.split()[0], None), "host", None)
                assert default in ("127.0.0.1", "localhost", "::1"), f"`{path} {param.opts[0]}` defaults to {default!r}"
            if names & {"metrics-port", "port"}:
                listeners.append(path)
    assert "metrics serve" in listeners, listeners


# --------------------------------------------------------------------------------------------------
# uninstall never touches the scheduler's tables


def _definition(engine: Engine, table: str) -> dict[str, Any]:
    inspector = sa.inspect(engine)
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f'SELECT * FROM "{table}" ORDER BY 1')).all()  # a fixed name, no input
        if engine.dialect.name == "postgresql":
            triggers = conn.execute(sa.text(
                "SELECT tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "WHERE c.relname = :t AND NOT tgisinternal AND tgname NOT LIKE 'pollbridge%' ORDER BY 1"),
                {"t": table}).scalars().all()
        else:
            triggers = conn.execute(sa.text(
                "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t "
                "AND name NOT LIKE 'pollbridge%' ORDER BY 1"), {"t": table}).scalars().all()
    return {
        "columns": [(c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                    for c in inspector.get_columns(table)],
        "pk": inspector.get_pk_constraint(table),
        "indexes": sorted((i["name"] or "", tuple(i["column_names"]), bool(i["unique"]))
                          for i in inspector.get_indexes(table)),
        "unique": sorted(str(u) for u in inspector.get_unique_constraints(table)),
        "checks": sorted(str(c) for c in inspector.get_check_constraints(table)),
        "triggers": list(triggers),
        "rows": [tuple(str(v) for v in r) for r in rows],
    }


@pytest.mark.parametrize("prefixed", [False, True], ids=["tasks", "pollbridge_jobs"])
def test_uninstall_leaves_the_scheduler_tables_exactly_as_they_were(empty_db_url: str, tmp_path: Path,
                                                                    prefixed: bool) -> None:
    """Even when the mapping points at a task table whose name starts with ``pollbridge_``."""
    engine = create_engine(empty_db_url)
    pg = engine.dialect.name == "postgresql"
    task_table = "pollbridge_jobs" if prefixed else "tasks"
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE workflow_instances (id TEXT PRIMARY KEY, workflow_type TEXT NOT NULL)"))
            conn.execute(sa.text(f"""CREATE TABLE {task_table} (
                id INTEGER PRIMARY KEY {'GENERATED BY DEFAULT AS IDENTITY' if pg else ''},
                instance_id TEXT NOT NULL, task_key TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'pending',
                depends_on JSON NOT NULL DEFAULT '[]',
                due_at {'TIMESTAMPTZ' if pg else 'TIMESTAMP'}, awaits_signal TEXT,
                signal_received_at {'TIMESTAMPTZ' if pg else 'TIMESTAMP'}, attempts INTEGER NOT NULL DEFAULT 0,
                max_attempts INTEGER NOT NULL DEFAULT 3, dispatched_at {'TIMESTAMPTZ' if pg else 'TIMESTAMP'},
                completed_at {'TIMESTAMPTZ' if pg else 'TIMESTAMP'},
                updated_at {'TIMESTAMPTZ' if pg else 'TIMESTAMP'} NOT NULL DEFAULT CURRENT_TIMESTAMP,
                CONSTRAINT {task_table}_key UNIQUE (instance_id, task_key),
                CONSTRAINT {task_table}_status CHECK (status <> ''))"""))
            conn.execute(sa.text(f"CREATE INDEX {task_table}_status_idx ON {task_table} (status)"))
            conn.execute(sa.text("CREATE TABLE audit_log (what TEXT)"))
            if pg:
                conn.execute(sa.text("CREATE FUNCTION audit() RETURNS trigger LANGUAGE plpgsql AS "
                                     "$$BEGIN INSERT INTO audit_log VALUES (TG_OP); RETURN NEW; END$$"))
                conn.execute(sa.text(f"CREATE TRIGGER scheduler_audit AFTER UPDATE ON {task_table} "
                                     "FOR EACH ROW EXECUTE FUNCTION audit()"))
            else:
                conn.execute(sa.text(f"CREATE TRIGGER scheduler_audit AFTER UPDATE ON {task_table} "
                                     "BEGIN INSERT INTO audit_log VALUES ('UPDATE'); END"))
        (tmp_path / "pollbridge.toml").write_text(f'[mapping]\ntable = "{task_table}"\n', encoding="utf-8")
        mapping = load_settings(tmp_path / "pollbridge.toml", environ={}).mapping
        install.init(engine, mapping=mapping)
        tables = reflect_tables(engine, mapping)
        with engine.begin() as conn:
            seed(conn, tables, [WorkflowSpec(f"u-{n}", "orders", (TaskSpec("a"), TaskSpec("b", ("a",))))
                                for n in range(5)])
        LegacyPoller(engine, tables).scan_once()  # some rows change (and are captured) before uninstalling
        before = {t: _definition(engine, t) for t in (task_table, "workflow_instances", "audit_log")}
        assert before["audit_log"]["rows"], "the scheduler's own trigger fired"
        result = invoke(["--database-url", empty_db_url, "uninstall", "--yes"], tmp_path)
        _clean(result, (0,))
        after = {t: _definition(engine, t) for t in (task_table, "workflow_instances", "audit_log")}
        assert after == before
        names = set(sa.inspect(engine).get_table_names())
        assert {task_table, "workflow_instances", "audit_log"} <= names
        assert not any(n.startswith("pollbridge_") and n != task_table for n in names), names
        with engine.connect() as conn:  # pollbridge's capture triggers are gone, the scheduler's stays
            if pg:
                left = conn.execute(sa.text("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")).scalars().all()
            else:
                left = conn.execute(sa.text("SELECT name FROM sqlite_master WHERE type = 'trigger'")).scalars().all()
        assert sorted(left) == ["scheduler_audit"]
        # Uninstalling twice is harmless too.
        _clean(invoke(["--database-url", empty_db_url, "uninstall", "--yes"], tmp_path), (0,))
        assert {t: _definition(engine, t) for t in (task_table, "workflow_instances", "audit_log")} == before
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------------------------
# flag changes carry an actor and a reason


@pytest.mark.parametrize("actor,reason", [("", "r"), ("   ", "r"), ("a", ""), ("a", " \t\n"), ("", ""),
                                          ("a", "x" * 2001)])
def test_the_flag_store_refuses_a_change_without_actor_or_reason(sqlite_url: str, actor: str, reason: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        store = FlagStore(engine)
        with pytest.raises(FlagError):
            store.change("orders", "dual_write", actor=actor, reason=reason)
        assert store.all() == {} and store.history() == []
    finally:
        engine.dispose()


@pytest.mark.parametrize("args", [
    ["flags", "set", "orders", "dual_write"],
    ["flags", "set", "orders", "dual_write", "--reason", ""],
    ["flags", "set", "orders", "dual_write", "--reason", "   "],
    ["flags", "set", "orders", "dual_write", "--reason", "why", "--actor", "   "],
    ["rollback", "orders"],
    ["rollback", "--all", "--reason", "\t"],
    ["rollback", "orders", "--reason", "why", "--actor", " "],
])
def test_the_cli_refuses_a_flag_change_without_actor_or_reason(args: list[str], sqlite_url: str,
                                                               tmp_path: Path) -> None:
    engine = create_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('i', 'orders')"))
            conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key) VALUES ('i', 'a')"))
        result = invoke(["--database-url", sqlite_url, *args], tmp_path)
        _clean(result, (2,))
        assert "actor" in result.stderr or "reason" in result.stderr
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM pollbridge_flag_audit")).scalar() == 0
            assert conn.execute(sa.text("SELECT count(*) FROM pollbridge_flags")).scalar() == 0
    finally:
        engine.dispose()


def test_a_flag_change_without_actor_records_the_operating_system_user(sqlite_url: str, tmp_path: Path) -> None:
    engine = create_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('i', 'orders')"))
            conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key) VALUES ('i', 'a')"))
        for args in (["flags", "set", "orders", "dual_write", "--reason", "try it"],
                     ["flags", "set", "orders", "dual_write", "--reason", "try it", "--actor", ""],
                     ["rollback", "orders", "--reason", "back"]):
            _clean(invoke(["--database-url", sqlite_url, *args], tmp_path), (0,))
        history = FlagStore(engine).history()
        assert history and all(c.actor.strip() and c.reason.strip() for c in history)
    finally:
        engine.dispose()
