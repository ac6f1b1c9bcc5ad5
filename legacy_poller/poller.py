"""One scan of the task table: find ready tasks, dispatch each with the shared compare-and-set.

The scan is one statement: the count of pending rows (what a poll examines, the figure that grows
with the table) joined to at most ``batch_size`` ready tasks, so an empty poll still reports how
much it looked at. Each ready task is then dispatched through :func:`bridge.dispatch.dispatch`,
which re-checks readiness in its UPDATE, so the poller can run beside any other dispatcher; a
scan's ready tasks are dispatched with one UPDATE and one INSERT (:func:`bridge.dispatch.dispatch_many`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.db import db_now
from bridge.dispatch import ReadyTask, dispatch_many
from bridge.readiness import ready_predicate, ready_since
from bridge.tasktable import TaskTable
from legacy_poller.metrics import PollerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScanResult:
    examined: int
    ready: int
    dispatched: int
    repended: int
    seconds: float


class LegacyPoller:
    """The reference poller. Thread-compatible: one scan at a time per instance."""

    def __init__(
        self,
        engine: Engine,
        tables: TaskTable,
        *,
        batch_size: int = 500,
        registry: CollectorRegistry | None = None,
        retry_failed: bool = True,
    ) -> None:
        self.engine = engine
        self.tables = tables
        self.batch_size = batch_size
        self.retry_failed = retry_failed and tables.has("attempts") and tables.has("max_attempts")
        self.metrics = PollerMetrics(registry if registry is not None else CollectorRegistry())
        self._scan = self._build_scan()

    def _build_scan(self) -> sa.Select[Any]:
        tt = self.tables
        t = tt.tasks
        src, workflow_type = tt.workflow_type_source(t)
        attempt = (tt.col("attempts") + 1) if tt.has("attempts") else sa.null()
        ready = (
            sa.select(
                tt.col("id").label("task_id"),
                tt.col("instance_id").label("instance_id"),
                tt.col("task_key").label("task_key"),
                workflow_type.label("workflow_type"),
                attempt.label("attempt"),
                ready_since(tt, t).label("ready_at"),
            )
            .select_from(src)
            .where(ready_predicate(tt, t))
            .order_by(tt.col("id"))
            .limit(self.batch_size)
            .subquery("pb_ready")
        )
        pending = (
            sa.select(sa.func.count().label("examined"))
            .select_from(t)
            .where(tt.col("status") == tt.statuses.pending)
            .subquery("pb_pending")
        )
        return sa.select(pending.c.examined, *ready.c).select_from(pending.outerjoin(ready, sa.true()))

    def scan_once(self) -> ScanResult:
        """Scan until a batch comes back short; dispatch everything found ready."""
        started = time.perf_counter()
        examined = ready_total = dispatched = 0
        repended = self._repend_failed() if self.retry_failed else 0
        while True:
            with self.engine.connect() as conn:
                rows = conn.execute(self._scan).all()
            examined += rows[0].examined if rows else 0
            ready = [
                ReadyTask(r.task_id, r.instance_id, r.task_key, r.workflow_type, r.attempt, r.ready_at)
                for r in rows
                if r.task_id is not None
            ]
            ready_total += len(ready)
            won = 0
            if ready:
                with self.engine.begin() as conn:
                    won = len(dispatch_many(conn, self.tables, ready, "poller"))
            dispatched += won
            self.metrics.lost_races.inc(len(ready) - won)
            if len(ready) < self.batch_size:
                break
        seconds = time.perf_counter() - started
        self.metrics.scans.inc()
        self.metrics.rows_examined.inc(examined)
        self.metrics.dispatches.labels(path="poller").inc(dispatched)
        self.metrics.scan_seconds.observe(seconds)
        if ready_total == 0:
            self.metrics.empty_scans.inc()
        if dispatched:
            log.debug("scan dispatched %d of %d ready (%d pending examined)", dispatched, ready_total, examined)
        return ScanResult(examined, ready_total, dispatched, repended, seconds)

    def _repend_failed(self) -> int:
        """The legacy scheduler's retry: a failed task with attempts left goes back to pending."""
        tt = self.tables
        values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.pending}
        if tt.has("updated_at"):
            values[tt.mapping.columns.updated_at or ""] = db_now(tt.dialect_name)
        stmt = (
            tt.tasks.update()
            .where(tt.col("status") == tt.statuses.failed, tt.col("attempts") < tt.col("max_attempts"))
            .values(values)
        )
        with self.engine.begin() as conn:
            count = conn.execute(stmt).rowcount
        self.metrics.retries.inc(count)
        return count
