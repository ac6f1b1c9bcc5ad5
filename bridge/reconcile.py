"""The reconciler's core: what each path did for every task that became ready in a window.

Set-based SQL, never a Python loop over tasks. Every dispatch (``pollbridge_dispatch_log``, paths
``poller``, ``events``, ``fallback``) and every shadow decision (``pollbridge_decisions``) in the window
is grouped by (task, attempt) and classified:

``duplicate``  more than one dispatch of the same attempt (a safety violation);
``early``      an action before the task's readiness, re-derived from the task table (its
               dependencies' completion times, its awaited signal, and for the current attempt its
               due time), not from what the dispatcher recorded (a safety violation);
``matched``    the event path acted (dispatch or shadow decision) within the latency objective;
``late``       the event path acted, past the objective;
``missing``    the event path was responsible but did not act: the poller's fallback or safety
               sweep dispatched it, or the poller dispatched it while the type was in ``dual_write``
               and no decision was recorded; also a task ready longer than the tolerance that no path
               dispatched, in a phase where the event path is responsible;
``extra``      a shadow decision for an attempt no path dispatched within the tolerance (it acted on
               a task that, for the poller, never became ready);
``pending``    not decided yet: inside the tolerance at the window's end (expected noise, named);
``poller``     dispatched by the poller while it was authoritative (``polling``, or an instance
               outside a ``selective`` percentage): not an event-path comparison.

``compared`` = matched + late + missing + early + duplicate + extra: the tasks that are evidence about
the event path, the denominator of the miss rate. :func:`miss_rate_upper` is the exact
(Clopper-Pearson) one-sided upper confidence bound of that rate, so 0 misses in 30 tasks is not
mistaken for a 0% miss rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.db import db_ago, millis_between, read_only
from bridge.readiness import greatest, latest_dependency_completion, ready_predicate, ready_since
from bridge.schema import decisions, dispatch_log, flag_audit, flags
from bridge.tasktable import TaskTable

KINDS = ("matched", "missing", "extra", "duplicate", "early", "late", "pending", "poller")
COMPARED = ("matched", "late", "missing", "early", "duplicate", "extra")


@dataclass(frozen=True)
class TypeCounts:
    workflow_type: str
    counts: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> int:
        return self.counts.get(kind, 0)

    @property
    def compared(self) -> int:
        return sum(self[k] for k in COMPARED)

    @property
    def tasks(self) -> int:
        return sum(self.counts.values())


def miss_rate_upper(misses: int, n: int, confidence: float = 0.95) -> float:
    """Exact one-sided upper confidence bound (Clopper-Pearson) of a rate seen as ``misses`` in ``n``.

    With no misses it is ``1 - (1 - confidence) ** (1 / n)``: 0 in 30 gives 9.5%, and a 0.1% budget
    needs about 3,000 clean tasks at 95%."""
    if n <= 0 or misses >= n:
        return 1.0
    alpha = 1.0 - confidence
    if misses == 0:
        return 1.0 - float(alpha ** (1.0 / n))
    lo, hi = misses / n, 1.0
    for _ in range(80):  # P(X <= misses; n, p) falls as p grows: bisect for the p where it equals alpha
        mid = (lo + hi) / 2
        if _binom_cdf(misses, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def _binom_cdf(k: int, n: int, p: float) -> float:
    if p <= 0:
        return 1.0
    if p >= 1:
        return 0.0 if k < n else 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    terms = [base - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q for i in range(k + 1)]
    top = max(terms)
    return math.exp(top) * math.fsum(math.exp(t - top) for t in terms)


@dataclass(frozen=True)
class PhaseSpan:
    workflow_type: str
    phase: str
    since: datetime | None  # None: from the beginning
    until: datetime | None  # None: still in force


def phase_spans(engine: Engine, types: Sequence[str] | None = None) -> list[PhaseSpan]:
    """The phase of each type over time, from the audit trail (a type with no change: ``polling``)."""
    q = sa.select(flag_audit.c.workflow_type, flag_audit.c.old_phase, flag_audit.c.new_phase,
                  flag_audit.c.changed_at).order_by(flag_audit.c.workflow_type, flag_audit.c.id)
    if types:
        q = q.where(flag_audit.c.workflow_type.in_(list(types)))
    with read_only(engine).connect() as conn:
        rows = conn.execute(q).all()
    spans: list[PhaseSpan] = []
    by_type: dict[str, list[Any]] = {}
    for r in rows:
        by_type.setdefault(r.workflow_type, []).append(r)
    for name, changes in by_type.items():
        start: datetime | None = None
        phase = changes[0].old_phase
        for change in changes:
            at = _utc(change.changed_at)
            spans.append(PhaseSpan(name, phase, start, at))
            start, phase = at, change.new_phase
        spans.append(PhaseSpan(name, phase, start, None))
    return spans


def _utc(value: Any) -> datetime | None:
    if value is None:
        return None
    parsed: datetime = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def _bind_time(engine: Engine, value: datetime) -> Any:
    """A timestamp as the dialect stores it (SQLite keeps db_now() text: naive UTC, millisecond text)."""
    value = value.astimezone(UTC)
    if engine.dialect.name == "sqlite":
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return value


def _phase_at(engine: Engine, spans: Sequence[PhaseSpan], type_col: Any, at_col: Any) -> sa.ColumnElement[Any]:
    """SQL: the phase of ``type_col`` at time ``at_col`` (a CASE over the audit trail's spans)."""
    whens: list[tuple[sa.ColumnElement[bool], str]] = []
    for span in spans:
        cond = [type_col == span.workflow_type]
        if span.since is not None:
            cond.append(at_col >= _bind_time(engine, span.since))
        if span.until is not None:
            cond.append(at_col < _bind_time(engine, span.until))
        whens.append((sa.and_(*cond), span.phase))
    if not whens:
        return sa.literal("polling")
    return sa.case(*whens, else_=sa.literal("polling"))


def _window_rows(engine: Engine, tt: TaskTable, since: datetime, until: datetime,
                 types: Sequence[str] | None) -> sa.Subquery:
    """One row per (task, attempt) acted on in the window, with the first time of each action."""
    lo, hi = _bind_time(engine, since), _bind_time(engine, until)
    dl, dc = dispatch_log, decisions
    log_q = sa.select(dl.c.task_id, dl.c.attempt, dl.c.workflow_type, dl.c.path.label("kind"), dl.c.ready_at,
                      dl.c.dispatched_at.label("at")).where(dl.c.dispatched_at >= lo, dl.c.dispatched_at < hi)
    dec_q = sa.select(dc.c.task_id, dc.c.attempt, dc.c.workflow_type, sa.literal("decision").label("kind"),
                      dc.c.ready_at, dc.c.decided_at.label("at")).where(dc.c.decided_at >= lo, dc.c.decided_at < hi)
    if types:
        log_q = log_q.where(dl.c.workflow_type.in_(list(types)))
        dec_q = dec_q.where(dc.c.workflow_type.in_(list(types)))
    actions = sa.union_all(log_q, dec_q).subquery("pb_actions")
    a = actions.c

    def first(kind: str) -> sa.ColumnElement[Any]:
        return sa.func.min(sa.case((a.kind == kind, a.at)))

    return (
        sa.select(
            a.task_id, a.attempt, sa.func.max(a.workflow_type).label("workflow_type"),
            first("poller").label("poller_at"), first("events").label("events_at"),
            first("fallback").label("fallback_at"), first("decision").label("decision_at"),
            sa.func.sum(sa.case((a.kind != "decision", 1), else_=0)).label("dispatches"),
            sa.func.min(a.at).label("first_at"), sa.func.min(a.ready_at).label("ready_at"),
        )
        .group_by(a.task_id, a.attempt)
        .subquery("pb_per_task")
    )


def _facts_ready(tt: TaskTable, t: sa.FromClause, attempt: Any) -> sa.ColumnElement[Any]:
    """Readiness re-derived from the task row's facts (not from what a dispatcher recorded)."""
    parts: list[sa.ColumnElement[Any]] = [latest_dependency_completion(tt, t)]
    if tt.has("signal_received_at"):
        parts.append(tt.col("signal_received_at", t))
    if tt.has("due_at"):
        # A retry moves the due time: it is a fact about the current attempt only.
        current = (tt.col("attempts", t) + 1 == attempt) if tt.has("attempts") else sa.true()
        parts.append(sa.case((current, tt.col("due_at", t))))
    return greatest(tt.dialect_name, parts)


def classify_sql(engine: Engine, tt: TaskTable, since: datetime, until: datetime, *,
                 types: Sequence[str] | None = None, objective: float = 1.0, tolerance: float = 10.0,
                 spans: Sequence[PhaseSpan] | None = None) -> sa.Select[Any]:
    """One row per (task, attempt) acted on in the window: its kind, path, latencies and facts."""
    d = tt.dialect_name
    per = _window_rows(engine, tt, since, until, types)
    t = tt.tasks.alias("pb_task")
    spans = list(spans) if spans is not None else phase_spans(engine, types)
    facts_ready = _facts_ready(tt, t, per.c.attempt)
    event_at = sa.func.coalesce(per.c.events_at, per.c.decision_at)
    phase_then = _phase_at(engine, spans, per.c.workflow_type, per.c.first_at)
    # ``late`` is judged on the recorded readiness (both paths record the same readiness SQL).
    event_ms = millis_between(d, per.c.ready_at, event_at)
    tolerance_ago = _tolerance_before(engine, until, tolerance)
    kind = sa.case(
        (per.c.dispatches > 1, "duplicate"),
        (sa.and_(facts_ready.is_not(None), per.c.first_at < facts_ready), "early"),
        (sa.and_(event_at.is_not(None), per.c.ready_at.is_not(None), event_ms > objective * 1000.0), "late"),
        (per.c.events_at.is_not(None), "matched"),
        (sa.and_(per.c.decision_at.is_not(None), per.c.dispatches > 0), "matched"),
        (per.c.decision_at.is_not(None), sa.case((per.c.decision_at >= tolerance_ago, "pending"), else_="extra")),
        (per.c.fallback_at.is_not(None), "missing"),
        (phase_then == "dual_write", "missing"),
        else_="poller",
    )
    path = sa.case(
        (per.c.events_at.is_not(None), "events"), (per.c.fallback_at.is_not(None), "fallback"),
        (per.c.poller_at.is_not(None), "poller"), else_="decision",
    )
    action_at = sa.func.coalesce(per.c.events_at, per.c.fallback_at, per.c.poller_at, per.c.decision_at)
    return (
        sa.select(
            per.c.task_id, per.c.attempt, per.c.workflow_type, kind.label("kind"), path.label("path"),
            millis_between(d, per.c.ready_at, action_at).label("latency_ms"),
            millis_between(d, per.c.ready_at, per.c.poller_at).label("poller_ms"),
            event_ms.label("events_ms"),
            phase_then.label("phase"), per.c.ready_at, action_at.label("action_at"), facts_ready.label("facts_ready"),
        )
        .select_from(per.outerjoin(t, sa.cast(tt.col("id", t), sa.String) == per.c.task_id))
    )


def _tolerance_before(engine: Engine, until: datetime, tolerance: float) -> Any:
    return _bind_time(engine, until - timedelta(seconds=tolerance))


def unacted_sql(tt: TaskTable, types: Sequence[str] | None, tolerance: float) -> sa.Select[Any]:
    """Tasks ready now that no path dispatched: ``missing`` past the tolerance, else ``pending``."""
    t = tt.tasks
    src, workflow_type = tt.workflow_type_source(t)
    since = ready_since(tt, t)
    kind = sa.case((sa.and_(since.is_not(None), since < db_ago(tt.dialect_name, tolerance)), "missing"),
                   else_="pending")
    q = (sa.select(sa.cast(tt.col("id"), sa.String).label("task_id"), workflow_type.label("workflow_type"),
                   kind.label("kind"), since.label("ready_at"))
         .select_from(src).where(ready_predicate(tt, t)))
    if types:
        q = q.where(workflow_type.in_(list(types)))
    return q


def count_by_type(engine: Engine, tt: TaskTable, since: datetime, until: datetime, *,
                  types: Sequence[str] | None = None, objective: float = 1.0,
                  tolerance: float = 10.0) -> dict[str, TypeCounts]:
    """Per workflow type, how many tasks of each kind (see the module docstring) in the window.

    Tasks ready now and not dispatched by anyone count only for types whose phase today makes the
    event path responsible (anything but ``polling``)."""
    inner = classify_sql(engine, tt, since, until, types=types, objective=objective, tolerance=tolerance).subquery()
    grouped = sa.select(inner.c.workflow_type, inner.c.kind, sa.func.count()).group_by(
        inner.c.workflow_type, inner.c.kind)
    out: dict[str, dict[str, int]] = {}
    with read_only(engine).connect() as conn:
        for workflow_type, kind, n in conn.execute(grouped):
            out.setdefault(workflow_type or "", {})[kind] = int(n)
        phases = dict(conn.execute(sa.select(flags.c.workflow_type, flags.c.phase)).all())
        unacted = unacted_sql(tt, types, tolerance).subquery()
        for workflow_type, kind, n in conn.execute(
                sa.select(unacted.c.workflow_type, unacted.c.kind, sa.func.count())
                .group_by(unacted.c.workflow_type, unacted.c.kind)):
            if phases.get(workflow_type, "polling") == "polling":
                continue
            bucket = out.setdefault(workflow_type or "", {})
            bucket[kind] = bucket.get(kind, 0) + int(n)
    return {name: TypeCounts(name, counts) for name, counts in sorted(out.items())}
