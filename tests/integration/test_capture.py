"""Capture triggers: one outbox row per relevant change, in the same transaction, none for a no-op."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from bridge.app import install
from bridge.capture.triggers import capture_status, installed_triggers
from bridge.db.schema import outbox
from bridge.tasktable.tables import TaskTable


def _outbox(engine: Engine, instance_id: str) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(outbox).where(outbox.c.instance_id == instance_id)
                                 .order_by(outbox.c.id)).all())


def _new_instance(engine: Engine, tables: TaskTable, instance_id: str, keys: list[str]) -> dict[str, int]:
    with engine.begin() as conn:
        conn.execute(tables.instances.insert().values(id=instance_id, workflow_type="orders"))  # type: ignore[union-attr]
        conn.execute(tables.tasks.insert(), [{"instance_id": instance_id, "task_key": k, "depends_on": []}
                                             for k in keys])
        rows = conn.execute(sa.select(tables.tasks.c.task_key, tables.tasks.c.id)
                            .where(tables.tasks.c.instance_id == instance_id)).all()
    return {k: i for k, i in rows}


def test_insert_and_status_change_are_captured_with_their_facts(engine: Engine, tables: TaskTable) -> None:
    ids = _new_instance(engine, tables, "cap1", ["a"])
    with engine.begin() as conn:
        conn.execute(tables.tasks.update().where(tables.tasks.c.id == ids["a"]).values(status="queued"))
    rows = _outbox(engine, "cap1")
    assert [(r.change, r.old_status, r.new_status) for r in rows] == [("insert", None, "pending"),
                                                                      ("status", "pending", "queued")]
    for r in rows:
        assert (r.task_id, r.task_key, r.workflow_type) == (str(ids["a"]), "a", "orders")
        assert uuid.UUID(r.event_id) and len(r.trace_id) == 32 and r.created_at is not None
        assert r.published_at is None
    assert rows[0].event_id != rows[1].event_id
    assert rows[0].id < rows[1].id  # the per-task version increases


def test_no_op_and_unmapped_updates_write_nothing(engine: Engine, tables: TaskTable) -> None:
    ids = _new_instance(engine, tables, "cap2", ["a"])
    t = tables.tasks
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="pending"))  # same value
        conn.execute(t.update().where(t.c.id == ids["a"]).values(attempts=2, max_attempts=5))  # not watched
    assert [r.change for r in _outbox(engine, "cap2")] == ["insert"]


def test_due_and_signal_changes_are_captured(engine: Engine, tables: TaskTable) -> None:
    ids = _new_instance(engine, tables, "cap3", ["a"])
    t = tables.tasks
    now = sa.func.clock_timestamp() if engine.dialect.name == "postgresql" else sa.func.datetime("now")
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(due_at=now))
        conn.execute(t.update().where(t.c.id == ids["a"]).values(awaits_signal="approval"))
        conn.execute(t.update().where(t.c.id == ids["a"]).values(signal_received_at=now))
    assert [r.change for r in _outbox(engine, "cap3")] == ["insert", "due", "signal", "signal"]


def test_capture_is_transactional(engine: Engine, tables: TaskTable) -> None:
    ids = _new_instance(engine, tables, "cap4", ["a"])
    t = tables.tasks

    class Abort(Exception):
        pass

    with pytest.raises(Abort), engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued"))
        raise Abort
    assert [r.change for r in _outbox(engine, "cap4")] == ["insert"]


@st.composite
def update_sequences(draw: st.DrawFn) -> list[tuple[str, Any]]:
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        column = draw(st.sampled_from(["status", "attempts", "awaits_signal", "max_attempts"]))
        if column == "status":
            value: Any = draw(st.sampled_from(["pending", "queued", "running", "completed", "failed"]))
        elif column == "awaits_signal":
            value = draw(st.sampled_from([None, "x", "y"]))
        else:
            value = draw(st.integers(0, 3))
        steps.append((column, value))
    return steps


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=update_sequences())
def test_exactly_the_relevant_changes_are_captured(engine: Engine, tables: TaskTable,
                                                  steps: list[tuple[str, Any]]) -> None:
    instance_id = f"h-{uuid.uuid4().hex[:8]}"
    ids = _new_instance(engine, tables, instance_id, ["a"])
    t = tables.tasks
    state: dict[str, Any] = {"status": "pending", "attempts": 0, "awaits_signal": None, "max_attempts": 3}
    expected = ["insert"]
    for column, value in steps:
        if column in ("status", "awaits_signal") and state[column] != value:
            expected.append("status" if column == "status" else "signal")
        state[column] = value
        with engine.begin() as conn:
            conn.execute(t.update().where(t.c.id == ids["a"]).values({column: value}))
    rows = _outbox(engine, instance_id)
    assert [r.change for r in rows] == expected
    assert len({r.event_id for r in rows}) == len(rows)


def test_status_reported_and_uninstall_removes_triggers_only(engine: Engine, tables: TaskTable) -> None:
    with engine.connect() as conn:
        ok, detail = capture_status(conn, tables)
    assert ok, detail
    install.uninstall(engine)
    with engine.connect() as conn:
        assert installed_triggers(conn) == []
        ok, detail = capture_status(conn, tables)
    assert not ok and "pollbridge init" in detail
    with engine.begin() as conn:  # the scheduler's table still works, and is not captured any more
        conn.execute(tables.instances.insert().values(id="after", workflow_type="w"))  # type: ignore[union-attr]
        conn.execute(tables.tasks.insert().values(instance_id="after", task_key="a", depends_on=[]))
        assert conn.execute(sa.select(sa.func.count()).select_from(tables.tasks)).scalar_one() == 1
