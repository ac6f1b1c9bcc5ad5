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


# --- a scheduler that is not ours: composite keys, a NULL status, attempts, a new row id per retry ---------

def _airflow_like(engine: Engine) -> TaskTable:
    """A task table shaped like Airflow's task_instance (a run is (dag_id, run_id), a task (task_id, map_index),
    a waiting task has state NULL, a retry gets a new primary key), with capture installed on it."""
    from bridge.capture.triggers import install_capture
    from bridge.core.mapping import StatusValues, TaskColumns, TaskTableMapping
    from bridge.tasktable.tables import reflect_tables

    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE task_instance (id VARCHAR(36) PRIMARY KEY, dag_id VARCHAR(250) NOT NULL, "
            "run_id VARCHAR(250) NOT NULL, task_id VARCHAR(250) NOT NULL, map_index INTEGER NOT NULL DEFAULT -1, "
            "state VARCHAR(20), try_number INTEGER NOT NULL DEFAULT 0, depends_on TEXT NOT NULL DEFAULT '[]', "
            "updated_at VARCHAR(40))")
    mapping = TaskTableMapping(
        table="task_instance", instances=None,
        columns=TaskColumns(instance_id=("dag_id", "run_id"), task_key=("task_id", "map_index"), status="state",
                            workflow_type="dag_id", attempts="try_number", due_at=None, awaits_signal=None,
                            signal_received_at=None, dispatched_at=None, completed_at=None, updated_at=None,
                            max_attempts=None),
        statuses=StatusValues(pending=["up_for_retry"], null="pending", dispatched="queued", running="running",
                              completed="success", failed="failed", skipped="skipped", other=["deferred"]))
    tt = reflect_tables(engine, mapping)
    with engine.begin() as conn:
        install_capture(conn, tt)
    return tt


def test_composite_keys_a_null_status_and_the_attempt_are_captured(engine: Engine) -> None:
    tt = _airflow_like(engine)
    t = tt.tasks
    with engine.begin() as conn:
        conn.execute(t.insert().values(id="u1", dag_id="etl", run_id="manual__2026-01-01", task_id="load",
                                       map_index=2, state=None))
        conn.execute(t.update().values(state="queued", try_number=1))
        conn.execute(t.update().values(updated_at="heartbeat"))  # an unwatched column: nothing captured
        conn.execute(t.update().values(state="deferred"))
        conn.execute(t.update().values(state=None))
        expected_keys = conn.execute(sa.select(tt.key_text("instance_id"), tt.key_text("task_key"))).one()
    rows = _outbox(engine, "etl/manual__2026-01-01")
    assert [(r.change, r.old_status, r.new_status, r.attempt) for r in rows] == [
        ("insert", None, None, 0), ("status", None, "queued", 1), ("status", "queued", "deferred", 1),
        ("status", "deferred", None, 1)]
    # Exactly the text the rest of pollbridge computes for the keys (TaskTable.key_text).
    assert {(r.instance_id, r.task_key) for r in rows} == {tuple(expected_keys)} == {
        ("etl/manual__2026-01-01", "load/2")}
    assert {(r.task_id, r.workflow_type) for r in rows} == {("u1", "etl")}


def test_a_new_row_id_is_captured_as_identity_or_with_the_status_change(engine: Engine) -> None:
    """Airflow gives a retried task instance a new primary key by an UPDATE: the same logical task, a new
    physical row, which the event path must hear of."""
    tt = _airflow_like(engine)
    t = tt.tasks
    with engine.begin() as conn:
        conn.execute(t.insert().values(id="u1", dag_id="etl", run_id="r", task_id="load", state="failed",
                                       try_number=1))
        conn.execute(t.update().values(id="u2"))  # only the id
        conn.execute(t.update().values(id="u3", state="up_for_retry"))  # the id and the status
    rows = _outbox(engine, "etl/r")
    assert [(r.change, r.task_id, r.old_status, r.new_status) for r in rows] == [
        ("insert", "u1", None, "failed"), ("identity", "u2", "failed", "failed"),
        ("status", "u3", "failed", "up_for_retry")]


def test_the_attempt_is_the_mapped_attempts_column_or_none(engine: Engine, tables: TaskTable) -> None:
    from dataclasses import replace

    from bridge.capture.triggers import install_capture

    ids = _new_instance(engine, tables, "att", ["a"])
    t = tables.tasks
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="queued", attempts=4))
        unmapped = replace(tables.mapping, columns=replace(tables.mapping.columns, attempts=None, max_attempts=None))
        install_capture(conn, replace(tables, mapping=unmapped))
        conn.execute(t.update().where(t.c.id == ids["a"]).values(status="running", attempts=5))
    assert [(r.change, r.new_status, r.attempt) for r in _outbox(engine, "att")] == [
        ("insert", "pending", 0), ("status", "queued", 4), ("status", "running", None)]


@pytest.mark.parametrize("new_type", ["varchar(300)", "text"])
def test_the_scheduler_can_retype_a_watched_column_and_its_sessions_keep_writing(
        engine: Engine, tables: TaskTable, new_type: str) -> None:
    """A column a trigger's WHEN clause (or column list) names cannot be retyped, and a PL/pgSQL plan made
    before the retype must not fail the writes of a session that fired the trigger before it."""
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite has no ALTER COLUMN ... TYPE")
    ids = _new_instance(engine, tables, "retype", ["a", "b"])
    t = tables.tasks
    with engine.connect() as scheduler, engine.connect() as migration:
        for i in range(3):  # the scheduler's session fires the trigger: captured and not captured updates
            scheduler.execute(t.update().where(t.c.id == ids["a"]).values(max_attempts=4 + i))
            scheduler.execute(t.update().where(t.c.id == ids["a"]).values(status=("queued", "pending")[i % 2]))
            scheduler.commit()
        migration.exec_driver_sql(f"ALTER TABLE tasks ALTER COLUMN status TYPE {new_type}")
        migration.exec_driver_sql("ALTER TABLE tasks ALTER COLUMN due_at TYPE timestamp")
        migration.commit()
        scheduler.execute(t.update().where(t.c.id == ids["a"]).values(max_attempts=9))
        scheduler.execute(t.update().where(t.c.id == ids["b"]).values(status="running"))
        scheduler.commit()
        # and within the migration's own transaction, after its ALTER
        migration.execute(t.update().where(t.c.id == ids["a"]).values(max_attempts=10))
        migration.exec_driver_sql("ALTER TABLE tasks ALTER COLUMN status TYPE varchar(200)")
        migration.execute(t.update().where(t.c.id == ids["a"]).values(status="completed"))
        migration.commit()
    rows = [(r.task_key, r.change, r.new_status) for r in _outbox(engine, "retype")]
    assert rows[-2:] == [("b", "status", "running"), ("a", "status", "completed")]
    assert len(rows) == 2 + 3 + 2
