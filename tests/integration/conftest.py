from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.engine import Engine

from bridge.app import install
from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.tasktable.tables import TaskTable, reflect_tables
from tests.support import Env
from tests.support.stacks import ENV_PARAMS, make_env


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def tables(engine: Engine) -> TaskTable:
    return reflect_tables(engine, TaskTableMapping())


@pytest.fixture(params=ENV_PARAMS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    """The three supported stacks: SQLite + embedded bus, PostgreSQL + embedded bus, PostgreSQL + Redis."""
    yield from make_env(request)


# --- one database per module and dialect, emptied before each test (cloning one per test costs seconds) ---
# A module opts in by overriding ``engine`` with ``support.SHARED_DB_PARAMS`` and ``support.shared_engine``.

PG_ADMIN_URL = os.environ.get("POLLBRIDGE_TEST_PG_URL", "postgresql://root@127.0.0.1:5432/postgres")


def _pg_admin(statement: str) -> None:
    with psycopg.connect(PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(statement.encode())


@pytest.fixture(scope="module")
def pg_shared(request: pytest.FixtureRequest, pg_template: str) -> Iterator[Engine]:
    """A PostgreSQL database cloned once for the requesting module from the session's template."""
    name = f"pb_{request.module.__name__.rpartition('.')[2][5:]}_{uuid.uuid4().hex[:8]}"
    _pg_admin(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    engine = create_engine(f"{PG_ADMIN_URL.rpartition('/')[0]}/{name}")
    yield engine
    engine.dispose()
    _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def sqlite_shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A SQLite database with pollbridge installed, once for the requesting module."""
    engine = create_engine(f"sqlite:///{tmp_path_factory.mktemp('db') / 'pollbridge.db'}")
    install.init(engine, demo_schema=True, mapping=TaskTableMapping())
    yield engine
    engine.dispose()
