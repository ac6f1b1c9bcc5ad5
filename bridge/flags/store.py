"""The flag store: the phase of each workflow type in the database, and every change in an audit trail.

A type without a row is ``polling``. Changes go through :meth:`FlagStore.change`, which validates the
input, writes the flag and its audit row in one transaction, and refuses to write if the flag changed
since the caller read it (two operators, or the guardian, racing): nothing is ever changed on a
refused or invalid request. Whether a promotion is allowed (one step at a time, the reconciler's
gate) is decided by :mod:`bridge.rollout.promotion`, not here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from bridge.core.errors import FlagError, FlagStoreUnavailable, first_line
from bridge.core.phases import PHASES, Flag, Phase
from bridge.db.clock import as_utc
from bridge.db.engine import db_now, read_only
from bridge.db.schema import flag_audit, flags

TYPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,199}")
#: Per-type overrides a flag may carry (``flags set --threshold NAME=VALUE``): gate and guardian settings.
THRESHOLDS = ("min_tasks", "miss_budget", "objective", "tolerance", "max_outbox_age", "max_lag", "max_miss_rate",
              "max_depth", "max_dispatches")
#: Thresholds that are whole numbers (the guards' limits, shared by every scheduler process through the flag).
INTEGER_THRESHOLDS = ("max_depth", "max_dispatches")
ACTIONS = ("set", "rollback", "guardian")
#: PostgreSQL: every flag change NOTIFYs this channel (payload: the workflow type) when it commits.
FLAGS_CHANNEL = "pollbridge_flags"


@dataclass(frozen=True)
class FlagChange:
    """One row of the audit trail."""

    id: int
    workflow_type: str
    action: str
    actor: str
    reason: str
    old_phase: str
    new_phase: str
    old_percent: float | None
    new_percent: float | None
    forced: bool
    gate: dict[str, Any] | None
    changed_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "workflow_type": self.workflow_type, "action": self.action, "actor": self.actor,
            "reason": self.reason, "old_phase": self.old_phase, "new_phase": self.new_phase,
            "old_percent": self.old_percent, "new_percent": self.new_percent, "forced": self.forced,
            "gate": self.gate, "changed_at": _iso(self.changed_at),
        }


def validate_type_name(name: str) -> str:
    if not isinstance(name, str) or not TYPE_NAME.fullmatch(name):
        raise FlagError(f"invalid workflow type name {name!r}: use 1-200 letters, digits and _ . : / @ + - "
                        "(starting with a letter or digit)")
    return name


def validate_phase(phase: str) -> Phase:
    if phase not in PHASES:
        raise FlagError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
    return phase


def validate_percent(percent: float | None, phase: str) -> float | None:
    if percent is None:
        return None
    if phase != "selective":
        raise FlagError(f"--percent applies to the selective phase only, not {phase}")
    if isinstance(percent, bool) or not isinstance(percent, int | float) or not math.isfinite(percent) \
            or not 0 <= percent <= 100:
        raise FlagError(f"percentage must be between 0 and 100, got {percent!r}")
    if abs(percent * 100 - round(percent * 100)) > 1e-6:
        raise FlagError(f"percentage {percent!r} has more than two decimals; the hash has 10,000 buckets")
    return float(percent)


def validate_reason(reason: str | None, what: str = "reason") -> str:
    text = (reason or "").strip()
    if not text:
        raise FlagError(f"a {what} is required (--{what}): every flag change is audited with why it was made")
    if len(text) > 2000:
        raise FlagError(f"{what} is too long ({len(text)} characters; at most 2000)")
    return text


def validate_thresholds(raw: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in raw.items():
        if name not in THRESHOLDS:
            raise FlagError(f"unknown threshold {name!r}; expected some of: {', '.join(THRESHOLDS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise FlagError(f"threshold {name} must be a positive number, got {value!r}")
        if name in INTEGER_THRESHOLDS and value != int(value):
            raise FlagError(f"threshold {name} must be a whole number, got {value!r}")
        if name in ("miss_budget", "max_miss_rate") and value >= 1:
            raise FlagError(f"threshold {name} is a rate and must be below 1, got {value!r}")
        out[name] = float(value)
    return out


class FlagStore:
    """Reads and writes ``pollbridge_flags`` and ``pollbridge_flag_audit``. Thread-safe (uses the engine)."""

    def __init__(self, engine: Engine, *, default_grace: float = 5.0) -> None:
        self.engine = engine
        self.default_grace = default_grace

    # --- reads ---------------------------------------------------------------------------------------
    def all(self) -> dict[str, Flag]:
        """Every stored flag; raises :class:`FlagStoreUnavailable` when the store cannot be read."""
        try:
            with read_only(self.engine).connect() as conn:
                rows = conn.execute(sa.select(flags)).all()
        except SQLAlchemyError as exc:
            raise FlagStoreUnavailable(f"cannot read the flag store: {first_line(exc)}") from None
        return {r.workflow_type: _flag(r) for r in rows}

    def get(self, workflow_type: str) -> Flag:
        return self.all().get(workflow_type) or Flag(workflow_type, grace_seconds=self.default_grace)

    def history(self, workflow_type: str | None = None, *, limit: int = 1000) -> list[FlagChange]:
        """Changes, oldest first (the most recent ``limit``)."""
        q = sa.select(flag_audit).order_by(flag_audit.c.id.desc()).limit(limit)
        if workflow_type is not None:
            q = q.where(flag_audit.c.workflow_type == workflow_type)
        with read_only(self.engine).connect() as conn:
            rows = conn.execute(q).all()
        return [_change(r) for r in reversed(rows)]

    def last_rollback(self, workflow_type: str) -> datetime | None:
        """When ``rollback`` last ran for the type (the rehearsal ``preflight`` asks for)."""
        q = sa.select(sa.func.max(flag_audit.c.changed_at)).where(
            flag_audit.c.workflow_type == workflow_type, flag_audit.c.action == "rollback")
        with read_only(self.engine).connect() as conn:
            value = conn.execute(q).scalar()
        return as_utc(value)

    # --- writes --------------------------------------------------------------------------------------
    def change(
        self,
        workflow_type: str,
        phase: str,
        *,
        actor: str,
        reason: str,
        percent: float | None = None,
        grace_seconds: float | None = None,
        thresholds: Mapping[str, Any] | None = None,
        action: str = "set",
        forced: bool = False,
        gate: dict[str, Any] | None = None,
        expected: Flag | None = None,
    ) -> FlagChange:
        """Write the flag and its audit row in one transaction; return the audit row.

        ``expected``: the flag the caller based its decision on; if the stored one differs (another
        change landed meanwhile) nothing is written and :class:`FlagError` says to retry."""
        validate_type_name(workflow_type)
        new_phase = validate_phase(phase)
        percent = validate_percent(percent, new_phase)
        reason = validate_reason(reason)
        actor = validate_reason(actor, "actor")
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}")
        if grace_seconds is not None and (not math.isfinite(grace_seconds) or grace_seconds <= 0):
            raise FlagError(f"grace must be a positive number of seconds, got {grace_seconds!r}")
        overrides = validate_thresholds(thresholds or {})
        now = db_now(self.engine.dialect.name)
        with self.engine.begin() as conn:
            q = sa.select(flags).where(flags.c.workflow_type == workflow_type)
            if conn.dialect.name == "postgresql":
                q = q.with_for_update()
            row = conn.execute(q).first()
            old = _flag(row) if row is not None else Flag(workflow_type, grace_seconds=self.default_grace)
            if expected is not None and (old.phase, old.percent) != (expected.phase, expected.percent):
                raise FlagError(f"the flag of {workflow_type} changed meanwhile (now {describe(old)}); "
                                "look again and retry")
            merged = {**old.thresholds, **overrides}
            values = {
                "phase": new_phase, "percent": percent,
                "grace_seconds": grace_seconds if grace_seconds is not None else old.grace_seconds,
                "thresholds": json.dumps(merged, sort_keys=True) if merged else None,
                "updated_at": now, "updated_by": actor,
            }
            if row is None:
                conn.execute(flags.insert().values(workflow_type=workflow_type, **values))
            else:
                conn.execute(flags.update().where(flags.c.workflow_type == workflow_type).values(**values))
            if conn.dialect.name == "postgresql":
                # Delivered at commit to every running router (bridge.flags.router), which re-reads at once.
                conn.execute(sa.select(sa.func.pg_notify(FLAGS_CHANNEL, workflow_type)))
            inserted = conn.execute(
                flag_audit.insert().values(
                    workflow_type=workflow_type, action=action, actor=actor, reason=reason,
                    old_phase=old.phase, new_phase=new_phase, old_percent=old.percent, new_percent=percent,
                    forced=forced, gate=json.dumps(gate, sort_keys=True, default=str) if gate else None,
                    changed_at=now,
                ).returning(*flag_audit.c)
            ).one()
        return _change(inserted)


def describe(flag: Flag) -> str:
    if flag.phase == "selective" and flag.percent is not None:
        return f"selective {flag.percent:g}%"
    return flag.phase


def _flag(r: Any) -> Flag:
    thresholds = json.loads(r.thresholds) if r.thresholds else {}
    return Flag(r.workflow_type, r.phase, r.percent, float(r.grace_seconds), thresholds,
                as_utc(r.updated_at), r.updated_by)


def _change(r: Any) -> FlagChange:
    return FlagChange(r.id, r.workflow_type, r.action, r.actor, r.reason, r.old_phase, r.new_phase,
                      r.old_percent, r.new_percent, bool(r.forced), json.loads(r.gate) if r.gate else None,
                      as_utc(r.changed_at) or datetime.min.replace(tzinfo=UTC))



def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
