"""Issue 22: a task held back by backpressure is neither a miss nor late while its hold is legitimate
(both dialects).

The event scheduler records each hold in ``pollbridge_holds`` (one row per task: ``held_at``, ``until``
renewed at every look, ``released_at`` once its holder dispatched it). Proves: :func:`legit_hold` is true
only for an unreleased hold whose ``until`` is at most ``HOLD_SLACK`` seconds past, by the database clock;
the event path's dispatch past the objective after a legitimate hold of that attempt is ``held`` (compared,
matched evidence, never ``late``), while one after a stale hold, a hold of another attempt or a hold begun
after it stays ``late``; a ready task under a legitimate hold at the window's end is ``on_hold``, not
``missing``, while one whose hold went stale (its holder died) or was released is ``missing``; a task the
fallback took after its hold went stale stays a miss; the text, JSON and HTML reports show both kinds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Engine

from bridge.cli.main import cli
from bridge.db.clock import as_utc, db_clock
from bridge.db.schema import dispatch_log, holds
from bridge.reconcile.html import render_html
from bridge.reconcile.report import Report, build_report
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.holds import HOLD_SLACK, legit_hold
from bridge.tasktable.tables import TaskTable
from tests.integration.test_reconcile_report import GATES, Drive


@pytest.fixture
def drive(engine: Engine, tables: TaskTable) -> Iterator[Drive]:
    with Drive.open(engine, tables) as d:
        yield d


def _hold(conn: sa.Connection, task_id: Any, *, held_at: datetime, until: datetime, attempt: int | None = 1,
          released_at: datetime | None = None, instance_id: str = "i", task_key: str = "a") -> None:
    conn.execute(holds.delete().where(holds.c.task_id == str(task_id)))
    conn.execute(holds.insert().values(task_id=str(task_id), instance_id=instance_id, workflow_type="orders",
                                       task_key=task_key, attempt=attempt, reason="rate", held_at=held_at,
                                       until=until, holder="sched-1", released_at=released_at))


#: The dispatches these tests judge are made 30 s late on purpose; the 5 s objective keeps the walk's own latency
#: (over a second per round in CI beside a CPU hog) out of the counts.
HOLD_GATES = dataclasses.replace(GATES, objective=5.0)


def _report(d: Drive, start: Any, **kwargs: Any) -> Report:
    return build_report(d.engine, d.tables, start, db_clock(d.engine) + timedelta(seconds=1), settings=HOLD_GATES,
                        **kwargs)


# --- the SQL test the poller's scan and the reconciler share ------------------------------------------------
def test_a_hold_is_legitimate_while_renewed_within_the_slack(engine: Engine) -> None:
    now = db_clock(engine)
    with engine.begin() as conn:
        began = now - timedelta(seconds=60)
        _hold(conn, "1", held_at=began, until=now + timedelta(seconds=2))  # renewed, its next look ahead
        _hold(conn, "2", held_at=began, until=now - timedelta(seconds=HOLD_SLACK / 2))  # a look a little late
        _hold(conn, "3", held_at=began, until=now - timedelta(seconds=HOLD_SLACK * 3))  # its holder died
        _hold(conn, "4", held_at=began, until=now + timedelta(seconds=2),
              released_at=now - timedelta(seconds=1))  # its holder dispatched it

        def legit(task_id: Any) -> bool:
            return bool(conn.execute(sa.select(legit_hold(sa.literal(task_id), engine.dialect.name))).scalar())

        assert [legit(str(i)) for i in range(1, 6)] == [True, True, False, False, False]
        assert legit(1) and not legit(3)  # an integer id is compared as text


# --- a dispatch after a hold --------------------------------------------------------------------------------
def _selective(d: Drive, n: int = 6) -> datetime:
    start = db_clock(d.engine) - timedelta(seconds=1)
    d.phase("selective")
    d.load("s", n)
    d.run(16)
    assert d.settled([f"s{i}" for i in range(n)])
    return start


def test_a_dispatch_after_a_legitimate_hold_is_held_not_late(drive: Drive) -> None:
    start = _selective(drive)
    second = timedelta(seconds=1)
    with drive.engine.begin() as conn:
        rows = conn.execute(sa.select(dispatch_log).where(dispatch_log.c.path == "events")
                            .order_by(dispatch_log.c.id).limit(4)).all()
        released, stale, other_attempt, after = rows

        def at(row: Any) -> datetime:
            value = as_utc(row.dispatched_at)
            assert value is not None
            return value

        for row in rows:  # each dispatched 30 s after its readiness: late, unless a hold excuses it
            conn.execute(dispatch_log.update().where(dispatch_log.c.id == row.id)
                         .values(ready_at=at(row) - 30 * second))

        # Held by its holder from readiness until the dispatch, renewed at every look, then released.
        _hold(conn, released.task_id, attempt=released.attempt, held_at=at(released) - 29 * second,
              until=at(released) - second, released_at=at(released))
        # The holder died 20 s before the dispatch: the hold went stale, another scheduler took the task late.
        _hold(conn, stale.task_id, attempt=stale.attempt, held_at=at(stale) - 29 * second,
              until=at(stale) - 20 * second)
        # A hold of the next attempt excuses nothing about this one.
        _hold(conn, other_attempt.task_id, attempt=(other_attempt.attempt or 0) + 1,
              held_at=at(other_attempt) - 29 * second, until=at(other_attempt) - second,
              released_at=at(other_attempt))
        # A hold that began after the dispatch did not delay it.
        _hold(conn, after.task_id, attempt=after.attempt, held_at=at(after) + second, until=at(after) + 2 * second)
    report = _report(drive, start)
    (orders,) = report.types
    assert orders.counts["held"] == 1 and orders.counts["late"] == 3
    assert orders.counts["matched"] == 18 - 4 and orders.compared == 18
    late = {m.task_id for m in report.mismatches if m.kind == "late"}
    assert late == {str(stale.task_id), str(other_attempt.task_id), str(after.task_id)}
    assert str(released.task_id) not in {m.task_id for m in report.mismatches}
    # Matched evidence, and said so; never a miss.
    min_tasks = next(c for c in orders.criteria if c.name == "min_tasks")
    assert "18 matched (3 of them late, 1 dispatched after a backpressure hold)" in min_tasks.detail
    assert orders.counts.get("missing", 0) == 0
    assert orders.event_path is not None and orders.event_path.held == 1 and orders.event_path.late == 3
    out = report.to_json()["types"][0]
    assert out["held"] == 1 and out["late"] == 3 and out["event_path"]["held"] == 1
    html = render_html(report)
    assert "<th>held</th>" in html and "<th>on hold</th>" in html


# --- a ready task still held at the window's end -------------------------------------------------------------
def _ready_and_unacted(d: Drive, names: list[str]) -> dict[str, str]:
    """Single-task instances of ``orders`` (in selective), ready for a minute and dispatched by nobody (the
    scheduler is holding them back, or dead): instance -> task id."""
    d.phase("selective")
    with d.engine.begin() as conn:
        seed(conn, d.tables, [WorkflowSpec(name, "orders", (TaskSpec("a"),)) for name in names])
    t = d.tables.tasks
    ago = db_clock(d.engine) - timedelta(seconds=60)
    with d.engine.begin() as conn:
        conn.execute(t.update().where(t.c.instance_id.in_(names)).values(updated_at=ago))
        return {r.instance_id: str(r.id) for r in conn.execute(sa.select(t.c.id, t.c.instance_id)
                                                                .where(t.c.instance_id.in_(names)))}


def test_a_task_under_a_legitimate_hold_is_on_hold_not_missing(drive: Drive) -> None:
    start = db_clock(drive.engine) - timedelta(seconds=1)
    ids = _ready_and_unacted(drive, ["held", "dead", "free", "released"])
    now = db_clock(drive.engine)
    with drive.engine.begin() as conn:
        _hold(conn, ids["held"], held_at=now - timedelta(seconds=59), until=now + timedelta(seconds=1))
        _hold(conn, ids["dead"], held_at=now - timedelta(seconds=59), until=now - timedelta(seconds=40))
        # Released by a holder whose dispatch did not land (the task is still ready): no excuse any more.
        _hold(conn, ids["released"], held_at=now - timedelta(seconds=59), until=now + timedelta(seconds=1),
              released_at=now - timedelta(seconds=1))
    report = _report(drive, start)
    (orders,) = report.types
    assert orders.counts["on_hold"] == 1 and orders.counts["missing"] == 3
    assert orders.compared == 3  # on hold: not compared, as pending
    missing = {m.task_id for m in report.mismatches if m.kind == "missing"}
    assert missing == {ids["dead"], ids["free"], ids["released"]}
    out = report.to_json()["types"][0]
    assert out["on_hold"] == 1 and out["missing"] == 3
    # The floor counts the same ready tasks: the poller leaves a legitimately held task alone too.
    control = _report(drive, start, control=True)
    assert control.types[0].counts["on_hold"] == 1 and control.types[0].counts["missing"] == 3


def test_the_fallback_taking_a_task_after_its_hold_went_stale_is_a_miss(drive: Drive) -> None:
    start = _selective(drive)
    with drive.engine.begin() as conn:
        row = conn.execute(sa.select(dispatch_log).where(dispatch_log.c.path == "events")
                           .order_by(dispatch_log.c.id)).first()
        assert row is not None
        at = as_utc(row.dispatched_at)
        assert at is not None
        conn.execute(dispatch_log.update().where(dispatch_log.c.id == row.id)
                     .values(path="fallback", ready_at=at - timedelta(seconds=30)))
        _hold(conn, row.task_id, attempt=row.attempt, held_at=at - timedelta(seconds=29),
              until=at - timedelta(seconds=20))
    report = _report(drive, start)
    (orders,) = report.types
    assert orders.counts["missing"] == 1 and orders.counts.get("held", 0) == 0
    (m,) = [m for m in report.mismatches if m.kind == "missing"]
    assert m.task_id == str(row.task_id) and "fallback" in m.detail


def test_the_text_report_shows_held_and_on_hold(drive: Drive, db_url: str) -> None:
    start = db_clock(drive.engine) - timedelta(seconds=1)
    ids = _ready_and_unacted(drive, ["held"])
    now = db_clock(drive.engine)
    with drive.engine.begin() as conn:
        _hold(conn, ids["held"], held_at=now - timedelta(seconds=59), until=now + timedelta(seconds=1))
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("POLLBRIDGE_")}
    env["POLLBRIDGE_DATABASE_URL"] = db_url
    result = CliRunner().invoke(cli, ["reconcile", "--since", (as_utc(start) or start).isoformat()], env=env)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if "matched" in line)
    assert "held" in header and "on hold" in header
    row = next(line for line in result.stdout.splitlines() if "│ orders" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    columns = [c.strip() for c in header.strip("┃ ").split("┃")]
    assert cells[columns.index("on hold")] == "1" and cells[columns.index("missing")] == "0"


def test_the_html_with_the_hold_columns_and_the_floor_still_fits_the_window(tmp_path: Any) -> None:
    """Rendered in headless Chromium (as ``tests/acceptance/test_report_html.py`` does): the summary's two
    backpressure columns and the floor table leave the page no wider than a 1280 px window, in both modes."""
    from dataclasses import replace

    from bridge.reconcile.report import PathShare
    from tests.acceptance.test_report_html import GATES as HTML_GATES
    from tests.acceptance.test_report_html import RELAXED, _measure
    from tests.acceptance.test_report_html import _report as busy_report

    report = busy_report()
    report = replace(report, types=tuple(
        replace(t, counts={**t.counts, "held": 12, "on_hold": 3}, floor=PathShare("poller", 400, 388, 2, 0, 9700.0),
                event_path=PathShare("events", 300, 3, 1, 12, 30.0)) for t in report.types))
    for control in (False, True):
        text = render_html(replace(report, control=control), gates=HTML_GATES, thresholds={"invoices": RELAXED})
        assert "<th>on hold</th>" in text and "Noise floor beside the event path" in text
        measured = _measure(text, tmp_path)
        assert measured["overflow"] <= 0, f"the page is {measured['overflow']} px wider than the window"
        assert "97.0%" in measured["text"] and "9.7 s" in measured["text"]
