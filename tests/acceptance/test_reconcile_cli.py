"""``pollbridge reconcile`` as a subprocess: the formats, ``--gate``'s exit code, bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bridge.bus import open_bus
from bridge.capture.relay import Relay
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import RelaySettings, SchedulerSettings, WorkerSettings
from bridge.db.engine import create_engine
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from event_scheduler.scheduler import EventScheduler
from legacy_poller.poller import LegacyPoller
from legacy_poller.workers import WorkerPool
from tests.support import Run


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr


@pytest.fixture
def walked(sqlite_url: str) -> str:
    """A SQLite database where ``orders`` ran in dual_write: 8 instances of 3 tasks, shadow decisions made."""
    engine = create_engine(sqlite_url)
    tables = reflect_tables(engine, TaskTableMapping())
    store = FlagStore(engine)
    store.change("orders", "dual_write", actor="test", reason="walk")
    router = FlagRouter(store, registry=CollectorRegistry())
    router.refresh()
    bus = open_bus("embedded", engine=engine, partitions=2)
    relay = Relay(engine, bus, RelaySettings(), statuses=tables.mapping.statuses)
    sched = EventScheduler(engine, tables, bus, SchedulerSettings(group="cli"), router, registry=CollectorRegistry())
    sched.refresh_leases()
    poller = LegacyPoller(engine, tables, router=router, registry=CollectorRegistry())
    workers = WorkerPool(engine, tables, WorkerSettings(concurrency=1, min_duration=0.0, max_duration=0.0))
    chain = (TaskSpec("a"), TaskSpec("b", ("a",)), TaskSpec("c", ("b",)))
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(f"w{i}", "orders", chain) for i in range(8)])
    for _ in range(12):
        while relay.publish_batch():
            pass
        while sched.poll_once(block=0.0):
            pass
        poller.scan_once()
        while workers.work_one():
            pass
    bus.close()
    engine.dispose()
    return sqlite_url


def test_json_report(pollbridge: Run, walked: str) -> None:
    result = pollbridge("reconcile", "--format", "json", "--since", "1h", env={"POLLBRIDGE_DATABASE_URL": walked})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    (orders,) = report["types"]
    assert orders["workflow_type"] == "orders" and orders["phase"] == "dual_write"
    assert orders["matched"] == 24 and orders["missing"] == 0
    assert orders["latency_ms"]["poller"]["n"] == 24 and orders["latency_ms"]["events"]["n"] == 24
    # 24 clean tasks are not enough evidence for the default 1000-task, 0.1% budget gate.
    assert report["verdict"] == "fail" and set(orders["failed_criteria"]) == {"min_tasks", "miss_rate"}


def test_gate_exit_codes(pollbridge: Run, walked: str, tmp_path: Path) -> None:
    env = {"POLLBRIDGE_DATABASE_URL": walked}
    refused = pollbridge("reconcile", "--gate", env=env)
    assert refused.returncode == 1, refused.stderr
    assert "gate failed for orders (min_tasks, miss_rate)" in refused.stderr
    _no_traceback(refused)
    (tmp_path / "lenient.toml").write_text("[gates]\nmin_tasks = 10\nmiss_budget = 0.2\n")
    passed = pollbridge("--config", str(tmp_path / "lenient.toml"), "reconcile", "--gate", env=env)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "verdict: pass" in passed.stdout


def test_html_output_file(pollbridge: Run, walked: str, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    result = pollbridge("reconcile", "--format", "html", "--output", str(out), env={"POLLBRIDGE_DATABASE_URL": walked})
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    assert html.startswith("<!doctype html>") and "<svg" in html and "orders" in html
    assert "report written to" in result.stderr


@pytest.mark.parametrize("args", [
    ("--since", "yesterday"),
    ("--since", "1h", "--until", "2h"),
    ("--type", "bad name"),
    ("--format", "pdf"),
])
def test_bad_input_exits_2(pollbridge: Run, walked: str, args: tuple[str, ...]) -> None:
    result = pollbridge("reconcile", *args, env={"POLLBRIDGE_DATABASE_URL": walked})
    assert result.returncode == 2, result.stdout + result.stderr
    _no_traceback(result)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(("pollbridge: error:", "Error:")), result.stderr


def test_help_shows_env_vars(pollbridge: Run) -> None:
    result = pollbridge("reconcile", "--help")
    for var in ("POLLBRIDGE_RECONCILE_SINCE", "POLLBRIDGE_RECONCILE_FORMAT", "POLLBRIDGE_RECONCILE_GATE",
                "POLLBRIDGE_RECONCILE_CONTROL", "POLLBRIDGE_RECONCILE_OUTPUT"):
        assert var in result.stdout
