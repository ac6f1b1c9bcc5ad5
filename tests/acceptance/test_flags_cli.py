"""`pollbridge flags list|set|history` and `pollbridge rollback` as a user runs them: the installed script as a
subprocess, on the embedded SQLite default in the working folder. Independent invocations run in parallel to
keep the suite fast."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.db.schema import flag_audit, flags
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from tests.support import Run


@pytest.fixture
def engine(sqlite_url: str, tmp_path: Path) -> Any:
    """The database the CLI finds by default (./pollbridge.db in its working folder), with two seeded types."""
    assert sqlite_url == f"sqlite:///{tmp_path / 'pollbridge.db'}"
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(f"{t}-{n}", t, (TaskSpec("a"),)) for t in ("orders", "reports")
                            for n in range(3)])
    yield engine
    engine.dispose()


def _state(engine: Engine) -> tuple[list[Any], int]:
    with engine.connect() as conn:
        rows = list(conn.execute(sa.select(flags).order_by(flags.c.workflow_type)).all())
        audit = conn.execute(sa.select(sa.func.count()).select_from(flag_audit)).scalar_one()
    return rows, audit


def _parallel(pollbridge: Run, calls: Sequence[tuple[Sequence[str], dict[str, str] | None]]
              ) -> list[subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda call: pollbridge(*call[0], env=call[1]), calls))


def _in_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The same command tree in this process (click's runner), for the cases beyond the ones run as a real
    subprocess: each subprocess pays the whole import (~1.5 s), and these only add input variations. The
    working folder is the test's (see the ``in_tmp`` fixture), so the default database is the same file."""
    from click.testing import CliRunner

    from bridge.cli.main import cli

    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("POLLBRIDGE_")}
    clean.update(env or {})
    result = CliRunner().invoke(cli, list(args), env=clean, prog_name="pollbridge")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: uncaught {result.exception!r}") from result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _ok(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout) if result.stdout.lstrip().startswith("{") else result.stdout


def _flat(text: str) -> str:
    """Help text with its wrapping undone."""
    return re.sub(r"\s+", " ", text)


def test_set_list_history_rollback(pollbridge: Run, engine: Engine) -> None:
    """The happy path, parsed from --json: set (actor = the OS user by default; reason and actor from the
    environment too), a canary forced through a refused gate with --force, list (types seen in the task table
    without a flag are polling), history oldest first, a repeated set changes nothing, rollback of one type
    and of --all."""
    first = _ok(pollbridge("flags", "set", "orders", "dual_write", "--reason", "shadow it", "--json",
                           env={"LOGNAME": "alice-ops"}))
    assert first["changed"] is True
    change = first["change"]
    assert (change["workflow_type"], change["old_phase"], change["new_phase"]) == ("orders", "polling", "dual_write")
    assert (change["actor"], change["reason"], change["forced"], change["action"]) == ("alice-ops", "shadow it",
                                                                                       False, "set")
    assert first["gate"]["passed"] is True
    assert [c["name"] for c in first["gate"]["criteria"]] == ["capture_installed"]

    forced = _ok(pollbridge("flags", "set", "orders", "selective", "--percent", "12.5", "--force", "--grace", "2",
                            "--threshold", "min_tasks=50", "--json",
                            env={"POLLBRIDGE_FLAG_REASON": "drill from env", "POLLBRIDGE_ACTOR": "bob"}))
    change = forced["change"]
    assert (change["new_phase"], change["new_percent"], change["forced"]) == ("selective", 12.5, True)
    assert (change["actor"], change["reason"]) == ("bob", "drill from env")
    assert forced["gate"]["passed"] is False  # no evidence: the override is what let it through

    listed_json, history_json, no_op = _parallel(pollbridge, [
        (["flags", "list", "--json"], None),
        (["flags", "history", "orders", "--json"], None),
        (["flags", "set", "orders", "selective", "--percent", "12.5", "--reason", "again"], None),
    ])
    by_type = {f["workflow_type"]: f for f in _ok(listed_json)["flags"]}
    assert set(by_type) == {"orders", "reports"}
    assert (by_type["orders"]["phase"], by_type["orders"]["percent"], by_type["orders"]["source"]) == (
        "selective", 12.5, "flag")
    assert (by_type["orders"]["grace_seconds"], by_type["orders"]["thresholds"]) == (2.0, {"min_tasks": 50.0})
    assert by_type["orders"]["updated_by"] == "bob"
    assert (by_type["reports"]["phase"], by_type["reports"]["source"]) == ("polling", "default")
    history = _ok(history_json)["changes"]
    assert [(c["old_phase"], c["new_phase"], c["forced"], c["actor"]) for c in history] == [
        ("polling", "dual_write", False, "alice-ops"), ("dual_write", "selective", True, "bob")]
    assert history[1]["gate"]["passed"] is False
    assert "nothing changed" in _ok(no_op)

    back = _ok(pollbridge("rollback", "orders", "--reason", "incident 7", "--actor", "carol", "--json"))["changes"]
    assert [(c["workflow_type"], c["old_phase"], c["new_phase"], c["action"], c["actor"]) for c in back] == [
        ("orders", "selective", "polling", "rollback", "carol")]

    store = FlagStore(engine)
    store.change("reports", "dual_write", actor="x", reason="y")
    text = pollbridge("rollback", "--all", "--reason", "everything back", env={"LOGNAME": "erin"})
    assert text.returncode == 0, text.stderr
    assert text.stdout.strip() == "reports: dual_write -> polling (rollback by erin)"
    assert {f.phase for f in store.all().values()} == {"polling"}
    assert [(c.workflow_type, c.reason) for c in store.history() if c.action == "rollback"] == [
        ("orders", "incident 7"), ("reports", "everything back")]


#: The issue's cases, run as real subprocesses.
BAD_INPUT: list[tuple[list[str], str]] = [
    (["flags", "set", "orders", "everywhere", "--reason", "x"], "unknown phase"),
    (["flags", "set", "bad name", "dual_write", "--reason", "x"], "invalid workflow type name"),
    (["flags", "set", "orders", "selective", "--percent", "150", "--reason", "x"], "between 0 and 100"),
    (["flags", "set", "orders", "selective", "--percent", "10"], "reason is required"),
    (["flags", "set", "reports", "cutover", "--reason", "x"], "one step at a time"),
    (["flags", "set", "orders", "cutover", "--percent", "10", "--reason", "x"], "selective phase only"),
]
#: More bad input, through the same command tree in process.
MORE_BAD_INPUT: list[tuple[list[str], str]] = [
    (["flags", "set", "orders", "selective", "--percent", "10", "--reason", "  "], "reason is required"),
    (["flags", "set", "orders", "selective", "--percent", "12.345", "--reason", "x"], "more than two decimals"),
    (["flags", "set", "orders", "selective", "--percent", "10", "--reason", "x", "--actor", " "], "actor"),
    (["flags", "set", "nosuchtype", "dual_write", "--reason", "x"], "unknown workflow type"),
    (["flags", "set", "orders", "selective", "--reason", "x", "--threshold", "min_tasks"], "NAME=VALUE"),
    (["flags", "set", "orders", "selective", "--reason", "x", "--threshold", "min_tasks=many"], "not a number"),
    (["flags", "history", "bad name"], "invalid workflow type name"),
    (["rollback", "--reason", "x"], "give one workflow type or --all"),
    (["rollback", "orders", "--all", "--reason", "x"], "give one workflow type or --all"),
    (["rollback", "orders"], "reason is required"),
    (["rollback", "bad name", "--reason", "x"], "invalid workflow type name"),
]


def _assert_bad_input(args: Sequence[str], fragment: str, result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 2, (args, result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, args
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, (args, result.stderr)
    assert lines[0].startswith("pollbridge: error:"), (args, lines)
    assert fragment in lines[0], (args, lines)


def test_bad_input_exits_2_with_one_line_and_changes_nothing(pollbridge: Run, engine: Engine, in_tmp: Path) -> None:
    """Every kind of bad input: exit 2, one line on stderr naming the problem, no traceback, nothing written."""
    FlagStore(engine).change("orders", "dual_write", actor="x", reason="baseline")
    before = _state(engine)
    results = _parallel(pollbridge, [(args, None) for args, _ in BAD_INPUT])
    for (args, fragment), result in zip(BAD_INPUT, results, strict=True):
        _assert_bad_input(args, fragment, result)
    for args, fragment in MORE_BAD_INPUT:
        _assert_bad_input(args, fragment, _in_process(*args))
    assert _state(engine) == before


def test_refused_gate_exits_1_and_prints_the_failed_criteria(pollbridge: Run, engine: Engine, in_tmp: Path) -> None:
    """A promotion without evidence: exit 1, each criterion listed with FAIL for the failing ones (and in
    --json the gate object), no traceback, nothing written."""
    FlagStore(engine).change("orders", "dual_write", actor="x", reason="baseline")
    before = _state(engine)
    text = pollbridge("flags", "set", "orders", "selective", "--percent", "10", "--reason", "promote")
    as_json = _in_process("flags", "set", "orders", "selective", "--percent", "10", "--reason", "promote", "--json")
    for result in (text, as_json):
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr + result.stdout
        assert "pollbridge: error: gate refused orders dual_write -> selective" in result.stderr
    # The seeded tasks count once they are past the tolerance window: how many depends on how soon the
    # command ran (a loaded machine can take longer than the tolerance), never enough.
    assert re.search(r"\[FAIL\] min_tasks: [0-3] compared task\(s\), need 1000", text.stderr), text.stderr
    assert "[pass] no_early" in text.stderr and "[pass] no_duplicate" in text.stderr
    assert "[FAIL] miss_rate" in text.stderr
    payload = json.loads(as_json.stdout)
    assert payload["changed"] is False
    gate = payload["gate"]
    assert (gate["workflow_type"], gate["target"], gate["passed"]) == ("orders", "selective", False)
    assert {c["name"]: c["passed"] for c in gate["criteria"]} == {
        "min_tasks": False, "no_early": True, "no_duplicate": True, "miss_rate": False,
        "no_capture_gap": True}
    assert _state(engine) == before


def test_help_shows_the_environment_variables(pollbridge: Run, in_tmp: Path) -> None:
    """Every option of the flag commands names its POLLBRIDGE_* variable in --help (flags set and rollback
    as subprocesses, list and history in process), except --force and --all: command line only."""
    expected = {
        ("flags", "set"): ["POLLBRIDGE_FLAG_REASON", "POLLBRIDGE_ACTOR", "POLLBRIDGE_FLAG_PERCENT",
                           "POLLBRIDGE_FLAG_GRACE", "POLLBRIDGE_FLAG_THRESHOLDS",
                           "POLLBRIDGE_JSON"],
        ("flags", "list"): ["POLLBRIDGE_JSON"],
        ("flags", "history"): ["POLLBRIDGE_HISTORY_LIMIT", "POLLBRIDGE_JSON"],
        ("rollback",): ["POLLBRIDGE_FLAG_REASON", "POLLBRIDGE_ACTOR", "POLLBRIDGE_JSON"],
    }
    results = _parallel(pollbridge, [([*cmd, "--help"], None) for cmd in expected if cmd in (("flags", "set"),
                                                                                              ("rollback",))])
    results.insert(1, _in_process("flags", "list", "--help"))
    results.insert(2, _in_process("flags", "history", "--help"))
    for (cmd, names), result in zip(expected.items(), results, strict=True):
        assert result.returncode == 0, (cmd, result.stderr)
        text = _flat(result.stdout)
        for name in names:
            assert re.search(rf"env var: {name}[];]", text), (cmd, name)
    assert "operating-system user" in _flat(results[0].stdout)
