"""``init`` and ``uninstall``: pollbridge's own objects, and nothing else.

``init`` applies the migrations (idempotent: a database at head is left as it is) and, with
``demo_schema``, creates the reference legacy tables if they are missing. ``uninstall`` runs the
migrations down and drops the version table; it cannot reach the scheduler's tables because it
only ever drops objects the migrations created, all prefixed ``pollbridge_``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Engine

from bridge import migrate
from bridge.db import check_connection
from bridge.demo_schema import create_demo_schema


@dataclass(frozen=True)
class InitResult:
    revision_before: str | None
    revision_after: str
    demo_tables_created: tuple[str, ...]


def init(engine: Engine, *, demo_schema: bool = False) -> InitResult:
    check_connection(engine)
    created: list[str] = []
    if demo_schema:
        with engine.begin() as conn:
            created = create_demo_schema(conn)
    before = migrate.current_revision(engine)
    if before != migrate.head_revision():
        migrate.upgrade(engine)
    after = migrate.current_revision(engine)
    assert after is not None
    return InitResult(before, after, tuple(created))


def uninstall(engine: Engine) -> list[str]:
    """Remove pollbridge's objects; return the tables that were dropped."""
    check_connection(engine)
    before = migrate.owned_tables(engine)
    if migrate.current_revision(engine) is not None:
        migrate.downgrade_all(engine)
    after = set(migrate.owned_tables(engine))
    return [t for t in before if t not in after]
