"""One scan of the task table: find ready tasks, dispatch each with the shared compare-and-set.

The scan is one statement: the count of pending rows (what a poll examines, the figure that grows
with the table) joined to at most ``batch_size`` ready tasks, so an empty poll still reports how
much it looked at. Each ready task is then dispatched through :func:`bridge.tasktable.dispatch.dispatch`,
which re-checks readiness in its UPDATE, so the poller can run beside any other dispatcher; a
scan's ready tasks are dispatched with one UPDATE and one INSERT (:func:`bridge.tasktable.dispatch.dispatch_many`).

With a :class:`~bridge.flags.router.FlagRouter` the poller follows the phase of each workflow type
(:mod:`legacy_poller.routing`): it leaves ``cutover`` types out of its scan, holds back a ``selective``
canary's tasks for the grace period and records those it still finds as path ``fallback`` (each an
event-path miss, counted in ``pollbridge_fallback_misses_total``), and :meth:`LegacyPoller.sweep_once`
is the slow safety sweep over ``cutover`` types. The flags are re-read at most every router refresh
interval; while the flag store is unreadable every type is ``polling`` here.

The statements are built in :mod:`legacy_poller.queries`; the poller keeps the scans per flag set and runs them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.core.phases import Flag
from bridge.core.ratelimit import TypeLimits
from bridge.core.settings import SchedulerSettings
from bridge.flags.router import FlagRouter
from bridge.tasktable.dispatch import ReadyTask, dispatch_many
from bridge.tasktable.queries import in_flight_statement
from bridge.tasktable.tables import TaskTable
from legacy_poller.metrics import PollerMetrics
from legacy_poller.queries import repend_failed_statement, scan_statement, time_out_running_statement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScanResult:
    examined: int
    ready: int
    dispatched: int
    repended: int
    seconds: float
    fallback: int = 0
    timed_out: int = 0


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
        router: FlagRouter | None = None,
        running_timeout: float = 0.0,
        limits: SchedulerSettings | None = None,
    ) -> None:
        """``running_timeout`` (``[poller] running_timeout``): fail a task of the poller's share running longer
        than that many seconds, as the platform's own scheduler does with a task whose worker died (0: never;
        needs ``updated_at``). The event path times out the tasks it owns itself.

        ``limits``: the per-type ``rate``/``burst`` and ``max_in_flight`` of ``[scheduler.types.T]``, applied to
        the poller's own dispatches too (every path: its share, the fallback, the sweep), so that a type's
        backpressure holds whichever path dispatches. A task over a limit stays pending for a later scan."""
        self.engine = engine
        self.tables = tables
        self.batch_size = batch_size
        self.retry_failed = retry_failed and tables.has("attempts") and tables.has("max_attempts")
        self.metrics = PollerMetrics(registry if registry is not None else CollectorRegistry())
        self.router = router
        self.running_timeout = running_timeout if tables.has("updated_at") else 0.0
        self._scans: dict[tuple[str, frozenset[Flag]], sa.Select[Any] | None] = {}
        self.limits = TypeLimits(limits) if limits is not None else None
        self._in_flight = in_flight_statement(tables)

    def _flags(self) -> dict[str, Flag]:
        if self.router is None:
            return {}
        if time.monotonic() - self.router.last_refresh >= self.router.refresh_interval:
            self.router.refresh()  # no refresh thread (or a stalled one): the poller still follows the flags
        return self.router.poller_flags()

    def _scan_for(self, mode: str, flags: dict[str, Flag]) -> sa.Select[Any] | None:
        relevant = frozenset(f for f in flags.values() if f.phase in ("selective", "cutover"))
        key = (mode, relevant)
        if key not in self._scans:
            if len(self._scans) > 64:
                self._scans.clear()
            self._scans[key] = scan_statement(self.tables, mode, {f.workflow_type: f for f in relevant},
                                              self.batch_size)
        return self._scans[key]

    def scan_once(self) -> ScanResult:
        """Scan until a batch comes back short; dispatch everything the flags let it (see the module doc)."""
        flags = self._flags()
        timed_out = self._time_out_running(flags) if self.running_timeout > 0 else 0
        repended = self._repend_failed(flags) if self.retry_failed else 0
        result = self._run("scan", flags, repended)
        self.metrics.scans.inc()
        if result.ready == 0:
            self.metrics.empty_scans.inc()
        return replace(result, timed_out=timed_out) if timed_out else result

    def sweep_once(self) -> ScanResult:
        """The safety sweep: dispatch tasks of ``cutover`` types still ready after their grace period
        (each an event-path miss, path ``fallback``). A no-op without cutover types."""
        result = self._run("sweep", self._flags(), 0)
        self.metrics.sweeps.inc()
        return result

    def _run(self, mode: str, flags: dict[str, Flag], repended: int) -> ScanResult:
        started = time.perf_counter()
        scan = self._scan_for(mode, flags)
        examined = ready_total = dispatched = fallback = 0
        while scan is not None:
            with self.engine.connect() as conn:
                rows = conn.execute(scan).all()
            examined += rows[0].examined if rows else 0
            ready = [
                ReadyTask(r.task_id, r.instance_id, r.task_key, r.workflow_type, r.attempt, r.ready_at)
                for r in rows
                if r.task_id is not None
            ]
            ready_total += len(ready)
            ready, limited = self._within_limits(ready)
            missed = [task for task in ready if mode == "sweep" or self._is_fallback(flags, task)]
            regular = [task for task in ready if not (mode == "sweep" or self._is_fallback(flags, task))]
            won: list[ReadyTask] = []
            won_fallback: list[ReadyTask] = []
            if ready:
                try:
                    with self.engine.begin() as conn:
                        won = dispatch_many(conn, self.tables, regular, "poller")
                        won_fallback = dispatch_many(conn, self.tables, missed, "fallback")
                except BaseException:  # rolled back: the tokens the limits took go back
                    if self.limits is not None:
                        self.limits.refund(t.workflow_type for t in ready)
                    raise
                if self.limits is not None and len(won) + len(won_fallback) < len(ready):  # lost races
                    won_ids = {id(t) for t in (*won, *won_fallback)}  # dispatch_many returns the tasks it was given
                    self.limits.refund(t.workflow_type for t in ready if id(t) not in won_ids)
            # Counted after the commit: an observer reading the dispatch log right after sees the rows.
            dispatched += len(won) + len(won_fallback)
            fallback += len(won_fallback)
            self.metrics.lost_races.inc(len(ready) - len(won) - len(won_fallback))
            self.metrics.dispatches.labels(path="poller").inc(len(won))
            if won_fallback:
                self.metrics.dispatches.labels(path="fallback").inc(len(won_fallback))
                for task in won_fallback:
                    self.metrics.fallback_misses.labels(workflow_type=task.workflow_type or "").inc()
                log.warning("%s dispatched %d task(s) the event path missed (path fallback): %s", mode,
                            len(won_fallback), ", ".join(sorted({str(t.workflow_type) for t in won_fallback})))
            if len(ready) + limited < self.batch_size or limited:
                break  # a full batch again, or the limits left tasks that the next scan finds first
        seconds = time.perf_counter() - started
        self.metrics.rows_examined.inc(examined)
        self.metrics.scan_seconds.observe(seconds)
        self.metrics.types_left_out.set(sum(1 for f in flags.values() if f.phase == "cutover"))
        if dispatched:
            log.debug("%s dispatched %d of %d ready (%d pending examined)", mode, dispatched, ready_total, examined)
        return ScanResult(examined, ready_total, dispatched, repended, seconds, fallback)

    def _within_limits(self, ready: list[ReadyTask]) -> tuple[list[ReadyTask], int]:
        """The ready tasks the types' limits let the poller dispatch now, and how many they left."""
        if self.limits is None or not ready:
            return ready, 0
        limits = self.limits
        in_flight: dict[str | None, int] = {}
        if any(limits.capped(t.workflow_type) for t in ready):
            with self.engine.connect() as conn:
                in_flight = {k: int(v) for k, v in conn.execute(self._in_flight).all()}
        out: list[ReadyTask] = []
        left: dict[str | None, int] = {}
        for task in ready:
            if limits.admit(task.workflow_type, in_flight) is not None:
                left[task.workflow_type] = left.get(task.workflow_type, 0) + 1
                continue
            out.append(task)
        for workflow_type, n in left.items():
            self.metrics.held_back.labels(workflow_type=workflow_type or "").inc(n)
        return out, sum(left.values())

    @staticmethod
    def _is_fallback(flags: dict[str, Flag], task: ReadyTask) -> bool:
        flag = flags.get(task.workflow_type or "")
        return flag is not None and flag.poller_route(str(task.instance_id)) == "fallback"

    def _repend_failed(self, flags: dict[str, Flag]) -> int:
        """The legacy scheduler's retry: a failed task with attempts left goes back to pending."""
        stmt = repend_failed_statement(self.tables, flags)
        with self.engine.begin() as conn:
            count = conn.execute(stmt).rowcount
        self.metrics.retries.inc(count)
        return count

    def _time_out_running(self, flags: dict[str, Flag]) -> int:
        """The legacy scheduler's running timeout: a task of its share running too long is failed (then
        re-pended by the retry, attempts permitting)."""
        stmt = time_out_running_statement(self.tables, flags, self.running_timeout)
        with self.engine.begin() as conn:
            count = conn.execute(stmt).rowcount
        if count:
            self.metrics.timeouts.inc(count)
            log.info("%d task(s) ran longer than %g s: failed", count, self.running_timeout)
        return count
