"""Phases flipped at random while a workload runs: every task done, none twice, none early.

A Hypothesis state machine runs the relay, the event scheduler and the legacy poller synchronously,
each following the flags through its own :class:`~bridge.flags.router.FlagRouter` (so processes see a
change at different moments, as real ones do), on one database. Rules add instances of two workflow
types, let workers complete or fail tasks, deliver events, scan, run the safety sweep, and:

* set a type's phase and selective percentage at random, skipping steps (an operator with ``--force``),
* roll back one type or all of them mid-flight,
* take the flag store down and bring it back (each process notices at its next refresh: the poller
  then treats every type as ``polling``, the scheduler keeps the flags it last read),
* refresh some routers and not others.

After every step no dispatch is early or doubled. At teardown everything is driven until the
instances settle, with the flags as they were left: whatever the phase, some path must own each task
(the poller's fallback and the safety sweep catch what the event path missed while its route was
off). Then nothing is lost, early or doubled, and every dispatch path is one of the three known ones.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from prometheus_client import CollectorRegistry

from bridge.bus import EventBus
from bridge.capture.relay import Relay
from bridge.core.errors import FlagStoreUnavailable
from bridge.core.phases import PHASES, Flag
from bridge.core.settings import RelaySettings, SchedulerSettings, TypeSettings, WorkerSettings
from bridge.db.schema import (
    bus_dead,
    bus_groups,
    bus_log,
    bus_pending,
    decisions,
    dispatch_log,
    flag_audit,
    flags,
    outbox,
    scheduler_leases,
    scheduler_members,
)
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reference.oracle import verify
from bridge.reference.workload import SHAPES, TaskSpec, WorkflowSpec, make_shape, seed
from event_scheduler.scheduler import EventScheduler
from legacy_poller.poller import LegacyPoller
from legacy_poller.workers import WorkerPool
from tests.support import Env, StackContext

TYPES = ("orders", "reports")
GRACE = 0.05  # the poller's fallback and the sweep wait this long before acting for the event path
SCHED = SchedulerSettings(group="flips", batch_size=16, block=0.05, lease_ttl=30.0, claim_interval=0.2,
                          max_deliveries=1000, defaults=TypeSettings(retry_base=0.05, retry_max=0.1, retry_jitter=0.5))
RELAY = RelaySettings(batch_size=100, purge_interval=3600)
OK = WorkerSettings(concurrency=1, min_duration=0.0, max_duration=0.0, failure_rate=0.0)
FAIL = replace(OK, failure_rate=1.0)
SETTLE_TIMEOUT = 45.0
RESET = (dispatch_log, decisions, outbox, bus_pending, bus_groups, bus_log, bus_dead, scheduler_leases,
         scheduler_members, flag_audit, flags)

MACHINE_SETTINGS = settings(
    max_examples=int(os.environ.get("POLLBRIDGE_STATEFUL_EXAMPLES", "10")),
    stateful_step_count=25,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


class FlakyStore(FlagStore):
    """The flag store, with an outage switch (the table stays; reads fail as if the database were gone)."""

    down = False

    def all(self) -> dict[str, Flag]:
        if FlakyStore.down:
            raise FlagStoreUnavailable("cannot read the flag store: injected outage")
        return super().all()


class Context(StackContext):
    partitions = 2
    reset_tables = RESET


@st.composite
def dags(draw: st.DrawFn) -> tuple[TaskSpec, ...]:
    import random

    kind = draw(st.sampled_from(SHAPES))
    low = {"chain": 1, "fanout": 3, "diamond": 4}[kind]
    size = draw(st.integers(low, low + 3))
    graph = [(t.key, t.depends_on) for t in make_shape(kind, size, random.Random(0), due_fraction=0.0)]
    return tuple(TaskSpec(key, deps, due_in=draw(st.sampled_from([None, None, None, 0.05]))) for key, deps in graph)


class FlipMachine(RuleBasedStateMachine):
    def __init__(self, ctx: Context) -> None:
        super().__init__()
        ctx.examples += 1
        ctx.reset()
        FlakyStore.down = False
        self.ctx = ctx
        self.engine = ctx.env.engine
        self.tables = ctx.env.tables
        self.example = ctx.examples
        self.instances: list[str] = []
        self.buses: list[EventBus] = []
        self.store = FlakyStore(self.engine, default_grace=GRACE)
        # One router per process: a change reaches each at its own next refresh.
        self.sched_router = FlagRouter(self.store, refresh_interval=3600, registry=CollectorRegistry())
        self.poller_router = FlagRouter(self.store, refresh_interval=3600, registry=CollectorRegistry())
        self.sched_router.refresh()
        self.poller_router.refresh()
        self.relay = Relay(self.engine, self._bus(), RELAY, statuses=self.tables.mapping.statuses)
        self.sched = EventScheduler(self.engine, self.tables, self._bus(), SCHED, self.sched_router,
                                    visibility_timeout=0.2, registry=CollectorRegistry(),
                                    holder=f"flips-{self.example}")
        self.sched.refresh_leases()
        self.poller = LegacyPoller(self.engine, self.tables, router=self.poller_router, registry=CollectorRegistry())
        self.ok = WorkerPool(self.engine, self.tables, OK, seed=1)
        self.fail = WorkerPool(self.engine, self.tables, FAIL, seed=2)

    def _bus(self) -> EventBus:
        bus = self.ctx.open_bus()
        self.buses.append(bus)
        return bus

    # --- the workload ---------------------------------------------------------------------------------
    @initialize(graphs=st.lists(dags(), min_size=1, max_size=3), workflow_type=st.sampled_from(TYPES))
    def start(self, graphs: list[tuple[TaskSpec, ...]], workflow_type: str) -> None:
        for tasks in graphs:
            self.add_instance(tasks, workflow_type)

    @rule(tasks=dags(), workflow_type=st.sampled_from(TYPES))
    def add_instance(self, tasks: tuple[TaskSpec, ...], workflow_type: str) -> None:
        instance_id = f"f{self.example}-{len(self.instances)}"
        with self.engine.begin() as conn:
            seed(conn, self.tables, [WorkflowSpec(instance_id, workflow_type, tasks)])
        self.instances.append(instance_id)

    @rule(outcomes=st.lists(st.booleans(), min_size=1, max_size=4))
    def work(self, outcomes: list[bool]) -> None:
        for ok in outcomes:
            (self.ok if ok else self.fail).work_one()

    @rule()
    def deliver(self) -> None:
        self.relay.publish_batch()
        self.sched.poll_once(block=0.0)

    @rule()
    def scan(self) -> None:
        self.poller.scan_once()

    @rule()
    def sweep(self) -> None:
        self.poller.sweep_once()

    # --- the operator, the outage ---------------------------------------------------------------------
    @precondition(lambda self: not FlakyStore.down)
    @rule(workflow_type=st.sampled_from(TYPES), phase=st.sampled_from(PHASES),
          percent=st.sampled_from([None, 0.0, 10.0, 50.0, 100.0]))
    def set_phase(self, workflow_type: str, phase: str, percent: float | None) -> None:
        self.store.change(workflow_type, phase, actor="hypothesis", reason="random flip", forced=True,
                          percent=percent if phase == "selective" else None, grace_seconds=GRACE)

    @precondition(lambda self: not FlakyStore.down)
    @rule(everything=st.booleans(), workflow_type=st.sampled_from(TYPES))
    def rollback(self, everything: bool, workflow_type: str) -> None:
        from bridge.rollout.promotion import rollback

        rollback(self.store, None if everything else [workflow_type], reason="mid-flight", actor="hypothesis")

    @rule(down=st.booleans())
    def outage(self, down: bool) -> None:
        FlakyStore.down = down

    @rule(scheduler=st.booleans(), poller=st.booleans())
    def refresh(self, scheduler: bool, poller: bool) -> None:
        if scheduler:
            self.sched_router.refresh()
        if poller:
            self.poller_router.refresh()

    # --- checked after every step ---------------------------------------------------------------------
    @invariant()
    def never_early_never_twice(self) -> None:
        if not self.instances:
            return
        with self.engine.connect() as conn:
            verdict = verify(conn, self.tables, self.instances)
        assert verdict.early == 0, verdict.problems
        assert verdict.double_dispatched == 0, verdict.problems

    @invariant()
    def a_store_outage_makes_the_poller_authoritative(self) -> None:
        if not self.poller_router.healthy:
            assert self.poller_router.poller_flags() == {}

    # --- the end --------------------------------------------------------------------------------------
    def teardown(self) -> None:
        try:
            if self.instances:
                self._settle()
        finally:
            FlakyStore.down = False
            self.sched.leases.release_all()  # lock files (a SQLite file) are not reset with the tables
            for bus in self.buses:
                bus.close()

    def _settle(self) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            self.sched_router.refresh()
            self.poller_router.refresh()
            while self.relay.publish_batch():
                pass
            self.sched.refresh_leases()
            while self.sched.poll_once(block=0.0):
                pass
            self.sched.claim_stale()
            for timer in self.sched.timers.due():
                self.sched._fire(timer)
            self.poller.scan_once()
            self.poller.sweep_once()
            while self.ok.work_one():
                pass
            with self.engine.connect() as conn:
                verdict = verify(conn, self.tables, self.instances)
                paths = set(conn.execute(sa.select(dispatch_log.c.path).distinct()).scalars())
            if verdict.unsettled == 0:
                break
            if time.monotonic() > deadline:
                flags_now = {} if FlakyStore.down else self.store.all()
                raise AssertionError(f"not settled after {SETTLE_TIMEOUT} s with flags {flags_now} "
                                     f"(store down: {FlakyStore.down}): {verdict}")
            time.sleep(0.01)
        assert verdict.lost == 0, verdict
        assert verdict.early == 0, verdict.problems
        assert verdict.double_dispatched == 0, verdict.problems
        assert paths <= {"poller", "events", "fallback"}, paths


STACKS = [
    "sqlite-embedded",
    pytest.param("postgresql-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
]


@pytest.mark.parametrize("env", STACKS, indirect=True)
def test_random_phase_flips_lose_nothing(env: Env, request: pytest.FixtureRequest) -> None:
    redis_url = request.getfixturevalue("redis_server") if env.kind.endswith("redis") else None
    ctx = Context(env, redis_url)
    run_state_machine_as_test(lambda: FlipMachine(ctx), settings=MACHINE_SETTINGS)  # type: ignore[no-untyped-call]
    assert ctx.examples >= 1


@pytest.mark.parametrize("env", STACKS, indirect=True)
def test_a_task_stranded_by_a_flip_is_caught_by_the_safety_sweep(env: Env, request: pytest.FixtureRequest) -> None:
    """Task b became ready while the type was ``polling`` (its event consumed with the route off) and the
    type went to ``cutover`` before the poller scanned: no event will come for it and the poller's scan
    leaves the type out, so only the safety sweep dispatches it, after the grace period, as ``fallback``
    (an event-path miss, counted)."""
    redis_url = request.getfixturevalue("redis_server") if env.kind.endswith("redis") else None
    ctx = Context(env, redis_url)
    machine = FlipMachine(ctx)
    try:
        machine.add_instance((TaskSpec("a"), TaskSpec("b", ("a",))), "orders")
        machine.scan()
        assert machine.ok.work_one()  # a completed: b is ready
        machine.deliver()  # the scheduler sees it with the route off (polling)
        machine.set_phase("orders", "cutover", None)
        machine.refresh(scheduler=True, poller=True)
        machine.deliver()
        machine.scan()
        with machine.engine.connect() as conn:
            paths = conn.execute(sa.select(dispatch_log.c.task_key, dispatch_log.c.path)).all()
        assert [tuple(p) for p in paths] == [("a", "poller")]
        deadline = time.monotonic() + 10
        while not machine.poller.sweep_once().fallback:
            assert time.monotonic() < deadline, "the sweep never dispatched the stranded task"
            time.sleep(0.02)
        with machine.engine.connect() as conn:
            paths = conn.execute(sa.select(dispatch_log.c.task_key, dispatch_log.c.path)
                                 .order_by(dispatch_log.c.id)).all()
        assert [tuple(p) for p in paths] == [("a", "poller"), ("b", "fallback")]
        assert machine.poller.metrics.value("pollbridge_fallback_misses_total", {"workflow_type": "orders"}) == 1
    finally:
        machine.teardown()
