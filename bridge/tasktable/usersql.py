"""SQL the user owns, installed beside pollbridge's own objects: ``[mapping] install_sql``.

An integration may need objects of its own in the scheduler's database before the mapping can be
read: Airflow keeps its DAGs' edges and trigger rules inside ``serialized_dag`` JSON, so its
integration ships views that present them as an edges table. The file holds named blocks
(``-- name: install``, ``-- name: uninstall`` and, optionally, ``-- name: check``): ``init`` runs
``install`` before it reads the mapping, ``uninstall`` runs ``uninstall`` before it removes
pollbridge's tables, and ``doctor`` runs ``check``, whose rows (first column) are problems, one
line each (no row: fine). Every object the file creates must carry the ``pollbridge_`` prefix:
``install`` is refused when its text creates anything else.

The file is the user's own SQL, like a migration they wrote: pollbridge runs it as written, never
pasting configuration into it.
"""

from __future__ import annotations

import re
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.core.errors import ConfigError, first_line
from bridge.core.mapping import TaskTableMapping
from bridge.db.sqlblocks import parse_blocks

_CREATED = re.compile(
    r"\bCREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMP(?:ORARY)?\s+)?(?:MATERIALIZED\s+)?"
    r"(VIEW|TABLE|FUNCTION|INDEX|TRIGGER|SEQUENCE|TYPE)\s+(?:IF\s+NOT\s+EXISTS\s+)?([\w.\"]+)",
    re.IGNORECASE,
)


def blocks(mapping: TaskTableMapping) -> dict[str, str] | None:
    """The named blocks of the mapping's ``install_sql`` file (``None`` without one)."""
    if mapping.install_sql is None:
        return None
    path = Path(mapping.install_sql)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"mapping.install_sql: cannot read {path}: {exc.strerror or exc}") from None
    found = parse_blocks(text)
    missing = [name for name in ("install", "uninstall") if name not in found]
    if missing:
        raise ConfigError(f"mapping.install_sql: {path} has no '-- name: {missing[0]}' block")
    foreign = [name for _kind, name in _CREATED.findall(found["install"])
               if not name.strip('"').split(".")[-1].strip('"').startswith("pollbridge_")]
    if foreign:
        raise ConfigError(f"mapping.install_sql: {path} creates {foreign[0]!r}; every object pollbridge installs "
                          "must be named pollbridge_...")
    return found


def install(conn: Connection, mapping: TaskTableMapping) -> bool:
    """Run the ``install`` block inside the caller's transaction; ``False`` without an install_sql file."""
    return _run(conn, mapping, "install")


def uninstall(conn: Connection, mapping: TaskTableMapping) -> bool:
    """Run the ``uninstall`` block inside the caller's transaction; ``False`` without an install_sql file."""
    return _run(conn, mapping, "uninstall")


def _run(conn: Connection, mapping: TaskTableMapping, block: str) -> bool:
    found = blocks(mapping)
    if found is None:
        return False
    conn.exec_driver_sql(found[block])
    return True


def problems(conn: Connection, mapping: TaskTableMapping) -> list[str]:
    """What the file's ``check`` block reports (one line each); a check that cannot run is a problem too."""
    found = blocks(mapping)
    if found is None or "check" not in found:
        return []
    try:
        with conn.begin_nested():
            rows = conn.execute(sa.text(found["check"])).all()
    except sa.exc.DBAPIError as exc:
        return [f"the install_sql check could not run: {first_line(exc)}"]
    return [str(row[0]) for row in rows]
