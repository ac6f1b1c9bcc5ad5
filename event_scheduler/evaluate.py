"""Evaluating instances: from "something changed in these instances" to dispatches, decisions and timers.

The database is the source of truth: an event only says *where to look*. One query reads the
non-terminal tasks of a batch of instances with their readiness computed by the shared readiness
SQL, so a stale, duplicated or reordered event can never cause a wrong dispatch, and the work is
proportional to the instances touched, never to the task table. Then, per task:

* ready → dispatch through the shared compare-and-set (route ``dispatch``), or record a shadow
  decision (route ``shadow``), or nothing (route ``off``);
* pending with a future due time → a ``due`` timer for the instance;
* failed with attempts left → a ``retry`` timer after an exponential backoff with jitter;
* running with a timeout for its type → a ``timeout`` timer.

Retry and timeout timers are armed only when pollbridge owns retries (``[legacy] retries``; never by
default beside a foreign scheduler), and armed whatever the route: the scheduler checks the route when
one fires, right before it writes, and writes only on the dispatching route (a flag may change between
arming and firing; a timer armed in ``polling`` is what retries the task once the type is in ``cutover``).

In a shadow phase the event path decides on the facts the events carry, not on the row's status at
evaluation time: a task an event of the batch made ready that the legacy scheduler took a few
milliseconds before the evaluation (a lost race) still gets its shadow decision, once per attempt
(:func:`event_scheduler.queries.taken_statement`, one more round trip, only for the instances in a
shadow phase whose events carry such facts).

Round trips per batch on PostgreSQL: one evaluation query and, if something is ready, one dispatch
statement. Once the evaluator has seen a type on the dispatching route, the two are one statement
(:func:`event_scheduler.queries.evaluate_and_dispatch_statement`) for the ready tasks that need no decision
in Python (see :meth:`Evaluator._combined`). They run on the caller's connection (the scheduler's loop
keeps one checked out, so no pool pre-ping per batch), each with a constant SQL text (instance and task ids
travel as arrays), so they are compiled once and prepared by the driver. An in-flight count is read only
for a type that has ``max_in_flight``, an instance's dispatch count (the depth guard) once per instance.
The statements are built from the mapping in :mod:`event_scheduler.queries`; the evaluator only runs them.

An evaluator may be used from two threads at once (the scheduler's loop and its catch-up): the
in-memory state (token buckets, dispatch counts) is guarded by a lock; the database state needs
none, every write being a compare-and-set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from bridge.capture.leadership import holder_name
from bridge.core.errors import MappingError
from bridge.core.events import new_trace_id
from bridge.core.phases import EventRouter
from bridge.core.ratelimit import TypeLimits
from bridge.core.settings import SchedulerSettings, TypeSettings
from bridge.db.changes import add_topics
from bridge.db.clock import as_utc
from bridge.db.driver import DriverStatement
from bridge.db.engine import about, autocommit
from bridge.tasktable.dispatch import ReadyTask, dispatch_many, skip_many
from bridge.tasktable.review import Parking, park
from bridge.tasktable.tables import TaskTable
from event_scheduler.metrics import SchedulerMetrics
from event_scheduler.queries import EvaluatorQueries

log = logging.getLogger(__name__)

TimerSpec = tuple[datetime, str, str, tuple[object, ...]]

#: The soonest a due timer fires: a task the database still finds not due is looked at again after this.
DUE_RECHECK = 0.02

#: A ready task whose compare-and-set matched nothing is looked at again after this many seconds.
LOST_RACE_RECHECK = 0.5

#: Instances whose dispatch count the dispatch-count guard keeps in memory, and tasks whose backpressure
#: hold this process keeps (least recently used dropped).
COUNT_CACHE = 100_000

#: A ready task parked in the review queue while it stays pending (a mapping without a review status) is
#: looked at again after this many seconds. A release writes nothing to the task table; it wakes the
#: instance through a row in pollbridge's outbox, and this look is the fallback should that row be lost.
REVIEW_RECHECK = 10.0


@dataclass(frozen=True)
class Scope:
    """The part of an instance an event can have changed: the tasks ``keys`` themselves (a task inserted,
    re-pended, failed, started, its due time or signal changed) and the tasks depending on one of
    ``dependents_of`` (a task reached a done status: completed, failed or skipped). Everything else in the
    instance is as it was, and a change to it brings an event of its own; timers, catch-up and other events
    evaluate the whole instance.

    ``fresh``: the keys whose own event said they were pending (inserted, re-pended, due time or signal
    changed). With ``dependents_of`` these are the facts the events carry: in a shadow phase a task they
    concern gets its decision even if the legacy scheduler took it before the evaluation (a lost race)."""

    keys: frozenset[str]
    dependents_of: frozenset[str] = frozenset()
    fresh: frozenset[str] = frozenset()

    def __or__(self, other: Scope) -> Scope:
        return Scope(self.keys | other.keys, self.dependents_of | other.dependents_of, self.fresh | other.fresh)


@dataclass
class Evaluation:
    dispatched: list[ReadyTask] = field(default_factory=list)
    decided: list[ReadyTask] = field(default_factory=list)
    held_back: list[ReadyTask] = field(default_factory=list)
    stopped: list[ReadyTask] = field(default_factory=list)
    timers: list[TimerSpec] = field(default_factory=list)
    unknown_instances: set[str] = field(default_factory=set)
    skipped: list[Any] = field(default_factory=list)  # ids of tasks whose skip this evaluation propagated


def backoff_delay(settings: TypeSettings, task_id: object, attempts: int) -> float:
    """Exponential backoff with jitter, deterministic per (task, attempt) so re-evaluation agrees."""
    base = min(settings.retry_max, settings.retry_base * (2 ** max(attempts - 1, 0)))
    jitter = random.Random(f"{task_id}:{attempts}").uniform(-settings.retry_jitter, settings.retry_jitter)
    return float(max(0.0, base * (1 + jitter)))


def retry_timer(settings: TypeSettings, task_id: object, attempts: int, failed_at: Any,
                workflow_type: object, instance_id: str | None = None) -> TimerSpec:
    """The timer that re-pends a task failed at ``failed_at`` (its ``updated_at``) after ``attempts``.
    ``instance_id`` lets the scheduler ask the router for the task's route when it fires."""
    since = as_utc(failed_at) or datetime.now(UTC)
    return (since + timedelta(seconds=backoff_delay(settings, task_id, attempts)), "retry", str(task_id),
            (task_id, attempts, workflow_type, instance_id))


def timeout_timer(settings: TypeSettings, task_id: object, running_since: Any, workflow_type: object,
                  instance_id: str | None = None) -> TimerSpec:
    """The timer that fails a task still running ``settings.running_timeout`` after ``running_since``."""
    since = as_utc(running_since) or datetime.now(UTC)
    return (since + timedelta(seconds=settings.running_timeout), "timeout", str(task_id),
            (task_id, workflow_type, instance_id))


#: Session settings for the scheduler's PostgreSQL connections (see :func:`_session_settings`).
SESSION_SETTINGS = "SET jit = off"
#: The evaluator's own connections (:meth:`Evaluator.connect`) only: generic plans for prepared statements.
GENERIC_PLANS = "SET plan_cache_mode = force_generic_plan"
_GENERIC_MARK = "pollbridge_generic_plans"


def _session_settings(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Pool checkout hook, once per connection: no JIT.

    The readiness SQL calls ``json_array_elements_text`` per task, which the planner costs at 100 rows a
    call, so a batch of a hundred instances is estimated above ``jit_above_cost`` and JIT-compiled:
    measured 2.4 s of compilation for a 5 ms query. Set in autocommit, so no rollback undoes it.

    (The driver prepares the statements run often and PostgreSQL may then use a generic plan, costed for
    an ``ANY(array)`` of ten elements. That is fine for these statements as long as nothing is computed
    per row from a parameter: the scope document is parsed once, in an InitPlan. The evaluator's own
    connections force it: :meth:`Evaluator.connect`.)"""
    if record.info.get("pollbridge_session_settings"):
        return
    autocommit_was = dbapi_conn.autocommit
    dbapi_conn.autocommit = True
    try:
        dbapi_conn.execute(SESSION_SETTINGS)
    finally:
        dbapi_conn.autocommit = autocommit_was
    record.info["pollbridge_session_settings"] = True


def _default_plans(dbapi_conn: Any, record: Any) -> None:
    """Pool checkin hook: a connection the evaluator set to generic plans goes back to the pool as it came
    (other users of the engine plan as PostgreSQL's ``auto`` mode does)."""
    if not record.info.pop(_GENERIC_MARK, False):
        return
    autocommit_was = dbapi_conn.autocommit
    try:
        dbapi_conn.autocommit = True
        dbapi_conn.execute("RESET plan_cache_mode")
    except Exception:  # a broken connection is not reused: the pool's ping finds it
        log.debug("could not reset plan_cache_mode on checkin", exc_info=True)
    else:
        dbapi_conn.autocommit = autocommit_was


def tune_sessions(engine: Engine) -> None:
    """Apply :data:`SESSION_SETTINGS` to every connection ``engine`` hands out, and undo the evaluator's own
    setting when its connections go back (idempotent; PostgreSQL only)."""
    if engine.dialect.name == "postgresql" and not sa.event.contains(engine, "checkout", _session_settings):
        sa.event.listen(engine, "checkout", _session_settings)
        sa.event.listen(engine, "checkin", _default_plans)


def writable(tt: TaskTable, status: str) -> bool:
    """Whether pollbridge has a value to write for logical ``status`` (a status mapped to NULL alone has none)."""
    try:
        tt.statuses.write(status)
    except MappingError:
        return False
    return True


class Evaluator:
    def __init__(self, engine: Engine, tables: TaskTable, router: EventRouter, settings: SchedulerSettings,
                 metrics: SchedulerMetrics, queries: EvaluatorQueries | None = None, *,
                 pollbridge_retries: bool = True, holder: str | None = None) -> None:
        """``holder`` names this process in the holds and the review queue. ``pollbridge_retries``
        (``[legacy] retries``): whether pollbridge re-pends failed tasks and fails
        timed-out ones on the dispatching route; without it no retry or timeout timer is armed."""
        self.engine = engine
        self.tables = tables
        self.router = router
        self.settings = settings
        self.metrics = metrics
        self.retries = pollbridge_retries and tables.has("attempts") and tables.has("max_attempts") \
            and writable(tables, "pending")
        self.timeouts = pollbridge_retries and writable(tables, "failed")
        tune_sessions(engine)
        self._single = autocommit(engine)
        self._dispatches = about(engine, "work")
        self._pg = engine.dialect.name == "postgresql"
        self.holder = holder or holder_name()
        self._lock = threading.Lock()  # guards _counts and _held
        self.limits = TypeLimits(settings)
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._held: OrderedDict[str, bool] = OrderedDict()
        self._types: set[str] = set()  # the workflow types seen in evaluations (see _combined)
        #: Per thread, while :meth:`sharing` runs: the caller's write transaction and what waits for its commit.
        self._shared = threading.local()
        # The SQL, built from the mapping once (event_scheduler.queries); the evaluator only runs it.
        self.queries = queries if queries is not None else EvaluatorQueries.build(tables, engine.dialect)

    @property
    def _query(self) -> sa.Select[Any]:
        """The evaluation statement (for ``bench.evaluate_cost`` and the driver tests)."""
        return self.queries.evaluation

    @property
    def _query_run(self) -> DriverStatement:
        """The evaluation through the driver (for ``bench.evaluate_cost`` and the driver tests)."""
        return self.queries.evaluation_run

    def connect(self) -> Connection:
        """A connection for :meth:`evaluate` (autocommit on PostgreSQL); the caller closes it.

        On PostgreSQL it uses generic plans for its prepared statements (``plan_cache_mode``), reset when it goes
        back to the pool. PostgreSQL's ``auto`` mode chose the generic plan for the evaluation but kept planning
        the lost-race statement afresh every time: beside Airflow (readiness through views over
        ``serialized_dag``) it spent 2.1 ms planning a statement that runs in 0.8 ms; with the generic plan
        forced it took 1.6 ms instead of 3.6 ms per run, and the evaluation 1.8 ms either way (7.6 ms with custom
        plans). Only these connections: the engine's other users keep ``auto``."""
        conn = self._single.connect()
        if self._pg:
            conn.exec_driver_sql(GENERIC_PLANS)
            conn.connection.info[_GENERIC_MARK] = True
        return conn

    @contextlib.contextmanager
    def sharing(self, conn: Connection) -> Iterator[list[Callable[[], None]]]:
        """SQLite: this thread's evaluations run inside ``conn``'s open write transaction (the bus's take,
        :meth:`bridge.bus.base.EventBus.read_handled`): their reads and writes go through it, and what must wait
        for the commit (metrics, logs) is collected in the list it yields, for the caller to run once the
        transaction committed. Should it roll back, the caller calls :meth:`forget` for the instances."""
        after: list[Callable[[], None]] = []
        self._shared.conn, self._shared.after = conn, after
        try:
            yield after
        finally:
            self._shared.conn = self._shared.after = None

    def forget(self, instance_ids: Sequence[str]) -> None:
        """Drop the dispatch counts kept for ``instance_ids`` (read again from the dispatch log when next needed):
        after a shared transaction rolled back, they may count dispatches that never committed."""
        with self._lock:
            for i in instance_ids:
                self._counts.pop(i, None)

    def _writing(self, engine: Engine, *topics: str) -> contextlib.AbstractContextManager[Connection]:
        """A write transaction through ``engine`` (its topics: :func:`bridge.db.engine.about`), or, while
        :meth:`sharing`, the shared one (its topics added)."""
        shared: Connection | None = getattr(self._shared, "conn", None)
        if shared is None:
            return engine.begin()
        add_topics(shared, *topics)
        return contextlib.nullcontext(shared)

    def _later(self, effect: Callable[[], None]) -> None:
        """Run ``effect`` now, or, while :meth:`sharing`, once the shared transaction committed."""
        after: list[Callable[[], None]] | None = getattr(self._shared, "after", None)
        if after is None:
            effect()
        else:
            after.append(effect)

    def evaluate(self, instance_ids: Sequence[str], trace_ids: dict[str, str | None] | None = None,
                 conn: Connection | None = None, scopes: Mapping[str, Scope | None] | None = None) -> Evaluation:
        """Evaluate ``instance_ids`` on ``conn`` (from :meth:`connect`), or on a connection of its own.

        ``scopes`` narrows an instance's evaluation to some of its tasks (PostgreSQL; an instance without
        one, or ``None``, is evaluated whole)."""
        if not instance_ids:
            return Evaluation()
        if conn is None:
            with self._single.connect() as own:
                return self._evaluate(own, instance_ids, trace_ids or {}, scopes or {})
        return self._evaluate(conn, instance_ids, trace_ids or {}, scopes or {})

    def _evaluate(self, conn: Connection, instance_ids: Sequence[str], trace_ids: dict[str, str | None],
                  scopes: Mapping[str, Scope | None]) -> Evaluation:
        result = Evaluation()
        ids = list(instance_ids)
        params: dict[str, Any] = {"ids": ids}
        if self._pg:
            document: dict[str, dict[str, Any]] = {}
            for i in ids:
                sc = scopes.get(i)
                document[i] = {"w": 1} if sc is None else {"k": sorted(sc.keys), "d": sorted(sc.dependents_of)}
            params["scope"] = json.dumps(document)
        combined = self._combined(ids, params, trace_ids)
        if combined is not None:  # the evaluation and the dispatch of what needs no decision, one statement
            trace_ids = combined
            run = self.queries.evaluate_and_dispatch_run
            assert run is not None  # _combined said yes
            rows = run.all(conn, params)
        else:
            rows = self.queries.evaluation_run.all(conn, params)
        present = {str(r.instance_id) for r in rows}
        live = {str(r.instance_id) for r in rows if r.any_live}
        finished = [i for i in ids if i not in live]
        if finished:
            # No live task: a finished instance (its dispatch count is not needed any more, so the state
            # kept for finished instances stays bounded) or an unknown one.
            with self._lock:
                for i in finished:
                    self._counts.pop(i, None)
            result.unknown_instances = {i for i in finished if i not in present}
        ready: list[tuple[ReadyTask, str]] = []
        picked: list[tuple[ReadyTask, bool]] = []  # dispatched (won or lost) by the combined statement
        read_counts: dict[str, int] = {}  # the dispatch log's count for the instances of picked tasks
        facts: dict[str, Facts] = {}  # by task id
        skips: list[Any] = []
        st = self.tables.statuses
        for r in rows:
            if not r.live:
                continue
            if r.skip:
                # A skip is the scheduler's decision too: only on the dispatching route (shadow phases write
                # nothing to the task table).
                if self.router.event_route(r.workflow_type, str(r.instance_id)) not in ("off", "shadow"):
                    skips.append(r.task_id)
                continue
            if r.workflow_type is not None and r.workflow_type not in self._types:
                with self._lock:
                    self._types.add(r.workflow_type)
            type_settings = self.settings.for_type(r.workflow_type)
            attempts = getattr(r, "attempts", None)
            status = st.logical(r.status)
            if r.ready and getattr(r, "review_state", None) == 1:
                # Parked for review: no path dispatches it. A release of a task left pending writes nothing to
                # the task table (no event), so the instance is looked at again now and then.
                result.timers.append((datetime.now(UTC) + timedelta(seconds=REVIEW_RECHECK), "due",
                                      str(r.instance_id), ()))
            elif r.ready and getattr(r, "picked", 0):
                picked.append((ReadyTask(r.task_id, str(r.instance_id), r.task_key, r.workflow_type,
                                         (attempts + 1) if attempts is not None else None, r.ready_at),
                               bool(r.won)))
                read_counts[str(r.instance_id)] = int(r.dispatches or 0)
            elif r.ready:
                facts[str(r.task_id)] = Facts(getattr(r, "review_state", None), getattr(r, "depth", None),
                                              getattr(r, "dispatches", None))
                task = ReadyTask(r.task_id, str(r.instance_id), r.task_key, r.workflow_type,
                                 (attempts + 1) if attempts is not None else None, r.ready_at)
                ready.append((task, self.router.event_route(r.workflow_type, str(r.instance_id))))
            elif status == "pending" and r.due_future and getattr(r, "due_at", None) is not None:
                due = as_utc(r.due_at)
                if due is not None:  # at least a moment from now, even if this host's clock is ahead
                    soonest = datetime.now(UTC) + timedelta(seconds=DUE_RECHECK)
                    result.timers.append((max(due, soonest), "due", str(r.instance_id), ()))
            elif status == "failed" and self.retries and attempts is not None \
                    and getattr(r, "max_attempts", None) is not None and attempts < r.max_attempts:
                result.timers.append(retry_timer(type_settings, r.task_id, attempts, getattr(r, "updated_at", None),
                                                 r.workflow_type, str(r.instance_id)))
            elif status == "running" and self.timeouts and type_settings.running_timeout > 0:
                result.timers.append(timeout_timer(type_settings, r.task_id, getattr(r, "updated_at", None),
                                                   r.workflow_type, str(r.instance_id)))
        if skips:
            if self._pg:
                result.skipped.extend(skip_many(conn, self.tables, skips))
            else:
                with self._writing(self.engine) as wconn:
                    result.skipped.extend(skip_many(wconn, self.tables, skips))
        if picked:
            with self._lock:  # the instances' counts as the Python path's guards would have read them
                for instance_id, count in read_counts.items():
                    if instance_id not in self._counts:
                        self._remember_count(instance_id, count)
            self._dispatched(conn, [t for t, _ in picked], [t for t, won in picked if won], result)
        if ready:
            self._act(conn, ready, trace_ids, result, facts)
        # The lost races after the decisions found ready: their statement is not in those decisions' latency
        # (beside Airflow it was 2.6 ms p50 of a 10 ms handling, on a loaded machine).
        taken = [(task, "shadow") for task in self._taken(conn, rows, scopes)]
        if taken:
            self._act(conn, taken, trace_ids, result, facts)
        return result

    def _taken(self, conn: Connection, rows: Sequence[Any], scopes: Mapping[str, Scope | None]) -> list[ReadyTask]:
        """The lost races of a shadow phase (see the module docstring): the tasks of the batch's instances in
        a shadow route that the legacy scheduler took before this evaluation, made ready by the facts the
        events carry, without a decision for their attempt yet. One query, only when there are such facts."""
        types: dict[str, str | None] = {}
        for r in rows:  # every known instance has a row (its live tasks, or its marker row)
            types.setdefault(str(r.instance_id), r.workflow_type)
        ids: list[str] = []
        fresh: list[tuple[str, str]] = []
        done: list[tuple[str, str]] = []
        for instance_id, scope in scopes.items():
            if scope is None or not (scope.fresh or scope.dependents_of) or instance_id not in types:
                continue
            if self.router.event_route(types[instance_id], instance_id) != "shadow":
                continue
            ids.append(instance_id)
            fresh.extend((instance_id, key) for key in sorted(scope.fresh))
            done.extend((instance_id, key) for key in sorted(scope.dependents_of))
        if not ids:
            return []
        if self._pg:
            document: dict[str, dict[str, list[str]]] = {}
            for instance_id, key in fresh:
                document.setdefault(instance_id, {"k": [], "d": []})["k"].append(key)
            for instance_id, key in done:
                document.setdefault(instance_id, {"k": [], "d": []})["d"].append(key)
            found = self.queries.taken_run.all(conn, {"ids": ids, "facts": json.dumps(document)})
        else:
            found = self._read(conn, self.queries.taken, {"ids": ids, "fresh": fresh, "done": done}).all()
        return [ReadyTask(r.task_id, str(r.instance_id), str(r.task_key), r.workflow_type, r.attempt, r.ready_at)
                for r in found]

    def _act(self, conn: Connection, ready: list[tuple[ReadyTask, str]], trace_ids: dict[str, str | None],
             result: Evaluation, facts: Mapping[str, Facts]) -> None:
        # A task found without an event (catch-up, timers) starts a trace of its own.
        traces = {t.instance_id: trace_ids.get(t.instance_id) or new_trace_id() for t, _ in ready}
        to_decide = [task for task, route in ready if route == "shadow"]
        candidates = [task for task, route in ready if route == "dispatch"]
        # The guards first, so a parked task takes no token and no in-flight slot.
        allowed = self._guards(conn, candidates, facts, result) if candidates else []
        to_dispatch: list[ReadyTask] = []
        holds: list[tuple[ReadyTask, str, float]] = []
        in_flight: dict[str | None, int] | None = None
        for task in allowed:
            if in_flight is None and self.limits.capped(task.workflow_type):  # read only when a cap is set
                in_flight = {k: int(v) for k, v in self._read(conn, self.queries.in_flight).all()}
            hold = self.limits.admit(task.workflow_type, in_flight if in_flight is not None else {})
            if hold is not None:
                holds.append((task, *hold))
                continue
            to_dispatch.append(task)
        if holds:
            self._hold(conn, holds, result)
        now = datetime.now(UTC)
        if to_dispatch:
            try:
                if self._pg:  # one statement (a CTE): atomic without BEGIN/COMMIT, on the caller's connection
                    won = dispatch_many(conn, self.tables, to_dispatch, "events", traces)
                else:  # on SQLite a dispatch wakes the workers, not the relay (a dispatch is a quiet change)
                    with self._writing(self._dispatches, "work") as wconn:
                        won = dispatch_many(wconn, self.tables, to_dispatch, "events", traces)
            except BaseException:  # nothing dispatched: the tokens taken go back
                self.limits.refund(t.workflow_type for t in to_dispatch)
                raise
            if len(won) < len(to_dispatch):  # a lost race took no dispatch of this process's
                won_ids = {id(t) for t in won}  # dispatch_many returns the very tasks it was given
                self.limits.refund(t.workflow_type for t in to_dispatch if id(t) not in won_ids)
            self._dispatched(conn, to_dispatch, won, result, now)
        if to_decide:
            if self._pg:
                decided = self._decide_all(conn, to_decide, traces)
            else:
                with self._writing(self.engine) as wconn:
                    decided = [t for t in to_decide if self._decide(wconn, t, traces[t.instance_id])]
            result.decided.extend(decided)

            def count_decisions() -> None:  # after the commit
                for t in decided:
                    self.metrics.decisions.labels(workflow_type=str(t.workflow_type)).inc()
                    self._observe("shadow", t, now)

            self._later(count_decisions)

    def _dispatched(self, conn: Connection, tried: list[ReadyTask], won: list[ReadyTask], result: Evaluation,
                    now: datetime | None = None) -> None:
        """After the compare-and-set of ``tried`` (by :func:`dispatch_many` or the combined statement): the
        winners counted, their holds released, a recheck armed for a lost race that left the task pending."""
        now = now or datetime.now(UTC)
        result.dispatched.extend(won)
        with self._lock:
            for t in won:
                self._remember_count(t.instance_id, self._counts.get(t.instance_id, 0) + 1)
            released = [str(t.task_id) for t in won if self._held.get(str(t.task_id), False)]
        if released:  # the holds this process kept end with the dispatch (the reconciler's evidence)
            if self._pg:
                conn.execute(self.queries.release_holds, {"ids": released})
            else:
                with self._writing(self.engine) as wconn:
                    wconn.execute(self.queries.release_holds, {"ids": released})

            def forget_holds() -> None:  # once released (after the commit): a release that failed is tried again
                with self._lock:
                    for task_id in released:
                        self._held.pop(task_id, None)

            self._later(forget_holds)
        if len(won) < len(tried):
            lost_races = len(tried) - len(won)
            self._later(lambda: self.metrics.lost_races.inc(lost_races))
            # Usually another dispatcher took the task, and the second look finds nothing to do. But the
            # evaluation found it ready and armed no timer for it: if the write's own readiness test
            # failed for another reason (the clock stepped back across a due time), nothing else would
            # ever look at the instance again.
            lost = [t for t in tried if t not in won]
            still = {str(i) for i in self._read(conn, self.queries.still_pending([t.task_id for t in lost]))
                     .scalars()}
            again = datetime.now(UTC) + timedelta(seconds=LOST_RACE_RECHECK)
            for instance_id in sorted({t.instance_id for t in lost if str(t.task_id) in still}):
                result.timers.append((again, "due", instance_id, ()))

        def count_dispatches() -> None:  # after the commit
            per_type: dict[str | None, int] = defaultdict(int)
            for t in won:
                per_type[t.workflow_type] += 1
                self._observe("events", t, now)
            for workflow_type, n in per_type.items():
                self.metrics.dispatches.labels(workflow_type=str(workflow_type), path="events").inc(n)

        self._later(count_dispatches)

    def _combined(self, ids: list[str], params: dict[str, Any],
                  trace_ids: dict[str, str | None]) -> dict[str, str | None] | None:
        """Whether this batch runs :func:`~event_scheduler.queries.evaluate_and_dispatch_statement` (PostgreSQL):
        its parameters added to ``params`` and the trace ids of every instance (an instance without one
        starts its own here, as :meth:`_act` would), or None (the evaluation alone; the Python path decides).

        The types it may dispatch are the ones this evaluator has seen (the SQL learns a batch's types only by
        reading it, so a type's first batch goes the Python way): those on the dispatching route for every
        instance of the batch, with no ``max_in_flight`` and no ``rate``."""
        run = self.queries.evaluate_and_dispatch_run
        if run is None or not self._types:
            return None
        with self._lock:
            seen = sorted(self._types)
        uniform = getattr(self.router, "uniform_route", None)

        def dispatching(wt: str) -> bool:
            # Once per type where the router can say (every type a Flag in one phase, Airflow's hundreds of
            # DAGs among them), per instance only for a selective percentage.
            route = uniform(wt) if uniform is not None else None
            if route is not None:
                return bool(route == "dispatch")
            return all(self.router.event_route(wt, i) == "dispatch" for i in ids)

        types = [wt for wt in seen if self.limits.unlimited(wt) and dispatching(wt)]
        if not types:
            return None
        with self._lock:
            known = {i: self._counts[i] for i in ids if i in self._counts}
        traces = {i: trace_ids.get(i) or new_trace_id() for i in ids}
        params.update({
            "pb_types": types, "pb_max_depth": [self._limit(wt, "max_depth") for wt in types],
            "pb_max_dispatches": [self._limit(wt, "max_dispatches") for wt in types],
            "pb_count_ids": list(known), "pb_counts": list(known.values()), "pb_traces": json.dumps(traces)})
        return dict(traces)

    def _read(self, conn: Connection, stmt: Any, params: dict[str, Any] | None = None) -> Any:
        """A read on the caller's connection on PostgreSQL (autocommit) and while :meth:`sharing` (inside the shared
        transaction, which may have written), on a read-only one elsewhere."""
        if self._pg or conn is getattr(self._shared, "conn", None):
            return conn.execute(stmt, params or {})
        with self._single.connect() as rconn:
            return rconn.execute(stmt, params or {}).freeze()()

    def _limit(self, workflow_type: str | None, name: str) -> int:
        """A guard's limit for a type: its flag's threshold (one value for every process, from the flag
        store), else this process's ``[scheduler]`` setting."""
        value = self.router.thresholds(workflow_type).get(name)
        return int(value) if value is not None else int(getattr(self.settings, name))

    def _guards(self, conn: Connection, tasks: list[ReadyTask], facts: Mapping[str, Facts],
                result: Evaluation) -> list[ReadyTask]:
        """The depth guard and the dispatch-count guard, per task, before any dispatch: a task whose causation
        depth is past ``max_depth``, or that would be its instance's dispatch number ``max_dispatches`` + 1
        or later (counting the tasks of this batch in order, so a batch never overshoots), is parked in the
        review queue (:mod:`bridge.tasktable.review`) for a person. A task a person released is exempt."""
        exempt = {t.task_id for t in tasks if facts.get(str(t.task_id), NO_FACTS).review_state == 2}
        stops: list[Parking] = []
        depths = self._depths_of(conn, [t for t in tasks if t.task_id not in exempt], facts)
        for t in tasks:
            depth = depths.get(str(t.task_id))
            if t.task_id in exempt or depth is None:
                continue
            limit = self._limit(t.workflow_type, "max_depth")
            if depth > limit:
                stops.append(Parking(t.task_id, t.instance_id, t.workflow_type, str(t.task_key), t.attempt,
                                     "depth", depth, limit))
        stopped = {s.task_id for s in stops}
        rest = [t for t in tasks if t.task_id not in stopped]
        counts = self._dispatch_counts(conn, sorted({t.instance_id for t in rest}),
                                       {t.instance_id: n for t in rest
                                        if (n := facts.get(str(t.task_id), NO_FACTS).dispatches) is not None})
        queued: dict[str, int] = defaultdict(int)
        for t in rest:
            number = counts.get(t.instance_id, 0) + queued[t.instance_id] + 1
            limit = self._limit(t.workflow_type, "max_dispatches")
            if number > limit and t.task_id not in exempt:
                stops.append(Parking(t.task_id, t.instance_id, t.workflow_type, str(t.task_key), t.attempt,
                                     "dispatches", number, limit))
                continue
            queued[t.instance_id] += 1
        if not stops:
            return tasks
        with self._writing(self.engine) as wconn:
            parked = park(wconn, self.tables, stops, self.holder)

        def count_parked() -> None:  # logged and counted after the commit: the metric never runs ahead of the database
            for stop in parked:
                log.warning("%s guard: task %s (%s) of instance %s parked for review: %s", stop.guard, stop.task_id,
                            stop.task_key, stop.instance_id, stop.reason)
                self.metrics.parked.labels(workflow_type=str(stop.workflow_type), guard=stop.guard).inc()

        self._later(count_parked)
        by_id = {s.task_id for s in parked}
        result.stopped.extend(t for t in tasks if t.task_id in by_id)
        # A task parked by another process meanwhile, or no longer pending, is simply not dispatched here.
        all_stopped = {s.task_id for s in stops}
        return [t for t in tasks if t.task_id not in all_stopped]

    def _depths_of(self, conn: Connection, tasks: list[ReadyTask],
                   facts: Mapping[str, Facts]) -> dict[str, int]:
        """Each task's causation depth: the mapped ``depth`` column (read with the evaluation; NULL counts as
        0), or the length of its ``spawned_by`` chain (one query per batch); nothing without either."""
        if not tasks:
            return {}
        if self.tables.has("depth"):
            return {str(t.task_id): int(facts.get(str(t.task_id), NO_FACTS).depth or 0) for t in tasks}
        if self.queries.spawn_depth is None:
            return {}
        cap = max(self._limit(t.workflow_type, "max_depth") for t in tasks) + 1
        ids = [t.task_id for t in tasks]
        return {str(k): int(v) for k, v in self._read(conn, self.queries.spawn_depth, {"ids": ids, "cap": cap}).all()}

    def _dispatch_counts(self, conn: Connection, instances: list[str], read: Mapping[str, int]) -> dict[str, int]:
        """Each instance's dispatches so far: counted once from the dispatch log (``read``: by the evaluation
        query itself, for the instances with a ready task; a query of its own for any other), then kept up to
        date in memory after each dispatch (forgotten when the instance finishes)."""
        with self._lock:
            unknown = [i for i in instances if i not in self._counts]
        counted: dict[str, int] = {i: int(read[i]) for i in unknown if i in read}
        missing = [i for i in unknown if i not in counted]
        if missing:
            counted.update({str(k): int(v) for k, v in self._read(conn, self.queries.dispatch_count,
                                                                  {"ids": missing}).all()})
        with self._lock:
            for i in unknown:
                if i not in self._counts:  # the other thread may have counted it meanwhile
                    self._remember_count(i, counted.get(i, 0))
            return {i: self._counts.get(i, counted.get(i, 0)) for i in instances}

    def _remember_count(self, instance_id: str, count: int) -> None:
        """Under ``_lock``."""
        self._counts[instance_id] = count
        self._counts.move_to_end(instance_id)
        while len(self._counts) > COUNT_CACHE:
            self._counts.popitem(last=False)

    def _hold(self, conn: Connection, holds: list[tuple[ReadyTask, str, float]], result: Evaluation) -> None:
        """Backpressure: the tasks stay pending, their instances are looked at again after the wait, and the
        holds are recorded in ``pollbridge_holds`` (one statement) so that the poller's fallback and sweep,
        the reconciler and the guardian know the wait is legitimate while this process keeps renewing it."""
        now = datetime.now(UTC)
        rows = [{"task_id": str(t.task_id), "instance_id": t.instance_id, "workflow_type": t.workflow_type,
                 "task_key": str(t.task_key), "attempt": t.attempt, "reason": reason, "holder": self.holder,
                 "pb_wait": wait if self._pg else f"+{wait:.3f} seconds"} for t, reason, wait in holds]
        if self._pg:  # one statement on the caller's connection, as the dispatch (no pool checkout, no BEGIN)
            conn.execute(self.queries.hold, rows).all()
        else:
            with self._writing(self.engine) as wconn:
                wconn.execute(self.queries.hold, rows).all()
        for t, _, wait in holds:
            result.held_back.append(t)
            result.timers.append((now + timedelta(seconds=wait), "due", t.instance_id, ()))

        def note_held() -> None:  # after the commit (a hold rolled back is neither kept nor counted)
            new: dict[str | None, int] = defaultdict(int)
            with self._lock:
                for t, _, _ in holds:
                    if str(t.task_id) not in self._held:  # counted once per task and hold, not per look
                        new[t.workflow_type] += 1
                    self._held[str(t.task_id)] = True
                    self._held.move_to_end(str(t.task_id))
                    while len(self._held) > COUNT_CACHE:
                        self._held.popitem(last=False)
            for workflow_type, n in new.items():
                self.metrics.held_back.labels(workflow_type=str(workflow_type)).inc(n)

        self._later(note_held)

    def _observe(self, path: str, task: ReadyTask, now: datetime) -> None:
        ready_at = as_utc(task.ready_at)
        if ready_at is not None:
            self.metrics.ready_to_dispatch.labels(path=path, workflow_type=str(task.workflow_type)).observe(
                max(0.0, (now - ready_at).total_seconds()))

    def _decide(self, conn: Connection, task: ReadyTask, trace_id: str | None) -> bool:
        """Record a shadow decision once per (task, attempt)."""
        return bool(conn.execute(self.queries.decision(task, trace_id)).rowcount)

    def _decide_all(self, conn: Connection, tasks: list[ReadyTask], traces: Mapping[str, str]) -> list[ReadyTask]:
        """PostgreSQL: the shadow decisions of ``tasks`` on the evaluation's autocommit connection, those with an
        attempt in one statement (measured beside Airflow: a transaction of its own per batch, a pool checkout
        with its ping and a statement per task, took 4-6 ms of the decision latency). The decided ones."""
        unique = list({(str(t.task_id), t.attempt): t for t in tasks}.values())
        with_attempt = [t for t in unique if t.attempt is not None]
        recorded: set[tuple[str, int]] = set()
        if with_attempt:
            statement = self.queries.decisions([(t, traces[t.instance_id]) for t in with_attempt])
            recorded = {(str(task_id), int(attempt)) for task_id, attempt in conn.execute(statement).all()}
        decided = [t for t in with_attempt if (str(t.task_id), t.attempt) in recorded]
        decided.extend(t for t in unique if t.attempt is None and self._decide(conn, t, traces[t.instance_id]))
        return decided


@dataclass(frozen=True)
class Facts:
    """What the evaluation query read about a ready task for the guards."""

    #: The review queue's word: 1 parked, 2 released by a person (exempt from the guards), None neither.
    review_state: int | None = None
    #: The mapped ``depth`` column.
    depth: int | None = None
    #: Its instance's dispatches logged so far (read with the evaluation, so the count costs no round trip).
    dispatches: int | None = None


NO_FACTS = Facts()


def group_by_instance(items: Sequence[tuple[str, Any]]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = defaultdict(list)
    for instance_id, item in items:
        out[instance_id].append(item)
    return out
