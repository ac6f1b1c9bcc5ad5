"""Time as pollbridge compares it: aware UTC, whatever the dialect returned.

PostgreSQL returns aware timestamps; SQLite returns naive UTC datetimes, or text where a column holds
``db_now()``'s output. :func:`as_utc` is the one conversion every layer uses; :func:`db_clock` reads
the database's clock (the only clock pollbridge's timings use).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.db.engine import db_now, read_only


def as_utc(value: Any) -> datetime | None:
    """``value`` (a datetime, naive meaning UTC, or ISO text) as an aware UTC datetime; None or ``""`` → None."""
    if value is None or value == "":
        return None
    parsed = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def bind_time(dialect_name: str, value: datetime) -> Any:
    """``value`` as the dialect stores :func:`db_now`'s output, to compare with such a column: SQLite keeps
    millisecond text (naive UTC), and text compares by characters, so a bound datetime (microseconds) would sort
    after the same millisecond written by the database; PostgreSQL takes the aware datetime."""
    value = value.astimezone(UTC)
    if dialect_name == "sqlite":
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return value


def db_clock(engine: Engine) -> datetime:
    """The database's current time, aware UTC."""
    with read_only(engine).connect() as conn:
        value = as_utc(conn.execute(sa.select(db_now(engine.dialect.name))).scalar_one())
    assert value is not None
    return value
