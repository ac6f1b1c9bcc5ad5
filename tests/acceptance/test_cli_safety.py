"""The CLI as a new user meets it (issue 18, items 1-3 and the CLI parts of 8): a wrong signal is refused, an
unknown workflow type is refused by every command that takes one, a type with no compared task is "no
evidence" (never a pass), gate overrides and destructive options come from the command line only, and the
smaller things: ``dlq purge --all`` with nothing to purge, the root ``--help``, ``--json``, hidden test-only
options, ``uninstall`` and the bus.

Most cases run the command tree in this process (click's runner: each subprocess pays the whole import);
the environment-variable cases run the installed script as a subprocess, as a user's shell would.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.bus.embedded import EmbeddedBus
from bridge.bus.redis_streams import RedisStreamsBus
from bridge.cli.main import cli
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import Settings
from bridge.db.engine import create_engine
from bridge.db.schema import flag_audit, flags, signals
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.serve.app import ServeApp, ServeContext
from bridge.serve.auth import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from bridge.tasktable.tables import reflect_tables
from tests.support import Run

ERROR_LINE = re.compile(r"^(pollbridge: error: |Error: )\S")
SECRET = "cli-safety-secret-0123456789"
SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "schemas" / "reconcile.schema.json"


@dataclass
class Db:
    url: str
    engine: Engine
    ids: dict[str, int]  # task key -> id


@pytest.fixture
def db(sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Db]:
    """The CLI's default database (./pollbridge.db in the test's folder): ``orders`` with tasks awaiting an
    approval (two) and a callback, ``reports`` with one plain task; ``orders`` stays in polling."""
    assert sqlite_url == f"sqlite:///{tmp_path / 'pollbridge.db'}"
    monkeypatch.chdir(tmp_path)
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    with engine.begin() as conn:
        seed(conn, tables, [
            WorkflowSpec("o-1", "orders", (TaskSpec("approve", awaits_signal="approval"),
                                           TaskSpec("refuse", awaits_signal="approval"),
                                           TaskSpec("hook", awaits_signal="callback"),
                                           TaskSpec("boss", awaits_signal="manager"))),
            WorkflowSpec("r-1", "reports", (TaskSpec("a"),)),
        ])
        ids = {str(k): int(i) for k, i in conn.execute(sa.text("SELECT task_key, id FROM tasks"))}
    yield Db(sqlite_url, engine, ids)
    engine.dispose()


def invoke(*args: str, env: dict[str, str] | None = None, input: str | None = None) -> Result:
    """``pollbridge ARGS`` in this process, with no POLLBRIDGE_* from outside."""
    for handler in logging.root.handlers[:]:  # basicConfig() must bind to this invocation's stderr
        logging.root.removeHandler(handler)
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("POLLBRIDGE_")}
    return CliRunner().invoke(cli, list(args), env={**clean, **(env or {})}, input=input, catch_exceptions=True)


def one_error(result: Result | subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The command exited ``code`` with exactly one error line on stderr (no traceback) naming ``words``."""
    exit_code = result.exit_code if isinstance(result, Result) else result.returncode
    if isinstance(result, Result) and result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"a traceback for the user: {result.exception!r}\n{result.stderr}")
    assert exit_code == code, (exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word.lower() in errors[0].lower(), (word, errors[0])
    return errors[0]


def dump(engine: Engine) -> dict[str, list[tuple[str, ...]]]:
    """Every row of every table, as text: to show a refused command changed nothing."""
    out: dict[str, list[tuple[str, ...]]] = {}
    metadata = sa.MetaData()
    with engine.connect() as conn:
        for name in sorted(sa.inspect(conn).get_table_names()):
            table = sa.Table(name, metadata, autoload_with=conn)
            out[name] = sorted(tuple(str(v) for v in row) for row in conn.execute(sa.select(table)))
    return out


def _event(event_id: str, instance: str) -> CloudEvent:
    return CloudEvent(id=event_id, type=TASK_STATUS_CHANGED, subject="1", time=datetime.now(UTC),
                      partitionkey=instance, data={})


def _signals(engine: Engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [(str(t), str(k)) for t, k in conn.execute(sa.select(signals.c.task_id, signals.c.kind))]


# --- 1. a wrong signal ------------------------------------------------------------------------------------------

def test_a_signal_of_another_kind_than_the_awaited_one_is_refused_and_records_nothing(db: Db) -> None:
    approve, refuse, hook, boss = (str(db.ids[k]) for k in ("approve", "refuse", "hook", "boss"))
    before = dump(db.engine)
    for task, kind in ((approve, "callback"), (hook, "approval"), (hook, "rejection")):
        one_error(invoke("signal", task, "--kind", kind), 2, f"task {task} awaits", repr(kind))
    assert dump(db.engine) == before, "a refused signal changed the database"
    # The awaited kind is taken (the real approval is not "already received"), and so is a rejection of an
    # approval; a task awaiting a name of the platform's own takes any kind.
    for task, kind, status in ((approve, "approval", "pending"), (refuse, "rejection", "failed"),
                               (hook, "callback", "pending"), (boss, "callback", "pending")):
        done = invoke("signal", task, "--kind", kind, "--json")
        assert done.exit_code == 0, done.stderr
        assert json.loads(done.stdout) == {"task_id": task, "kind": kind, "status": status}
    assert sorted(_signals(db.engine)) == sorted([(approve, "approval"), (refuse, "rejection"), (hook, "callback"),
                                                  (boss, "callback")])


def test_the_webhook_answers_409_to_a_signal_of_another_kind_and_records_nothing(db: Db) -> None:
    import asyncio

    import httpx

    tables = reflect_tables(db.engine, TaskTableMapping())
    app = ServeApp(ServeContext(Settings(database_url=db.url), db.engine, tables, None, SECRET),
                   registry=CollectorRegistry())
    approve = str(db.ids["approve"])

    async def post(kind: str) -> httpx.Response:
        body = json.dumps({"task_id": approve, "kind": kind}).encode()
        ts = str(int(time.time()))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.asgi), base_url="http://test") as client:
            return await client.post(f"/signals/{approve}", content=body,
                                     headers={TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: sign(SECRET, ts, body),
                                              "Content-Type": "application/json"})

    before = dump(db.engine)
    wrong = asyncio.run(post("callback"))
    assert wrong.status_code == 409, wrong.text
    assert wrong.json()["error"] == "conflict" and "awaits 'approval'" in wrong.json()["message"]
    assert dump(db.engine) == before
    right = asyncio.run(post("approval"))
    assert right.status_code == 202, right.text
    assert _signals(db.engine) == [(approve, "approval")]


# --- 2. unknown workflow types and no evidence ------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ("reconcile", "--gate", "--type", "reportz"),
    ("reconcile", "--type", "reports", "--type", "reportz", "--format", "json"),
    ("rollback", "nosuchtype", "--reason", "typo"),
    ("flags", "history", "nosuchtype"),
    ("flags", "set", "nosuchtype", "dual_write", "--reason", "typo"),
    ("preflight", "dual_write", "--type", "nosuchtype"),
])
def test_every_command_that_takes_a_type_refuses_an_unknown_one_as_preflight_does(db: Db,
                                                                                 args: tuple[str, ...]) -> None:
    before = dump(db.engine)
    name = "reportz" if "reportz" in args else "nosuchtype"
    line = one_error(invoke(*args), 2, f"unknown workflow type {name!r}: no flag and no task of that type in 'tasks'")
    assert line.startswith("pollbridge: error: ")
    assert dump(db.engine) == before, f"`pollbridge {' '.join(args)}` changed the database"


def test_a_type_with_no_compared_task_is_no_evidence_never_a_pass(db: Db) -> None:
    import jsonschema

    FlagStore(db.engine).change("orders", "dual_write", actor="test", reason="start")  # judged, still no evidence
    for name in ("reports", "orders"):
        table = invoke("reconcile", "--gate", "--type", name)
        assert table.exit_code == 1, table.stdout + table.stderr
        assert "verdict: no_evidence" in table.stdout and "verdict: pass" not in table.stdout
        assert "100.000%" not in table.stdout, "a miss-rate bound shown for a type with nothing compared"
        assert f"no evidence for {name}" in table.stderr
        as_json = invoke("reconcile", "--type", name, "--format", "json")
        assert as_json.exit_code == 0, as_json.stderr  # without --gate the report is only shown
        report = json.loads(as_json.stdout)
        jsonschema.validate(report, json.loads(SCHEMA.read_text()))
        assert report["verdict"] == "no_evidence" and report["types"][0]["verdict"] == "no_evidence"
    empty = invoke("reconcile", "--gate")  # no type acted in the window: no evidence either
    assert empty.exit_code == 1 and "verdict: no_evidence" in empty.stdout, empty.stdout + empty.stderr


# --- 3. overrides only from the command line --------------------------------------------------------------------

def _state(engine: Engine) -> tuple[list[Any], int, list[str]]:
    with engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(sa.select(flags.c.workflow_type, flags.c.phase, flags.c.percent))]
        audit = conn.execute(sa.select(sa.func.count()).select_from(flag_audit)).scalar_one()
        tables = sorted(sa.inspect(conn).get_table_names())
    return rows, int(audit), tables


def test_gate_overrides_and_destructive_options_are_not_taken_from_the_environment(pollbridge: Run, db: Db) -> None:
    FlagStore(db.engine).change("orders", "dual_write", actor="test", reason="start")
    bus = EmbeddedBus(db.engine, partitions=2)
    bus.ensure_group("g")
    bus.publish([_event("e-1", "o-1")])
    (delivery,) = bus.read("g", "c", [0, 1], 1, 0.0)
    bus.dead_letter("g", delivery, "poison")
    before = (_state(db.engine), dump(db.engine))
    calls: list[tuple[Sequence[str], dict[str, str], str | None]] = [
        (["flags", "set", "orders", "selective", "--reason", "r"], {"POLLBRIDGE_FLAG_FORCE": "1"}, None),
        (["flags", "set", "orders", "cutover", "--reason", "r"], {"POLLBRIDGE_FLAG_FORCE": "true"}, None),
        (["rollback", "--reason", "r"], {"POLLBRIDGE_ROLLBACK_ALL": "1"}, None),
        (["dlq", "replay"], {"POLLBRIDGE_DLQ_ALL": "1"}, None),
        (["dlq", "purge"], {"POLLBRIDGE_DLQ_ALL": "1", "POLLBRIDGE_YES": "1"}, None),
        (["uninstall"], {"POLLBRIDGE_YES": "1"}, "n\n"),
    ]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda c: pollbridge(*c[0], env=c[1], input=c[2]), calls))
    refused, skipped, rolled, replayed, purged, uninstalled = results
    one_error(refused, 1, "gate refused orders")
    one_error(skipped, 2, "one step at a time")
    one_error(rolled, 2, "give one workflow type or --all")
    one_error(replayed, 2, "--all")
    one_error(purged, 2, "--all")
    one_error(uninstalled, 1, "aborted: nothing removed")
    assert (_state(db.engine), dump(db.engine)) == before, "an environment variable overrode a gate or removed data"
    # The options still work when typed, and --help names no variable for them.
    helps = [pollbridge(*cmd, "--help") for cmd in (("flags", "set"), ("rollback",), ("dlq", "replay"),
                                                     ("dlq", "purge"), ("uninstall",))]
    for text in (h.stdout for h in helps):
        for variable in ("POLLBRIDGE_FLAG_FORCE", "POLLBRIDGE_ROLLBACK_ALL", "POLLBRIDGE_DLQ_ALL", "POLLBRIDGE_YES"):
            assert variable not in text, (variable, text)
    assert "POLLBRIDGE_FLAG_REASON" in helps[0].stdout  # the others keep theirs
    typed = invoke("flags", "set", "orders", "cutover", "--reason", "r", "--force")
    assert typed.exit_code == 0 and "(forced)" in typed.stdout, typed.stdout + typed.stderr


# --- 8. the smaller things --------------------------------------------------------------------------------------

def test_dlq_replay_and_purge_all_with_nothing_there_say_so_without_asking(db: Db) -> None:
    for verb in ("replay", "purge"):
        result = invoke("dlq", verb, "--all")  # no input: a question would abort
        assert result.exit_code == 0, result.stdout + result.stderr
        assert result.stdout.strip() == f"no dead letter: nothing to {verb}"
        assert "?" not in result.stdout + result.stderr
        as_json = invoke("dlq", verb, "--all", "--json")
        assert json.loads(as_json.stdout) == {"replayed" if verb == "replay" else "purged": 0, "ids": []}


def test_the_root_help_shows_each_commands_short_help_whole() -> None:
    result = invoke("--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0
    commands = result.stdout.split("Commands:", 1)[1]
    assert "..." not in commands, commands
    flat = " ".join(commands.split())
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert command is not None
        whole = " ".join(command.get_short_help_str(limit=10_000).split())
        assert f"{name} {whole}" in flat, (name, whole)
    assert "(exit 1 if any task was lost, dispatched twice or early)" in flat
    for group in ("flags", "dlq", "guardian", "metrics"):
        sub = invoke(group, "--help", env={"COLUMNS": "80"})
        assert "..." not in sub.stdout.split("Commands:", 1)[1], sub.stdout


def test_test_only_options_are_hidden_from_help_but_still_taken() -> None:
    shown = invoke("scheduler", "run", "--help")
    assert shown.exit_code == 0
    assert "--phase" not in shown.stdout and "POLLBRIDGE_SCHEDULER_PHASE" not in shown.stdout
    taken = invoke("scheduler", "run", "--phase", "sideways")
    one_error(taken, 2, "sideways")


def test_json_output_of_init_signal_dlq_and_uninstall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    init = invoke("--database-url", url, "init", "--demo-schema", "--json")
    assert init.exit_code == 0, init.stderr
    doc = json.loads(init.stdout)
    assert doc["migrated"] is True and doc["revision_before"] is None and doc["revision_after"]
    assert doc["demo_tables_created"] == ["workflow_instances", "tasks"] and doc["capture_installed"] is True
    again = json.loads(invoke("--database-url", url, "init", "--json").stdout)
    assert again["migrated"] is False and again["revision_before"] == again["revision_after"]
    engine = create_engine(url)
    try:
        bus = EmbeddedBus(engine, partitions=2)
        bus.ensure_group("g")
        bus.publish([_event(f"e-{i}", f"i-{i}") for i in range(3)])
        for d in bus.read("g", "c", [0, 1], 3, 0.0):
            bus.dead_letter("g", d, "poison")
        first, second, third = (d.id for d in bus.dead_letters())
    finally:
        engine.dispose()
    replayed = invoke("--database-url", url, "dlq", "replay", first, "--json")
    assert replayed.exit_code == 0, replayed.stderr
    assert json.loads(replayed.stdout) == {"replayed": 1, "ids": [first]}
    purged = invoke("--database-url", url, "dlq", "purge", "--all", "--yes", "--json")
    assert purged.exit_code == 0, purged.stderr
    assert json.loads(purged.stdout) == {"purged": 2, "ids": sorted([second, third])}
    removed = invoke("--database-url", url, "uninstall", "--yes", "--json")
    assert removed.exit_code == 0, removed.stderr
    doc = json.loads(removed.stdout)
    assert "pollbridge_bus_log" in doc["removed"] and "pollbridge_flags" in doc["removed"]
    assert doc["bus"]["state"] == "dropped" and doc["bus"]["keys_removed"] is None


def _redis_keys(redis_url: str, namespace: str) -> list[bytes]:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return sorted(client.scan_iter(match=f"{namespace}:*"))
    finally:
        client.close()


@pytest.mark.redis
def test_uninstall_removes_the_redis_bus_keys_or_keeps_them_with_keep_bus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_server: str, redis_namespace: str) -> None:
    monkeypatch.chdir(tmp_path)
    other = f"{redis_namespace}-other"
    (tmp_path / "pollbridge.toml").write_text(f'[bus]\nurl = "{redis_server}"\nnamespace = "{redis_namespace}"\n')

    def fill(namespace: str) -> None:
        bus = RedisStreamsBus(redis_server, partitions=2, namespace=namespace)
        try:
            bus.ensure_group("g")
            bus.publish([_event("e", "i")])
            bus.epoch()
        finally:
            bus.close()

    def tables() -> list[str]:
        engine = create_engine(f"sqlite:///{tmp_path / 'pollbridge.db'}")
        try:
            return [t for t in sa.inspect(engine).get_table_names() if t.startswith("pollbridge_")]
        finally:
            engine.dispose()

    try:
        fill(other)
        assert invoke("init", "--demo-schema").exit_code == 0
        fill(redis_namespace)
        assert _redis_keys(redis_server, redis_namespace)
        down = invoke("--bus-url", "redis://127.0.0.1:1/0", "uninstall", "--yes")  # the bus cannot be reached
        one_error(down, 1, "cannot reach the bus", "nothing removed", "--keep-bus")
        assert tables() and _redis_keys(redis_server, redis_namespace), "a failed uninstall removed something"
        done = invoke("uninstall", "--yes")
        assert done.exit_code == 0, done.stdout + done.stderr
        assert "pollbridge_outbox" in done.stdout and f"key(s) of namespace '{redis_namespace}'" in done.stdout
        assert tables() == [] and _redis_keys(redis_server, redis_namespace) == []
        assert _redis_keys(redis_server, other), "another namespace's keys were removed"
        assert invoke("init").exit_code == 0
        fill(redis_namespace)
        kept = invoke("uninstall", "--yes", "--keep-bus")
        assert kept.exit_code == 0, kept.stdout + kept.stderr
        assert f"left (--keep-bus): the keys of namespace '{redis_namespace}'" in kept.stdout
        assert tables() == [] and _redis_keys(redis_server, redis_namespace)
    finally:
        import redis

        client = redis.Redis.from_url(redis_server)
        try:
            keys = list(client.scan_iter(match=f"{other}:*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()
