"""``pollbridge demo``: the whole migration on one workload, with the invariants checked.

It builds instances of three workflow types (chain, fan-out/fan-in and stacked-diamond DAGs, some
tasks with due times, some awaiting a signal) under a fresh ``demo-<run>`` prefix, starts every
component in this process (:class:`bridge.app.runall.Stack`: relay, event scheduler, poller, guardian, demo
workers) and walks the types through ``polling``, ``dual_write`` (and prints the reconciler's
report), ``selective`` at 50%, ``cutover`` and a rollback, each promotion through its gate (with
thresholds sized to the demo; a refusal is recorded, then forced and audited as such). Each stage
runs a fresh slice of the workload to completion and is measured: ready→dispatch latency per path,
database statements per dispatch and per idle second of each path, misses, lost, double and early
dispatches (verified independently by :mod:`bridge.reference.oracle`). Only this run's instances are reported.
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

from bridge.app import install
from bridge.core.errors import WorkloadError
from bridge.core.settings import GateSettings, Settings
from bridge.core.urls import mask_url
from bridge.db.engine import StatementCounter, check_connection, db_now, read_only
from bridge.reference.oracle import Verdict, percentile, verify
from bridge.reference.schema import is_default_mapping
from bridge.reference.workload import TaskSpec, WorkflowSpec, demo_workload, seed
from bridge.tasktable.tables import TaskTable, reflect_tables
from legacy_poller.poller import LegacyPoller

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


STAGES: tuple[tuple[str, str, float | None], ...] = (
    ("polling", "polling", None),
    ("dual_write", "dual_write", None),
    ("selective", "selective", 50.0),
    ("cutover", "cutover", None),
    ("rollback", "polling", None),
)
IDLE_SETTLE = 1.0   # the relay polls hot for a moment after its last row before it waits for a notification
IDLE_SECONDS = 2.0


def _split(specs: list[WorkflowSpec], parts: int) -> list[list[WorkflowSpec]]:
    size, extra = divmod(len(specs), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(specs[at:at + n])
        at += n
    return out


def demo_gates(tasks_per_stage: int) -> GateSettings:
    """Gate thresholds sized to the demo's handful of tasks (production defaults: 1,000 tasks, 0.1%)."""
    return GateSettings(min_tasks=max(5, tasks_per_stage // 4), miss_budget=0.5, tolerance=5.0)


def run_demo(settings: Settings, options: DemoOptions, progress: Progress | None = None,
             stage_started: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole migration on one workload: polling, dual_write (with the reconciler's report), selective 50%,
    cutover and a rollback, a fresh slice of the workload in each, every component in this process."""
    from bridge.app.components import Components
    from bridge.app.runall import Stack, StackOptions
    from bridge.reconcile.report import build_report
    from bridge.rollout.promotion import rollback

    started = time.perf_counter()
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    specs = (load_workload_file(options.workload_file, prefix) if options.workload_file
             else demo_workload(options.instances, options.tasks_per_instance, seed=options.seed, prefix=prefix))
    for spec in specs:  # validate before touching the database
        from bridge.reference.workload import validate_dag

        validate_dag(spec.instance_id, {t.key: t.depends_on for t in spec.tasks})
    stages = _split(specs, len(STAGES))
    types = sorted({spec.workflow_type for spec in specs})

    components = Components(settings)
    observer = components.engine()
    try:
        check_connection(observer)
        install.init(observer, demo_schema=is_default_mapping(settings.mapping), mapping=settings.mapping,
                     capture=settings.capture)
        tables = reflect_tables(observer, settings.mapping)
        store = components.flag_store(observer)
        rollback(store, types, reason="demo: start from polling", actor="demo")
        stack = Stack(settings, StackOptions(poll_interval=options.poll_interval, demo_workers=True,
                                             count_statements=True, worker_seed=options.seed))
        stack.start()
        assert stack.router is not None
        signaller = _Signaller(observer, tables, [s.instance_id for s in specs])
        signaller.start()
        phases: list[dict[str, Any]] = []
        deadline = time.monotonic() + options.timeout
        timed_out = False
        try:
            for (label, phase, percent), stage in zip(STAGES, stages, strict=True):
                if stage_started:
                    stage_started(label)
                stage_tasks = sum(len(s.tasks) for s in stage)
                gate = None
                if label == "rollback":
                    rollback(store, types, reason="demo: rehearse the way back", actor="demo")
                elif phase != "polling":
                    gate = _promote(observer, tables, store, settings, types, phase, percent,
                                    demo_gates(stage_tasks))
                stack.router.refresh()  # every component of this process sees the new phase at once
                before = stack.statements()
                stage_start = time.perf_counter()
                ids = [s.instance_id for s in stage]
                with observer.begin() as conn:
                    total = seed(conn, tables, stage)
                while True:
                    settled = _settled(observer, tables, ids)
                    if progress:
                        progress(settled, total)
                    if settled >= total:
                        break
                    if time.monotonic() > deadline:
                        timed_out = True
                        break
                    time.sleep(0.1)
                busy = time.perf_counter() - stage_start
                after_work = stack.statements()
                time.sleep(IDLE_SETTLE)
                idle_start = stack.statements()
                time.sleep(IDLE_SECONDS)  # nothing to do: what does each path still ask the database?
                after_idle = stack.statements()
                with observer.connect() as conn:
                    verdict = verify(conn, tables, ids)
                stats = _stage_stats(label, phase, percent, stage, verdict, before, after_work, idle_start, after_idle,
                                     busy)
                stats["gate"] = gate
                if label == "dual_write":
                    stats["reconcile"] = _reconcile(observer, tables, types, demo_gates(stage_tasks), build_report)
                phases.append(stats)
                if timed_out:
                    break
        finally:
            signaller.stop()
            stack.stop()
        all_ids = [s.instance_id for s in specs]
        with observer.connect() as conn:
            verdict = verify(conn, tables, all_ids)
        summary = _summary(settings, options, verdict, stack.poller, stack.counters.get("poller"),
                           time.perf_counter() - started, timed_out=timed_out)
        summary["phases"] = phases
        summary["workflow_types"] = types
        return summary
    finally:
        observer.dispose()


def _promote(engine: sa.Engine, tables: TaskTable, store: Any, settings: Settings, types: list[str], phase: str,
             percent: float | None, gates: GateSettings) -> dict[str, Any]:
    """Promote every type one step through its gate; a refusal is recorded and then forced, audited as such."""
    from bridge.core.errors import GateRefused
    from bridge.rollout.promotion import set_phase

    results: dict[str, Any] = {}
    for name in types:
        try:
            outcome = set_phase(engine, tables, store, gates, name, phase, percent=percent, actor="demo",
                                reason=f"demo: {phase}")
            results[name] = {"passed": True, "forced": False,
                             "criteria": [c.to_json() for c in (outcome.gate.criteria if outcome.gate else ())]}
        except GateRefused as refused:
            outcome = set_phase(engine, tables, store, gates, name, phase, percent=percent, actor="demo",
                                reason=f"demo: {phase}, gate refused ({refused}); forced to go on", force=True)
            results[name] = {"passed": False, "forced": True,
                             "criteria": [c.to_json() for c in (outcome.gate.criteria if outcome.gate else ())]}
    return results


def _reconcile(engine: sa.Engine, tables: TaskTable, types: list[str], gates: GateSettings,
               build_report: Callable[..., Any]) -> dict[str, Any]:
    from datetime import timedelta

    from bridge.db.clock import db_clock

    now = db_clock(engine)
    report = build_report(engine, tables, now - timedelta(minutes=10), now + timedelta(seconds=1), types=types,
                          settings=gates)
    out = report.to_json()
    return {"verdict": out["verdict"], "types": out["types"], "mismatches": out["mismatches"][:20]}


def _group(statements: dict[str, int], path: str) -> int:
    names = ("poller",) if path == "poller" else ("relay", "scheduler", "router")
    return sum(statements.get(n, 0) for n in names)


def _stage_stats(label: str, phase: str, percent: float | None, stage: list[WorkflowSpec], verdict: Verdict,
                 before: dict[str, int], after_work: dict[str, int], idle_start: dict[str, int],
                 after_idle: dict[str, int], busy: float) -> dict[str, Any]:
    paths = {}
    for path, values in sorted(verdict.latencies_ms.items()):
        paths[path] = {"dispatches": len(values), "p50_ms": _round(percentile(values, 50)),
                       "p99_ms": _round(percentile(values, 99)), "max_ms": _round(max(values) if values else None)}
    per_dispatch: dict[str, float | None] = {}
    idle: dict[str, float] = {}
    for path in ("poller", "events"):
        work = _group(after_work, path) - _group(before, path)
        n = paths.get(path, {}).get("dispatches", 0)
        if path == "events" and phase == "dual_write":
            n = verdict.tasks  # the event path decided (shadow) for each task instead of dispatching
        per_dispatch[path] = round(work / n, 2) if n else None
        idle[path] = round((_group(after_idle, path) - _group(idle_start, path)) / IDLE_SECONDS, 1)
    by_component = {name: round((after_idle.get(name, 0) - idle_start.get(name, 0)) / IDLE_SECONDS, 1)
                     for name in sorted(after_idle) if name != "workers"}
    return {
        "phase": label, "flag": phase, "percent": percent, "instances": len(stage), "tasks": verdict.tasks,
        "idle_statements_per_s_by_component": by_component,
        "paths": paths, "statements_per_dispatch": per_dispatch, "idle_statements_per_s": idle,
        "misses": paths.get("fallback", {}).get("dispatches", 0), "lost": verdict.lost,
        "double_dispatched": verdict.double_dispatched, "early": verdict.early, "seconds": round(busy, 2),
    }


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
             counter: StatementCounter | None, elapsed: float, *, timed_out: bool) -> dict[str, Any]:
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
        "bus": mask_url(settings.bus_url),
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
            "statements": counter.count if counter else None,
            "statements_per_dispatch": round(counter.count / poller_dispatches, 2)
            if counter and poller_dispatches else None,
        },
        "problems": list(verdict.problems[:20]),
        "elapsed_s": round(elapsed, 2),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def passed(summary: dict[str, Any]) -> bool:
    return (summary["lost"] == 0 and summary["double_dispatched"] == 0 and summary["early"] == 0
            and not summary["timed_out"])
