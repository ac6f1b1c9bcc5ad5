"""Bad input, generated: configuration files, mapping identifiers, CLI arguments, CloudEvents, signal payloads.

Every case ends one of two ways: a clear one-line error (an expected error never shows a traceback,
exit code 2 for bad input, 1 for a failed check or an unreachable server) or, for a bus entry, a dead
letter with its reason. And a rejected command changes nothing: a dump of pollbridge's tables and of
the scheduler's tables is the same before and after.

Most CLI cases run in-process with click's ``CliRunner`` (hypothesis draws hundreds of them); a sample
runs as real subprocesses, as a user would meet them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from bridge.bus.embedded import EmbeddedBus
from bridge.cli.main import cli
from bridge.core.errors import PollbridgeError
from bridge.core.events import CloudEvent, EventFormatError
from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import SchedulerSettings, load_settings
from bridge.db.engine import about, create_engine
from bridge.reference.schema import create_demo_schema
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from event_scheduler.exceptions import SignalError
from event_scheduler.scheduler import EventScheduler
from event_scheduler.signals import MAX_PAYLOAD, record_signal

FUNCTION_FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

# --------------------------------------------------------------------------------------------------
# helpers


_REFLECTED: dict[str, sa.MetaData] = {}


def dump(engine: Engine) -> dict[str, list[tuple[str, ...]]]:
    """Every row of every table (pollbridge's and the scheduler's), as sorted text tuples."""
    out: dict[str, list[tuple[str, ...]]] = {}
    metadata = _REFLECTED.setdefault(str(engine.url), sa.MetaData())
    with engine.connect() as conn:
        names = sorted(conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'").scalars()
                       if engine.dialect.name == "sqlite" else sa.inspect(conn).get_table_names())
        for name in names:
            table = metadata.tables.get(name)
            if table is None:
                table = sa.Table(name, metadata, autoload_with=conn)
            rows = conn.execute(sa.select(table)).all()
            out[name] = sorted(tuple(str(v) for v in row) for row in rows)
    return out


def _env_without_pollbridge() -> dict[str, str | None]:
    return {k: None for k in os.environ if k.startswith("POLLBRIDGE_")}


def invoke(args: list[str], env: dict[str, str] | None = None, input: str | None = None) -> Result:
    """Run the CLI in this process, as ``pollbridge ARGS`` would run, with no POLLBRIDGE_* from outside."""
    for handler in logging.root.handlers[:]:  # basicConfig() must bind to this invocation's stderr
        logging.root.removeHandler(handler)
    return CliRunner().invoke(cli, args, env={**_env_without_pollbridge(), **(env or {})}, input=input,
                              catch_exceptions=True)


ERROR_LINE = re.compile(r"^(pollbridge: error: |Error: )\S")


def assert_clean(result: Result, *, allowed: tuple[int, ...] = (0, 1, 2)) -> None:
    """No traceback; an accepted exit code; an error is exactly one line, and bad input is exit 2 with one."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError("unexpected exception (a traceback for the user):\n" + "".join(
            traceback.format_exception(result.exception)) + f"\nstderr: {result.stderr}")
    assert result.exit_code in allowed, (result.exit_code, result.stdout, result.stderr)
    text = result.stdout + result.stderr
    assert "Traceback" not in text, text
    errors = [line for line in result.stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(errors) <= 1, result.stderr
    if result.exit_code == 2:
        assert len(errors) == 1, f"bad input without a one-line error: {result.stderr!r}"
    if result.exit_code != 0 and errors:
        assert len(errors[0]) > len("pollbridge: error: ") + 3, errors


@pytest.fixture
def installed(sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Engine]]:
    """A SQLite database with pollbridge and the reference schema, a few instances in it; cwd is empty."""
    monkeypatch.chdir(tmp_path)
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    with engine.begin() as conn:
        seed(conn, tables, [
            WorkflowSpec("i-1", "orders", (TaskSpec("a"), TaskSpec("b", ("a",), awaits_signal="approval"))),
            WorkflowSpec("i-2", "reports", (TaskSpec("a", awaits_signal="callback"),)),
        ])
    yield sqlite_url, engine
    engine.dispose()


# --------------------------------------------------------------------------------------------------
# configuration files

SECTIONS = ["database", "bus", "poller", "workers", "mapping", "capture", "relay", "scheduler", "router", "gates",
            "guardian", "preflight", "serve"]
KEYS = ["url", "partitions", "namespace", "visibility_timeout", "interval", "batch_size", "concurrency",
        "min_duration", "max_duration", "failure_rate", "wake", "relay_partitions", "retention", "poll_interval",
        "phase", "defaults", "types", "lease_ttl", "grace", "refresh_interval", "window", "min_tasks",
        "miss_budget", "confidence", "max_miss_rate", "max_lag", "table", "schema", "columns", "statuses",
        "dependencies", "instances", "mode", "pending", "id", "status", "max_bus_memory", "host", "port"]
#: Values for ``url`` keys: never a host that could be reached or take long to fail.
URLS = ["embedded", "sqlite:///x.db", "redis://127.0.0.1:1/0", "mysql://x@h/d", "nonsense", "", "http://x",
        "postgresql://u:pw@127.0.0.1:1/d", "rediss://:p@127.0.0.1:1/0", "unix:///nope.sock"]

scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(["adaptive", "poll", "notify", "cutover", "selective", "json", "edges", "tasks", "0", "-1"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3))
#: Keys without control characters: a key with one is bug 1 in the report (tested on its own below).
plain_text = st.text(alphabet=st.characters(exclude_categories=["Cs", "Cc"]), min_size=1, max_size=8)
toml_keys = st.one_of(st.sampled_from(KEYS), plain_text)


@st.composite
def tables(draw: st.DrawFn, depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in draw(st.lists(toml_keys, max_size=4, unique=True)):
        if key == "url":
            out[key] = draw(st.sampled_from(URLS))
        elif depth < 2 and draw(st.integers(0, 4)) == 0:
            out[key] = draw(tables(depth + 1))
        else:
            out[key] = draw(values)
    return out


configs = st.dictionaries(st.one_of(st.sampled_from(SECTIONS), plain_text),
                          st.one_of(tables(), values), max_size=4)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {_toml_value(v)}" for k, v in value.items()) \
            + "}"
    raise TypeError(type(value))


def to_toml(doc: dict[str, Any]) -> str:
    lines = [f"{json.dumps(k, ensure_ascii=False)} = {_toml_value(v)}" for k, v in doc.items()
             if not isinstance(v, dict)]
    for key, value in doc.items():
        if isinstance(value, dict):
            lines.append(f"[{json.dumps(key, ensure_ascii=False)}]")
            lines += [f"{json.dumps(k, ensure_ascii=False)} = {_toml_value(v)}" for k, v in value.items()]
    return "\n".join(lines).replace("\x7f", "\\u007f") + "\n"


broken_toml = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["[bus", "a = ", "x = 1\nx = 2", "[bus]\n[bus]", "partitions = 08", "[bus]\nurl = 'a\nb'",
                     "\ufeff[bus]", "[[bus]]\nurl = 1", "key = \"\\q\"", "a.b = 1\na = 2"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=FUNCTION_FIXTURES)
@given(doc=configs)
@example(doc={"bus": {"partitions": 0}})
@example(doc={"scheduler": {"defaults": 3}})
@example(doc={"scheduler": {"types": {"x": 5}}})
@example(doc={"mapping": {"columns": {"status": "st atus"}}})
@example(doc={"relay": {"max_bus_memory": float("nan")}})
@example(doc={"bus": {"url": "mysql://x@h/d"}})
@example(doc={"database": {"url": 5}})
def test_generated_configuration_is_accepted_or_one_clear_error(doc: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "generated.toml"
    path.write_text(to_toml(doc), encoding="utf-8")
    try:
        load_settings(path, environ={})
    except PollbridgeError as exc:
        message = str(exc)
        assert message.strip() and "\n" not in message, message
        assert exc.exit_code == 2, (type(exc).__name__, message)


@settings(max_examples=100, deadline=None, suppress_health_check=FUNCTION_FIXTURES)
@given(text=broken_toml)
def test_text_that_is_not_a_configuration_is_one_clear_error(text: str, tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(text, encoding="utf-8")
    try:
        load_settings(path, environ={})
    except PollbridgeError as exc:
        assert exc.exit_code == 2 and str(exc).strip() and "\n" not in str(exc), str(exc)


@settings(max_examples=60, deadline=None, suppress_health_check=FUNCTION_FIXTURES)
@given(doc=st.one_of(configs, st.builds(lambda t: t, broken_toml)))
def test_a_rejected_configuration_changes_nothing(doc: dict[str, Any] | str, installed: tuple[str, Engine],
                                                  tmp_path: Path) -> None:
    """Through the CLI: a command that would write (a flag change) refused for its configuration leaves the
    database as it was, with one line on stderr and no traceback."""
    url, engine = installed
    path = tmp_path / "cli.toml"
    path.write_text(doc if isinstance(doc, str) else to_toml(doc), encoding="utf-8")
    before = dump(engine)
    result = invoke(["--config", str(path), "--database-url", url, "flags", "set", "orders", "dual_write",
                     "--reason", "generated config"])
    assert_clean(result)
    if result.exit_code != 0:
        assert dump(engine) == before


@pytest.mark.parametrize("doc", ['"bad\\nsection" = 1', '[bus]\n"x\\u001b[2J" = 1', '[mapping]\n"a\\nb" = 1'])
def test_an_unknown_key_with_control_characters_is_shown_escaped(doc: str, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(doc, encoding="utf-8")
    with pytest.raises(PollbridgeError) as raised:
        load_settings(path, environ={})
    assert "\n" not in str(raised.value) and "\x1b" not in str(raised.value), repr(str(raised.value))


def test_unreadable_configuration_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[bus]\nnamespace = \"caf\xe9\"\n")
    with pytest.raises(PollbridgeError) as raised:
        load_settings(path, environ={})
    assert raised.value.exit_code == 2 and "\n" not in str(raised.value)


# --------------------------------------------------------------------------------------------------
# mapping identifiers

MAPPED_NAMES = [
    ("table",), ("schema",), ("columns", "id"), ("columns", "instance_id"), ("columns", "task_key"),
    ("columns", "status"), ("columns", "depends_on"), ("columns", "due_at"), ("columns", "updated_at"),
    ("columns", "workflow_type"), ("instances", "table"), ("instances", "id"), ("instances", "workflow_type"),
    ("instances", "schema"),
]
OPTIONAL = {("schema",), ("columns", "depends_on"), ("columns", "due_at"), ("columns", "updated_at"),
            ("columns", "workflow_type"), ("instances", "schema")}
EXISTING = {"tasks", "workflow_instances", "id", "instance_id", "task_key", "status", "depends_on", "due_at",
            "awaits_signal", "signal_received_at", "attempts", "max_attempts", "dispatched_at", "completed_at",
            "updated_at", "workflow_type", "created_at", "main", "temp"}

identifiers = st.one_of(
    st.text(max_size=70),
    st.sampled_from(['tasks"; DROP TABLE tasks; --', "tasks; DROP TABLE tasks", "t'x", "a b", "1tasks", "x" * 64,
                     "tâsks", "tasks\n", "", "public.tasks", "`tasks`", "[tasks]", "tasks--", "ta\x00sks", "Tasks"]),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,62}", fullmatch=True),
).filter(lambda name: name.lower() not in EXISTING)


@pytest.fixture
def demo_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Engine]]:
    """A SQLite database with the scheduler's reference tables and nothing of pollbridge's yet."""
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'legacy.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        create_demo_schema(conn)
    yield url, engine
    engine.dispose()


def _mapping_toml(path: tuple[str, ...], name: str) -> str:
    if len(path) == 1:
        return f"[mapping]\n{path[0]} = {_toml_value(name)}\n"
    return f"[mapping.{path[0]}]\n{path[1]} = {_toml_value(name)}\n"


@settings(max_examples=120, deadline=None, suppress_health_check=FUNCTION_FIXTURES)
@given(path=st.sampled_from(MAPPED_NAMES), name=identifiers)
@example(path=("table",), name='tasks"; DROP TABLE tasks; --')
@example(path=("columns", "status"), name="status = status; DROP TABLE tasks")
def test_a_mapped_name_is_validated_before_anything_is_installed(path: tuple[str, ...], name: str,
                                                                demo_only: tuple[str, Engine], tmp_path: Path) -> None:
    if "schema" in path and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", name):
        name = "0" + name  # a valid schema name is bug 2 in the report below (SQLite): tested on its own
    if name == "" and path in OPTIONAL:
        name = " "  # empty means "not mapped" for these, which is valid
    url, engine = demo_only
    (tmp_path / "m.toml").write_text(_mapping_toml(path, name), encoding="utf-8")
    before = dump(engine)
    result = invoke(["--config", str(tmp_path / "m.toml"), "--database-url", url, "init"])
    assert_clean(result, allowed=(1, 2))
    if result.exit_code == 2:  # not an identifier: the message names the setting
        assert f"mapping.{'.'.join(path)}" in result.stderr, result.stderr
    else:  # an identifier the database does not have: the message names it
        assert name in result.stderr, result.stderr
    assert dump(engine) == before, "a rejected init installed something"


@pytest.mark.parametrize("key", ["schema", "instances.schema"])
def test_a_mapped_schema_that_does_not_exist_is_a_clean_error_on_sqlite(key: str, demo_only: tuple[str, Engine],
                                                                        tmp_path: Path) -> None:
    url, _ = demo_only
    path = ("schema",) if key == "schema" else ("instances", "schema")
    (tmp_path / "m.toml").write_text(_mapping_toml(path, "nosuchschema"), encoding="utf-8")
    result = invoke(["--config", str(tmp_path / "m.toml"), "--database-url", url, "init"])
    assert_clean(result, allowed=(1, 2))


@pytest.mark.postgres
def test_a_mapped_schema_that_does_not_exist_is_a_clean_error_on_postgresql(pg_empty_url: str, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    engine = create_engine(pg_empty_url)
    try:
        with engine.begin() as conn:
            create_demo_schema(conn)
        before = dump(engine)
        (tmp_path / "m.toml").write_text('[mapping]\nschema = "nosuchschema"\n', encoding="utf-8")
        result = invoke(["--config", str(tmp_path / "m.toml"), "--database-url", pg_empty_url, "init"])
        assert_clean(result, allowed=(1,))
        assert "nosuchschema" in result.stderr
        assert dump(engine) == before
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------------------------
# CLI arguments

argv_text = st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=24)
type_names = st.one_of(st.sampled_from(["orders", "reports", "", "-x", "a" * 201, "ord ers", "orders\n", "ørders",
                                        "1", "../etc", "'; DROP TABLE tasks; --", "orders;", "unknown"]), argv_text)
numbers = st.one_of(st.sampled_from(["0", "-1", "100", "100.001", "1e309", "nan", "inf", "-0", "abc", "", "12.345",
                                     "3", "50", "0.5", "1_0", "0x10"]), argv_text)
phases = st.one_of(st.sampled_from(["polling", "dual_write", "selective", "cutover", "Cutover", "", "off"]), argv_text)
task_ids = st.one_of(st.sampled_from(["1", "2", "3", "0", "-1", "999999", "abc", "1.5", "", " 1", "1e3",
                                      "99999999999999999999999"]), argv_text)


def _opt(name: str, strategy: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    return st.one_of(st.just([]), strategy.map(lambda v: [name, v]))


def _flag(name: str) -> st.SearchStrategy[list[str]]:
    return st.sampled_from([[], [name]])


def _cmd(*parts: st.SearchStrategy[list[str]]) -> st.SearchStrategy[list[str]]:
    return st.tuples(*parts).map(lambda ps: [a for p in ps for a in p])


def _fixed(*words: str) -> st.SearchStrategy[list[str]]:
    return st.just(list(words))


def _arg(strategy: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    return strategy.map(lambda v: [v])


def _huge(text: str) -> bool:
    """A task id past the database's integer range."""
    try:
        return abs(int(text)) >= 2**31
    except ValueError:
        return False


#: Commands that never write, whatever they are given.
READ_ONLY = {"flags list", "flags history", "dlq list", "explain", "status", "reconcile", "preflight",
             "guardian check", "doctor"}

cli_args = st.one_of(
    _cmd(_fixed("flags", "set"), _arg(type_names), _arg(phases), _opt("--percent", numbers),
         _opt("--reason", argv_text), _opt("--actor", argv_text), _flag("--force"), _opt("--grace", numbers),
         _opt("--threshold", st.one_of(argv_text, numbers.map(lambda n: f"min_tasks={n}"),
                                       numbers.map(lambda n: f"max_miss_rate={n}"))), _flag("--json")),
    _cmd(_fixed("rollback"), st.one_of(_arg(type_names), _fixed("--all"), _fixed()), _opt("--reason", argv_text),
         _opt("--actor", argv_text), _flag("--json")),
    _cmd(_fixed("flags", "history"), st.one_of(_arg(type_names), _fixed()), _opt("--limit", numbers), _flag("--json")),
    _cmd(_fixed("flags", "list"), _flag("--json"), st.one_of(_fixed(), _arg(argv_text))),
    _cmd(_fixed("signal"), _arg(task_ids), _opt("--kind", st.one_of(st.sampled_from(["callback", "approval",
                                                                                     "rejection"]), argv_text)),
         _opt("--payload", st.one_of(argv_text, st.sampled_from(['{"a": 1}', "[]", "{", "null", '"x"' * 3]))),
         _opt("--actor", argv_text)),
    _cmd(_fixed("dlq"), st.sampled_from([["list"], ["replay"], ["purge"], ["replay", "--all"], ["purge", "--all"]]),
         st.one_of(_fixed(), _arg(argv_text)), _opt("--limit", numbers)),
    _cmd(_fixed("explain"), _arg(task_ids), _flag("--json")),
    _cmd(_fixed("status"), _opt("--window", numbers), _flag("--json")),
    _cmd(_fixed("reconcile"), _opt("--type", type_names), _opt("--since", st.one_of(argv_text, st.sampled_from(
        ["1h", "30m", "-1h", "0s", "2024-01-01", "9999999h", "1x", "nan"]))), _opt("--until", argv_text),
         _opt("--format", st.sampled_from(["table", "json", "html", "xml", ""])), _opt("--limit", numbers),
         _flag("--gate")),
    _cmd(_fixed("preflight"), _arg(phases), _opt("--type", type_names)),
    _cmd(_fixed("guardian", "check", "--dry-run"), _flag("--json")),
    st.lists(argv_text, max_size=4),
).filter(lambda args: not any(_huge(a) for a in args))  # huge ids: bug 4, tested on their own below


def _command_name(args: list[str]) -> str:
    words = [a for a in args[:2] if not a.startswith("-")]
    two = " ".join(words)
    return two if two in READ_ONLY else (words[0] if words else "")


@settings(max_examples=200, deadline=None, suppress_health_check=FUNCTION_FIXTURES)
@given(args=cli_args)
@example(args=["flags", "set", "orders", "cutover", "--reason", "   "])
@example(args=["flags", "set", "orders", "selective", "--percent", "nan", "--reason", "r"])
@example(args=["flags", "set", "orders", "selective", "--percent", "12.345", "--reason", "r", "--force"])
@example(args=["flags", "set", "orders\n", "dual_write", "--reason", "r"])
@example(args=["rollback", "orders", "--all", "--reason", "r"])
@example(args=["signal", "abc", "--kind", "callback"])
@example(args=["signal", "3", "--kind", "approval", "--payload", "{"])
@example(args=["dlq", "replay", "no-such-id"])
@example(args=["reconcile", "--since", "-1h"])
@example(args=["status", "--window", "nan"])
def test_generated_cli_arguments_exit_cleanly_and_a_refusal_changes_nothing(args: list[str],
                                                                            installed: tuple[str, Engine]) -> None:
    url, engine = installed
    before = dump(engine)
    result = invoke(["--database-url", url, *args], input="n\n")
    assert_clean(result)
    if result.exit_code != 0 or _command_name(args) in READ_ONLY:
        assert dump(engine) == before, f"`pollbridge {' '.join(args)}` exited {result.exit_code} and changed " \
                                       "the database"


@pytest.mark.parametrize("args", [["explain", "99999999999999999999999"],
                                  ["signal", "99999999999999999999999", "--kind", "callback"]])
def test_a_task_id_out_of_the_integer_range_is_no_such_task(args: list[str], installed: tuple[str, Engine]) -> None:
    url, _ = installed
    result = invoke(["--database-url", url, *args])
    assert_clean(result, allowed=(2,))


SUBPROCESS_CASES = [
    (["flags", "set", "bad type!", "cutover", "--reason", "x"], 2, "invalid workflow type name"),
    (["signal", "abc", "--kind", "callback"], 2, "not a valid int"),
    (["signal", "3", "--kind", "callback", "--payload", "{"], 2, "not valid JSON"),
    (["explain", "424242"], 2, "424242"),
    (["dlq", "replay", "nope"], 2, "no dead letter"),
    (["reconcile", "--since", "yesterday-ish"], 2, "invalid time"),
]


def test_bad_arguments_as_subprocesses(installed: tuple[str, Engine], tmp_path: Path) -> None:
    """A sample as real processes, all started at once: exit 2, one line naming the problem, no change."""
    url, engine = installed
    exe = shutil.which("pollbridge")
    assert exe, "the pollbridge console script is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
    before = dump(engine)
    procs = [subprocess.Popen([exe, "--database-url", url, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, _, _ in SUBPROCESS_CASES]
    try:
        outcomes = [(p.communicate(timeout=180), p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for (args, code, words), ((stdout, stderr), returncode) in zip(SUBPROCESS_CASES, outcomes, strict=True):
        assert returncode == code, (args, returncode, stdout, stderr)
        assert "Traceback" not in stderr + stdout, (args, stderr)
        errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
        assert len(errors) == 1 and words.lower() in errors[0].lower(), (args, stderr)
    assert dump(engine) == before


# --------------------------------------------------------------------------------------------------
# CloudEvents

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children,
                                                                               max_size=3)),
    max_leaves=8,
)
ATTRIBUTES = ["specversion", "id", "source", "type", "subject", "time", "partitionkey", "data", "depth", "traceid"]


@st.composite
def envelopes(draw: st.DrawFn) -> dict[str, Any]:
    """A valid envelope with some attributes dropped or replaced by any JSON value."""
    event: dict[str, Any] = {"specversion": "1.0", "id": draw(st.uuids()).hex, "source": "pollbridge",
                             "type": draw(st.sampled_from(["task.status_changed", "timer.expired", "x"])),
                             "subject": "1", "time": "2024-05-01T12:00:00Z", "partitionkey": "i-1",
                             "data": {"task_key": "a"}, "depth": 0}
    for key in draw(st.lists(st.sampled_from(ATTRIBUTES), max_size=3, unique=True)):
        if draw(st.booleans()):
            event.pop(key, None)
        else:
            event[key] = draw(st.one_of(json_values, st.sampled_from(["", "1.0", "not a time", -1, True, 2**70])))
    return event


payloads = st.one_of(
    envelopes().map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(['{"specversion": "1.0"}', "[]", "null", "\"x\"", "{", "\ufeff{}", "NaN", "1e999"]),
)


@settings(max_examples=400, deadline=None)
@given(payload=payloads)
@example(payload=json.dumps({"specversion": "1.0", "id": "x", "source": "s", "type": "t", "subject": "1",
                             "time": "2024-13-45T99:99:99Z", "partitionkey": "p"}))
@example(payload=b"\xff\xfe")
def test_from_json_parses_or_says_what_is_wrong_in_one_line(payload: str | bytes) -> None:
    try:
        event = CloudEvent.from_json(payload)
    except EventFormatError as exc:
        message = str(exc)
        assert message.strip() and "\n" not in message, message
        return
    # What parses is a real event, and survives its own round trip.
    assert event.id and event.partitionkey and event.depth >= 0 and event.time.tzinfo is not None
    again = CloudEvent.from_json(event.to_json())
    assert (again.id, again.type, again.subject, again.partitionkey, again.data, again.depth) == \
        (event.id, event.type, event.subject, event.partitionkey, event.data, event.depth)


@pytest.fixture
def consumer(installed: tuple[str, Engine]) -> Iterator[tuple[Engine, EmbeddedBus, EventScheduler]]:
    _, engine = installed
    bus = EmbeddedBus(engine, partitions=2)
    sched = EventScheduler(engine, reflect_tables(engine, TaskTableMapping()), bus,
                           SchedulerSettings(block=0.01, max_deliveries=2), FixedRouter("cutover"))
    sched.refresh_leases()
    yield engine, bus, sched
    bus.close()


def _append_raw(engine: Engine, partition: int, payloads: list[str]) -> None:
    # A commit about the bus (bridge.db.changes): on SQLite only those wake the bus's readers in this process.
    with about(engine, "bus").begin() as conn:
        conn.execute(sa.text("INSERT INTO pollbridge_bus_log (partition, event_id, payload, created_at) "
                             "VALUES (:p, :e, :payload, CURRENT_TIMESTAMP)"),
                     [{"p": partition, "e": f"raw-{n}", "payload": text} for n, text in enumerate(payloads)])


@settings(max_examples=25, deadline=None, suppress_health_check=FUNCTION_FIXTURES)
@given(batch=st.lists(st.one_of(payloads.filter(lambda p: isinstance(p, str)), envelopes().map(json.dumps)),
                      min_size=1, max_size=12))
def test_the_scheduler_dead_letters_every_malformed_entry_with_its_reason(
        batch: list[str], consumer: tuple[Engine, EmbeddedBus, EventScheduler]) -> None:
    """Entries on the bus that are not pollbridge CloudEvents become dead letters with a reason; events that
    parse (whatever they say) are acknowledged; nothing crashes the consumer or stays pending."""
    engine, bus, sched = consumer
    known = {letter.id for letter in bus.dead_letters(100_000)}
    _append_raw(engine, 0, batch)
    for _ in range(20):
        if sched.poll_once(block=0.01) == 0:
            break
    assert bus.pending_count(sched.settings.group) == 0
    new = [letter for letter in bus.dead_letters(100_000) if letter.id not in known]
    expected = []
    for text in batch:
        try:
            CloudEvent.from_json(text)
        except EventFormatError:
            expected.append(text)
    assert sorted(letter.payload for letter in new) == sorted(expected)
    for letter in new:
        assert letter.reason.strip() and "\n" not in letter.reason, letter


@pytest.mark.redis
@settings(max_examples=20, deadline=None, suppress_health_check=FUNCTION_FIXTURES)
@given(entries=st.lists(st.dictionaries(st.one_of(st.sampled_from(["id", "payload"]), st.text(max_size=5)),
                                        st.one_of(st.binary(max_size=30), payloads.filter(
                                            lambda p: isinstance(p, str))), min_size=1, max_size=3),
                        min_size=1, max_size=8))
def test_raw_redis_entries_are_delivered_as_malformed_never_raised(entries: list[dict[str, Any]],
                                                                    redis_server: str, redis_namespace: str) -> None:
    """Whatever bytes sit in a partition stream, reading it yields deliveries (a malformed one says why)."""
    import redis

    from bridge.bus.redis_streams import RedisStreamsBus

    bus = RedisStreamsBus(redis_server, partitions=1, namespace=redis_namespace)
    client = redis.Redis.from_url(redis_server)
    try:
        bus.ensure_group("g")
        for fields in entries:
            client.xadd(bus.keys.stream(0), fields)
        got = bus.read("g", "c", [0], 100, 0.01)
        assert len(got) == len(entries)
        for d in got:
            assert (d.event is None) == (d.error is not None)
            if d.error is not None:
                assert d.error.strip() and "\n" not in d.error
                bus.dead_letter("g", d, d.error)
        bus.ack("g", got)
        assert bus.pending_count("g") == 0
    finally:
        client.delete(bus.keys.stream(0), bus.keys.dead)
        client.close()
        bus.close()


# --------------------------------------------------------------------------------------------------
# signal payloads

signal_payloads = st.one_of(
    json_values.map(json.dumps),
    st.text(max_size=50),
    st.sampled_from(["{", "", " ", "null", "NaN", "Infinity", '{"a": NaN}', "1e999", "[" * 50 + "]" * 50,
                     '{"a": "\\ud800"}', "x" * (MAX_PAYLOAD + 1), json.dumps({"big": "y" * (MAX_PAYLOAD - 20)})]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=FUNCTION_FIXTURES)
@given(payload=signal_payloads, task=st.sampled_from(["2", "3", "1", "abc", "999"]),
       kind=st.sampled_from(["callback", "approval", "rejection", "bogus"]))
def test_a_signal_is_recorded_or_refused_with_one_line_and_no_change(payload: str, task: str, kind: str,
                                                                      installed: tuple[str, Engine]) -> None:
    _, engine = installed
    tables = reflect_tables(engine, TaskTableMapping())
    before = dump(engine)
    try:
        result = record_signal(engine, tables, task, kind, payload=payload, actor="tester")
    except SignalError as exc:
        assert str(exc).strip() and "\n" not in str(exc), str(exc)
        assert dump(engine) == before
        return
    assert result.task_id == task and kind != "bogus"
    json.loads(payload)  # only valid JSON is recorded
    with engine.begin() as conn:  # undo, so the next example finds the task waiting again
        conn.execute(sa.text("UPDATE tasks SET signal_received_at = NULL, status = 'pending', attempts = 0, "
                             "completed_at = NULL WHERE id = :id"), {"id": int(task)})
        conn.execute(sa.text("DELETE FROM pollbridge_signals"))
        conn.execute(sa.text("DELETE FROM pollbridge_outbox"))


@pytest.mark.parametrize("spelling", ["0_3", " 3", "+3", "\uff13"])  # the last: a fullwidth digit three
def test_a_task_id_is_taken_only_in_its_canonical_spelling(spelling: str, installed: tuple[str, Engine]) -> None:
    _, engine = installed
    tables = reflect_tables(engine, TaskTableMapping())
    try:
        record_signal(engine, tables, spelling, "callback", actor="tester")
    except SignalError:
        return  # refused: fine
    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT task_id FROM pollbridge_signals")).scalars().all()
    assert stored == ["3"], f"{spelling!r} signalled task 3 but was recorded as {stored}"


@pytest.mark.postgres
def test_a_connection_lost_while_reading_the_mapping_is_not_a_missing_table(pg_url: str) -> None:
    import psycopg

    from bridge.core.errors import MappingMismatch

    engine = create_engine(pg_url)
    statements = {"n": 0}

    @sa.event.listens_for(engine, "before_cursor_execute")
    def cut(_conn: Any, cursor: Any, *_args: Any) -> None:
        statements["n"] += 1
        if statements["n"] == 2:  # the connection is terminated in the middle of the reflection
            with psycopg.connect(pg_url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (cursor.connection.info.backend_pid,))

    try:
        with pytest.raises(PollbridgeError) as raised:
            reflect_tables(engine, TaskTableMapping())
        assert not isinstance(raised.value, MappingMismatch), str(raised.value)
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_connection_cut_while_a_command_runs_is_one_line(pg_url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    import bridge.cli.flags

    def cutting_engine(url: str, **kwargs: Any) -> Engine:
        engine = create_engine(url, **kwargs)

        @sa.event.listens_for(engine, "before_cursor_execute")
        def cut(_conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
            if "DISTINCT" in statement:  # the list of workflow types: well after check_connection()
                with psycopg.connect(pg_url, autocommit=True) as admin:
                    admin.execute("SELECT pg_terminate_backend(%s)", (cursor.connection.info.backend_pid,))

        return engine

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bridge.cli.flags, "create_engine", cutting_engine)
    result = invoke(["--database-url", pg_url, "flags", "list"])
    assert_clean(result, allowed=(1,))
