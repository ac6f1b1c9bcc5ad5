"""``pollbridge status`` and ``pollbridge metrics serve``: the state of the migration on one screen.

:func:`gather_status` reads, in a handful of cheap queries (each bounded by an index or by the
window, never a scan of the task table):

* **per workflow type** (every type with a flag, a dispatch or a shadow decision in the window, or a
  guardian demotion): its phase and selective percentage, dispatches by path (``poller``, ``events``,
  ``fallback``) in the last ``window`` seconds, fallback misses (the ``fallback`` dispatches: each one
  a task the event path should have dispatched), shadow decisions and guardian demotions. ``poller`` is
  the legacy scheduler: pollbridge's poller, or a foreign scheduler's dispatches captured from the task
  table (:mod:`bridge.capture.evidence`), as the relay records them;
* **the outbox**: backlog (unpublished rows), the age of the oldest by the database clock, and the
  rows the relay dead-lettered;
* **the bus** (the scheduler's consumer group): lag per partition and summed, pending (delivered,
  not acknowledged) entries, dead letters. An unreachable bus makes these ``unknown`` with the reason;
  it never fails the status;
* **the guardian**: its latest demotions (``pollbridge_flag_audit`` rows with actor ``guardian``) with
  time and reason;
* **the flag store**: whether it can be read;
* **safety valves** per type: the tasks parked in the review queue (and how long the oldest has waited for a
  person) and the ready tasks under a legitimate backpressure hold now.

The result is a frozen :class:`Status` with :meth:`Status.to_json` (keys documented in
``docs/observe.md``). :class:`StatusCollector` exposes the same figures to Prometheus, gathered on
each scrape. URLs are shown masked (:func:`bridge.db.engine.mask_url`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine

from bridge.bus.base import EventBus
from bridge.capture.outbox import read_backlog
from bridge.capture.wal import SlotState, publication_exists, slot_state
from bridge.core.errors import FlagStoreUnavailable, first_line
from bridge.core.phases import PHASES
from bridge.core.settings import SchedulerSettings
from bridge.db.clock import as_utc
from bridge.db.engine import db_ago, read_only
from bridge.db.schema import decisions, dispatch_log, flag_audit, holds, outbox_dead
from bridge.flags.store import FlagStore
from bridge.tasktable.holds import HOLD_SLACK
from bridge.tasktable.review import summary as review_summary

log = logging.getLogger(__name__)

PATHS = ("poller", "events", "fallback")
#: Guardian demotions listed (the most recent ones).
GUARDIAN_RECENT = 10
GUARDIAN_ACTOR = "guardian"
DEFAULT_WINDOW = 300.0


@dataclass(frozen=True)
class TypeStatus:
    workflow_type: str
    phase: str  # 'unknown' while the flag store cannot be read
    percent: float | None
    flag_source: str  # 'flag', 'default' (no row: polling) or 'unavailable'
    dispatches: dict[str, int]  # by path, every path present
    decisions: int
    guardian_demotions: int  # all time, from the audit trail
    #: Tasks parked in the review queue now, and the age of the oldest (seconds; None without any).
    parked: int = 0
    parked_oldest_age: float | None = None
    #: Ready tasks under a legitimate backpressure hold now (waiting by design, not misses).
    held: int = 0

    @property
    def fallback_misses(self) -> int:
        return self.dispatches.get("fallback", 0)

    def to_json(self) -> dict[str, Any]:
        return {"workflow_type": self.workflow_type, "phase": self.phase, "percent": self.percent,
                "flag_source": self.flag_source, "dispatches": dict(self.dispatches),
                "fallback_misses": self.fallback_misses, "decisions": self.decisions,
                "guardian_demotions": self.guardian_demotions,
                "review": {"parked": self.parked,
                           "oldest_age_seconds": (round(self.parked_oldest_age, 3)
                                                  if self.parked_oldest_age is not None else None)},
                "held_back": self.held}


@dataclass(frozen=True)
class BusStatus:
    url: str  # masked
    group: str
    state: str  # 'ok' or 'unknown'
    reason: str
    lag: int | None = None
    lag_partitions: dict[int, int] | None = None
    pending: int | None = None
    dead_letters: int | None = None
    #: Where each partition lives when the bus spreads them over servers (a Redis Cluster), else None.
    placement: dict[int, str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "group": self.group, "state": self.state, "reason": self.reason, "lag": self.lag,
                "lag_partitions": ({str(p): n for p, n in sorted(self.lag_partitions.items())}
                                   if self.lag_partitions is not None else None),
                "pending": self.pending, "dead_letters": self.dead_letters,
                "placement": ({str(p): n for p, n in sorted(self.placement.items())}
                              if self.placement is not None else None)}


@dataclass(frozen=True)
class GuardianDemotion:
    workflow_type: str
    changed_at: datetime | None
    old_phase: str
    new_phase: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"workflow_type": self.workflow_type, "changed_at": _iso(self.changed_at), "old_phase": self.old_phase,
                "new_phase": self.new_phase, "reason": self.reason}


@dataclass(frozen=True)
class Status:
    checked_at: datetime
    window_seconds: float
    database: str  # masked
    types: tuple[TypeStatus, ...]
    outbox_backlog: int
    outbox_oldest_age_seconds: float
    outbox_dead_letters: int
    bus: BusStatus
    guardian_recent: tuple[GuardianDemotion, ...]
    flag_store_up: bool
    flag_store_detail: str
    totals: dict[str, int] = field(default_factory=dict)  # dispatches by path, decisions, over every type
    #: The replication slot of write-ahead-log capture (None: capture is by trigger)
    slot: SlotState | None = None

    def type(self, name: str) -> TypeStatus | None:
        return next((t for t in self.types if t.workflow_type == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "checked_at": _iso(self.checked_at),
            "window_seconds": self.window_seconds,
            "database": self.database,
            "types": [t.to_json() for t in self.types],
            "totals": dict(self.totals),
            "outbox": {"backlog": self.outbox_backlog,
                       "oldest_age_seconds": round(self.outbox_oldest_age_seconds, 3),
                       "dead_letters": self.outbox_dead_letters},
            "bus": self.bus.to_json(),
            "guardian": {"demotions": sum(t.guardian_demotions for t in self.types),
                         "recent": [d.to_json() for d in self.guardian_recent]},
            "flag_store": {"up": self.flag_store_up, "detail": self.flag_store_detail},
            "capture": {"mode": "trigger"} if self.slot is None else {
                "mode": "wal", "slot": {"exists": self.slot.exists, "active": self.slot.active,
                                        "wal_status": self.slot.wal_status,
                                        "retained_bytes": self.slot.retained_bytes,
                                        "lag_bytes": self.slot.lag_bytes}},
        }


def gather_status(engine: Engine, *, bus: EventBus | None = None, bus_label: str = "embedded",
                  bus_error: str | None = None, group: str = SchedulerSettings().group,
                  window: float = DEFAULT_WINDOW, store: FlagStore | None = None,
                  database_label: str | None = None) -> Status:
    """Everything ``status`` shows (see the module docstring). Raises only when the database cannot be read.

    ``bus``: the bus to ask for lag, pending entries and dead letters (``None``: unknown, with
    ``bus_error`` as the reason). ``bus_label`` and ``database_label`` must already be masked."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    store = store if store is not None else FlagStore(engine)
    flags_detail = "readable"
    try:
        stored = store.all()
        flags_up = True
        flags_detail = f"readable: {len(stored)} workflow type(s) with a flag"
    except FlagStoreUnavailable as exc:
        stored, flags_up, flags_detail = {}, False, str(exc)

    dialect = engine.dialect.name
    since = db_ago(dialect, window)
    dl, dc, fa = dispatch_log.c, decisions.c, flag_audit.c
    with read_only(engine).connect() as conn:
        per_path = conn.execute(sa.select(dl.workflow_type, dl.path, sa.func.count())
                                .where(dl.dispatched_at >= since).group_by(dl.workflow_type, dl.path)).all()
        decided = conn.execute(sa.select(dc.workflow_type, sa.func.count())
                               .where(dc.decided_at >= since).group_by(dc.workflow_type)).all()
        outbox_now = read_backlog(conn)
        slot = slot_state(conn) if publication_exists(conn) else None
        dead_outbox = conn.execute(sa.select(sa.func.count()).select_from(outbox_dead)).scalar_one()
        demotion_counts = conn.execute(sa.select(fa.workflow_type, sa.func.count())
                                       .where(fa.actor == GUARDIAN_ACTOR).group_by(fa.workflow_type)).all()
        recent = conn.execute(sa.select(fa.workflow_type, fa.changed_at, fa.old_phase, fa.new_phase, fa.reason)
                              .where(fa.actor == GUARDIAN_ACTOR).order_by(fa.id.desc())
                              .limit(GUARDIAN_RECENT)).all()
        parked = review_summary(conn)
        h = holds.c
        held = {(workflow_type or ""): int(n) for workflow_type, n in conn.execute(
            sa.select(h.workflow_type, sa.func.count())
            .where(h.released_at.is_(None), h.until > db_ago(dialect, HOLD_SLACK)).group_by(h.workflow_type))}
        conn.rollback()

    now, backlog, age = outbox_now.now, outbox_now.unpublished, outbox_now.oldest_age

    dispatches: dict[str, dict[str, int]] = {}
    for workflow_type, path, n in per_path:
        dispatches.setdefault(workflow_type or "", {})[str(path)] = int(n)
    decisions_by_type = {(workflow_type or ""): int(n) for workflow_type, n in decided}
    demotions = {str(workflow_type): int(n) for workflow_type, n in demotion_counts}
    parked_by_type = {(workflow_type or ""): v for workflow_type, v in parked.items()}
    names = sorted(set(stored) | set(dispatches) | set(decisions_by_type) | set(demotions) | set(parked_by_type)
                   | set(held))
    types = []
    for name in names:
        flag = stored.get(name)
        counts = {p: dispatches.get(name, {}).get(p, 0) for p in PATHS}
        for p, n in dispatches.get(name, {}).items():  # a path pollbridge does not know still shows
            counts.setdefault(p, n)
        types.append(TypeStatus(
            workflow_type=name,
            phase=flag.phase if flag is not None else ("polling" if flags_up else "unknown"),
            percent=flag.percent if flag is not None and flag.phase == "selective" else None,
            flag_source="flag" if flag is not None else ("default" if flags_up else "unavailable"),
            dispatches=counts, decisions=decisions_by_type.get(name, 0), guardian_demotions=demotions.get(name, 0),
            parked=parked_by_type.get(name, (0, None))[0],
            parked_oldest_age=_age(now, parked_by_type.get(name, (0, None))[1]), held=held.get(name, 0)))
    totals = {p: sum(t.dispatches.get(p, 0) for t in types) for p in PATHS}
    totals["decisions"] = sum(t.decisions for t in types)
    totals["parked"] = sum(t.parked for t in types)
    totals["held_back"] = sum(t.held for t in types)

    return Status(
        checked_at=now, window_seconds=float(window),
        database=database_label if database_label is not None else engine.url.render_as_string(hide_password=True),
        types=tuple(types), outbox_backlog=int(backlog), outbox_oldest_age_seconds=age,
        outbox_dead_letters=int(dead_outbox),
        bus=bus_status(bus, bus_label, group, bus_error),
        guardian_recent=tuple(GuardianDemotion(str(r.workflow_type), as_utc(r.changed_at), r.old_phase, r.new_phase,
                                               r.reason) for r in recent),
        flag_store_up=flags_up, flag_store_detail=flags_detail, totals=totals, slot=slot)


def bus_status(bus: EventBus | None, label: str, group: str, bus_error: str | None = None) -> BusStatus:
    """Lag, pending entries and dead letters of ``group``; ``unknown`` with the reason when the bus cannot tell."""
    if bus is None:
        return BusStatus(label, group, "unknown", bus_error or "no bus configured")
    try:
        lag = bus.lag(group)
        pending = bus.pending_count(group)
        dead = dead_letter_count(bus)
        placement = bus.placement()
    except Exception as exc:  # unreachable, timeout, auth, missing tables: the figures are unknown, no failure
        return BusStatus(label, group, "unknown", f"bus {label} unreachable: {first_line(exc)}")
    return BusStatus(label, group, "ok", f"bus {label} reachable", sum(lag.values()), dict(lag), pending, dead,
                     placement)


def dead_letter_count(bus: EventBus) -> int:
    """How many dead letters the bus holds (a count, not a listing, where the backend allows it)."""
    return bus.dead_letter_count()


# --- Prometheus -------------------------------------------------------------------------------------------

class StatusCollector(Collector):
    """Exposes :func:`gather_status` as metrics, gathered on each scrape (one at a time).

    ``gather`` returns a :class:`Status` (it may raise: the scrape then reports
    ``pollbridge_status_up 0`` and ``pollbridge_flag_store_up 0`` only). Labels stay low-cardinality:
    ``workflow_type``, ``phase``, ``path``, ``partition``."""

    def __init__(self, gather: Callable[[], Status]) -> None:
        self._gather = gather
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # nothing is gathered at registration; names come with each scrape

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            try:
                status = self._gather()
                self.last_error = None
            except Exception as exc:  # the database is down: say so instead of failing the scrape
                error = first_line(exc)
                if error != self.last_error:  # one line per new failure, not one per scrape
                    log.warning("status gathering failed: %s", error)
                self.last_error = error
                yield _gauge("pollbridge_status_up", "1 when the last status gathering succeeded", 0)
                yield _gauge("pollbridge_flag_store_up", "1 when the flag store could be read", 0)
                return
        yield from status_metrics(status)


def status_metrics(s: Status) -> Iterator[GaugeMetricFamily]:
    """The metric families of one :class:`Status` (see docs/observe.md for the list)."""
    yield _gauge("pollbridge_status_up", "1 when the last status gathering succeeded", 1)
    yield _gauge("pollbridge_status_window_seconds", "Length of the window the *_window metrics count over",
                 s.window_seconds)
    phase = GaugeMetricFamily("pollbridge_phase", "1 for the current phase of each workflow type",
                              labels=["workflow_type", "phase"])
    percent = GaugeMetricFamily("pollbridge_phase_percent", "Selective share of the instances the event path "
                                "owns (100 when all), per selective workflow type", labels=["workflow_type"])
    window = GaugeMetricFamily("pollbridge_dispatches_window", "Dispatches in the last window by path "
                               "(fallback: event-path misses)", labels=["workflow_type", "path"])
    shadow = GaugeMetricFamily("pollbridge_decisions_window", "Shadow decisions of the event path in the last window",
                               labels=["workflow_type"])
    demoted = GaugeMetricFamily("pollbridge_guardian_demotions", "Guardian demotions of each workflow type, from "
                                "the audit trail", labels=["workflow_type"])
    last_demotion = GaugeMetricFamily("pollbridge_guardian_last_demotion_timestamp_seconds", "Unix time of the "
                                      "latest guardian demotion of each workflow type", labels=["workflow_type"])
    for t in s.types:
        for p in PHASES:
            phase.add_metric([t.workflow_type, p], 1.0 if t.phase == p else 0.0)
        if t.phase == "selective":
            percent.add_metric([t.workflow_type], 100.0 if t.percent is None else t.percent)
        for path, n in t.dispatches.items():
            window.add_metric([t.workflow_type, path], n)
        shadow.add_metric([t.workflow_type], t.decisions)
        demoted.add_metric([t.workflow_type], t.guardian_demotions)
    latest: dict[str, datetime] = {}
    for d in s.guardian_recent:
        if d.changed_at is not None and d.workflow_type not in latest:
            latest[d.workflow_type] = d.changed_at
    for name, at in sorted(latest.items()):
        last_demotion.add_metric([name], at.timestamp())
    parked = GaugeMetricFamily("pollbridge_review_parked", "Tasks parked in the review queue by the depth or "
                               "dispatch-count guard, waiting for `pollbridge review`", labels=["workflow_type"])
    parked_age = GaugeMetricFamily("pollbridge_review_oldest_age_seconds", "How long the oldest parked task of "
                                   "each workflow type has waited for a person", labels=["workflow_type"])
    held = GaugeMetricFamily("pollbridge_held_back_now", "Ready tasks under a legitimate backpressure hold "
                             "(waiting by design, not misses)", labels=["workflow_type"])
    for t in s.types:
        parked.add_metric([t.workflow_type], t.parked)
        if t.parked_oldest_age is not None:
            parked_age.add_metric([t.workflow_type], t.parked_oldest_age)
        held.add_metric([t.workflow_type], t.held)
    yield from (phase, percent, window, shadow, demoted, last_demotion, parked, parked_age, held)
    yield _gauge("pollbridge_outbox_backlog", "Outbox rows not yet published", s.outbox_backlog)
    yield _gauge("pollbridge_outbox_oldest_age_seconds", "Age of the oldest unpublished outbox row (database clock; "
                 "0 without a backlog)", s.outbox_oldest_age_seconds)
    yield _gauge("pollbridge_outbox_dead_letters", "Outbox rows the relay could not turn into events",
                 s.outbox_dead_letters)
    if s.slot is not None:
        yield _gauge("pollbridge_wal_slot_active", "1 while a relay streams the write-ahead-log capture's slot",
                     1 if s.slot.active else 0)
        yield _gauge("pollbridge_wal_slot_lost", "1 when the slot is missing or invalidated (its WAL was removed)",
                     0 if s.slot.exists and s.slot.wal_status != "lost" else 1)
        yield _gauge("pollbridge_wal_slot_retained_bytes", "WAL the capture's slot keeps on the database's disk",
                     s.slot.retained_bytes or 0)
        yield _gauge("pollbridge_wal_slot_lag_bytes", "WAL written since the capture last confirmed",
                     s.slot.lag_bytes or 0)
    b = s.bus
    yield _gauge("pollbridge_bus_up", "1 when the bus answered the last status gathering", 1 if b.state == "ok" else 0)
    lag = GaugeMetricFamily("pollbridge_bus_lag", "Bus entries not yet delivered to the scheduler's group, per "
                            "partition (absent while the bus is unreachable)", labels=["partition"])
    for partition, n in sorted((b.lag_partitions or {}).items()):
        lag.add_metric([str(partition)], n)
    yield lag
    pending = GaugeMetricFamily("pollbridge_bus_pending", "Entries delivered to the scheduler's group, not "
                                "acknowledged (absent while the bus is unreachable)", labels=[])
    if b.pending is not None:
        pending.add_metric([], b.pending)
    dead = GaugeMetricFamily("pollbridge_dead_letters", "Dead letters on the bus (absent while the bus is "
                             "unreachable)", labels=[])
    if b.dead_letters is not None:
        dead.add_metric([], b.dead_letters)
    yield from (pending, dead)
    yield _gauge("pollbridge_flag_store_up", "1 when the flag store could be read", 1 if s.flag_store_up else 0)


def _age(now: datetime, since: datetime | None) -> float | None:
    if since is None:
        return None
    now_utc = as_utc(now)
    return max(0.0, (now_utc - since).total_seconds()) if now_utc is not None else None


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


# --- helpers ----------------------------------------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
