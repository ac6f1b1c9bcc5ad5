"""Scale curve: the poller's scan cost and the event path's per-event cost as the task table grows.

    python -m bench.scale [--sizes 10000,100000,1000000] [--quick] [--keep] [--json F] [--png F]
    python -m bench.paths --scale ...        # the same

For each size a scratch PostgreSQL database gets, with set-based SQL (``generate_series``, capture
triggers off while seeding, then ``VACUUM ANALYZE``), ``size`` tasks in chains of 10 per instance:

* 80 % of the instances finished (every task completed): history, as a task table keeps it;
* 20 % waiting: the first task pending with a due time a day away, the other nine pending behind it:
  the backlog a poller looks at on every scan and finds not ready;
* ``--ready`` (600) instances in progress: five tasks completed, the sixth pending and ready.

**Poller** (``legacy_poller.poller.LegacyPoller``, in process, the scan ``pollbridge poller run`` makes):
the time of one scan and the rows it examined (its own ``examined`` figure: the pending rows its
statement counts and checks), and the shared buffers ``EXPLAIN (ANALYZE, BUFFERS)`` reports for its
statement; an *empty* scan (nothing ready, the common case for a poll) and a scan that dispatches 100
ready tasks; median of ``--runs``.

**Event path** (``event_scheduler.evaluate.Evaluator``, in process, what ``pollbridge scheduler run``
does for a batch of events): a "task t4 completed" event per instance, scoped as the scheduler scopes
it, evaluated and its ready task dispatched through the compare-and-set: time per event for batches of
1 and of 100 events, median over distinct instances (each event finds its task ready and dispatches it).

Target shape: the poller's cost grows with the table, the event path's does not.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.dialects import postgresql

from bench import _paths_common as pc
from bench.common import scratch_database, write_json
from bridge.app import install
from bridge.core.phases import FixedRouter
from bridge.core.settings import SchedulerSettings, Settings
from bridge.db.engine import create_engine
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.evaluate import Evaluator, Scope
from event_scheduler.metrics import SchedulerMetrics
from legacy_poller.poller import LegacyPoller

SEED_SQL = """
INSERT INTO workflow_instances (id, workflow_type) SELECT 'i' || g, 'orders' FROM generate_series(1, :instances) g;
INSERT INTO tasks (instance_id, task_key, status, depends_on, due_at, attempts, dispatched_at, completed_at, updated_at)
SELECT 'i' || g, 't' || k, s.status,
       CASE WHEN k = 0 THEN '[]'::json ELSE json_build_array('t' || (k - 1)) END,
       CASE WHEN g > :ready AND g % 5 = 0 AND k = 0 THEN now() + interval '1 day' END,
       CASE WHEN s.status = 'completed' THEN 1 ELSE 0 END,
       CASE WHEN s.status = 'completed' THEN now() - interval '1 hour' END,
       CASE WHEN s.status = 'completed' THEN now() - interval '1 hour' + k * interval '1 second' END,
       now() - interval '2 hours'
FROM generate_series(1, :instances) g, generate_series(0, 9) k,
     LATERAL (SELECT CASE WHEN g <= :ready THEN CASE WHEN k < 5 THEN 'completed' ELSE 'pending' END
                          WHEN g % 5 = 0 THEN 'pending' ELSE 'completed' END AS status) s
"""


def seed(engine: sa.Engine, tasks: int, ready: int) -> float:
    instances = max(tasks // 10, ready + 10)
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE tasks DISABLE TRIGGER USER"))  # seeding is not a workload to capture
        for statement in SEED_SQL.split(";\n"):
            if statement.strip():
                conn.execute(sa.text(statement), {"instances": instances, "ready": ready})
        conn.execute(sa.text("ALTER TABLE tasks ENABLE TRIGGER USER"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE tasks"))
        conn.execute(sa.text("VACUUM ANALYZE workflow_instances"))
        conn.execute(sa.text("VACUUM ANALYZE pollbridge_dispatch_log"))
    return time.perf_counter() - started


def explain_buffers(engine: sa.Engine, stmt: Any) -> int | None:
    """Shared buffers (hit + read) ``EXPLAIN (ANALYZE, BUFFERS)`` reports for ``stmt`` (run in a rolled-back
    transaction; None if it cannot be rendered)."""
    try:
        dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
        text = str(stmt.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
    except Exception:
        return None
    with engine.connect() as conn:
        plan = conn.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text)).scalar_one()
        conn.rollback()
    top = plan[0]["Plan"]
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))


def measure_poller(engine: sa.Engine, tt: TaskTable, runs: int) -> dict[str, Any]:
    poller = LegacyPoller(engine, tt, batch_size=500, registry=CollectorRegistry())
    poller.scan_once()  # warm-up (prepares, caches); nothing is ready any more after the event-path part
    empty = [poller.scan_once() for _ in range(runs)]
    busy = []
    for _ in range(max(3, runs // 2)):
        with engine.begin() as conn:  # 100 dispatched tasks become ready again
            conn.execute(sa.text("UPDATE tasks SET status = 'pending' WHERE id IN "
                                 "(SELECT id FROM tasks WHERE status = 'queued' ORDER BY id LIMIT 100)"))
        busy.append(poller.scan_once())
    scan = poller._scan_for("scan", {})
    return {
        "empty_scan_ms": round(statistics.median(r.seconds for r in empty) * 1000, 2),
        "empty_scan_ms_all": [round(r.seconds * 1000, 2) for r in empty],
        "rows_examined": empty[0].examined,
        "scan_100_ready_ms": round(statistics.median(r.seconds for r in busy) * 1000, 2),
        "dispatched_per_busy_scan": [r.dispatched for r in busy],
        "scan_buffers": explain_buffers(engine, scan) if scan is not None else None,
    }


def measure_events(engine: sa.Engine, tt: TaskTable, ready: int, singles: int, batches: int) -> dict[str, Any]:
    metrics = SchedulerMetrics(CollectorRegistry())
    evaluator = Evaluator(engine, tt, FixedRouter("cutover"), SchedulerSettings(), metrics)
    scoped = "scopes" in inspect.signature(evaluator.evaluate).parameters
    ids = [f"i{g}" for g in range(1, ready + 1)]
    warm, ids = ids[:5], ids[5:]
    scope = Scope(frozenset({"t4"}), frozenset({"t4"}))

    def run(batch: list[str]) -> tuple[float, int]:
        with evaluator.connect() as conn:
            started = time.perf_counter()
            if scoped:
                result = evaluator.evaluate(batch, conn=conn, scopes=dict.fromkeys(batch, scope))
            else:
                result = evaluator.evaluate(batch, conn=conn)
            return time.perf_counter() - started, len(result.dispatched)

    for i in warm:
        run([i])
    single = [run([ids.pop(0)]) for _ in range(singles)]
    per_batch = []
    for _ in range(batches):
        chunk, ids = ids[:100], ids[100:]
        seconds, dispatched = run(chunk)
        per_batch.append((seconds / len(chunk), dispatched))
    return {
        "per_event_ms_batch_1": round(statistics.median(s for s, _ in single) * 1000, 3),
        "per_event_ms_batch_1_p90": round(sorted(s for s, _ in single)[int(0.9 * len(single))] * 1000, 3),
        "per_event_ms_batch_100": round(statistics.median(s for s, _ in per_batch) * 1000, 3),
        "dispatched_batch_1": sum(d for _, d in single),
        "dispatched_batch_100": sum(d for _, d in per_batch),
        "events_batch_1": len(single), "events_batch_100": 100 * len(per_batch),
        "scoped": scoped,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="tasks in the table, comma-separated")
    parser.add_argument("--ready", type=int, default=600, help="instances with a ready task")
    parser.add_argument("--runs", type=int, default=7, help="poller scans per size")
    parser.add_argument("--quick", action="store_true", help="10k and 50k tasks (< 1 minute)")
    parser.add_argument("--keep", action="store_true", help="keep the last scratch database")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--png", dest="png_path")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.runs = "10000,50000", 3
    pc.exit_on_signals()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    singles, batches = 50, 5
    ready = max(args.ready, 5 + singles + 100 * batches)
    results: dict[str, Any] = {"command": " ".join(["python -m bench.scale", *(argv or sys.argv[1:])]),
                               "machine": pc.machine_info(), "sizes": []}
    settings = Settings()
    for size in sizes:
        with scratch_database("pollbridge_bench_scale", keep=args.keep) as url:
            engine = create_engine(url)
            try:
                install.init(engine, demo_schema=True, mapping=settings.mapping)
                tt = reflect_tables(engine, settings.mapping)
                seconds = seed(engine, size, ready)
                with engine.connect() as conn:
                    counts: dict[str, int] = {str(k): int(v) for k, v in conn.execute(
                        sa.text("SELECT status, count(*) FROM tasks GROUP BY 1")).all()}
                load = pc.MachineLoad(["pollbridge_bench_scale"])
                load.start()
                events = measure_events(engine, tt, ready, singles, batches)
                poller = measure_poller(engine, tt, args.runs)
                row: dict[str, Any] = {"tasks": sum(counts.values()), "by_status": counts, "seed_s": round(seconds, 1),
                       "poller": poller, "events": events, "load": load.stop()}
            finally:
                engine.dispose()
        results["sizes"].append(row)
        print(f"{row['tasks']:>9,} tasks (seeded in {row['seed_s']} s): poller empty scan "
              f"{poller['empty_scan_ms']} ms, "
              f"{poller['rows_examined']:,} rows examined, {poller['scan_buffers']} buffers; scan with 100 ready "
              f"{poller['scan_100_ready_ms']} ms | event path {events['per_event_ms_batch_1']} ms/event alone, "
              f"{events['per_event_ms_batch_100']} ms/event in batches of 100 | load {row['load']['load_after']}, "
              f"others {row['load']['other_cpu_pct']}% of a core", flush=True)
    head = ["tasks", "pending", "poller empty scan ms", "rows examined", "scan buffers", "scan w/ 100 ready ms",
            "event ms (batch 1)", "event ms (batch 100)", "load avg", "other CPU %"]
    print()
    print(pc.table(head, [[r["tasks"], r["by_status"].get("pending", 0), r["poller"]["empty_scan_ms"],
                           r["poller"]["rows_examined"], r["poller"]["scan_buffers"],
                           r["poller"]["scan_100_ready_ms"], r["events"]["per_event_ms_batch_1"],
                           r["events"]["per_event_ms_batch_100"], r["load"]["load_after"][0],
                           r["load"]["other_cpu_pct"]] for r in results["sizes"]]))
    write_json(args.json_path, results)
    series = {
        "poller: one empty scan": [[r["tasks"], r["poller"]["empty_scan_ms"]] for r in results["sizes"]],
        "poller: one scan dispatching 100": [[r["tasks"], r["poller"]["scan_100_ready_ms"]] for r in results["sizes"]],
        "event path: per event, alone": [[r["tasks"], r["events"]["per_event_ms_batch_1"]] for r in results["sizes"]],
        "event path: per event, batches of 100": [[r["tasks"], r["events"]["per_event_ms_batch_100"]]
                                                  for r in results["sizes"]],
    }
    message = pc.plot(args.png_path, "cost as the task table grows (PostgreSQL)", "tasks in the table (log)",
                      "milliseconds (log)", series, logx=True, logy=True)
    if message:
        print(message)
    bad = [r["tasks"] for r in results["sizes"]
           if r["events"]["dispatched_batch_1"] != r["events"]["events_batch_1"]
           or r["events"]["dispatched_batch_100"] != r["events"]["events_batch_100"]]
    if bad:
        print(f"error: some events did not dispatch their ready task at sizes {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
