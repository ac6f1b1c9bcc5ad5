"""The outbox relay's SQL: one named function per statement, each saying what it is for.

:meth:`RelayQueries.build` builds the statements a :class:`~bridge.capture.relay.Relay` runs every cycle
once, for its partition, batch size and the engine's dialect; the statements that take per-call values (a
cutoff time, an epoch, dead-lettered ids) are built by its methods. The relay only runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect

from bridge.core.events import SOURCE, SPECVERSION, TASK_SIGNAL_RECEIVED, TASK_STATUS_CHANGED
from bridge.db.driver import DriverStatement
from bridge.db.engine import db_now
from bridge.db.schema import outbox, outbox_dead, relay_state


def event_payload_sql(dialect_name: str, o: Any = outbox.c) -> sa.ColumnElement[str]:
    """The CloudEvent JSON of an outbox row, built by the database (C speed, off the relay's GIL).

    Equivalent to ``row_to_event(row).to_json()`` up to key order and whitespace; the relay uses it
    only for rows that pass the same validation ``row_to_event`` does. ``o``: the row's columns (the
    outbox's; the capture trigger's notice passes its record's, :func:`event_notice_sql`)."""
    if dialect_name == "postgresql":
        build = sa.func.json_build_object
        time = sa.func.to_char(sa.func.timezone("UTC", o.created_at), 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
    else:
        build = sa.func.json_object
        time = sa.func.strftime("%Y-%m-%dT%H:%M:%fZ", o.created_at)
    fields = ("task_id", o.task_id, "instance_id", o.instance_id, "workflow_type", o.workflow_type,
              "task_key", o.task_key, "old_status", o.old_status, "new_status", o.new_status,
              "change", o.change, "version", o.id)
    # ``attempt`` only when the row has one (row_to_event leaves it out otherwise).
    data: sa.ColumnElement[Any]
    if dialect_name == "postgresql":
        data = sa.case((o.attempt.is_(None), build(*fields)), else_=build(*fields, "attempt", o.attempt))
    else:  # a JSON merge patch drops a member whose value is null
        data = sa.func.json_patch(build(*fields), build("attempt", o.attempt))
    envelope = build("specversion", SPECVERSION, "id", o.event_id, "source", SOURCE, "type",
                     sa.case((o.change == "signal", TASK_SIGNAL_RECEIVED), else_=TASK_STATUS_CHANGED),
                     "subject", o.task_id, "time", time, "datacontenttype", "application/json",
                     "partitionkey", o.instance_id,
                     "depth", sa.case((o.depth > 0, o.depth), else_=0), "traceid", o.trace_id, "data", data)
    return sa.cast(envelope, sa.Text).label("payload")


#: The prefix of a notification that carries its change's event: ``e:<relay partition>:<event JSON>``.
EVENT_NOTICE = "e:"
#: PostgreSQL refuses a notification payload of 8,000 bytes or more; a longer notice is sent empty (the claim
#: publishes the event).
NOTICE_LIMIT = 7900
#: The capture trigger sends an event only when no unpublished row of its instance has one of this many outbox
#: ids below its own, and the relay publishes it early only when its last claim took an id no further below: an
#: event published before its claim must not overtake an earlier change of its instance (``send_event``).
EVENT_WINDOW = 64


def event_notice_sql(prefix: str) -> str:
    """The capture trigger's notice for the outbox row it just inserted, whose columns it holds in PL/pgSQL
    variables named ``prefix`` + column (``capture_function``): :data:`EVENT_NOTICE`, the relay partition and the
    event JSON of :func:`event_payload_sql`, the same document the claim builds for that row."""
    names = ("id", "event_id", "task_id", "instance_id", "workflow_type", "task_key", "change", "old_status",
             "new_status", "attempt", "depth", "trace_id", "relay_partition", "created_at")
    row = SimpleNamespace(**{n: sa.literal_column(prefix + n, outbox.c[n].type) for n in names})
    payload = event_payload_sql("postgresql", row)
    text = str(payload.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))  # type: ignore[no-untyped-call]
    return f"'{EVENT_NOTICE}' || {prefix}relay_partition || ':' || {text}"


def unpublished_rows(dialect_name: str, partition: int | None, *columns: Any) -> sa.Select[Any]:
    """``columns`` of the unpublished outbox rows (of ``partition``, or all), oldest first.

    On PostgreSQL in the order of the partial index of unpublished rows, ``(relay_partition, id)``, with the
    partition as ``= ANY(ARRAY[p])``: an order only that index gives, so the planner reads it whatever the
    statistics say. ``relay_partition = p ORDER BY id`` is also the primary key's order, and under statistics
    taken while a burst waited unpublished (``published_at`` null in every sampled row) the planner took the
    primary key and filtered out every retained published row, oldest first, on each claim until the next
    autoanalyze: 22 ms a claim with 57,000 retained rows, p50 45 ms instead of 5.5 at 500 completions/s in
    ``bench.cost`` (2026-12-07, auto_explain). An equality would let the planner drop the partition from the
    order (a constant); an array it cannot."""
    o = outbox.c
    query = sa.select(*columns).where(o.published_at.is_(None))
    if dialect_name != "postgresql":
        return (query.where(o.relay_partition == partition) if partition is not None else query).order_by(o.id)
    if partition is not None:
        query = query.where(o.relay_partition == sa.any_(postgresql.array([sa.literal(partition, sa.Integer)])))
    return query.order_by(o.relay_partition, o.id)


def claim_statement(dialect_name: str, partition: int, batch_size: int) -> sa.Update:
    """The claim: up to ``batch_size`` unpublished rows of ``partition`` (oldest first, ``FOR UPDATE SKIP
    LOCKED``) marked published by the database clock in one statement, returning every outbox column and
    the event JSON (``payload``, :func:`event_payload_sql`). Selected by ``published_at IS NULL``, never
    above a high-water id. Run in the transaction that publishes: a failed publish rolls it back."""
    o = outbox.c
    batch = unpublished_rows(dialect_name, partition, o.id).limit(batch_size).with_for_update(skip_locked=True)
    if dialect_name == "postgresql":
        # = ANY(ARRAY(subquery)) runs the LIMIT subquery once. With IN (subquery), a generic plan
        # cached while the outbox was empty re-ran it per outbox row (measured: 14.9 s for 11k rows,
        # and it claimed more than the batch size).
        claim_ids: sa.ColumnElement[bool] = o.id == sa.any_(sa.func.array(batch.scalar_subquery()))
    else:
        claim_ids = o.id.in_(batch.scalar_subquery())
    return (outbox.update()
            .where(claim_ids)
            .values(published_at=db_now(dialect_name))
            .returning(*outbox.c, event_payload_sql(dialect_name)))


def peek_statement(partition: int) -> sa.Select[Any]:
    """Whether ``partition`` has an unpublished row (one id or none), read without a write lock (SQLite:
    the look before a claim; on the partial index of unpublished rows)."""
    o = outbox.c
    return sa.select(o.id).where(o.relay_partition == partition, o.published_at.is_(None)).limit(1)


def dead_letter_statement() -> sa.Insert:
    """A malformed outbox row set aside in ``pollbridge_outbox_dead`` (executemany: ``outbox_id``,
    ``reason``, ``payload``, ``created_at``)."""
    return outbox_dead.insert()


def delete_rows_statement(ids: Sequence[Any]) -> sa.Delete:
    """The outbox rows ``ids`` deleted (the dead-lettered ones, in the claim's transaction)."""
    return outbox.delete().where(outbox.c.id.in_(list(ids)))


def mark_noticed_statement(dialect_name: str, pairs: Sequence[tuple[int, str]]) -> sa.Update:
    """The rows ``pairs`` (outbox id, event id: both must match) marked published if they are not yet: rows whose
    events went out from their notifications, marked by a relay on its way out without a claim (no bus I/O)."""
    o = outbox.c
    return (outbox.update()
            .where(sa.tuple_(o.id, o.event_id).in_(list(pairs)), o.published_at.is_(None))
            .values(published_at=db_now(dialect_name)))


def bus_epoch_statement(partition: int) -> sa.Select[Any]:
    """The bus epoch the relay of ``partition`` stored (a scalar; ``None`` before the first check)."""
    return sa.select(relay_state.c.bus_epoch).where(relay_state.c.relay_partition == partition)


def requeue_statement(dialect_name: str, partition: int, since: datetime) -> sa.Update:
    """After a bus loss: the rows of ``partition`` published at or after ``since`` (the retention window)
    unpublished again, their ``created_at`` set to now by the database clock ("queued for publishing since",
    so the guardian does not read the replay of old rows as a relay stuck for as long as they are old)."""
    o = outbox.c
    return (outbox.update()
            .where(o.relay_partition == partition, o.published_at.is_not(None), o.published_at >= since)
            .values(published_at=None, created_at=db_now(dialect_name)))


def retained_statement(partition: int, since: datetime) -> sa.Select[Any]:
    """After one bus partition's loss: the id and instance of every row of ``partition`` published at or after
    ``since`` (the relay keeps those whose instance the lost bus partitions hold)."""
    o = outbox.c
    return (sa.select(o.id, o.instance_id)
            .where(o.relay_partition == partition, o.published_at.is_not(None), o.published_at >= since))


def requeue_ids_statement(dialect_name: str, ids: Sequence[Any]) -> sa.Update:
    """The rows ``ids`` unpublished again, as :func:`requeue_statement` does for a whole window."""
    return (outbox.update().where(outbox.c.id.in_(list(ids)), outbox.c.published_at.is_not(None))
            .values(published_at=None, created_at=db_now(dialect_name)))


def set_bus_epoch_statement(partition: int, epoch: str | None) -> sa.Update:
    """The bus epoch stored for ``partition`` (what the next check compares with)."""
    return relay_state.update().where(relay_state.c.relay_partition == partition).values(bus_epoch=epoch)


def purge_statement(partition: int, cutoff: datetime, limit: int) -> sa.Delete:
    """Housekeeping: up to ``limit`` rows of ``partition`` published before ``cutoff`` deleted (the
    retention window; run in small batches)."""
    o = outbox.c
    ids = sa.select(o.id).where(o.published_at.is_not(None), o.published_at < cutoff,
                                o.relay_partition == partition).limit(limit)
    return outbox.delete().where(o.id.in_(ids.scalar_subquery()))


def oldest_published_statement(partition: int) -> sa.Select[Any]:
    """The publish time of the oldest published row ``partition`` keeps (a scalar, ``None`` if none): when
    the next purge is due."""
    o = outbox.c
    return sa.select(sa.func.min(o.published_at)).where(o.published_at.is_not(None), o.relay_partition == partition)


def set_armed_statement(partition: int, armed: bool) -> sa.Update:
    """Whether the capture trigger should NOTIFY for ``partition`` (armed while the relay idles on LISTEN)."""
    return relay_state.update().where(relay_state.c.relay_partition == partition).values(armed=armed)


#: PostgreSQL, right after the relay armed: the first transaction id not yet started. Every writer that could
#: have read the armed flag before it was set had its id by then (its trigger runs after its own row write).
ARM_HORIZON_SQL = "SELECT pg_snapshot_xmax(pg_current_snapshot())::text"

#: PostgreSQL: whether every transaction that could have read the flag down has ended, so a claim from now on
#: sees every row a writer added without notifying: every transaction id below the horizon (``:horizon``, from
#: :data:`ARM_HORIZON_SQL`) has ended, and no session still holds a snapshot from before it (a REPEATABLE READ
#: writer reads the flag with its first snapshot and may take its id later; ``backend_xmin`` is shown for
#: every role's sessions). Conservative: a snapshot taken since, before any new id, also counts.
HORIZON_PASSED_SQL = (
    "SELECT pg_snapshot_xmin(pg_current_snapshot()) >= CAST(:horizon AS xid8) AND NOT EXISTS ("
    "SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid <> pg_backend_pid() AND backend_xmin IS NOT NULL "
    "AND age(backend_xmin) >= age(xid(CAST(:horizon AS xid8))))")

#: PostgreSQL: the armed flag raised again if it is down (another relay of the partition, in the moment it lost
#: the partition, may have lowered it); a row back means it was down.
REASSERT_ARMED_SQL = ("UPDATE pollbridge_relay_state SET armed = true WHERE relay_partition = :partition "
                      "AND NOT armed RETURNING 1")


def widened_xid_sql(xmax: str, xid: str) -> str:
    """SQL for the 64-bit id of the 32-bit transaction id ``xid`` (as the write-ahead log names one): the id
    nearest ``xmax`` (a 64-bit id as bigint, a snapshot's xmax) with that low half, i.e. ``xmax`` plus the
    signed 32-bit distance from xmax's low half to ``xid``. Both arguments are SQL expressions (bigint)."""
    return f"({xmax} + (({xid} - ({xmax} & 4294967295) + 6442450944) % 4294967296) - 2147483648)"


#: PostgreSQL: how many of the transactions ``:xids`` (32-bit ids) this statement's snapshot does not see yet.
#: A commit reaches the log (and a logical walsender) before its session leaves the process array, so a
#: decoded commit can be invisible for a moment.
INVISIBLE_XIDS_SQL = (
    "WITH s AS (SELECT pg_current_snapshot() AS snap, "
    "CAST(CAST(pg_snapshot_xmax(pg_current_snapshot()) AS text) AS bigint) AS xmax) "
    "SELECT count(*) FROM s, unnest(CAST(:xids AS bigint[])) AS x(xid) WHERE NOT pg_visible_in_snapshot("
    f"CAST(CAST({widened_xid_sql('s.xmax', 'x.xid')} AS text) AS xid8), s.snap)")


@dataclass(frozen=True)
class RelayQueries:
    """The statements of one relay (one partition), the per-cycle ones built once."""

    dialect_name: str
    partition: int
    #: :func:`claim_statement`.
    claim: sa.Update
    #: The claim straight through the driver on PostgreSQL (once per cycle; see :mod:`bridge.db.driver`).
    claim_run: DriverStatement
    #: :func:`peek_statement`.
    peek: sa.Select[Any]

    @classmethod
    def build(cls, dialect: Dialect, partition: int, batch_size: int) -> RelayQueries:
        claim = claim_statement(dialect.name, partition, batch_size)
        return cls(dialect_name=dialect.name, partition=partition, claim=claim,
                   claim_run=DriverStatement(claim, dialect), peek=peek_statement(partition))

    def dead_letter(self) -> sa.Insert:
        """:func:`dead_letter_statement`."""
        return dead_letter_statement()

    def delete_rows(self, ids: Sequence[Any]) -> sa.Delete:
        """:func:`delete_rows_statement`."""
        return delete_rows_statement(ids)

    def mark_noticed(self, pairs: Sequence[tuple[int, str]]) -> sa.Update:
        """:func:`mark_noticed_statement`."""
        return mark_noticed_statement(self.dialect_name, pairs)

    def bus_epoch(self) -> sa.Select[Any]:
        """:func:`bus_epoch_statement`."""
        return bus_epoch_statement(self.partition)

    def requeue(self, since: datetime) -> sa.Update:
        """:func:`requeue_statement`."""
        return requeue_statement(self.dialect_name, self.partition, since)

    def retained(self, since: datetime) -> sa.Select[Any]:
        """:func:`retained_statement`."""
        return retained_statement(self.partition, since)

    def requeue_ids(self, ids: Sequence[Any]) -> sa.Update:
        """:func:`requeue_ids_statement`."""
        return requeue_ids_statement(self.dialect_name, ids)

    def set_bus_epoch(self, epoch: str | None) -> sa.Update:
        """:func:`set_bus_epoch_statement`."""
        return set_bus_epoch_statement(self.partition, epoch)

    def purge(self, cutoff: datetime, limit: int) -> sa.Delete:
        """:func:`purge_statement`."""
        return purge_statement(self.partition, cutoff, limit)

    def oldest_published(self) -> sa.Select[Any]:
        """:func:`oldest_published_statement`."""
        return oldest_published_statement(self.partition)

    def set_armed(self, armed: bool) -> sa.Update:
        """:func:`set_armed_statement`."""
        return set_armed_statement(self.partition, armed)
