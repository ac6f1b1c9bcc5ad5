"""The event scheduler's loop: consume the bus, evaluate instances, dispatch, keep timers.

One process consumes the partitions it leases (:mod:`event_scheduler.leases`) through the consumer
group ``scheduler.group``. A batch of entries is coalesced by instance and evaluated in one query
(:mod:`event_scheduler.evaluate`); entries are acknowledged only after their instances were handled.
If handling raises, the batch is retried instance by instance, and the entries of an instance that
still fails stay pending: another consumer claims them after the visibility timeout, and an entry
delivered more than ``max_deliveries`` times goes to the dead-letter store with the error. An entry
that cannot be parsed is dead-lettered at once.

Crash recovery: pending entries of a dead consumer are claimed (``claim_stale``) after the
visibility timeout; when the process acquires partitions (at start, or taking over) it catches up
from the database, evaluating every instance of those partitions that has something to do now or a
timer to rebuild, which both dispatches tasks that are ready already and rebuilds their timers.

In :meth:`EventScheduler.run` the catch-up runs on a thread of its own, in chunks, while the loop
goes on consuming: its query is O(pending tasks) and must not stall fresh events. Evaluating an
instance on both threads at once is safe (every write is a compare-and-set; the evaluator's
in-memory state is locked; the timer queue is thread-safe), and a catch-up that fails is retried
until it completed or the partitions were lost, so a cold start, a lost bus or a long outage never
strands a ready task. The loop keeps one database connection checked out (no pool pre-ping per
batch); a failure drops it and the next cycle takes a fresh, pinged one from the pool.

Nothing is written to the task table in ``polling`` and ``dual_write``: the only writes of the event path
besides a dispatch are a retry's re-pend and a running timeout, and a timer fired for them asks the router
for the task's route right before it writes. Off the dispatching route it writes nothing and looks again
after :data:`ROUTE_RECHECK` while the task still waits (the legacy scheduler usually handles it first; if
the type is promoted meanwhile, the retry still happens). Without ``pollbridge_retries`` (``[legacy]
retries``; the default beside a foreign scheduler) neither is ever done: the legacy scheduler owns them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Connection, Engine

from bridge.bus.base import Delivery, EventBus, partition_for
from bridge.capture.leadership import holder_name
from bridge.core.backoff import Backoff
from bridge.core.errors import first_line
from bridge.core.events import (
    TASK_CHANGE_TYPES,
    TASK_STATUS_CHANGED,
    TIMER_EXPIRED,
    CloudEvent,
    new_event_id,
    new_trace_id,
)
from bridge.core.mapping import DONE_STATUSES
from bridge.core.phases import EventRouter
from bridge.core.settings import SchedulerSettings
from bridge.db.engine import db_now
from bridge.tasktable.readiness import ready_predicate
from bridge.tasktable.tables import TaskTable
from event_scheduler.evaluate import Evaluation, Evaluator, Scope, retry_timer, timeout_timer
from event_scheduler.leases import lease_store
from event_scheduler.metrics import SchedulerMetrics
from event_scheduler.queries import (
    instance_of_statement,
    repend_statement,
    retry_owed_statement,
    running_since_statement,
    time_out_statement,
)
from event_scheduler.timers import Timer, TimerQueue

log = logging.getLogger(__name__)

RECENT_EVENTS = 50_000  # event ids remembered to skip duplicates cheaply (the CAS makes them harmless anyway)
SCOPED_CHANGES = ("insert", "status", "due", "signal")  # the task-row changes the capture trigger records
CATCH_UP_CHUNK = 100  # instances per catch-up evaluation
DRAIN_SECONDS = 1.0  # at most this long in one poll_once, so the loop renews its leases well within their ttl
CATCH_UP_PAUSE = 0.002  # seconds the catch-up thread yields between chunks, so the loop keeps its pace
#: Seconds before a retry or timeout timer that fired off the dispatching route looks again (the router's
#: default refresh interval is 1 s: a promotion is seen within about this long).
ROUTE_RECHECK = 2.0


class EventScheduler:
    def __init__(
        self,
        engine: Engine,
        tables: TaskTable,
        bus: EventBus,
        settings: SchedulerSettings,
        router: EventRouter,
        *,
        visibility_timeout: float = 30.0,
        registry: CollectorRegistry | None = None,
        holder: str | None = None,
        pollbridge_retries: bool = True,
    ) -> None:
        """``pollbridge_retries`` (``settings.legacy.pollbridge_retries``): whether pollbridge re-pends failed
        tasks and fails timed-out ones, on the dispatching route only; ``False`` leaves both to the legacy
        scheduler in every phase."""
        self.engine = engine
        self.tables = tables
        self.bus = bus
        self.settings = settings
        self.router = router
        self.visibility_timeout = visibility_timeout
        self.holder = holder or holder_name()
        self.metrics = SchedulerMetrics(registry if registry is not None else CollectorRegistry())
        self.evaluator = Evaluator(engine, tables, router, settings, self.metrics,
                                   pollbridge_retries=pollbridge_retries, holder=self.holder)
        self.leases = lease_store(engine, bus, self.holder, settings.lease_ttl)
        self.timers = TimerQueue(self._fire)
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._conn: Connection | None = None  # the loop's connection, only while run() runs
        #: Whether the bus handles a batch inside its take (the embedded bus on this SQLite file: _poll_inside),
        #: and, per batch so handled, what waits for its commit and its instances.
        self._in_take = bus.handles_in_take(engine)
        self._after: list[Callable[[], None]] = []
        self._inside: list[str] = []
        self._catch_up_lock = threading.Lock()
        self._catch_up_pending: set[int] = set()
        self._catch_up_thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: The bus's epochs as last seen (None: not looked yet), to notice a loss of the bus's data.
        self._epochs: dict[int, str] | None = None
        self.bus.ensure_group(settings.group)

    # --- handling ------------------------------------------------------------------------------------
    def handle(self, deliveries: Sequence[Delivery]) -> None:
        """Handle one batch; acknowledges what was handled (or dead-lettered)."""
        self.bus.ack(self.settings.group, self._handle(deliveries))

    def _handle_inside(self, conn: Connection, deliveries: list[Delivery]) -> list[Delivery]:
        """The handler :meth:`poll_once` gives :meth:`~bridge.bus.base.EventBus.read_handled`: the batch evaluated
        and dispatched on ``conn``, inside the bus's take (its writes commit with the take, or not at all). What
        waits for the commit (timers, remembered ids, metrics) is kept in ``_after`` for :meth:`_poll_inside`."""
        # Every run's instances (a take may run the handler again after one rolled back): their counts are forgotten
        # should this one roll back too.
        instances = {d.event.partitionkey for d in deliveries if d.event is not None}
        self._inside.extend(instances)
        try:
            with self.evaluator.sharing(conn) as after:
                done = self._handle(deliveries, conn, after)
        except Exception:  # rolled back with the take, whatever a later run of the same read commits
            self.evaluator.forget(sorted(instances))
            raise
        self._after = after
        return done

    def _handle(self, deliveries: Sequence[Delivery], inside: Connection | None = None,
                after: list[Callable[[], None]] | None = None) -> list[Delivery]:
        """Handle one batch; returns what to acknowledge (handled, duplicate, skipped or dead-lettered).

        ``inside`` (with ``after``): the batch is handled inside the bus's take on that connection
        (:meth:`_handle_inside`): an entry to dead-letter is not returned (so the take leaves it pending) and is
        dead-lettered after the commit (a write of the bus's own), a failure is raised (the take rolls back and
        the batch is handled apart), and what must wait for the commit goes to ``after``."""
        if not deliveries:
            return []
        started = time.perf_counter()
        done: list[Delivery] = []
        by_instance: dict[str, list[Delivery]] = {}
        traces: dict[str, str | None] = {}
        scopes: dict[str, Scope | None] = {}
        dead: Callable[[Delivery, str, str], None] = self._dead
        if after is not None:  # left pending by the take, dead-lettered (a write of the bus's own) after its commit
            def dead(d: Delivery, reason: str, kind: str) -> None:
                after.append(lambda: self._dead(d, reason, kind))
        for d in deliveries:
            if d.event is None:
                dead(d, f"unparseable entry: {d.error}", "unparseable")
                continue
            if d.deliveries > self.settings.max_deliveries:
                dead(d, f"handling failed on {d.deliveries - 1} deliveries (max {self.settings.max_deliveries})",
                     "poison")
                continue
            if d.event.id in self._recent:
                if after is None:
                    self.metrics.duplicates.inc()
                else:
                    after.append(self.metrics.duplicates.inc)
                done.append(d)
                continue
            if not self._may_matter(d.event):
                done.append(d)
                continue
            instance = d.event.partitionkey
            by_instance.setdefault(instance, []).append(d)
            traces[instance] = d.event.traceid
            scope = self._scope(d.event)
            if instance not in scopes:
                scopes[instance] = scope
            else:
                had = scopes[instance]
                scopes[instance] = None if had is None or scope is None else had | scope
        if by_instance and inside is not None:
            evaluation = self.evaluator.evaluate(list(by_instance), traces, inside, scopes)
            for items in by_instance.values():
                done.extend(items)
        elif by_instance:
            try:
                self._apply(self.evaluator.evaluate(list(by_instance), traces, self._conn, scopes), by_instance)
                for items in by_instance.values():
                    done.extend(items)
            except Exception as exc:
                self._drop_connection()
                self.metrics.handler_errors.inc()
                log.warning("batch of %d instances failed (%s); retrying one by one", len(by_instance), exc)
                for instance_id, items in by_instance.items():
                    try:
                        self._apply(self.evaluator.evaluate([instance_id], traces, scopes=scopes),
                                    {instance_id: items})
                        done.extend(items)
                    except Exception as inner:  # left pending: redelivered, then dead-lettered
                        log.warning("instance %s failed: %s: %s", instance_id, type(inner).__name__, inner)

        def settle() -> None:  # in memory, after the commit when handled inside the take
            if by_instance and inside is not None:
                self._apply(evaluation, by_instance)
            consumed: dict[str, int] = defaultdict(int)
            for d in done:
                if d.event is not None:
                    self._remember(d.event.id)
                    consumed[str(d.event.data.get("workflow_type"))] += 1
            for workflow_type, n in consumed.items():
                self.metrics.consumed.labels(workflow_type=workflow_type).inc(n)
            self.metrics.decision_latency.observe(time.perf_counter() - started)

        if after is None:
            settle()
        else:  # first: the timers and the remembered ids matter more than a metric or a dead letter failing after
            after.insert(0, settle)
        return done

    def _scope(self, event: CloudEvent) -> Scope | None:
        """What of its instance an event can have changed (None: anything, evaluate the whole instance).

        A task's own change (insert, status, due time, signal) can change that task's readiness and
        timers; a task that completed can also make the tasks depending on it ready. Nothing else in the
        instance changed with it: another task's change comes with an event of its own."""
        if event.type not in TASK_CHANGE_TYPES or event.data.get("change") not in SCOPED_CHANGES:
            return None
        key = event.data.get("task_key")
        if not isinstance(key, str) or not key:
            return None
        # A done dependency (completed, or failed or skipped for the trigger rules that count those) can
        # make its dependents ready; a task whose own change left it pending can be ready itself.
        status = self.tables.statuses.logical(event.data.get("new_status"))
        keys = frozenset((key,))
        return Scope(keys, keys if status in DONE_STATUSES else frozenset(),
                     keys if status == "pending" else frozenset())

    def _may_matter(self, event: CloudEvent) -> bool:
        """Whether an event can change what the scheduler should do for its instance.

        A task that became dispatched cannot make another task ready (only completion, failure,
        insertion, due and signal changes can); a task that started running matters only when its
        type has a running timeout. Skipping the rest halves the work of a busy instance."""
        if event.type != TASK_STATUS_CHANGED or event.data.get("change") != "status":
            return True
        status = self.tables.statuses.logical(event.data.get("new_status"))
        if status == "dispatched":
            return False
        if status == "running":
            type_settings = self.settings.for_type(event.data.get("workflow_type"))
            return self.evaluator.timeouts and type_settings.running_timeout > 0
        return True

    def _apply(self, evaluation: Evaluation, by_instance: dict[str, list[Delivery]]) -> None:
        for when, kind, key, data in evaluation.timers:
            self.timers.schedule(when, kind, key, data)
        if evaluation.timers:
            self.metrics.timers_pending.set(len(self.timers))
        if evaluation.unknown_instances:
            self.metrics.unknown.inc(sum(len(by_instance.get(i, [])) or 1 for i in evaluation.unknown_instances))
            log.info("events for unknown instance(s) acknowledged: %s", sorted(evaluation.unknown_instances)[:5])

    def _dead(self, d: Delivery, reason: str, kind: str) -> None:
        self.bus.dead_letter(self.settings.group, d, reason)
        self.metrics.dead_letters.labels(reason=kind).inc()
        log.warning("dead-lettered bus entry %s/%s: %s", d.partition, d.entry_id, reason)

    def _remember(self, event_id: str) -> None:
        self._recent[event_id] = None
        if len(self._recent) > RECENT_EVENTS:
            self._recent.popitem(last=False)

    # --- timers --------------------------------------------------------------------------------------
    def _fire(self, timer: Timer) -> None:
        self.metrics.timers_fired.labels(kind=timer.kind).inc()
        if timer.kind == "due":
            # Through the bus, so the instance's partition owner handles it in order with its other events.
            event = CloudEvent(id=new_event_id(), type=TIMER_EXPIRED, subject=timer.key, partitionkey=timer.key,
                               time=datetime.now(UTC), traceid=new_trace_id(), data={"instance_id": timer.key})
            self.bus.publish([event])
        elif timer.kind == "retry":
            self._repend(*timer.data)
        elif timer.kind == "timeout":
            self._time_out(*timer.data)
        self.metrics.timers_pending.set(len(self.timers))

    def _dispatching(self, conn: Connection, task_id: object, workflow_type: object,
                     instance_id: object) -> bool | None:
        """Whether the task is on the dispatching route now, asked right before a timer's write (a flag
        may have changed since the timer was armed); ``None`` if the task is gone. A timer armed without
        the instance id (an older one) reads it from the row."""
        if instance_id is None:
            instance_id = conn.execute(instance_of_statement(self.tables, task_id)).scalar()
            if instance_id is None:
                return None
        type_name = None if workflow_type is None else str(workflow_type)
        return self.router.event_route(type_name, str(instance_id)) == "dispatch"

    def _repend(self, task_id: object, attempts: object, workflow_type: object, instance_id: object = None) -> None:
        if not self.evaluator.retries:  # the legacy scheduler owns retries
            return
        tt = self.tables
        with self.engine.begin() as conn:
            dispatching = self._dispatching(conn, task_id, workflow_type, instance_id)
            if dispatching is None:
                return
            changed = conn.execute(repend_statement(tt, task_id, attempts)).rowcount if dispatching else 0
            owed = None if changed else conn.execute(retry_owed_statement(tt, task_id)).first()
        if changed:  # counted after the commit, so the metric never runs ahead of the database
            self.metrics.retries.labels(workflow_type=str(workflow_type)).inc()
            return
        if owed is None:  # re-pended by someone else, or out of attempts
            return
        current, failed_at = owed
        type_settings = self.settings.for_type(str(workflow_type) if workflow_type is not None else None)
        when, kind, key, data = retry_timer(type_settings, task_id, current, failed_at, workflow_type,
                                            None if instance_id is None else str(instance_id))
        if not dispatching:
            # Off the dispatching route nothing is written; the task still waits for a retry, so look again
            # (the legacy scheduler re-pends it meanwhile, or the type is promoted and the retry is ours).
            self.timers.schedule(max(when, datetime.now(UTC) + timedelta(seconds=ROUTE_RECHECK)), kind, key, data)
        elif current != attempts:
            # This timer was for an earlier attempt (a scheduler that owned the partition before kept it)
            # and kept the current attempt's from being armed: arm it now.
            self.timers.schedule(when, kind, key, data)

    def _time_out(self, task_id: object, workflow_type: object, instance_id: object = None) -> None:
        if not self.evaluator.timeouts:  # the legacy scheduler owns timeouts
            return
        tt = self.tables
        type_settings = self.settings.for_type(str(workflow_type) if workflow_type is not None else None)
        timeout = type_settings.running_timeout
        cutoff = datetime.now(UTC) - timedelta(seconds=timeout)
        if tt.dialect_name == "sqlite":
            cutoff = cutoff.replace(tzinfo=None)
        with self.engine.begin() as conn:
            dispatching = self._dispatching(conn, task_id, workflow_type, instance_id)
            if dispatching is None:
                return
            changed = conn.execute(time_out_statement(tt, task_id, cutoff)).rowcount if dispatching else 0
            # One timer per task, the earliest kept: an attempt that started running before the previous
            # attempt's timer fired has no timer of its own. Re-arm for it, or a worker that dies in
            # that attempt strands the task in running.
            running = None if changed else conn.execute(running_since_statement(tt, task_id)).first()
        if changed:
            self.metrics.timeouts.labels(workflow_type=str(workflow_type)).inc()
            log.info("task %s ran longer than %.0f s: failed", task_id, timeout)
            return
        if running is None or (dispatching and not tt.has("updated_at")):
            return
        when, kind, key, data = timeout_timer(type_settings, task_id, running[0], workflow_type,
                                              None if instance_id is None else str(instance_id))
        if not dispatching:  # nothing written off the dispatching route: look again while it still runs
            when = max(when, datetime.now(UTC) + timedelta(seconds=ROUTE_RECHECK))
        self.timers.schedule(when, kind, key, data)

    # --- catch-up ------------------------------------------------------------------------------------
    def catch_up(self, partitions: set[int], stop: threading.Event | None = None) -> int:
        """Evaluate every instance of ``partitions`` with something to do now or a timer to rebuild.

        Returns the instances evaluated. Synchronous; :meth:`run` calls it on the catch-up thread
        (``stop`` ends it early, and so does the loss of every partition asked for)."""
        if not partitions:
            return 0
        tt = self.tables
        t = tt.tasks
        # Only instances with something to do now or a timer to rebuild: a ready task, a future due
        # time, a failed task with attempts left, a running task when a type has a timeout. Pending
        # tasks waiting on dependencies get their event when a dependency completes.
        # Failed and running tasks only when pollbridge owns retries and timeouts (their timers are armed
        # whatever the route: they write only on the dispatching route, see _repend and _time_out).
        wanted = [ready_predicate(tt, t)]
        if tt.has("due_at"):
            wanted.append(sa.and_(tt.status_in("pending"), tt.col("due_at") > db_now(tt.dialect_name)))
        if self.evaluator.retries:
            wanted.append(sa.and_(tt.status_in("failed"), tt.col("attempts") < tt.col("max_attempts")))
        if self.evaluator.timeouts and any(
                ts.running_timeout > 0 for ts in (self.settings.defaults, *(s for _, s in self.settings.types))):
            wanted.append(tt.status_in("running"))
        q = sa.select(tt.col("instance_id")).distinct().where(sa.or_(*wanted))
        started = time.monotonic()
        with self.evaluator.connect() as conn:
            instances = [str(i) for i in conn.execute(q).scalars()
                         if partition_for(str(i), self.bus.partitions) in partitions]
        # One connection for every chunk on PostgreSQL (autocommit); on SQLite one per chunk, so no read
        # transaction stays open across the chunks.
        with (self.evaluator.connect() if self.engine.dialect.name == "postgresql"
              else contextlib.nullcontext()) as chunk_conn:
            for start in range(0, len(instances), CATCH_UP_CHUNK):
                if stop is not None and (stop.is_set() or not (partitions & self.leases.owned)):
                    log.info("catch-up of partitions %s interrupted", sorted(partitions))
                    return start
                chunk = instances[start:start + CATCH_UP_CHUNK]
                self._apply(self.evaluator.evaluate(chunk, conn=chunk_conn), {})
                if stop is not None:
                    time.sleep(CATCH_UP_PAUSE)
        log.info("caught up %d instance(s) on partitions %s in %.2f s", len(instances), sorted(partitions),
                 time.monotonic() - started)
        return len(instances)

    def _catch_up_later(self, partitions: set[int]) -> None:
        """Queue ``partitions`` for the catch-up thread (started if it is not running)."""
        with self._catch_up_lock:
            self._catch_up_pending |= partitions
            if self._catch_up_thread is None or not self._catch_up_thread.is_alive():
                self._catch_up_thread = threading.Thread(target=self._catch_up_worker, name="pollbridge-catch-up",
                                                         daemon=True)
                self._catch_up_thread.start()

    def _catch_up_worker(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            with self._catch_up_lock:
                todo = self._catch_up_pending & self.leases.owned
                self._catch_up_pending = set()
                if not todo:
                    self._catch_up_thread = None
                    return
            try:
                self.catch_up(todo, self._stop)
                backoff.reset()
            except Exception as exc:  # database outage: retried until done, never given up
                pause = backoff.next()
                log.warning("catch-up of partitions %s failed (%s: %s); retrying in %.1f s", sorted(todo),
                            type(exc).__name__, first_line(exc), pause)
                with self._catch_up_lock:
                    self._catch_up_pending |= todo
                self._stop.wait(pause)

    def request_catch_up(self) -> None:
        """Catch up every owned partition on the catch-up thread, e.g. when the event path became
        responsible for more instances (ready tasks produce no new event). Thread-safe; returns at once."""
        owned = set(self.leases.owned)
        if owned:
            self._catch_up_later(owned)

    def catching_up(self) -> bool:
        """Whether the catch-up thread has work queued or running."""
        with self._catch_up_lock:
            return bool(self._catch_up_pending) or self._catch_up_thread is not None

    # --- the loop ------------------------------------------------------------------------------------
    def poll_once(self, block: float | None = None) -> int:
        """Read from the owned partitions and handle what comes, until a read finds nothing within
        ``block`` or :data:`DRAIN_SECONDS` have passed (for tests and ``run``); returns how many entries
        were handled. Each batch's acknowledgements go with the next read (one round trip fewer); all
        are made before it returns."""
        owned = sorted(self.leases.owned)
        if not owned:
            return 0
        group, size = self.settings.group, self.settings.batch_size
        wait = self.settings.block if block is None else block
        if self._in_take:
            return self._poll_inside(owned, wait)
        deliveries = self.bus.read(group, self.holder, owned, size, wait)
        deadline = time.monotonic() + DRAIN_SECONDS
        handled = 0
        while deliveries:
            handled += len(deliveries)
            done = self._handle(deliveries)
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # back to the loop: leases, stale entries, lag
                self.bus.ack(group, done)
                break
            deliveries = self.bus.ack_and_read(group, done, self.holder, owned, size, min(wait, remaining))
        return handled

    def _poll_inside(self, owned: list[int], wait: float) -> int:
        """:meth:`poll_once` where the bus handles a batch inside its take (the embedded bus on this SQLite file):
        each batch's evaluation and dispatch in the take's one write transaction, which acknowledges what they
        handled (`bench.cost`, embedded: three write transactions per batch before). A batch whose handling failed
        inside the take was rolled back and taken again, pending: it is handled apart and acknowledged with the
        next read."""
        group, size = self.settings.group, self.settings.batch_size
        deadline = time.monotonic() + DRAIN_SECONDS
        handled, block = 0, wait
        acks: list[Delivery] = []
        while True:
            self._after, self._inside = [], []
            try:
                got, inside = self.bus.read_handled(group, self.holder, owned, size, block, self._handle_inside, acks)
            except Exception:
                self.evaluator.forget(self._inside)
                raise
            acks = []
            if not got:
                return handled
            handled += len(got)
            if inside:
                for effect in self._after:  # each on its own: the batch is committed whatever one of them does
                    try:
                        effect()
                    except Exception as exc:
                        log.warning("after a batch handled in the take: %s: %s", type(exc).__name__, first_line(exc))
            else:  # rolled back: counts that may include what did not commit are read again
                self.evaluator.forget(self._inside)
                self.metrics.handler_errors.inc()
                acks = self._handle(got)
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # back to the loop: leases, stale entries, lag
                self.bus.ack(group, acks)
                return handled
            block = min(wait, remaining)

    def claim_stale(self) -> int:
        owned = sorted(self.leases.owned)
        if not owned:
            return 0
        claimed = self.bus.claim_stale(self.settings.group, self.holder, owned, self.visibility_timeout,
                                       self.settings.batch_size)
        self.handle(claimed)
        return len(claimed)

    def refresh_leases(self, background: bool = False) -> None:
        """Renew and rebalance the leases; catch up on acquired partitions (on the catch-up thread when
        ``background``, else before returning)."""
        acquired, lost = self.leases.refresh(self._conn)
        self.metrics.partitions_owned.set(len(self.leases.owned))
        if lost:
            log.info("scheduler %s released partitions %s", self.holder, sorted(lost))
        if acquired:
            log.info("scheduler %s acquired partitions %s", self.holder, sorted(acquired))
            if background:
                # Queued before the claim: a claim that fails (the cycle is retried, but the partitions are
                # owned now and the next refresh acquires nothing) must not lose the catch-up with it.
                self._catch_up_later(acquired)
                self.claim_stale()
            else:
                try:
                    self.claim_stale()
                finally:
                    self.catch_up(acquired)

    def check_bus_epochs(self) -> set[int]:
        """Notice that the bus lost the data of partitions (their epochs changed: Redis flushed or restarted
        empty, a cluster shard lost, RabbitMQ's data gone); the owned ones among them are queued for catch-up.

        The relay republishes the lost task events from its outbox, with their ids; but what the scheduler itself
        put on the bus is in no outbox (a due timer fires by publishing ``timer.expired``), and a republished
        event this process remembers handling would be skipped as a duplicate. So the remembered event ids are
        forgotten and every owned partition that lost its data is evaluated from the database, as when it was
        acquired (found by the RabbitMQ broker-wipe fault test: a timer event published just before the wipe
        was lost and its task never dispatched). Bus commands only, no database statement; returns the owned
        partitions queued."""
        epochs = self.bus.epochs()
        previous, self._epochs = self._epochs, epochs
        if previous is None:
            return set()
        changed = {p for p, token in epochs.items() if previous.get(p) not in (None, token)}
        if not changed:
            return set()
        self._recent.clear()
        lost = changed & set(self.leases.owned)
        self.metrics.bus_resets.inc()
        log.warning("the bus lost the data of partition(s) %s (epoch changed): remembered event ids forgotten; "
                    "catching up owned partition(s) %s from the database", sorted(changed), sorted(lost))
        if lost:
            self._catch_up_later(lost)
        return lost

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def run(self, stop: threading.Event) -> None:
        self.timers.start()
        self._stop.clear()
        backoff = Backoff()
        next_lease = next_claim = next_lag = 0.0
        try:
            while not stop.is_set():
                try:
                    if self._conn is None and self.engine.dialect.name == "postgresql":
                        # Autocommit: each statement sees the latest commits. (A connection kept on SQLite
                        # would keep one read transaction, and its snapshot, open.)
                        self._conn = self.evaluator.connect()
                    now = time.monotonic()
                    if now >= next_lease:
                        self.refresh_leases(background=True)
                        self.check_bus_epochs()  # with the leases' round: bus commands only, no statement
                        next_lease = now + self.settings.lease_ttl / 3
                    if now >= next_claim:
                        self.claim_stale()
                        next_claim = now + self.settings.claim_interval
                    if now >= next_lag:
                        for partition, lag in self.bus.lag(self.settings.group).items():
                            self.metrics.lag.labels(partition=str(partition)).set(lag)
                        next_lag = now + 5.0
                    if not self.leases.owned:
                        stop.wait(min(1.0, self.settings.lease_ttl / 3))
                        continue
                    self.poll_once()
                    backoff.reset()
                except Exception as exc:  # database or bus outage: back off and retry
                    self._drop_connection()
                    pause = backoff.next()
                    log.warning("scheduler cycle failed (%s: %s); retrying in %.1f s", type(exc).__name__,
                                first_line(exc), pause)
                    stop.wait(pause)
        finally:
            self._stop.set()
            thread = self._catch_up_thread
            if thread is not None:
                thread.join(10)
            self._drop_connection()
            self.timers.stop()
            try:
                self.leases.release_all()
            except Exception:
                log.warning("could not release partition leases; they expire in %.0f s", self.settings.lease_ttl)
