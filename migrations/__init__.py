"""pollbridge's Alembic migrations (run through ``bridge.db.migrate``, not the alembic CLI)."""
