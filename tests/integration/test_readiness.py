"""The readiness SQL against a Python oracle, on random DAGs, statuses, timers and signals."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from bridge.db.clock import as_utc
from bridge.tasktable.readiness import ready_predicate, ready_since
from bridge.tasktable.tables import TaskTable

STATUSES = ["pending", "queued", "running", "completed", "failed"]


@st.composite
def instances(draw: st.DrawFn) -> list[dict[str, Any]]:
    n = draw(st.integers(1, 7))
    tasks = []
    for i in range(n):
        deps = sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else []
        keys = [f"k{d}" for d in deps]
        if draw(st.integers(0, 9)) == 0:
            keys.append("missing")  # a dependency on a task key that does not exist
        tasks.append({
            "task_key": f"k{i}",
            "status": draw(st.sampled_from(STATUSES)),
            "depends_on": keys,
            "due": draw(st.sampled_from([None, "past", "future"])),
            "signal": draw(st.sampled_from([None, "waiting", "received"])),
            "completed_ago": draw(st.integers(1, 500)),
        })
    return tasks


def _ts(engine: Engine, value: datetime) -> datetime:
    return value.replace(tzinfo=None) if engine.dialect.name == "sqlite" else value


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=instances())
def test_ready_set_matches_oracle(engine: Engine, tables: TaskTable, spec: list[dict[str, Any]]) -> None:
    instance_id = f"r-{uuid.uuid4().hex[:10]}"
    now = datetime.now(UTC)
    rows = []
    for t in spec:
        rows.append({
            "instance_id": instance_id,
            "task_key": t["task_key"],
            "status": t["status"],
            "depends_on": t["depends_on"],
            "due_at": None if t["due"] is None else _ts(engine, now + (
                timedelta(seconds=-30) if t["due"] == "past" else timedelta(hours=1))),
            "awaits_signal": None if t["signal"] is None else "approval",
            "signal_received_at": _ts(engine, now - timedelta(seconds=20)) if t["signal"] == "received" else None,
            "completed_at": _ts(engine, now - timedelta(seconds=t["completed_ago"]))
            if t["status"] == "completed" else None,
            "updated_at": _ts(engine, now - timedelta(seconds=600)),
        })
    with engine.begin() as conn:
        conn.execute(tables.instances.insert().values(id=instance_id, workflow_type="w"))  # type: ignore[union-attr]
        conn.execute(tables.tasks.insert(), rows)
        t = tables.tasks
        got = dict(conn.execute(
            sa.select(t.c.task_key, ready_since(tables, t))
            .where(t.c.instance_id == instance_id, ready_predicate(tables, t))
        ).all())

    by_key = {r["task_key"]: r for r in rows}
    expected = {}
    for r in rows:
        deps = [by_key.get(k) for k in r["depends_on"]]
        ready = (
            r["status"] == "pending"
            and all(d is not None and d["status"] == "completed" for d in deps)
            and (r["due_at"] is None or as_utc(r["due_at"]) <= now)  # type: ignore[operator]
            and (r["awaits_signal"] is None or r["signal_received_at"] is not None)
        )
        if ready:
            candidates = [as_utc(d["completed_at"]) for d in deps if d is not None]
            candidates += [as_utc(r[c]) for c in ("due_at", "signal_received_at", "updated_at") if r[c] is not None]
            expected[r["task_key"]] = max(c for c in candidates if c is not None)
    assert set(got) == set(expected)
    for key, since in got.items():
        assert abs((as_utc(since) - expected[key]).total_seconds()) < 0.002, key  # type: ignore[operator]
