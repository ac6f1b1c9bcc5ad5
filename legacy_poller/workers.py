"""The demo worker pool: executes dispatched tasks and writes results back through the mapping.

It plays the existing platform's workers: claim a dispatched task (dispatched → running, one
statement; ``FOR UPDATE SKIP LOCKED`` on PostgreSQL so workers do not queue behind each other),
"run" it for a random duration, then set completed or failed with the completion time from the
database clock. Failure is drawn with ``failure_rate``; retries are the scheduler's business.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter
from sqlalchemy.engine import Engine

from bridge.core.settings import WorkerSettings
from bridge.db.changes import changes_of
from bridge.db.engine import db_now, finds_a_row, read_only
from bridge.tasktable.tables import TaskTable

log = logging.getLogger(__name__)

#: SQLite: an idle worker looks on its own this often (seconds); a commit to the database wakes it sooner.
IDLE_LOOK = 5.0


@dataclass(frozen=True)
class WorkerStats:
    completed: int
    failed: int


class WorkerPool:
    def __init__(
        self,
        engine: Engine,
        tables: TaskTable,
        settings: WorkerSettings,
        *,
        registry: CollectorRegistry | None = None,
        seed: int | None = None,
    ) -> None:
        self.engine = engine
        self.tables = tables
        self.settings = settings
        self._random = random.Random(seed)
        self._random_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        registry = registry if registry is not None else CollectorRegistry()
        self._finished = Counter(
            "pollbridge_demo_worker_tasks", "Tasks the demo workers finished", ["outcome"], registry=registry
        )
        # SQLite: a claim is a write transaction and the database has one write lock, so idle workers (each
        # claiming every idle_sleep) would keep the relay and the schedulers waiting; they look first, without it.
        self._reader = read_only(engine)
        self._peek = (sa.select(tables.col("id")).where(tables.status_in("dispatched")).limit(1)
                      if engine.dialect.name == "sqlite" else None)
        # Woken by any commit about data, and by the event scheduler's dispatches (``work``: they wake no relay).
        self._changes = changes_of(engine, "data", "work")
        self._lock = threading.Lock()
        self.completed = 0
        self.failed = 0
        self.errors = 0

    def _claim_statement(self) -> sa.Update:
        tt = self.tables
        pick = (
            sa.select(tt.col("id"))
            .where(tt.status_in("dispatched"))
            .order_by(tt.col("id"))
            .limit(1)
            .with_for_update(skip_locked=True)
            .scalar_subquery()
        )
        values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("running")}
        if tt.has("attempts"):
            values[tt.mapping.columns.attempts or ""] = tt.col("attempts") + 1
        if tt.has("updated_at"):
            values[tt.mapping.columns.updated_at or ""] = db_now(tt.dialect_name)
        return (
            tt.tasks.update()
            .where(tt.col("id") == pick, tt.status_in("dispatched"))
            .values(values)
            .returning(tt.col("id"))
        )

    def _finish(self, task_id: Any, ok: bool) -> None:
        tt = self.tables
        now = db_now(tt.dialect_name)
        values: dict[str, Any] = {tt.mapping.columns.status: tt.statuses.write("completed" if ok else "failed")}
        for logical in ("completed_at", "updated_at"):
            if tt.has(logical):
                values[getattr(tt.mapping.columns, logical)] = now
        stmt = tt.tasks.update().where(tt.col("id") == task_id, tt.status_in("running"))
        with self.engine.begin() as conn:
            conn.execute(stmt.values(values))

    def work_one(self) -> bool:
        """Claim, run and finish one task; ``False`` when none was waiting."""
        if self._peek is not None and not finds_a_row(self._reader, self._peek):
            return False
        with self.engine.begin() as conn:
            task_id = conn.execute(self._claim_statement()).scalar()
        if task_id is None:
            return False
        with self._random_lock:
            duration = self._random.uniform(self.settings.min_duration, self.settings.max_duration)
            ok = self._random.random() >= self.settings.failure_rate
        if self._stop.wait(duration):
            # Asked to stop mid-task: finish it anyway so nothing is left running by us.
            pass
        self._finish(task_id, ok)
        with self._lock:
            if ok:
                self.completed += 1
            else:
                self.failed += 1
        self._finished.labels(outcome="completed" if ok else "failed").inc()
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                seen = self._changes.generation if self._changes is not None else 0
                looked = time.monotonic()
                if not self.work_one():
                    self._idle(seen, looked)
            except Exception:  # a worker survives a database hiccup, like a real one
                with self._lock:
                    self.errors += 1
                log.exception("demo worker error")
                self._stop.wait(1.0)

    def _idle(self, seen: int, looked: float) -> None:
        """After a look that found nothing. SQLite file: until a commit changes the database (a dispatch is
        one; :mod:`bridge.db.changes`), looking on its own only every :data:`IDLE_LOOK`, and never sooner than
        ``idle_sleep`` after its last look (a busy database commits all the time). Otherwise every
        ``idle_sleep``."""
        if self._changes is None:
            self._stop.wait(self.settings.idle_sleep)
            return
        deadline = looked + IDLE_LOOK
        while not self._stop.is_set() and self._changes.generation == seen and time.monotonic() < deadline:
            self._changes.wait(seen, min(0.25, deadline - time.monotonic()))  # slices: a stop is honoured
        self._stop.wait(max(0.0, looked + self.settings.idle_sleep - time.monotonic()))

    def start(self) -> None:
        for n in range(self.settings.concurrency):
            thread = threading.Thread(target=self._loop, name=f"pollbridge-worker-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()

    def stats(self) -> WorkerStats:
        with self._lock:
            return WorkerStats(self.completed, self.failed)
