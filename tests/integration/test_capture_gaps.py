"""Capture gaps (bridge/capture/gaps.py) as the reconciler and the guardian see them, on SQLite and PostgreSQL.

The write-ahead-log capture records a gap when its slot was lost (tests/integration/test_capture_modes.py
checks that on a real slot); here gaps are recorded directly, and the report and the guardian must show them:
the report's window lists each gap and fails ``no_capture_gap`` for every judged type, a window that ends
before the gap does not; the guardian reports each gap once, and demotes nothing for it.
"""

from __future__ import annotations

import json
from datetime import timedelta

from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.capture.gaps import PENDING, WAL_SLOT, close_gap_statement, gaps_between, pending_gap, record_gap_statement
from bridge.core.settings import GateSettings, GuardianSettings
from bridge.db.clock import db_clock
from bridge.flags.store import FlagStore
from bridge.reconcile.report import build_report
from bridge.rollout.guardian import Guardian
from bridge.tasktable.tables import TaskTable


def _gap(engine: Engine, rederived: int = 3) -> None:
    with engine.begin() as conn:
        conn.execute(record_gap_statement(engine.dialect.name, WAL_SLOT, rederived, "slot pollbridge_x was gone"))


def test_a_report_lists_the_gaps_of_its_window_and_its_verdicts_refuse_them(engine: Engine,
                                                                             tables: TaskTable) -> None:
    FlagStore(engine).change("orders", "dual_write", actor="op", reason="shadow")
    start = db_clock(engine) - timedelta(minutes=5)
    _gap(engine, 5)
    after = db_clock(engine) + timedelta(seconds=1)
    with engine.connect() as conn:
        (recorded,) = gaps_between(conn, start, after)
    # A window [.., at) ends right before the gap, to the millisecond: half-open, as a report's. (On SQLite the
    # column is millisecond text: a bound datetime compared as text took the gap's own millisecond as earlier.)
    before = recorded.detected_at
    report = build_report(engine, tables, start, after, settings=GateSettings(),
                          types=["orders"])
    assert [g.rederived for g in report.capture_gaps] == [5]
    (orders,) = report.types
    gap = next(c for c in orders.criteria if c.name == "no_capture_gap")
    assert not gap.passed and "5 task(s) re-derived" in gap.detail
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["capture_gaps"][0]["source"] == WAL_SLOT and doc["capture_gaps"][0]["rederived"] == 5
    earlier = build_report(engine, tables, start, before, settings=GateSettings(),
                           types=["orders"])
    assert earlier.capture_gaps == ()
    assert next(c for c in earlier.types[0].criteria if c.name == "no_capture_gap").passed


def test_the_guardian_reports_each_gap_once_and_demotes_nothing_for_it(engine: Engine) -> None:
    store = FlagStore(engine)
    store.change("orders", "cutover", actor="op", reason="go", forced=True)
    _gap(engine)
    guardian = Guardian(engine, GuardianSettings(), store=store, registry=CollectorRegistry())
    first = guardian.check_once()
    assert [g.rederived for g in first.capture_gaps] == [3]  # recorded before it started: within its window
    assert first.to_json()["capture_gaps"][0]["detail"] == "slot pollbridge_x was gone"
    assert first.demoted == [] and store.get("orders").phase == "cutover"
    assert guardian.check_once().capture_gaps == ()  # reported once
    _gap(engine, 9)
    assert [g.rederived for g in guardian.check_once().capture_gaps] == [9]
    assert guardian.value("pollbridge_guardian_capture_gaps_total") == 2


def test_a_gap_whose_re_derivation_is_pending_still_refuses_the_window_and_says_so(engine: Engine,
                                                                                   tables: TaskTable) -> None:
    """A slot recovery records its gap before it re-derives (pending: a failure in between is finished later):
    such a gap refuses the window like any other, says its re-derivation is pending, and is closed with its
    count; the same gap, not a second one."""
    FlagStore(engine).change("orders", "dual_write", actor="op", reason="shadow")
    start = db_clock(engine) - timedelta(minutes=5)
    _gap(engine, PENDING)
    with engine.connect() as conn:
        gap_id = pending_gap(conn, WAL_SLOT)
    assert gap_id is not None
    report = build_report(engine, tables, start, db_clock(engine) + timedelta(seconds=1), settings=GateSettings(),
                          types=["orders"])
    criterion = next(c for c in report.types[0].criteria if c.name == "no_capture_gap")
    assert not criterion.passed and "re-derivation pending" in criterion.detail
    doc = report.to_json()["capture_gaps"][0]
    assert doc["pending"] is True and doc["rederived"] is None
    with engine.begin() as conn:
        conn.execute(close_gap_statement(gap_id, 4, "re-derived"))
    with engine.connect() as conn:
        assert pending_gap(conn, WAL_SLOT) is None
        (closed,) = gaps_between(conn, start, db_clock(engine) + timedelta(seconds=1))
    assert (closed.id, closed.rederived, closed.pending, closed.summary) == (gap_id, 4, False, "4 task(s) re-derived")
