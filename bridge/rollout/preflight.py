"""``pollbridge preflight PHASE --type T``: the checks that gate moving a workflow type into PHASE.

The checks themselves (name, description, prerequisites, what they measure) are the registry of
:mod:`bridge.rollout.checks`, shared with ``doctor``; here each gets the target phases it applies to, in
:data:`CHECKS` (the runbooks refer to checks by these names, and a test holds the runbooks and this
table to one another). Which checks run for which target phase:

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
``dispatch_writable``                       yes        yes
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
  a SQLite file one holding the partition's lock file beside it (released the moment its process dies,
  :mod:`bridge.db.filelock`); on SQLite in memory one whose lease heartbeat in ``pollbridge_relay_state``
  is newer than ``heartbeat_timeouts`` times ``relay.lease_timeout``.
* ``scheduler_alive``: at least one scheduler process heartbeat within ``heartbeat_timeouts`` times
  ``scheduler.lease_ttl``, and every bus partition is leased by a live one; read where the leases are
  (beside a Redis bus; on a SQLite file its lock files, each held for as long as its process lives; else
  ``pollbridge_scheduler_members`` and ``pollbridge_scheduler_leases``).
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
* ``dispatch_writable``: pollbridge's writes (the status, the dispatch, update and completion times, the
  ``[mapping.dispatch] set`` columns) reach the task table: always without ``mapping.read_table``; through a
  view only when it is updatable for each of them (PostgreSQL: automatically, or by an ``INSTEAD OF UPDATE``
  trigger of the user's ``install_sql``).

A check whose prerequisite failed (for example everything after ``database`` when the database is
down) fails with "not checked" and names it. Nothing is written: preflight only reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from bridge.core.errors import FlagError, PollbridgeError
from bridge.core.phases import PHASES, Flag, Phase
from bridge.core.settings import Settings
from bridge.core.urls import mask_url
from bridge.db.engine import check_connection
from bridge.flags.store import FlagStore, validate_percent, validate_phase, validate_type_name
from bridge.reconcile.gate import unknown_types
from bridge.rollout.checks import REGISTRY as ALL_CHECKS
from bridge.rollout.checks import BusOpener, Check, CheckResult, Move, Probe, run_checks

__all__ = ["CHECKS", "REGISTRY", "CheckResult", "PreflightCheck", "PreflightReport", "checks_for", "matrix",
           "run_preflight", "validate_request"]


@dataclass(frozen=True)
class PreflightCheck:
    """A check of the shared registry and the target phases it gates."""

    check: Check
    phases: tuple[Phase, ...]

    @property
    def name(self) -> str:
        return self.check.name

    @property
    def description(self) -> str:
        return self.check.description

    @property
    def needs(self) -> tuple[str, ...]:
        return self.check.needs


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


EVENT_PATH: tuple[Phase, ...] = ("dual_write", "selective", "cutover")
DISPATCHING: tuple[Phase, ...] = ("selective", "cutover")

#: The checklist, in the order it prints: each registry check with the target phases it gates.
CHECKS: tuple[PreflightCheck, ...] = tuple(PreflightCheck(ALL_CHECKS[name], phases) for name, phases in (
    ("database", PHASES),
    ("migrations", EVENT_PATH),
    ("capture_installed", EVENT_PATH),
    ("bus", EVENT_PATH),
    ("relay_alive", EVENT_PATH),
    ("scheduler_alive", EVENT_PATH),
    ("outbox_backlog", EVENT_PATH),
    ("consumer_lag", EVENT_PATH),
    ("dead_letters", DISPATCHING),
    ("reconciler_gate", EVENT_PATH),
    ("rollback_rehearsed", DISPATCHING),
    ("dispatch_writable", DISPATCHING),
))
#: Preflight's checks by name (the runbooks may name only these).
REGISTRY: dict[str, PreflightCheck] = {c.name: c for c in CHECKS}


def checks_for(phase: str) -> list[PreflightCheck]:
    """The checks that gate entering ``phase``, in checklist order."""
    target = validate_phase(phase)
    return [c for c in CHECKS if target in c.phases]


def matrix() -> dict[str, dict[str, bool]]:
    """``{check: {phase: applies}}`` for every check and phase (documentation and tests)."""
    return {c.name: {ph: ph in c.phases for ph in PHASES} for c in CHECKS}


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
        # The one rule every command that takes a type applies (bridge.reconcile.gate.unknown_types).
        return not unknown_types(probe.engine, probe.tables, [probe.move.workflow_type], probe.store)
    except (PollbridgeError, SQLAlchemyError):
        return None


def run_preflight(engine: Engine, settings: Settings, workflow_type: str, phase: str, *, store: FlagStore,
                  open_bus: BusOpener, percent: float | None = None,
                  checks: Sequence[PreflightCheck] | None = None) -> PreflightReport:
    """Run the checks for moving ``workflow_type`` into ``phase`` (see the module docstring).

    ``store`` and ``open_bus`` come from the composition root (:meth:`bridge.app.components.Components.preflight`);
    the bus is opened only if a check needs it, and closed before this returns.

    Raises :class:`FlagError` (exit 2) for bad input: a bad type name, an unknown phase, a bad
    percentage, or (for a phase other than ``polling``) a type with no flag and no task in the task
    table."""
    target = validate_request(workflow_type, phase, percent)
    probe = Probe(engine, settings, store=store, open_bus=open_bus, database_label=mask_url(settings.database_url),
                  move=Move(workflow_type, target, percent))
    try:
        if target != "polling" and _known_type(probe) is False:
            raise FlagError(f"unknown workflow type {workflow_type!r}: no flag and no task of that type in "
                            f"{settings.mapping.table!r}; check the name")
        selected = list(checks) if checks is not None else checks_for(target)
        results = run_checks([c.check for c in selected], probe)
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
        results=tuple(results),
        not_applicable=tuple(c.name for c in CHECKS if c.name not in names),
    )
