"""``init`` and ``uninstall``: pollbridge's own objects, and nothing else.

``init`` applies the migrations (idempotent: a database at head is left as it is) and, with
``demo_schema``, creates the reference legacy tables if they are missing. ``uninstall`` runs the
migrations down and drops the version table; it cannot reach the scheduler's tables because it
only ever drops objects the migrations created, all prefixed ``pollbridge_``. :func:`uninstall_all` also
empties the bus (:meth:`bridge.bus.base.EventBus.purge_all`: on Redis every key of pollbridge's
namespace), after checking that the bus answers, so an unreachable bus changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Engine

from bridge.bus.base import EventBus
from bridge.capture import wal
from bridge.capture.triggers import capture_target, install_capture, remove_capture
from bridge.core.errors import MappingMismatch, first_line
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import CaptureSettings
from bridge.db import migrate
from bridge.db.changes import remove_journal
from bridge.db.engine import check_connection, read_only
from bridge.db.filelock import remove_locks
from bridge.reference.schema import create_demo_schema
from bridge.tasktable import usersql
from bridge.tasktable.tables import TaskTable, reflect_tables


@dataclass(frozen=True)
class InitResult:
    revision_before: str | None
    revision_after: str
    demo_tables_created: tuple[str, ...]
    capture_installed: bool = False


def init(
    engine: Engine,
    *,
    demo_schema: bool = False,
    mapping: TaskTableMapping | None = None,
    capture: CaptureSettings | None = None,
    bus: EventBus | None = None,
) -> InitResult:
    """Apply the migrations; with a ``mapping``, also (re)install the capture triggers on its task table.

    The mapping is checked against the database before anything is migrated, so a mapping that
    names a missing table or column, or a view as the capture target, changes nothing (only the demo tables,
    when asked for, exist)."""
    check_connection(engine)
    created: list[str] = []
    if demo_schema:
        with engine.begin() as conn:
            created = create_demo_schema(conn)
    tables = None
    if mapping is not None and capture is not None and capture.mode == "wal":
        # Refused before anything is created: the server's settings, and what this mode cannot capture yet.
        with read_only(engine).connect() as conn:
            problems = wal.settings_problems(conn) if conn.dialect.name == "postgresql" else []
        if problems:
            raise MappingMismatch(f"[capture] mode = 'wal': {problems[0]}")
    if mapping is not None and mapping.install_sql is not None:
        # The mapping may read what its own SQL creates (Airflow's edges views): installed first, and rolled
        # back with everything else when the mapping then does not match or names a view as capture target.
        with engine.begin() as conn:
            usersql.install(conn, mapping)
            tables = reflect_tables(conn, mapping)
            capture_target(conn, tables)
            if capture is not None and capture.mode == "wal":
                wal.captured_columns(conn, tables)
    elif mapping is not None:
        tables = reflect_tables(engine, mapping)
        # A view cannot carry the capture triggers: refused here, before anything of pollbridge is created.
        with read_only(engine).connect() as conn:
            capture_target(conn, tables)
            if capture is not None and capture.mode == "wal":
                wal.captured_columns(conn, tables)
    before = migrate.current_revision(engine)
    if before != migrate.head_revision():
        migrate.upgrade(engine)
    after = migrate.current_revision(engine)
    assert after is not None
    if tables is not None:
        capture = capture or CaptureSettings()
        switch_capture(engine, tables, capture, bus=bus)
    return InitResult(before, after, tuple(created), tables is not None)


def switch_capture(engine: Engine, tables: TaskTable, capture: CaptureSettings, *, bus: EventBus | None = None,
                   timeout: float = 120.0) -> None:
    """Install the capture of ``capture.mode``, replacing the other one without losing or doubling a change.

    To the write-ahead log: the publication, then the slot (PostgreSQL creates a logical slot only outside a
    transaction that wrote; it streams from then on), then one transaction, holding the task table against
    writes for its duration, drops the triggers and marks the switch
    (:func:`bridge.capture.wal.mark_switch`): the triggers captured what committed before the mark, the log
    carries what commits after it. Back to the triggers: one transaction creates them and marks the end of
    the log's share; once the slot is confirmed past the mark (by the running relay, else streamed here with
    ``bus``), the slot and the publication are dropped."""
    pg = engine.dialect.name == "postgresql"
    if capture.mode == "wal":
        # The publication before the slot: pgoutput reads it with the catalog as of each change it decodes, and
        # a change from before the publication existed fails the stream ("publication does not exist").
        with engine.begin() as conn:
            wal.install_publication(conn, tables)
        wal.ensure_slot(engine)
        with engine.begin() as conn:
            wal.lock_task_table(conn, tables)
            remove_capture(conn)
            wal.mark_switch(conn, "wal")
        return
    with engine.begin() as conn:
        streaming = pg and wal.publication_exists(conn)
        if streaming:
            wal.lock_task_table(conn, tables)
        install_capture(conn, tables, wake=capture.wake,  # type: ignore[arg-type]
                        relay_partitions=capture.relay_partitions)
        stop = wal.mark_switch(conn, "trigger") if streaming else None
    if stop is not None:
        wal.wait_confirmed(engine, stop, timeout, tables, bus)
    _remove_wal(engine, end_stream=True)


def wal_installed(engine: Engine) -> bool:
    """Whether the write-ahead-log capture's publication is in the database (PostgreSQL)."""
    if engine.dialect.name != "postgresql":
        return False
    with read_only(engine).connect() as conn:
        try:
            return wal.publication_exists(conn)
        finally:
            conn.rollback()


def _remove_wal(engine: Engine, *, end_stream: bool = False) -> list[str]:
    """Drop the WAL capture's slot and publication, if any (outside a transaction, as the slot needs)."""
    if engine.dialect.name != "postgresql":
        return []
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        return wal.remove_wal(conn, end_stream=end_stream)


def uninstall(engine: Engine, mapping: TaskTableMapping | None = None) -> list[str]:
    """Remove pollbridge's objects (and what the mapping's ``install_sql`` created); return the tables that
    were dropped."""
    check_connection(engine)
    before = migrate.owned_tables(engine)
    _remove_wal(engine)
    with engine.begin() as conn:
        remove_capture(conn)
        if mapping is not None:
            usersql.uninstall(conn, mapping)
    if migrate.current_revision(engine) is not None:
        migrate.downgrade_all(engine)
    remove_journal(engine)  # SQLite: the commit-topic journal beside the database file (bridge.db.changes)
    remove_locks(engine)  # SQLite: the liveness lock files beside it (bridge.db.filelock)
    after = set(migrate.owned_tables(engine))
    return [t for t in before if t not in after]


@dataclass(frozen=True)
class UninstallResult:
    dropped: tuple[str, ...]  # pollbridge's tables that were dropped
    bus_removed: int | None  # keys (or rows) of the bus removed; None: the bus was not touched (or failed)
    bus_error: str | None = None  # the bus failed after the tables were dropped: why its data is left


def uninstall_all(engine: Engine, bus: EventBus | None, mapping: TaskTableMapping | None = None) -> UninstallResult:
    """:func:`uninstall`, then empty ``bus`` (``None``: leave the bus alone, or it lives in the dropped tables).

    The bus is asked first (a read): when it cannot be reached, this raises before anything is removed."""
    check_connection(engine)
    if bus is not None:
        bus.dead_letter_count()
    dropped = tuple(uninstall(engine, mapping))
    if bus is None:
        return UninstallResult(dropped, None)
    try:
        return UninstallResult(dropped, bus.purge_all())
    except Exception as exc:  # the bus went away after answering: the tables are gone, say what is left
        return UninstallResult(dropped, None, first_line(exc))
