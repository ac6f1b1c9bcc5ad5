"""pollbridge's Alembic migrations (run through ``bridge.migrate``, not the alembic CLI)."""
