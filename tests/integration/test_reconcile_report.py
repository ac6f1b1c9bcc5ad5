"""The reconcile report on real paths: a type walked polling -> dual_write -> selective by the real
poller, relay and event scheduler, then classified (both dialects).

Proves: the report sees what each path did (matched shadow decisions and event dispatches, the
poller's dispatches while authoritative), the phases over the window come from the audit trail, the
latency percentiles are the dispatch log's figures, a planted fallback dispatch is a ``missing`` with
its explanation, a planted early dispatch and a duplicate are caught, the verdict follows the
criteria, the HTML is self-contained and escapes what it shows, and ``--control`` judges the poller.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.bus import open_bus
from bridge.capture.relay import Relay
from bridge.core.settings import GateSettings, RelaySettings, SchedulerSettings, WorkerSettings
from bridge.db.clock import as_utc, db_clock
from bridge.db.schema import decisions, dispatch_log, flag_audit, flags
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reconcile.html import render_html
from bridge.reconcile.report import HISTOGRAM_EDGES_MS, TIMELINE_BUCKETS, Report, build_report, parse_when
from bridge.reference.oracle import percentile
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import TaskTable
from event_scheduler.scheduler import EventScheduler
from legacy_poller.poller import LegacyPoller
from legacy_poller.workers import WorkerPool

CHAIN = (TaskSpec("a"), TaskSpec("b", ("a",)), TaskSpec("c", ("b",)))
GATES = GateSettings(min_tasks=10, miss_budget=0.5, tolerance=1.0)


@dataclass
class Drive:
    engine: Engine
    tables: TaskTable
    store: FlagStore
    router: FlagRouter
    relay: Relay
    sched: EventScheduler
    poller: LegacyPoller
    workers: WorkerPool

    def load(self, prefix: str, n: int, workflow_type: str = "orders") -> None:
        with self.engine.begin() as conn:
            seed(conn, self.tables, [WorkflowSpec(f"{prefix}{i}", workflow_type, CHAIN) for i in range(n)])

    def run(self, rounds: int) -> None:
        for i in range(rounds):
            while self.relay.publish_batch():
                pass
            while self.sched.poll_once(block=0.0):
                pass
            if i % 4 == 0:
                self.poller.scan_once()
            while self.workers.work_one():
                pass

    def phase(self, phase: str, percent: float | None = None) -> None:
        self.store.change("orders", phase, actor="test", reason="walk", percent=percent)
        self.router.refresh()

    def settled(self, instance_ids: list[str]) -> bool:
        from bridge.reference.oracle import verify

        with self.engine.connect() as conn:
            return verify(conn, self.tables, instance_ids).unsettled == 0

    @classmethod
    @contextmanager
    def open(cls, engine: Engine, tables: TaskTable) -> Iterator[Drive]:
        store = FlagStore(engine, default_grace=0.2)
        router = FlagRouter(store, refresh_interval=3600, registry=CollectorRegistry())
        router.refresh()
        bus = open_bus("embedded", engine=engine, partitions=2)
        sched = EventScheduler(engine, tables, bus, SchedulerSettings(group="rec"), router, visibility_timeout=0.2,
                               registry=CollectorRegistry(), holder="rec-test")
        sched.refresh_leases()
        d = cls(engine, tables, store, router,
                Relay(engine, bus, RelaySettings(), statuses=tables.mapping.statuses), sched,
                LegacyPoller(engine, tables, router=router, registry=CollectorRegistry()),
                WorkerPool(engine, tables, WorkerSettings(concurrency=1, min_duration=0.0, max_duration=0.0), seed=1))
        try:
            yield d
        finally:
            sched.leases.release_all()  # on a SQLite file its lock files: the next Drive's scheduler takes them
            bus.close()


@pytest.fixture
def drive(engine: Engine, tables: TaskTable) -> Iterator[Drive]:
    with Drive.open(engine, tables) as d:
        yield d


def _walk(d: Drive) -> tuple[Any, Any]:
    """polling (5 instances) -> dual_write (6) -> selective 100% (6); returns (start, end) on the DB clock."""
    start = db_clock(d.engine) - timedelta(seconds=1)
    d.load("p", 5)
    d.run(16)
    d.phase("dual_write")
    d.load("d", 6)
    d.run(16)
    d.phase("selective")
    d.load("s", 6)
    d.run(16)
    return start, db_clock(d.engine) + timedelta(seconds=1)


def _report(d: Drive, start: Any, end: Any, **kwargs: Any) -> Report:
    return build_report(d.engine, d.tables, start, end, settings=GATES, **kwargs)


def test_the_report_sees_both_paths_over_a_walk_through_the_phases(drive: Drive) -> None:
    start, end = _walk(drive)
    report = _report(drive, start, end)
    (orders,) = report.types
    c = orders.counts
    # 5 polling instances: the poller's alone; 6 dual_write: the poller's dispatches, each matched by a
    # shadow decision; 6 selective (every instance): dispatched by the event path.
    assert c.get("poller", 0) == 15
    assert c.get("matched", 0) == 18 + 18
    assert sum(c.get(k, 0) for k in ("missing", "extra", "duplicate", "early")) == 0
    assert [p.phase for p in orders.phases] == ["polling", "dual_write", "selective"]
    assert orders.phase == "selective"
    assert orders.verdict == "pass" and report.verdict == "pass"
    assert [ch.new_phase for ch in report.flag_changes] == ["dual_write", "selective"]
    # The events latency is the dispatch log's (selective) and decision (dual_write) figures.
    with drive.engine.connect() as conn:
        rows = conn.execute(sa.select(dispatch_log.c.path, dispatch_log.c.ready_at, dispatch_log.c.dispatched_at)
                            .where(dispatch_log.c.path == "events")).all()
    assert orders.latency_ms["events"]["n"] == 18 + 18
    event_ms = sorted((r.dispatched_at - r.ready_at).total_seconds() * 1000 for r in rows)
    assert orders.latency_ms["events"]["max"] >= max(event_ms) - 1  # decisions may be slower still
    poller_n = orders.latency_ms["poller"]["n"]
    assert poller_n == 15 + 18  # every poller dispatch: in polling and in dual_write
    json_form = report.to_json()
    assert set(json_form) >= {"window", "verdict", "types", "mismatches", "flag_changes"}
    assert set(json_form["types"][0]) >= {"workflow_type", "phase", "tasks", "matched", "missing", "extra",
                                          "duplicate", "early", "late", "pending", "latency_ms",
                                          "miss_rate_upper_95", "verdict", "failed_criteria"}


def test_histograms_and_timelines_count_every_first_action(drive: Drive) -> None:
    """The chart's data, recomputed here from the dispatch log and the decisions: per path, the cumulative
    count of first actions at or under each latency edge, and the first actions per time bucket."""
    start, end = _walk(drive)
    with drive.engine.connect() as conn:
        rows = [(r.task_id, r.attempt, r.path, r.ready_at, r.at) for r in conn.execute(
            sa.select(dispatch_log.c.task_id, dispatch_log.c.attempt, dispatch_log.c.path, dispatch_log.c.ready_at,
                      dispatch_log.c.dispatched_at.label("at")))]
        rows += [(r.task_id, r.attempt, "decision", r.ready_at, r.at) for r in conn.execute(
            sa.select(decisions.c.task_id, decisions.c.attempt, decisions.c.ready_at,
                      decisions.c.decided_at.label("at")))]
    firsts: dict[tuple[str, int], dict[str, Any]] = {}
    for task_id, attempt, kind, ready_at, at in rows:
        f = firsts.setdefault((task_id, attempt), {})
        f[kind] = min(f.get(kind, at), at)
        f["ready"] = min(f.get("ready", ready_at), ready_at)

    sqlite = drive.engine.dialect.name == "sqlite"

    def utc(value: Any) -> datetime:
        stamp = as_utc(value)
        assert stamp is not None
        if sqlite:  # SQLite's date functions round a time to the millisecond
            stamp = stamp.replace(microsecond=0) + timedelta(milliseconds=int(stamp.microsecond / 1000 + 0.5))
        return stamp

    def ms(f: dict[str, Any], *kinds: str) -> float | None:
        at = next((f[k] for k in kinds if k in f), None)
        return None if at is None else (utc(at) - utc(f["ready"])).total_seconds() * 1000.0

    expected_hist: dict[str, list[int]] = {}
    expected_timeline: dict[str, list[int]] = {}
    on_edge: list[str] = []
    # SQLite binds the window's start as text to the millisecond (bridge.reconcile.classify.bind_time); PostgreSQL
    # binds it whole (truncating it there too put an action up to 1 ms past an edge a bucket late).
    since = utc(start.replace(microsecond=start.microsecond // 1000 * 1000) if sqlite else start)
    for f in firsts.values():
        for path, value in (("poller", ms(f, "poller")), ("events", ms(f, "events", "decision")),
                            ("fallback", ms(f, "fallback"))):
            if value is not None:
                hist = expected_hist.setdefault(path, [0] * (len(HISTOGRAM_EDGES_MS) + 1))
                for j, edge in enumerate(HISTOGRAM_EDGES_MS):
                    hist[j] += value <= edge
                hist[-1] += 1
        path = next(p for p in ("events", "fallback", "poller", "decision") if p in f)
        at = utc(f[path])
        # The documented buckets (docs/reconcile.md): the window cut into TIMELINE_BUCKETS of equal width, each
        # [start, end), so an action exactly on an edge opens the next bucket. Exact, in whole microseconds
        # (timedelta arithmetic): the times are whole milliseconds on SQLite and a poller batch shares one, so
        # a batch lands exactly on an edge (mostly the window's middle) in a run or two in a hundred, where a
        # floating-point ``seconds // width`` put it a bucket early half of the time (1.294 s // 0.0431333 s = 29).
        bucket = min((at - since) * TIMELINE_BUCKETS // (end - start), TIMELINE_BUCKETS - 1)
        expected_timeline.setdefault(path, [0] * TIMELINE_BUCKETS)[bucket] += 1
        if (at - since) * TIMELINE_BUCKETS % (end - start) == timedelta(0):
            on_edge.append(f"{path} at {at} opens bucket {bucket}")
    (orders,) = _report(drive, start, end).types
    assert orders.histogram == expected_hist
    assert orders.timeline == expected_timeline, f"actions exactly on a bucket edge: {on_edge or 'none'}"
    assert sum(map(sum, orders.timeline.values())) == orders.counts["poller"] + orders.counts["matched"]


def test_planted_misses_and_violations_are_classified_and_explained(drive: Drive) -> None:
    start, end = _walk(drive)
    with drive.engine.begin() as conn:
        events = conn.execute(sa.select(dispatch_log).where(dispatch_log.c.path == "events")
                              .order_by(dispatch_log.c.id)).all()
        missed, doubled, early = events[0], events[1], events[2]
        # A fallback catch: the event path "missed" it.
        conn.execute(dispatch_log.update().where(dispatch_log.c.id == missed.id).values(path="fallback"))
        # The same attempt dispatched twice.
        conn.execute(dispatch_log.insert().values(
            task_id=doubled.task_id, instance_id=doubled.instance_id, workflow_type=doubled.workflow_type,
            task_key=doubled.task_key, attempt=doubled.attempt, path="poller", ready_at=doubled.ready_at,
            dispatched_at=doubled.dispatched_at + timedelta(milliseconds=1)))
    # Early: a task that depends on another, recorded as dispatched before that dependency completed.
    t = drive.tables.tasks
    with drive.engine.begin() as conn:
        dep_done = conn.execute(sa.select(t.c.completed_at).where(
            t.c.instance_id == early.instance_id, t.c.task_key == "a")).scalar_one()
        target = conn.execute(sa.select(dispatch_log.c.id).where(
            dispatch_log.c.instance_id == early.instance_id, dispatch_log.c.task_key == "b")).scalar_one()
        conn.execute(dispatch_log.update().where(dispatch_log.c.id == target)
                     .values(dispatched_at=dep_done - timedelta(seconds=1)))
    report = _report(drive, start - timedelta(seconds=5), end)
    (orders,) = report.types
    assert orders.counts.get("missing") == 1
    assert orders.counts.get("duplicate") == 1
    assert orders.counts.get("early") == 1
    kinds = {m.kind: m for m in report.mismatches}
    assert "fallback" in kinds["missing"].detail and kinds["missing"].task_id == missed.task_id
    assert "2 times" in kinds["duplicate"].detail
    assert "before its readiness" in kinds["early"].detail
    assert orders.verdict == "fail"
    failed = {c.name for c in orders.criteria if not c.passed}
    assert failed == {"no_early", "no_duplicate"}


def test_too_few_tasks_fail_and_a_polling_type_is_not_judged(drive: Drive) -> None:
    drive.load("q", 3, workflow_type="reports")  # reports stays in polling
    start, end = _walk(drive)
    strict = GateSettings(min_tasks=1000, tolerance=1.0)
    report = build_report(drive.engine, drive.tables, start, end, settings=strict)
    by_type = {t.workflow_type: t for t in report.types}
    assert by_type["orders"].verdict == "fail"
    assert [c.name for c in by_type["orders"].criteria if not c.passed] == ["min_tasks", "miss_rate"]
    # Not judged (no criteria), and with no compared task it has no evidence: never a pass.
    assert by_type["reports"].criteria == () and by_type["reports"].verdict == "no_evidence"
    assert report.verdict == "fail"


def test_control_judges_the_poller_against_itself(drive: Drive) -> None:
    start, end = _walk(drive)
    report = _report(drive, start, end, control=True)
    (orders,) = report.types
    # Every poller dispatch is judged; the event path's own dispatches are not.
    assert orders.counts.get("matched", 0) + orders.counts.get("late", 0) == 15 + 18
    assert orders.counts.get("events", 0) == 18
    assert report.control and report.to_json()["control"] is True


def test_html_is_self_contained_and_escapes(drive: Drive) -> None:
    start, _end = _walk(drive)
    drive.store.change("orders", "polling", actor="<script>x</script>", reason="r", action="rollback")
    report = _report(drive, start, db_clock(drive.engine) + timedelta(seconds=1))
    html = render_html(report)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "src=" not in html and "href=" not in html  # nothing external
    assert html.count("<svg") == 2  # the CDF and the timeline of the one type

    class Collect(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: list[str] = []

        def handle_starttag(self, tag: str, attrs: Any) -> None:
            self.tags.append(tag)

    parser = Collect()
    parser.feed(html)
    assert {"table", "svg", "polyline", "h1"} <= set(parser.tags)


def test_parse_when() -> None:
    from datetime import UTC, datetime

    from bridge.core.errors import ConfigError

    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert parse_when("30m", now) == now - timedelta(minutes=30)
    assert parse_when("2h", now) == now - timedelta(hours=2)
    assert parse_when("1d", now) == now - timedelta(days=1)
    assert parse_when("2026-11-29T10:00:00", now) == datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    for bad in ("yesterday", "-5m", "", "5x"):
        with pytest.raises(ConfigError):
            parse_when(bad, now)
    assert percentile([1.0, 2.0], 50) == 1.0


# --- the tests: every mismatch kind planted and explained; clean runs have none; the schema ---------
SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "schemas" / "reconcile.schema.json"


def _validate(report: Report) -> None:
    import jsonschema

    jsonschema.validate(report.to_json(), json.loads(SCHEMA.read_text()))


def _dual_write_then_selective(d: Drive) -> tuple[Any, Any]:
    start = db_clock(d.engine) - timedelta(seconds=1)
    d.phase("dual_write")
    d.load("d", 4)
    d.run(12)
    d.phase("selective")
    d.load("s", 4)
    d.run(12)
    return start, db_clock(d.engine) + timedelta(seconds=1)


def test_a_deleted_decision_is_missing(drive: Drive) -> None:
    start, end = _dual_write_then_selective(drive)
    with drive.engine.begin() as conn:
        victim = conn.execute(sa.select(decisions.c.id, decisions.c.task_id).order_by(decisions.c.id)).first()
        assert victim is not None
        conn.execute(decisions.delete().where(decisions.c.id == victim.id))
    report = _report(drive, start, end)
    _validate(report)
    (m,) = [m for m in report.mismatches if m.kind == "missing"]
    assert m.task_id == victim.task_id
    assert "no shadow decision" in m.detail and "dual_write" in m.detail


def test_a_delayed_dispatch_is_late(drive: Drive) -> None:
    start, end = _dual_write_then_selective(drive)
    with drive.engine.begin() as conn:
        victim = conn.execute(sa.select(dispatch_log).where(dispatch_log.c.path == "events")
                              .order_by(dispatch_log.c.id)).first()
        assert victim is not None
        conn.execute(dispatch_log.update().where(dispatch_log.c.id == victim.id)
                     .values(ready_at=victim.dispatched_at - timedelta(seconds=30)))
    # A 10 s objective: beside a CPU hog in CI a real dispatch once took past 1 s, a second "late".
    report = build_report(drive.engine, drive.tables, start, end, settings=replace(GATES, objective=10.0))
    _validate(report)
    (m,) = [m for m in report.mismatches if m.kind == "late"]
    assert m.task_id == victim.task_id
    assert "after readiness (objective 10000 ms)" in m.detail and "30000 ms" in m.detail


def test_a_decision_nobody_dispatched_is_extra(drive: Drive) -> None:
    start, end = _dual_write_then_selective(drive)
    with drive.engine.begin() as conn:
        (decided_at,) = conn.execute(sa.select(sa.func.min(decisions.c.decided_at))).one()
        conn.execute(decisions.insert().values(task_id="999999", instance_id="ghost", workflow_type="orders",
                                               task_key="ghost", attempt=1, ready_at=decided_at,
                                               decided_at=decided_at))
    report = _report(drive, start, end)
    _validate(report)
    (m,) = [m for m in report.mismatches if m.kind == "extra"]
    assert m.task_id == "999999" and "no path dispatched it" in m.detail


def test_every_planted_kind_validates_against_the_schema(drive: Drive) -> None:
    start, end = _walk(drive)
    report = _report(drive, start, end, control=True)
    _validate(report)
    _validate(_report(drive, start, end))


@settings(max_examples=int(os.environ.get("POLLBRIDGE_RECONCILE_EXAMPLES", "5")), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(shapes=st.lists(st.sampled_from(["chain", "fanout", "diamond"]), min_size=1, max_size=4),
       sizes=st.lists(st.integers(1, 5), min_size=4, max_size=4),
       phase=st.sampled_from(["dual_write", "selective", "cutover"]),
       percent=st.sampled_from([None, 30.0, 70.0]))
def test_clean_runs_have_no_mismatch(engine: Engine, tables: TaskTable, shapes: list[str], sizes: list[int],
                                     phase: str, percent: float | None) -> None:
    """No false positives: whatever the DAGs and the phase, a clean run (both paths driven to completion)
    reconciles with zero mismatches."""
    import random

    from bridge.reference.workload import make_shape

    with engine.begin() as conn:
        for table in (dispatch_log, decisions, flag_audit, flags):
            conn.execute(table.delete())
    with Drive.open(engine, tables) as d:
        start = db_clock(engine) - timedelta(seconds=1)
        d.store.change("orders", phase, actor="test", reason="clean",
                       percent=percent if phase == "selective" else None)
        d.router.refresh()
        prefix = f"h{uuid.uuid4().hex[:10]}-"  # not random: Hypothesis seeds it the same in every example
        specs = [WorkflowSpec(f"{prefix}{i}", "orders", tuple(make_shape(shape, max(size, 4 if shape == "diamond"
                                                                                    else 1), random.Random(i),
                                                                         due_fraction=0.0)))
                 for i, (shape, size) in enumerate(zip(shapes, sizes, strict=False))]
        with engine.begin() as conn:
            seed(conn, tables, specs)
        for _ in range(40):
            d.run(1)
            if d.settled([s.instance_id for s in specs]):
                break
        assert d.settled([s.instance_id for s in specs])
        report = build_report(engine, tables, start, db_clock(engine) + timedelta(seconds=1),
                              settings=GateSettings(objective=60.0, tolerance=60.0, min_tasks=1, miss_budget=0.99))
    assert report.mismatches == (), report.mismatches
    _validate(report)
