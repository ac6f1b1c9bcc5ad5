"""Running pollbridge's Alembic migrations programmatically, from a checkout or an installed wheel.

The migration scripts are found by path, beside this package, never by importing a ``migrations``
package (a user's own ``migrations`` folder in the working directory would win that import) and never
through a path relative to the working directory: in a checkout (or an editable install) they are the
repository's ``migrations/`` directory; an installed wheel carries them as package data in
``pollbridge/migrations/`` (pyproject.toml maps the one onto the other). Alembic loads ``env.py`` and
the version files by path. Alembic's version table is ``pollbridge_alembic_version`` so it cannot
collide with the user's own Alembic.

Alembic is imported by the functions that use it: it is about a quarter of the CLI's start-up time,
and most commands (``flags``, ``signal``, ``status``, ``relay run``, ...) never read or run migrations.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.core.errors import PollbridgeError
from bridge.db.schema import VERSION_TABLE, metadata

if TYPE_CHECKING:
    from alembic.config import Config


# The directory holding bridge/, event_scheduler/, ... : the repository root or site-packages.
_ROOT = Path(__file__).resolve().parents[2]
# Installed wheel first, then the checkout.
_CANDIDATES = (_ROOT / "pollbridge" / "migrations", _ROOT / "migrations")


def script_location() -> str:
    """The directory of pollbridge's Alembic scripts (``env.py``, ``script.py.mako``, ``versions/``)."""
    for candidate in _CANDIDATES:
        if (candidate / "env.py").is_file() and (candidate / "versions").is_dir():
            return str(candidate)
    looked = ", ".join(str(c) for c in _CANDIDATES)
    raise PollbridgeError(f"pollbridge's migration scripts are missing (looked in {looked}): reinstall pollbridge")


def alembic_config(engine: Engine) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", script_location())
    config.attributes["engine"] = engine
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(script_location())
    head = script.get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def require_head(engine: Engine) -> None:
    """Refuse to run a long-lived component on pollbridge tables of another version: code that expects a table
    an older schema lacks would fail every cycle (a poller whose every scan fails is no safety net)."""
    from bridge.core.errors import SchemaNotInstalled

    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    if current is None:
        raise SchemaNotInstalled("pollbridge is not installed in this database: run `pollbridge init` first")
    raise SchemaNotInstalled(f"pollbridge's tables are at migration {current}, this version needs {head}: run "
                             "`pollbridge init` (it upgrades them in place and leaves the scheduler's tables alone), "
                             "then start this again")


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


__all__ = ["current_revision", "downgrade_all", "head_revision", "metadata", "owned_tables", "script_location",
           "upgrade"]
