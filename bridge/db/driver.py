"""Hot statements sent straight through the driver: compiled by SQLAlchemy once, executed by psycopg.

The event scheduler runs two statements per batch (its evaluation and its dispatch), hundreds of times
a second. Through ``Connection.execute`` each call spends more CPU in SQLAlchemy's execution context and
result machinery than in the driver: measured 0.54 ms of CPU per evaluation call through SQLAlchemy,
0.19 ms through this module, 0.17 ms as bare psycopg (``python -m bench.evaluate_cost``). A
:class:`DriverStatement` compiles the Core statement once for the engine's dialect and runs the SQL
text SQLAlchemy would have sent, with the parameters it would have sent, on the psycopg connection
underneath the caller's :class:`~sqlalchemy.engine.Connection`: same connection, same transaction (or
autocommit), same SQL.

It takes the direct path only where that is provably the same as SQLAlchemy's: PostgreSQL through
psycopg, no parameter given per call rendered into the SQL (an expanding ``IN`` of a parameter; a literal
``IN`` list is rendered once, as SQLAlchemy renders it per call), bind and result processors applied
as SQLAlchemy would apply them. Anything else runs through ``Connection.execute``. What the direct path
keeps of SQLAlchemy's execution:

* ``before_cursor_execute`` listeners are called with the cursor, the SQL and the parameters (statement
  counters and fault-injection tests see these statements too);
* a driver error is raised as SQLAlchemy's wrapped ``DBAPIError``, and a connection the dialect finds
  disconnected is invalidated, so the pool never hands it out again;
* a statement on a connection outside a transaction begins one, as SQLAlchemy's autobegin does.

What it does not keep: listeners get no execution context (``None``) and their return values are
ignored; ``echo`` and ``handle_error`` hooks are skipped; a disconnect invalidates this connection only
(the pool's pre-ping finds the others). Instrumentation that needs the execution context should not
rely on seeing these statements.

Rows are named tuples: attribute access by label, like SQLAlchemy's ``Row``.

The SQL is handed to psycopg once converted to its server form (``$1`` placeholders, through a
``RawCursor``), with the values in that order. psycopg converts a ``%(name)s`` query on every call and
caches the conversion only for queries up to 4,096 bytes and 50 parameters; the scheduler's combined
evaluation is 8 KB with 55 parameters, and the conversion (a regular-expression split of the text) was a
quarter of the scheduler's Python time at 500 completions/s (py-spy, ``bench.minimal``). Listeners still
see SQLAlchemy's text and a dict of values.
"""

from __future__ import annotations

import re
from collections import namedtuple
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError

Processor = Callable[[Any], Any]

#: What SQLAlchemy's ``pyformat`` output holds besides SQL: a named placeholder, or an escaped percent sign.
_PYFORMAT = re.compile(r"%\(([^()%]+)\)s|%%|%")


def server_form(sql: str) -> tuple[str, tuple[str, ...]] | None:
    """``sql`` (``pyformat``, as SQLAlchemy renders it for psycopg) with ``$n`` placeholders, and the parameter
    name of each ``$n`` in order (a name used twice is one placeholder). ``None`` if the text holds a percent
    sign that is neither (not something SQLAlchemy renders; such a statement keeps psycopg's own conversion)."""
    order: dict[str, int] = {}
    bad = False

    def place(match: re.Match[str]) -> str:
        nonlocal bad
        if match.group(0) == "%%":
            return "%"
        name = match.group(1)
        if name is None:
            bad = True
            return "%"
        return f"${order.setdefault(name, len(order) + 1)}"

    converted = _PYFORMAT.sub(place, sql)
    return None if bad else (converted, tuple(order))


class DriverStatement:
    """A Core statement compiled once for ``dialect``; :meth:`all` and :meth:`scalars` run it.

    Thread-safe: the only state set after construction is the result processors, on the first run (two
    threads racing there compute the same list). The statement must return rows (a ``SELECT`` or a DML
    statement with ``RETURNING``)."""

    def __init__(self, statement: sa.Select[Any] | sa.Insert | sa.Update | sa.Delete, dialect: Dialect) -> None:
        self.statement = statement
        self._direct = False
        self._sql = ""
        self._defaults: dict[str, Any] = {}
        self._bind: dict[str, Processor] = {}
        self._required: frozenset[str] = frozenset()
        self._result: list[Processor | None] | None = None  # from the first result's column types
        self._types: list[Any] = []
        self._dialect = dialect
        self._row: Any = None
        self._raw = ""  # the SQL in psycopg's server form, for a RawCursor
        self._order: tuple[str, ...] = ()  # the parameter of each $n
        if dialect.name != "postgresql" or dialect.driver != "psycopg":
            return
        compiled = statement.compile(dialect=dialect)
        required = {name for name, bind in compiled.binds.items() if bind.required}
        # A literal IN list is rendered at execution time (a post-compile parameter); its values are fixed,
        # so it is rendered once here. A parameter given per call must not change the SQL text.
        late = [*getattr(compiled, "post_compile_params", ()), *getattr(compiled, "literal_execute_params", ())]
        if any(bind.required for bind in late) or getattr(compiled, "escaped_bind_names", None) \
                or dialect.paramstyle != "pyformat":
            return
        columns: list[Any] = list(statement.selected_columns if isinstance(statement, sa.Select)
                                  else statement.exported_columns)
        keys = [c.key for c in columns]
        if not keys or len(set(keys)) != len(keys) or not all(k.isidentifier() and not k.startswith("_")
                                                               for k in keys):
            return
        if any(bind.callable is not None for bind in compiled.binds.values()):
            return  # its value is computed per execution
        expanded = compiled.construct_expanded_state(dict.fromkeys(required))
        self._sql = expanded.statement
        self._required = frozenset(required)
        processors: dict[str, Processor] = dict(expanded.processors)  # a rendered IN list's own names
        for name, bind in compiled.binds.items():
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if processor is not None and name in expanded.parameters:
                processors[name] = processor
        # Fixed values are processed once; only what a call passes is processed per call.
        self._defaults = {k: (processors[k](v) if k in processors else v)
                          for k, v in expanded.parameters.items() if k not in required}
        self._bind = processors
        self._types = [c.type.dialect_impl(dialect) for c in columns]
        self._row = namedtuple("DriverRow", keys)  # type: ignore[misc]
        form = server_form(self._sql)
        if form is None or set(form[1]) != set(expanded.parameters):
            return
        # Text, not bytes: psycopg encodes it in the connection's client encoding (a mapped name need not be ASCII).
        self._raw, self._order = form[0], form[1]
        self._direct = True

    @property
    def direct(self) -> bool:
        """Whether calls go straight to the driver (else through ``Connection.execute``)."""
        return self._direct

    def all(self, conn: Connection, params: Mapping[str, Any]) -> list[Any]:
        """Every row, as named tuples (or SQLAlchemy rows on the fallback path)."""
        if not self._direct:
            return list(conn.execute(self.statement, dict(params)).all())
        rows, procs = self._run(conn, params)
        make = self._row._make
        if not any(procs):
            return [make(r) for r in rows]
        return [make(v if p is None else p(v) for p, v in zip(procs, r, strict=True)) for r in rows]

    def scalars(self, conn: Connection, params: Mapping[str, Any]) -> list[Any]:
        """The first column of every row."""
        if not self._direct:
            return list(conn.execute(self.statement, dict(params)).scalars())
        rows, procs = self._run(conn, params)
        first = procs[0]
        return [r[0] if first is None else first(r[0]) for r in rows]

    def _run(self, conn: Connection, params: Mapping[str, Any]) -> tuple[Sequence[tuple[Any, ...]],
                                                                        list[Processor | None]]:
        missing = self._required.difference(params)
        if missing:  # SQLAlchemy's error and words
            raise sa.exc.InvalidRequestError(f"A value is required for bind parameter {min(missing)!r}")
        values = dict(self._defaults)
        for name, value in params.items():
            processor = self._bind.get(name)
            values[name] = value if processor is None else processor(value)
        if not conn.in_transaction():
            conn.begin()  # what SQLAlchemy's autobegin does, so its commit() and rollback() act on this
        raw = conn.connection.driver_connection
        assert raw is not None
        cursor: Any = None  # a psycopg RawCursor; SQLAlchemy types it as its DBAPICursor protocol
        try:
            cursor = psycopg.RawCursor(raw)
            for listener in conn.dispatch.before_cursor_execute:
                listener(conn, cursor, self._sql, values, None, False)
            cursor.execute(self._raw, [values[name] for name in self._order], prepare=True)
            rows: list[tuple[Any, ...]] = cursor.fetchall()
            procs = self._result
            if procs is None:  # as SQLAlchemy does: the processors for the types the server reports
                description = cursor.description or []
                procs = self._result = [t.result_processor(self._dialect, d.type_code)
                                        for t, d in zip(self._types, description, strict=True)]
            return rows, procs
        except conn.dialect.loaded_dbapi.Error as exc:
            invalidated = conn.dialect.is_disconnect(exc, raw, cursor)
            if invalidated:
                conn.invalidate(exc)
            raise DBAPIError.instance(self._sql, values, exc, conn.dialect.loaded_dbapi.Error,
                                      connection_invalidated=invalidated, dialect=conn.dialect) from exc
        finally:
            if cursor is not None:
                cursor.close()
