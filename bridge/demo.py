"""``pollbridge demo``: a workload run end to end on the legacy poller, with the invariants checked.

It seeds instances of three workflow types (chain, fan-out/fan-in and stacked-diamond DAGs, some
tasks with due times) under a fresh ``demo-<run>`` prefix, runs the poller and the demo workers
until every task is settled, then verifies the run independently (:mod:`bridge.verify`) and
summarises latency, scans and statements per dispatch. Only this run's instances are reported.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from bridge import install
from bridge.db import StatementCounter, check_connection, create_engine, db_now, mask_url, read_only
from bridge.demo_schema import is_default_mapping
from bridge.exceptions import WorkloadError
from bridge.settings import Settings
from bridge.tasktable import TaskTable, reflect_tables
from bridge.verify import Verdict, percentile, verify
from bridge.workload import TaskSpec, WorkflowSpec, demo_workload, seed
from legacy_poller.poller import LegacyPoller
from legacy_poller.runner import PollerRunner
from legacy_poller.workers import WorkerPool

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class DemoOptions:
    instances: int = 30
    tasks_per_instance: int = 6
    poll_interval: float = 1.0
    timeout: float = 300.0
    seed: int = 7
    workload_file: str | None = None


def load_workload_file(path: str, prefix: str) -> list[WorkflowSpec]:
    """A JSON list of ``{"workflow_type", "tasks": [{"key", "depends_on", "due_in", "awaits_signal"}]}``."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"cannot read workload file {path}: {exc}") from None
    if not isinstance(raw, list):
        raise WorkloadError(f"workload file {path}: expected a JSON list of instances")
    specs = []
    for n, item in enumerate(raw):
        try:
            tasks = tuple(
                TaskSpec(str(t["key"]), tuple(str(d) for d in t.get("depends_on", [])),
                         float(t["due_in"]) if t.get("due_in") is not None else None,
                         t.get("awaits_signal"))
                for t in item["tasks"]
            )
            specs.append(WorkflowSpec(f"{prefix}-{n:06d}", str(item["workflow_type"]), tasks))
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"workload file {path}: instance #{n} is malformed ({exc!r})") from None
    return specs


def run_demo(settings: Settings, options: DemoOptions, progress: Progress | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    specs = (load_workload_file(options.workload_file, prefix) if options.workload_file
             else demo_workload(options.instances, options.tasks_per_instance, seed=options.seed, prefix=prefix))
    for spec in specs:  # validate before touching the database
        from bridge.workload import validate_dag

        validate_dag(spec.instance_id, {t.key: t.depends_on for t in spec.tasks})

    observer = create_engine(settings.database_url)
    poller_engine = create_engine(settings.database_url)
    worker_engine = create_engine(settings.database_url)
    counter = StatementCounter()
    try:
        check_connection(observer)
        install.init(observer, demo_schema=is_default_mapping(settings.mapping), mapping=settings.mapping,
                     capture=settings.capture)
        tables = reflect_tables(observer, settings.mapping)
        with observer.begin() as conn:
            total = seed(conn, tables, specs)
        instance_ids = [s.instance_id for s in specs]

        counter.attach(poller_engine)
        registry = CollectorRegistry()
        poller = LegacyPoller(poller_engine, tables, batch_size=settings.poller.batch_size, registry=registry)
        workers = WorkerPool(worker_engine, tables, settings.workers, registry=registry, seed=options.seed)
        runner = PollerRunner(poller, options.poll_interval)
        signaller = _Signaller(observer, tables, instance_ids)
        workers.start()
        runner.start()
        signaller.start()
        deadline = time.monotonic() + options.timeout
        try:
            while True:
                settled = _settled(observer, tables, instance_ids)
                if progress:
                    progress(settled, total)
                if settled >= total or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            signaller.stop()
            runner.stop()
            workers.stop()
        with observer.connect() as conn:
            verdict = verify(conn, tables, instance_ids)
        return _summary(settings, options, verdict, poller, counter, time.perf_counter() - started,
                        timed_out=time.monotonic() > deadline)
    finally:
        for engine in (observer, poller_engine, worker_engine):
            engine.dispose()


class _Signaller:
    """Stands in for the people and systems that answer awaited signals in the demo."""

    def __init__(self, engine: sa.Engine, tables: TaskTable, instance_ids: list[str], delay: float = 0.3):
        self.engine, self.tables, self.instance_ids, self.delay = engine, tables, instance_ids, delay
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pollbridge-demo-signaller", daemon=True)

    def _loop(self) -> None:
        tt = self.tables
        if not tt.has("awaits_signal"):
            return
        now = db_now(tt.dialect_name)
        stmt = tt.tasks.update().where(
            tt.col("instance_id").in_(sa.bindparam("ids", expanding=True)),
            tt.col("awaits_signal").is_not(None),
            tt.col("signal_received_at").is_(None),
        ).values({tt.mapping.columns.signal_received_at or "": now})
        while not self._stop.wait(self.delay):
            for start in range(0, len(self.instance_ids), 500):
                with self.engine.begin() as conn:
                    conn.execute(stmt, {"ids": self.instance_ids[start:start + 500]})

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _settled(engine: sa.Engine, tt: TaskTable, instance_ids: list[str]) -> int:
    """Tasks finished for good. Cheap count while anything is moving; a full verify only when idle."""
    st = tt.statuses
    counts: dict[str, int] = {}
    with read_only(engine).connect() as conn:  # polling must not take SQLite's write lock
        for start in range(0, len(instance_ids), 500):
            q = (sa.select(tt.col("status"), sa.func.count())
                 .where(tt.col("instance_id").in_(instance_ids[start:start + 500]))
                 .group_by(tt.col("status")))
            for status, n in conn.execute(q):
                counts[status] = counts.get(status, 0) + n
        if counts.get(st.failed, 0) == 0 and counts.get(st.pending, 0) + counts.get(st.dispatched, 0) \
                + counts.get(st.running, 0) > 0:
            return counts.get(st.completed, 0)
        verdict = verify(conn, tt, instance_ids)
    return verdict.completed + verdict.failed + verdict.blocked


def _summary(settings: Settings, options: DemoOptions, verdict: Verdict, poller: LegacyPoller,
             counter: StatementCounter, elapsed: float, *, timed_out: bool) -> dict[str, Any]:
    m = poller.metrics
    scans = int(m.value("pollbridge_poller_scans_total"))
    empty = int(m.value("pollbridge_poller_empty_scans_total"))
    poller_dispatches = int(m.value("pollbridge_poller_dispatches_total", {"path": "poller"}))
    paths = {}
    for path, values in sorted(verdict.latencies_ms.items()):
        paths[path] = {
            "dispatches": len(values),
            "p50_ms": _round(percentile(values, 50)),
            "p90_ms": _round(percentile(values, 90)),
            "p99_ms": _round(percentile(values, 99)),
            "max_ms": _round(max(values) if values else None),
        }
    return {
        "database": mask_url(settings.database_url),
        "bus": settings.bus_url,
        "instances": options.instances if not options.workload_file else None,
        "tasks": verdict.tasks,
        "dispatches": verdict.dispatches,
        "completed": verdict.completed,
        "failed": verdict.failed,
        "blocked": verdict.blocked,
        "lost": verdict.lost,
        "double_dispatched": verdict.double_dispatched,
        "early": verdict.early,
        "timed_out": timed_out,
        "paths": paths,
        "poller": {
            "interval_s": options.poll_interval,
            "scans": scans,
            "empty_scans": empty,
            "empty_scan_ratio": round(empty / scans, 3) if scans else None,
            "rows_examined": int(m.value("pollbridge_poller_rows_examined_total")),
            "statements": counter.count,
            "statements_per_dispatch": round(counter.count / poller_dispatches, 2) if poller_dispatches else None,
        },
        "problems": list(verdict.problems[:20]),
        "elapsed_s": round(elapsed, 2),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def passed(summary: dict[str, Any]) -> bool:
    return (summary["lost"] == 0 and summary["double_dispatched"] == 0 and summary["early"] == 0
            and not summary["timed_out"])
