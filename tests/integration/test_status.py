"""``status`` (and the metrics collector built on it) over SQLite and PostgreSQL, and every bus for the lag.

A workload driven by the real paths (the legacy poller, its safety sweep, the relay, the event scheduler
in ``dual_write``) must show up in the per-type counts exactly; the outbox backlog and its age, the bus's
lag per partition, pending entries and dead letters must match what was published, read and
dead-lettered; an unreachable bus is ``unknown`` with its reason (never a failure, never a password);
guardian demotions come from the audit trail; a flag store that cannot be read is reported as down.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy.engine import Engine

from bridge.bus import open_bus
from bridge.bus.base import partition_for
from bridge.capture.relay import Relay
from bridge.core.errors import FlagStoreUnavailable
from bridge.core.phases import Flag
from bridge.core.settings import RelaySettings, SchedulerSettings
from bridge.db.schema import dispatch_log, outbox
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reconcile.status import Status, StatusCollector, gather_status
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.rollout.promotion import rollback
from bridge.tasktable.tables import TaskTable
from event_scheduler.scheduler import EventScheduler
from legacy_poller.poller import LegacyPoller
from tests.support import Env

GROUP = "status-test"
RELAY = RelaySettings(batch_size=1000, purge_interval=3600)
SCHED = SchedulerSettings(group=GROUP, batch_size=100, block=0.05, lease_ttl=30.0)


def _seed(engine: Engine, tables: TaskTable, workflow_type: str, instances: int, prefix: str,
          tasks: tuple[TaskSpec, ...] = (TaskSpec("a"), TaskSpec("b", ("a",)))) -> list[str]:
    specs = [WorkflowSpec(f"{prefix}{n}", workflow_type, tasks) for n in range(instances)]
    with engine.begin() as conn:
        seed(conn, tables, specs)
    return [s.instance_id for s in specs]


def _set(engine: Engine, workflow_type: str, phase: str, **kwargs: Any) -> None:
    FlagStore(engine).change(workflow_type, phase, actor="test", reason="test set-up", **kwargs)


def _poller(engine: Engine, tables: TaskTable) -> LegacyPoller:
    router = FlagRouter(FlagStore(engine), refresh_interval=0.0, registry=CollectorRegistry())
    return LegacyPoller(engine, tables, router=router, registry=CollectorRegistry())


def _status(engine: Engine, **kwargs: Any) -> Status:
    kwargs.setdefault("group", GROUP)
    return gather_status(engine, **kwargs)


# --- per type --------------------------------------------------------------------------------------------
def test_dispatches_by_path_misses_and_decisions_per_type(engine: Engine, tables: TaskTable) -> None:
    _set(engine, "etl", "dual_write")
    _set(engine, "etl2", "selective", percent=25.0)
    _seed(engine, tables, "orders", 3, "o")     # polling: the poller dispatches the 3 roots
    _seed(engine, tables, "reports", 2, "r")    # cutover, no scheduler acting: the sweep catches the 2 roots
    _seed(engine, tables, "etl", 4, "e")        # dual_write: shadow decisions, then the poller dispatches
    bus = open_bus("embedded", engine=engine, partitions=2)
    sched = EventScheduler(engine, tables, bus, SCHED, _router(engine), registry=CollectorRegistry(),
                           holder="status-test")
    sched.refresh_leases()  # catch-up: the ready etl roots get their shadow decisions
    _set(engine, "reports", "cutover", grace_seconds=0.05)  # after the scheduler read the flags
    poller = _poller(engine, tables)
    poller.scan_once()
    time.sleep(0.1)
    assert poller.sweep_once().fallback == 2
    # An old dispatch, outside a 300 s window but inside a 2 h one.
    with engine.begin() as conn:
        conn.execute(dispatch_log.insert().values(
            task_id="999", instance_id="old", workflow_type="orders", task_key="x", attempt=1, path="events",
            dispatched_at=_stamp(engine, datetime.now(UTC) - timedelta(hours=1))))

    status = _status(engine, bus=bus)
    assert [t.workflow_type for t in status.types] == ["etl", "etl2", "orders", "reports"]
    orders, reports, etl, etl2 = (status.type(n) for n in ("orders", "reports", "etl", "etl2"))
    assert orders is not None and reports is not None and etl is not None and etl2 is not None
    assert (orders.phase, orders.flag_source, orders.dispatches) == (
        "polling", "default", {"poller": 3, "events": 0, "fallback": 0})
    assert (reports.phase, reports.dispatches, reports.fallback_misses) == (
        "cutover", {"poller": 0, "events": 0, "fallback": 2}, 2)
    assert (etl.phase, etl.decisions, etl.dispatches["poller"]) == ("dual_write", 4, 4)
    assert (etl2.phase, etl2.percent, etl2.flag_source, sum(etl2.dispatches.values())) == (
        "selective", 25.0, "flag", 0)
    assert status.totals == {"poller": 7, "events": 0, "fallback": 2, "decisions": 4, "parked": 0, "held_back": 0}
    assert status.window_seconds == 300.0

    wide = _status(engine, bus=bus, window=7200)
    wide_orders = wide.type("orders")
    assert wide_orders is not None and wide_orders.dispatches["events"] == 1


def _router(engine: Engine) -> FlagRouter:
    router = FlagRouter(FlagStore(engine), refresh_interval=3600, registry=CollectorRegistry())
    router.refresh()
    return router


def _stamp(engine: Engine, value: datetime) -> Any:
    return value.astimezone(UTC).replace(tzinfo=None) if engine.dialect.name == "sqlite" else value


# --- the outbox --------------------------------------------------------------------------------------------
def test_outbox_backlog_and_the_age_of_the_oldest_row(engine: Engine, tables: TaskTable) -> None:
    before = _status(engine)
    assert (before.outbox_backlog, before.outbox_oldest_age_seconds) == (0, 0.0)
    _seed(engine, tables, "orders", 3, "ob")
    time.sleep(0.3)
    status = _status(engine)
    assert status.outbox_backlog == 6
    assert 0.3 <= status.outbox_oldest_age_seconds < 30
    with engine.begin() as conn:  # a row the relay cannot publish goes to the relay's dead letters
        conn.execute(outbox.insert().values(event_id="bad", change="bogus", created_at=datetime.now(UTC)))
    Relay(engine, open_bus("embedded", engine=engine, partitions=2), RELAY,
          statuses=tables.mapping.statuses).publish_batch()
    after = _status(engine)
    assert (after.outbox_backlog, after.outbox_oldest_age_seconds, after.outbox_dead_letters) == (0, 0.0, 1)


# --- the bus, every backend --------------------------------------------------------------------------------
def test_lag_pending_and_dead_letters_on_every_bus(env: Env) -> None:
    engine, tables = env.engine, env.tables
    bus = env.open_bus()
    bus.ensure_group(GROUP)
    label = "the test bus"
    empty = _status(engine, bus=bus, bus_label=label)
    assert (empty.bus.state, empty.bus.lag, empty.bus.pending, empty.bus.dead_letters) == ("ok", 0, 0, 0)
    assert empty.bus.lag_partitions == dict.fromkeys(range(bus.partitions), 0)

    instances = _seed(engine, tables, "orders", 6, "lag", tasks=(TaskSpec("a"),))
    assert Relay(engine, bus, RELAY, statuses=tables.mapping.statuses).publish_batch() == 6
    expected = Counter(partition_for(i, bus.partitions) for i in instances)
    status = _status(engine, bus=bus, bus_label=label)
    assert status.bus.state == "ok" and status.bus.lag == 6
    assert status.bus.lag_partitions == {p: expected.get(p, 0) for p in range(bus.partitions)}

    got = bus.read(GROUP, "probe", list(range(bus.partitions)), 2, 0.0)
    assert len(got) == 2
    bus.dead_letter(GROUP, got[0], "poison for the test")
    status = _status(engine, bus=bus, bus_label=label)
    assert (status.bus.lag, status.bus.pending, status.bus.dead_letters) == (4, 1, 1)
    assert status.bus.group == GROUP and status.bus.url == label


def test_an_unreachable_bus_is_unknown_with_its_reason_and_no_password(engine: Engine) -> None:
    bus = open_bus("redis://alice:s3cret@127.0.0.1:1/0", socket_timeout=1.0)
    try:
        status = _status(engine, bus=bus, bus_label="redis://alice:***@127.0.0.1:1/0")
    finally:
        bus.close()
    assert status.bus.state == "unknown"
    assert status.bus.reason.startswith("bus redis://alice:***@127.0.0.1:1/0 unreachable: ")
    assert (status.bus.lag, status.bus.lag_partitions, status.bus.pending, status.bus.dead_letters) == (
        None, None, None, None)
    assert "s3cret" not in json.dumps(status.to_json())
    assert status.flag_store_up  # the rest is still there

    none = _status(engine, bus=None, bus_error="bus redis://x could not be opened")
    assert (none.bus.state, none.bus.reason) == ("unknown", "bus redis://x could not be opened")


# --- guardian and flag store -------------------------------------------------------------------------------
def test_guardian_demotions_come_from_the_audit_trail(engine: Engine) -> None:
    store = FlagStore(engine)
    _set(engine, "orders", "cutover")
    _set(engine, "reports", "selective")
    rollback(store, ["orders"], reason="guardian: lag 20000 above max_lag 10000", actor="guardian", action="guardian")
    rollback(store, ["reports"], reason="operator rollback", actor="alice")
    _set(engine, "orders", "selective")
    rollback(store, ["orders"], reason="guardian: outbox 90 s above 60 s", actor="guardian", action="guardian")
    status = _status(engine)
    orders, reports = status.type("orders"), status.type("reports")
    assert orders is not None and reports is not None
    assert (orders.guardian_demotions, reports.guardian_demotions) == (2, 0)
    assert [(d.workflow_type, d.old_phase, d.new_phase, d.reason) for d in status.guardian_recent] == [
        ("orders", "selective", "polling", "guardian: outbox 90 s above 60 s"),
        ("orders", "cutover", "polling", "guardian: lag 20000 above max_lag 10000")]
    assert all(d.changed_at is not None for d in status.guardian_recent)
    assert status.to_json()["guardian"]["demotions"] == 2


class DownStore(FlagStore):
    def all(self) -> dict[str, Flag]:
        raise FlagStoreUnavailable("cannot read the flag store: injected outage")


def test_a_flag_store_that_cannot_be_read_is_reported_down(engine: Engine, tables: TaskTable) -> None:
    _seed(engine, tables, "orders", 1, "fs")
    _poller(engine, tables).scan_once()
    status = _status(engine, store=DownStore(engine))
    assert (status.flag_store_up, status.flag_store_detail) == (False, "cannot read the flag store: injected outage")
    orders = status.type("orders")
    assert orders is not None and (orders.phase, orders.flag_source) == ("unknown", "unavailable")
    assert _status(engine).flag_store_up is True


# --- JSON and metrics --------------------------------------------------------------------------------------
def test_json_has_the_documented_keys(engine: Engine) -> None:
    _set(engine, "orders", "dual_write")
    doc = _status(engine, bus=open_bus("embedded", engine=engine, partitions=2), bus_label="embedded",
                  database_label="postgresql://u:***@h/db").to_json()
    assert set(doc) == {"checked_at", "window_seconds", "database", "types", "totals", "outbox", "bus", "guardian",
                        "flag_store", "capture"}
    assert doc["capture"] == {"mode": "trigger"}
    assert doc["database"] == "postgresql://u:***@h/db"
    assert set(doc["types"][0]) == {"workflow_type", "phase", "percent", "flag_source", "dispatches",
                                    "fallback_misses", "decisions", "guardian_demotions", "review", "held_back"}
    assert set(doc["outbox"]) == {"backlog", "oldest_age_seconds", "dead_letters"}
    assert set(doc["bus"]) == {"url", "group", "state", "reason", "lag", "lag_partitions", "pending", "dead_letters",
                               "placement"}
    assert doc["bus"]["placement"] is None  # one place: only a Redis Cluster spreads partitions
    assert doc["bus"]["lag_partitions"] == {"0": 0, "1": 0}
    assert set(doc["guardian"]) == {"demotions", "recent"}
    assert set(doc["flag_store"]) == {"up", "detail"}
    json.dumps(doc)


def test_the_collector_exposes_status_on_each_scrape(engine: Engine, tables: TaskTable) -> None:
    _set(engine, "orders", "selective", percent=10.0)
    bus = open_bus("embedded", engine=engine, partitions=2)
    bus.ensure_group(GROUP)
    registry = CollectorRegistry()
    registry.register(StatusCollector(lambda: _status(engine, bus=bus)))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("pollbridge_status_up") == 1 and value("pollbridge_flag_store_up") == 1
    assert value("pollbridge_phase", workflow_type="orders", phase="selective") == 1
    assert value("pollbridge_phase", workflow_type="orders", phase="polling") == 0
    assert value("pollbridge_phase_percent", workflow_type="orders") == 10
    assert value("pollbridge_outbox_backlog") == 0

    ids = _seed(engine, tables, "reports", 2, "col", tasks=(TaskSpec("a"),))
    assert value("pollbridge_outbox_backlog") == 2  # gathered again on this scrape
    assert value("pollbridge_outbox_oldest_age_seconds") is not None
    Relay(engine, bus, RELAY, statuses=tables.mapping.statuses).publish_batch()
    assert sum(value("pollbridge_bus_lag", partition=str(p)) or 0 for p in range(2)) == 2
    _poller(engine, tables).scan_once()
    assert value("pollbridge_dispatches_window", workflow_type="reports", path="poller") == 2
    assert value("pollbridge_dispatches_window", workflow_type="reports", path="fallback") == 0
    assert value("pollbridge_bus_pending") == 0 and value("pollbridge_dead_letters") == 0
    rollback(FlagStore(engine), ["orders"], reason="guardian: test", actor="guardian", action="guardian")
    assert value("pollbridge_guardian_demotions", workflow_type="orders") == 1
    assert value("pollbridge_phase", workflow_type="orders", phase="polling") == 1
    assert len(ids) == 2

    text = generate_latest(registry).decode()
    for name in ("pollbridge_phase", "pollbridge_dispatches_window", "pollbridge_outbox_backlog",
                 "pollbridge_outbox_oldest_age_seconds", "pollbridge_bus_lag", "pollbridge_bus_pending",
                 "pollbridge_dead_letters", "pollbridge_guardian_demotions", "pollbridge_flag_store_up"):
        assert f"# TYPE {name} gauge" in text, name


def test_the_collector_reports_a_failed_gathering_instead_of_failing_the_scrape() -> None:
    def broken() -> Status:
        raise sa.exc.OperationalError("SELECT 1", {}, Exception("connection refused"))

    collector = StatusCollector(broken)
    registry = CollectorRegistry()
    registry.register(collector)
    assert registry.get_sample_value("pollbridge_status_up") == 0
    assert registry.get_sample_value("pollbridge_flag_store_up") == 0
    assert collector.last_error == "connection refused"


def test_an_unreachable_bus_leaves_the_lag_out_of_the_metrics(engine: Engine) -> None:
    registry = CollectorRegistry()
    registry.register(StatusCollector(lambda: _status(engine, bus=None, bus_error="no bus")))
    assert registry.get_sample_value("pollbridge_bus_up") == 0
    assert registry.get_sample_value("pollbridge_bus_pending") is None
    assert registry.get_sample_value("pollbridge_flag_store_up") == 1
    assert "pollbridge_bus_lag{" not in generate_latest(registry).decode()
