"""Alembic environment for pollbridge: online only, on the engine handed over by bridge.db.migrate.

Alembic loads this file and ``versions/*.py`` by path, from the repository's ``migrations/`` in a
checkout or from ``pollbridge/migrations/`` in an installed wheel (``bridge.db.migrate.script_location``);
nothing imports them as a package.
"""

from __future__ import annotations

from alembic import context

from bridge.db.schema import VERSION_TABLE, metadata

config = context.config
engine = config.attributes["engine"]

with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
