"""A branch that skips one side (issue 17, item 2): the skip propagates as Airflow propagates it.

The reference tables with their optional ``trigger_rule`` column and a ``skipped`` status: ``choose`` →
(``left``, ``right``); ``right`` → ``right2`` (``all_success``); (``left``, ``right2``) → ``join``
(``none_failed_min_one_success``). The branch task skips ``right``. On the dispatching route the event
scheduler moves ``right2`` to skipped (its rule can no longer hold, nothing failed), dispatches ``left``,
and, once ``left`` completes, ``join``. In ``dual_write`` it writes nothing: ``right2`` stays pending (the
legacy scheduler's call). A failed dependency is not a skip: the task stays pending.
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
from bridge.db.engine import db_now
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.scheduler import EventScheduler
from tests.support import Env, drain

STACKS = ["sqlite-embedded", pytest.param("postgresql-embedded", marks=pytest.mark.postgres)]
RELAY = RelaySettings(batch_size=100, purge_interval=3600)
SCHED = SchedulerSettings(group="skips", block=0.05, lease_ttl=30.0)
MAPPING = TaskTableMapping.from_dict({"columns": {"trigger_rule": "trigger_rule"}, "statuses": {"skipped": "skipped"}})


class Stack:
    def __init__(self, env: Env, tables: TaskTable, phase: str) -> None:
        self.env = env
        self.tables = tables
        self.relay = Relay(env.engine, env.open_bus(), RELAY, statuses=tables.mapping.statuses)
        self.sched = EventScheduler(env.engine, tables, env.open_bus(), SCHED, FixedRouter(phase),
                                    visibility_timeout=30.0, registry=CollectorRegistry())
        self.sched.refresh_leases()

    def drain(self) -> None:
        drain(self.relay, self.sched)  # a skip's own captured change wakes its dependents: a few rounds

    def write(self, key: str, values: dict[str, Any]) -> None:
        t = self.tables.tasks
        with self.env.engine.begin() as conn:
            conn.execute(t.update().where(t.c.task_key == key).values(values))

    def statuses(self) -> dict[str, str]:
        t = self.tables.tasks
        with self.env.engine.connect() as conn:
            return {r.task_key: r.status for r in conn.execute(sa.select(t.c.task_key, t.c.status))}


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for s in made:
        s.sched.leases.release_all()


def _start(env: Env, phase: str, stacks: list[Stack]) -> Stack:
    tables = reflect_tables(env.engine, MAPPING)
    with env.engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec("branchy", "orders", (
            TaskSpec("choose"), TaskSpec("left", ("choose",)), TaskSpec("right", ("choose",)),
            TaskSpec("right2", ("right",)), TaskSpec("join", ("left", "right2"))))])
        conn.execute(tables.tasks.update().where(tables.tasks.c.task_key == "join")
                     .values(trigger_rule="none_failed_min_one_success"))
    s = Stack(env, tables, phase)
    stacks.append(s)
    return s


def _finish(s: Stack, key: str, status: str = "completed") -> None:
    now = db_now(s.tables.dialect_name)
    s.write(key, {"status": "running", "attempts": 1})
    s.write(key, {"status": status, "completed_at": now})


@pytest.mark.parametrize("env", STACKS, indirect=True)
def test_a_skipped_side_propagates_and_the_join_runs(env: Env, stacks: list[Stack]) -> None:
    s = _start(env, "cutover", stacks)
    s.drain()
    assert s.statuses()["choose"] == "queued"
    _finish(s, "choose")
    s.write("right", {"status": "skipped", "completed_at": db_now(s.tables.dialect_name)})  # the branch's choice
    s.drain()
    got = s.statuses()
    assert got["left"] == "queued"
    assert got["right2"] == "skipped", "all_success after a skipped dependency: the skip propagates"
    assert got["join"] == "pending", "join waits for left"
    _finish(s, "left")
    s.drain()
    assert s.statuses()["join"] == "queued", "none_failed_min_one_success: left succeeded, right2 skipped"


@pytest.mark.parametrize("env", STACKS, indirect=True)
def test_nothing_is_skipped_in_a_shadow_phase(env: Env, stacks: list[Stack]) -> None:
    s = _start(env, "dual_write", stacks)
    s.write("choose", {"status": "queued"})
    _finish(s, "choose")
    s.write("right", {"status": "skipped", "completed_at": db_now(s.tables.dialect_name)})
    s.drain()
    assert s.statuses()["right2"] == "pending"


@pytest.mark.parametrize("env", STACKS, indirect=True)
def test_a_failed_dependency_is_not_a_skip(env: Env, stacks: list[Stack]) -> None:
    s = _start(env, "cutover", stacks)
    s.drain()
    _finish(s, "choose")
    s.drain()
    s.write("left", {"status": "queued"})
    _finish(s, "right", status="failed")
    s.write("right", {"attempts": 3, "max_attempts": 3})  # no retry left
    s.drain()
    assert s.statuses()["right2"] == "pending"
