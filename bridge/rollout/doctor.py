"""``pollbridge doctor``: is this installation able to work? Each check passes or says why not.

Checks: the database is reachable; the mapping matches the real tables and columns; pollbridge's
migrations are at head; the workflows in the task table are DAGs (no dependency on an unknown task
key, no cycle). Each check is independent where it can be: a mapping mismatch does not hide the
migration state.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.capture.triggers import capture_status
from bridge.core.errors import PollbridgeError, first_line
from bridge.core.settings import Settings
from bridge.core.urls import mask_url
from bridge.db import migrate
from bridge.db.engine import check_connection
from bridge.reference.workload import find_cycle
from bridge.tasktable.tables import TaskTable, reflect_tables

#: Most task rows the DAG check reads, so doctor stays quick on a large table.
DAG_CHECK_LIMIT = 200_000


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def run_checks(engine: Engine, settings: Settings) -> list[Check]:
    checks: list[Check] = []
    try:
        check_connection(engine)
        checks.append(Check("database", True, f"connected to {mask_url(engine.url)}"))
    except PollbridgeError as exc:
        checks.append(Check("database", False, str(exc)))
        return checks

    tables: TaskTable | None = None
    try:
        tables = reflect_tables(engine, settings.mapping)
        checks.append(Check("mapping", True, _describe_mapping(tables)))
    except PollbridgeError as exc:
        checks.append(Check("mapping", False, str(exc)))

    checks.append(_check(_migrations, engine))
    if tables is not None:
        checks.append(_check(_capture, engine, tables))
        checks.append(_check(_dags, engine, tables))
    checks.append(_check(_bus, engine, settings))
    return checks


def _capture(engine: Engine, tables: TaskTable) -> Check:
    with engine.connect() as conn:
        ok, detail = capture_status(conn, tables)
    return Check("capture", ok, detail)


def _bus(engine: Engine, settings: Settings) -> Check:
    from bridge.bus import open_bus

    try:
        bus = open_bus(settings.bus_url, engine=engine, partitions=settings.bus.partitions,
                       namespace=settings.bus.namespace)
        try:
            bus.epoch()
        finally:
            bus.close()
    except PollbridgeError:
        raise
    except Exception as exc:  # any client error: report it, masked, as a failed check
        reason = first_line(exc)
        return Check("bus", False, f"cannot reach the bus {mask_url(settings.bus_url)}: {mask_url(reason)}")
    return Check("bus", True, f"{mask_url(settings.bus_url)} reachable ({settings.bus.partitions} partitions)")


def _check(fn: Callable[..., Check], *args: Any) -> Check:
    try:
        return fn(*args)
    except PollbridgeError as exc:
        name = fn.__name__.strip("_")
        return Check(name, False, str(exc))


def _describe_mapping(tables: TaskTable) -> str:
    m = tables.mapping
    source = f"column {m.columns.workflow_type}" if m.columns.workflow_type else (
        f"table {m.instances.table}" if m.instances else "?")
    deps = "JSON column" if m.dependency_mode == "json" else f"edges table {m.edges.table if m.edges else '?'}"
    return (f"table {m.table}: {len(m.columns.mapped())} mapped columns found; "
            f"workflow type from {source}; dependencies in {deps}")


def _migrations(engine: Engine) -> Check:
    head = migrate.head_revision()
    current = migrate.current_revision(engine)
    if current == head:
        return Check("migrations", True, f"at head ({head})")
    if current is None:
        return Check("migrations", False, "pollbridge is not installed in this database: run `pollbridge init`")
    return Check("migrations", False, f"at {current}, head is {head}: run `pollbridge init` to upgrade")


def _dags(engine: Engine, tables: TaskTable) -> Check:
    tt = tables
    deps: dict[str, dict[str, list[str]]] = defaultdict(dict)
    with engine.connect() as conn:
        if tt.mapping.dependency_mode == "json":
            q = sa.select(tt.col("instance_id"), tt.col("task_key"), tt.col("depends_on")).limit(DAG_CHECK_LIMIT)
            rows: Sequence[Any] = conn.execute(q).all()

            for instance_id, key, raw in rows:
                value = json.loads(raw) if isinstance(raw, str) else (raw or [])
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    return Check("dags", False, f"instance {instance_id!r} task {key!r}: dependencies are not "
                                                "a JSON array of task keys")
                deps[str(instance_id)][str(key)] = value
        else:
            assert tt.edges is not None and tt.mapping.edges is not None
            e = tt.edges
            dep = tt.tasks.alias("pb_dep")
            q = (sa.select(tt.col("instance_id"), tt.col("task_key"), tt.col("task_key", dep),
                           tt.col("instance_id", dep))
                 .select_from(tt.tasks.outerjoin(e, e.c[tt.mapping.edges.task_id] == tt.col("id"))
                              .outerjoin(dep, tt.col("id", dep) == e.c[tt.mapping.edges.depends_on_id]))
                 .limit(DAG_CHECK_LIMIT))
            rows = conn.execute(q).all()
            row: Any
            for row in rows:
                instance_id, key, dep_key, dep_instance = row
                entry = deps[str(instance_id)].setdefault(str(key), [])
                if dep_key is not None:
                    if dep_instance != instance_id:
                        return Check("dags", False, f"instance {instance_id!r} task {key!r} depends on a task "
                                                    f"of another instance ({dep_instance!r})")
                    entry.append(str(dep_key))
    problems = []
    for instance_id, graph in deps.items():
        for key, wanted in graph.items():
            for d in wanted:
                if d not in graph:
                    problems.append(f"instance {instance_id!r}: task {key!r} depends on unknown task key {d!r}")
        cycle = find_cycle(graph)
        if cycle:
            problems.append(f"instance {instance_id!r}: dependency cycle {' -> '.join(cycle)}")
    scanned = sum(len(g) for g in deps.values())
    capped = " (first rows only)" if len(rows) >= DAG_CHECK_LIMIT else ""
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return Check("dags", False, "; ".join(problems[:3]) + more)
    return Check("dags", True, f"{len(deps)} instances, {scanned} tasks checked{capped}: no cycle, no unknown key")
