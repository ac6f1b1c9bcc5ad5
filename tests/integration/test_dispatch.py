"""The compare-and-set dispatch: one winner, readiness re-checked at write time, log in the same transaction."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.db.schema import dispatch_log
from bridge.tasktable.dispatch import ReadyTask, dispatch
from bridge.tasktable.tables import TaskTable


def _add(engine: Engine, tables: TaskTable, instance: str, tasks: list[dict[str, object]]) -> dict[str, int]:
    with engine.begin() as conn:
        conn.execute(tables.instances.insert().values(id=instance, workflow_type="orders"))  # type: ignore[union-attr]
        conn.execute(tables.tasks.insert(), [{"instance_id": instance, **t} for t in tasks])
        rows = conn.execute(sa.select(tables.tasks.c.task_key, tables.tasks.c.id)
                            .where(tables.tasks.c.instance_id == instance)).all()
    return {k: i for k, i in rows}


def _ready(ids: dict[str, int], key: str, instance: str) -> ReadyTask:
    return ReadyTask(ids[key], instance, key, "orders", 1, None)


def _log_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(dispatch_log)).scalar_one())


def test_concurrent_dispatchers_have_exactly_one_winner(engine: Engine, tables: TaskTable) -> None:
    ids = _add(engine, tables, "i1", [{"task_key": "a", "depends_on": []}])
    barrier = threading.Barrier(4)
    wins: list[bool] = []
    lock = threading.Lock()

    def contender() -> None:
        barrier.wait()
        with engine.begin() as conn:
            won = dispatch(conn, tables, _ready(ids, "a", "i1"), "poller")
        with lock:
            wins.append(won)

    threads = [threading.Thread(target=contender) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(wins) == [False, False, False, True]
    assert _log_count(engine) == 1
    with engine.connect() as conn:
        status = conn.execute(sa.select(tables.tasks.c.status, tables.tasks.c.dispatched_at)
                              .where(tables.tasks.c.id == ids["a"])).one()
    assert status.status == "queued" and status.dispatched_at is not None


def test_dispatch_rechecks_readiness_at_write_time(engine: Engine, tables: TaskTable) -> None:
    """A scan saw the task ready, but its dependency is no longer completed: the CAS refuses."""
    ids = _add(engine, tables, "i2", [
        {"task_key": "a", "depends_on": [], "status": "running"},
        {"task_key": "b", "depends_on": ["a"], "status": "pending"},
    ])
    with engine.begin() as conn:
        assert dispatch(conn, tables, _ready(ids, "b", "i2"), "events") is False
    assert _log_count(engine) == 0
    with engine.begin() as conn:
        conn.execute(tables.tasks.update().where(tables.tasks.c.id == ids["a"]).values(status="completed"))
    with engine.begin() as conn:
        assert dispatch(conn, tables, _ready(ids, "b", "i2"), "events") is True
    with engine.connect() as conn:
        row = conn.execute(sa.select(dispatch_log)).one()
    assert (row.task_key, row.path, row.instance_id, row.attempt) == ("b", "events", "i2", 1)


def test_dispatch_and_log_commit_together(engine: Engine, tables: TaskTable) -> None:
    ids = _add(engine, tables, "i3", [{"task_key": "a", "depends_on": []}])

    class Boom(Exception):
        pass

    with pytest.raises(Boom), engine.begin() as conn:
        assert dispatch(conn, tables, _ready(ids, "a", "i3"), "poller")
        raise Boom
    assert _log_count(engine) == 0
    with engine.connect() as conn:
        assert conn.execute(sa.select(tables.tasks.c.status).where(tables.tasks.c.id == ids["a"])).scalar() == "pending"


def test_future_due_time_blocks_dispatch(engine: Engine, tables: TaskTable) -> None:
    far = sa.func.datetime("now", "+1 hour") if engine.dialect.name == "sqlite" else sa.text(
        "clock_timestamp() + interval '1 hour'")
    ids = _add(engine, tables, "i4", [{"task_key": "a", "depends_on": []}])
    with engine.begin() as conn:
        conn.execute(tables.tasks.update().where(tables.tasks.c.id == ids["a"]).values(due_at=far))
        assert dispatch(conn, tables, _ready(ids, "a", "i4"), "poller") is False
