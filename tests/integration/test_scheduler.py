"""The event scheduler end to end (capture → relay → bus → scheduler → dispatch) on the three stacks, and on
PostgreSQL + a Redis Cluster and PostgreSQL + RabbitMQ."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from bridge.bus.base import Delivery
from bridge.capture.relay import Relay
from bridge.core.phases import FixedRouter, Phase
from bridge.core.settings import RelaySettings, SchedulerSettings, TypeSettings, WorkerSettings
from bridge.db.schema import decisions, dispatch_log, signals
from bridge.reference.oracle import verify
from bridge.reference.workload import TaskSpec, WorkflowSpec, demo_workload, seed
from event_scheduler import evaluate as evaluate_module
from event_scheduler.exceptions import SignalError
from event_scheduler.scheduler import EventScheduler
from event_scheduler.signals import record_signal
from legacy_poller.poller import LegacyPoller
from legacy_poller.workers import WorkerPool
from tests.support import Env, wait_for
from tests.support.stacks import ENV_PARAMS_WITH_CLUSTER, make_env

RELAY = RelaySettings(poll_interval=0.002, arm_after=0.05, fallback_interval=0.2, lease_timeout=1.0,
                      purge_interval=3600)
SCHED = SchedulerSettings(block=0.1, lease_ttl=2.0, claim_interval=0.5, max_deliveries=3,
                          defaults=TypeSettings(retry_base=0.2, retry_jitter=0.1))
WORKERS = WorkerSettings(concurrency=3, min_duration=0.0, max_duration=0.005, idle_sleep=0.01)


@pytest.fixture(params=ENV_PARAMS_WITH_CLUSTER)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    """Every stack, and PostgreSQL + a Redis Cluster."""
    yield from make_env(request)


class Stack:
    def __init__(self, env: Env) -> None:
        self.env = env
        self.threads: list[tuple[threading.Thread, threading.Event]] = []
        self.pools: list[WorkerPool] = []

    def run(self, target: Callable[[threading.Event], None]) -> threading.Event:
        stop = threading.Event()
        thread = threading.Thread(target=target, args=(stop,), daemon=True)
        thread.start()
        self.threads.append((thread, stop))
        return stop

    def relay(self) -> Relay:
        relay = Relay(self.env.engine, self.env.open_bus(), RELAY, statuses=self.env.tables.mapping.statuses)
        self.run(relay.run)
        return relay

    def scheduler(self, phase: Phase = "cutover", settings: SchedulerSettings = SCHED,
                  start: bool = True, visibility_timeout: float = 1.0) -> EventScheduler:
        sched = EventScheduler(self.env.engine, self.env.tables, self.env.open_bus(), settings,
                               FixedRouter(phase), visibility_timeout=visibility_timeout,
                               registry=CollectorRegistry())
        if start:
            self.run(sched.run)
        return sched

    def workers(self, settings: WorkerSettings = WORKERS) -> WorkerPool:
        pool = WorkerPool(self.env.engine, self.env.tables, settings, seed=3)
        pool.start()
        self.pools.append(pool)
        return pool

    def stop(self) -> None:
        for pool in self.pools:
            pool.stop()
        for _, stop in self.threads:
            stop.set()
        for thread, _ in self.threads:
            thread.join(20)


@pytest.fixture
def stack(env: Env) -> Iterator[Stack]:
    s = Stack(env)
    yield s
    s.stop()


def _paths(env: Env) -> dict[str, int]:
    with env.engine.connect() as conn:
        return dict(conn.execute(sa.select(dispatch_log.c.path, sa.func.count()).group_by(dispatch_log.c.path)).all())


def _settled(env: Env, ids: list[str]) -> Callable[[], bool]:
    def check() -> bool:
        with env.engine.connect() as conn:
            return verify(conn, env.tables, ids).unsettled == 0
    return check


def test_cutover_runs_a_workload_on_events_alone(env: Env, stack: Stack) -> None:
    specs = demo_workload(8, 6, prefix="ev")
    stack.relay()
    stack.scheduler("cutover")
    stack.workers()
    with env.engine.begin() as conn:
        total = seed(conn, env.tables, specs)
    ids = [s.instance_id for s in specs]
    wait_for(_settled(env, ids), 60, interval=0.1, what="the workload to finish on the event path")
    with env.engine.connect() as conn:
        verdict = verify(conn, env.tables, ids)
    assert verdict.completed == verdict.dispatches == total
    assert (verdict.double_dispatched, verdict.early) == (0, 0), verdict.problems
    assert _paths(env) == {"events": total}
    with env.engine.connect() as conn:
        traces = conn.execute(sa.select(sa.func.count()).where(dispatch_log.c.trace_id.is_not(None))).scalar()
    assert traces == total


def test_dual_write_records_decisions_and_never_dispatches(env: Env, stack: Stack) -> None:
    specs = demo_workload(4, 5, prefix="shadow")
    stack.relay()
    sched = stack.scheduler("dual_write")
    with env.engine.begin() as conn:
        seed(conn, env.tables, specs)
    roots = sum(1 for s in specs for t in s.tasks if not t.depends_on and t.due_in is None)
    wait_for(lambda: sched.metrics.value("pollbridge_scheduler_decisions_total", {"workflow_type": "orders"})
             + sched.metrics.value("pollbridge_scheduler_decisions_total", {"workflow_type": "reports"})
             + sched.metrics.value("pollbridge_scheduler_decisions_total", {"workflow_type": "etl"}) >= roots,
             30, what="shadow decisions for the root tasks")
    assert _paths(env) == {}
    # The poller stays authoritative; the decisions keep coming as tasks become ready.
    stack.workers()
    poller = LegacyPoller(env.engine, env.tables)
    ids = [s.instance_id for s in specs]

    def settled() -> bool:
        poller.scan_once()
        return _settled(env, ids)()

    wait_for(settled, 60, interval=0.05, what="the poller to finish the workload")
    total = sum(len(s.tasks) for s in specs)
    assert _paths(env) == {"poller": total}
    with env.engine.connect() as conn:
        decided = conn.execute(sa.select(decisions.c.task_id, decisions.c.attempt)).all()
    assert len(decided) == len(set(decided)), "a decision was recorded twice"
    assert len(decided) >= roots


def test_catch_up_dispatches_tasks_ready_before_start(env: Env, stack: Stack) -> None:
    """No event on the bus at all (as after a long outage): start-up evaluates from the database. A root with a
    due time is put an hour away: the workload's own (about 1 s) passed before the catch-up on a loaded machine,
    and the root was rightly dispatched as well (CI beside a CPU hog: 5 dispatched against 4 counted)."""
    specs = [replace(s, tasks=tuple(replace(t, due_in=3600.0) if t.due_in is not None and not t.depends_on else t
                                    for t in s.tasks)) for s in demo_workload(5, 4, prefix="cold")]
    timed = [s.instance_id for s in specs for t in s.tasks if not t.depends_on and t.due_in is not None]
    assert timed  # the case the due time guards is in the workload
    with env.engine.begin() as conn:
        seed(conn, env.tables, specs)
    sched = stack.scheduler("cutover", start=False)
    sched.refresh_leases()  # acquires every partition and catches up
    roots = sum(1 for s in specs for t in s.tasks if not t.depends_on and t.due_in is None)
    assert _paths(env).get("events") == roots
    with env.engine.connect() as conn:
        assert verify(conn, env.tables, timed).early == 0


def test_due_timer_fires_without_a_scan(env: Env, stack: Stack) -> None:
    stack.relay()
    sched = stack.scheduler("cutover")
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("timed", "orders", (TaskSpec("later", due_in=2.0),))])
    wait_for(lambda: _paths(env).get("events") == 1, 15, what="the timer task to be dispatched")
    assert sched.metrics.value("pollbridge_scheduler_timers_fired_total", {"kind": "due"}) >= 1
    with env.engine.connect() as conn:
        verdict = verify(conn, env.tables, ["timed"])
    assert verdict.early == 0, verdict.problems


def test_approval_and_rejection_signals(env: Env, stack: Stack) -> None:
    stack.relay()
    stack.scheduler("cutover")
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("sig", "orders", (
            TaskSpec("approve_me", awaits_signal="manager"), TaskSpec("reject_me", awaits_signal="manager"),
            TaskSpec("plain")))])
        ids = dict(conn.execute(sa.select(env.tables.tasks.c.task_key, env.tables.tasks.c.id)).all())
    wait_for(lambda: _paths(env).get("events") == 1, 15, what="the task that awaits nothing")
    with pytest.raises(SignalError, match="awaits no signal"):
        record_signal(env.engine, env.tables, str(ids["plain"]), "approval")
    with pytest.raises(SignalError, match="no task"):
        record_signal(env.engine, env.tables, "999999", "approval")
    with pytest.raises(SignalError, match="not valid JSON"):
        record_signal(env.engine, env.tables, str(ids["approve_me"]), "approval", payload="{nope")
    record_signal(env.engine, env.tables, str(ids["approve_me"]), "approval", payload='{"by": "ann"}', actor="ann")
    wait_for(lambda: _paths(env).get("events") == 2, 15, what="the approved task")
    result = record_signal(env.engine, env.tables, str(ids["reject_me"]), "rejection")
    assert result.new_status == "failed"
    with pytest.raises(SignalError, match="already received"):
        record_signal(env.engine, env.tables, str(ids["approve_me"]), "callback")
    with env.engine.connect() as conn:
        status, attempts, max_attempts = conn.execute(
            sa.select(env.tables.tasks.c.status, env.tables.tasks.c.attempts, env.tables.tasks.c.max_attempts)
            .where(env.tables.tasks.c.id == ids["reject_me"])).one()
        recorded = conn.execute(sa.select(signals.c.kind, signals.c.actor, signals.c.payload)
                                .order_by(signals.c.id)).all()
    assert status == "failed" and attempts == max_attempts  # rejected for good: no retry
    assert [r.kind for r in recorded] == ["approval", "rejection"] and recorded[0].actor == "ann"


def test_failed_task_is_retried_after_backoff_and_dispatched_again(env: Env, stack: Stack) -> None:
    stack.relay()
    sched = stack.scheduler("cutover")
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("retry", "orders", (TaskSpec("flaky"),))])
    wait_for(lambda: _paths(env).get("events") == 1, 15, what="the first dispatch")
    t = env.tables.tasks
    with env.engine.begin() as conn:  # a worker ran it (attempt 1) and it failed
        conn.execute(t.update().where(t.c.instance_id == "retry").values(status="failed", attempts=1))
    wait_for(lambda: _paths(env).get("events") == 2, 15, what="the retry to be dispatched")
    assert sched.metrics.value("pollbridge_scheduler_retries_total", {"workflow_type": "orders"}) == 1
    with env.engine.connect() as conn:
        attempts = sorted(conn.execute(sa.select(dispatch_log.c.attempt)).scalars())
    assert attempts == [1, 2]


def _db_now(env: Env) -> Any:
    return sa.func.clock_timestamp() if env.engine.dialect.name == "postgresql" else sa.func.strftime(
        "%Y-%m-%d %H:%M:%f", "now")


def _one_task_dispatched(env: Env, instance: str) -> None:
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec(instance, "orders", (TaskSpec("only"),))])
    wait_for(lambda: _paths(env).get("events") == 1, 15, what=f"the dispatch of {instance}'s task")


def test_running_task_past_its_timeout_is_failed(env: Env, stack: Stack) -> None:
    settings = SchedulerSettings(block=0.1, lease_ttl=2.0, defaults=TypeSettings(running_timeout=0.5,
                                                                                retry_base=30.0))
    stack.relay()
    sched = stack.scheduler("cutover", settings=settings)
    _one_task_dispatched(env, "slow")
    t = env.tables.tasks
    now = _db_now(env)
    with env.engine.begin() as conn:  # a worker picked it up and then hung
        conn.execute(t.update().where(t.c.instance_id == "slow").values(status="running", attempts=1, updated_at=now))
    wait_for(lambda: sched.metrics.value("pollbridge_scheduler_timeouts_total", {"workflow_type": "orders"}) == 1,
             15, what="the running timeout")
    with env.engine.connect() as conn:
        assert conn.execute(sa.select(t.c.status).where(t.c.instance_id == "slow")).scalar() == "failed"


def test_a_retry_that_starts_before_the_first_attempts_timeout_still_times_out(env: Env, stack: Stack) -> None:
    """One timeout timer per task, the earliest kept: the first attempt's timer is still there when the
    retry starts running, so the retry's own deadline is not armed. When the stale timer fires on a task
    that is running again but not for long enough, it must re-arm for the retry (the chaos suite found a
    retry stranded in ``running`` after its worker was killed)."""
    timeout = 2.0
    settings = SchedulerSettings(block=0.1, lease_ttl=2.0, defaults=TypeSettings(running_timeout=timeout,
                                                                                retry_base=0.05, retry_jitter=0.0))
    stack.relay()
    sched = stack.scheduler("cutover", settings=settings)
    _one_task_dispatched(env, "again")
    t = env.tables.tasks
    now = _db_now(env)
    with env.engine.begin() as conn:
        task_id = str(conn.execute(sa.select(t.c.id).where(t.c.instance_id == "again")).scalar_one())
    key = ("timeout", task_id)

    def set_status(status: str, attempts: int) -> None:
        with env.engine.begin() as conn:
            conn.execute(t.update().where(t.c.instance_id == "again")
                         .values(status=status, attempts=attempts, updated_at=now))

    set_status("running", 1)  # attempt 1 runs ...
    wait_for(lambda: key in sched.timers._current, 15, what="the first attempt's timeout timer")
    first = sched.timers._current[key].when
    set_status("failed", 1)  # ... and fails at once: retried after 0.05 s
    wait_for(lambda: _paths(env).get("events") == 2, 15, what="the retry's dispatch")
    set_status("running", 2)  # the retry runs, and its worker dies
    wait_for(lambda: sched.metrics.value("pollbridge_scheduler_timeouts_total", {"workflow_type": "orders"}) == 1,
             first - time.time() + timeout + 15, what="the retry's running timeout")
    with env.engine.connect() as conn:
        status, attempts = conn.execute(sa.select(t.c.status, t.c.attempts).where(t.c.instance_id == "again")).one()
    assert (status, attempts) == ("failed", 2)


def test_a_stale_retry_timer_does_not_keep_the_current_attempts_retry_from_firing(env: Env, stack: Stack) -> None:
    """A scheduler that owned the partition before may still hold the retry timer of an earlier attempt.
    Fired, it must re-arm the current attempt's retry instead of doing nothing: the current attempt's
    timer was not armed, the earlier one firing first."""
    settings = SchedulerSettings(block=0.1, lease_ttl=2.0, defaults=TypeSettings(retry_base=0.3, retry_jitter=0.0))
    stack.relay()
    sched = stack.scheduler("cutover", settings=settings)
    _one_task_dispatched(env, "stale")
    t = env.tables.tasks
    with env.engine.begin() as conn:
        task_id = conn.execute(sa.select(t.c.id).where(t.c.instance_id == "stale")).scalar_one()
    # Left over from attempt 1, due before the current attempt's retry would be.
    sched.timers.schedule(time.time() + 0.2, "retry", str(task_id), (task_id, 1, "orders"))
    with env.engine.begin() as conn:  # attempt 2 ran and failed (attempt 1's retry was someone else's)
        conn.execute(t.update().where(t.c.id == task_id).values(status="failed", attempts=2))
    wait_for(lambda: _paths(env).get("events") == 2, 15, what="attempt 3's dispatch")
    with env.engine.connect() as conn:
        assert conn.execute(sa.select(dispatch_log.c.attempt).order_by(dispatch_log.c.id.desc())).first() == (3,)


def test_poison_and_unknown_events(env: Env, stack: Stack) -> None:
    from bridge.core.events import CloudEvent

    bus = env.open_bus()
    sched = stack.scheduler("cutover", start=False)
    sched.refresh_leases()
    good = CloudEvent(id="e-unknown", type="task.status_changed", subject="1", partitionkey="nobody",
                      time=__import__("datetime").datetime.now(__import__("datetime").UTC))
    bus.publish([good])
    _write_raw(env, bus, "this is not json")
    handled = 0
    for _ in range(20):
        handled += sched.poll_once(block=0.1)
        if handled >= 2:
            break
    assert sched.metrics.value("pollbridge_scheduler_unknown_events_total") == 1
    assert sched.metrics.value("pollbridge_scheduler_dead_letters_total", {"reason": "unparseable"}) == 1
    letters = bus.dead_letters()
    assert len(letters) == 1 and "unparseable" in letters[0].reason
    assert bus.pending_count(SCHED.group) == 0


def _write_raw(env: Env, bus: Any, payload: str) -> None:
    """An entry that is not a CloudEvent, written straight into the backend's storage."""
    if env.bus_url is not None:  # a bus server (a Redis Cluster's readers wait on its doorbell: rung too)
        from tests.support.buses import raw_write

        raw_write(env.bus_url, bus, 0, payload, "raw")
    else:
        from bridge.db.schema import bus_log

        with env.engine.begin() as conn:
            conn.execute(bus_log.insert().values(partition=0, event_id="raw", payload=payload,
                                                 created_at=sa.func.current_timestamp()))


def test_two_schedulers_split_the_partitions(env: Env, stack: Stack) -> None:
    a = stack.scheduler("cutover", start=False)
    b = stack.scheduler("cutover", start=False)
    a.refresh_leases()
    b.refresh_leases()
    a.refresh_leases()  # a sees b and gives back the excess
    b.refresh_leases()
    assert a.leases.owned and b.leases.owned
    assert a.leases.owned.isdisjoint(b.leases.owned)
    assert a.leases.owned | b.leases.owned == set(range(4))


def test_dispatch_count_guard_parks_a_runaway_instance_for_review(env: Env, stack: Stack) -> None:
    settings = SchedulerSettings(block=0.1, lease_ttl=2.0, max_dispatches=3)
    stack.relay()
    sched = stack.scheduler("cutover", settings=settings)
    stack.workers()
    chain = tuple(TaskSpec(f"t{i}", (f"t{i-1}",) if i else ()) for i in range(6))
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("runaway", "orders", chain)])
    t = env.tables.tasks
    wait_for(lambda: sched.metrics.value("pollbridge_scheduler_parked_total",
                                         {"workflow_type": "orders", "guard": "dispatches"}) >= 1, 30,
             what="the dispatch-count guard to stop the instance")
    with env.engine.connect() as conn:
        statuses = dict(conn.execute(sa.select(t.c.task_key, t.c.status).where(t.c.instance_id == "runaway")).all())
    assert [statuses[f"t{i}"] for i in range(3)] == ["completed"] * 3
    assert statuses["t3"] == "review"
    assert statuses["t4"] == statuses["t5"] == "pending"
    assert _paths(env) == {"events": 3}


def test_a_ready_task_whose_compare_and_set_matched_nothing_is_looked_at_again(
        env: Env, stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Losing the compare-and-set usually means another dispatcher won; when nothing did (the write's own
    readiness test failed), the instance must still be evaluated again: there is no relay here, so only
    the re-check timer the loss arms can bring the task back."""
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("raced", "orders", (TaskSpec("a"),))])
    real = evaluate_module.dispatch_many
    calls: list[int] = []

    def first_write_matches_nothing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return [] if len(calls) == 1 else real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "dispatch_many", first_write_matches_nothing)
    sched = stack.scheduler("cutover")  # its start-up catch-up finds the task ready, and loses the write
    wait_for(lambda: _paths(env).get("events") == 1, 15, what="the re-check to dispatch the task")
    # The write that lost came first; the re-check's write is dispatch_many again, or on PostgreSQL the
    # evaluation's own combined statement (the type was seen by then).
    assert calls[:1] == [1]
    assert sched.metrics.value("pollbridge_scheduler_lost_races_total") == 1


def test_a_claim_that_fails_on_acquisition_does_not_lose_the_catch_up(
        env: Env, stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The partitions are owned once the lease round committed: the next round acquires nothing, so the
    catch-up must already be queued when claiming the dead owner's entries fails."""
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("orphan", "orders", (TaskSpec("a"),))])
    sched = stack.scheduler("cutover", start=False)

    def claim_fails() -> int:
        raise RuntimeError("bus unavailable")

    monkeypatch.setattr(sched, "claim_stale", claim_fails)
    with pytest.raises(RuntimeError, match="bus unavailable"):
        sched.refresh_leases(background=True)
    wait_for(lambda: _paths(env).get("events") == 1, 15, what="the catch-up to dispatch the ready task")


def test_a_bus_that_lost_its_data_makes_the_scheduler_catch_up_from_the_database(env: Env, stack: Stack) -> None:
    """What the scheduler itself put on the bus (a due timer's ``timer.expired``) is in no outbox, so the relay's
    replay cannot bring it back: when the bus's epoch of an owned partition changes, the scheduler forgets the event
    ids it remembers and catches the partition up from the database. Here no relay runs, so the ready task's only
    way to the scheduler is that catch-up."""
    if env.bus_url is None:
        pytest.skip("the embedded bus lives in the database: it is lost only with the database")
    from tests.support.buses import lose_bus_data

    sched = stack.scheduler("cutover")
    wait_for(lambda: len(sched.leases.owned) == 4 and not sched.catching_up(), 20, what="the scheduler to settle")
    wait_for(lambda: sched._epochs is not None, 20, what="the scheduler's first look at the bus epochs")
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("lost-1", "orders", (TaskSpec("a"),))])
    assert _paths(env) == {}  # nothing told the scheduler: no relay runs
    bus = env.open_bus()
    assert env.bus_url is not None
    lose_bus_data(env.bus_url, bus)
    wait_for(lambda: _paths(env).get("events") == 1, 30, what="the catch-up to dispatch the ready task")
    assert sched.metrics.value("pollbridge_scheduler_bus_resets_total") >= 1


@pytest.fixture(params=["sqlite-embedded"])
def lite(request: pytest.FixtureRequest) -> Iterator[Env]:
    yield from make_env(request)


def test_on_sqlite_a_batch_is_evaluated_and_dispatched_inside_the_bus_take_and_a_failure_is_handled_apart(
        lite: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite and its embedded bus: the evaluation and the dispatch run inside the take's write transaction, so
    no pending row is written or acknowledged for a batch; the dispatch is counted after the commit. When the
    evaluation fails inside the take, nothing it wrote stays, and the batch is handled apart: dispatched once,
    acknowledged, nothing dead-lettered."""
    stack = Stack(lite)
    try:
        sched = stack.scheduler("cutover", start=False)
        assert sched._in_take
        sched.refresh_leases()
        pending_rows: list[str] = []

        def seen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
            if "pollbridge_bus_pending" in statement and not statement.lstrip().upper().startswith("SELECT"):
                pending_rows.append(statement.split()[0])

        real = sched.evaluator.evaluate
        failures: list[str] = []

        def fails_inside_once(ids: Any, traces: Any = None, conn: Any = None, scopes: Any = None) -> Any:
            if conn is not None and ids == ["apart"] and not failures:
                real(ids, traces, conn, scopes)  # its dispatch written in the take's transaction ...
                failures.append("apart")
                raise RuntimeError("the evaluation failed")  # ... and rolled back with it
            return real(ids, traces, conn, scopes)

        monkeypatch.setattr(sched.evaluator, "evaluate", fails_inside_once)
        stack.relay()
        sa.event.listen(lite.engine, "before_cursor_execute", seen)
        try:
            with lite.engine.begin() as conn:
                seed(conn, lite.tables, [WorkflowSpec("inside", "orders", (TaskSpec("a"),))])
            wait_for(lambda: sched.poll_once(block=0.1) >= 0 and _paths(lite).get("events") == 1, 15,
                     what="the first dispatch")
            assert pending_rows == []  # taken, handled and acknowledged in one transaction
            assert sched.metrics.value("pollbridge_scheduler_dispatches_total",
                                       {"workflow_type": "orders", "path": "events"}) == 1

            with lite.engine.begin() as conn:
                seed(conn, lite.tables, [WorkflowSpec("apart", "orders", (TaskSpec("a"),))])
            wait_for(lambda: sched.poll_once(block=0.1) >= 0 and _paths(lite).get("events") == 2, 15,
                     what="the dispatch handled apart")
            sched.poll_once(block=0.1)  # its acknowledgement rides with the next take
        finally:
            sa.event.remove(lite.engine, "before_cursor_execute", seen)
        assert failures == ["apart"]
        assert "INSERT" in pending_rows  # taken again as a read takes it: pending, then acknowledged
        with lite.engine.connect() as conn:
            verdict = verify(conn, lite.tables, ["inside", "apart"])
        assert verdict.dispatches == 2 and verdict.double_dispatched == 0, verdict.problems
        assert sched.metrics.value("pollbridge_scheduler_dispatches_total",
                                   {"workflow_type": "orders", "path": "events"}) == 2
        assert sched.metrics.value("pollbridge_scheduler_dead_letters_total", {"reason": "unparseable"}) == 0
        assert sched.bus.pending_count(SCHED.group) == 0
    finally:
        stack.stop()


def test_a_handler_run_that_rolled_back_forgets_the_dispatch_counts_it_kept(lite: Env,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the take the evaluator counts its dispatches in memory before the commit; a run that raised (rolled
    back with the take) forgets them at once, whatever a later run of the same read commits."""
    from bridge.core.events import CloudEvent

    stack = Stack(lite)
    try:
        sched = stack.scheduler("cutover", start=False)
        with sched.evaluator._lock:
            sched.evaluator._remember_count("x", 3)

        def counts_then_fails(ids: Any, traces: Any = None, conn: Any = None, scopes: Any = None) -> Any:
            with sched.evaluator._lock:
                sched.evaluator._remember_count("x", 4)  # a dispatch the rollback undoes
            raise RuntimeError("the evaluation failed")

        monkeypatch.setattr(sched.evaluator, "evaluate", counts_then_fails)
        event = CloudEvent(id="e-x", type="task.status_changed", subject="1", partitionkey="x",
                           time=__import__("datetime").datetime.now(__import__("datetime").UTC))
        delivery = Delivery("1", 0, event.to_json(), event)
        with lite.engine.begin() as conn, pytest.raises(RuntimeError):
            sched._handle_inside(conn, [delivery])
        assert "x" not in sched.evaluator._counts  # read again from the dispatch log when next needed
    finally:
        stack.stop()


def test_a_failing_after_commit_effect_stops_none_of_the_others(lite: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the take the batch is committed before its effects in memory run: a dead letter that fails (a bus
    write of its own) neither raises nor keeps the batch's remembered ids and metrics from being applied; the
    unparseable entry stays pending, to be dead-lettered when claimed again."""
    from bridge.core.events import CloudEvent

    stack = Stack(lite)
    try:
        bus = lite.open_bus()
        sched = stack.scheduler("cutover", start=False)
        assert sched._in_take
        sched.refresh_leases()

        def fails(*_args: Any, **_kwargs: Any) -> None:
            raise RuntimeError("the dead letter could not be written")

        monkeypatch.setattr(sched.bus, "dead_letter", fails)
        _write_raw(lite, bus, "this is not json")
        good = CloudEvent(id="e-after", type="task.status_changed", subject="1", partitionkey="nobody",
                          time=__import__("datetime").datetime.now(__import__("datetime").UTC))
        bus.publish([good])
        handled = 0
        for _ in range(20):
            handled += sched.poll_once(block=0.1)
            if handled >= 2:
                break
        assert handled == 2
        assert "e-after" in sched._recent  # the batch's own effects ran
        assert sched.metrics.value("pollbridge_scheduler_unknown_events_total") == 1
        assert sched.metrics.value("pollbridge_scheduler_dead_letters_total", {"reason": "unparseable"}) == 0
        assert bus.pending_count(SCHED.group) == 1  # the unparseable one, not lost
    finally:
        stack.stop()
