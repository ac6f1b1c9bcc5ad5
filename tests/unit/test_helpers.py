"""The one helper for each recurring need: first line of an error, UTC, backoff, URLs."""

from __future__ import annotations

import ast
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.exc import OperationalError

from bridge.core.backoff import Backoff
from bridge.core.errors import ConfigError, FlagStoreUnavailable, first_line
from bridge.core.urls import mask_url, validate_bus_url, validate_namespace
from bridge.db.clock import as_utc
from bridge.flags.store import FlagStore

ROOT = Path(__file__).resolve().parents[2]


class _Empty(Exception):
    def __str__(self) -> str:
        return ""


@pytest.mark.parametrize("exc, expected", [
    (RuntimeError("boom\nsecond line"), "boom"),
    (RuntimeError("\n\n  late first line  \nmore"), "late first line"),
    (RuntimeError(""), "RuntimeError"),
    (_Empty(), "_Empty"),
    (OperationalError("SELECT 1", {}, RuntimeError("server closed the connection\nDETAIL")),
     "server closed the connection"),
    (OperationalError("SELECT 1", {}, _Empty()), "_Empty"),
])
def test_first_line(exc: BaseException, expected: str) -> None:
    assert first_line(exc) == expected


def test_an_empty_driver_message_still_makes_the_flag_store_unavailable() -> None:
    """The flag store's own copy raised IndexError on an empty message, which skipped the router's
    fall-back to ``polling`` (that fall-back catches FlagStoreUnavailable only)."""

    class Broken:
        dialect = sa.create_engine("sqlite://").dialect

        def connect(self) -> None:
            raise OperationalError("SELECT", {}, _Empty())

        def execution_options(self, **_: object) -> Broken:
            return self

    store = FlagStore(Broken())  # type: ignore[arg-type]
    with pytest.raises(FlagStoreUnavailable, match="cannot read the flag store: _Empty"):
        store.all()


# Fixed offsets (what a database returns); zoneinfo zones add gaps and folds that are not the point here.
_OFFSETS = st.builds(timezone, st.timedeltas(min_value=timedelta(hours=-23, minutes=-59),
                                             max_value=timedelta(hours=23, minutes=59)).map(
                                                 lambda d: timedelta(minutes=d // timedelta(minutes=1))))


@given(st.datetimes(min_value=datetime(1900, 1, 2), max_value=datetime(9999, 12, 30),
                    timezones=st.one_of(st.none(), _OFFSETS)))
def test_as_utc_is_aware_utc_and_keeps_the_instant(value: datetime) -> None:
    result = as_utc(value)
    assert result is not None and result.tzinfo is UTC
    if value.tzinfo is None:
        assert result.replace(tzinfo=None) == value  # naive means UTC
    else:
        assert result == value
    assert as_utc(value.isoformat()) == result  # text (SQLite's db_now()) reads the same


def test_as_utc_empty() -> None:
    assert as_utc(None) is None and as_utc("") is None
    assert as_utc("2026-12-03 08:00:00.123") == datetime(2026, 12, 3, 8, 0, 0, 123000, tzinfo=UTC)
    two = timezone(timedelta(hours=2))
    assert as_utc(datetime(2026, 1, 1, 2, tzinfo=two)) == datetime(2026, 1, 1, tzinfo=UTC)


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff()
    assert [b.next() for _ in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    b.reset()
    assert b.next() == 0.1
    with pytest.raises(ValueError):
        Backoff(1.0, 0.5)


def test_urls() -> None:
    assert mask_url("redis://:secret@h:6379/0") == "redis://:***@h:6379/0"
    assert mask_url("postgresql://u:p@ss@h/db?password=x") == "postgresql://u:***@h/db?password=***"
    validate_bus_url("embedded")
    validate_bus_url("rediss://h:6380/0")
    with pytest.raises(ConfigError, match="unsupported bus URL 'kafka://u:\\*\\*\\*@h'"):
        validate_bus_url("kafka://u:pw@h")
    assert validate_namespace("pb-1.x") == "pb-1.x"
    for bad in ("a:b", "{p}", "", "a b", 3):
        with pytest.raises(ConfigError):
            validate_namespace(bad)


# The repeats these helpers replaced, by the names they had: none may come back.
FORBIDDEN_DEFINITIONS = {"_first_line", "_utc", "_aware", "to_utc", "_as_datetime", "_as_utc"}


def test_no_private_copy_of_a_shared_helper() -> None:
    found = []
    for package in ("bridge", "event_scheduler", "legacy_poller", "pollbridge"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef) and node.name in FORBIDDEN_DEFINITIONS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} def {node.name}")
    assert not found, "use bridge.core.errors.first_line / bridge.db.clock.as_utc:\n" + "\n".join(found)


def test_the_servers_tests_start_take_ports_no_client_connection_can_hold() -> None:
    """Every test server's port comes from tests/support/ports.py, below the kernel's ephemeral range: a port the
    kernel chose was taken by some client connection between the pick and `airflow api-server`'s bind a minute
    later (CI, 2026-12-07: "[Errno 98] address already in use")."""
    from tests.support.ports import _ephemeral_start, free_port

    ports = {free_port(also=(10_000,)) for _ in range(20)}
    assert all(port >= 10_000 and port + 10_000 < _ephemeral_start() for port in ports), ports
    # A port the kernel picks is only safe in the socket it was bound to: the server keeps it, listening at once.
    pickers = []
    for path in (ROOT / "tests").rglob("*.py"):
        lines = path.read_text(encoding="utf-8").splitlines()
        pickers += [f"{path.relative_to(ROOT)}:{i + 1}" for i, line in enumerate(lines)
                    if 'bind(("127.0.0.1", 0))' in line and path.name not in ("ports.py", "test_helpers.py")
                    and "listen(" not in lines[i + 1]]
    assert pickers == [], pickers
