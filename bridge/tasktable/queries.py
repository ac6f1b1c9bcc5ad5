"""SQL expressions built from the mapping that both dispatch paths use (the event scheduler and the poller).

Each path keeps its own statements in a query module of its own (:mod:`event_scheduler.queries`,
:mod:`legacy_poller.queries`); what they share lives here.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from bridge.tasktable.tables import TaskTable


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
