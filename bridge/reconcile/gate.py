"""The promotion gate's verdict on evidence: the criteria a type's reconciled counts must meet.

Shared by the reconcile report (its verdict per type) and by promotion (:mod:`bridge.rollout.promotion`),
which adds the capture check for ``dual_write`` and the window of the type's current phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bridge.core.phases import Flag
from bridge.core.settings import GateSettings
from bridge.reconcile.classify import miss_rate_upper


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


def judge(counts: dict[str, int], compared: int, flag: Flag, settings: GateSettings) -> tuple[Criterion, ...]:
    """The evidence criteria of a gate (and of a reconcile report's verdict) for one type's counts."""
    missing = counts.get("missing", 0)
    min_tasks = int(threshold(flag, settings, "min_tasks"))
    budget = threshold(flag, settings, "miss_budget")
    upper = miss_rate_upper(missing, compared, settings.confidence)
    return (
        Criterion("min_tasks", compared >= min_tasks, f"{compared} compared task(s), need {min_tasks}"),
        Criterion("no_early", counts.get("early", 0) == 0, f"{counts.get('early', 0)} early action(s)"),
        Criterion("no_duplicate", counts.get("duplicate", 0) == 0,
                  f"{counts.get('duplicate', 0)} duplicate dispatch(es)"),
        Criterion("miss_rate", upper < budget,
                  f"{missing} miss(es) in {compared}: upper {settings.confidence:.0%} bound {upper:.4%}, "
                  f"budget {budget:.4%}"),
    )
