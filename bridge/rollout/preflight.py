"""``pollbridge preflight PHASE --type T``: the checks that gate moving a workflow type into PHASE.

Each check has a stable snake_case name, a one-line description and the target phases it applies to,
in the registry :data:`CHECKS` (the runbooks refer to checks by these names, and a test holds the
runbooks and this registry to one another). Which checks run for which target phase:

=====================  =======  ==========  =========  =======
check                  polling  dual_write  selective  cutover
=====================  =======  ==========  =========  =======
``database``           yes      yes         yes        yes
``migrations``                  yes         yes        yes
``capture_installed``           yes         yes        yes
``bus``                         yes         yes        yes
``relay_alive``                 yes         yes        yes
``scheduler_alive``             yes         yes        yes
``outbox_backlog``              yes         yes        yes
``consumer_lag``                yes         yes        yes
``dead_letters``                            yes        yes
``reconciler_gate``             yes         yes        yes
``rollback_rehearsed``                      yes        yes
=====================  =======  ==========  =========  =======

Returning to ``polling`` needs nothing but the database: the way back must never wait for the event
path. ``dual_write`` needs the whole event path running (it is what gathers the evidence), but no
rehearsed rollback or clean dead-letter store yet: the poller stays authoritative. ``selective`` and
``cutover`` let the event path dispatch, so they also need no dead letters beyond the threshold and a
rollback rehearsed for the type within ``[preflight] rollback_rehearsal_days``.

What each check measures:

* ``database``: one connection (the URL is shown masked).
* ``migrations``: pollbridge's schema is at the migration head.
* ``capture_installed``: both capture triggers are on the mapped task table.
* ``bus``: the bus answers (its epoch token can be read).
* ``relay_alive``: every relay partition (``[capture] relay_partitions``) has a live relay: on
  PostgreSQL one holding the partition's advisory lock (released the moment its connection closes); on
  SQLite one whose lease heartbeat in ``pollbridge_relay_state`` is newer than ``heartbeat_timeouts``
  times ``relay.lease_timeout``.
* ``scheduler_alive``: at least one scheduler process heartbeat within ``heartbeat_timeouts`` times
  ``scheduler.lease_ttl``, and every bus partition is leased by a live one; read where the leases are
  (beside a Redis bus, else ``pollbridge_scheduler_members`` and ``pollbridge_scheduler_leases``).
* ``outbox_backlog``: the oldest unpublished outbox row (``published_at IS NULL``) is at most
  ``max_backlog_age`` seconds old, by the database clock.
* ``consumer_lag``: bus entries not yet delivered to the scheduler's group, over all partitions, at
  most ``max_lag``.
* ``dead_letters``: the bus's dead letters plus the relay's (``pollbridge_outbox_dead``) at most
  ``max_dead_letters`` (default 0: look at them, then ``dlq replay`` or ``dlq purge``).
* ``reconciler_gate``: the gate ``flags set`` would apply to this step (:func:`bridge.rollout.promotion.evaluate_gate`:
  the capture triggers for ``dual_write``; the reconciler's evidence since the current phase began for
  ``selective``, a larger percentage and ``cutover``). A step that skips a phase fails it; a move that is
  not a promotion passes it, since ``flags set`` applies no gate then.
* ``rollback_rehearsed``: ``pollbridge rollback`` ran for the type (audit action ``rollback``; a
  guardian demotion does not count) within ``rollback_rehearsal_days``.

A check whose prerequisite failed (for example everything after ``database`` when the database is
down) fails with "not checked" and names it. Nothing is written: preflight only reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from bridge.bus.base import EventBus
from bridge.capture.leadership import ADVISORY_NAMESPACE
from bridge.capture.triggers import capture_status
from bridge.core.errors import FlagError, PollbridgeError, first_line
from bridge.core.phases import PHASES, Flag, Phase
from bridge.core.settings import Settings
from bridge.core.urls import mask_url
from bridge.db import migrate
from bridge.db.clock import as_utc, db_clock
from bridge.db.engine import check_connection, read_only
from bridge.db.schema import outbox_dead, relay_state
from bridge.flags.store import FlagStore, describe, validate_percent, validate_phase, validate_type_name
from bridge.rollout.promotion import RANK, evaluate_gate, is_promotion
from bridge.tasktable.tables import TaskTable, reflect_tables

#: Seconds a Redis call of preflight may take: a hung bus must fail its check, not hang the checklist.
BUS_TIMEOUT = 3.0

Outcome = tuple[bool, str]


@dataclass(frozen=True)
class PreflightCheck:
    """One entry of the registry: what it checks, for which target phases, after which other checks."""

    name: str
    description: str
    phases: tuple[Phase, ...]
    run: Callable[[Probe], Outcome] = field(repr=False, compare=False)
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    detail: str
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail, "description": self.description}


@dataclass(frozen=True)
class PreflightReport:
    workflow_type: str
    phase: Phase
    percent: float | None
    current_phase: Phase | None  # None while the flag store cannot be read
    current_percent: float | None
    results: tuple[CheckResult, ...]
    not_applicable: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def result(self, name: str) -> CheckResult | None:
        return next((r for r in self.results if r.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "workflow_type": self.workflow_type, "phase": self.phase, "percent": self.percent,
            "current_phase": self.current_phase, "current_percent": self.current_percent,
            "passed": self.passed, "failed": [r.name for r in self.failed],
            "checks": [r.to_json() for r in self.results], "not_applicable": list(self.not_applicable),
        }


class Probe:
    """What the checks of one run share: the engine and settings, and lazily the task table, the bus and
    the type's flag (each opened or read once)."""

    def __init__(self, engine: Engine, settings: Settings, workflow_type: str, target: Phase,
                 percent: float | None, *, bus: EventBus | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.workflow_type = workflow_type
        self.target = target
        self.percent = percent
        self._bus = bus
        self._owns_bus = bus is None
        self._tables: TaskTable | None = None
        self._flag: Flag | None = None

    @property
    def tables(self) -> TaskTable:
        if self._tables is None:
            self._tables = reflect_tables(self.engine, self.settings.mapping)
        return self._tables

    @property
    def flag(self) -> Flag:
        if self._flag is None:
            self._flag = FlagStore(self.engine, default_grace=self.settings.router.grace).get(self.workflow_type)
        return self._flag

    @property
    def bus(self) -> EventBus:
        if self._bus is None:
            from bridge.bus import open_bus
            from bridge.core.urls import bus_scheme

            s = self.settings
            options: dict[str, Any] = {} if bus_scheme(s.bus_url) == "embedded" else {"socket_timeout": BUS_TIMEOUT}
            self._bus = open_bus(s.bus_url, engine=self.engine, partitions=s.bus.partitions,
                                 namespace=s.bus.namespace, **options)
        return self._bus

    def guardian(self, *, with_bus: bool) -> Any:
        from bridge.rollout.guardian import Guardian

        return Guardian(self.engine, self.settings.guardian, bus=self.bus if with_bus else None,
                        group=self.settings.scheduler.group, registry=CollectorRegistry(),
                        bus_label=mask_url(self.settings.bus_url))

    def close(self) -> None:
        if self._bus is not None and self._owns_bus:
            self._bus.close()
        self._bus = None


# --- the checks -----------------------------------------------------------------------------------------

def _database(p: Probe) -> Outcome:
    check_connection(p.engine)
    return True, f"connected to {mask_url(p.settings.database_url)}"


def _migrations(p: Probe) -> Outcome:
    head = migrate.head_revision()
    current = migrate.current_revision(p.engine)
    if current == head:
        return True, f"at head ({head})"
    if current is None:
        return False, "pollbridge is not installed in this database: run `pollbridge init`"
    return False, f"at {current}, head is {head}: run `pollbridge init` to upgrade"


def _capture(p: Probe) -> Outcome:
    with read_only(p.engine).connect() as conn:
        return capture_status(conn, p.tables)


def _bus(p: Probe) -> Outcome:
    p.bus.epoch()
    return True, f"{mask_url(p.settings.bus_url)} reachable ({p.settings.bus.partitions} partitions)"



def _age(now: datetime, then: datetime) -> str:
    return f"{max(0.0, (now - then).total_seconds()):.1f} s ago"


def _relay_alive(p: Probe) -> Outcome:
    s = p.settings
    partitions = s.capture.relay_partitions
    rs = relay_state.c
    with read_only(p.engine).connect() as conn:
        rows = {int(r.relay_partition): r for r in conn.execute(
            sa.select(rs.relay_partition, rs.holder, rs.heartbeat_at).where(rs.relay_partition < partitions))}
        if p.engine.dialect.name == "postgresql":
            # The relay holds a session advisory lock (ADVISORY_NAMESPACE, partition) for as long as it lives: a
            # dead relay's connection closes and releases it at once. (Its relay_state row is written when it
            # takes the lock, not renewed while it holds it.)
            held = set(conn.execute(sa.text(
                "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = :ns "
                "AND objsubid = 2 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
                {"ns": ADVISORY_NAMESPACE}).scalars())
            conn.rollback()
            alive, dead = [], []
            for part in range(partitions):
                row = rows.get(part)
                holder = row.holder if row is not None and row.holder else "unknown"
                since = as_utc(row.heartbeat_at) if row is not None else None
                if part in held:
                    taken = f" since {since.isoformat(timespec='seconds')}" if since else ""
                    alive.append(f"partition {part} held by {holder}{taken}")
                else:
                    last = f" (last holder {holder})" if row is not None and row.holder else ""
                    dead.append(f"partition {part}: no relay holds its lock{last}: the relay is down "
                                f"(start `pollbridge relay run --partition {part}`)")
            return (False, "; ".join(dead)) if dead else (True, "; ".join(alive))
    # SQLite: a lease row renewed every lease_timeout / 2 with the host's UTC clock.
    limit = s.preflight.heartbeat_timeouts * s.relay.lease_timeout
    now = datetime.now(UTC)
    alive, dead = [], []
    for part in range(partitions):
        row = rows.get(part)
        beat = as_utc(row.heartbeat_at) if row is not None else None
        if row is None or row.holder is None or beat is None:
            dead.append(f"partition {part}: no relay holds it (start `pollbridge relay run --partition {part}`)")
        elif (now - beat).total_seconds() > limit:
            dead.append(f"partition {part}: last heartbeat {_age(now, beat)} by {row.holder}, "
                        f"older than {limit:g} s: the relay is down or stuck")
        else:
            alive.append(f"partition {part} held by {row.holder}, heartbeat {_age(now, beat)}")
    return (False, "; ".join(dead)) if dead else (True, "; ".join(alive))


def _scheduler_alive(p: Probe) -> Outcome:
    from event_scheduler.leases import lease_snapshot

    s = p.settings
    limit = s.preflight.heartbeat_timeouts * s.scheduler.lease_ttl
    # Where the leases are: beside a Redis bus (its clock), else in the database (the hosts' UTC clocks).
    snap = lease_snapshot(p.engine, p.bus)
    now = snap.now
    live = snap.live_members(limit)
    if not live:
        newest = max(snap.members.values(), default=None)
        seen = f"the last heartbeat was {_age(now, newest)}" if newest else "no scheduler process is registered"
        return False, (f"no scheduler process heartbeat within {limit:g} s ({seen}): "
                       "start `pollbridge scheduler run`")
    wanted = s.bus.partitions
    orphaned = sorted(set(range(wanted)) - snap.held_by(live))
    figures = f"{len(live)} live scheduler process(es), newest heartbeat {_age(now, max(live.values()))}"
    if orphaned:
        return False, (f"{figures}, but bus partition(s) {', '.join(map(str, orphaned))} of {wanted} have no live "
                       "consumer (a process died and its leases have not been taken over yet)")
    return True, f"{figures}, holding all {wanted} bus partitions"


def _outbox_backlog(p: Probe) -> Outcome:
    limit = p.settings.preflight.max_backlog_age
    unpublished, age, _ = p.guardian(with_bus=False).outbox_age()
    detail = (f"{unpublished} unpublished outbox row(s), the oldest {age:.1f} s old "
              f"({'within' if age <= limit else 'above'} max_backlog_age {limit:g} s)")
    if age > limit:
        detail += ": the relay is not keeping up, or not publishing"
    return age <= limit, detail


def _consumer_lag(p: Probe) -> Outcome:
    limit = p.settings.preflight.max_lag
    partitions, detail = p.guardian(with_bus=True).lag()
    if partitions is None:
        return False, f"lag unknown: {detail}"
    lag = sum(partitions.values())
    return lag <= limit, f"{detail} ({'within' if lag <= limit else 'above'} max_lag {limit})"


def _dead_letters(p: Probe) -> Outcome:
    from bridge.reconcile.status import dead_letter_count

    limit = p.settings.preflight.max_dead_letters
    on_bus = dead_letter_count(p.bus)
    with read_only(p.engine).connect() as conn:
        relay = int(conn.execute(sa.select(sa.func.count()).select_from(outbox_dead)).scalar_one())
    total = on_bus + relay
    detail = (f"{on_bus} dead letter(s) on the bus, {relay} set aside by the relay "
              f"({'within' if total <= limit else 'above'} max_dead_letters {limit})")
    if total > limit:
        detail += ": see `pollbridge dlq list`, then `pollbridge dlq replay` or `pollbridge dlq purge`"
        if relay:
            detail += "; the relay's are in pollbridge_outbox_dead"
    return total <= limit, detail


def _reconciler_gate(p: Probe) -> Outcome:
    flag = p.flag
    target = p.target
    move = f"{describe(flag)} -> {describe(Flag(flag.workflow_type, target, p.percent))}"
    if RANK[target] > RANK[flag.phase] + 1:
        step = PHASES[RANK[flag.phase] + 1]
        return False, f"{move} skips a step: `flags set` promotes one step at a time (next: {step})"
    if not is_promotion(flag, target, p.percent):
        return True, f"{move} is not a promotion: `flags set` applies no gate"
    gate = evaluate_gate(p.engine, p.tables, flag, target, p.settings.gates)
    criteria = "; ".join(f"{c.name} {'ok' if c.passed else 'FAILED'} ({c.detail})" for c in gate.criteria)
    return gate.passed, f"gate {move}: {criteria}"


def _rollback_rehearsed(p: Probe) -> Outcome:
    days = p.settings.preflight.rollback_rehearsal_days
    last = as_utc(FlagStore(p.engine).last_rollback(p.workflow_type))
    if last is None:
        return False, (f"no rollback of {p.workflow_type} was ever recorded: rehearse one "
                       f"(`pollbridge rollback {p.workflow_type} --reason rehearsal`)")
    age_days = max(0.0, (db_clock(p.engine) - last).total_seconds()) / 86400
    when = f"last rollback {last.isoformat(timespec='seconds')} ({age_days:.1f} day(s) ago)"
    if age_days > days:
        return False, f"{when}, older than rollback_rehearsal_days {days:g}: rehearse it again"
    return True, f"{when}, within rollback_rehearsal_days {days:g}"


EVENT_PATH: tuple[Phase, ...] = ("dual_write", "selective", "cutover")
DISPATCHING: tuple[Phase, ...] = ("selective", "cutover")

#: The registry, in the order the checklist prints.
CHECKS: tuple[PreflightCheck, ...] = (
    PreflightCheck("database", "the database is reachable", PHASES, _database),
    PreflightCheck("migrations", "pollbridge's schema is at the migration head", EVENT_PATH, _migrations,
                   ("database",)),
    PreflightCheck("capture_installed", "the capture triggers are on the task table", EVENT_PATH, _capture,
                   ("database",)),
    PreflightCheck("bus", "the event bus is reachable", EVENT_PATH, _bus),
    PreflightCheck("relay_alive", "every relay partition has a relay with a fresh heartbeat", EVENT_PATH,
                   _relay_alive, ("database", "migrations")),
    PreflightCheck("scheduler_alive", "a scheduler process has a fresh heartbeat and every bus partition a consumer",
                   EVENT_PATH, _scheduler_alive, ("database", "migrations", "bus")),
    PreflightCheck("outbox_backlog", "the oldest unpublished outbox row is younger than max_backlog_age",
                   EVENT_PATH, _outbox_backlog, ("database", "migrations")),
    PreflightCheck("consumer_lag", "the scheduler's consumer lag is at most max_lag", EVENT_PATH, _consumer_lag,
                   ("bus",)),
    PreflightCheck("dead_letters", "dead letters (bus and relay) are at most max_dead_letters", DISPATCHING,
                   _dead_letters, ("database", "migrations", "bus")),
    PreflightCheck("reconciler_gate", "the promotion gate `flags set` applies to this step passes", EVENT_PATH,
                   _reconciler_gate, ("database", "migrations")),
    PreflightCheck("rollback_rehearsed", "a rollback of the type was rehearsed within rollback_rehearsal_days",
                   DISPATCHING, _rollback_rehearsed, ("database", "migrations")),
)
REGISTRY: dict[str, PreflightCheck] = {c.name: c for c in CHECKS}


def checks_for(phase: str) -> list[PreflightCheck]:
    """The checks that gate entering ``phase``, in checklist order."""
    target = validate_phase(phase)
    return [c for c in CHECKS if target in c.phases]


def matrix() -> dict[str, dict[str, bool]]:
    """``{check: {phase: applies}}`` for every check and phase (documentation and tests)."""
    return {c.name: {ph: ph in c.phases for ph in PHASES} for c in CHECKS}


def _reason(exc: BaseException) -> str:
    return mask_url(first_line(exc))


def _run_one(check: PreflightCheck, probe: Probe, roots: dict[str, list[str]]) -> CheckResult:
    blocked: list[str] = []
    for need in check.needs:
        for root in roots.get(need, []):
            if root not in blocked:
                blocked.append(root)
    if blocked:
        roots[check.name] = blocked
        return CheckResult(check.name, False, f"not checked: {', '.join(blocked)} failed", check.description)
    try:
        passed, detail = check.run(probe)
    except PollbridgeError as exc:
        passed, detail = False, str(exc)
    except SQLAlchemyError as exc:
        passed, detail = False, f"database error: {_reason(exc)}"
    except Exception as exc:  # a bus client error, a timeout: the check fails with the reason, masked
        passed, detail = False, f"{type(exc).__name__}: {_reason(exc)}"
    if not passed:
        roots[check.name] = [check.name]
    return CheckResult(check.name, passed, detail, check.description)


def validate_request(workflow_type: str, phase: str, percent: float | None) -> Phase:
    """Bad input is exit 2 before anything is read."""
    validate_type_name(workflow_type)
    target = validate_phase(phase)
    validate_percent(percent, target)
    return target


def _known_type(probe: Probe) -> bool | None:
    """Whether the type has a flag or a task; ``None`` when that cannot be read (the checks then say why)."""
    try:
        check_connection(probe.engine)
        if probe.flag.updated_at is not None:
            return True
        tt = probe.tables
        src, workflow_type = tt.workflow_type_source(tt.tasks)
        with read_only(probe.engine).connect() as conn:
            found = conn.execute(sa.select(workflow_type).select_from(src)
                                 .where(workflow_type == probe.workflow_type).limit(1)).first()
        return found is not None
    except (PollbridgeError, SQLAlchemyError):
        return None


def run_preflight(engine: Engine, settings: Settings, workflow_type: str, phase: str, *,
                  percent: float | None = None, bus: EventBus | None = None,
                  checks: Sequence[PreflightCheck] | None = None) -> PreflightReport:
    """Run the checks for moving ``workflow_type`` into ``phase`` (see the module docstring).

    Raises :class:`FlagError` (exit 2) for bad input: a bad type name, an unknown phase, a bad
    percentage, or (for a phase other than ``polling``) a type with no flag and no task in the task
    table. ``bus``: use this bus instead of opening one from the settings (it is left open)."""
    target = validate_request(workflow_type, phase, percent)
    probe = Probe(engine, settings, workflow_type, target, percent, bus=bus)
    try:
        if target != "polling" and _known_type(probe) is False:
            raise FlagError(f"unknown workflow type {workflow_type!r}: no flag and no task of that type in "
                            f"{settings.mapping.table!r}; check the name")
        selected = list(checks) if checks is not None else checks_for(target)
        done: dict[str, CheckResult] = {}
        roots: dict[str, list[str]] = {}  # failed check -> the failed checks at the root of it
        for check in selected:
            done[check.name] = _run_one(check, probe, roots)
        try:
            current: Flag | None = probe.flag
        except PollbridgeError:
            current = None
    finally:
        probe.close()
    names = {c.name for c in selected}
    return PreflightReport(
        workflow_type=workflow_type, phase=target, percent=percent,
        current_phase=current.phase if current is not None else None,
        current_percent=current.percent if current is not None else None,
        results=tuple(done.values()),
        not_applicable=tuple(c.name for c in CHECKS if c.name not in names),
    )
