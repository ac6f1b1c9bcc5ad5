"""The legacy poller following the flags: cutover types left out of the scan and caught by the safety sweep,
selective canaries held back for the grace period then dispatched as fallbacks, re-pending of failed tasks
left to the event path for the types it owns. SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.core.phases import bucket, percent_threshold
from bridge.db.schema import dispatch_log
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import TaskTable
from legacy_poller.poller import LegacyPoller
from tests.support import SHARED_DB_PARAMS, shared_engine, wait_for


@pytest.fixture(params=SHARED_DB_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    """Overrides the per-test database: the module's shared one for the dialect, emptied (``shared_engine``)."""
    return shared_engine(request)


def _specs(workflow_type: str, instance_ids: Sequence[str]) -> list[WorkflowSpec]:
    """One single-task instance per id (ready at once)."""
    return [WorkflowSpec(i, workflow_type, (TaskSpec("a"),)) for i in instance_ids]


def _seed(engine: Engine, tables: TaskTable, specs: Sequence[WorkflowSpec], *, ago: float = 0.0) -> None:
    """Seed; ``ago``: pretend the tasks became ready that many seconds ago (their updated_at)."""
    with engine.begin() as conn:
        seed(conn, tables, specs, now=datetime.now(UTC) - timedelta(seconds=ago))


def _split(workflow_type: str, percent: float, n: int, prefix: str) -> tuple[list[str], list[str]]:
    """``n`` instance ids inside the percentage of ``workflow_type`` and ``n`` outside it."""
    threshold = percent_threshold(percent)
    ids = [f"{prefix}-{k}" for k in range(4 * n + 200)]
    inside = [i for i in ids if bucket(workflow_type, i) < threshold][:n]
    outside = [i for i in ids if bucket(workflow_type, i) >= threshold][:n]
    assert len(inside) == len(outside) == n
    return inside, outside


def _log(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(dispatch_log).order_by(dispatch_log.c.id)).all())


def _paths(engine: Engine) -> dict[str, str]:
    """instance id -> path of its dispatch (each instance has one task)."""
    rows = _log(engine)
    assert len({r.instance_id for r in rows}) == len(rows), "an instance was dispatched twice"
    return {r.instance_id: r.path for r in rows}


def _status(engine: Engine, tables: TaskTable) -> dict[str, str]:
    t = tables.tasks
    with engine.connect() as conn:
        return {str(i): str(s) for i, s in conn.execute(sa.select(t.c.instance_id, t.c.status)).all()}


def _router(engine: Engine, interval: float = 3600.0) -> tuple[FlagStore, FlagRouter]:
    store = FlagStore(engine)
    return store, FlagRouter(store, refresh_interval=interval)


def _poller(engine: Engine, tables: TaskTable, router: FlagRouter, **kwargs: Any) -> tuple[LegacyPoller,
                                                                                           CollectorRegistry]:
    registry = CollectorRegistry()
    return LegacyPoller(engine, tables, router=router, registry=registry, **kwargs), registry


def _drive(step: Callable[[], object], done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Run ``step`` every 20 ms until ``done()``; fail after ``timeout`` seconds."""

    def stepped() -> bool:
        step()
        return done()

    wait_for(stepped, timeout, interval=0.02, what=what)


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def test_cutover_type_is_left_out_of_the_scan(engine: Engine, tables: TaskTable) -> None:
    """A type in cutover: the regular scan neither dispatches nor even counts its tasks (rows examined drop);
    the other type is dispatched as usual, path poller; the sweep leaves tasks younger than the grace."""
    orders, reports = [f"o-{n}" for n in range(6)], [f"r-{n}" for n in range(5)]
    _seed(engine, tables, _specs("orders", orders) + _specs("reports", reports))
    store, router = _router(engine)
    store.change("reports", "cutover", actor="t", reason="r", grace_seconds=30)
    router.refresh()
    poller, registry = _poller(engine, tables, router)

    result = poller.scan_once()
    assert (result.examined, result.ready, result.dispatched, result.fallback) == (6, 6, 6, 0)
    assert _paths(engine) == dict.fromkeys(orders, "poller")
    assert registry.get_sample_value("pollbridge_poller_types_left_out") == 1

    again = poller.scan_once()
    assert (again.examined, again.dispatched) == (0, 0)  # reports' 5 pending rows are not examined
    assert registry.get_sample_value("pollbridge_poller_rows_examined_total") == 6
    assert {_status(engine, tables)[r] for r in reports} == {"pending"}

    swept = poller.sweep_once()
    assert (swept.examined, swept.dispatched) == (5, 0)  # ready for less than 30 s: the event path's
    assert len(_log(engine)) == 6
    assert registry.get_sample_value("pollbridge_poller_sweeps_total") == 1


def test_sweep_dispatches_cutover_tasks_older_than_the_grace_as_fallback(engine: Engine, tables: TaskTable) -> None:
    """The safety sweep takes only cutover-type tasks ready longer than the grace period, path fallback, each
    counted in pollbridge_fallback_misses_total; it never touches other types, however old."""
    stale, fresh = [f"stale-{n}" for n in range(4)], [f"fresh-{n}" for n in range(3)]
    old_orders = [f"o-{n}" for n in range(3)]
    _seed(engine, tables, _specs("reports", stale) + _specs("orders", old_orders), ago=60)
    _seed(engine, tables, _specs("reports", fresh))
    store, router = _router(engine)
    store.change("reports", "cutover", actor="t", reason="r", grace_seconds=20)
    router.refresh()
    poller, registry = _poller(engine, tables, router)

    swept = poller.sweep_once()
    assert (swept.examined, swept.dispatched, swept.fallback) == (7, 4, 4)
    assert _paths(engine) == dict.fromkeys(stale, "fallback")
    assert registry.get_sample_value("pollbridge_fallback_misses_total", {"workflow_type": "reports"}) == 4
    assert registry.get_sample_value("pollbridge_poller_dispatches_total", {"path": "fallback"}) == 4
    status = _status(engine, tables)
    assert {status[i] for i in fresh + old_orders} == {"pending"}

    # The regular scan takes the polling type, never the cutover one.
    result = poller.scan_once()
    assert (result.dispatched, result.fallback) == (3, 0)
    assert _paths(engine) == {**dict.fromkeys(stale, "fallback"), **dict.fromkeys(old_orders, "poller")}


def test_sweep_waits_out_a_short_grace(engine: Engine, tables: TaskTable) -> None:
    """grace 0.3 s: the sweep dispatches a fresh cutover task only once it has been ready that long (the
    dispatch log shows dispatched_at - ready_at >= grace), then as fallback."""
    store, router = _router(engine)
    store.change("reports", "cutover", actor="t", reason="r", grace_seconds=0.3)
    router.refresh()
    poller, registry = _poller(engine, tables, router)
    ids = [f"r-{n}" for n in range(3)]
    _seed(engine, tables, _specs("reports", ids))
    _drive(poller.sweep_once, lambda: len(_log(engine)) == 3, "every task swept")
    for row in _log(engine):
        assert row.path == "fallback"
        waited = (_aware(row.dispatched_at) - _aware(row.ready_at)).total_seconds()
        assert waited >= 0.3 - 0.002, waited
    assert registry.get_sample_value("pollbridge_fallback_misses_total", {"workflow_type": "reports"}) == 3


def test_selective_holds_back_canaries_until_the_grace(engine: Engine, tables: TaskTable) -> None:
    """selective 50%, long grace: the scan dispatches the instances outside the percentage (path poller) and
    the other type, while the canaries stay pending even with a batch of 2 they would fill (they are filtered
    in SQL). A canary ready longer than the grace is a fallback; shortening the grace lets the rest follow."""
    canary, outside = _split("orders", 50.0, 5, "ord")
    old_canary, _ = _split("orders", 50.0, 2, "old")
    reports = ["rep-0", "rep-1"]
    _seed(engine, tables, _specs("orders", canary))  # the lowest ids: first in the scan's order
    _seed(engine, tables, _specs("orders", outside) + _specs("reports", reports))
    _seed(engine, tables, _specs("orders", old_canary), ago=120)
    store, router = _router(engine)
    store.change("orders", "selective", actor="t", reason="r", percent=50, grace_seconds=60)
    router.refresh()
    poller, registry = _poller(engine, tables, router, batch_size=2)

    result = poller.scan_once()
    assert (result.dispatched, result.fallback) == (len(outside) + len(reports) + len(old_canary), len(old_canary))
    assert _paths(engine) == {**dict.fromkeys(outside + reports, "poller"), **dict.fromkeys(old_canary, "fallback")}
    assert {_status(engine, tables)[i] for i in canary} == {"pending"}
    assert registry.get_sample_value("pollbridge_fallback_misses_total", {"workflow_type": "orders"}) == 2
    assert poller.scan_once().dispatched == 0

    store.change("orders", "selective", actor="t", reason="shorter grace", percent=50, grace_seconds=0.3)
    router.refresh()
    _drive(poller.scan_once, lambda: len(_log(engine)) == 2 * 5 + 2 + 2, "the canaries after the grace")
    paths = _paths(engine)
    assert {paths[i] for i in canary} == {"fallback"}
    assert registry.get_sample_value("pollbridge_fallback_misses_total", {"workflow_type": "orders"}) == 7
    assert registry.get_sample_value("pollbridge_poller_dispatches_total", {"path": "poller"}) == 7


def test_selective_without_percentage_holds_every_instance(engine: Engine, tables: TaskTable) -> None:
    """selective with no percentage: every instance of the type is a canary; other types are unaffected."""
    _seed(engine, tables, _specs("orders", ["a", "b", "c"]) + _specs("reports", ["r"]))
    store, router = _router(engine)
    store.change("orders", "selective", actor="t", reason="r", grace_seconds=60)
    router.refresh()
    poller, _ = _poller(engine, tables, router)
    assert poller.scan_once().dispatched == 1
    assert _paths(engine) == {"r": "poller"}


def test_repending_failed_tasks_skips_what_the_event_path_owns(engine: Engine, tables: TaskTable) -> None:
    """A failed task with attempts left goes back to pending only where the poller is authoritative: not for
    a cutover type, not for a selective canary; after a rollback the poller re-pends those too."""
    canary, outside = _split("etl", 50.0, 1, "etl")
    _seed(engine, tables, _specs("orders", ["o-0", "o-1"]) + _specs("reports", ["r-0", "r-1"])
          + _specs("etl", canary + outside))
    t = tables.tasks
    with engine.begin() as conn:
        conn.execute(t.update().values(status="failed", attempts=1))
    store, router = _router(engine)
    store.change("orders", "cutover", actor="t", reason="r")
    store.change("etl", "selective", actor="t", reason="r", percent=50, grace_seconds=60)
    router.refresh()
    poller, registry = _poller(engine, tables, router)

    result = poller.scan_once()
    assert result.repended == 3
    status = _status(engine, tables)
    assert status == {"o-0": "failed", "o-1": "failed", "r-0": "queued", "r-1": "queued",
                      canary[0]: "failed", outside[0]: "queued"}
    assert registry.get_sample_value("pollbridge_poller_repended_total") == 3

    store.change("orders", "polling", actor="t", reason="back", action="rollback")
    router.refresh()
    assert poller.scan_once().repended == 2
    assert _status(engine, tables)["o-0"] == "queued"


def _orphan(engine: Engine, tables: TaskTable, instance_id: str, status: str = "pending") -> None:
    """A task whose instance has no workflow_instances row: its workflow type is NULL."""
    with engine.begin() as conn:
        conn.execute(tables.tasks.insert().values(instance_id=instance_id, task_key="a", status=status, attempts=1))


def test_typeless_task_is_dispatched_while_a_type_is_in_cutover(engine: Engine, tables: TaskTable) -> None:
    """A task whose type is NULL belongs to no flag: a cutover of another type must not hide it."""
    _orphan(engine, tables, "orphan")
    store, router = _router(engine)
    store.change("orders", "cutover", actor="t", reason="r")
    router.refresh()
    poller, _ = _poller(engine, tables, router)
    assert poller.scan_once().dispatched == 1
    assert _paths(engine) == {"orphan": "poller"}


def test_typeless_failed_task_is_repended_while_a_type_is_in_cutover(engine: Engine, tables: TaskTable) -> None:
    """The event path routes a NULL type as polling, so only the poller can retry such a task."""
    _orphan(engine, tables, "orphan", status="failed")
    store, router = _router(engine)
    store.change("orders", "cutover", actor="t", reason="r")
    router.refresh()
    poller, _ = _poller(engine, tables, router)
    assert poller.scan_once().repended == 1


def test_typeless_task_is_not_held_back_by_another_types_canary(engine: Engine, tables: TaskTable) -> None:
    """A typeless task is the poller's (its event route is off): no other type's grace may delay it."""
    inside, _ = _split("orders", 50.0, 1, "orphan")
    _orphan(engine, tables, inside[0])
    store, router = _router(engine)
    store.change("orders", "selective", actor="t", reason="r", percent=50, grace_seconds=60)
    router.refresh()
    poller, _ = _poller(engine, tables, router)
    assert poller.scan_once().dispatched == 1


def test_unreadable_flag_store_makes_the_poller_authoritative(engine: Engine, tables: TaskTable) -> None:
    """Store unreadable: the poller treats every type as polling and dispatches a cutover type's tasks (path
    poller) rather than leave them to a possibly blind event path."""
    _seed(engine, tables, _specs("reports", ["r-0", "r-1"]))
    store, router = _router(engine, interval=0.01)
    store.change("reports", "cutover", actor="t", reason="r")
    poller, _ = _poller(engine, tables, router)
    assert poller.scan_once().dispatched == 0
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE pollbridge_flags RENAME TO pollbridge_flags_away"))
    try:
        time.sleep(0.02)
        assert poller.scan_once().dispatched == 2
        assert not router.healthy
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE pollbridge_flags_away RENAME TO pollbridge_flags"))
    assert _paths(engine) == {"r-0": "poller", "r-1": "poller"}


def test_rollback_reaches_the_poller_within_one_refresh_interval(engine: Engine, tables: TaskTable) -> None:
    """Without a refresh thread the poller re-reads stale flags itself: a rollback of a cutover type is
    followed by the next scan once the refresh interval has passed."""
    _seed(engine, tables, _specs("reports", ["r-0"]))
    store, router = _router(engine, interval=0.2)
    store.change("reports", "cutover", actor="t", reason="r")
    poller, _ = _poller(engine, tables, router)
    assert poller.scan_once().dispatched == 0
    store.change("reports", "polling", actor="t", reason="back", action="rollback")
    time.sleep(0.25)
    assert poller.scan_once().dispatched == 1


def test_running_timeout_fails_only_the_pollers_share(engine: Engine, tables: TaskTable) -> None:
    """A worker that died leaves its task running: the reference poller (``[poller] running_timeout``) fails it
    where it is authoritative (here ``polling`` and ``dual_write``, where the event path writes nothing), and
    leaves a cutover type's and a selective canary's to the event scheduler, a task running for less than the
    timeout to its worker; the retry then re-pends it (attempts permitting)."""
    canary, outside = _split("etl", 50.0, 1, "etl")
    _seed(engine, tables, _specs("orders", ["o-0"]) + _specs("reports", ["r-0"]) + _specs("billing", ["b-0"])
          + _specs("etl", canary + outside))
    t = tables.tasks
    old = datetime.now(UTC) - timedelta(seconds=120)
    with engine.begin() as conn:
        conn.execute(t.update().values(status="running", attempts=1, max_attempts=3, updated_at=old))
        conn.execute(t.update().where(t.c.instance_id == "b-0").values(updated_at=datetime.now(UTC)))
    store, router = _router(engine)
    store.change("orders", "cutover", actor="t", reason="r")
    store.change("reports", "dual_write", actor="t", reason="r")
    store.change("etl", "selective", actor="t", reason="r", percent=50, grace_seconds=60)
    router.refresh()

    untimed, _ = _poller(engine, tables, router)
    assert untimed.scan_once().timed_out == 0  # off by default: the platform's own timeout, if any
    assert set(_status(engine, tables).values()) == {"running"}

    poller, registry = _poller(engine, tables, router, running_timeout=60, retry_failed=False)
    assert poller.scan_once().timed_out == 2
    assert _status(engine, tables) == {"o-0": "running", "r-0": "failed", "b-0": "running",
                                       canary[0]: "running", outside[0]: "failed"}
    assert registry.get_sample_value("pollbridge_poller_timeouts_total") == 2
    with engine.connect() as conn:
        completed = conn.execute(sa.select(t.c.completed_at).where(t.c.instance_id == "r-0")).scalar_one()
    assert completed is not None and _aware(completed) > old
    assert poller.scan_once().timed_out == 0  # failed once: nothing left to time out
