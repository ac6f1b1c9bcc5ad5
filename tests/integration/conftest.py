from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from bridge.db import create_engine
from bridge.mapping import TaskTableMapping
from bridge.tasktable import TaskTable, reflect_tables


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def tables(engine: Engine) -> TaskTable:
    return reflect_tables(engine, TaskTableMapping())
