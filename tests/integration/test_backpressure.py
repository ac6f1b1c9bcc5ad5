"""Backpressure the whole system respects (issue 22): a task the event scheduler holds back by its type's rate or
in-flight limit is recorded as a hold; while the hold is legitimate the poller's fallback and safety sweep leave
it alone, the guardian does not count it a miss, and ``held_back_total`` counts tasks, not evaluations. The
reference poller applies the same per-type limits to its own dispatches. SQLite and PostgreSQL; the evaluator
and the poller are driven step by step, so each assertion is about what one step did.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.core.settings import GuardianSettings, SchedulerSettings, TypeSettings
from bridge.db.schema import dispatch_log, holds
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.rollout.guardian import Guardian
from bridge.tasktable.tables import TaskTable
from event_scheduler.evaluate import Evaluator
from event_scheduler.metrics import SchedulerMetrics
from legacy_poller.poller import LegacyPoller
from tests.support import SHARED_DB_PARAMS, shared_engine


@pytest.fixture(params=SHARED_DB_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    return shared_engine(request)


def _limits(**type_settings: float) -> SchedulerSettings:
    return SchedulerSettings(defaults=TypeSettings(**type_settings))  # type: ignore[arg-type]


def _seed(engine: Engine, tables: TaskTable, ids: Sequence[str], *, ago: float = 60.0) -> None:
    """Single-task instances of type orders, ready ``ago`` seconds ago (past any grace period)."""
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(i, "orders", (TaskSpec("a"),)) for i in ids],
             now=datetime.now(UTC) - timedelta(seconds=ago))


def _router(engine: Engine, phase: str) -> FlagRouter:
    store = FlagStore(engine)
    store.change("orders", phase, actor="t", reason="t", grace_seconds=1)
    router = FlagRouter(store, refresh_interval=3600)
    router.refresh()
    return router


def _paths(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {str(p): int(n) for p, n in conn.execute(sa.select(dispatch_log.c.path, sa.func.count())
                                                       .group_by(dispatch_log.c.path))}


def _in_flight(engine: Engine, tables: TaskTable) -> int:
    t = tables.tasks
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(t.c.status.in_(("queued", "running")))).scalar() or 0)


def _complete_in_flight(engine: Engine, tables: TaskTable) -> None:
    t = tables.tasks
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.status.in_(("queued", "running")))
                     .values(status="completed", completed_at=sa.func.current_timestamp()))


def _stale_holds(engine: Engine) -> None:
    """The holder died: its holds were last renewed a minute ago."""
    with engine.begin() as conn:
        conn.execute(holds.update().values(until=datetime.now(UTC) - timedelta(seconds=60)))


def _evaluator(engine: Engine, tables: TaskTable, router: FlagRouter, limits: SchedulerSettings) -> Evaluator:
    evaluator = Evaluator(engine, tables, router, limits, SchedulerMetrics(CollectorRegistry()), holder="sched-a")
    # As if it had evaluated the type before: on PostgreSQL an unlimited type would now be dispatched by the
    # evaluation's combined statement, which must leave a type with max_in_flight or a rate to the Python path.
    evaluator._types.add("orders")
    return evaluator


@pytest.mark.parametrize("phase", ["selective", "cutover"])
def test_a_legitimate_hold_is_not_fair_game_for_the_fallback_or_the_sweep(engine: Engine, tables: TaskTable,
                                                                          phase: str) -> None:
    ids = [f"bp-{n}" for n in range(6)]
    _seed(engine, tables, ids)
    router = _router(engine, phase)
    limits = _limits(max_in_flight=2)
    result = _evaluator(engine, tables, router, limits).evaluate(ids)
    assert len(result.dispatched) == 2 and len(result.held_back) == 4
    poller = LegacyPoller(engine, tables, router=router, registry=CollectorRegistry(), limits=limits)
    # Before: the scan (selective) or the sweep (cutover) took all four held tasks as fallback misses.
    taken = poller.scan_once() if phase == "selective" else poller.sweep_once()
    assert taken.dispatched == 0 and _paths(engine) == {"events": 2}
    # The holder died: once its holds are stale the fallback takes them, within the type's limit.
    _complete_in_flight(engine, tables)
    _stale_holds(engine)
    taken = poller.scan_once() if phase == "selective" else poller.sweep_once()
    assert (taken.dispatched, taken.fallback) == (2, 2) and _paths(engine) == {"events": 2, "fallback": 2}
    assert _in_flight(engine, tables) == 2


def test_held_back_counts_tasks_not_evaluations_and_a_dispatch_releases_the_hold(engine: Engine,
                                                                                 tables: TaskTable) -> None:
    ids = [f"hb-{n}" for n in range(5)]
    _seed(engine, tables, ids)
    router = _router(engine, "cutover")
    evaluator = _evaluator(engine, tables, router, _limits(max_in_flight=1))
    for _ in range(3):
        evaluator.evaluate(ids)
    counted = evaluator.metrics.value("pollbridge_scheduler_held_back_total", {"workflow_type": "orders"})
    assert counted == 4  # 12 before: one per task per look
    with engine.connect() as conn:
        rows = conn.execute(sa.select(holds).order_by(holds.c.task_id)).all()
    assert len(rows) == 4 and {r.reason for r in rows} == {"in_flight"} and {r.holder for r in rows} == {"sched-a"}
    assert all(r.released_at is None for r in rows)
    _complete_in_flight(engine, tables)
    [won] = evaluator.evaluate(ids).dispatched
    with engine.connect() as conn:
        released = conn.execute(sa.select(holds.c.released_at).where(holds.c.task_id == str(won.task_id))).scalar()
    assert released is not None


def test_the_poller_applies_the_types_limits_in_polling(engine: Engine, tables: TaskTable) -> None:
    ids = [f"pl-{n}" for n in range(5)]
    _seed(engine, tables, ids)
    registry = CollectorRegistry()
    poller = LegacyPoller(engine, tables, registry=registry, limits=_limits(max_in_flight=2))
    assert poller.scan_once().dispatched == 2
    assert poller.scan_once().dispatched == 0 and _in_flight(engine, tables) == 2
    assert registry.get_sample_value("pollbridge_poller_held_back_total", {"workflow_type": "orders"}) == 6
    rated = LegacyPoller(engine, tables, registry=CollectorRegistry(), limits=_limits(rate=0.001, burst=1))
    _complete_in_flight(engine, tables)
    assert rated.scan_once().dispatched == 1 and rated.scan_once().dispatched == 0


def test_a_lost_race_or_a_failed_dispatch_gives_its_rate_tokens_back(engine: Engine, tables: TaskTable,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A token taken for a task another dispatcher took first, or for a dispatch that rolled back, goes back to
    the type's bucket: with a rate too slow to refill in the test, the task after them is dispatched at once (on the
    code before, held by the rate: the bucket had spent its burst on dispatches that never happened)."""
    import event_scheduler.evaluate as evaluate_module
    import legacy_poller.poller as poller_module

    real = evaluate_module.dispatch_many
    t = tables.tasks

    def another_dispatcher_first(conn: sa.Connection, tt: TaskTable, tasks: Sequence[object], *args: object,
                                 **kwargs: object) -> object:
        # Another dispatcher takes the first task between the evaluation's read and this compare-and-set.
        first = tasks[0].task_id  # type: ignore[attr-defined]
        conn.execute(t.update().where(t.c.id == first).values(status="queued"))
        return real(conn, tt, tasks, *args, **kwargs)  # type: ignore[arg-type]

    _seed(engine, tables, ["tk-0", "tk-1"])
    evaluator = _evaluator(engine, tables, _router(engine, "cutover"), _limits(rate=0.001, burst=2))
    monkeypatch.setattr(evaluate_module, "dispatch_many", another_dispatcher_first)
    assert len(evaluator.evaluate(["tk-0", "tk-1"]).dispatched) == 1  # one won, one lost: one token spent
    monkeypatch.setattr(evaluate_module, "dispatch_many", real)
    _seed(engine, tables, ["tk-2"])
    result = evaluator.evaluate(["tk-2"])
    assert len(result.dispatched) == 1 and not result.held_back

    def failing(*args: object, **kwargs: object) -> object:
        raise sa.exc.OperationalError("dispatch", {}, Exception("the database went away"))

    _seed(engine, tables, ["tk-3"])  # one token: the failed dispatch's must come back
    single = _evaluator(engine, tables, _router(engine, "cutover"), _limits(rate=0.001, burst=1))
    monkeypatch.setattr(evaluate_module, "dispatch_many", failing)
    with pytest.raises(sa.exc.OperationalError):
        single.evaluate(["tk-3"])
    monkeypatch.setattr(evaluate_module, "dispatch_many", real)
    assert len(single.evaluate(["tk-3"]).dispatched) == 1

    # The reference poller: a scan whose dispatch rolled back, and one that lost a race, leave their tokens.
    _complete_in_flight(engine, tables)
    _seed(engine, tables, ["tk-4"])
    poller = LegacyPoller(engine, tables, registry=CollectorRegistry(), limits=_limits(rate=0.001, burst=1))
    monkeypatch.setattr(poller_module, "dispatch_many", failing)
    with pytest.raises(sa.exc.OperationalError):
        poller.scan_once()
    monkeypatch.setattr(poller_module, "dispatch_many", real)
    assert poller.scan_once().dispatched == 1
    _complete_in_flight(engine, tables)
    _seed(engine, tables, ["tk-5", "tk-6"])
    racing = LegacyPoller(engine, tables, registry=CollectorRegistry(), limits=_limits(rate=0.001, burst=2))
    calls = iter([another_dispatcher_first])  # the scan's first dispatch loses tk-5 to another dispatcher

    def first_call_races(conn: sa.Connection, tt: TaskTable, tasks: Sequence[object], *args: object,
                         **kwargs: object) -> object:
        step = next(calls, real) if tasks else real
        return step(conn, tt, tasks, *args, **kwargs)  # type: ignore[operator]

    monkeypatch.setattr(poller_module, "dispatch_many", first_call_races)
    assert racing.scan_once().dispatched == 1  # tk-6; tk-5 lost: its token goes back
    monkeypatch.setattr(poller_module, "dispatch_many", real)
    _complete_in_flight(engine, tables)
    _seed(engine, tables, ["tk-7"])
    assert racing.scan_once().dispatched == 1


def test_the_guardian_tells_backpressure_from_failure(engine: Engine, tables: TaskTable) -> None:
    ids = [f"gd-{n}" for n in range(6)]
    _seed(engine, tables, ids)
    router = _router(engine, "selective")
    _evaluator(engine, tables, router, _limits(max_in_flight=1)).evaluate(ids)
    guardian = Guardian(engine, GuardianSettings(min_tasks=1), store=FlagStore(engine), registry=CollectorRegistry())
    report = guardian.check_once(act=True)
    [verdict] = [v for v in report.verdicts if v.workflow_type == "orders"]
    [miss] = [f for f in verdict.findings if f.criterion == "miss_rate"]
    assert miss.state == "ok" and "5 ready task(s) held back by backpressure now" in miss.detail
    assert verdict.action != "demoted"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tasks=st.integers(1, 12), cap=st.integers(1, 4), steps=st.lists(st.sampled_from(["evaluate", "scan",
                                                                                     "complete"]),
                                                                     min_size=1, max_size=12))
def test_in_flight_cap_holds_beside_a_running_poller(engine: Engine, tables: TaskTable, tasks: int, cap: int,
                                                     steps: list[str]) -> None:
    """Invariant: in selective, with the event scheduler and the poller both dispatching (the poller's grace long
    past), the type's in-flight count never exceeds its cap, and while the scheduler keeps its holds no held
    task is taken as a fallback."""
    with engine.begin() as conn:
        for name in ("tasks", "workflow_instances", "pollbridge_dispatch_log", "pollbridge_holds",
                     "pollbridge_flags", "pollbridge_flag_audit", "pollbridge_outbox"):
            conn.execute(sa.text(f"DELETE FROM {name}"))
    ids = [f"inv-{n}" for n in range(tasks)]
    _seed(engine, tables, ids)
    router = _router(engine, "selective")
    limits = _limits(max_in_flight=cap)
    evaluator = _evaluator(engine, tables, router, limits)
    poller = LegacyPoller(engine, tables, router=router, registry=CollectorRegistry(), limits=limits)
    evaluator.evaluate(ids)
    for step in steps:
        if step == "evaluate":
            evaluator.evaluate(ids)
        elif step == "scan":
            poller.scan_once()
        else:
            _complete_in_flight(engine, tables)
        assert _in_flight(engine, tables) <= cap
    assert _paths(engine).get("fallback", 0) == 0
