"""``pollbridge doctor``: is this installation able to work? Each check passes or says why not.

Checks (from the registry in :mod:`bridge.rollout.checks`, shared with ``preflight``): the database is
reachable; the mapping matches the real tables and columns; pollbridge's migrations are at head; the
capture triggers are installed on a table (a view as ``mapping.table`` is refused, naming its base table),
enabled, and current (what the mapping and ``[capture]`` settings generate now: after the scheduler's own
migrations altered its table, or after an upgrade of pollbridge, an outdated capture says to run
``pollbridge init``); the workflows in the task table are DAGs (no dependency on an unknown
task key, no cycle); the bus is reachable. Each check is independent where it can be: a mapping
mismatch does not hide the migration state. When the database cannot be reached nothing else is
checked; a check whose prerequisite failed (the capture and DAG checks without a mapping) is left out.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from bridge.core.settings import Settings
from bridge.flags.store import FlagStore
from bridge.rollout.checks import REGISTRY, BusOpener, CheckResult, Probe, run_checks

#: The checks doctor runs, in the order it prints them.
DOCTOR: tuple[str, ...] = ("database", "mapping", "install_sql", "migrations", "capture_installed", "dags", "bus")
#: Doctor's own name for a registry check (its output has always said ``capture``).
NAMES: dict[str, str] = {"capture_installed": "capture"}


def run_doctor(engine: Engine, settings: Settings, *, store: FlagStore, open_bus: BusOpener) -> list[CheckResult]:
    """Run :data:`DOCTOR`; ``store`` and ``open_bus`` come from the composition root
    (:meth:`bridge.app.components.Components.doctor`)."""
    probe = Probe(engine, settings, store=store, open_bus=open_bus)
    try:
        # The mapping's own SQL is checked only where there is some: no line about nothing.
        names = [n for n in DOCTOR if n != "install_sql" or settings.mapping.install_sql is not None]
        first, *rest = [REGISTRY[name] for name in names]
        results = run_checks([first], probe)
        if results[0].passed:  # without the database there is nothing else to look at
            results += run_checks(rest, probe, blocked="omit")
    finally:
        probe.close()
    return [CheckResult(NAMES.get(r.name, r.name), r.passed, r.detail, r.description) for r in results]


def to_json(results: list[CheckResult]) -> dict[str, Any]:
    """``doctor --json``: ``{"ok": ..., "checks": [{"name", "ok", "detail"}, ...]}``."""
    return {"ok": all(r.passed for r in results),
            "checks": [{"name": r.name, "ok": r.passed, "detail": r.detail} for r in results]}
