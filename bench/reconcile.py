"""Reconciler benchmark: the whole report over a window of N tasks on PostgreSQL.

    python -m bench.reconcile [--tasks 1000000] [--quick] [--keep] [--json FILE]

Builds, with set-based SQL in a scratch database, ``--tasks`` tasks (chains of 10 per instance, all
completed) of one workflow type that went ``polling`` → ``dual_write`` → ``selective`` over the
window: in the first third the poller dispatched; in the second the poller dispatched and the event
path recorded shadow decisions; in the last the event path dispatched (0.1% of them as fallback
catches, a few planted early and duplicate dispatches). Then times :func:`bridge.reconcile.report.build_report`
(counts, percentiles, histograms, timeline, mismatches) over the whole window, as
``pollbridge reconcile --format json`` runs it, and checks the counts it found against what was
planted. Target: 1,000,000 tasks in ≤ 10 s on the 2-core machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from bench.common import machine, scratch_database, write_json
from bridge.app import install
from bridge.core.settings import GateSettings, Settings
from bridge.db.engine import create_engine
from bridge.reconcile.report import build_report
from bridge.tasktable.tables import reflect_tables

CHAIN = 10

SEED_SQL = """
INSERT INTO workflow_instances (id, workflow_type)
SELECT 'i' || g, 'orders' FROM generate_series(1, :instances) g;

INSERT INTO tasks (instance_id, task_key, status, depends_on, attempts, max_attempts, dispatched_at, completed_at,
                   updated_at)
SELECT 'i' || g, 't' || k, 'completed',
       CASE WHEN k = 1 THEN '[]'::json ELSE json_build_array('t' || (k - 1)) END, 1, 3,
       :t0 + make_interval(secs => (g * :spacing) + k * 0.5 + 0.01),
       :t0 + make_interval(secs => (g * :spacing) + k * 0.5 + 0.4),
       :t0 + make_interval(secs => (g * :spacing) + k * 0.5 + 0.4)
FROM generate_series(1, :instances) g, generate_series(1, 10) k;

-- ready_at = the previous task's completion (or the instance's start); dispatched 10 ms later.
INSERT INTO pollbridge_dispatch_log (task_id, instance_id, workflow_type, task_key, attempt, path, ready_at,
                                     dispatched_at, trace_id)
SELECT t.id::text, t.instance_id, 'orders', t.task_key, 1,
       CASE WHEN t.dispatched_at < :t1 OR t.dispatched_at < :t2 THEN 'poller'
            WHEN t.id % 1000 = 7 THEN 'fallback' ELSE 'events' END,
       t.dispatched_at - interval '10 milliseconds', t.dispatched_at, md5(t.id::text)
FROM tasks t;

INSERT INTO pollbridge_decisions (task_id, instance_id, workflow_type, task_key, attempt, ready_at, decided_at,
                                  trace_id)
SELECT t.id::text, t.instance_id, 'orders', t.task_key, 1, t.dispatched_at - interval '10 milliseconds',
       t.dispatched_at - interval '8 milliseconds', md5(t.id::text)
FROM tasks t WHERE t.dispatched_at >= :t1 AND t.dispatched_at < :t2;

-- Planted safety violations in the last third: 3 duplicates, and 2 dispatches before the dependency completed.
INSERT INTO pollbridge_dispatch_log (task_id, instance_id, workflow_type, task_key, attempt, path, ready_at,
                                     dispatched_at, trace_id)
SELECT task_id, instance_id, workflow_type, task_key, attempt, 'poller', ready_at,
       dispatched_at + interval '1 millisecond', trace_id
FROM pollbridge_dispatch_log WHERE path = 'events' ORDER BY id DESC LIMIT 3;
UPDATE pollbridge_dispatch_log SET dispatched_at = dispatched_at - interval '5 seconds'
WHERE id IN (SELECT id FROM pollbridge_dispatch_log WHERE path = 'events' AND task_key = 't5' ORDER BY id LIMIT 2);

INSERT INTO pollbridge_flag_audit (workflow_type, action, actor, reason, old_phase, new_phase, forced, changed_at)
VALUES ('orders', 'set', 'bench', 'bench', 'polling', 'dual_write', false, :t1),
       ('orders', 'set', 'bench', 'bench', 'dual_write', 'selective', false, :t2);
INSERT INTO pollbridge_flags (workflow_type, phase, grace_seconds, updated_at, updated_by)
VALUES ('orders', 'selective', 5, :t2, 'bench');
ANALYZE;
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reconcile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="50,000 tasks (CI keeps the script working)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of the report")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    tasks = 50_000 if args.quick else args.tasks
    instances = max(tasks // CHAIN, 3)
    with scratch_database("pollbridge_bench_reconcile", keep=args.keep) as url:
        engine = create_engine(url)
        settings = Settings()
        install.init(engine, demo_schema=True, mapping=settings.mapping)
        tt = reflect_tables(engine, settings.mapping)
        with engine.begin() as conn:
            t0 = conn.execute(sa.text("SELECT date_trunc('second', now()) - interval '2 days'")).scalar_one()
        spacing = 0.02  # seconds between instance starts: the window spans instances * spacing seconds
        span = timedelta(seconds=instances * spacing + 10)
        t1, t2 = t0 + span / 3, t0 + span * 2 / 3
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE tasks DISABLE TRIGGER USER"))  # seeding is not a workload to capture
            for statement in [s for s in SEED_SQL.split(";\n") if s.strip()]:
                conn.execute(sa.text(statement), {"instances": instances, "t0": t0, "t1": t1, "t2": t2,
                                                  "spacing": spacing})
            conn.execute(sa.text("ALTER TABLE tasks ENABLE TRIGGER USER"))
        seed_seconds = time.perf_counter() - started
        print(f"seeded {instances * CHAIN:,} tasks in {seed_seconds:.1f} s", file=sys.stderr)
        gates = GateSettings(min_tasks=100)
        timings: list[float] = []
        report: Any = None
        for _ in range(args.runs):
            started = time.perf_counter()
            report = build_report(engine, tt, t0, t0 + span + timedelta(seconds=60), settings=gates, now=None,
                                  mismatch_limit=1000)
            timings.append(time.perf_counter() - started)
        engine.dispose()
    orders = report.types[0]
    found = {k: orders.counts.get(k, 0) for k in ("matched", "missing", "duplicate", "early", "poller", "late")}
    result = {
        "tasks": instances * CHAIN,
        "seconds": [round(t, 2) for t in timings],
        "best_seconds": round(min(timings), 2),
        "counts": found,
        "verdict": report.verdict,
        "machine": machine(),
    }
    print(f"reconcile over {result['tasks']:,} tasks: {', '.join(f'{t:.2f}' for t in timings)} s "
          f"(best {result['best_seconds']} s); counts {found}; verdict {report.verdict}")
    write_json(args.json_path, result)
    ok = found["duplicate"] == 3 and found["early"] == 2 and found["missing"] > 0
    if not ok:
        print("error: the report did not find what was planted", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
