"""Apache Airflow's own readiness latency: when an upstream task ended → when the scheduler scheduled its downstream.

    python -m bench.airflow_latency [--runs 3] [--quick] [--admin-url URL] [--json F]
    python -m bench.airflow_latency --database-url postgresql://…/airflow [--json F]

The first form starts a real Airflow 3.3 (PostgreSQL, LocalExecutor; tests/support/airflow.py: its own database and
legacy role, the virtualenv of ``$POLLBRIDGE_AIRFLOW_VENV`` or ``~/.cache/pollbridge/airflow-3.3``), runs every DAG of
tests/acceptance/airflow_dags/pollbridge_shapes.py ``--runs`` times (a wave of one run of each DAG at a time, waiting
for the wave to finish), then reads Airflow's tables and stops it. The second reads an existing Airflow 3.3 database
after its runs (pollbridge's views are installed for the query and dropped again if they were not there before).

The latency of a task is its first try's ``task_instance.scheduled_dttm`` minus the latest ``end_date`` of its upstream
task instances in the same run (``tests.support.airflow.READINESS_SQL``; the edges come from pollbridge's view
``pollbridge_airflow_edges``). Tasks without an upstream are left out. This is the figure pollbridge's event path is
compared with: Airflow's scheduler loop finds a ready task only when it next looks (``[scheduler]
scheduler_idle_sleep_time``, 1 s, when idle), plus its own processing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from typing import Any

import psycopg

from bench.common import PG_ADMIN_URL, latency_summary, machine, write_json
from tests.support.airflow import READINESS_SQL, SHAPE_DAGS, AirflowRig, Latency, load_sql_blocks


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.airflow_latency", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="waves of one run of every shape DAG (default 3)")
    parser.add_argument("--quick", action="store_true", help="one wave (a smoke run)")
    parser.add_argument("--admin-url", default=PG_ADMIN_URL,
                        help="PostgreSQL role that may create a database and a role (default $POLLBRIDGE_BENCH_PG_URL)")
    parser.add_argument("--database-url", help="read this existing Airflow 3.3 database instead of starting Airflow")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser


def read_latencies(database_url: str) -> list[Latency]:
    """Airflow's readiness latencies in an Airflow database; pollbridge's views are left as they were found."""
    blocks = load_sql_blocks()
    with psycopg.connect(database_url, autocommit=True) as conn:
        had_views = conn.execute("SELECT to_regclass('pollbridge_airflow_edges') IS NOT NULL").fetchone() == (True,)
        if not had_views:
            conn.execute(blocks["install"].encode())
        try:
            return [Latency(*row) for row in conn.execute(READINESS_SQL.encode()).fetchall()]
        finally:
            if not had_views:
                conn.execute(blocks["uninstall"].encode())


def run_airflow(admin_url: str, waves: int) -> tuple[list[Latency], dict[str, float]]:
    """Start Airflow, run ``waves`` waves of the shape DAGs, read the latencies, stop it."""
    with AirflowRig(admin_url) as rig:
        rig.wait_serialized(SHAPE_DAGS)
        began = time.monotonic()
        for wave in range(1, waves + 1):
            for dag_id in SHAPE_DAGS:
                rig.trigger(dag_id, f"manual__bench_{wave}")
            rig.wait_finished(deadline=300)
        rig.timings["runs"] = time.monotonic() - began
        failed = [run for run in rig.dag_runs() if run[2] != "success"]
        if failed:
            raise SystemExit(f"DAG runs did not succeed: {failed}")
        rig.install_views()
        return rig.readiness_latencies(), dict(rig.timings)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    timings: dict[str, float] = {}
    if args.database_url:
        latencies = read_latencies(args.database_url)
    else:
        latencies, timings = run_airflow(args.admin_url, 1 if args.quick else args.runs)
    if not latencies:
        print("no dispatched task with an upstream task: nothing to measure", file=sys.stderr)
        return 1
    overall = latency_summary([latency.seconds * 1000 for latency in latencies])
    per_dag: dict[str, list[float]] = defaultdict(list)
    for latency in latencies:
        per_dag[latency.dag_id].append(latency.seconds * 1000)
    print(f"Airflow readiness latency (upstream end_date -> downstream scheduled_dttm), {overall['n']} tasks:")
    print(f"  p50 {overall['p50_ms']:.0f} ms   p90 {overall['p90_ms']:.0f} ms   p99 {overall['p99_ms']:.0f} ms   "
          f"max {overall['max_ms']:.0f} ms")
    for dag_id, values in sorted(per_dag.items()):
        summary = latency_summary(values)
        print(f"  {dag_id:<12} n={summary['n']:<3} p50 {summary['p50_ms']:.0f} ms  p99 {summary['p99_ms']:.0f} ms")
    if timings:
        print("Airflow timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    payload: dict[str, Any] = {"readiness_latency": overall, "per_dag": {d: latency_summary(v) for d, v in
                                                                        per_dag.items()},
                               "timings_s": timings, "machine": machine()}
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
