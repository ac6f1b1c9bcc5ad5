"""The outbox's backlog: how many captured changes wait for the relay, and how old the oldest is.

The one probe behind the relay's gauges, the guardian's ``outbox_age`` criterion, ``preflight``'s
``outbox_backlog`` check and ``status``. Both timestamps come from the database clock, so a host clock
that drifts cannot make a backlog look older or younger than it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.capture.queries import unpublished_rows
from bridge.db.clock import as_utc
from bridge.db.engine import db_now
from bridge.db.schema import outbox


@dataclass(frozen=True)
class Backlog:
    unpublished: int
    oldest_age: float  # seconds; 0.0 without a backlog
    now: datetime      # the database clock when it was read


def backlog_query(dialect: str, partition: int | None = None) -> sa.Select[Any]:
    """Unpublished rows (of one relay partition, or all), their oldest ``created_at`` and the database now."""
    o = outbox.c
    if dialect == "postgresql":  # on the partial index of unpublished rows, whatever the statistics say (see
        # unpublished_rows: a plain count took a sequential scan of every retained row under a burst's statistics)
        rows = unpublished_rows(dialect, partition, o.created_at).subquery()
        return sa.select(sa.func.count(), sa.func.min(rows.c.created_at), db_now(dialect))
    query = sa.select(sa.func.count(), sa.func.min(o.created_at), db_now(dialect)).where(o.published_at.is_(None))
    return query.where(o.relay_partition == partition) if partition is not None else query


def read_backlog(conn: Connection, partition: int | None = None) -> Backlog:
    """The backlog as of now (uses the partial index on unpublished rows)."""
    count, oldest, now = conn.execute(backlog_query(conn.dialect.name, partition)).one()
    now_utc = as_utc(now)
    assert now_utc is not None
    oldest_utc = as_utc(oldest)
    age = max(0.0, (now_utc - oldest_utc).total_seconds()) if oldest_utc is not None else 0.0
    return Backlog(int(count), age, now_utc)
