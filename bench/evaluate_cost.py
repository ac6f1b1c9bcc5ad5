"""The Python cost of the scheduler's evaluation statement: through SQLAlchemy, and the same SQL through psycopg.

    python -m bench.evaluate_cost [--calls 2000] [--json F]

Seeds 200 chains of 10 tasks in a scratch PostgreSQL database, then runs the event scheduler's evaluation
of one instance ``--calls`` times on one kept autocommit connection, as the scheduler's loop does: first
with ``Connection.execute`` (what the scheduler did until 2026-12-01), then the scheduler's driver path
(``bridge.db.driver.DriverStatement``: the compiled SQL on the psycopg connection underneath, named rows,
statement listeners), then the bare SQL text and parameters through psycopg (prepared). Reports CPU
(``time.process_time``) and wall time per call. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from bench.common import scratch_database, write_json
from bridge.app import install
from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import CaptureSettings, SchedulerSettings
from bridge.db.engine import create_engine
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from event_scheduler.evaluate import Evaluator
from event_scheduler.metrics import SchedulerMetrics


def _per_call(run: Any, calls: int) -> dict[str, float]:
    for _ in range(min(200, calls)):  # warm: prepared statements, caches
        run()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        run()
    return {"cpu_ms": round((time.process_time() - cpu) / calls * 1000, 3),
            "wall_ms": round((time.perf_counter() - wall) / calls * 1000, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.evaluate_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    with scratch_database("pollbridge_bench_evaluate_cost") as url:
        engine = create_engine(url)
        install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings())
        tt = reflect_tables(engine, TaskTableMapping())
        chain = tuple(TaskSpec(f"t{k}", (f"t{k - 1}",) if k else ()) for k in range(10))
        with engine.begin() as conn:
            seed(conn, tt, [WorkflowSpec(f"i{n}", "orders", chain) for n in range(200)])
            conn.execute(sa.text("UPDATE tasks SET status = 'completed' WHERE task_key = 't0'"))
        # dual_write: the evaluation records nothing that changes the next call's answer.
        evaluator = Evaluator(engine, tt, FixedRouter("dual_write"), SchedulerSettings(),
                              SchedulerMetrics(CollectorRegistry()))
        conn = evaluator.connect()
        params = {"ids": ["i5"], "scope": json.dumps({"i5": {"w": 1}})}
        sent: dict[str, Any] = {}

        def capture(_c: Any, _cursor: Any, statement: str, parameters: Any, _ctx: Any, _many: bool) -> None:
            sent.update(sql=statement, params=parameters)

        sa.event.listen(engine, "before_cursor_execute", capture)
        conn.execute(evaluator._query, params).all()
        sa.event.remove(engine, "before_cursor_execute", capture)
        raw = conn.connection.driver_connection
        assert raw is not None
        result = {
            "sqlalchemy": _per_call(lambda: conn.execute(evaluator._query, params).all(), args.calls),
            "driver_statement": _per_call(lambda: evaluator._query_run.all(conn, params), args.calls),
            "psycopg": _per_call(lambda: raw.execute(sent["sql"], sent["params"], prepare=True).fetchall(),
                                 args.calls),
            "calls": args.calls,
        }
        conn.close()
        engine.dispose()
    for name in ("sqlalchemy", "driver_statement", "psycopg"):
        print(f"{name:16} cpu {result[name]['cpu_ms']:.3f} ms/call, wall {result[name]['wall_ms']:.3f} ms/call")
    write_json(args.json_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
