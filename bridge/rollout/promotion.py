"""Moving a workflow type between phases: one step at a time, promotions gated by the reconciler.

Promotion (``polling`` -> ``dual_write`` -> ``selective`` -> ``cutover``, and raising a ``selective``
percentage) is refused unless the gate for the target passes; ``force`` with a reason overrides it
and the audit row records that it was forced and what the gate said. Skipping a step needs
``force`` too. Demotion and rollback are never gated: the way back must always be open.

The gates:

* entering ``dual_write``: capture is installed and current for the task table, by trigger or from the
  write-ahead log, whichever is installed (the event path can only shadow what it sees);
* entering ``selective``, raising its percentage, entering ``cutover``: the reconciler over the gate
  window, counting only evidence gathered since the type's current phase began, shows at least
  ``min_tasks`` matched tasks (``matched`` and ``late``: the event path's action paired with the legacy
  dispatch; an ``extra`` decision or a miss is compared but is no such evidence, and no legacy dispatch at
  all is ``no_evidence``), no ``early`` and no ``duplicate`` action, and an upper confidence bound of the miss
  rate below ``miss_budget`` (:mod:`bridge.reconcile.gate`). A type's flag thresholds override ``[gates]``.
"""

from __future__ import annotations

import getpass
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import Engine

from bridge.capture.gaps import gaps_between
from bridge.capture.wal import capture_state
from bridge.core.errors import FlagError, GateRefused
from bridge.core.phases import PHASES, Flag, Phase
from bridge.core.settings import GateSettings
from bridge.db.clock import as_utc, db_clock
from bridge.db.engine import read_only
from bridge.flags.store import (
    FlagChange,
    FlagStore,
    describe,
    validate_percent,
    validate_phase,
    validate_reason,
    validate_thresholds,
)
from bridge.reconcile.classify import count_by_type
from bridge.reconcile.gate import Criterion, GateResult, judge, threshold
from bridge.tasktable.tables import TaskTable

RANK = {phase: i for i, phase in enumerate(PHASES)}


def default_actor() -> str:
    """The operating-system user (flag changes always carry an actor)."""
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (containers): still an actor, never blank
        return f"uid:{os.getuid()}"



def is_promotion(old: Flag, phase: Phase, percent: float | None) -> bool:
    if RANK[phase] != RANK[old.phase]:
        return RANK[phase] > RANK[old.phase]
    if phase == "selective":
        return (100.0 if percent is None else percent) > (100.0 if old.percent is None else old.percent)
    return False


def evaluate_gate(engine: Engine, tt: TaskTable, flag: Flag, target: Phase, settings: GateSettings,
                  *, now: datetime | None = None) -> GateResult:
    """The gate for moving ``flag``'s type into ``target`` (see the module docstring)."""
    name = flag.workflow_type
    if target == "dual_write":
        with read_only(engine).connect() as conn:
            installed, detail = capture_state(conn, tt)
        return GateResult(name, target, (Criterion("capture_installed", installed, detail),), {})
    until = now or db_clock(engine)
    since = until - timedelta(seconds=settings.window)
    began = as_utc(flag.updated_at)
    if began is not None and began > since:
        since = began  # evidence of the current phase only
    counts = count_by_type(engine, tt, since, until, types=[name],
                           objective=threshold(flag, settings, "objective"),
                           tolerance=threshold(flag, settings, "tolerance")).get(name)
    raw = dict(counts.counts) if counts is not None else {}
    compared = counts.compared if counts is not None else 0
    with read_only(engine).connect() as conn:
        gaps = gaps_between(conn, since, until)
    criteria = judge(raw, compared, flag, settings, gaps=gaps)
    return GateResult(name, target, criteria, {**raw, "compared": compared}, since, until)



@dataclass(frozen=True)
class Outcome:
    change: FlagChange | None  # None: already in that phase, nothing written
    gate: GateResult | None
    old: Flag


def set_phase(engine: Engine, tt: TaskTable | None, store: FlagStore, settings: GateSettings, workflow_type: str,
              phase: str, *, reason: str, actor: str | None = None, percent: float | None = None,
              force: bool = False, grace_seconds: float | None = None,
              thresholds: dict[str, Any] | None = None) -> Outcome:
    """Validate, gate and write one flag change (see the module docstring). Raises :class:`FlagError`
    (bad input, exit 2) or :class:`GateRefused` (exit 1); nothing is written then."""
    target = validate_phase(phase)
    percent = validate_percent(percent, target)
    reason = validate_reason(reason)
    actor = validate_reason(actor or default_actor(), "actor")
    validate_thresholds(thresholds or {})  # bad input is exit 2 before any gate is evaluated
    if grace_seconds is not None and (not math.isfinite(grace_seconds) or grace_seconds <= 0):
        raise FlagError(f"grace must be a positive number of seconds, got {grace_seconds!r}")
    old = store.get(workflow_type)
    if grace_seconds is not None and grace_seconds == old.grace_seconds:
        grace_seconds = None
    overrides = validate_thresholds(thresholds or {})
    if {k: v for k, v in overrides.items() if old.thresholds.get(k) != v} == {}:
        overrides = {}
    if (old.phase, old.percent) == (target, percent) and not overrides and grace_seconds is None:
        return Outcome(None, None, old)
    if RANK[target] > RANK[old.phase] + 1 and not force:
        step = PHASES[RANK[old.phase] + 1]
        raise FlagError(f"{workflow_type} is in {describe(old)}: promote one step at a time (next: {step}); "
                        "skipping a step needs --force")
    gate = None
    if is_promotion(old, target, percent):
        if tt is None:
            raise FlagError("cannot evaluate the gate without the task table mapping")
        gate = evaluate_gate(engine, tt, old, target, settings)
        if not gate.passed and not force:
            failed = "; ".join(f"{c.name}: {c.detail}" for c in gate.failed)
            refused = GateRefused(f"gate refused {workflow_type} {describe(old)} -> {target}: {failed} "
                                  "(gather more evidence, or --force with a reason)")
            refused.gate = gate
            raise refused
    record: dict[str, Any] = gate.to_json() if gate is not None else {}
    if overrides or grace_seconds is not None:
        # Loosening a threshold weakens the next gate: the audit trail says what changed.
        record["settings"] = {
            **({"thresholds": {"old": old.thresholds, "new": {**old.thresholds, **overrides}}} if overrides else {}),
            **({"grace_seconds": {"old": old.grace_seconds, "new": grace_seconds}}
               if grace_seconds is not None else {}),
        }
    change = store.change(workflow_type, target, actor=actor, reason=reason, percent=percent,
                          grace_seconds=grace_seconds, thresholds=overrides, forced=force,
                          gate=record or None, expected=old)
    return Outcome(change, gate, old)


def rollback(store: FlagStore, workflow_types: Sequence[str] | None, *, reason: str, actor: str | None = None,
             action: str = "rollback") -> list[FlagChange]:
    """Return types to ``polling`` (``None``: every type with a flag that is not ``polling``). Never gated.

    A rollback of a type already in ``polling`` is still recorded: it is the rehearsal ``preflight``
    asks for."""
    reason = validate_reason(reason)
    actor = validate_reason(actor or default_actor(), "actor")
    if workflow_types is None:
        names = sorted(name for name, flag in store.all().items() if flag.phase != "polling")
    else:
        names = list(workflow_types)
    return [store.change(name, "polling", actor=actor, reason=reason, action=action) for name in names]
