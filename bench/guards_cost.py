"""What the review queue's probes cost the hot path: the evaluation of a ready task and the dispatch.

    python -m bench.guards_cost [--rounds 6] [--calls 1500] [--queue 10000] [--json F]

Issue 22 put two index probes on the event path: the evaluation reads the review queue's word on each *ready*
task (:func:`bridge.tasktable.review.review_state`), and the shared dispatch compare-and-set refuses a parked
task (:func:`bridge.tasktable.review.parked`, also in the poller's scan). This measures both on PostgreSQL,
in one process, alternating configuration ``probes`` (the code as shipped) with ``none`` (the same statements
built with the probes replaced by constants), ``--rounds`` times each, with ``--queue`` decided rows in
``pollbridge_review`` (the audit trail a long-lived installation accumulates) and one open row:

* ``evaluate``: the evaluation statement of one instance whose one ready task is checked (dual_write, so
  nothing changes between calls), per call;
* ``dispatch``: one dispatch of a batch of 50 ready tasks (each round re-pends them), per batch.

Reports CPU (``time.process_time``) and wall time per call, the median over rounds. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from unittest import mock

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from bench.common import scratch_database, write_json
from bridge.app import install
from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import CaptureSettings, SchedulerSettings
from bridge.db.engine import create_engine
from bridge.db.schema import review
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable import dispatch as dispatch_module
from bridge.tasktable.dispatch import ReadyTask, dispatch_many
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler import queries as queries_module
from event_scheduler.evaluate import Evaluator
from event_scheduler.metrics import SchedulerMetrics

BATCH = 50


@contextmanager
def configuration(name: str) -> Iterator[None]:
    """``probes``: as shipped; ``none``: the probes replaced by constants (a statement built inside)."""
    if name == "probes":
        yield
        return
    with mock.patch.object(queries_module, "review_state", lambda _id: sa.null()), \
            mock.patch.object(dispatch_module, "parked", lambda _id: sa.false()):
        dispatch_module._PG_STATEMENTS.clear()
        try:
            yield
        finally:
            dispatch_module._PG_STATEMENTS.clear()


def _per_call(run: Callable[[], Any], calls: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        run()
    return (time.process_time() - cpu) / calls * 1000, (time.perf_counter() - wall) / calls * 1000


def _evaluate_cost(engine: sa.Engine, tt: TaskTable, calls: int) -> tuple[float, float]:
    evaluator = Evaluator(engine, tt, FixedRouter("dual_write"), SchedulerSettings(),
                          SchedulerMetrics(CollectorRegistry()), holder="bench")
    conn = evaluator.connect()
    try:
        params = {"ids": ["i5"], "scope": json.dumps({"i5": {"w": 1}})}
        for _ in range(100):  # warm: prepared statement
            evaluator._query_run.all(conn, params)
        return _per_call(lambda: evaluator._query_run.all(conn, params), calls)
    finally:
        conn.close()


def _dispatch_cost(engine: sa.Engine, tt: TaskTable, tasks: list[ReadyTask], calls: int) -> tuple[float, float]:
    t = tt.tasks
    ids = [task.task_id for task in tasks]
    cpu_total = wall_total = 0.0
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(calls):
            conn.execute(t.update().where(t.c.id.in_(ids)).values(status="pending"))
            cpu, wall = time.process_time(), time.perf_counter()
            won = dispatch_many(conn, tt, tasks, "events")
            cpu_total += time.process_time() - cpu
            wall_total += time.perf_counter() - wall
            assert len(won) == len(tasks)
    return cpu_total / calls * 1000, wall_total / calls * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.guards_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--queue", type=int, default=10_000)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, list[tuple[float, float]]]] = {"evaluate": {}, "dispatch": {}}
    with scratch_database("pollbridge_bench_guards_cost") as url:
        engine = create_engine(url)
        install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings())
        tt = reflect_tables(engine, TaskTableMapping())
        chain = tuple(TaskSpec(f"t{k}", (f"t{k - 1}",) if k else ()) for k in range(10))
        with engine.begin() as conn:
            seed(conn, tt, [WorkflowSpec(f"i{n}", "orders", chain) for n in range(200)])
            seed(conn, tt, [WorkflowSpec("wide", "orders", tuple(TaskSpec(f"w{k}") for k in range(BATCH)))])
            conn.execute(sa.text("UPDATE tasks SET status = 'completed' WHERE task_key = 't0'"))
            now = datetime.now(UTC)
            conn.execute(review.insert(), [
                {"task_id": str(1_000_000 + n), "instance_id": f"gone{n}", "workflow_type": "orders",
                 "task_key": "x", "guard": "depth", "measured": 9, "limit_value": 5, "parked_at": now,
                 "parked_by": "bench", "decision": "released", "decided_by": "bench", "decided_at": now,
                 "decision_reason": "bench"} for n in range(args.queue)])
            conn.execute(review.insert().values(task_id="2000000", instance_id="open", workflow_type="orders",
                                                task_key="x", guard="depth", measured=9, limit_value=5,
                                                parked_at=sa.func.now(), parked_by="bench"))
            conn.execute(sa.text("ANALYZE"))
            t = tt.tasks
            rows = conn.execute(sa.select(t.c.id, t.c.task_key).where(t.c.instance_id == "wide")).all()
        tasks = [ReadyTask(r.id, "wide", r.task_key, "orders", None, None) for r in rows]
        for round_ in range(args.rounds):
            order = ("probes", "none") if round_ % 2 == 0 else ("none", "probes")
            for name in order:
                with configuration(name):
                    results["evaluate"].setdefault(name, []).append(_evaluate_cost(engine, tt, args.calls))
                    results["dispatch"].setdefault(name, []).append(
                        _dispatch_cost(engine, tt, tasks, max(50, args.calls // 10)))
        engine.dispose()
    summary: dict[str, Any] = {"rounds": args.rounds, "calls": args.calls, "queue_rows": args.queue + 1,
                               "batch": BATCH}
    for what, by_name in results.items():
        for name, samples in by_name.items():
            cpu = statistics.median(s[0] for s in samples)
            wall = statistics.median(s[1] for s in samples)
            summary[f"{what}_{name}"] = {"cpu_ms": round(cpu, 4), "wall_ms": round(wall, 4)}
            unit = "per call" if what == "evaluate" else f"per batch of {BATCH}"
            print(f"{what:9} {name:7} cpu {cpu:.4f} ms, wall {wall:.4f} ms {unit} (median of {len(samples)})")
    write_json(args.json_path, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
