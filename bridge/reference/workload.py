"""Workflow definitions (DAGs of tasks), their validation, and seeding them through the mapping.

A :class:`WorkflowSpec` is one instance's tasks. :func:`validate_dag` rejects a dependency on a
task key the instance does not have and a cycle (naming the keys on it). :func:`seed` inserts
instances through the mapping, so the demo and the tests can load a workload into any mapped
schema, including one that stores dependencies in an edges table.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.core.errors import WorkloadError
from bridge.tasktable.tables import TaskTable

SHAPES = ("chain", "fanout", "diamond")


@dataclass(frozen=True)
class TaskSpec:
    key: str
    depends_on: tuple[str, ...] = ()
    due_in: float | None = None  # seconds after seeding
    awaits_signal: str | None = None


@dataclass(frozen=True)
class WorkflowSpec:
    instance_id: str
    workflow_type: str
    tasks: tuple[TaskSpec, ...] = field(default_factory=tuple)


def validate_dag(instance_id: str, deps: Mapping[str, Sequence[str]]) -> None:
    """Raise :class:`WorkloadError` for an unknown dependency key or a cycle."""
    for key, wanted in deps.items():
        for dep in wanted:
            if dep not in deps:
                raise WorkloadError(
                    f"instance {instance_id!r}: task {key!r} depends on unknown task key {dep!r}"
                )
    cycle = find_cycle(deps)
    if cycle:
        raise WorkloadError(f"instance {instance_id!r}: dependency cycle {' -> '.join(cycle)}")


def find_cycle(deps: Mapping[str, Sequence[str]]) -> list[str] | None:
    """One cycle as a list of keys (first key repeated at the end), or ``None``. Iterative DFS."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(deps, white)
    for root in deps:
        if colour[root] != white:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = [root]
        colour[root] = grey
        while stack:
            node, index = stack[-1]
            children = [d for d in deps.get(node, ()) if d in deps]
            if index < len(children):
                stack[-1] = (node, index + 1)
                child = children[index]
                if colour[child] == grey:
                    return [*path[path.index(child):], child]
                if colour[child] == white:
                    colour[child] = grey
                    stack.append((child, 0))
                    path.append(child)
            else:
                colour[node] = black
                stack.pop()
                path.pop()
    return None


def make_shape(shape: str, size: int, rng: random.Random, due_fraction: float = 0.2,
               max_due: float = 2.0) -> tuple[TaskSpec, ...]:
    """Tasks of one DAG shape with ``size`` tasks (at least 3 for fan-out and 4 for diamond)."""
    size = max(size, 1)
    deps: list[tuple[str, tuple[str, ...]]]
    if shape == "chain":
        deps = [(f"t{i}", (f"t{i-1}",) if i else ()) for i in range(size)]
    elif shape == "fanout":
        middle = max(size - 2, 1)
        deps = [("start", ())]
        deps += [(f"branch{i}", ("start",)) for i in range(middle)]
        deps.append(("join", tuple(f"branch{i}" for i in range(middle))))
    elif shape == "diamond":
        # Stacked diamonds: a -> (b, c) -> d -> (e, f) -> g ...
        deps = [("n0", ())]
        n = 1
        while n < size:
            top = f"n{n-1}"
            left, right, bottom = f"n{n}", f"n{n+1}", f"n{n+2}"
            deps += [(left, (top,)), (right, (top,)), (bottom, (left, right))]
            n += 3
    else:
        raise WorkloadError(f"unknown DAG shape {shape!r}; expected one of {', '.join(SHAPES)}")
    return tuple(
        TaskSpec(key, d, due_in=round(rng.uniform(0.1, max_due), 3) if rng.random() < due_fraction else None)
        for key, d in deps
    )


def demo_workload(
    instances: int, tasks_per_instance: int, *, seed: int = 7, prefix: str = "demo"
) -> list[WorkflowSpec]:
    """Instances spread over three workflow types, one DAG shape each."""
    rng = random.Random(seed)
    types = {"chain": "orders", "fanout": "reports", "diamond": "etl"}
    specs = []
    for n in range(instances):
        shape = SHAPES[n % len(SHAPES)]
        specs.append(WorkflowSpec(f"{prefix}-{n:06d}", types[shape], make_shape(shape, tasks_per_instance, rng)))
    return specs


def seed(conn: Connection, tt: TaskTable, specs: Iterable[WorkflowSpec], *, now: datetime | None = None) -> int:
    """Insert the instances (validated first: nothing is written if any is invalid). Returns tasks inserted."""
    specs = list(specs)
    for spec in specs:
        validate_dag(spec.instance_id, {t.key: t.depends_on for t in spec.tasks})
    now = now or datetime.now(UTC)
    if tt.dialect_name == "sqlite":
        now = now.astimezone(UTC).replace(tzinfo=None)
    cols = tt.mapping.columns
    if tt.instances is not None:
        assert tt.mapping.instances is not None
        inst = tt.mapping.instances
        conn.execute(
            tt.instances.insert(),
            [{inst.id: s.instance_id, inst.workflow_type: s.workflow_type} for s in specs],
        )
    rows: list[dict[str, Any]] = []
    for spec in specs:
        for task in spec.tasks:
            row: dict[str, Any] = {
                cols.instance_id: spec.instance_id,
                cols.task_key: task.key,
                cols.status: tt.statuses.write("pending"),
            }
            if cols.workflow_type:
                row[cols.workflow_type] = spec.workflow_type
            if tt.mapping.dependency_mode == "json":
                row[cols.depends_on or ""] = list(task.depends_on)
            if cols.due_at:
                row[cols.due_at] = now + timedelta(seconds=task.due_in) if task.due_in is not None else None
            if cols.awaits_signal:
                row[cols.awaits_signal] = task.awaits_signal
            if cols.updated_at:
                row[cols.updated_at] = now
            rows.append(row)
    if rows:
        conn.execute(tt.tasks.insert(), rows)
    if tt.mapping.dependency_mode == "edges":
        _insert_edges(conn, tt, specs)
    return len(rows)


def _insert_edges(conn: Connection, tt: TaskTable, specs: list[WorkflowSpec]) -> None:
    assert tt.edges is not None and tt.mapping.edges is not None
    ids: dict[tuple[str, str], Any] = {}
    instance_ids = [s.instance_id for s in specs]
    for chunk_start in range(0, len(instance_ids), 500):
        chunk = instance_ids[chunk_start:chunk_start + 500]
        q = sa.select(tt.col("id"), tt.col("instance_id"), tt.col("task_key")).where(
            tt.col("instance_id").in_(chunk)
        )
        for task_id, instance_id, key in conn.execute(q):
            ids[(instance_id, key)] = task_id
    edges = [
        {tt.mapping.edges.task_id: ids[(s.instance_id, t.key)],
         tt.mapping.edges.depends_on_id: ids[(s.instance_id, d)]}
        for s in specs
        for t in s.tasks
        for d in t.depends_on
    ]
    if edges:
        conn.execute(tt.edges.insert(), edges)
