"""Unit tests of bridge.db.engine: URL masking and normalisation, the database clock on SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from hypothesis import example, given
from hypothesis import strategies as st
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine, make_url

from bridge.core.errors import ConfigError
from bridge.core.urls import mask_url
from bridge.db.engine import create_engine, db_now, millis_between, normalize_url, open_engine

passwords = st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)
# Passwords that are safe to paste into a URL unencoded ('@' ends the credentials, '%' starts an escape).
raw_passwords = st.text(
    alphabet=st.characters(exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp"), exclude_characters="@%/?#"),
    min_size=1,
    max_size=40,
)
SPECIAL = "p@ss:w/rd?#%&=+ $!é🔑"


# --------------------------------------------------------------------------------------------------
# mask_url


@given(passwords)
@example(SPECIAL)
@example("postgresql")
@example("host")
def test_mask_url_hides_encoded_postgres_password(password: str) -> None:
    url = f"postgresql://user:{quote(password, safe='')}@host/db"
    assert make_url(url).password == password  # the URL really carries this password
    assert mask_url(url) == "postgresql://user:***@host/db"
    assert mask_url(make_url(url)) == "postgresql://user:***@host/db"


@given(passwords)
@example(SPECIAL)
def test_mask_url_hides_encoded_postgres_password_with_port_and_query(password: str) -> None:
    url = f"postgresql+psycopg://app_user:{quote(password, safe='')}@db.example.com:5433/prod?sslmode=require"
    masked = mask_url(url)
    assert masked == "postgresql+psycopg://app_user:***@db.example.com:5433/prod?sslmode=require"


@given(passwords, st.sampled_from(["redis", "rediss"]), st.sampled_from(["", "default"]))
@example(SPECIAL, "redis", "")
def test_mask_url_hides_encoded_redis_password(password: str, scheme: str, user: str) -> None:
    url = f"{scheme}://{user}:{quote(password, safe='')}@cache.local:6379/0"
    assert mask_url(url) == f"{scheme}://{user}:***@cache.local:6379/0"


@given(raw_passwords)
@example("pa:ss")
@example("s3cr3t!$&'()*+,;=")
def test_mask_url_hides_unencoded_password(password: str) -> None:
    assert mask_url(f"postgresql://user:{password}@host/db") == "postgresql://user:***@host/db"
    assert mask_url(f"redis://:{password}@host:6379/0") == "redis://:***@host:6379/0"


def test_mask_url_hides_password_with_unencoded_at_sign() -> None:
    masked = mask_url("postgresql://user:p@SECRETTAIL@host/db")
    assert "SECRETTAIL" not in masked


@given(raw_passwords)
def test_mask_url_fallback_for_unparseable_urls(password: str) -> None:
    # 'my-db' is not a valid SQLAlchemy scheme, so make_url fails and the manual masking runs.
    masked = mask_url(f"my-db://someone:{password}@host:1/x")
    assert masked == "my-db://someone:***@host:1/x"


def test_mask_url_leaves_urls_without_password_alone() -> None:
    for url in ("sqlite:///pollbridge.db", "postgresql://user@host/db", "redis://host:6379/0", "embedded",
                "my-db://host/x"):
        assert mask_url(url) == url


# --------------------------------------------------------------------------------------------------
# normalize_url


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("postgresql://user@host:5432/db", "postgresql+psycopg"),
        ("postgresql://user:pw@host/db", "postgresql+psycopg"),
        ("postgresql+psycopg://user@host/db", "postgresql+psycopg"),
        ("sqlite:///pollbridge.db", "sqlite"),
        ("sqlite://", "sqlite"),
    ],
)
def test_normalize_url_selects_psycopg(url: str, driver: str) -> None:
    parsed = normalize_url(url)
    assert parsed.drivername == driver
    original = make_url(url)
    assert (parsed.username, parsed.password, parsed.host, parsed.port, parsed.database) == (
        original.username, original.password, original.host, original.port, original.database
    )


def test_normalize_url_accepts_postgres_alias() -> None:
    assert normalize_url("postgres://user@host/db").drivername == "postgresql+psycopg"


@pytest.mark.parametrize("url", ["mysql://user@host/db", "mssql+pyodbc://host/db", "oracle://h/db", "redis://h:6379/0"])
def test_unsupported_database_lists_supported_ones(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        normalize_url(url)
    message = str(info.value)
    assert "unsupported database" in message
    assert "supported: sqlite, postgresql" in message
    assert info.value.exit_code == 2


@pytest.mark.parametrize("url", ["foo", "", "not a url", "://nothing"])
def test_unparseable_url_names_supported_examples(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        normalize_url(url)
    message = str(info.value)
    assert "invalid database URL" in message
    assert "sqlite" in message
    assert "postgresql" in message


@given(passwords)
def test_normalize_url_errors_mask_the_password(password: str) -> None:
    with pytest.raises(ConfigError) as info:
        normalize_url(f"mysql://user:{quote(password, safe='')}@host/db")
    assert str(info.value) == "unsupported database 'mysql' in mysql://user:***@host/db; supported: sqlite, postgresql"


def test_create_engine_rejects_unsupported_scheme() -> None:
    with pytest.raises(ConfigError, match="mysql"):
        create_engine("mysql://user@host/db")


# --------------------------------------------------------------------------------------------------
# SQLite engine, db_now and millis_between


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine("sqlite:///" + str(tmp_path / "clock.db"))
    yield engine
    engine.dispose()


def test_sqlite_engine_pragmas(engine: Engine) -> None:
    assert engine.dialect.name == "sqlite"
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


def test_open_engine_ownership(engine: Engine, tmp_path: Path) -> None:
    assert open_engine(engine) == (engine, False)
    created, owned = open_engine("sqlite:///" + str(tmp_path / "other.db"))
    try:
        assert owned
        assert created is not engine
    finally:
        created.dispose()


def test_db_now_on_sqlite_is_current_utc_with_milliseconds(engine: Engine) -> None:
    before = datetime.now(UTC).replace(tzinfo=None)
    with engine.connect() as conn:
        first = conn.execute(sa.select(db_now("sqlite"))).scalar_one()
        second = conn.execute(sa.select(db_now("sqlite"))).scalar_one()
    after = datetime.now(UTC).replace(tzinfo=None)
    assert isinstance(first, str)
    parsed = datetime.strptime(first, "%Y-%m-%d %H:%M:%S.%f")
    assert len(first.rsplit(".", 1)[1]) == 3  # millisecond precision
    # SQLite's clock is the same wall clock, in UTC (allow the truncation to milliseconds).
    assert (before - parsed).total_seconds() < 0.002
    assert (parsed - after).total_seconds() < 0.002
    assert datetime.strptime(second, "%Y-%m-%d %H:%M:%S.%f") >= parsed


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        ("2024-01-01 00:00:00.000", "2024-01-01 00:00:01.500", 1500.0),
        ("2024-01-01 00:00:01.500", "2024-01-01 00:00:00.000", -1500.0),
        ("2024-03-31 23:59:59.900", "2024-04-01 00:00:00.100", 200.0),
        ("2024-01-01 12:00:00.000", "2024-01-01 12:00:00.000", 0.0),
        ("2024-01-01 00:00:00.000", "2024-01-02 00:00:00.000", 86_400_000.0),
        ("2024-01-01 00:00:00.001", "2024-01-01 00:00:00.002", 1.0),
    ],
)
def test_millis_between_on_sqlite(engine: Engine, start: str, end: str, expected: float) -> None:
    with engine.connect() as conn:
        value = conn.execute(sa.select(millis_between("sqlite", sa.literal(start), sa.literal(end)))).scalar_one()
    assert value == pytest.approx(expected, abs=0.1)


def test_millis_between_db_now_and_itself_is_tiny(engine: Engine) -> None:
    now = db_now("sqlite")
    with engine.connect() as conn:
        value = conn.execute(
            sa.select(millis_between("sqlite", sa.literal("2000-01-01 00:00:00.000"), now))
        ).scalar_one()
    expected = (datetime.now(UTC).replace(tzinfo=None) - datetime(2000, 1, 1)).total_seconds() * 1000
    assert value == pytest.approx(expected, abs=5_000)


def test_millis_between_on_a_table_column(engine: Engine) -> None:
    metadata = sa.MetaData()
    events = sa.Table("events", metadata, sa.Column("id", sa.Integer, primary_key=True),
                      sa.Column("started", sa.Text), sa.Column("ended", sa.Text))
    with engine.begin() as conn:
        metadata.create_all(conn)
        conn.execute(events.insert(), [{"id": 1, "started": "2024-05-05 10:00:00.000",
                                        "ended": "2024-05-05 10:00:02.250"}])
    with engine.connect() as conn:
        value = conn.execute(sa.select(millis_between("sqlite", events.c.started, events.c.ended))).scalar_one()
    assert value == pytest.approx(2250.0, abs=0.1)


def test_postgres_expressions_compile() -> None:
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    assert "clock_timestamp()" in str(db_now("postgresql").compile(dialect=dialect))
    start = sa.column("a", sa.DateTime(timezone=True))
    end = sa.column("b", sa.DateTime(timezone=True))
    expression = millis_between("postgresql", start, end)
    compiled = str(expression.compile(dialect=dialect, compile_kwargs={"literal_binds": True})).lower()
    # date_part (double precision), not extract (numeric since PostgreSQL 14, several times slower)
    assert compiled.replace(" ", "") == "date_part('epoch',b-a)*1000.0"
