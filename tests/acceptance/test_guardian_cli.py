"""``pollbridge guardian check|run`` through the real CLI, on a SQLite database made by ``pollbridge init``:
the JSON report, a dry run that changes nothing, a demotion audited as the guardian, an unreachable bus,
an uninstalled database, ``guardian run`` demoting, serving metrics and stopping on SIGTERM, and ``--help``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import GuardianSettings
from bridge.db.engine import create_engine
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.rollout.guardian import Guardian
from bridge.tasktable.tables import reflect_tables
from tests.support import Run, wait_for
from tests.support.ports import free_port


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


def _init(pollbridge: Run) -> str:
    """``pollbridge init --demo-schema`` in the test's folder (the default sqlite:///pollbridge.db); its URL."""
    result = pollbridge("init", "--demo-schema")
    assert result.returncode == 0, result.stderr
    return "sqlite:///pollbridge.db"


def _stuck_cutover(tmp_path: Path, max_age: float = 0.5) -> None:
    """``orders`` in cutover with captured changes no relay publishes, aged past ``max_age`` seconds."""
    engine = create_engine(f"sqlite:///{tmp_path / 'pollbridge.db'}")
    try:
        tables = reflect_tables(engine, TaskTableMapping())
        with engine.begin() as conn:
            seed(conn, tables, [WorkflowSpec("inst-1", "orders", (TaskSpec("a"), TaskSpec("b", ("a",))))])
        store = FlagStore(engine)
        store.change("orders", "cutover", actor="test", reason="test set-up")
        store.change("reports", "polling", actor="test", reason="test set-up")
        probe = Guardian(engine, GuardianSettings(), store=store)
        wait_for(lambda: probe.outbox_age()[1] > max_age, 30, what=f"the outbox to age past {max_age} s")
    finally:
        engine.dispose()


def _phase(tmp_path: Path, workflow_type: str) -> str:
    engine = create_engine(f"sqlite:///{tmp_path / 'pollbridge.db'}")
    try:
        return FlagStore(engine).get(workflow_type).phase
    finally:
        engine.dispose()


def _check_json(pollbridge: Run, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = pollbridge("guardian", "check", "--json", *args, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    _no_traceback(result)
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_check_json_on_a_fresh_database(pollbridge: Run) -> None:
    _init(pollbridge)
    report = _check_json(pollbridge)
    assert report["outbox"] == {"unpublished": 0, "oldest_age_seconds": 0.0, "max_outbox_age": 60.0}
    assert report["lag"]["state"] == "known" and report["lag"]["entries"] == 0
    assert report["lag"]["group"] == "pollbridge-scheduler"
    assert (report["types"], report["demoted"], report["dry_run"]) == ([], [], False)


def test_check_dry_run_changes_nothing_and_check_demotes(pollbridge: Run, tmp_path: Path) -> None:
    _init(pollbridge)
    (tmp_path / "pollbridge.toml").write_text("[guardian]\nmax_outbox_age = 0.5\n")
    _stuck_cutover(tmp_path)

    dry = _check_json(pollbridge, "--dry-run")
    assert dry["dry_run"] is True and dry["would_demote"] == ["orders"] and dry["demoted"] == []
    assert _phase(tmp_path, "orders") == "cutover"

    report = _check_json(pollbridge)
    assert report["demoted"] == ["orders"]
    (orders,) = report["types"]
    assert (orders["workflow_type"], orders["phase"], orders["action"]) == ("orders", "cutover", "demoted")
    outbox = next(c for c in orders["criteria"] if c["criterion"] == "outbox_age")
    assert outbox["state"] == "exceeded" and outbox["value"] > 0.5 and outbox["threshold"] == 0.5
    assert report["unguarded"] == [{"workflow_type": "reports", "phase": "polling"}]
    assert _phase(tmp_path, "orders") == "polling"

    history = pollbridge("flags", "history", "orders", "--json")
    assert history.returncode == 0, history.stderr
    last = json.loads(history.stdout)["changes"][-1]
    assert (last["actor"], last["action"], last["new_phase"]) == ("guardian", "guardian", "polling")
    assert "max_outbox_age 0.5 s" in last["reason"]

    text = pollbridge("guardian", "check")  # nothing left to guard: the demoted type is not touched again
    assert text.returncode == 0, text.stderr
    assert "demoted: nothing" in text.stdout and "orders (polling)" in text.stdout
    assert len(json.loads(pollbridge("flags", "history", "orders", "--json").stdout)["changes"]) == 2


def test_check_with_an_unreachable_bus_reports_the_lag_unknown(pollbridge: Run, tmp_path: Path) -> None:
    _init(pollbridge)
    (tmp_path / "pollbridge.toml").write_text("[guardian]\nmax_outbox_age = 0.5\nmax_lag = 1\n")
    _stuck_cutover(tmp_path)
    result = pollbridge("guardian", "check", "--json", env={"POLLBRIDGE_BUS_URL": "redis://:s3cret@127.0.0.1:1/0"},
                        timeout=60)
    assert result.returncode == 0, result.stderr
    _no_traceback(result)
    report = json.loads(result.stdout)
    assert report["lag"]["state"] == "unknown" and report["lag"]["entries"] is None
    assert "unreachable" in report["lag"]["detail"]
    assert report["outbox"]["unpublished"] >= 2 and report["demoted"] == ["orders"]  # the outbox check still ran
    assert "lag criterion skipped" in result.stderr
    assert "s3cret" not in result.stdout + result.stderr


def test_check_before_init_is_one_line_exit_1(pollbridge: Run) -> None:
    result = pollbridge("guardian", "check")
    assert result.returncode == 1
    _no_traceback(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pollbridge: error: ") and "pollbridge init" in lines[0], lines


def test_run_rejects_a_bad_interval(pollbridge: Run) -> None:
    result = pollbridge("guardian", "run", "--interval", "0")
    assert result.returncode == 2
    _no_traceback(result)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started; killed at the end if the test did not stop them."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_run_demotes_serves_metrics_and_stops_on_sigterm(pollbridge: Run, tmp_path: Path,
                                                         processes: list[subprocess.Popen[bytes]]) -> None:
    _init(pollbridge)
    (tmp_path / "pollbridge.toml").write_text("[guardian]\nmax_outbox_age = 0.5\n")
    _stuck_cutover(tmp_path)
    exe = shutil.which("pollbridge")
    assert exe is not None
    port = free_port()
    log = tmp_path / "guardian.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
           "POLLBRIDGE_GUARDIAN_INTERVAL": "0.2"}
    with log.open("wb") as out:  # a file, not a pipe: an undrained pipe could block the process
        proc = subprocess.Popen([exe, "guardian", "run", "--metrics-port", str(port)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=out)
    processes.append(proc)

    def stderr() -> str:
        return log.read_text(errors="replace")

    wait_for(lambda: "guardian checking every 0.2 s" in stderr() or proc.poll() is not None, 60,
             what="the guardian to start")
    assert proc.poll() is None, stderr()
    wait_for(lambda: _phase(tmp_path, "orders") == "polling", 30, what="the guardian to demote orders")
    assert _phase(tmp_path, "reports") == "polling"

    def metrics() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body: str = response.read().decode()
            return body

    body = metrics()
    assert 'pollbridge_guardian_demotions_total{reason="outbox_age",workflow_type="orders"} 1.0' in body, body
    assert "pollbridge_guardian_checks_total" in body and "pollbridge_guardian_outbox_age_seconds" in body

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, stderr()
    err = stderr()
    assert "Traceback" not in err, err
    assert "guardian demoted orders cutover -> polling" in err, err
    assert "guardian stopped:" in err and "1 demotion(s)" in err, err


@pytest.mark.parametrize(("command", "variables"), [
    (("guardian", "run", "--help"), ("POLLBRIDGE_GUARDIAN_INTERVAL", "POLLBRIDGE_METRICS_PORT")),
    (("guardian", "check", "--help"), ("POLLBRIDGE_JSON", "POLLBRIDGE_GUARDIAN_DRY_RUN")),
    (("--help",), ()),
])
def test_help_shows_environment_variables(pollbridge: Run, command: tuple[str, ...],
                                          variables: tuple[str, ...]) -> None:
    result = pollbridge(*command, timeout=60)
    assert result.returncode == 0, result.stderr
    for variable in variables:
        assert variable in result.stdout, (variable, result.stdout)
    if command == ("--help",):
        assert "guardian" in result.stdout
