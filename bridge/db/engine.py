"""Database access: engines, the database clock, statement counting and URL masking.

Components accept either an :class:`~sqlalchemy.engine.Engine` or a URL; :func:`open_engine`
returns the engine and whether the caller owns it, so a component closes only what it opened.

SQLite (the embedded default) runs in WAL mode with a busy timeout, and every transaction starts
with ``BEGIN IMMEDIATE``: pysqlite's deferred transactions turn a read-then-write race between two
threads into an immediate ``database is locked`` error that no timeout can wait out.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.sql.elements import ColumnElement

from bridge.core.errors import ConfigError, DatabaseUnavailable, first_line
from bridge.core.urls import mask_url
from bridge.db.changes import NotifyingConnection, change_signal, check_topics

SQLITE_BUSY_TIMEOUT_MS = 30_000




def normalize_url(url: str) -> URL:
    """Parse a database URL, selecting psycopg 3 for plain ``postgresql://`` URLs."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(
            f"invalid database URL {mask_url(url)!r}; expected e.g. sqlite:///pollbridge.db or "
            "postgresql://user@host:5432/dbname"
        ) from None
    if parsed.drivername == "postgres":  # the libpq spelling
        parsed = parsed.set(drivername="postgresql")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigError(
            f"unsupported database {parsed.get_backend_name()!r} in {mask_url(parsed)}; "
            "supported: sqlite, postgresql"
        )
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


OTHER_STATEMENTS = "other"


class StatementCounter:
    """Counts the SQL statements an engine executes: the figure behind "statements per dispatch".

    ``count`` is every statement. With ``classes`` (a name for each group of table names, in order, given
    here or later to :meth:`classify`) each statement is also counted under the first class one of whose
    tables it names (:data:`OTHER_STATEMENTS` when none: transaction control, ``SELECT 1``, tables of no
    class): the embedded bus keeps its log in the same database as the task table, and its statements
    are then counted apart from the task table's. A table name matches as a whole identifier, quoted or
    not, schema-qualified or not, in any case."""

    def __init__(self, classes: Mapping[str, Iterable[str]] | None = None) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self._by_class: dict[str, int] = {}
        self._patterns: list[tuple[str, re.Pattern[str]]] = []
        self._seen: dict[str, str] = {}  # statement text -> its class (the texts repeat: compiled once)
        if classes:
            self.classify(classes)

    def attach(self, engine: Engine) -> None:
        sa.event.listen(engine, "before_cursor_execute", self._on_execute)

    def classify(self, classes: Mapping[str, Iterable[str]]) -> None:
        """Count statements by the tables they name from now on (earlier statements are in ``count`` only)."""
        patterns = []
        for name, tables in classes.items():
            names = sorted({t for t in tables if t}, key=len, reverse=True)
            if names:
                alternatives = "|".join(f'"{re.escape(t)}"|{re.escape(t)}' for t in names)
                patterns.append((name, re.compile(rf'(?<![\w$"])(?:{alternatives})(?![\w$"])', re.IGNORECASE)))
        with self._lock:
            self._patterns = patterns
            self._seen = {}

    def by_class(self) -> dict[str, int]:
        """Statements counted under each class since :meth:`classify` (a class with none is absent)."""
        with self._lock:
            return dict(self._by_class)

    def _class_of(self, statement: str) -> str:
        for name, pattern in self._patterns:
            if pattern.search(statement):
                return name
        return OTHER_STATEMENTS

    def _on_execute(self, _conn: Any, _cursor: Any, statement: Any = "", *_args: Any, **_kwargs: Any) -> None:
        with self._lock:
            self.count += 1
            if not self._patterns:
                return
            text = statement if isinstance(statement, str) else str(statement)
            kind = self._seen.get(text)
            if kind is None:
                kind = self._class_of(text)
                if len(self._seen) >= 10_000:  # texts that vary per call (expanding IN lists): stay bounded
                    self._seen.clear()
                self._seen[text] = kind
            self._by_class[kind] = self._by_class.get(kind, 0) + 1


def create_engine(url: str, *, pool_size: int = 5) -> Engine:
    """Create an engine for a pollbridge URL (not connected yet)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = sa.create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
                                                        "factory": NotifyingConnection})
        _configure_sqlite(engine)
        return engine
    return sa.create_engine(
        parsed,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args={"options": "-c timezone=UTC", "connect_timeout": 10},
    )


READ_ONLY = "pollbridge_read_only"


def read_only(engine: Engine) -> Engine:
    """The same engine for read-only work: on SQLite its transactions are deferred (no write lock).

    Never write through it on SQLite: a deferred transaction that later writes can fail at once with
    "database is locked" instead of waiting."""
    return engine.execution_options(**{READ_ONLY: True})


TOPICS = "pollbridge_topics"


def quiet(engine: Engine) -> Engine:
    """The same engine for writes no component waits for (lease renewals, a bus reader's offsets): on SQLite
    their commits wake no one (:mod:`bridge.db.changes`). Elsewhere the same engine."""
    return engine.execution_options(**{TOPICS: frozenset()})


def about(engine: Engine, *topics: str) -> Engine:
    """The same engine for writes about ``topics`` (``bus``: an embedded-bus publish): on SQLite their commits
    wake only the waiters for those (:mod:`bridge.db.changes`)."""
    return engine.execution_options(**{TOPICS: check_topics(topics)})


def finds_a_row(reader: Engine, statement: sa.Select[Any]) -> bool:
    """Whether ``statement`` returns a row, read through ``reader`` as one statement with no transaction
    around it (:func:`autocommit`): on SQLite the look a poller takes before a claim, which is a write
    transaction and would take the database's one write lock even when it finds nothing. (It was a
    read transaction: a ``BEGIN`` per look, 0.2 of the idle relay's statements a second.)"""
    with autocommit(reader).connect() as conn:
        return conn.execute(statement).first() is not None


#: SQLite: the connection's statements run each in SQLite's own implicit transaction (no BEGIN), reads only.
STATEMENTS_ALONE = "pollbridge_statements_alone"


def autocommit(engine: Engine) -> Engine:
    """The engine for single statements that need no transaction around them (reads, and writes that are
    atomic as one statement): no BEGIN and COMMIT round trips on PostgreSQL. On SQLite, reads only (as
    :func:`read_only`), each statement in SQLite's implicit transaction, as on PostgreSQL: no ``BEGIN`` (the
    event scheduler's evaluation sent one per instance batch, a statement per completion of the embedded
    default's 25 in `bench.cost`)."""
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="AUTOCOMMIT")
    return engine.execution_options(**{STATEMENTS_ALONE: True})


def discard(conn: Connection | None) -> None:
    """Let a kept connection go, invalidated rather than returned to the pool: it may carry session settings
    (asynchronous commit, custom plans) another user of the engine must not inherit, or be broken."""
    if conn is None:
        return
    with contextlib.suppress(Exception):
        conn.invalidate()
    with contextlib.suppress(Exception):
        conn.close()


def open_engine(engine_or_url: Engine | str) -> tuple[Engine, bool]:
    """``(engine, owned)``: ``owned`` is true when this call created the engine (the caller disposes it)."""
    if isinstance(engine_or_url, Engine):
        return engine_or_url, False
    return create_engine(engine_or_url), True


def check_connection(engine: Engine) -> None:
    """Connect once; raise :class:`DatabaseUnavailable` with a masked URL when that fails."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except OperationalError as exc:
        reason = first_line(exc)
        raise DatabaseUnavailable(f"cannot connect to {mask_url(engine.url)}: {reason}") from None


def _configure_sqlite(engine: Engine) -> None:
    signal = change_signal(engine)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        if isinstance(dbapi_conn, NotifyingConnection):  # its commits wake this process's waiters
            dbapi_conn.pb_signal = signal
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()
        # The frozen routing hash, so SQLite scans can filter a selective percentage in SQL as PostgreSQL does.
        dbapi_conn.create_function("pollbridge_bucket", 2, _sqlite_bucket, deterministic=True)

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        options = conn.get_execution_options()
        dbapi_conn = conn.connection.dbapi_connection
        if isinstance(dbapi_conn, NotifyingConnection):  # what its commit is about (bridge.db.changes)
            dbapi_conn.pb_topics = options.get(TOPICS)
        if options.get(STATEMENTS_ALONE):  # autocommit(): each read in SQLite's implicit transaction
            return
        # Read-only work (see read_only()) takes no write lock: in WAL mode it never blocks writers.
        if options.get(READ_ONLY):
            conn.exec_driver_sql("BEGIN")
            return
        writer = dbapi_conn if isinstance(dbapi_conn, NotifyingConnection) else None
        if writer is not None:  # this process's writers queue on a lock of their own (bridge.db.changes)
            writer.pb_begin_write()
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            if writer is not None:
                writer.pb_end_write()
            raise


def _sqlite_bucket(workflow_type: str | None, instance_id: Any) -> int:
    from bridge.core.phases import bucket

    return bucket(workflow_type, str(instance_id))


def is_sqlite(bind: Engine | Connection) -> bool:
    return bind.dialect.name == "sqlite"


def db_now(dialect_name: str) -> ColumnElement[Any]:
    """The database clock as an expression: ``clock_timestamp()`` on PostgreSQL (not the transaction
    start, so timestamps inside one transaction still order), millisecond UTC text on SQLite."""
    if dialect_name == "postgresql":
        return sa.func.clock_timestamp()
    return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now")


def db_ago(dialect_name: str, seconds: float) -> ColumnElement[Any]:
    """The database clock minus ``seconds`` (bound, never formatted into the SQL), comparable with
    timestamps written by :func:`db_now`."""
    if dialect_name == "postgresql":
        return sa.func.clock_timestamp() - sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam(None, float(seconds)))
    return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", sa.bindparam(None, f"-{float(seconds)!r} seconds"))


def millis_between(dialect_name: str, start: Any, end: Any) -> ColumnElement[Any]:
    """``end - start`` in milliseconds, as a float expression."""
    if dialect_name == "postgresql":
        # date_part is double precision; extract() is numeric since PostgreSQL 14, several times slower
        # over a million rows.
        return sa.func.date_part("epoch", end - start) * 1000.0
    # SQLite's date functions resolve milliseconds, and a difference of two julianday() values carries
    # an error of up to about 0.1 ms: round to the millisecond, so 10 ms is 10 ms (not 10.00004) at a
    # histogram edge or an objective.
    return sa.func.round((sa.func.julianday(end) - sa.func.julianday(start)) * 86_400_000.0)
