"""SQL expressions built from the mapping that both dispatch paths use (the event scheduler and the poller).

Each path keeps its own statements in a query module of its own (:mod:`event_scheduler.queries`,
:mod:`legacy_poller.queries`); what they share lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from bridge.tasktable.tables import TaskTable, parse_task_id


def type_of_row(tt: TaskTable, t: sa.FromClause) -> sa.ColumnElement[Any]:
    """The workflow type of task row ``t`` as a scalar expression (usable in an UPDATE's WHERE).

    With an instances table, a correlated scalar subquery: a primary-key lookup per row, whatever the
    statistics say (a join could turn into a hash of the whole instances table)."""
    if tt.instances is None:
        return tt.col("workflow_type", t)
    assert tt.mapping.instances is not None
    inst = tt.instances
    return (
        sa.select(inst.c[tt.mapping.instances.workflow_type])
        .where(inst.c[tt.mapping.instances.id] == tt.col("instance_id", t))
        .scalar_subquery()
    )


def in_flight_statement(tt: TaskTable) -> sa.Select[Any]:
    """Backpressure (``max_in_flight``): rows ``(workflow_type, count)`` of the dispatched and running
    tasks per workflow type. Read only when a type has a limit, once per dispatch round."""
    all_src, any_type = tt.workflow_type_source(tt.tasks)
    return (sa.select(any_type.label("workflow_type"), sa.func.count()).select_from(all_src)
            .where(tt.status_in("dispatched", "running")).group_by(any_type))


def in_ids(column: sa.ColumnElement[Any], pg: bool) -> sa.ColumnElement[bool]:
    """``column`` is one of the ``ids`` parameter: ``= ANY(array)`` on PostgreSQL (one SQL text whatever
    the number of ids), an expanding ``IN`` elsewhere."""
    if pg:
        return column == sa.any_(sa.bindparam("ids", type_=postgresql.ARRAY(column.type)))
    return column.in_(sa.bindparam("ids", expanding=True))


def spawn_depth_statement(tt: TaskTable, pg: bool) -> sa.Select[Any]:
    """The depth guard with ``mapping.columns.spawned_by``: rows ``(task_id, depth)`` for the task ids in the
    ``ids`` parameter, the depth being the length of the chain of spawning tasks, followed at most ``cap``
    links (a parameter: ``max_depth`` + 1, so a cycle or a very deep chain costs a bounded walk)."""
    t = tt.tasks
    start = (sa.select(tt.col("id").label("task_id"), tt.col("spawned_by").label("parent"),
                       sa.literal(0, sa.Integer).label("depth"))
             .where(in_ids(tt.col("id"), pg)).cte("pb_chain", recursive=True))
    up = t.alias("pb_up")
    chain = start.union_all(
        sa.select(start.c.task_id, tt.col("spawned_by", up), start.c.depth + 1)
        .select_from(start.join(up, tt.col("id", up) == start.c.parent))
        .where(start.c.depth < sa.bindparam("cap", type_=sa.Integer)))
    # A link whose spawning row is gone still counts: the task was spawned, whatever happened to its parent.
    counted = sa.case((chain.c.parent.is_(None), chain.c.depth), else_=chain.c.depth + 1)
    return sa.select(chain.c.task_id, sa.func.max(counted).label("depth")).group_by(chain.c.task_id)


#: How far the events' depth follows a ``spawned_by`` chain (the guard walks at most ``max_depth`` + 1 links;
#: an event's depth is informational, so deeper than this it reads as this).
EVENT_DEPTH_CAP = 1000


def spawn_depths(conn: Connection, tt: TaskTable, task_ids: Sequence[str],
                 cap: int = EVENT_DEPTH_CAP) -> dict[str, int]:
    """The causation depth of each task of ``task_ids`` (their ids as text) from ``mapping.columns.spawned_by``:
    one query; a task not found is left out. For the capture's events (the relay, the WAL capture)."""
    if not task_ids or not tt.has("spawned_by"):
        return {}
    keys = []
    for text in dict.fromkeys(task_ids):
        try:
            keys.append(parse_task_id(tt, text, ValueError))
        except ValueError:
            continue  # not an id of this table (a hand-written outbox row): no depth
    if not keys:
        return {}
    stmt = spawn_depth_statement(tt, conn.dialect.name == "postgresql")
    return {str(k): int(v) for k, v in conn.execute(stmt, {"ids": keys, "cap": cap}).all()}
