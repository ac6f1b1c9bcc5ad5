"""Capture gaps: changes the capture lost and could not replay, recorded for the reconciler, the gates and the
guardian (``pollbridge_capture_gaps``, migration 0012).

A gap is recorded when the write-ahead log's replication slot was dropped or invalidated (the WAL it needed was
removed): what changed between its loss and its re-creation is in no log, so the capture re-derived the state
of every unfinished task from the table and published it (:meth:`bridge.capture.wal.WalCapture.recover_slot`).
The event path then evaluates those instances again, but the window around the gap is incomplete evidence:
an event-path decision may be late or missing for a reason that is not the event path's. So a reconcile
report lists the gaps of its window and its verdict and every promotion gate refuse to pass on a window that
holds one (criterion ``no_capture_gap``), and the guardian reports each new gap (it does not demote: the
re-derivation already published every unfinished task, and in ``selective`` and ``cutover`` the poller's
sweep still covers a task the event path did not dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.db.clock import as_utc, bind_time
from bridge.db.engine import db_now
from bridge.db.schema import capture_gaps

#: The one source today: the write-ahead log's replication slot was lost.
WAL_SLOT = "wal_slot"
#: ``rederived`` of a gap whose re-derivation is not written yet: recorded before the slot is made again, so that a
#: failure or a crash between the two is finished at the capture's next start instead of forgotten.
PENDING = -1


@dataclass(frozen=True)
class CaptureGap:
    id: int
    detected_at: datetime
    source: str
    rederived: int
    detail: str

    @property
    def pending(self) -> bool:
        """The re-derivation is not written yet (:data:`PENDING`)."""
        return self.rederived == PENDING

    @property
    def summary(self) -> str:
        return "re-derivation pending" if self.pending else f"{self.rederived} task(s) re-derived"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "detected_at": self.detected_at.isoformat(), "source": self.source,
                "rederived": None if self.pending else self.rederived, "pending": self.pending,
                "detail": self.detail}


def record_gap_statement(dialect_name: str, source: str, rederived: int, detail: str) -> sa.Insert:
    """A gap detected now (the database clock)."""
    return capture_gaps.insert().values(detected_at=db_now(dialect_name), source=source, rederived=rederived,
                                        detail=detail)


def pending_gap(conn: Connection, source: str) -> int | None:
    """The oldest gap of ``source`` whose re-derivation is not written yet (:data:`PENDING`), by id."""
    c = capture_gaps.c
    found = conn.execute(sa.select(sa.func.min(c.id)).where(c.source == source, c.rederived == PENDING)).scalar()
    return None if found is None else int(found)


def close_gap_statement(gap_id: int, rederived: int, detail: str) -> sa.Update:
    """A pending gap's re-derivation written: how many tasks, and what happened."""
    return capture_gaps.update().where(capture_gaps.c.id == gap_id).values(rederived=rederived, detail=detail)


def gaps_between(conn: Connection, since: datetime, until: datetime) -> list[CaptureGap]:
    """The gaps detected in ``[since, until)`` (a report's window), oldest first."""
    c = capture_gaps.c
    # As the column holds them (SQLite: db_now's millisecond text; a bound datetime would compare as text wrongly).
    low, high = (sa.literal(bind_time(conn.dialect.name, t), type_=sa.String if conn.dialect.name == "sqlite"
                            else sa.DateTime(timezone=True)) for t in (since, until))
    rows = conn.execute(sa.select(capture_gaps).where(c.detected_at >= low, c.detected_at < high)
                        .order_by(c.detected_at, c.id)).all()
    return [_gap(r) for r in rows]


def _gap(row: Any) -> CaptureGap:
    return CaptureGap(int(row.id), as_utc(row.detected_at) or row.detected_at, str(row.source), int(row.rederived),
                      str(row.detail))


def gaps_after(conn: Connection, after_id: int) -> list[CaptureGap]:
    """The gaps recorded after id ``after_id`` (what a guardian has not reported yet), oldest first."""
    c = capture_gaps.c
    return [_gap(r) for r in conn.execute(sa.select(capture_gaps).where(c.id > after_id).order_by(c.id))]


def last_gap_id(conn: Connection) -> int:
    return int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(capture_gaps.c.id), 0))).scalar_one())
