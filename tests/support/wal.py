"""Whether write-ahead-log capture can run on a test database: the one check every WAL test makes first."""

from __future__ import annotations

import os

import pytest

from bridge.capture import wal
from bridge.db.engine import create_engine


def wal_available(url: str) -> None:
    """Fail (in CI, ``POLLBRIDGE_REQUIRE_SERVICES=1``) or skip, with what to set, unless the server at ``url`` can
    run write-ahead-log capture (``wal_level = logical``, a free slot, a sender, the REPLICATION attribute, a
    bounded ``max_slot_wal_keep_size``)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            problems = wal.settings_problems(conn)
    finally:
        engine.dispose()
    if problems:
        message = f"write-ahead-log capture cannot run here: {problems[0]}"
        if os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
