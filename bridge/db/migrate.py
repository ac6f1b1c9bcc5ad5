"""Running pollbridge's Alembic migrations programmatically, from a checkout or an installed wheel.

The migration scripts live in the top-level ``migrations`` package and are found through
``importlib.resources``, never through a path relative to the working directory. Alembic's
version table is ``pollbridge_alembic_version`` so it cannot collide with the user's own Alembic.

Alembic is imported by the functions that use it: it is about a quarter of the CLI's start-up time,
and most commands (``flags``, ``signal``, ``status``, ``relay run``, ...) never read or run migrations.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.db.schema import VERSION_TABLE, metadata

if TYPE_CHECKING:
    from alembic.config import Config


def alembic_config(engine: Engine) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resources.files("migrations")))
    config.attributes["engine"] = engine
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(resources.files("migrations")))
    head = script.get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(engine), revision)


def downgrade_all(engine: Engine) -> None:
    """Remove every pollbridge object the migrations created, then the version table itself."""
    from alembic import command

    command.downgrade(alembic_config(engine), "base")
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {VERSION_TABLE}"))


def owned_tables(engine: Engine) -> list[str]:
    """pollbridge's tables present in the database (by prefix; never the scheduler's)."""
    names = sa.inspect(engine).get_table_names()
    return sorted(n for n in names if n.startswith("pollbridge_"))


__all__ = ["current_revision", "downgrade_all", "head_revision", "metadata", "owned_tables", "upgrade"]
