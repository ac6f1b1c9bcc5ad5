"""The promotion gate's verdict on evidence: the criteria a type's reconciled counts must meet.

Shared by the reconcile report (its verdict per type) and by promotion (:mod:`bridge.rollout.promotion`),
which adds the capture check for ``dual_write`` and the window of the type's current phase.

A verdict is one of :data:`VERDICTS`: ``pass``, ``fail``, or ``no_evidence`` (never a pass) for a type with
no compared task, or with no dispatch observed in the window (in ``dual_write``: not one of the legacy
scheduler's, so shadow decisions had nothing to be matched with), unless a safety criterion failed.

Only matched evidence counts toward ``min_tasks``: attempts where the event path's action was matched with
a dispatch (its own dispatch, or the legacy scheduler's dispatch its shadow decision matched), whether
within the latency objective (``matched``) or past it (``late``: matched, and slow; only a paired attempt
is ever ``late``; ``held``: its own dispatch, past the objective after a legitimate backpressure hold).
``extra`` decisions, misses and unsafe actions are compared (the miss rate's denominator) but are no
evidence that the event path works, so "N compared, 0 matched" never passes, however low ``min_tasks`` is
set: at least one matched attempt is always needed.

:data:`FLOOR` is no judgement at all: the verdict of a control report (``reconcile --control``), which
measures the legacy poller (the noise floor) and is never judged by this gate; ``reconcile --gate
--control`` is refused.

:func:`unknown_types` is the one test of whether a name is a workflow type at all (a flag, or a task of
that type): every command that takes a type refuses one that is not, before it reads or writes anything
else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.capture.gaps import CaptureGap
from bridge.core.errors import FlagError
from bridge.core.phases import Flag
from bridge.core.settings import GateSettings
from bridge.db.engine import read_only
from bridge.flags.store import FlagStore
from bridge.reconcile.classify import miss_rate_upper
from bridge.tasktable.tables import TaskTable

PASS = "pass"
FAIL = "fail"
#: The verdict of a type with no compared task in the window: nothing to judge, so never a pass.
NO_EVIDENCE = "no_evidence"
VERDICTS = (PASS, FAIL, NO_EVIDENCE)
#: The verdict of a control report and of each of its types: the legacy poller measured, not judged.
FLOOR = "floor"


@dataclass(frozen=True)
class Criterion:
    name: str
    passed: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass(frozen=True)
class GateResult:
    workflow_type: str
    target: str
    criteria: tuple[Criterion, ...]
    counts: dict[str, int]
    since: datetime | None = None
    until: datetime | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.criteria)

    @property
    def failed(self) -> list[Criterion]:
        return [c for c in self.criteria if not c.passed]

    def to_json(self) -> dict[str, Any]:
        return {
            "workflow_type": self.workflow_type, "target": self.target, "passed": self.passed,
            "criteria": [c.to_json() for c in self.criteria], "counts": self.counts,
            "window": {"since": self.since.isoformat() if self.since else None,
                       "until": self.until.isoformat() if self.until else None},
        }


def threshold(flag: Flag, settings: GateSettings, name: str) -> float:
    return float(flag.thresholds.get(name, getattr(settings, name)))


def judge(counts: dict[str, int], compared: int, flag: Flag, settings: GateSettings, *,
          dispatched: int | None = None, gaps: Sequence[CaptureGap] = ()) -> tuple[Criterion, ...]:
    """The evidence criteria of a gate (and of a reconcile report's verdict) for one type's counts (kind ->
    attempts). ``dispatched``: how many compared attempts some path dispatched, when known (only said in
    the ``min_tasks`` detail; the criterion itself needs no more than the matched count). ``gaps``: the capture
    gaps of the window (:mod:`bridge.capture.gaps`): a window with one is incomplete evidence."""
    missing = counts.get("missing", 0)
    late = counts.get("late", 0)
    held = counts.get("held", 0)
    matched = counts.get("matched", 0) + late + held
    # At least one: a threshold below 1 must not let a type pass on zero matched attempts.
    min_tasks = max(1, int(threshold(flag, settings, "min_tasks")))
    budget = threshold(flag, settings, "miss_budget")
    upper = miss_rate_upper(missing, compared, settings.confidence)
    detail = f"{compared} compared task(s), need {min_tasks} matched: {matched} matched"
    notes = [f"{late} of them late"] if late else []
    if held:
        notes.append(f"{held} dispatched after a backpressure hold")
    if notes:
        detail += f" ({', '.join(notes)})"
    if dispatched == 0 and compared:
        detail += " (no dispatch observed in the window: nothing to match the shadow decisions with)"
    return (
        Criterion("min_tasks", matched >= min_tasks, detail),
        Criterion("no_early", counts.get("early", 0) == 0, f"{counts.get('early', 0)} early action(s)"),
        Criterion("no_duplicate", counts.get("duplicate", 0) == 0,
                  f"{counts.get('duplicate', 0)} duplicate dispatch(es)"),
        Criterion("miss_rate", upper < budget,
                  f"{missing} miss(es) in {compared}: upper {settings.confidence:.0%} bound {upper:.4%}, "
                  f"budget {budget:.4%}"),
        Criterion("no_capture_gap", not gaps, gap_detail(gaps)),
    )


def gap_detail(gaps: Sequence[CaptureGap]) -> str:
    """What a ``no_capture_gap`` criterion says."""
    if not gaps:
        return "no capture gap in the window"
    first = gaps[0]
    return (f"{len(gaps)} capture gap(s) in the window (the first at {first.detected_at:%Y-%m-%d %H:%M:%S} UTC, "
            f"{first.source}: {first.summary}): changes were lost and re-derived, so the "
            "window is incomplete evidence; judge a window that starts after the last gap")


#: The criteria whose failure is a ``fail`` even without a dispatch observed: an unsafe action is evidence.
SAFETY = ("no_early", "no_duplicate")


def verdict_of(criteria: Sequence[Criterion], compared: int, dispatched: int | None = None) -> str:
    """``no_evidence`` without a compared task, or (``dispatched`` known) without a dispatch observed unless
    a safety criterion failed; else ``pass`` when every criterion passed, else ``fail``."""
    if compared == 0:
        return NO_EVIDENCE
    if dispatched == 0 and all(c.passed for c in criteria if c.name in SAFETY):
        return NO_EVIDENCE
    return PASS if all(c.passed for c in criteria) else FAIL


def unknown_types(engine: Engine, tt: TaskTable, names: Iterable[str], store: FlagStore) -> list[str]:
    """The names in ``names`` that are no workflow type: no flag in ``store`` and no task of that type in the
    task table. Reads only (the flags, then one bounded look-up per remaining name)."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return []
    flagged = store.all()
    rest = [name for name in wanted if name not in flagged]
    if not rest:
        return []
    src, workflow_type = tt.workflow_type_source(tt.tasks)
    unknown = []
    with read_only(engine).connect() as conn:
        for name in rest:
            found = conn.execute(sa.select(workflow_type).select_from(src)
                                 .where(workflow_type == name).limit(1)).first()
            if found is None:
                unknown.append(name)
    return unknown


def unknown_type_message(name: str, table: str) -> str:
    """How every command refuses a name that is no workflow type (as ``preflight`` does)."""
    return f"unknown workflow type {name!r}: no flag and no task of that type in {table!r}; check the name"


def require_known_types(engine: Engine, tt: TaskTable, names: Iterable[str], store: FlagStore) -> None:
    """Raise :class:`FlagError` (exit 2) for the first of ``names`` that is no workflow type."""
    unknown = unknown_types(engine, tt, names, store)
    if unknown:
        raise FlagError(unknown_type_message(unknown[0], tt.mapping.table))
