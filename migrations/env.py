"""Alembic environment for pollbridge: online only, on the engine handed over by bridge.db.migrate."""

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
