"""Capture runs with pollbridge's rights, not the writer's: a scheduler whose role has rights on its own table
only keeps writing it, and its writes are captured (PostgreSQL: SECURITY DEFINER, a pinned search path)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql

from bridge.app import install
from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.reference.schema import create_demo_schema
from tests.conftest import PG_ADMIN_URL

pytestmark = pytest.mark.postgres


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _url(base: str, user: str | None = None, options: str | None = None) -> str:
    """``base`` (a test database URL) as another user, with libpq ``options`` (e.g. a search path)."""
    scheme, _, rest = _plain(base).partition("://")
    host_and_db = rest.rpartition("@")[2]
    url = f"{scheme}://{user or rest.rpartition('@')[0]}@{host_and_db}"
    return f"{url}?options={options}" if options else url


@pytest.fixture
def legacy_role(pg_server: None) -> Iterator[str]:
    """A LOGIN role of its own, dropped afterwards (with its grants: see :func:`_grant_own_tables_only`)."""
    name = f"pb_legacy_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_plain(PG_ADMIN_URL), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    yield name
    for url in _GRANTED.pop(name, []):  # DROP OWNED revokes its grants and drops what it owns, per database
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
    with psycopg.connect(_plain(PG_ADMIN_URL), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


#: role -> the databases where it was granted something (the role fixture is torn down before the database)
_GRANTED: dict[str, list[str]] = {}


def _grant_own_tables_only(url: str, role: str) -> None:
    """The legacy role gets rights on the scheduler's tables (and their sequence), nothing of pollbridge's."""
    _GRANTED.setdefault(role, []).append(_plain(url))
    with psycopg.connect(_plain(url), autocommit=True) as conn:
        for table in ("tasks", "workflow_instances"):
            conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
                sql.Identifier(table), sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT USAGE ON SEQUENCE tasks_id_seq TO {}").format(sql.Identifier(role)))


def _outbox(url: str, instance_id: str) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(
                "SELECT change, task_key, old_status, new_status, attempt, workflow_type FROM pollbridge_outbox "
                "WHERE instance_id = :i ORDER BY id"), {"i": instance_id}).all())
    finally:
        engine.dispose()


def _legacy_writes(url: str, instance_id: str) -> None:
    """What a legacy scheduler does, through its own connection: an instance, a task, status and other updates."""
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO workflow_instances (id, workflow_type) VALUES (%s, 'orders')", (instance_id,))
        conn.execute("INSERT INTO tasks (instance_id, task_key) VALUES (%s, 'a')", (instance_id,))
        conn.commit()
        conn.execute("UPDATE tasks SET status = 'queued', attempts = 1 WHERE instance_id = %s", (instance_id,))
        conn.execute("UPDATE tasks SET updated_at = clock_timestamp() WHERE instance_id = %s", (instance_id,))
        conn.commit()
        conn.execute("UPDATE tasks SET status = 'completed' WHERE instance_id = %s", (instance_id,))
        conn.commit()


EXPECTED = [("insert", "a", None, "pending", 0, "orders"), ("status", "a", "pending", "queued", 1, "orders"),
            ("status", "a", "queued", "completed", 1, "orders")]


def test_a_legacy_role_with_rights_on_its_own_table_only_writes_and_is_captured(pg_url: str, legacy_role: str) -> None:
    engine = create_engine(pg_url)  # the superuser the tests use installs, as an operator would with `init`
    try:
        install.init(engine, mapping=TaskTableMapping())
    finally:
        engine.dispose()
    _grant_own_tables_only(pg_url, legacy_role)
    legacy = _url(pg_url, legacy_role)
    with psycopg.connect(legacy) as conn:  # the role really has no right on pollbridge's tables
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT 1 FROM pollbridge_outbox")
        conn.rollback()
        # ...nor on the function: a trigger function is not called, it is fired (no EXECUTE checked)
        assert conn.execute("SELECT has_function_privilege(current_user, 'pollbridge_capture()', 'EXECUTE')"
                            ).fetchone() == (False,)
    _legacy_writes(legacy, "legacy-1")
    assert [tuple(r) for r in _outbox(pg_url, "legacy-1")] == EXPECTED
    with psycopg.connect(_plain(pg_url)) as conn:  # owned by the role that ran init, with its search path pinned
        owner, definer, config = conn.execute(
            "SELECT pg_get_userbyid(proowner), prosecdef, proconfig FROM pg_proc WHERE proname = 'pollbridge_capture'"
        ).fetchone() or (None, None, None)
        assert owner == conn.execute("SELECT current_user").fetchone()[0]  # type: ignore[index]
        assert definer is True
        assert config == ["search_path=pg_catalog, public, pg_temp"]


def test_the_writers_search_path_cannot_redirect_capture(pg_url: str, legacy_role: str) -> None:
    """A writer whose session puts a table named pollbridge_outbox of its own first on its search path does not
    receive the capture's rows: every name the function uses is pinned to pollbridge's schema."""
    _grant_own_tables_only(pg_url, legacy_role)
    with psycopg.connect(_plain(pg_url), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE SCHEMA decoy AUTHORIZATION {}").format(sql.Identifier(legacy_role)))
    legacy = _url(pg_url, legacy_role, options="-csearch_path%3Ddecoy,public")
    with psycopg.connect(legacy) as conn:
        conn.execute("CREATE TABLE decoy.pollbridge_outbox (LIKE public.tasks)")
        conn.execute("CREATE TABLE decoy.pollbridge_relay_state (relay_partition integer, armed boolean)")
        conn.commit()
    _legacy_writes(legacy, "legacy-2")
    assert [tuple(r) for r in _outbox(pg_url, "legacy-2")] == EXPECTED
    with psycopg.connect(_plain(pg_url)) as conn:
        assert conn.execute("SELECT count(*) FROM decoy.pollbridge_outbox").fetchone() == (0,)


def test_capture_writes_where_pollbridge_is_installed_not_where_the_writer_looks(
        pg_empty_url: str, legacy_role: str) -> None:
    """pollbridge installed in a schema of its own (the current schema of the connection that ran init),
    the scheduler's tables in public: the writer's search path does not name pollbridge's schema."""
    with psycopg.connect(_plain(pg_empty_url), autocommit=True) as admin:
        admin.execute("CREATE SCHEMA pb_home")
    scheduler = create_engine(pg_empty_url)
    try:
        with scheduler.begin() as conn:
            create_demo_schema(conn)
    finally:
        scheduler.dispose()
    dbname = pg_empty_url.rpartition("/")[2]
    with psycopg.connect(_plain(pg_empty_url), autocommit=True) as admin:  # for the sessions of `init` only
        admin.execute(sql.SQL("ALTER DATABASE {} SET search_path = pb_home, public").format(sql.Identifier(dbname)))
    engine = create_engine(pg_empty_url)
    try:
        install.init(engine, mapping=TaskTableMapping())
    finally:
        engine.dispose()
    with psycopg.connect(_plain(pg_empty_url), autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER DATABASE {} RESET search_path").format(sql.Identifier(dbname)))
    _grant_own_tables_only(pg_empty_url, legacy_role)
    _legacy_writes(_url(pg_empty_url, legacy_role), "legacy-3")
    with psycopg.connect(_plain(pg_empty_url)) as conn:
        rows = conn.execute("SELECT change, task_key, old_status, new_status, attempt, workflow_type "
                            "FROM pb_home.pollbridge_outbox WHERE instance_id = 'legacy-3' ORDER BY id").fetchall()
        assert conn.execute("SELECT to_regclass('public.pollbridge_outbox')").fetchone() == (None,)
    assert rows == EXPECTED
