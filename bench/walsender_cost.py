"""What PostgreSQL's logical decoding itself adds to a database's transaction count (issue 19's "transactions per
change" target, measured without pollbridge).

    python -m bench.walsender_cost [--transactions 200] [--json F]

A scratch database with two tables, ``published`` (in a publication) and ``other`` (not), and a logical
replication slot on ``pgoutput``. A walsender streams the slot (psycopg2's replication connection, confirming
what it reads, as pollbridge's relay does) while one client commits ``--transactions`` single-row UPDATEs of one
table, then of the other. The database's ``pg_stat_database`` commits and rollbacks are read before and after,
with the walsender's and the writer's connections closed first (a backend reports its counts at exit).

What it shows: the walsender decodes every transaction that wrote, published table or not, and opens a
transaction of its own to look the catalogs up for each (PostgreSQL 15's reorder buffer), which it rolls back.
So with WAL capture every write transaction in the database, pollbridge's own outbox writes included, costs at
least one more counted transaction: "at most one database transaction per change" cannot hold as
``pg_stat_database`` counts them (docs/capture.md).
"""

from __future__ import annotations

import argparse
import select
import time
from typing import Any

import psycopg

from bench.common import PG_ADMIN_URL, machine, scratch_database, write_json

SLOT = "pb_bench_walsender"


def _counters(url: str, database: str) -> tuple[int, int]:
    time.sleep(1.2)  # past PostgreSQL's stats flush interval (1 s)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s",
                           (database,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def measure(url: str, table: str, transactions: int) -> dict[str, Any]:
    """``transactions`` single-row UPDATEs of ``table`` while the slot is streamed: the counters' changes."""
    import psycopg2
    import psycopg2.extras

    database = url.rsplit("/", 1)[1]
    admin = PG_ADMIN_URL
    stream = psycopg2.connect(url, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    cur = stream.cursor()
    cur.start_replication(slot_name=SLOT, decode=False,
                          options={"proto_version": "1", "publication_names": "pb_bench_walsender"})
    before = _counters(admin, database)
    with psycopg.connect(url, autocommit=True) as writer:
        for i in range(transactions):
            writer.execute(f"UPDATE {table} SET v = v + 1 WHERE id = %s", (i % 100 + 1,))
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:  # read (and confirm) whatever the walsender sends
        message = cur.read_message()
        if message is None:
            select.select([cur], [], [], 0.1)
        else:
            cur.send_feedback(flush_lsn=message.data_start)
    stream.close()
    time.sleep(1.0)  # the walsender exits and reports
    after = _counters(admin, database)
    commits, rollbacks = after[0] - before[0], after[1] - before[1]
    return {"table": table, "published": table == "published", "transactions": transactions,
            "commits": commits, "rollbacks": rollbacks,
            "extra_per_transaction": round((commits + rollbacks - transactions) / transactions, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.walsender_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=200)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    with scratch_database("pollbridge_bench_walsender") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            if conn.execute("SHOW wal_level").fetchone() != ("logical",):
                print("bench.walsender_cost: wal_level is not logical (ALTER SYSTEM SET wal_level = logical; restart)")
                return 1
            for table in ("published", "other"):
                conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int NOT NULL)")
                conn.execute(f"INSERT INTO {table} SELECT g, 0 FROM generate_series(1, 100) AS g")
            conn.execute("CREATE PUBLICATION pb_bench_walsender FOR TABLE published")
            conn.execute(f"SELECT pg_create_logical_replication_slot('{SLOT}', 'pgoutput')")
        try:
            results = [measure(url, table, args.transactions) for table in ("published", "other")]
        finally:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(f"SELECT pg_drop_replication_slot('{SLOT}')")
    for r in results:
        print(f"{r['transactions']} single-row transactions on a {'published' if r['published'] else 'not published'} "
              f"table: commits +{r['commits']}, rollbacks +{r['rollbacks']}: {r['extra_per_transaction']} counted "
              "transactions more per transaction (the walsender's)")
    write_json(args.json_path, {"results": results, "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
