"""The shadow decision survives a lost race (issue 17, item 3).

In ``dual_write`` the legacy scheduler dispatches, and it may take a task a few milliseconds before the
event scheduler evaluates the event that made it ready. The event path decides on the facts the event
carries (the dependency completed), not on the row's status at evaluation time: the task still gets its
shadow decision, for the attempt the legacy scheduler dispatched, exactly once. Never early: a task the
legacy scheduler took while a dependency was still running gets none, and neither does one it took
before the facts that made it ready.

The race is made deterministic: the dependency's completion and the legacy scheduler's take commit in
one transaction, before the scheduler handles any of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from bridge.capture.relay import Relay
from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import RelaySettings, SchedulerSettings
from bridge.db.engine import db_ago, db_now
from bridge.db.schema import decisions, dispatch_log
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.scheduler import EventScheduler
from tests.support import Env

STACKS = ["sqlite-embedded", pytest.param("postgresql-embedded", marks=pytest.mark.postgres)]
RELAY = RelaySettings(batch_size=100, purge_interval=3600)
SCHED = SchedulerSettings(group="lostrace", block=0.05, lease_ttl=30.0)
#: Airflow's semantics on the reference tables: the dispatch itself increments the attempt counter.
DISPATCH_MOVES = TaskTableMapping(attempt_moves="dispatch", dispatch_set=(("attempts", "increment"),))


class Shadow:
    """The relay and an event scheduler in ``dual_write``, driven synchronously by the test."""

    def __init__(self, env: Env, tables: TaskTable) -> None:
        self.env = env
        self.tables = tables
        self.relay = Relay(env.engine, env.open_bus(), RELAY, statuses=tables.mapping.statuses)
        self.sched = EventScheduler(env.engine, tables, env.open_bus(), SCHED, FixedRouter("dual_write"),
                                    visibility_timeout=30.0, registry=CollectorRegistry())
        self.sched.refresh_leases()

    def drain(self) -> None:
        while self.relay.publish_batch():
            pass
        while self.sched.poll_once(block=0.0):
            pass

    def decisions(self) -> list[tuple[str, int | None]]:
        with self.env.engine.connect() as conn:
            return sorted((r.task_key, r.attempt) for r in conn.execute(
                sa.select(decisions.c.task_key, decisions.c.attempt)))

    def decision_of(self, key: str) -> Any:
        with self.env.engine.connect() as conn:
            return conn.execute(sa.select(decisions).where(decisions.c.task_key == key)).one()

    def write(self, *changes: tuple[str, dict[str, Any]]) -> None:
        """The legacy scheduler and its workers: every change in one transaction, in order."""
        t = self.tables.tasks
        with self.env.engine.begin() as conn:
            for key, values in changes:
                conn.execute(t.update().where(t.c.task_key == key).values(values))

    def row(self, key: str) -> Any:
        t = self.tables.tasks
        with self.env.engine.connect() as conn:
            return conn.execute(sa.select(t).where(t.c.task_key == key)).one()


@pytest.fixture
def shadows(env: Env) -> Iterator[list[Shadow]]:
    made: list[Shadow] = []
    yield made
    for s in made:
        s.sched.leases.release_all()


def _start(env: Env, tables: TaskTable, shadows: list[Shadow]) -> Shadow:
    with env.engine.begin() as conn:  # a → b; a, x → c; y → d
        seed(conn, tables, [WorkflowSpec("race", "orders", (
            TaskSpec("a"), TaskSpec("x"), TaskSpec("y"), TaskSpec("b", ("a",)), TaskSpec("c", ("a", "x")),
            TaskSpec("d", ("y",))))])
    s = Shadow(env, tables)
    shadows.append(s)
    s.drain()  # the roots are ready and pending when their inserts are evaluated: decided, as always
    assert s.decisions() == ROOTS
    return s


ROOTS = [("a", 1), ("x", 1), ("y", 1)]

#: Where the legacy scheduler's take of b stands when the event path evaluates (claim semantics: the
#: worker's claim increments the attempt counter), and the attempts column then.
TAKEN = [
    pytest.param({"status": "queued"}, id="dispatched"),
    pytest.param({"status": "running", "attempts": 1}, id="claimed"),
    pytest.param({"status": "completed", "attempts": 1}, id="finished"),
]


@pytest.mark.parametrize("env", STACKS, indirect=True)
@pytest.mark.parametrize("taken", TAKEN)
def test_a_task_the_legacy_scheduler_took_first_still_gets_its_decision(
        env: Env, taken: dict[str, Any], shadows: list[Shadow]) -> None:
    s = _start(env, env.tables, shadows)
    now = db_now(env.tables.dialect_name)
    # The legacy scheduler and its workers: the roots dispatched and claimed (attempt 1) ...
    for root in ("a", "x", "y"):
        s.write((root, {"status": "queued", "dispatched_at": now}))
        s.write((root, {"status": "running", "attempts": 1}))
    s.drain()
    # ... then, in one transaction: a completes, and the legacy scheduler takes b (ready) and c (not ready:
    # x still runs; a scheduler that dispatches early, or a person who ran it by hand).
    completion = {"status": "completed", "completed_at": now, "updated_at": now}
    s.write(("a", completion), ("b", {"dispatched_at": now, "updated_at": now, **taken}),
            ("c", {"status": "queued", "dispatched_at": now, "updated_at": now}))
    s.drain()  # the completion of a is evaluated now: b and c are no longer pending
    assert s.decisions() == sorted([*ROOTS, ("b", 1)]), "the lost race of b got no decision (or c got one)"
    b = s.decision_of("b")
    a_row = s.row("a")
    assert b.ready_at is not None and b.ready_at.replace(tzinfo=None) == a_row.completed_at.replace(tzinfo=None)
    # d was taken 30 s before y completed, on other facts: when y completes, d's dependencies are done,
    # but its take is not this event's (a decision now would be a late one for a dispatch it never raced).
    s.write(("d", {"status": "queued", "dispatched_at": db_ago(env.tables.dialect_name, 30.0), "updated_at": now}))
    s.write(("y", completion))
    s.drain()
    # Replayed and later events change nothing: one decision per attempt.
    s.sched.catch_up({0, 1, 2, 3})
    s.write(("b", {"status": "completed", "attempts": 1, "completed_at": now, "updated_at": now}))
    s.drain()
    assert s.decisions() == sorted([*ROOTS, ("b", 1)])
    with env.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dispatch_log)).scalar() == 0


@pytest.mark.parametrize("env", STACKS, indirect=True)
def test_a_lost_race_when_the_dispatch_moves_the_attempt_counter(env: Env, shadows: list[Shadow]) -> None:
    """``attempt_moves = "dispatch"`` (Airflow's try_number): the legacy dispatch already incremented the
    counter, so the decision's attempt is the counter itself, not one more. A second try lost the same way
    is decided for attempt 2."""
    tables = reflect_tables(env.engine, DISPATCH_MOVES)
    s = _start(env, tables, shadows)
    now = db_now(tables.dialect_name)
    s.write(("a", {"status": "queued", "attempts": 1, "dispatched_at": now}))
    s.drain()
    s.write(("a", {"status": "completed", "completed_at": now, "updated_at": now}),
            ("b", {"status": "queued", "attempts": 1, "dispatched_at": now, "updated_at": now}))
    s.drain()
    assert s.decisions() == sorted([*ROOTS, ("b", 1)])
    # b's first try fails; the legacy scheduler re-pends it and dispatches the second try at once, before
    # the event path evaluates the re-pend.
    s.write(("b", {"status": "failed", "updated_at": now}))
    s.drain()
    s.write(("b", {"status": "pending", "updated_at": now}),
            ("b", {"status": "queued", "attempts": 2, "dispatched_at": now, "updated_at": now}))
    s.drain()
    assert s.decisions() == sorted([*ROOTS, ("b", 1), ("b", 2)])
