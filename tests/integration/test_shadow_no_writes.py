"""Nothing written to the scheduler's table in the shadow phases (issue 17, item 4).

In ``polling`` and ``dual_write`` the legacy scheduler dispatches, retries and times out; pollbridge only
records shadow decisions in its own tables. Each test builds, before pollbridge runs, everything a
simulated legacy worker would have written (a task failed with attempts left, a task running past the
running timeout, an approval and a rejection, a task due later, ready roots), takes a dump of every
column of every row of the scheduler's tables, then runs the relay and the event scheduler over it
(start-up catch-up, every event, the retry, timeout and due timers fired, a second catch-up) and takes
the dump again: the only writes in between are pollbridge's, so the two dumps must be equal.

The phase is checked when a timer fires, not when it was armed: a retry or timeout armed in one phase
writes only if the type is on the dispatching route (``selective``, ``cutover``) at that moment. And with
``[legacy] retries = "legacy"`` (the default beside a foreign scheduler) pollbridge never retries or times
out a task, even in ``cutover``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from bridge.app.components import Components
from bridge.capture.relay import Relay
from bridge.core.phases import EventRouter, FixedRouter, Phase
from bridge.core.settings import RelaySettings, SchedulerSettings, TypeSettings, settings_from_dict
from bridge.db.engine import db_ago
from bridge.db.schema import decisions
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from event_scheduler.scheduler import EventScheduler
from event_scheduler.signals import record_signal
from tests.support import Env, wait_for

STACKS = ["sqlite-embedded", pytest.param("postgresql-embedded", marks=pytest.mark.postgres)]
RELAY = RelaySettings(batch_size=100, purge_interval=3600)
#: Retries due at once (the failure is stamped in the past) and a short running timeout.
SCHED = SchedulerSettings(group="nowrites", block=0.05, lease_ttl=30.0,
                          defaults=TypeSettings(retry_base=0.05, retry_max=0.1, retry_jitter=0.0, running_timeout=0.5))
PARTITIONS = 4
TIMER_KINDS = ("retry", "timeout")


def _dump(env: Env) -> dict[str, list[tuple[Any, ...]]]:
    """Every column of every row of the scheduler's tables (the task table and the instances table)."""
    tt = env.tables
    tables = [tt.tasks] + ([tt.instances] if tt.instances is not None else [])
    with env.engine.connect() as conn:
        return {t.name: [tuple(r) for r in conn.execute(sa.select(t).order_by(*t.primary_key.columns))]
                for t in tables}


def _legacy_world(env: Env, prefix: str) -> dict[str, Any]:
    """Seed one instance and write what the legacy scheduler and its workers did; task ids by key."""
    tt = env.tables
    t = tt.tasks
    tasks = (TaskSpec("root"), TaskSpec("after", ("root",)), TaskSpec("flaky"), TaskSpec("hung"),
             TaskSpec("approve", awaits_signal="approval"), TaskSpec("reject", awaits_signal="approval"),
             TaskSpec("later", due_in=3600.0))
    instance = f"{prefix}-i"
    with env.engine.begin() as conn:
        seed(conn, tt, [WorkflowSpec(instance, "orders", tasks)])
        ids = dict(conn.execute(sa.select(t.c.task_key, t.c.id).where(t.c.instance_id == instance)).all())
        past = db_ago(tt.dialect_name, 10.0)
        # The legacy scheduler dispatched both; a worker claimed them: one failed (attempts left), the
        # other hangs in running, long past the running timeout.
        conn.execute(t.update().where(t.c.id == ids["flaky"])
                     .values(status="failed", attempts=1, dispatched_at=past, completed_at=past, updated_at=past))
        conn.execute(t.update().where(t.c.id == ids["hung"])
                     .values(status="running", attempts=1, dispatched_at=past, updated_at=past))
    # The platform's signals, recorded before the dump: an approval and a rejection.
    record_signal(env.engine, tt, str(ids["approve"]), "approval", actor="legacy")
    record_signal(env.engine, tt, str(ids["reject"]), "rejection", actor="legacy")
    return ids


class Driver:
    """The relay and one event scheduler, driven synchronously (no threads: every step is the test's)."""

    def __init__(self, env: Env, router: EventRouter, scheduler: Callable[..., EventScheduler] | None = None) -> None:
        self.env = env
        self.relay = Relay(env.engine, env.open_bus(), RELAY, statuses=env.tables.mapping.statuses)
        make = scheduler or (lambda bus, registry: EventScheduler(
            env.engine, env.tables, bus, SCHED, router, visibility_timeout=30.0, registry=registry))
        self.sched: EventScheduler = make(env.open_bus(), CollectorRegistry())
        self.sched.refresh_leases()  # takes every partition and catches up from the database
        assert self.sched.leases.owned == set(range(PARTITIONS))

    def drain(self) -> None:
        """Publish the outbox and handle every event on the bus."""
        while self.relay.publish_batch():
            pass
        while self.sched.poll_once(block=0.0):
            pass

    def fire_due(self) -> None:
        for timer in self.sched.timers.due():
            self.sched._fire(timer)

    def fired(self, kind: str) -> float:
        return self.sched.metrics.value("pollbridge_scheduler_timers_fired_total", {"kind": kind})

    def run_until_fired(self, kinds: tuple[str, ...], timeout: float = 15.0) -> None:
        """Drain and fire due timers until every timer of ``kinds`` fired at least once (deadline-bounded)."""
        def step() -> bool:
            self.drain()
            self.fire_due()
            self.drain()
            return all(self.fired(kind) >= 1 for kind in kinds)

        wait_for(step, timeout, interval=0.02, what=f"the {', '.join(kinds)} timers to fire")

    def expire(self, kind: str) -> int:
        """Fire every armed timer of ``kind`` now, as if its time had come (the due timer of a task due in an
        hour: no test waits on the wall clock for it, so a slow machine cannot skip it)."""
        timers = [timer for (k, _), timer in list(self.sched.timers._current.items()) if k == kind]
        for timer in timers:
            self.sched.timers.cancel(timer.kind, timer.key)
            self.sched._fire(timer)
        return len(timers)

    def timer_kinds(self) -> set[str]:
        return {kind for kind, _ in self.sched.timers._current}


@pytest.fixture
def drivers(env: Env) -> Iterator[list[Driver]]:
    made: list[Driver] = []
    yield made
    for d in made:
        d.sched.leases.release_all()


def _statuses(env: Env, ids: dict[str, Any], *keys: str) -> dict[str, tuple[str, int]]:
    t = env.tables.tasks
    with env.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.id, t.c.status, t.c.attempts).where(t.c.id.in_([ids[k] for k in keys])))
        by_id = {r.id: (r.status, r.attempts) for r in rows}
    return {k: by_id[ids[k]] for k in keys}


def _decided(env: Env) -> set[str]:
    with env.engine.connect() as conn:
        return set(conn.execute(sa.select(decisions.c.task_key)).scalars())


@pytest.mark.parametrize("env", STACKS, indirect=True)
@pytest.mark.parametrize("phase", ["polling", "dual_write"])
def test_a_shadow_phase_writes_nothing_to_the_task_table(env: Env, phase: Phase, drivers: list[Driver]) -> None:
    _legacy_world(env, f"nw-{phase}")
    before = _dump(env)
    d = Driver(env, FixedRouter(phase))
    drivers.append(d)
    # Every event, the retry of the failed task and the timeout of the hung one fired, and the due timer.
    d.run_until_fired(TIMER_KINDS)
    assert d.expire("due") == 1
    d.drain()
    d.sched.catch_up(set(range(PARTITIONS)))  # a second catch-up, as after taking partitions over
    d.fire_due()
    d.drain()
    assert _dump(env) == before, f"pollbridge wrote the task table in {phase}"
    assert d.sched.metrics.value("pollbridge_scheduler_retries_total", {"workflow_type": "orders"}) == 0
    assert d.sched.metrics.value("pollbridge_scheduler_timeouts_total", {"workflow_type": "orders"}) == 0
    # Shadow decisions (pollbridge's own table), in dual_write only: for what became ready, and for the
    # two tasks the legacy scheduler had taken before their insert events were evaluated (lost races);
    # none for the rejected task (never dispatched) or for the one waiting on a dependency.
    expected = {"root", "approve", "flaky", "hung"} if phase == "dual_write" else set()
    assert _decided(env) == expected


@pytest.mark.parametrize("env", STACKS, indirect=True)
@pytest.mark.parametrize("promoted", ["selective", "cutover"])
def test_retries_and_timeouts_armed_in_a_shadow_phase_happen_once_the_type_dispatches(
        env: Env, promoted: Phase, drivers: list[Driver]) -> None:
    """The route is asked when a timer fires: fired in ``dual_write`` they write nothing (and look again
    while the task still waits), fired again after the type went to ``selective`` or ``cutover`` the
    retry and the timeout happen, as they always did on the dispatching route."""
    store = FlagStore(env.engine, default_grace=5.0)
    router = FlagRouter(store, refresh_interval=3600, registry=CollectorRegistry())
    store.change("orders", "dual_write", actor="test", reason="shadow", forced=True)
    router.refresh()
    ids = _legacy_world(env, f"promo-{promoted}")
    before = _dump(env)
    d = Driver(env, router)
    drivers.append(d)
    d.run_until_fired(("retry", "timeout"))
    assert _dump(env) == before, "a timer fired in dual_write wrote the task table"
    assert {"retry", "timeout"} <= d.timer_kinds(), "the timers that found the type in dual_write were dropped"
    store.change("orders", promoted, actor="test", reason="promoted", forced=True)
    router.refresh()

    def retried_and_timed_out() -> bool:
        d.fire_due()
        got = _statuses(env, ids, "flaky", "hung")
        return got["flaky"][0] != "failed" and got["hung"][0] == "failed"

    wait_for(retried_and_timed_out, 15, interval=0.05, what=f"the retry and the timeout in {promoted}")
    got = _statuses(env, ids, "flaky", "hung", "reject")
    assert got["flaky"] == ("pending", 1)  # re-pended for its second attempt (no relay ran since)
    assert got["hung"] == ("failed", 1)
    assert got["reject"] == ("failed", 3)  # rejected for good: never retried
    assert d.sched.metrics.value("pollbridge_scheduler_retries_total", {"workflow_type": "orders"}) == 1
    assert d.sched.metrics.value("pollbridge_scheduler_timeouts_total", {"workflow_type": "orders"}) == 1


@pytest.mark.parametrize("env", STACKS, indirect=True)
def test_a_timer_armed_in_cutover_writes_nothing_after_a_rollback(env: Env, drivers: list[Driver]) -> None:
    """The other direction: armed while the type dispatched, fired after it was rolled back to polling."""
    store = FlagStore(env.engine, default_grace=5.0)
    router = FlagRouter(store, refresh_interval=3600, registry=CollectorRegistry())
    store.change("orders", "cutover", actor="test", reason="events", forced=True)
    router.refresh()
    t = env.tables.tasks
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("rb-i", "orders", (TaskSpec("flaky"), TaskSpec("hung")))])
    d = Driver(env, router)  # its catch-up dispatches both tasks
    drivers.append(d)
    with env.engine.begin() as conn:  # the legacy workers' results, as the timers will find them
        past = db_ago(env.tables.dialect_name, 10.0)
        conn.execute(t.update().where(t.c.task_key == "flaky").values(status="failed", attempts=1, updated_at=past))
        conn.execute(t.update().where(t.c.task_key == "hung").values(status="running", attempts=1, updated_at=past))
    d.drain()  # both timers armed on the dispatching route ...
    assert {"retry", "timeout"} <= d.timer_kinds()
    store.change("orders", "polling", actor="test", reason="rollback", forced=True)
    router.refresh()  # ... and the type rolled back before they fire
    before = _dump(env)

    def both_fired() -> bool:
        d.fire_due()
        return d.fired("retry") >= 1 and d.fired("timeout") >= 1

    wait_for(both_fired, 15, what="the timers armed in cutover to fire")
    assert _dump(env) == before, "a timer armed in cutover wrote the task table after the rollback to polling"


LEGACY_OWNS_RETRIES = [
    pytest.param({"retries": "legacy"}, id="retries-legacy"),
    pytest.param({"kind": "foreign"}, id="foreign-default"),
]


@pytest.mark.parametrize("env", STACKS, indirect=True)
@pytest.mark.parametrize("legacy", LEGACY_OWNS_RETRIES)
def test_when_the_legacy_scheduler_owns_retries_none_happen_even_in_cutover(
        env: Env, legacy: dict[str, str], drivers: list[Driver]) -> None:
    """``[legacy] retries = "legacy"`` (and ``kind = "foreign"``, whose default it is), wired through the
    composition root: no retry or timeout timer is armed, and none writes, even on the dispatching route."""
    settings = replace(settings_from_dict({"legacy": legacy}), scheduler=SCHED)
    assert not settings.legacy.pollbridge_retries
    router = FixedRouter("cutover")

    def make(bus: Any, registry: CollectorRegistry) -> EventScheduler:
        return Components(settings).scheduler(env.engine, env.tables, bus, router, registry=registry)

    ids = _legacy_world(env, "legacy-owns")
    d = Driver(env, router, make)
    drivers.append(d)
    d.drain()
    assert d.expire("due") == 1
    d.drain()
    d.sched.catch_up(set(range(PARTITIONS)))
    d.fire_due()
    d.drain()
    assert not {"retry", "timeout"} & d.timer_kinds()
    assert d.fired("retry") == d.fired("timeout") == 0
    assert _statuses(env, ids, "flaky", "hung") == {"flaky": ("failed", 1), "hung": ("running", 1)}
    assert d.sched.metrics.value("pollbridge_scheduler_retries_total", {"workflow_type": "orders"}) == 0
    assert d.sched.metrics.value("pollbridge_scheduler_timeouts_total", {"workflow_type": "orders"}) == 0
