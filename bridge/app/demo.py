"""``pollbridge demo``: the whole migration on one workload, with the invariants checked.

It builds instances of three workflow types (chain, fan-out/fan-in and stacked-diamond DAGs, some tasks
with due times; a workload file may also have tasks that await a signal) under a fresh ``demo-<run>``
prefix, starts every component in this process (:class:`bridge.app.runall.Stack`: relay, event
scheduler, poller, guardian, demo workers) and walks the types through ``polling``, ``dual_write`` (and
the reconciler's report), ``selective`` at 50%, ``cutover`` and a rollback. Each stage:

1. moves every type to the stage's phase, each promotion through its gate with the demo's own
   thresholds (:data:`DEMO_GATES`, printed beside the production defaults): a refusal is recorded with
   its reason, then forced and audited as forced;
2. waits until every component acts on the new phase: the flag router has re-read the flags and a
   poller scan that began after that has finished (a scan that read the flags before the change could
   otherwise still dispatch the stage's first tasks as the phase before);
3. measures what each path asks the database while there is nothing to do;
4. seeds a fresh slice of the workload and waits until it has settled. In ``selective`` exactly the
   percentage of each type's instances are canaries (by the frozen routing hash), so the default run
   gives every gate the evidence it asks for;
5. checks the invariants over the slice (nothing lost, dispatched twice or early:
   :mod:`bridge.reference.oracle`).

Every dispatch is attributed to the phase in force for its type when it committed (the dispatch log
against the flag audit trail, both on the database clock). Statements are counted per component and
classified by the tables they name (:class:`bridge.db.engine.StatementCounter`): the task table's, the
bus's (the embedded bus keeps its log in the same database; Redis's commands are no database statements
and are not counted) and the rest (pollbridge's outbox, dispatch log, flags and leases, and transaction
control). Only this run's instances are reported.
"""

from __future__ import annotations

import bisect
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bridge.app import install
from bridge.core.errors import WorkloadError
from bridge.core.phases import bucket, percent_threshold
from bridge.core.settings import GateSettings, Settings
from bridge.core.urls import bus_scheme, mask_url
from bridge.db import schema
from bridge.db.clock import as_utc
from bridge.db.engine import OTHER_STATEMENTS, StatementCounter, check_connection, db_now, read_only
from bridge.reference.oracle import Verdict, percentile, verify
from bridge.reference.schema import is_default_mapping
from bridge.reference.workload import TaskSpec, WorkflowSpec, demo_workload, seed, validate_dag
from bridge.tasktable.tables import TaskTable, reflect_tables
from legacy_poller.poller import LegacyPoller

Progress = Callable[[int, int], None]
Say = Callable[[str], None]


@dataclass(frozen=True)
class DemoOptions:
    instances: int = 150
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

#: The demo's gate thresholds, for its own run only (a type's flag thresholds are left alone). With
#: the default sizing every type brings 30 or more compared tasks to each gate: 0 misses in 25 put the
#: miss rate's 95% upper bound at 11.3%.
DEMO_GATES = GateSettings(min_tasks=25, miss_budget=0.15, tolerance=5.0)
PRODUCTION_GATES = GateSettings()

#: The components whose statements each path is charged with (the flag router's re-reads serve both
#: paths; they go to the event path, which would not need them without pollbridge either).
PATH_COMPONENTS = {"poller": ("poller",), "events": ("relay", "scheduler", "router")}
TASK_TABLE, BUS, POLLBRIDGE = "task_table", "bus", "pollbridge"
KINDS = ("total", TASK_TABLE, BUS, POLLBRIDGE, OTHER_STATEMENTS)
BUS_TABLES = (schema.bus_log, schema.bus_groups, schema.bus_pending, schema.bus_dead)

STAGE_TEXT = {
    "polling": "the legacy poller alone dispatches, as before pollbridge",
    "dual_write": "the event path shadows the poller, recording what it would dispatch",
    "selective": "the event path dispatches for {canary} canary instances, the poller for the others",
    "cutover": "the event path dispatches everything; the poller only sweeps for misses",
    "rollback": "back to polling in one ungated command; the poller dispatches again",
}


def statement_classes(tables: TaskTable) -> dict[str, list[str]]:
    """The tables behind each class of statement, in the order a statement is matched."""
    task_tables = [t.name for t in (tables.tasks, tables.instances, tables.edges) if t is not None]
    bus = [t.name for t in BUS_TABLES]
    own = sorted(t.name for t in schema.metadata.tables.values() if t.name not in bus)
    return {TASK_TABLE: task_tables, BUS: bus, POLLBRIDGE: [*own, "pollbridge_alembic_version"]}


def _sizes(total: int, parts: int) -> list[int]:
    size, extra = divmod(total, parts)
    return [size + (1 if i < extra else 0) for i in range(parts)]


def _split(specs: list[WorkflowSpec], parts: int) -> list[list[WorkflowSpec]]:
    out, at = [], 0
    for n in _sizes(len(specs), parts):
        out.append(specs[at:at + n])
        at += n
    return out


def is_canary(workflow_type: str, instance_id: str, percent: float) -> bool:
    """Whether ``selective`` at ``percent`` puts the instance on the event path (the frozen routing hash)."""
    return bucket(workflow_type, instance_id) < percent_threshold(percent)


def _with_canaries(count: int, tasks_per_instance: int, seed_: int, prefix: str, percent: float) -> list[WorkflowSpec]:
    """``count`` instances with the types' usual mix, exactly ``percent`` of each type's being canaries
    (rounded half up), picked from a longer generated run in order."""
    mix = Counter(s.workflow_type for s in demo_workload(count, tasks_per_instance, seed=seed_, prefix=prefix))
    quota: Counter[tuple[str, bool]] = Counter()
    for name, n in mix.items():
        canaries = int(n * percent / 100 + 0.5)
        quota[(name, True)], quota[(name, False)] = canaries, n - canaries
    picked: list[WorkflowSpec] = []
    for spec in demo_workload(count * 20 + 60, tasks_per_instance, seed=seed_, prefix=prefix):
        key = (spec.workflow_type, is_canary(spec.workflow_type, spec.instance_id, percent))
        if quota[key] > 0:
            quota[key] -= 1
            picked.append(spec)
            if len(picked) == count:
                break
    return picked


def stage_slices(options: DemoOptions, prefix: str) -> list[list[WorkflowSpec]]:
    """The instances each stage seeds: the workload file split evenly, or one generated slice per stage."""
    if options.workload_file:
        slices = _split(load_workload_file(options.workload_file, prefix), len(STAGES))
    else:
        slices = []
        for n, ((label, _phase, percent), count) in enumerate(zip(STAGES, _sizes(options.instances, len(STAGES)),
                                                                  strict=True)):
            stage_prefix = f"{prefix}-{label}"
            seed_ = options.seed + n
            slices.append(_with_canaries(count, options.tasks_per_instance, seed_, stage_prefix, percent)
                          if percent is not None else
                          demo_workload(count, options.tasks_per_instance, seed=seed_, prefix=stage_prefix))
    for stage in slices:  # validate before touching the database
        for spec in stage:
            validate_dag(spec.instance_id, {t.key: t.depends_on for t in spec.tasks})
    return slices


def stage_line(label: str, percent: float | None, stage: Sequence[WorkflowSpec], grace: float) -> str:
    """What a stage does, in one line (said as it starts)."""
    tasks = sum(len(s.tasks) for s in stage)
    canary = sum(1 for s in stage if percent is not None and is_canary(s.workflow_type, s.instance_id, percent))
    what = STAGE_TEXT[label].format(canary=canary, grace=grace)
    name = f"{label} {percent:g}%" if percent is not None else label
    return f"{name}: {what} ({len(stage)} instances, {tasks} tasks)…"


def run_demo(settings: Settings, options: DemoOptions, progress: Progress | None = None,
             stage_started: Callable[[str], None] | None = None, say: Say | None = None) -> dict[str, Any]:
    """The whole migration on one workload: polling, dual_write (with the reconciler's report), selective 50%,
    cutover and a rollback, a fresh slice of the workload in each, every component in this process.
    ``say`` is told what each stage does as it starts, and what its gate decided."""
    from bridge.app.components import Components
    from bridge.app.runall import Stack, StackOptions
    from bridge.reconcile.report import build_report
    from bridge.rollout.promotion import rollback

    started = time.perf_counter()
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    slices = stage_slices(options, prefix)
    specs = [spec for stage in slices for spec in stage]
    types = sorted({spec.workflow_type for spec in specs})
    tell: Say = say or (lambda _line: None)

    components = Components(settings)
    observer = components.engine()
    try:
        check_connection(observer)
        install.init(observer, demo_schema=is_default_mapping(settings.mapping), mapping=settings.mapping,
                     capture=settings.capture)
        tables = reflect_tables(observer, settings.mapping)
        store = components.flag_store(observer)
        stage_of_change = {c.id: "polling" for c in rollback(store, types, reason="demo: start from polling",
                                                             actor="demo")}
        first_change = min(stage_of_change, default=0)
        stack = Stack(settings, StackOptions(poll_interval=options.poll_interval, demo_workers=True,
                                             count_statements=True, worker_seed=options.seed))
        stack.start()
        classes = statement_classes(tables)
        for counter in stack.counters.values():
            counter.classify(classes)
        signaller = _Signaller(observer, tables, [s.instance_id for s in specs])
        signaller.start()
        measured: list[dict[str, Any]] = []
        deadline = time.monotonic() + options.timeout
        timed_out = False
        quiet_since = time.monotonic()
        try:
            for (label, phase, percent), stage in zip(STAGES, slices, strict=True):
                if stage_started:
                    stage_started(label)
                tell(stage_line(label, percent, stage, store.default_grace))
                gate = None
                if label == "rollback":
                    for change in rollback(store, types, reason="demo: rehearse the way back", actor="demo"):
                        stage_of_change[change.id] = label
                elif phase != "polling":
                    gate, written = _promote(observer, tables, store, types, phase, percent, DEMO_GATES)
                    stage_of_change.update(dict.fromkeys(written, label))
                    tell(f"  gate into {label}: {gate_text(gate)}")
                if not _await_phase(stack, types, phase, percent, deadline):
                    timed_out = True
                    tell(f"  timed out: the components did not all act on {label} within --timeout")
                    break
                time.sleep(max(0.0, quiet_since + IDLE_SETTLE - time.monotonic()))
                idle_start = _snapshot(stack)
                time.sleep(IDLE_SECONDS)  # nothing to do: what does each path still ask the database?
                before = idle_end = _snapshot(stack)
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
                after_work = _snapshot(stack)
                quiet_since = time.monotonic()
                with observer.connect() as conn:
                    verdict = verify(conn, tables, ids)
                    decisions = _count_decisions(conn, ids) if phase == "dual_write" else 0
                measured.append({
                    "label": label, "phase": phase, "percent": percent, "stage": stage, "verdict": verdict,
                    "gate": gate, "before": before, "after_work": after_work, "idle_start": idle_start,
                    "idle_end": idle_end, "busy": busy, "decisions": decisions,
                    "reconcile": _reconcile(observer, tables, types, DEMO_GATES, build_report)
                    if label == "dual_write" else None,
                })
                if timed_out:
                    tell(f"  timed out: {total - settled} of {total} tasks not settled within --timeout")
                    break
        finally:
            signaller.stop()
            stack.stop()
        all_ids = [s.instance_id for s in specs]
        with observer.connect() as conn:
            verdict = verify(conn, tables, all_ids)
            attributed = attribute_dispatches(conn, all_ids, stage_of_change, first_change)
        phases = [_stage_stats(m, attributed.get(m["label"], {})) for m in measured]
        summary = _summary(settings, options, verdict, stack.poller, stack.counters.get("poller"),
                           time.perf_counter() - started, timed_out=timed_out)
        summary["phases"] = phases
        summary["workflow_types"] = types
        summary["task_tables"] = classes[TASK_TABLE]
        summary["instances"] = len(specs)
        other = {label: {path: len(values) for path, values in paths.items()}
                 for label, paths in attributed.items() if label not in stage_of_change.values()}
        if other:
            summary["dispatches_in_other_phases"] = other
        summary["verdict"] = verdict_lines(summary)
        return summary
    finally:
        observer.dispose()


def _await_phase(stack: Any, types: Sequence[str], phase: str, percent: float | None, deadline: float) -> bool:
    """Wait until every component of this process acts on the phase just written; ``False`` past ``deadline``.

    The event path asks the router for each task, so a re-read is enough there. The poller takes its
    flags once per scan: the scan running now may have read them before the change (and still dispatch
    the next stage's first tasks under the old phase), the one after it cannot. A re-read that started
    before the change and ended after it can put the old flags back, so the router is asked again."""
    router, poller = stack.router, stack.poller
    assert router is not None
    want = (phase, percent if phase == "selective" else None)

    def scans() -> float:
        return float(poller.metrics.value("pollbridge_poller_scans_total"))

    while True:
        router.refresh()
        start = scans()
        while scans() < start + 2:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        views = (router.flags(), router.poller_flags())  # the event path's and the poller's
        if all(name in view and (view[name].phase, view[name].percent if view[name].phase == "selective" else None)
               == want for view in views for name in types):
            return True
        if time.monotonic() > deadline:
            return False


def _snapshot(stack: Any) -> dict[str, dict[str, int]]:
    counters: dict[str, StatementCounter] = stack.counters
    return {name: {"total": c.count, **c.by_class()} for name, c in counters.items()}


def _promote(engine: sa.Engine, tables: TaskTable, store: Any, types: list[str], phase: str, percent: float | None,
             gates: GateSettings) -> tuple[dict[str, Any], list[int]]:
    """Promote every type one step through its gate; a refusal is recorded with its reason and then forced,
    audited as such. Returns the gate of each type and the ids of the audit rows written."""
    from bridge.core.errors import GateRefused
    from bridge.reconcile.gate import GateResult
    from bridge.rollout.promotion import set_phase

    results: dict[str, Any] = {}
    written: list[int] = []
    for name in types:
        try:
            outcome = set_phase(engine, tables, store, gates, name, phase, percent=percent, actor="demo",
                                reason=f"demo: {phase}")
            result: dict[str, Any] = {"passed": True, "forced": False}
        except GateRefused as refused:
            failed = refused.gate.failed if isinstance(refused.gate, GateResult) else []
            why = "; ".join(f"{c.name}: {c.detail}" for c in failed) or str(refused)
            outcome = set_phase(engine, tables, store, gates, name, phase, percent=percent, actor="demo",
                                reason=f"demo: {phase}, gate refused ({why}); forced to go on", force=True)
            result = {"passed": False, "forced": True, "refused": why}
        evaluated = outcome.gate
        result["criteria"] = [c.to_json() for c in (evaluated.criteria if evaluated else ())]
        result["counts"] = dict(evaluated.counts) if evaluated else {}
        results[name] = result
        if outcome.change is not None:
            written.append(outcome.change.id)
    return results, written


def gate_text(gate: dict[str, Any] | None) -> str:
    """What a stage's gate decided and on what evidence, in a few words."""
    if not gate:
        return "none"
    refused = {name: g for name, g in gate.items() if not g["passed"]}
    if refused:
        return "refused, forced to go on (audited as forced): " + "; ".join(
            f"{name}: {g.get('refused', 'refused')}" for name, g in sorted(refused.items()))
    counts = [g.get("counts") or {} for g in gate.values()]
    if not any(counts):
        details = {c["detail"] for g in gate.values() for c in g["criteria"]}
        return "passed: " + "; ".join(sorted(details))
    compared = [c.get("compared", 0) for c in counts]
    missing = sum(c.get("missing", 0) for c in counts)
    spread = f"{min(compared)}" if min(compared) == max(compared) else f"{min(compared)} to {max(compared)}"
    return (f"passed: {sum(compared)} tasks compared ({spread} per type), {missing} missed, "
            f"{sum(c.get('early', 0) for c in counts)} early, {sum(c.get('duplicate', 0) for c in counts)} duplicate")


def _reconcile(engine: sa.Engine, tables: TaskTable, types: list[str], gates: GateSettings,
               build_report: Callable[..., Any]) -> dict[str, Any]:
    from datetime import timedelta

    from bridge.db.clock import db_clock

    now = db_clock(engine)
    report = build_report(engine, tables, now - timedelta(minutes=10), now + timedelta(seconds=1), types=types,
                          settings=gates)
    out = report.to_json()
    return {"verdict": out["verdict"], "types": out["types"], "mismatches": out["mismatches"][:20]}


def _count_decisions(conn: sa.Connection, instance_ids: list[str]) -> int:
    total = 0
    for start in range(0, len(instance_ids), 500):
        chunk = instance_ids[start:start + 500]
        total += int(conn.execute(sa.select(sa.func.count()).select_from(schema.decisions)
                                  .where(schema.decisions.c.instance_id.in_(chunk))).scalar_one())
    return total


def attribute_dispatches(conn: sa.Connection, instance_ids: Sequence[str], stage_of_change: dict[int, str],
                         first_change: int) -> dict[str, dict[str, list[float | None]]]:
    """Each dispatch of these instances under the phase in force for its type when it committed: the flag
    audit row before it on the database clock names the stage (``stage_of_change``: audit id -> stage);
    a change the demo did not make (the guardian's) is named by its action and phase. Returns stage ->
    path -> ready→dispatch latencies in ms (``None``: no ready time recorded)."""
    audit = schema.flag_audit
    changes: dict[str, list[tuple[datetime, str]]] = {}
    rows = conn.execute(sa.select(audit.c.id, audit.c.workflow_type, audit.c.action, audit.c.new_phase,
                                  audit.c.changed_at).where(audit.c.id >= first_change)
                        .order_by(audit.c.changed_at, audit.c.id)).all()
    for row in rows:
        at = as_utc(row.changed_at)
        assert at is not None
        label = stage_of_change.get(row.id, f"{row.new_phase} ({row.action})")
        changes.setdefault(row.workflow_type, []).append((at, label))
    starts = {name: [at for at, _label in spans] for name, spans in changes.items()}
    log = schema.dispatch_log
    out: dict[str, dict[str, list[float | None]]] = {}
    for start in range(0, len(instance_ids), 500):
        chunk = list(instance_ids[start:start + 500])
        for done in conn.execute(sa.select(log.c.workflow_type, log.c.path, log.c.ready_at, log.c.dispatched_at)
                                 .where(log.c.instance_id.in_(chunk))):
            at = as_utc(done.dispatched_at)
            assert at is not None
            spans = changes.get(done.workflow_type or "", [])
            index = bisect.bisect_right(starts.get(done.workflow_type or "", []), at) - 1
            label = spans[index][1] if index >= 0 else "before the demo's first change"
            ready = as_utc(done.ready_at)
            latency = (at - ready).total_seconds() * 1000.0 if ready is not None else None
            out.setdefault(label, {}).setdefault(done.path, []).append(latency)
    return out


def _delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]], path: str, kind: str) -> int:
    return sum(after.get(name, {}).get(kind, 0) - before.get(name, {}).get(kind, 0)
               for name in PATH_COMPONENTS[path])


def _path_stats(values: list[float | None], *, p90: bool = False) -> dict[str, Any]:
    timed = [v for v in values if v is not None]
    out: dict[str, Any] = {"dispatches": len(values), "p50_ms": _round(percentile(timed, 50))}
    if p90:
        out["p90_ms"] = _round(percentile(timed, 90))
    out["p99_ms"] = _round(percentile(timed, 99))
    out["max_ms"] = _round(max(timed) if timed else None)
    return out


def _stage_stats(m: dict[str, Any], attributed: dict[str, list[float | None]]) -> dict[str, Any]:
    verdict: Verdict = m["verdict"]
    stage: list[WorkflowSpec] = m["stage"]
    phase, percent = m["phase"], m["percent"]
    paths = {path: _path_stats(values, p90=True) for path, values in sorted(attributed.items())}
    per_dispatch: dict[str, float | None] = {}
    by_table: dict[str, dict[str, float] | None] = {}
    idle: dict[str, float] = {}
    idle_by_table: dict[str, dict[str, float]] = {}
    for path in PATH_COMPONENTS:
        n = paths.get(path, {}).get("dispatches", 0)
        if path == "events" and phase == "dual_write":
            n = m["decisions"]  # the event path recorded a shadow decision instead of dispatching
        work = {kind: _delta(m["after_work"], m["before"], path, kind) for kind in KINDS}
        per_dispatch[path] = round(work["total"] / n, 2) if n else None
        by_table[path] = {kind: round(work[kind] / n, 2) for kind in KINDS[1:]} if n else None
        quiet = {kind: _delta(m["idle_end"], m["idle_start"], path, kind) / IDLE_SECONDS for kind in KINDS}
        idle[path] = round(quiet["total"], 1)
        idle_by_table[path] = {kind: round(quiet[kind], 1) for kind in KINDS[1:]}
    by_component = {name: round((m["idle_end"][name]["total"] - m["idle_start"][name]["total"]) / IDLE_SECONDS, 1)
                    for name in sorted(m["idle_end"]) if name != "workers"}
    return {
        "phase": m["label"], "flag": phase, "percent": percent, "instances": len(stage),
        "canary_instances": sum(1 for s in stage if is_canary(s.workflow_type, s.instance_id, percent))
        if percent is not None else None,
        "tasks": verdict.tasks, "dispatches_by_path": {path: p["dispatches"] for path, p in paths.items()},
        "shadow_decisions": m["decisions"] if phase == "dual_write" else None,
        "idle_statements_per_s_by_component": by_component,
        "paths": paths, "statements_per_dispatch": per_dispatch, "statements_per_dispatch_by_table": by_table,
        "idle_statements_per_s": idle, "idle_statements_per_s_by_table": idle_by_table,
        "misses": paths.get("fallback", {}).get("dispatches", 0), "lost": verdict.lost,
        "double_dispatched": verdict.double_dispatched, "early": verdict.early, "seconds": round(m["busy"], 2),
        "gate": m["gate"], **({"reconcile": m["reconcile"]} if m["reconcile"] is not None else {}),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def _stage(summary: dict[str, Any], label: str) -> dict[str, Any] | None:
    return next((st for st in summary.get("phases", []) if st["phase"] == label), None)


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    """The demo's result in three lines: latency before and after, the invariants, what each gate proved."""
    polling, cutover = _stage(summary, "polling"), _stage(summary, "cutover")
    before = (polling or {}).get("paths", {}).get("poller", {})
    after = (cutover or {}).get("paths", {}).get("events", {})
    if before and after:
        speed = (f"ready→dispatch: p50 {_ms(before['p50_ms'])} with the legacy poller → {_ms(after['p50_ms'])} with "
                 f"the event path (p99 {_ms(before['p99_ms'])} → {_ms(after['p99_ms'])})")
    else:
        speed = "ready→dispatch: not measured on both paths (the run stopped early)"
    checked = f"{summary['tasks']} tasks and {summary['dispatches']} dispatches, checked independently in every phase"
    if summary.get("timed_out"):
        safe = f"TIMED OUT: {summary['lost']} task(s) not settled within --timeout; {checked}"
    elif summary["lost"] or summary["double_dispatched"] or summary["early"]:
        safe = (f"INVARIANT FAILED: {summary['lost']} lost, {summary['double_dispatched']} dispatched twice, "
                f"{summary['early']} early ({checked}; the problems are listed below)")
    else:
        safe = f"nothing lost, dispatched twice or early: {checked}"
    gated = [st for st in summary.get("phases", []) if st.get("gate")]
    proofs = " · ".join(f"{st['phase']} ({gate_proof(st)})" for st in gated) or "none reached"
    forced = any(not g["passed"] for st in gated for g in st["gate"].values())
    gates = ("gates: " if forced or not gated else "gates passed on evidence: ") + proofs
    return [speed, safe, gates]


EVIDENCE = {"selective": "shadow decisions", "cutover": "canary dispatches"}


def gate_proof(stage: dict[str, Any]) -> str:
    """What the gate into a stage proved, in a few words (or that it was forced, and on which criteria)."""
    gate: dict[str, Any] = stage.get("gate") or {}
    failed = sorted({c["name"] for g in gate.values() for c in g["criteria"] if not c["passed"]})
    if any(not g["passed"] for g in gate.values()):
        return f"FORCED: refused on {', '.join(failed) or 'its criteria'}"
    counts = [g.get("counts") or {} for g in gate.values()]
    if not any(counts):
        return "capture triggers" if any(c["name"] == "capture_installed" for g in gate.values()
                                                   for c in g["criteria"]) else "passed"
    compared = sum(c.get("compared", 0) for c in counts)
    missing = sum(c.get("missing", 0) for c in counts)
    return f"{compared} {EVIDENCE.get(stage['flag'], 'compared tasks')}, {missing} missed"


def gate_brief(stage: dict[str, Any]) -> str:
    """The gate into a stage in a table cell."""
    if stage["phase"] == "rollback":
        return "never gated"
    gate = stage.get("gate")
    if not gate:
        return "-"
    return "passed" if all(g["passed"] for g in gate.values()) else "FORCED"


def gate_settings() -> dict[str, Any]:
    keys = ("min_tasks", "miss_budget", "confidence", "objective", "tolerance", "window")
    return {"demo": {k: getattr(DEMO_GATES, k) for k in keys},
            "production_defaults": {k: getattr(PRODUCTION_GATES, k) for k in keys}}


def backend(settings: Settings) -> dict[str, Any]:
    """Where the figures come from: the database, and the bus (whose statements are counted apart)."""
    database = "postgresql" if settings.database_url.startswith(("postgres", "postgresql")) else "sqlite"
    bus = "embedded" if bus_scheme(settings.bus_url) == "embedded" else "redis"
    return {
        "database": database, "bus": bus,
        "bus_statements_counted": bus == "embedded",
        "description": (f"{'PostgreSQL' if database == 'postgresql' else 'SQLite'} ({mask_url(settings.database_url)})"
                        + (" and the embedded bus, whose log lives in the same database" if bus == "embedded" else
                           f" and Redis Streams ({mask_url(settings.bus_url)})")),
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
    task_table = counter.by_class().get(TASK_TABLE, 0) if counter else None
    return {
        "database": mask_url(settings.database_url),
        "bus": mask_url(settings.bus_url),
        "backend": backend(settings),
        "gate_settings": gate_settings(),
        "statement_classes": {TASK_TABLE: "the scheduler's tables (the task table, and its instances and edges "
                                          "tables when mapped)",
                              BUS: "the embedded bus's log, groups and pending entries (pollbridge_bus_*)",
                              POLLBRIDGE: "pollbridge's own tables: outbox, dispatch log, decisions, flags, leases",
                              OTHER_STATEMENTS: "transaction control (BEGIN) and statements naming no table"},
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
            "task_table_statements_per_dispatch": round(task_table / poller_dispatches, 2)
            if task_table is not None and poller_dispatches else None,
        },
        "problems": list(verdict.problems[:20]),
        "elapsed_s": round(elapsed, 2),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def passed(summary: dict[str, Any]) -> bool:
    return (summary["lost"] == 0 and summary["double_dispatched"] == 0 and summary["early"] == 0
            and not summary["timed_out"])
