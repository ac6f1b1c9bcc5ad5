"""The guardian over SQLite and PostgreSQL (and, for the lag, every bus): what it demotes, why, and
what it leaves alone.

Each test fails if the guardian demoted too much (a type in polling or dual_write, a type whose own
threshold is not crossed, a type whose misses are too few or too old), too little, wrote its audit
row with the wrong actor, action or reason, or flapped. Waits are deadline-bounded (``wait_for``).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.app import install
from bridge.bus.redis_streams import RedisStreamsBus
from bridge.core.errors import PollbridgeError
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id
from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import Flag
from bridge.core.settings import GuardianSettings, SchedulerSettings
from bridge.db.clock import db_clock
from bridge.db.engine import create_engine, db_now
from bridge.db.schema import dispatch_log, flag_audit, flags
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.rollout.guardian import CheckReport, Finding, Guardian
from bridge.rollout.promotion import rollback
from bridge.tasktable.tables import TaskTable
from tests.support import Env, wait_for

GROUP = SchedulerSettings().group


# --- helpers -------------------------------------------------------------------------------------------------
def _set(store: FlagStore, name: str, phase: str, **kwargs: Any) -> None:
    store.change(name, phase, actor="test", reason="test set-up", **kwargs)


def _guardian(engine: Engine, store: FlagStore | None = None, **settings: Any) -> Guardian:
    return Guardian(engine, GuardianSettings(**settings), store=store or FlagStore(engine),
                    registry=CollectorRegistry())


def _seed(engine: Engine, tables: TaskTable, instance_id: str, workflow_type: str) -> None:
    """An instance of two tasks: the capture trigger writes their outbox rows in the same transaction."""
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(instance_id, workflow_type, (TaskSpec("a"), TaskSpec("b", ("a",))))])


def _at(engine: Engine, seconds_ago: float) -> Any:
    """The database clock minus ``seconds_ago``, as the dialect stores timestamps (SQLite: db_now()'s text)."""
    value = db_clock(engine) - timedelta(seconds=seconds_ago)
    if engine.dialect.name == "sqlite":
        return sa.literal(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3], sa.String())
    return value


def _plant(engine: Engine, workflow_type: str, *, events: int = 0, fallback: int = 0, poller: int = 0,
           seconds_ago: float | None = None) -> None:
    """Dispatch-log rows as the paths write them (``dispatched_at`` now, or ``seconds_ago``)."""
    at = db_now(engine.dialect.name) if seconds_ago is None else _at(engine, seconds_ago)
    rows = [{"task_id": uuid.uuid4().hex, "instance_id": f"i-{uuid.uuid4().hex[:8]}", "workflow_type": workflow_type,
             "task_key": "k", "attempt": 1, "path": path}
            for path, n in (("events", events), ("fallback", fallback), ("poller", poller)) for _ in range(n)]
    with engine.begin() as conn:
        conn.execute(dispatch_log.insert().values(dispatched_at=at), rows)


def _audit_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(flag_audit)).scalar_one())


def _finding(report: CheckReport, workflow_type: str, criterion: str) -> Finding:
    verdict = next(v for v in report.verdicts if v.workflow_type == workflow_type)
    return next(f for f in verdict.findings if f.criterion == criterion)


def _demotions(guardian: Guardian, workflow_type: str, reason: str) -> float:
    return guardian.value("pollbridge_guardian_demotions_total", {"workflow_type": workflow_type, "reason": reason})


# --- (a) stuck relay -----------------------------------------------------------------------------------------
def test_the_guardian_demotes_when_the_relay_is_stopped_and_the_backlog_ages_past_its_threshold(
        engine: Engine, tables: TaskTable, caplog: pytest.LogCaptureFixture) -> None:
    store = FlagStore(engine)
    _set(store, "orders", "cutover")
    _set(store, "canary", "selective", percent=25)
    _set(store, "reports", "polling")
    _set(store, "billing", "dual_write")  # poller authoritative: a stuck relay costs it nothing
    _set(store, "patient", "cutover", thresholds={"max_outbox_age": 3600})  # its own, lenient threshold
    for i, name in enumerate(("orders", "reports", "billing", "patient")):
        _seed(engine, tables, f"inst-{i}", name)
    # No relay runs: the captured rows stay unpublished.

    lenient = _guardian(engine, store, max_outbox_age=3600)
    report = lenient.check_once()
    assert report.unpublished >= 8
    assert report.demoted == [] and _finding(report, "orders", "outbox_age").state == "ok"
    assert store.get("orders").phase == "cutover"

    guardian = _guardian(engine, store, max_outbox_age=0.5)
    wait_for(lambda: guardian.outbox_age()[1] > 0.5, 30, what="the oldest outbox row to age past 0.5 s")
    before = {name: store.history(name) for name in ("reports", "billing", "patient")}
    with caplog.at_level(logging.WARNING, logger="bridge.rollout.guardian"):
        report = guardian.check_once()

    assert sorted(report.demoted) == ["canary", "orders"]
    assert {name: store.get(name).phase for name in ("orders", "canary", "reports", "billing", "patient")} == {
        "orders": "polling", "canary": "polling", "reports": "polling", "billing": "dual_write", "patient": "cutover"}
    for name in ("reports", "billing", "patient"):  # untouched: not even an audit row
        assert store.history(name) == before[name]
    last = store.history("orders")[-1]
    assert (last.actor, last.action, last.old_phase, last.new_phase) == ("guardian", "guardian", "cutover", "polling")
    measured = re.search(r"outbox row is ([0-9.]+) s old", last.reason)
    assert measured is not None and float(measured.group(1)) >= 0.5, last.reason
    assert "max_outbox_age 0.5 s" in last.reason
    assert store.get("orders").updated_by == "guardian"
    assert _finding(report, "patient", "outbox_age").state == "ok"
    assert _demotions(guardian, "orders", "outbox_age") == 1
    assert _demotions(guardian, "canary", "outbox_age") == 1
    assert guardian.value("pollbridge_guardian_outbox_age_seconds") > 0.5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("demoted orders cutover -> polling" in m and "outbox" in m for m in warnings), warnings


# --- (b) miss rate -------------------------------------------------------------------------------------------
def test_the_miss_rate_demotes_a_type_past_its_threshold_once_enough_dispatches_exist(engine: Engine) -> None:
    store = FlagStore(engine)
    for name in ("orders", "reports", "billing"):
        _set(store, name, "selective")
    _set(store, "lenient", "selective", thresholds={"max_miss_rate": 0.5})
    _plant(engine, "orders", events=8, fallback=2)      # 20% of 10: judged, above 10%
    _plant(engine, "reports", events=3, fallback=3, poller=10)  # 50%, but 6 < min_tasks (poller rows never count)
    _plant(engine, "billing", events=19, fallback=1)    # 5%: within
    _plant(engine, "lenient", events=8, fallback=2)     # 20%: within its own 50%
    guardian = _guardian(engine, store, min_tasks=10, max_miss_rate=0.1)

    report = guardian.check_once()

    assert report.demoted == ["orders"]
    assert {n: store.get(n).phase for n in ("orders", "reports", "billing", "lenient")} == {
        "orders": "polling", "reports": "selective", "billing": "selective", "lenient": "selective"}
    orders = _finding(report, "orders", "miss_rate")
    assert (orders.state, orders.value, orders.threshold) == ("exceeded", 0.2, 0.1)
    reports = _finding(report, "reports", "miss_rate")
    assert (reports.state, reports.value) == ("not_judged", 0.5)
    assert "6 dispatches" in reports.detail and "need 10" in reports.detail
    assert _finding(report, "billing", "miss_rate").state == "ok"
    assert _finding(report, "lenient", "miss_rate").state == "ok"
    last = store.history("orders")[-1]
    assert (last.actor, last.action, last.new_phase) == ("guardian", "guardian", "polling")
    assert "20.00%" in last.reason and "2 fallback of 10" in last.reason and "10.00%" in last.reason
    assert _demotions(guardian, "orders", "miss_rate") == 1
    assert guardian.value("pollbridge_guardian_miss_rate", {"workflow_type": "reports"}) == 0.5


def test_the_miss_rate_counts_only_the_window(engine: Engine) -> None:
    store = FlagStore(engine)
    _set(store, "orders", "selective")
    with engine.begin() as conn:  # in selective for two hours: the window, not the phase start, is the limit
        conn.execute(flags.update().where(flags.c.workflow_type == "orders").values(updated_at=_at(engine, 7200)))
    _plant(engine, "orders", fallback=10, seconds_ago=3600)  # misses an hour ago, outside a 300 s window
    _plant(engine, "orders", events=10, seconds_ago=10)
    guardian = _guardian(engine, store, min_tasks=10, max_miss_rate=0.1, window=300)

    first = guardian.check_once()
    assert first.demoted == []
    assert _finding(first, "orders", "miss_rate").value == 0.0

    _plant(engine, "orders", fallback=5)
    second = guardian.check_once()
    assert second.demoted == ["orders"]
    assert "5 fallback of 15" in store.history("orders")[-1].reason


# --- (c) no flapping -----------------------------------------------------------------------------------------
def test_no_flapping_after_a_demotion(engine: Engine) -> None:
    store = FlagStore(engine)
    _set(store, "orders", "selective")
    _plant(engine, "orders", events=8, fallback=2)
    guardian = _guardian(engine, store, min_tasks=10, max_miss_rate=0.1)
    assert guardian.check_once().demoted == ["orders"]
    audit_rows = _audit_count(engine)

    again = guardian.check_once()
    assert again.demoted == [] and again.unguarded == {"orders": "polling"}
    assert _audit_count(engine) == audit_rows
    assert _demotions(guardian, "orders", "miss_rate") == 1

    # An operator re-promotes: the misses from before that must not demote it again at once.
    _set(store, "orders", "selective")
    third = guardian.check_once()
    assert third.demoted == [] and store.get("orders").phase == "selective"
    assert _finding(third, "orders", "miss_rate").state == "not_judged"
    assert _audit_count(engine) == audit_rows + 1  # the operator's row only
    # ... while fresh misses still do.
    _plant(engine, "orders", events=5, fallback=5)
    assert guardian.check_once().demoted == ["orders"]


def test_a_type_moved_by_someone_else_during_the_check_is_left_alone(engine: Engine) -> None:
    class RacingStore(FlagStore):
        """An operator rolls the type back right after the guardian read the flags."""

        raced = False

        def all(self) -> dict[str, Flag]:
            seen = super().all()
            if not self.raced:
                self.raced = True
                rollback(FlagStore(self.engine), ["orders"], reason="operator", actor="ops")
            return seen

    setup = FlagStore(engine)
    _set(setup, "orders", "selective")
    _plant(engine, "orders", events=8, fallback=2)
    guardian = _guardian(engine, RacingStore(engine), min_tasks=10, max_miss_rate=0.1)

    report = guardian.check_once()

    assert report.demoted == [] and report.verdicts[0].action == "skipped"
    assert [(c.actor, c.action) for c in setup.history("orders")] == [("test", "set"), ("ops", "rollback")]
    assert _demotions(guardian, "orders", "miss_rate") == 0


# --- (d) lag -------------------------------------------------------------------------------------------------
def test_lag_past_its_threshold_demotes(env: Env) -> None:
    bus = env.open_bus()
    bus.ensure_group(GROUP)
    store = FlagStore(env.engine)
    _set(store, "orders", "cutover")
    _set(store, "reports", "selective", thresholds={"max_lag": 1000})
    _set(store, "billing", "dual_write")
    events = [CloudEvent(id=new_event_id(), type=TASK_STATUS_CHANGED, subject=str(i), partitionkey=f"inst-{i}",
                         time=datetime.now(UTC), data={"task_id": str(i), "workflow_type": "orders"})
              for i in range(5)]
    bus.publish(events)  # nobody reads them

    lenient = Guardian(env.engine, GuardianSettings(max_lag=100), bus=bus, store=store, registry=CollectorRegistry())
    first = lenient.check_once()
    assert first.lag == 5 and first.demoted == []

    guardian = Guardian(env.engine, GuardianSettings(max_lag=3), bus=bus, store=store, registry=CollectorRegistry())
    report = guardian.check_once()

    assert report.demoted == ["orders"]
    assert (store.get("reports").phase, store.get("billing").phase) == ("selective", "dual_write")
    last = store.history("orders")[-1]
    assert (last.actor, last.action, last.new_phase) == ("guardian", "guardian", "polling")
    assert "is 5 entries" in last.reason and "max_lag 3" in last.reason and GROUP in last.reason
    assert guardian.value("pollbridge_guardian_lag") == 5
    assert _demotions(guardian, "orders", "lag") == 1


def test_an_unreachable_bus_skips_the_lag_but_not_the_other_criteria(
        engine: Engine, tables: TaskTable, caplog: pytest.LogCaptureFixture) -> None:
    store = FlagStore(engine)
    _set(store, "orders", "cutover")
    _set(store, "reports", "selective")
    _seed(engine, tables, "inst-1", "orders")
    _plant(engine, "reports", events=5, fallback=5)
    bus = RedisStreamsBus("redis://127.0.0.1:1/0", partitions=2, socket_timeout=2.0)  # nothing listens there
    try:
        guardian = Guardian(engine, GuardianSettings(max_outbox_age=0.5, max_lag=1, min_tasks=10, max_miss_rate=0.1),
                            bus=bus, store=store, registry=CollectorRegistry(), bus_label="bus redis://127.0.0.1:1/0")
        wait_for(lambda: guardian.outbox_age()[1] > 0.5, 30, what="the oldest outbox row to age past 0.5 s")
        with caplog.at_level(logging.WARNING, logger="bridge.rollout.guardian"):
            report = guardian.check_once()
    finally:
        bus.close()

    assert report.lag is None and "unreachable" in report.lag_detail
    assert _finding(report, "orders", "lag").state == "unknown"
    assert _finding(report, "orders", "outbox_age").state == "exceeded"
    assert _finding(report, "reports", "miss_rate").state == "exceeded"
    assert sorted(report.demoted) == ["orders", "reports"]
    assert _demotions(guardian, "reports", "outbox_age") == 1  # the first tripped criterion names the demotion
    assert "fallback-miss rate 50.00%" in store.history("reports")[-1].reason
    assert math.isnan(guardian.value("pollbridge_guardian_lag"))
    assert any("lag criterion skipped" in r.getMessage() for r in caplog.records), caplog.text


# --- failures ------------------------------------------------------------------------------------------------
def test_a_check_against_a_database_that_is_down_raises_and_is_counted() -> None:
    engine = create_engine("postgresql://root@127.0.0.1:1/nowhere")  # nothing listens there
    try:
        guardian = _guardian(engine)
        with pytest.raises(PollbridgeError):
            guardian.check_once()
    finally:
        engine.dispose()
    assert guardian.value("pollbridge_guardian_checks_total") == 1
    assert guardian.value("pollbridge_guardian_errors_total") == 1


def test_failing_checks_never_end_the_loop(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'late.db'}")  # pollbridge not installed yet: checks fail
    guardian = _guardian(engine, interval=0.05)
    stop = threading.Event()
    thread = threading.Thread(target=guardian.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: guardian.value("pollbridge_guardian_errors_total") >= 3, 30, what="three failed checks")
        assert thread.is_alive()
        install.init(engine, demo_schema=True, mapping=TaskTableMapping())
        errors = guardian.value("pollbridge_guardian_errors_total")
        checks = guardian.value("pollbridge_guardian_checks_total")
        wait_for(lambda: guardian.value("pollbridge_guardian_checks_total") >= checks + 3, 30,
                 what="three more checks")
        # At most the one check already running during the install failed; the others succeeded.
        assert guardian.value("pollbridge_guardian_errors_total") <= errors + 1
    finally:
        stop.set()
        thread.join(10)
        engine.dispose()
    assert not thread.is_alive()
