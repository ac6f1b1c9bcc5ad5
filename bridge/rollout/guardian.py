"""The guardian: demotes a workflow type to ``polling`` when the event path is failing it.

Every ``guardian.interval`` seconds :meth:`Guardian.check_once` measures three criteria:

* **outbox_age**: the age, by the database clock, of the oldest unpublished outbox row
  (``published_at IS NULL``). Past ``max_outbox_age`` the capture/relay path is stuck: no event
  reaches the scheduler, so every *guarded* type is demoted. With capture from the write-ahead log the
  outbox holds only published rows, so the figure is also how long the capture's replication slot has
  been without a reader, or missing (as this guardian saw it, checking every ``interval``): the larger
  of the two.
* **lag**: the consumer lag of the scheduler's group (``scheduler.group``), summed over the bus
  partitions. Past ``max_lag`` the scheduler is not keeping up (or not running): every guarded type
  is demoted. The bus is optional: when there is none, or it cannot be reached, this criterion is
  reported as ``unknown`` and skipped (a log line says so when that starts and when it ends); the
  other two criteria still run.
* **miss_rate**, per guarded type: dispatch-log rows with path ``fallback`` divided by rows with path
  ``events`` or ``fallback``, over the last ``window`` seconds, counting only dispatches since the
  type entered its current phase (evidence gathered before an operator re-promoted a type must not
  demote it again at once). Judged only once at least ``min_tasks`` such dispatches exist; past
  ``max_miss_rate`` that type is demoted. Backpressure is not failure: a ready task the event scheduler
  holds back by its type's rate or in-flight limit (a legitimate hold, :mod:`bridge.tasktable.holds`) is
  never taken by the fallback, so it adds no miss; the finding reports how many are held, as waiting by design.

Thresholds are ``[guardian]`` settings; a flag's ``thresholds`` may override ``max_outbox_age``,
``max_lag`` and ``max_miss_rate`` for its type. "Past" means strictly above.

**Guarded types** are those whose phase lets the event path dispatch: ``selective`` and ``cutover``.
``dual_write`` is left alone on purpose: there the poller is authoritative and the event path only
records shadow decisions, so a stuck relay or a lagging scheduler costs nothing but evidence, and
demoting would only throw away the dual-write history the reconciler is gathering. ``polling`` has
nothing to demote.

**Demotion** is :func:`bridge.rollout.promotion.rollback` to ``polling`` with actor ``guardian`` and action
``guardian``, its reason naming each tripped criterion with the measured figure and the threshold,
plus a WARNING log line. Demoting to ``polling`` makes the poller authoritative again, so a type is
never left without a dispatcher; it is the one direction the guardian ever moves a type.

**No flapping.** The guardian never promotes. A type it demoted is in ``polling``, which it does
not guard, so later checks leave it (and its audit trail) alone; only an operator brings it back,
through the promotion gates. Should an operator re-promote it, the guardian guards it again, and
the miss rate then counts only dispatches since that re-promotion (see above). Right before it
demotes a type the guardian reads the flag again and skips a type someone else already moved out of
the guarded phases.

**Failures.** :meth:`Guardian.check_once` raises when the database cannot be read (after counting
the error); :meth:`Guardian.run` logs and counts every failed check and carries on, so an outage
never ends the loop.

Metrics, on the injected registry: ``pollbridge_guardian_demotions_total{workflow_type,reason}``
(``reason``: the first tripped criterion, in the order outbox_age, lag, miss_rate; one increment per
demotion), gauges ``pollbridge_guardian_outbox_age_seconds``, ``pollbridge_guardian_lag`` (NaN while
unknown) and ``pollbridge_guardian_miss_rate{workflow_type}``, counters
``pollbridge_guardian_checks_total`` (every check) and ``pollbridge_guardian_errors_total`` (checks
that failed).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from bridge.bus.base import EventBus
from bridge.capture.gaps import CaptureGap, gaps_after, gaps_between, last_gap_id
from bridge.capture.outbox import read_backlog
from bridge.capture.wal import publication_exists, slot_state
from bridge.core.errors import PollbridgeError, first_line
from bridge.core.phases import Flag, Phase
from bridge.core.settings import GuardianSettings, SchedulerSettings
from bridge.db.clock import as_utc, bind_time
from bridge.db.engine import db_ago, read_only
from bridge.db.schema import dispatch_log, holds
from bridge.flags.store import FlagChange, FlagStore, describe
from bridge.rollout.promotion import rollback
from bridge.tasktable.holds import HOLD_SLACK

log = logging.getLogger(__name__)

ACTOR = "guardian"
#: Phases in which the event path dispatches (see the module docstring for why not ``dual_write``).
GUARDED: tuple[Phase, ...] = ("selective", "cutover")
CRITERIA = ("outbox_age", "lag", "miss_rate")

State = Literal["ok", "exceeded", "unknown", "not_judged"]
Action = Literal["none", "demoted", "would_demote", "skipped"]


class GuardianError(PollbridgeError):
    """A check could not be completed (the database could not be read or written). Exit 1."""


@dataclass(frozen=True)
class Finding:
    """One criterion measured for one type."""

    criterion: str
    state: State
    value: float | None
    threshold: float
    detail: str

    @property
    def exceeded(self) -> bool:
        return self.state == "exceeded"

    def to_json(self) -> dict[str, Any]:
        return {"criterion": self.criterion, "state": self.state, "value": self.value,
                "threshold": self.threshold, "detail": self.detail}


@dataclass(frozen=True)
class MissCount:
    events: int
    fallback: int
    since: datetime
    #: Ready tasks of the type under a legitimate backpressure hold now: waiting by design, not failing.
    held: int = 0

    @property
    def total(self) -> int:
        return self.events + self.fallback

    @property
    def rate(self) -> float:
        return self.fallback / self.total if self.total else 0.0


@dataclass
class TypeVerdict:
    workflow_type: str
    phase: str
    findings: tuple[Finding, ...]
    action: Action = "none"
    reason: str | None = None
    change: FlagChange | None = None

    @property
    def tripped(self) -> list[Finding]:
        return [f for f in self.findings if f.exceeded]

    def to_json(self) -> dict[str, Any]:
        return {"workflow_type": self.workflow_type, "phase": self.phase, "action": self.action,
                "reason": self.reason, "criteria": [f.to_json() for f in self.findings],
                "change": self.change.to_json() if self.change is not None else None}


@dataclass
class CheckReport:
    """What one check measured and did."""

    checked_at: datetime
    unpublished: int
    outbox_age: float
    lag: int | None
    lag_partitions: dict[int, int] | None
    lag_detail: str
    group: str
    settings: GuardianSettings
    verdicts: list[TypeVerdict] = field(default_factory=list)
    unguarded: dict[str, str] = field(default_factory=dict)  # type -> phase
    dry_run: bool = False
    #: Capture gaps recorded since the previous check (the first check: over the last ``window``).
    capture_gaps: tuple[CaptureGap, ...] = ()

    @property
    def demoted(self) -> list[str]:
        return [v.workflow_type for v in self.verdicts if v.action == "demoted"]

    @property
    def would_demote(self) -> list[str]:
        return [v.workflow_type for v in self.verdicts if v.action == "would_demote"]

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "checked_at": self.checked_at.isoformat(),
            "dry_run": self.dry_run,
            "outbox": {"unpublished": self.unpublished, "oldest_age_seconds": round(self.outbox_age, 3),
                       "max_outbox_age": s.max_outbox_age},
            "lag": {"group": self.group, "state": "unknown" if self.lag is None else "known", "entries": self.lag,
                    "partitions": ({str(p): n for p, n in sorted(self.lag_partitions.items())}
                                   if self.lag_partitions is not None else None),
                    "max_lag": s.max_lag, "detail": self.lag_detail},
            "miss_rate": {"window_seconds": s.window, "min_tasks": s.min_tasks, "max_miss_rate": s.max_miss_rate},
            "types": [v.to_json() for v in self.verdicts],
            "unguarded": [{"workflow_type": name, "phase": phase} for name, phase in sorted(self.unguarded.items())],
            "would_demote": self.would_demote,
            "demoted": self.demoted,
            "capture_gaps": [g.to_json() for g in self.capture_gaps],
        }


class Guardian:
    """Watches the event path and demotes failing types to ``polling`` (see the module docstring).

    ``bus`` is optional (``None``: the lag criterion is unknown). ``bus_label`` names the bus in log
    lines and reports (a masked URL; without a bus, why there is none). Drive it from one thread."""

    def __init__(self, engine: Engine, settings: GuardianSettings, *, bus: EventBus | None = None,
                 group: str = SchedulerSettings().group, store: FlagStore | None = None,
                 registry: CollectorRegistry | None = None, bus_label: str | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.bus = bus
        self.group = group
        self.store = store if store is not None else FlagStore(engine)
        self.bus_label = bus_label or (repr(bus) if bus is not None else "no bus configured")
        self._reader = read_only(engine)
        self._dialect = engine.dialect.name
        self._lag_known: bool | None = None  # None: not checked yet
        self._slot_down_since: float | None = None  # monotonic: first check that saw the WAL slot unread
        self._slot_age = 0.0
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._demotions = Counter("pollbridge_guardian_demotions", "Workflow types the guardian demoted to polling, "
                                  "by the first criterion that tripped", ["workflow_type", "reason"], registry=r)
        self._outbox_age = Gauge("pollbridge_guardian_outbox_age_seconds",
                                 "Age of the oldest unpublished outbox row (database clock) at the last check",
                                 registry=r)
        self._lag = Gauge("pollbridge_guardian_lag", "Bus entries not yet delivered to the scheduler's group, summed "
                          "over partitions, at the last check (NaN while unknown)", registry=r)
        self._miss_rate = Gauge("pollbridge_guardian_miss_rate", "Fallback dispatches / (events + fallback) over "
                                "the window, per guarded workflow type", ["workflow_type"], registry=r)
        self._checks = Counter("pollbridge_guardian_checks", "Guardian checks run", registry=r)
        self._errors = Counter("pollbridge_guardian_errors", "Guardian checks that failed", registry=r)
        self._miss_labels: set[str] = set()
        self._gaps = Counter("pollbridge_guardian_capture_gaps", "Capture gaps (changes lost and re-derived from the "
                             "table) the guardian found recorded", registry=r)
        self._last_gap: int | None = None  # the newest capture gap reported (None: not looked yet)

    # --- measuring -----------------------------------------------------------------------------------
    def outbox_age(self) -> tuple[int, float, datetime]:
        """``(unpublished rows, age in seconds of the oldest, database now)``; age 0 without a backlog.

        Both timestamps come from the database, so a host clock that drifts cannot trip the criterion."""
        with self._reader.connect() as conn:
            backlog = read_backlog(conn)
        return backlog.unpublished, backlog.oldest_age, backlog.now

    def lag(self) -> tuple[dict[int, int] | None, str]:
        """Per-partition lag of the scheduler's group, or ``None`` with why it is unknown."""
        if self.bus is None:
            return None, f"lag not checked: {self.bus_label}"
        try:
            per_partition = self.bus.lag(self.group)
        except Exception as exc:  # any bus failure (unreachable, timeout, auth) only makes lag unknown
            return None, f"{self.bus_label} unreachable: {first_line(exc)}"
        return per_partition, f"{sum(per_partition.values())} entries not yet delivered to group {self.group}"

    def miss_count(self, flag: Flag, now: datetime) -> MissCount:
        """Events and fallback dispatches of ``flag``'s type over the window, since its current phase began."""
        since = now - timedelta(seconds=self.settings.window)
        began = as_utc(flag.updated_at)
        if began is not None and began > since:
            since = began  # evidence of the current phase only: no re-demotion on stale misses
        dl = dispatch_log.c
        q = (sa.select(dl.path, sa.func.count())
             .where(dl.workflow_type == flag.workflow_type, dl.path.in_(("events", "fallback")),
                    dl.dispatched_at >= self._bind_time(since))
             .group_by(dl.path))
        h = holds.c
        held_q = (sa.select(sa.func.count()).where(h.workflow_type == flag.workflow_type, h.released_at.is_(None),
                                                   h.until > db_ago(self._dialect, HOLD_SLACK)))
        with self._reader.connect() as conn:
            counts = {str(path): int(n) for path, n in conn.execute(q)}
            held = int(conn.execute(held_q).scalar() or 0)
        return MissCount(counts.get("events", 0), counts.get("fallback", 0), since, held)

    def _bind_time(self, value: datetime) -> Any:
        return bind_time(self._dialect, value)

    # --- one check -----------------------------------------------------------------------------------
    def check_once(self, *, act: bool = True) -> CheckReport:
        """Measure every criterion and demote the types that tripped one (``act=False``: only report).

        Raises :class:`GuardianError` (or :class:`~bridge.core.errors.FlagStoreUnavailable`) when the
        database cannot be read or a demotion cannot be written; the error is counted first."""
        self._checks.inc()
        try:
            return self._check(act)
        except SQLAlchemyError as exc:
            self._errors.inc()
            raise GuardianError(f"guardian check failed: {first_line(exc)}") from exc
        except Exception:
            self._errors.inc()
            raise

    def _check(self, act: bool) -> CheckReport:
        s = self.settings
        flags = self.store.all()
        unpublished, age, now = self.outbox_age()
        slot_down = self._slot_down()
        self._slot_age = slot_down
        age = max(age, slot_down)
        self._outbox_age.set(age)
        partitions, lag_detail = self.lag()
        lag = sum(partitions.values()) if partitions is not None else None
        self._lag.set(math.nan if lag is None else lag)
        self._note_lag_state(lag is not None, lag_detail)
        report = CheckReport(now, unpublished, age, lag, partitions, lag_detail, self.group, s, dry_run=not act,
                             capture_gaps=self._new_gaps(now))

        guarded = {name: f for name, f in sorted(flags.items()) if f.phase in GUARDED}
        report.unguarded = {name: f.phase for name, f in sorted(flags.items()) if f.phase not in GUARDED}
        for name in self._miss_labels - set(guarded):  # types that left the guarded phases: no stale gauge
            self._miss_rate.remove(name)
        self._miss_labels &= set(guarded)

        for name, flag in guarded.items():
            findings = (self._judge_outbox(flag, age, unpublished), self._judge_lag(flag, lag, lag_detail),
                        self._judge_miss_rate(flag, now))
            report.verdicts.append(TypeVerdict(name, flag.phase, findings))

        failures: list[str] = []
        for verdict in report.verdicts:
            tripped = verdict.tripped
            if not tripped:
                continue
            verdict.reason = "; ".join(f.detail for f in tripped)  # the audit row's actor says who
            if not act:
                verdict.action = "would_demote"
                continue
            try:
                self._demote(verdict, tripped)
            except Exception as exc:  # try the other types: one failed write must not shield them
                log.error("guardian could not demote %s: %s", verdict.workflow_type, first_line(exc))
                failures.append(f"{verdict.workflow_type}: {first_line(exc)}")
        if failures:
            raise GuardianError("guardian could not demote " + "; ".join(failures))
        return report

    def _new_gaps(self, now: datetime) -> tuple[CaptureGap, ...]:
        """Capture gaps recorded since the last check (the first: those of the last ``window``), each logged.
        Reported, not demoted for: the capture re-derived and published every unfinished task, and the poller's
        sweep covers what the event path still misses (see bridge.capture.gaps); the gates refuse the window."""
        with self._reader.connect() as conn:
            if self._last_gap is None:
                gaps = gaps_between(conn, now - timedelta(seconds=self.settings.window), now)
                # Older gaps than the window are not reported; newer ones than the last are, next time.
                self._last_gap = max((g.id for g in gaps), default=None) or last_gap_id(conn)
            else:
                gaps = gaps_after(conn, self._last_gap)
        if gaps:
            self._last_gap = max(g.id for g in gaps)
        for gap in gaps:
            self._gaps.inc()
            log.warning("capture gap at %s (%s): %s; promotion gates refuse windows that hold it",
                        gap.detected_at.isoformat(), gap.source, gap.detail)
        return tuple(gaps)

    def _slot_down(self) -> float:
        """Seconds the write-ahead-log capture's slot has been without a reader or missing, as seen by this
        guardian's checks (0 when it is streamed, or when capture is by trigger)."""
        if self._dialect != "postgresql":
            return 0.0
        with self._reader.connect() as conn:
            if not publication_exists(conn):
                self._slot_down_since = None
                return 0.0
            state = slot_state(conn)
        if state.exists and state.active and state.wal_status != "lost":
            self._slot_down_since = None
            return 0.0
        now = time.monotonic()
        if self._slot_down_since is None:
            self._slot_down_since = now
        return now - self._slot_down_since

    def _threshold(self, flag: Flag, name: str) -> float:
        return float(flag.thresholds.get(name, getattr(self.settings, name)))

    def _judge_outbox(self, flag: Flag, age: float, unpublished: int) -> Finding:
        limit = self._threshold(flag, "max_outbox_age")
        state: State = "exceeded" if age > limit else "ok"
        if self._slot_age and self._slot_age >= age:
            detail = (f"the write-ahead-log capture's slot has had no reader for {age:.1f} s, "
                      f"{'above' if age > limit else 'within'} max_outbox_age {limit:g} s")
        else:
            detail = (f"oldest unpublished outbox row is {age:.1f} s old ({unpublished} unpublished), "
                      f"{'above' if age > limit else 'within'} max_outbox_age {limit:g} s")
        if state == "exceeded":
            detail += ": the capture/relay path is stuck"
        return Finding("outbox_age", state, round(age, 3), limit, detail)

    def _judge_lag(self, flag: Flag, lag: int | None, lag_detail: str) -> Finding:
        limit = self._threshold(flag, "max_lag")
        if lag is None:
            return Finding("lag", "unknown", None, limit, f"lag unknown ({lag_detail}); criterion skipped")
        state: State = "exceeded" if lag > limit else "ok"
        return Finding("lag", state, float(lag), limit,
                       f"consumer lag of group {self.group} is {lag} entries, "
                       f"{'above' if lag > limit else 'within'} max_lag {limit:g}")

    def _judge_miss_rate(self, flag: Flag, now: datetime) -> Finding:
        limit = self._threshold(flag, "max_miss_rate")
        counted = self.miss_count(flag, now)
        self._miss_rate.labels(workflow_type=flag.workflow_type).set(counted.rate)
        self._miss_labels.add(flag.workflow_type)
        figures = (f"{counted.fallback} fallback of {counted.total} dispatches (events + fallback) "
                   f"since {counted.since.isoformat(timespec='seconds')}")
        if counted.held:
            # Backpressure is not failure: held tasks are neither dispatched by the fallback nor counted.
            figures += f"; {counted.held} ready task(s) held back by backpressure now (waiting by design, not misses)"
        if counted.total < self.settings.min_tasks:
            return Finding("miss_rate", "not_judged", round(counted.rate, 6), limit,
                           f"fallback-miss rate not judged: {figures}, need {self.settings.min_tasks}")
        state: State = "exceeded" if counted.rate > limit else "ok"
        return Finding("miss_rate", state, round(counted.rate, 6), limit,
                       f"fallback-miss rate {counted.rate:.2%} ({figures}), "
                       f"{'above' if state == 'exceeded' else 'within'} max_miss_rate {limit:.2%}")

    def _demote(self, verdict: TypeVerdict, tripped: list[Finding]) -> None:
        name = verdict.workflow_type
        # Read again just before writing: an operator (or another guardian) may have moved the type
        # since this check read the flags; never write a second, redundant demotion.
        current = self.store.get(name)
        if current.phase not in GUARDED:
            verdict.action = "skipped"
            log.info("guardian: %s is now %s, not demoting it", name, describe(current))
            return
        assert verdict.reason is not None
        change = rollback(self.store, [name], reason=verdict.reason, actor=ACTOR, action="guardian")[0]
        verdict.action, verdict.change = "demoted", change
        self._demotions.labels(workflow_type=name, reason=tripped[0].criterion).inc()
        log.warning("guardian demoted %s %s -> polling: %s", name, describe(current), verdict.reason)

    def _note_lag_state(self, known: bool, detail: str) -> None:
        # One line when the lag becomes unknown and one when it is known again, not one per check.
        if known == self._lag_known:
            if not known:
                log.debug("guardian: %s", detail)
            return
        if not known:
            log.warning("guardian: lag criterion skipped: %s; outbox and miss-rate checks continue", detail)
        elif self._lag_known is False:
            log.info("guardian: lag known again: %s", detail)
        self._lag_known = known

    # --- the loop ------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Check now and then every ``interval`` seconds until ``stop`` is set. Never raises for a failed
        check: it is logged and counted, and the next check comes on schedule."""
        log.info("guardian checking every %g s (group %s, bus %s)", self.settings.interval, self.group,
                 self.bus_label)
        while not stop.is_set():
            try:
                self.check_once()
            except PollbridgeError as exc:
                log.error("%s", exc)
            except Exception:  # a bug or an unexpected failure: still never end the loop
                log.exception("guardian check failed")
            stop.wait(self.settings.interval)

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """A metric's current value (0 when never set): for tests and the CLI's summary."""
        return self.registry.get_sample_value(name, dict(labels or {})) or 0.0

