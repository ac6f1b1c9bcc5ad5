"""The reconcile report: both paths side by side for a window, per workflow type, with a verdict.

:func:`build_report` runs the set-based classification of :mod:`bridge.reconcile.classify` (counts, latency
percentiles, a histogram for the chart, dispatches over time, the mismatches with their
explanation) and judges each type with the gate's criteria (:func:`bridge.reconcile.gate.judge`). A type
that spent the whole window in ``polling`` has no event path to judge: it gets no criteria. A type with no
compared task (in ``polling``, or idle) has the verdict ``no_evidence``, never ``pass``; the report's
verdict is ``fail`` when a type fails, else ``no_evidence`` when a type (or the whole report) has no
evidence, else ``pass``.

Beside each type's counts, the *floor*: the legacy path's own late and missing share over the window (what
``--control`` counts for it), next to the event path's (:class:`PathShare`), so a late share is read against
what the old path did on the same traffic. A control report (``control``) is that floor: every verdict in it
is ``floor`` (:data:`bridge.reconcile.gate.FLOOR`), never ``pass`` or ``fail``: the promotion gate does not
apply to the legacy poller.

The JSON form (:meth:`Report.to_json`) is a stable interface, documented in ``docs/reconcile.md``::

    {"window": {"since", "until"}, "verdict": "pass"|"fail"|"no_evidence"|"floor", "control": bool,
     "types": [{"workflow_type", "phase", "phases": [{"phase", "since", "until"}], "tasks", "compared",
                "matched", "missing", "extra", "duplicate", "early", "late", "held", "pending", "on_hold", "poller",
                "latency_ms": {"poller": {"p50","p90","p99","max","n"}, "events": {...}, "fallback": {...}},
                "floor": {"path", "judged", "late", "missing", "held", "late_share", "missing_share", "p50_ms"}|null,
                "event_path": {...the same...}|null,
                "miss_rate_upper_95", "verdict", "failed_criteria": [...], "criteria": [{"name","passed","detail"}]}],
     "mismatches": [{"task_id", "workflow_type", "kind", "detail"}],
     "flag_changes": [{"workflow_type", "action", "actor", "reason", "old_phase", "new_phase", "changed_at", ...}]}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import accumulate
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from bridge.capture.gaps import CaptureGap, gaps_between
from bridge.core.phases import Flag
from bridge.core.settings import GateSettings
from bridge.db.clock import as_utc
from bridge.db.engine import millis_between
from bridge.flags.store import FlagChange, FlagStore
from bridge.reconcile.classify import (
    COMPARED,
    CONTROL_COMPARED,
    KINDS,
    PhaseSpan,
    TypeCounts,
    add_unacted,
    bind_time,
    classified,
    current_phases,
    latency_by_type,
    miss_rate_upper,
    phase_spans,
    unacted_sql,
)
from bridge.reconcile.gate import FAIL, FLOOR, NO_EVIDENCE, PASS, Criterion, judge, verdict_of
from bridge.tasktable.tables import TaskTable

#: Upper edges (ms) of the latency histogram drawn in the HTML report (a CDF on a log scale).
HISTOGRAM_EDGES_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 300_000)
TIMELINE_BUCKETS = 60
MISMATCH_KINDS = ("missing", "extra", "duplicate", "early", "late")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PathShare:
    """One path's late and missing share of what it was judged on in the window: the legacy poller's (the
    floor, as ``--control`` judges it) or the event path's (its compared attempts)."""

    path: str  # "poller" (the legacy path) or "events"
    judged: int  # the legacy path: matched + late + missing + early + duplicate; the event path: compared
    late: int
    missing: int
    held: int = 0  # the event path only: dispatched past the objective after a legitimate backpressure hold
    p50_ms: float | None = None

    @property
    def late_share(self) -> float:
        return self.late / self.judged if self.judged else 0.0

    @property
    def missing_share(self) -> float:
        return self.missing / self.judged if self.judged else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "judged": self.judged, "late": self.late, "missing": self.missing,
                "held": self.held, "late_share": round(self.late_share, 6),
                "missing_share": round(self.missing_share, 6), "p50_ms": self.p50_ms}


def path_share(path: str, counts: dict[str, int], latency: dict[str, dict[str, float | int]]) -> PathShare | None:
    """``path``'s figures from its own classification's counts (None: nothing of it judged in the window)."""
    judged = sum(counts.get(k, 0) for k in (CONTROL_COMPARED if path == "poller" else COMPARED))
    if not judged:
        return None
    p50 = latency.get(path, {}).get("p50")
    return PathShare(path, judged, counts.get("late", 0), counts.get("missing", 0),
                     counts.get("held", 0) if path == "events" else 0, None if p50 is None else float(p50))


@dataclass(frozen=True)
class TypeReport:
    workflow_type: str
    phase: str
    phases: tuple[PhaseSpan, ...]
    counts: dict[str, int]
    latency_ms: dict[str, dict[str, float | int]]
    criteria: tuple[Criterion, ...]
    miss_rate_upper: float
    histogram: dict[str, list[int]] = field(default_factory=dict)  # path -> cumulative counts per edge
    timeline: dict[str, list[int]] = field(default_factory=dict)  # path -> dispatches per time bucket
    #: Compared attempts some path dispatched (None: not counted, as in a report built by hand).
    dispatched: int | None = None
    #: A control report's type: the legacy poller judged, never by the promotion gate.
    control: bool = False
    #: The legacy path's late and missing share (the noise floor), and the event path's, over the window.
    floor: PathShare | None = None
    event_path: PathShare | None = None

    @property
    def compared(self) -> int:
        """The counts' compared attempts: the event path's (:data:`COMPARED`), or in a control report the
        legacy poller's (:data:`CONTROL_COMPARED`)."""
        return sum(self.counts.get(k, 0) for k in (CONTROL_COMPARED if self.control else COMPARED))

    @property
    def verdict(self) -> str:
        """``pass``, ``fail`` or ``no_evidence`` (no compared task, or no dispatch observed):
        :func:`bridge.reconcile.gate.verdict_of`; ``floor`` in a control report (never judged)."""
        if self.control:
            return FLOOR
        return verdict_of(self.criteria, self.compared, self.dispatched)

    @property
    def no_evidence_reason(self) -> str:
        """Why the verdict is ``no_evidence`` (one phrase)."""
        if self.compared == 0:
            return "no compared task in the window"
        return (f"no dispatch observed in the window ({self.compared} compared, none dispatched: in dual_write, "
                "no dispatch of the legacy scheduler to match the shadow decisions with)")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workflow_type": self.workflow_type, "phase": self.phase,
                               "phases": [_span_json(s) for s in self.phases],
                               "tasks": sum(self.counts.values()), "compared": self.compared}
        for kind in KINDS:
            out[kind] = self.counts.get(kind, 0)
        out["latency_ms"] = self.latency_ms
        out["floor"] = self.floor.to_json() if self.floor else None
        out["event_path"] = self.event_path.to_json() if self.event_path else None
        out["miss_rate_upper_95"] = round(self.miss_rate_upper, 6)
        out["verdict"] = self.verdict
        out["failed_criteria"] = [c.name for c in self.criteria if not c.passed]
        out["criteria"] = [c.to_json() for c in self.criteria]
        return out


@dataclass(frozen=True)
class Mismatch:
    task_id: str
    workflow_type: str
    kind: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "workflow_type": self.workflow_type, "kind": self.kind, "detail": self.detail}


@dataclass(frozen=True)
class Report:
    since: datetime
    until: datetime
    types: tuple[TypeReport, ...]
    mismatches: tuple[Mismatch, ...]
    flag_changes: tuple[FlagChange, ...]
    control: bool = False
    mismatches_truncated: bool = False
    #: Changes the capture lost in the window and re-derived (bridge.capture.gaps): incomplete evidence.
    capture_gaps: tuple[CaptureGap, ...] = ()

    @property
    def verdict(self) -> str:
        """``fail`` if a type fails, else ``no_evidence`` if a type has none (or there is no type), else ``pass``;
        ``floor`` for a control report, whatever it found: the legacy poller is measured, not judged."""
        if self.control:
            return FLOOR
        verdicts = {t.verdict for t in self.types}
        if FAIL in verdicts:
            return FAIL
        if not verdicts or NO_EVIDENCE in verdicts:
            return NO_EVIDENCE
        return PASS

    def to_json(self) -> dict[str, Any]:
        return {
            "window": {"since": self.since.isoformat(), "until": self.until.isoformat()},
            "verdict": self.verdict,
            "control": self.control,
            "types": [t.to_json() for t in self.types],
            "mismatches": [m.to_json() for m in self.mismatches],
            "mismatches_truncated": self.mismatches_truncated,
            "flag_changes": [c.to_json() for c in self.flag_changes],
            "capture_gaps": [g.to_json() for g in self.capture_gaps],
        }


def _span_json(span: PhaseSpan) -> dict[str, Any]:
    return {"phase": span.phase, "since": span.since.isoformat() if span.since else None,
            "until": span.until.isoformat() if span.until else None}


def _spans_in(spans: Sequence[PhaseSpan], name: str, since: datetime, until: datetime) -> tuple[PhaseSpan, ...]:
    mine = [s for s in spans if s.workflow_type == name]
    if not mine:
        return (PhaseSpan(name, "polling", None, None),)
    return tuple(s for s in mine if (s.until is None or s.until > since) and (s.since is None or s.since < until))


def build_report(engine: Engine, tt: TaskTable, since: datetime, until: datetime, *,
                 types: Sequence[str] | None = None, settings: GateSettings | None = None,
                 control: bool = False, now: datetime | None = None, mismatch_limit: int = 1000,
                 progress: Progress | None = None) -> Report:
    """Classify every task acted on in ``[since, until)``; see the module docstring."""
    settings = settings or GateSettings()
    step = progress or (lambda _what: None)
    store = FlagStore(engine)
    stored = store.all()
    spans = phase_spans(engine, types)
    ends_now = now is None or until >= now
    step("classifying")
    with classified(engine, tt, since, until, types=types, objective=settings.objective,
                    tolerance=settings.tolerance, spans=spans, control=control) as (conn, kinds):
        step("counts, histograms and timelines")
        grid = _grid(conn, engine, tt, kinds, since, until, control)
        if ends_now:  # tasks nobody dispatched: never a dispatch observed
            add_unacted(conn, tt, grid.event_counts, types=types, tolerance=settings.tolerance, control=False,
                        acted=kinds, floor=grid.floor_counts)
        mode_counts = grid.floor_counts if control else grid.event_counts
        counts = {name: TypeCounts(name, n, grid.dispatched.get(name, 0)) for name, n in sorted(mode_counts.items())}
        histograms, timelines = grid.histograms, grid.timelines
        step("latency percentiles")
        latency = latency_by_type(conn, kinds)
        step("mismatches")
        mismatches, truncated = _mismatches(conn, tt, kinds, types, settings, ends_now, control, mismatch_limit)
        gaps = tuple(gaps_between(conn, since, until))
    names = sorted(set(counts) | ({*types} if types else set()))
    reports = []
    for name in names:
        flag = stored.get(name) or Flag(name)
        raw = dict(counts[name].counts) if name in counts else {}
        dispatched = counts[name].dispatched if name in counts else 0
        compared = sum(raw.get(k, 0) for k in (CONTROL_COMPARED if control else COMPARED))
        phases = _spans_in(spans, name, since, until)
        # The legacy poller (control) is never judged by the promotion gate: its report is a floor.
        judged = not control and any(s.phase != "polling" for s in phases)
        criteria = judge(raw, compared, flag, settings, dispatched=dispatched, gaps=gaps) if judged else ()
        lat = latency.get(name, {})
        reports.append(TypeReport(name, phases[-1].phase if phases else flag.phase, phases, raw,
                                  lat, criteria,
                                  miss_rate_upper(raw.get("missing", 0), compared, settings.confidence),
                                  histograms.get(name, {}), timelines.get(name, {}), dispatched, control,
                                  path_share("poller", grid.floor_counts.get(name, {}), lat),
                                  path_share("events", grid.event_counts.get(name, {}), lat)))
    changes = tuple(c for c in store.history(limit=100_000)
                    if (not types or c.workflow_type in types) and since <= (as_utc(c.changed_at) or since) < until)
    return Report(since, until, tuple(reports), tuple(mismatches), changes, control, truncated, gaps)


@dataclass
class _Grid:
    """What one scan of the classification gives: counts per kind, latency histograms, actions over time."""

    event_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # type -> event-path kind -> n
    floor_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # type -> control kind -> n
    histograms: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # type -> path -> cumulative
    timelines: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # type -> path -> per bucket
    #: type -> compared attempts (of the report's mode) some path dispatched
    dispatched: dict[str, int] = field(default_factory=dict)


def _latency_bucket(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """The index of the first edge of :data:`HISTOGRAM_EDGES_MS` at or above ``column`` (past the last
    edge: their count; NULL stays NULL). A CASE rather than ``width_bucket``: the same on both dialects,
    and an edge's own value counts at that edge, as a cumulative histogram needs."""
    whens = [(column <= edge, i) for i, edge in enumerate(HISTOGRAM_EDGES_MS)]
    return sa.case((column.is_(None), sa.null()), *whens, else_=len(HISTOGRAM_EDGES_MS))


def _grid(conn: Connection, engine: Engine, tt: TaskTable, kinds: sa.FromClause, since: datetime,
          until: datetime, control: bool = False) -> _Grid:
    """Counts, histograms and timelines in one scan of the classification: grouped by type, both kinds (the
    event path's and the control's, for the floor beside it), path, time bucket and each path's latency
    bucket (a few thousand groups at most), then added up here.

    Three scans (one per result) took 1.5 s at a million tasks; this one takes about a third of that."""
    c = kinds.c
    # Multiply before dividing: offset / (window / 60) put an action exactly on an edge one bucket early
    # (1146 / 38.2 = 29.999999999999996); offset * 60 / window is exact on every edge (checked against
    # exact arithmetic over 32 million offset/window pairs). Buckets are at least 1 ms wide.
    window_ms = max((until - since) / timedelta(milliseconds=1), float(TIMELINE_BUCKETS))
    offset = millis_between(tt.dialect_name, sa.literal(bind_time(engine, since)), c.action_at)
    # PostgreSQL's cast to integer rounds, SQLite's truncates: floor first, so a bucket is [start, end).
    position = offset * TIMELINE_BUCKETS / window_ms
    bucket = sa.cast(sa.func.floor(position) if tt.dialect_name == "postgresql" else position, sa.Integer)
    keys = [c.workflow_type, c.event_kind, c.control_kind, c.path, bucket,
            _latency_bucket(c.poller_ms), _latency_bucket(c.events_ms), _latency_bucket(c.fallback_ms)]
    labelled = [k.label(f"k{i}") for i, k in enumerate(keys)]
    inner = sa.select(*labelled, sa.case((c.dispatches > 0, 1), else_=0).label("pb_dispatched")).subquery("pb_grid")
    keyed = [inner.c[f"k{i}"] for i in range(len(keys))]
    # Summed, not a grouping key: every attempt with a dispatch has a dispatch path, so grouping by it would
    # only split the groups the path already splits.
    q = sa.select(*keyed, sa.func.count(), sa.func.sum(inner.c.pb_dispatched)).group_by(*keyed)
    grid = _Grid()
    width = len(HISTOGRAM_EDGES_MS) + 1
    for name, event_kind, control_kind, path, b, *buckets, n, with_dispatch in conn.execute(q):
        name = name or ""
        n = int(n)
        for table, k in ((grid.event_counts, event_kind), (grid.floor_counts, control_kind)):
            per_type = table.setdefault(name, {})
            per_type[k] = per_type.get(k, 0) + n
        kind = control_kind if control else event_kind
        if kind in (CONTROL_COMPARED if control else COMPARED):
            grid.dispatched[name] = grid.dispatched.get(name, 0) + int(with_dispatch or 0)
        series = grid.timelines.setdefault(name, {}).setdefault(path, [0] * TIMELINE_BUCKETS)
        series[min(max(int(b or 0), 0), TIMELINE_BUCKETS - 1)] += n
        for hist_path, edge_index in zip(("poller", "events", "fallback"), buckets, strict=True):
            if edge_index is not None:
                grid.histograms.setdefault(name, {}).setdefault(hist_path, [0] * width)[int(edge_index)] += n
    for per_path in grid.histograms.values():
        for path, counts in per_path.items():
            per_path[path] = list(accumulate(counts))  # at each edge, then the total
    return grid


def _ms(value: Any) -> str:
    return "?" if value is None else f"{float(value):.0f} ms"


def duration_text(ms: float) -> str:
    """A latency as a person reads it: ``850 ms``, ``1 s``, ``9.7 s``, ``125 s``."""
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms >= 100_000:
        return f"{ms / 1000:.0f} s"
    return f"{ms / 1000:.1f}".removesuffix(".0") + " s"


def _explain(row: Any, objective_ms: float, control: bool = False) -> str:
    kind = row.kind
    if control:
        return _explain_control(row, objective_ms)
    if kind == "duplicate":
        return f"attempt {row.attempt} dispatched {row.dispatches} times (first by {row.path})"
    if kind == "early":
        return (f"acted ({row.path}) {_ms(-(row.after_facts_ms or 0))} before its readiness: a dependency, its "
                "due time or its signal came later")
    if kind == "late":
        return f"the event path acted {_ms(row.events_ms)} after readiness (objective {objective_ms:.0f} ms)"
    if kind == "extra":
        return "the event path decided to dispatch this attempt, but no path dispatched it within the tolerance"
    if row.path == "fallback":
        return (f"the poller's fallback dispatched it {_ms(row.fallback_ms)} after readiness: the event path "
                "did not act within the grace period")
    if row.path == "poller" and row.owned_phase is not None:
        # An outage miss: the event path owned the task and the poller took it only after a demotion.
        return (f"the event path owned it ({row.owned_phase} at readiness) and did not dispatch it; the poller "
                f"dispatched it {_ms(row.poller_ms)} after readiness, once the type was back in {row.phase}")
    if row.path == "poller" and row.poller_ms is None:
        # A foreign scheduler's dispatch, captured from the task table: no ready time was recorded.
        return (f"the legacy scheduler dispatched attempt {row.attempt} (captured from the task table, no ready "
                f"time recorded) while the type was in {row.phase}; the event path recorded no shadow decision")
    return (f"the poller dispatched it {_ms(row.poller_ms)} after readiness while the type was in {row.phase}; "
            "the event path recorded no shadow decision")


def _explain_control(row: Any, objective_ms: float) -> str:
    """A control mismatch names the path it judges, the legacy poller, with the latency it had."""
    objective = duration_text(objective_ms)
    if row.kind == "duplicate":
        return f"the poller dispatched attempt {row.attempt}, which was dispatched {row.dispatches} times"
    if row.kind == "early":
        return (f"the poller dispatched it {duration_text(-(row.after_facts_ms or 0))} before its readiness: a "
                "dependency, its due time or its signal came later")
    if row.poller_ms is None:  # a foreign scheduler's dispatch records no ready time (never late, then)
        return f"the poller dispatched attempt {row.attempt} (no ready time recorded) while the type was in {row.phase}"
    return (f"the poller dispatched it {duration_text(row.poller_ms)} after readiness (objective {objective}) "
            f"while the type was in {row.phase}")


def _mismatches(conn: Connection, tt: TaskTable, kinds: sa.FromClause, types: Sequence[str] | None,
                settings: GateSettings, ends_now: bool, control: bool, limit: int) -> tuple[list[Mismatch], bool]:
    c = kinds.c
    q = (sa.select(*c).where(c.kind.in_(MISMATCH_KINDS))
         .order_by(c.kind, c.action_at).limit(limit + 1))
    out: list[Mismatch] = []
    for row in conn.execute(q):
        out.append(Mismatch(str(row.task_id), row.workflow_type or "", row.kind,
                            _explain(row, settings.objective * 1000.0, control)))
    if ends_now and len(out) <= limit:
        phases = current_phases(conn)
        unacted = unacted_sql(tt, types, settings.tolerance, kinds).subquery()
        for row in conn.execute(sa.select(unacted).where(unacted.c.kind == "missing").limit(limit + 1 - len(out))):
            phase = phases.get(row.workflow_type, "polling")
            if phase == "polling" and not control:
                continue
            waited = float(row.waiting_ms or 0)
            detail = (f"ready for {duration_text(waited)} and the poller has not dispatched it (nor any path; "
                      f"phase {phase})" if control
                      else f"ready for {_ms(row.waiting_ms)} and dispatched by no path (phase {phase})")
            out.append(Mismatch(str(row.task_id), row.workflow_type or "", "missing", detail))
    return out[:limit], len(out) > limit


def parse_when(text: str, now: datetime) -> datetime:
    """``30m``, ``2h``, ``1d``, ``90s`` (ago), or an ISO 8601 time (UTC unless it says otherwise)."""
    from datetime import timedelta

    from bridge.core.errors import ConfigError

    raw = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if raw and raw[-1] in units:
        try:
            amount = float(raw[:-1])
        except ValueError:
            amount = -1
        if amount >= 0:
            return now - timedelta(seconds=amount * units[raw[-1]])
    try:
        parsed = datetime.fromisoformat(raw)
    except ValueError:
        raise ConfigError(f"invalid time {text!r}: give a duration like 30m, 2h, 1d or an ISO time like "
                          "2026-11-29T14:00:00") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
