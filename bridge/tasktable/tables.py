"""The existing scheduler's tables, seen through the mapping.

:func:`reflect_tables` loads the real tables named by the mapping from the database (so column
types are the user's, not guessed) and checks that every mapped column exists. The result,
:class:`TaskTable`, is the only way the rest of pollbridge reaches those tables: callers ask for
columns by *logical* name (``tt.col("status")``), never by the user's column names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import NoSuchTableError, OperationalError

from bridge.core.errors import DatabaseUnavailable, MappingMismatch, first_line
from bridge.core.mapping import TaskTableMapping


@dataclass(frozen=True)
class TaskTable:
    mapping: TaskTableMapping
    tasks: sa.Table
    instances: sa.Table | None
    edges: sa.Table | None
    dialect_name: str

    def col(self, logical: str, table: sa.FromClause | None = None) -> sa.ColumnElement[Any]:
        """The column for a logical name on ``table`` (the task table or an alias of it).

        A composite key (``instance_id = ["dag_id", "run_id"]``) is its text form: the parts cast to
        text and joined with ``/``, the same text capture writes into events (see :meth:`key_text`)."""
        parts = self.mapping.columns.parts(logical)
        if not parts:
            raise KeyError(f"column {logical!r} is not mapped")
        source = self.tasks if table is None else table
        if len(parts) > 1:
            return self.key_text(logical, source)
        column: sa.ColumnElement[Any] = source.c[parts[0]]
        return column

    def parts(self, logical: str, table: sa.FromClause | None = None) -> list[sa.ColumnElement[Any]]:
        """The column(s) of a logical name on ``table``: one, or a composite key's parts."""
        source = self.tasks if table is None else table
        return [source.c[name] for name in self.mapping.columns.parts(logical)]

    def key_text(self, logical: str, table: sa.FromClause | None = None) -> sa.ColumnElement[Any]:
        """A key as text: the column cast to text, or a composite key's parts joined with ``/``.

        The separator is not escaped: a composite key is unambiguous as long as no part but the last
        contains ``/`` (Airflow's dag ids cannot; its run ids may only as the last part)."""
        columns = self.parts(logical, table)
        texts = [sa.cast(c, sa.String) for c in columns]
        if len(texts) == 1:
            return texts[0]
        joined: sa.ColumnElement[Any] = texts[0]
        for text in texts[1:]:
            joined = joined + sa.literal("/", sa.String) + text
        return sa.type_coerce(joined, sa.String)

    def key_equal(self, logical: str, a: sa.FromClause, b: sa.FromClause) -> sa.ColumnElement[bool]:
        """Rows ``a`` and ``b`` have the same key, compared part by part (so an index on the parts serves)."""
        return sa.and_(*(x == y for x, y in zip(self.parts(logical, a), self.parts(logical, b), strict=True)))

    def has(self, logical: str) -> bool:
        return getattr(self.mapping.columns, logical) is not None

    @property
    def statuses(self) -> Any:
        return self.mapping.statuses

    def status_in(self, *names: str, table: sa.FromClause | None = None) -> sa.ColumnElement[bool]:
        """The row's status is one of the logical statuses ``names`` (every stored value of each, SQL NULL
        included where the mapping says NULL means one of them). A status with one value compiles to a
        plain ``=``, as before lists existed."""
        column = self.col("status", table)
        values: list[str] = []
        null = False
        for name in names:
            for value in self.statuses.of(name):
                if value is None:
                    null = True
                elif value not in values:
                    values.append(value)
        clauses: list[sa.ColumnElement[bool]] = []
        if len(values) == 1:
            clauses.append(column == values[0])
        elif values:
            clauses.append(column.in_(values))
        if null:
            clauses.append(column.is_(None))
        if not clauses:
            return sa.false()
        return clauses[0] if len(clauses) == 1 else sa.or_(*clauses)

    def readiness_columns(self) -> tuple[str, ...]:
        """Task-table columns readiness reads beyond the logical ones (a subquery over the task table that
        readiness is applied to must carry them): the trigger rule, the commit time that floors the ready
        time, and in ``keys`` mode the key column and the columns an edge is matched on."""
        names: list[str] = []
        for logical in ("trigger_rule", "committed_at"):
            if column := getattr(self.mapping.columns, logical):
                names.append(column)
        if self.mapping.dependency_mode == "keys" and self.mapping.edges is not None:
            names += [self.mapping.dependency_key_column, *self.mapping.edges.match]
        return tuple(dict.fromkeys(names))

    @property
    def has_rules(self) -> bool:
        """Whether trigger rules are mapped (else every dependency must be completed: all_success)."""
        edges = self.mapping.edges
        return self.has("trigger_rule") or (edges is not None and edges.rule is not None)

    def workflow_type_source(
        self, tasks: sa.FromClause, only_instances: sa.BindParameter[Any] | None = None
    ) -> tuple[sa.FromClause, sa.ColumnElement[Any]]:
        """``(from_clause, type_expression)`` giving each task row its workflow type.

        ``only_instances`` (an expanding bind parameter of instance ids) restricts the join to those
        instances, so the planner looks them up by key instead of hashing the whole instances table."""
        if self.instances is None:
            return tasks, self.col("workflow_type", tasks)
        inst = self.instances
        assert self.mapping.instances is not None
        on = inst.c[self.mapping.instances.id] == self.col("instance_id", tasks)
        if only_instances is not None:
            on = sa.and_(on, inst.c[self.mapping.instances.id].in_(only_instances))
        joined = tasks.outerjoin(inst, on)
        return joined, inst.c[self.mapping.instances.workflow_type]


def reflect_tables(bind: Engine | Connection, mapping: TaskTableMapping) -> TaskTable:
    """Reflect the mapped tables; raise :class:`MappingMismatch` naming any missing table or column."""
    try:
        return _reflect_tables(bind, mapping)
    except MappingMismatch as exc:
        if mapping.install_sql is None or "does not exist in the database" not in str(exc):
            raise
        raise MappingMismatch(f"{exc}; if {mapping.install_sql} creates it, run `pollbridge init`") from None


def _reflect_tables(bind: Engine | Connection, mapping: TaskTableMapping) -> TaskTable:
    metadata = sa.MetaData()
    tasks = _reflect(bind, metadata, mapping.read_table or mapping.table, mapping.schema)
    _require_columns(tasks, mapping.columns.mapped().items(), "mapping.columns")
    for column, _value in mapping.dispatch_set:
        _require_columns(tasks, [("set", column)], "mapping.dispatch")
    instances = None
    if mapping.type_from_instances:
        assert mapping.instances is not None
        instances = _reflect(bind, metadata, mapping.instances.table, mapping.instances.schema)
        _require_columns(
            instances,
            [("id", mapping.instances.id), ("workflow_type", mapping.instances.workflow_type)],
            "mapping.instances",
        )
    edges = None
    if mapping.dependency_mode == "edges":
        assert mapping.edges is not None
        edges = _reflect(bind, metadata, mapping.edges.table, mapping.edges.schema)
        _require_columns(
            edges,
            [("task_id", mapping.edges.task_id), ("depends_on_id", mapping.edges.depends_on_id)],
            "mapping.dependencies",
        )
    elif mapping.dependency_mode == "keys":
        assert mapping.edges is not None and mapping.edges.task_key and mapping.edges.depends_on_key
        edges = _reflect(bind, metadata, mapping.edges.table, mapping.edges.schema)
        wanted = [("task_key", mapping.edges.task_key), ("depends_on_key", mapping.edges.depends_on_key),
                  *[("match", m) for m in mapping.edges.match]]
        if mapping.edges.rule:
            wanted.append(("rule", mapping.edges.rule))
        _require_columns(edges, wanted, "mapping.dependencies")
        _require_columns(tasks, [("key_column", mapping.dependency_key_column),
                                 *[("match", m) for m in mapping.edges.match]], "mapping.dependencies")
    return TaskTable(mapping, tasks, instances, edges, bind.dialect.name)


def _qualified(name: str, schema: str | None) -> str:
    return f"{schema}.{name}" if schema else name


def _reflect(bind: Engine | Connection, metadata: sa.MetaData, name: str, schema: str | None) -> sa.Table:
    try:
        return sa.Table(name, metadata, schema=schema, autoload_with=bind)
    except OperationalError as exc:
        if "unknown database" not in str(exc.orig):  # a connection cut, a lock: not a missing table
            reason = first_line(exc)
            raise DatabaseUnavailable(f"cannot read table {_qualified(name, schema)!r}: {reason}") from None
        raise _missing(name, schema) from None  # SQLite: the schema (attached database) does not exist
    except NoSuchTableError:
        raise _missing(name, schema) from None


def _missing(name: str, schema: str | None) -> MappingMismatch:
    return MappingMismatch(
            f"table {_qualified(name, schema)!r} named by the mapping does not exist in the database; "
            "fix the [mapping] section of pollbridge.toml or create the table "
            "(pollbridge init --demo-schema creates the reference one)"
        )


def _require_columns(table: sa.Table, wanted: Any, where: str) -> None:
    for logical, column in wanted:
        if column not in table.c:
            raise MappingMismatch(
                f"column {column!r} ({where}.{logical}) does not exist in table "
                f"{_qualified(table.name, table.schema)!r}; existing columns: {', '.join(table.c.keys())}"
            )


def parse_task_id(tt: TaskTable, raw: str, error: type[Exception]) -> Any:
    """``raw`` as a value of the task table's id column, or ``error`` with a clear message.

    Integer ids must be plain ASCII digits within the column's range: ``int()`` would also take
    ``" 10 "``, ``"1_0"`` or other scripts' digits, and an id past the range would reach the database
    as an overflow."""
    column_type = tt.col("id").type
    try:
        python_type = column_type.python_type
    except NotImplementedError:
        return raw
    where = f"{tt.mapping.table}.{tt.mapping.columns.id}"
    if python_type is int:
        limit = 2**31 if type(column_type).__name__.upper() in ("INTEGER", "SMALLINTEGER") and \
            tt.dialect_name == "postgresql" else 2**63
        if not (isinstance(raw, str) and re.fullmatch(r"-?[0-9]{1,19}", raw)) or not -limit <= int(raw) < limit:
            raise error(f"task id {raw!r} is not a valid integer id of {where}")
        return int(raw)
    try:
        return python_type(raw)
    except (TypeError, ValueError):
        raise error(f"task id {raw!r} is not a valid {python_type.__name__} (the type of {where})") from None
