"""The relay's claim and the backlog count stay on the partial index of unpublished rows whatever the statistics
say.

The outbox keeps published rows for ``relay.retention``. Statistics taken while a burst waited unpublished say
every row is unpublished; until the next autoanalyze, a claim the planner runs along the primary key filters
every retained published row before it finds the few unpublished ones (measured: 22 ms a claim with 57,000
retained rows, ``bench.cost`` at 500 completions/s, p50 45 ms instead of 5).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg import sql as psql
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from bridge.capture.outbox import backlog_query
from bridge.capture.queries import claim_statement
from bridge.db.engine import create_engine

pytestmark = pytest.mark.postgres

RETAINED = 20_000
WAITING = 5


@pytest.fixture
def stale(pg_url: str) -> Iterator[Engine]:
    """An outbox whose statistics were taken while ``RETAINED`` rows waited: since then all were published and
    ``WAITING`` new rows wait (autovacuum off for the table, so no autoanalyze corrects them mid-test)."""
    engine = create_engine(pg_url)
    insert = ("INSERT INTO pollbridge_outbox (event_id, task_id, instance_id, workflow_type, task_key, change, "
              "new_status, relay_partition, created_at) SELECT gen_random_uuid()::text, g::text, g::text, 'wf', 't', "
              "'status', 'ready', 0, clock_timestamp() FROM generate_series(1, :n) g")
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE pollbridge_outbox SET (autovacuum_enabled = off)")
        conn.execute(sa.text(insert), {"n": RETAINED})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("ANALYZE pollbridge_outbox")
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE pollbridge_outbox SET published_at = clock_timestamp()")
        conn.execute(sa.text(insert), {"n": WAITING})
    yield engine
    engine.dispose()


def _scans(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if "Relation Name" in plan:
        yield plan
    for child in plan.get("Plans", []):
        yield from _scans(child)


def _explain(engine: Engine, statement: sa.Executable, generic: bool) -> dict[str, Any]:
    """``statement`` prepared with its parameters as ``$n``, executed under EXPLAIN ANALYZE in a transaction rolled
    back: with ``generic``, as a prepared statement runs once PostgreSQL settles on a generic plan (the relay's claim,
    prepared by the driver after a few runs)."""
    compiled = statement.compile(dialect=postgresql.psycopg.dialect(paramstyle="numeric_dollar"))  # type: ignore[attr-defined]
    names = list(compiled.positiontup or ())
    values = [compiled.params[name] for name in names]
    types = ", ".join(compiled.binds[name].type.compile(dialect=postgresql.dialect()) for name in names)
    with engine.begin() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        if generic:
            driver.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        driver.execute(f"PREPARE pb_look ({types}) AS {compiled.string}" if names
                       else f"PREPARE pb_look AS {compiled.string}")
        arguments = psql.SQL(", ").join(psql.Literal(v) for v in values)  # a utility statement takes no $n
        look = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE pb_look" + ("({})" if names else "")
        row = driver.execute(psql.SQL(look).format(arguments)).fetchone()
        conn.rollback()
    assert row is not None
    document = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    return document[0]["Plan"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
def test_the_claim_reads_only_unpublished_rows_under_statistics_of_a_burst(stale: Engine, generic: bool) -> None:
    with stale.connect() as conn:
        null_frac = conn.exec_driver_sql("SELECT null_frac FROM pg_stats WHERE tablename = 'pollbridge_outbox' "
                                         "AND attname = 'published_at'").scalar_one()
    assert null_frac == 1.0  # the trap is set: the statistics say every row waits

    plan = _explain(stale, claim_statement("postgresql", 0, 5000), generic)

    assert plan["Actual Rows"] == WAITING
    scans = list(_scans(plan))
    # The rows are picked on the partial index, and no scan filters the retained published rows out one by one.
    assert any(s.get("Index Name") == "pollbridge_outbox_unpublished_idx" for s in scans), plan
    for scan in scans:
        assert scan.get("Rows Removed by Filter", 0) < RETAINED / 10, scan
    # Its cost follows the waiting rows, not the retained ones (a scan of the primary key read ~20,000 tuples).
    assert plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0) < 1000, plan


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
@pytest.mark.parametrize("partition", [0, None], ids=["one-partition", "all-partitions"])
def test_the_backlog_reads_only_unpublished_rows_under_statistics_of_a_burst(stale: Engine, partition: int | None,
                                                                               generic: bool) -> None:
    """The relay's gauges, the guardian's ``outbox_age``, ``preflight`` and ``status`` count the backlog: a
    plain count took a sequential scan of every retained row under these statistics."""
    query = backlog_query("postgresql", partition)
    plan = _explain(stale, query, generic)
    with stale.connect() as conn:
        assert conn.execute(query).one()[0] == WAITING
    scans = list(_scans(plan))
    assert [s.get("Index Name") for s in scans] == ["pollbridge_outbox_unpublished_idx"], plan
    assert all(s.get("Rows Removed by Filter", 0) == 0 for s in scans), plan
