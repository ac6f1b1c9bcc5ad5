"""init, uninstall and the migrations, on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa
from alembic import command
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


def test_long_lived_components_refuse_an_older_schema(tmp_path: Path) -> None:
    """Code upgraded without `pollbridge init`: the poller (the safety net) would fail every scan on a table the
    old schema lacks; it refuses to start instead, in one line naming the fix, and starts after `init`."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    install.init(engine, demo_schema=True)
    command.downgrade(migrate.alembic_config(engine), "0009")
    engine.dispose()
    exe = str(Path(sys.executable).with_name("pollbridge"))
    env = {"POLLBRIDGE_DATABASE_URL": url, "PATH": "/usr/bin:/bin"}
    for args in (["poller", "run", "--interval", "0.1"], ["scheduler", "run"], ["relay", "run"]):
        ran = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, env=env)
        assert ran.returncode == 1, (args, ran.stderr)
        assert ran.stderr.strip().count("\n") == 0 and "run `pollbridge init`" in ran.stderr, ran.stderr
        assert "at migration 0009" in ran.stderr
    assert subprocess.run([exe, "init"], capture_output=True, text=True, timeout=120, env=env).returncode == 0
    assert migrate.current_revision(create_engine(url)) == migrate.head_revision()
