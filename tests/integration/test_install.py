"""init, uninstall and the migrations, on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from bridge.app import install
from bridge.db import migrate
from bridge.db.engine import create_engine
from bridge.db.schema import VERSION_TABLE, metadata


def test_init_is_idempotent_and_reaches_head(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        first = install.init(engine)
        assert first.revision_before is None
        assert first.revision_after == migrate.head_revision()
        second = install.init(engine)
        assert second.revision_before == second.revision_after == migrate.head_revision()
        assert set(migrate.owned_tables(engine)) == {VERSION_TABLE, *metadata.tables}
    finally:
        engine.dispose()


def test_migrations_create_exactly_the_schema_module(empty_db_url: str) -> None:
    """schema.py and the migrations must not drift: autogenerate finds no difference."""
    engine = create_engine(empty_db_url)
    try:
        install.init(engine)
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            diff = [d for d in compare_metadata(context, metadata) if "pollbridge_" in repr(d)]
        assert diff == []
    finally:
        engine.dispose()


def test_uninstall_removes_only_pollbridge_objects(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        install.init(engine, demo_schema=True)
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('i1', 'orders')"))
            conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key) VALUES ('i1', 'a')"))
        dropped = install.uninstall(engine)
        assert set(dropped) == {VERSION_TABLE, *metadata.tables}
        assert migrate.owned_tables(engine) == []
        assert migrate.current_revision(engine) is None
        names = set(sa.inspect(engine).get_table_names())
        assert {"tasks", "workflow_instances"} <= names
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM tasks")).scalar() == 1
        # And it can be installed again afterwards.
        assert install.init(engine).revision_after == migrate.head_revision()
    finally:
        engine.dispose()


def test_demo_schema_is_not_recreated_over_existing_tables(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        assert set(install.init(engine, demo_schema=True).demo_tables_created) == {"tasks", "workflow_instances"}
        assert install.init(engine, demo_schema=True).demo_tables_created == ()
    finally:
        engine.dispose()


def test_init_refuses_a_view_as_the_capture_target_and_creates_nothing(empty_db_url: str) -> None:
    """A view cannot carry row triggers: init says so in one line naming the base table, before it migrates."""
    import pytest

    from bridge.core.errors import MappingMismatch
    from bridge.core.mapping import TaskTableMapping
    from bridge.reference.schema import create_demo_schema

    engine = create_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            create_demo_schema(conn)
            conn.exec_driver_sql("CREATE VIEW tasks_fixed AS SELECT * FROM tasks")
        with pytest.raises(MappingMismatch) as refused:
            install.init(engine, mapping=TaskTableMapping(table="tasks_fixed"))
        assert str(refused.value) == (
            "mapping.table 'tasks_fixed' is a view: capture needs the base table; set mapping.table to the base "
            "table 'tasks' and mapping.read_table to the view 'tasks_fixed'")
        assert migrate.owned_tables(engine) == [] and migrate.current_revision(engine) is None
        result = install.init(engine, mapping=TaskTableMapping(table="tasks", read_table="tasks_fixed"))
        assert result.capture_installed
    finally:
        engine.dispose()
