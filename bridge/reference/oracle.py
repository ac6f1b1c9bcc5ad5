"""An independent check of the invariants over a set of instances, computed in Python.

It deliberately does not reuse the readiness SQL: it reloads the task rows and the dispatch log
and re-derives, from timestamps alone, whether any dispatch was early (before a dependency
completed, before the due time, before the awaited signal), whether a task was dispatched twice
for the same attempt, and whether any task was left neither finished nor legitimately blocked.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.db.clock import as_utc
from bridge.db.schema import dispatch_log
from bridge.tasktable.tables import TaskTable


@dataclass(frozen=True)
class TaskRow:
    id: Any
    instance_id: str
    key: str
    status: str
    depends_on: tuple[Any, ...]  # task keys (json mode) resolved to ids below
    due_at: datetime | None
    awaits_signal: str | None
    signal_received_at: datetime | None
    completed_at: datetime | None
    attempts: int | None
    max_attempts: int | None


@dataclass(frozen=True)
class Verdict:
    tasks: int
    dispatches: int
    completed: int
    failed: int
    lost: int
    double_dispatched: int
    early: int
    blocked: int
    unsettled: int
    problems: tuple[str, ...] = field(default_factory=tuple)
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)


def load_tasks(conn: Connection, tt: TaskTable, instance_ids: Sequence[str]) -> list[TaskRow]:
    cols = tt.mapping.columns
    wanted = ["id", "instance_id", "task_key", "status", "due_at", "awaits_signal", "signal_received_at",
              "completed_at", "attempts", "max_attempts"]
    if tt.mapping.dependency_mode == "json":
        wanted.append("depends_on")
    selected = [tt.col(w).label(w) for w in wanted if getattr(cols, w) is not None]
    rows: list[Any] = []
    for start in range(0, len(instance_ids), 500):
        chunk = list(instance_ids[start:start + 500])
        rows += conn.execute(sa.select(*selected).where(tt.col("instance_id").in_(chunk))).mappings().all()
    by_key = {(r["instance_id"], r["task_key"]): r["id"] for r in rows}
    edges: dict[Any, list[Any]] = defaultdict(list)
    if tt.mapping.dependency_mode == "edges":
        assert tt.edges is not None and tt.mapping.edges is not None
        ids = [r["id"] for r in rows]
        for start in range(0, len(ids), 500):
            q = sa.select(tt.edges.c[tt.mapping.edges.task_id], tt.edges.c[tt.mapping.edges.depends_on_id]).where(
                tt.edges.c[tt.mapping.edges.task_id].in_(ids[start:start + 500]))
            for task_id, dep_id in conn.execute(q):
                edges[task_id].append(dep_id)
    out = []
    for r in rows:
        if tt.mapping.dependency_mode == "json":
            raw = r.get("depends_on") or []
            if isinstance(raw, str):
                raw = json.loads(raw)
            deps = tuple(by_key.get((r["instance_id"], k), ("missing", k)) for k in raw)
        else:
            deps = tuple(edges.get(r["id"], ()))
        out.append(TaskRow(
            r["id"], r["instance_id"], r["task_key"], r["status"], deps,
            as_utc(r.get("due_at")), r.get("awaits_signal"), as_utc(r.get("signal_received_at")),
            as_utc(r.get("completed_at")), r.get("attempts"), r.get("max_attempts"),
        ))
    return out


def verify(conn: Connection, tt: TaskTable, instance_ids: Sequence[str]) -> Verdict:
    tasks = load_tasks(conn, tt, instance_ids)
    by_id = {str(t.id): t for t in tasks}
    st = tt.statuses
    problems: list[str] = []

    def terminal_failed(t: TaskRow) -> bool:
        if t.status != st.failed:
            return False
        return t.attempts is None or t.max_attempts is None or t.attempts >= t.max_attempts

    # Blocked: pending behind a terminally failed (or missing) dependency, transitively.
    blocked: set[str] = set()
    changed = True
    while changed:
        changed = False
        for t in tasks:
            tid = str(t.id)
            if tid in blocked or t.status != st.pending:
                continue
            for dep in t.depends_on:
                d = by_id.get(str(dep))
                if d is None or terminal_failed(d) or str(d.id) in blocked:
                    blocked.add(tid)
                    changed = True
                    break

    log_rows: list[Any] = []
    for start in range(0, len(instance_ids), 500):
        chunk = list(instance_ids[start:start + 500])
        log_rows += conn.execute(
            sa.select(dispatch_log.c.task_id, dispatch_log.c.attempt, dispatch_log.c.path,
                      dispatch_log.c.ready_at, dispatch_log.c.dispatched_at)
            .where(dispatch_log.c.instance_id.in_(chunk))
        ).all()

    per_attempt = Counter((row.task_id, row.attempt) for row in log_rows)
    double = sum(1 for n in per_attempt.values() if n > 1)
    for (task_id, attempt), n in per_attempt.items():
        if n > 1:
            problems.append(f"task {task_id} attempt {attempt} dispatched {n} times")

    early = 0
    latencies: dict[str, list[float]] = defaultdict(list)
    for row in log_rows:
        at = as_utc(row.dispatched_at)
        assert at is not None
        ready_at = as_utc(row.ready_at)
        if ready_at is not None:
            latencies[row.path].append((at - ready_at).total_seconds() * 1000.0)
        found = by_id.get(row.task_id)
        if found is None:
            continue
        t = found
        reasons = []
        for dep in t.depends_on:
            d = by_id.get(str(dep))
            if d is None or d.completed_at is None or d.completed_at > at or d.status != st.completed:
                reasons.append(f"dependency {dep} not completed")
        if t.due_at is not None and t.due_at > at:
            reasons.append(f"due at {t.due_at.isoformat()}")
        if t.awaits_signal is not None and (t.signal_received_at is None or t.signal_received_at > at):
            reasons.append(f"signal {t.awaits_signal!r} not received")
        if reasons:
            early += 1
            problems.append(f"task {row.task_id} dispatched early at {at.isoformat()}: {'; '.join(reasons)}")

    completed = sum(1 for t in tasks if t.status == st.completed)
    failed = sum(1 for t in tasks if terminal_failed(t))
    unsettled = len(tasks) - completed - failed - len(blocked)
    return Verdict(
        tasks=len(tasks),
        dispatches=len(log_rows),
        completed=completed,
        failed=failed,
        lost=unsettled,
        double_dispatched=double,
        early=early,
        blocked=len(blocked),
        unsettled=unsettled,
        problems=tuple(problems),
        latencies_ms=dict(latencies),
    )


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    # Exact rational arithmetic: in floating point 7 / 100 * 100 is 7.000000000000001, one rank too high.
    rank = max(1, min(len(ordered), math.ceil(Fraction(str(q)) * len(ordered) / 100)))
    return ordered[rank - 1]
