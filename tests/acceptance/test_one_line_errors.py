"""Expected errors are one line (issue 18, item 4): every command with a file it cannot write, with PostgreSQL
unreachable and with Redis unreachable says so in one line on stderr, with the exit code the house rules give
(2 bad input, 1 an unreachable service or a failed check), no traceback, and changes nothing.

The command tree runs in this process (click's runner): a subprocess per case would pay the whole import
each time. Long-running services that wait for the bus by design (``relay run``, ``guardian run``,
``serve``, ``metrics serve``: they retry, and say so in their log) are driven here with the database
unreachable, where they stop at once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import Engine

from bridge.cli.main import cli
from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables

PG_DOWN = "postgresql://root:sekrit99@127.0.0.1:1/x"
REDIS_DOWN = "redis://:sekrit99@127.0.0.1:1/0"


def invoke(*args: str) -> Result:
    """``pollbridge ARGS`` in this process, with no POLLBRIDGE_* from outside and nothing to read on stdin."""
    for handler in logging.root.handlers[:]:  # basicConfig() must bind to this invocation's stderr
        logging.root.removeHandler(handler)
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("POLLBRIDGE_")}
    return CliRunner().invoke(cli, list(args), env=clean, input="", catch_exceptions=True)


def no_traceback(result: Result) -> None:
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError("a traceback for the user:\n" + "".join(traceback.format_exception(result.exception)))
    assert "Traceback" not in result.stdout + result.stderr, result.stderr


def one_line(result: Result, code: int, *words: str) -> str:
    """Exit ``code`` and exactly one line on stderr, an error naming ``words``; never the password."""
    no_traceback(result)
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pollbridge: error: "), lines
    for word in words:
        assert word.lower() in lines[0].lower(), (word, lines[0])
    assert "sekrit99" not in result.stdout + result.stderr
    return lines[0]


def dump(engine: Engine) -> dict[str, list[tuple[str, ...]]]:
    out: dict[str, list[tuple[str, ...]]] = {}
    metadata = sa.MetaData()
    with engine.connect() as conn:
        for name in sorted(sa.inspect(conn).get_table_names()):
            table = sa.Table(name, metadata, autoload_with=conn)
            out[name] = sorted(tuple(str(v) for v in row) for row in conn.execute(sa.select(table)))
    return out


@pytest.fixture
def installed(sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """pollbridge installed in ./pollbridge.db (the CLI's default), a few tasks of ``orders``."""
    assert sqlite_url == f"sqlite:///{tmp_path / 'pollbridge.db'}"
    monkeypatch.chdir(tmp_path)
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec("o-1", "orders", (TaskSpec("a"),))])
    yield engine
    engine.dispose()


# --- a file that cannot be written ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["html", "json", "table"])
@pytest.mark.parametrize("where", ["missing folder", "a folder", "a file as folder"])
def test_reconcile_checks_its_output_path_before_building_the_report(installed: Engine, tmp_path: Path,
                                                                     fmt: str, where: str) -> None:
    (tmp_path / "plain").write_text("x")
    path = {"missing folder": "/nonexistent/dir/r.html", "a folder": str(tmp_path),
            "a file as folder": str(tmp_path / "plain" / "r.html")}[where]
    before = dump(installed)
    started = time.monotonic()
    result = invoke("reconcile", "--type", "orders", "--format", fmt, "--output", path)
    one_line(result, 2, "--output")
    assert "report" not in result.stdout
    assert dump(installed) == before and (tmp_path / "plain").read_text() == "x"
    assert time.monotonic() - started < 30


def test_other_file_options_are_one_error_line(installed: Engine, tmp_path: Path) -> None:
    """``--config`` and ``demo --workload``: a missing file or a folder is bad input, exit 2, one error line."""
    cases = [("--config", str(tmp_path / "missing.toml"), "doctor"), ("--config", str(tmp_path), "doctor"),
             ("demo", "--workload", str(tmp_path / "missing.json")), ("demo", "--workload", str(tmp_path))]
    before = dump(installed)
    for args in cases:
        result = invoke(*args)
        no_traceback(result)
        assert result.exit_code == 2, (args, result.stdout, result.stderr)
        errors = [line for line in result.stderr.splitlines() if line.startswith(("pollbridge: error: ", "Error: "))]
        assert len(errors) == 1, (args, result.stderr)
    assert dump(installed) == before


# --- PostgreSQL unreachable -------------------------------------------------------------------------------------

PG_COMMANDS = [
    ("init",), ("init", "--json"), ("uninstall", "--yes"), ("demo", "--instances", "1"), ("poller", "run"),
    ("relay", "run"), ("scheduler", "run"), ("workers", "run"), ("run-all",), ("signal", "1", "--kind", "callback"),
    ("dlq", "list"), ("dlq", "replay", "--all"), ("dlq", "purge", "--all", "--yes"), ("flags", "list"),
    ("flags", "set", "orders", "dual_write", "--reason", "r"), ("flags", "history"), ("flags", "history", "orders"),
    ("rollback", "orders", "--reason", "r"), ("rollback", "--all", "--reason", "r"), ("reconcile",),
    ("reconcile", "--type", "orders", "--format", "json"), ("guardian", "run"), ("guardian", "check"),
    ("explain", "1"), ("status",), ("status", "--json"), ("metrics", "serve", "--port", "0"), ("serve", "--port", "0"),
]


@pytest.mark.parametrize("args", PG_COMMANDS, ids=" ".join)
def test_every_command_with_postgresql_unreachable_is_one_line_exit_1(args: tuple[str, ...], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    one_line(invoke("--database-url", PG_DOWN, *args), 1, "127.0.0.1:1")
    assert list(tmp_path.iterdir()) == [], "a command that could not connect wrote a file"


@pytest.mark.parametrize("args", [("doctor",), ("preflight", "dual_write", "--type", "orders")], ids=" ".join)
def test_the_checklists_with_postgresql_unreachable_fail_the_database_check(args: tuple[str, ...]) -> None:
    result = invoke("--database-url", PG_DOWN, *args)
    no_traceback(result)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert "[FAIL] database" in result.stdout and result.stderr == ""
    assert "sekrit99" not in result.stdout


# --- Redis unreachable ------------------------------------------------------------------------------------------

REDIS_COMMANDS = [
    (("dlq", "list"), ("cannot reach the bus",)),
    (("dlq", "replay", "--all"), ("cannot reach the bus",)),
    (("dlq", "purge", "--all", "--yes"), ("cannot reach the bus",)),
    (("scheduler", "run"), ("cannot reach the bus",)),
    (("run-all",), ("bus",)),
    (("demo", "--instances", "1"), ("bus",)),
    (("uninstall", "--yes"), ("cannot reach the bus", "nothing removed")),
    (("status",), ("status incomplete", "the bus")),
]


@pytest.mark.parametrize(("args", "words"), [pytest.param(a, w, id=" ".join(a)) for a, w in REDIS_COMMANDS])
def test_every_command_that_needs_redis_unreachable_is_one_line_exit_1(installed: Engine, args: tuple[str, ...],
                                                                       words: tuple[str, ...]) -> None:
    before = dump(installed) if args[0] in ("uninstall", "dlq", "status") else None
    result = invoke("--bus-url", REDIS_DOWN, *args)
    one_line(result, 1, *words)
    if before is not None:
        assert dump(installed) == before


def test_status_still_shows_what_it_could_read_and_exits_1(installed: Engine) -> None:
    result = invoke("--bus-url", REDIS_DOWN, "status", "--json")
    one_line(result, 1, "status incomplete", "the bus")
    doc = json.loads(result.stdout)
    assert doc["bus"]["state"] == "unknown" and doc["flag_store"]["up"] is True
    assert doc["outbox"]["backlog"] >= 1
    healthy = invoke("status")
    assert healthy.exit_code == 0 and healthy.stderr == "", healthy.stderr


@pytest.mark.parametrize("args", [("doctor",), ("preflight", "dual_write", "--type", "orders")], ids=" ".join)
def test_the_checklists_with_redis_unreachable_fail_the_bus_check(installed: Engine, args: tuple[str, ...]) -> None:
    result = invoke("--bus-url", REDIS_DOWN, *args)
    no_traceback(result)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert "[FAIL] bus" in result.stdout and "sekrit99" not in result.stdout + result.stderr


def test_guardian_check_with_redis_unreachable_skips_the_lag_and_completes(installed: Engine) -> None:
    """Documented: the bus is optional for the guardian; the lag is unknown, the other criteria still run."""
    result = invoke("--bus-url", REDIS_DOWN, "guardian", "check")
    no_traceback(result)
    assert result.exit_code == 0, result.stderr
    assert "lag: unknown, skipped" in result.stdout and len(result.stderr.strip().splitlines()) <= 1
