"""The depth guard as the seeds define it, the dispatch-count guard, and the review queue (issue 22).

Depth is the causation depth of a task (``mapping.columns.depth``, or the chain of ``spawned_by``), checked per
task before every dispatch; the dispatch count is checked per task within a batch. Parked tasks form a
review queue shared through the database: no path dispatches them until ``pollbridge review release``;
``reject`` fails them for good. SQLite and PostgreSQL; the evaluator is driven directly (no relay, no bus),
so every assertion is about one evaluation's decisions.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.core.mapping import StatusValues, TaskColumns, TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import SchedulerSettings
from bridge.db.schema import OUTBOX_CHANNEL, dispatch_log, outbox, review
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from bridge.reconcile.classify import count_by_type
from bridge.reconcile.explain import explain_task
from bridge.reconcile.status import gather_status, status_metrics
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable import review as queue
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.evaluate import Evaluator
from event_scheduler.metrics import SchedulerMetrics
from legacy_poller.poller import LegacyPoller
from tests.support import SHARED_DB_PARAMS, shared_engine


@pytest.fixture(params=SHARED_DB_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    engine = shared_engine(request)
    with engine.begin() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("tasks")}
        for name in ("depth", "spawned_by"):
            if name not in columns:
                conn.execute(sa.text(f"ALTER TABLE tasks ADD COLUMN {name} INTEGER"))
        if "kind" not in columns:  # a workflow type on the task row (test_an_instance_of_two_types...)
            conn.execute(sa.text("ALTER TABLE tasks ADD COLUMN kind VARCHAR(64)"))
    return engine


def _tables(engine: Engine, *, source: str = "depth", review_status: bool = True) -> TaskTable:
    columns = replace(TaskColumns(), **{source: source})
    statuses = StatusValues() if review_status else StatusValues(review="")
    return reflect_tables(engine, TaskTableMapping(columns=columns, statuses=statuses))


#: The workflow types the evaluators of a test have already seen (see the ``warm`` fixture).
SEEN_TYPES: frozenset[str] = frozenset()


@pytest.fixture(autouse=True, params=["first batch", "warm"])
def warm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test twice: with an evaluator whose batch is the first of its type, and with one that has seen the
    type, so that on PostgreSQL its ready tasks go to the evaluation's combined statement
    (``event_scheduler.queries.evaluate_and_dispatch_statement``), which must leave every task a guard would
    park to the Python path's guards."""
    if request.param == "warm":
        monkeypatch.setattr(sys.modules[__name__], "SEEN_TYPES", frozenset({"agents"}))


def _evaluator(engine: Engine, tt: TaskTable, router: Any = None, **limits: int) -> Evaluator:
    evaluator = Evaluator(engine, tt, router or FixedRouter("cutover"), SchedulerSettings(**limits),
                          SchedulerMetrics(CollectorRegistry()), holder="test-scheduler")
    evaluator._types.update(SEEN_TYPES)
    return evaluator


def _seed(engine: Engine, tt: TaskTable, instance: str, keys: Sequence[str],
          **column: dict[str, Any]) -> dict[str, int]:
    """One instance of independent tasks ``keys``; ``column`` sets a column per key (depth={"b": 3}).
    Returns key -> row id."""
    with engine.begin() as conn:
        seed(conn, tt, [WorkflowSpec(instance, "agents", tuple(TaskSpec(k) for k in keys))])
        t = tt.tasks
        ids = {str(k): int(i) for k, i in conn.execute(sa.select(t.c.task_key, t.c.id)
                                                        .where(t.c.instance_id == instance))}
        for name, values in column.items():
            for key, value in values.items():
                conn.execute(t.update().where(t.c.id == ids[key]).values({name: value}))
    return ids


def _status(engine: Engine, tt: TaskTable, instance: str) -> dict[str, str]:
    t = tt.tasks
    with engine.connect() as conn:
        return {str(k): str(s) for k, s in conn.execute(sa.select(t.c.task_key, t.c.status)
                                                        .where(t.c.instance_id == instance))}


def _queue(engine: Engine) -> list[queue.ReviewEntry]:
    with engine.connect() as conn:
        return queue.entries(conn, include_decided=True)


def test_depth_parks_only_the_task_past_max_depth(engine: Engine) -> None:
    tt = _tables(engine)
    ids = _seed(engine, tt, "run-1", ["a", "b", "c"], depth={"a": 0, "b": 3, "c": 2})
    result = _evaluator(engine, tt, max_depth=2).evaluate(["run-1"])
    assert sorted(t.task_key for t in result.dispatched) == ["a", "c"]
    assert [t.task_key for t in result.stopped] == ["b"]
    assert _status(engine, tt, "run-1") == {"a": "queued", "b": "review", "c": "queued"}
    [entry] = _queue(engine)
    assert (entry.task_id, entry.guard, entry.measured, entry.limit, entry.moved, entry.decision) == \
        (str(ids["b"]), "depth", 3, 2, True, None)
    assert entry.reason == "causation depth 3 > max_depth 2" and entry.parked_by == "test-scheduler"


def test_a_limit_beyond_32_bits_is_a_limit(engine: Engine) -> None:
    """A limit has no upper bound (a flag may set 1e10): the evaluation's combined statement carried the
    limits as 32-bit integers and failed every warm batch with "integer out of range"."""
    tt = _tables(engine)
    _seed(engine, tt, "big", ["a", "b"], depth={"a": 1, "b": 1})
    result = _evaluator(engine, tt, max_depth=3_000_000_000, max_dispatches=3_000_000_000).evaluate(["big"])
    assert sorted(t.task_key for t in result.dispatched) == ["a", "b"] and not result.stopped


def test_an_instance_of_two_types_is_guarded_per_type(engine: Engine) -> None:
    """With the workflow type on the task row one instance can hold tasks of two types, each with its own
    max_dispatches from its flag: a (type t1, limit 1) and b (t2, limit 10), nothing dispatched before. Task
    by task, a is the instance's dispatch 1 and b its dispatch 2: both go. The combined statement compared the
    instance's count with each row's own limit, took b alone, and the Python path then parked a."""
    tt = reflect_tables(engine, TaskTableMapping(columns=replace(TaskColumns(), depth="depth",
                                                                 workflow_type="kind")))
    ids = _seed(engine, tt, "mixed", ["a", "b"])
    with engine.begin() as conn:
        for key, kind in (("a", "t1"), ("b", "t2")):
            conn.execute(tt.tasks.update().where(tt.tasks.c.id == ids[key]).values(kind=kind))
    store = FlagStore(engine)
    store.change("t1", "cutover", actor="t", reason="t", thresholds={"max_dispatches": 1})
    store.change("t2", "cutover", actor="t", reason="t", thresholds={"max_dispatches": 10})
    router = FlagRouter(store, refresh_interval=3600)
    router.refresh()
    evaluator = _evaluator(engine, tt, router)
    if SEEN_TYPES:
        evaluator._types.update({"t1", "t2"})
    result = evaluator.evaluate(["mixed"])
    assert sorted(t.task_key for t in result.dispatched) == ["a", "b"] and not result.stopped
    assert _queue(engine) == []


def test_a_wide_flat_instance_is_not_deep(engine: Engine) -> None:
    """Eight parallel tasks of depth 1 under max_depth 5: depth is causation, not a count of dispatches."""
    tt = _tables(engine)
    keys = [f"t{i}" for i in range(8)]
    _seed(engine, tt, "wide", keys, depth=dict.fromkeys(keys, 1))
    result = _evaluator(engine, tt, max_depth=5).evaluate(["wide"])
    assert len(result.dispatched) == 8 and not result.stopped


def test_the_dispatch_count_guard_never_overshoots_within_a_batch(engine: Engine) -> None:
    """Eight ready tasks in one batch, max_dispatches 5: five dispatched, three parked (the old guard checked
    before the batch and dispatched all eight)."""
    tt = _tables(engine)
    keys = [f"t{i}" for i in range(8)]
    _seed(engine, tt, "burst", keys)
    result = _evaluator(engine, tt, max_dispatches=5).evaluate(["burst"])
    assert len(result.dispatched) == 5 and len(result.stopped) == 3
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dispatch_log)).scalar() == 5
    measured = sorted(e.measured for e in _queue(engine))
    assert measured == [6, 6, 6] and {e.guard for e in _queue(engine)} == {"dispatches"}


def test_the_dispatch_count_comes_with_the_evaluation(engine: Engine) -> None:
    """A scheduler that has not seen the instance counts its logged dispatches (3 by another process here) in
    the evaluation query itself: max_dispatches 4 lets one of two ready tasks go and parks the other, and no
    count query of its own is sent (it was a round trip per new instance, one in five of a trickle's
    transactions)."""
    tt = _tables(engine)
    _seed(engine, tt, "counted", ["a", "b"])
    with engine.begin() as conn:
        conn.execute(dispatch_log.insert(), [{"task_id": f"old{i}", "instance_id": "counted", "task_key": f"old{i}",
                                              "path": "events", "dispatched_at": datetime.now(UTC)} for i in range(3)])
    evaluator = _evaluator(engine, tt, max_dispatches=4)
    sent: list[str] = []

    def record(conn: object, cursor: object, statement: str, *rest: object) -> None:
        sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        result = evaluator.evaluate(["counted"])
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert len(result.dispatched) == 1 and len(result.stopped) == 1
    assert [e.measured for e in _queue(engine)] == [5]
    assert not [s for s in sent if "count(*)" in s.lower() and "group by pollbridge_dispatch_log" in s.lower()], sent


def test_depth_from_the_spawning_chain(engine: Engine) -> None:
    tt = _tables(engine, source="spawned_by")
    ids = _seed(engine, tt, "chain", ["root", "child", "grandchild"])
    with engine.begin() as conn:
        t = tt.tasks
        conn.execute(t.update().where(t.c.id == ids["child"]).values(spawned_by=ids["root"], status="completed"))
        conn.execute(t.update().where(t.c.id == ids["grandchild"]).values(spawned_by=ids["child"]))
        conn.execute(t.update().where(t.c.id == ids["root"]).values(status="completed"))
    result = _evaluator(engine, tt, max_depth=1).evaluate(["chain"])
    assert [t.task_key for t in result.stopped] == ["grandchild"] and not result.dispatched
    assert [(e.measured, e.limit) for e in _queue(engine)] == [(2, 1)]


def test_a_spawning_cycle_costs_a_bounded_walk_and_is_parked(engine: Engine) -> None:
    tt = _tables(engine, source="spawned_by")
    ids = _seed(engine, tt, "cycle", ["x", "y"])
    with engine.begin() as conn:
        t = tt.tasks
        conn.execute(t.update().where(t.c.id == ids["x"]).values(spawned_by=ids["y"]))
        conn.execute(t.update().where(t.c.id == ids["y"]).values(spawned_by=ids["x"]))
    result = _evaluator(engine, tt, max_depth=3).evaluate(["cycle"])
    assert len(result.stopped) == 2 and not result.dispatched
    assert all(e.measured == 5 for e in _queue(engine))  # the walk stops at max_depth + 1 links


def test_release_lets_the_task_run_and_exempts_it(engine: Engine) -> None:
    tt = _tables(engine)
    ids = _seed(engine, tt, "rel", ["deep"], depth={"deep": 9})
    evaluator = _evaluator(engine, tt, max_depth=2)
    assert evaluator.evaluate(["rel"]).stopped
    with engine.begin() as conn:
        [outcome] = queue.decide(conn, tt, [str(ids["deep"])], "released", actor="alice", reason="expected depth")
    assert outcome.done and _status(engine, tt, "rel") == {"deep": "pending"}
    # Before the fix a released task went straight back to review on the next evaluation.
    result = evaluator.evaluate(["rel"])
    assert [t.task_key for t in result.dispatched] == ["deep"] and not result.stopped
    [entry] = _queue(engine)
    assert (entry.decision, entry.decided_by, entry.decision_reason) == ("released", "alice", "expected depth")


def test_without_a_review_status_a_parked_task_stays_pending_and_no_path_takes_it(engine: Engine) -> None:
    tt = _tables(engine, review_status=False)
    ids = _seed(engine, tt, "held", ["deep"], depth={"deep": 9})
    evaluator = _evaluator(engine, tt, max_depth=2)
    first = evaluator.evaluate(["held"])
    assert first.stopped and _status(engine, tt, "held") == {"deep": "pending"}
    [entry] = _queue(engine)
    assert not entry.moved
    # The poller's scan (any phase: here with no flags, the type is polling) and its dispatch leave it alone,
    # and the evaluator arms a re-check instead of dispatching it.
    assert LegacyPoller(engine, tt, registry=CollectorRegistry()).scan_once().dispatched == 0
    again = evaluator.evaluate(["held"])
    assert not again.dispatched and not again.stopped and [k for _, k, _, _ in again.timers] == ["due"]
    # Another scheduler with a far higher limit does not dispatch it either: parking is in the database.
    assert not _evaluator(engine, tt, max_depth=1000).evaluate(["held"]).dispatched
    # Nor the safety sweep of a cutover type, however long past the grace period (before: the sweep
    # dispatched every task the guard "held back", so the guard did nothing).
    store = FlagStore(engine)
    store.change("agents", "cutover", actor="t", reason="t", grace_seconds=0.001)
    router = FlagRouter(store, refresh_interval=3600)
    router.refresh()
    with engine.begin() as conn:
        conn.execute(tt.tasks.update().values(updated_at=datetime.now(UTC) - timedelta(seconds=60)))
    assert LegacyPoller(engine, tt, router=router, registry=CollectorRegistry()).sweep_once().dispatched == 0
    # The queue is in the status, its metrics and the answer of explain.
    state = gather_status(engine)
    agents = state.type("agents")
    assert agents is not None and agents.parked == 1 and state.totals["parked"] == 1
    samples = {m.name: m.samples for m in status_metrics(state)}
    assert [(s.labels, s.value) for s in samples["pollbridge_review_parked"]] == [({"workflow_type": "agents"}, 1.0)]
    story = explain_task(engine, tt, str(ids["deep"]), store=store)
    assert story.answer.code == "held_for_review" and "causation depth 9 > max_depth 2" in story.answer.sentence
    with engine.begin() as conn:
        queue.decide(conn, tt, [str(ids["deep"])], "released", actor="bob", reason="ok")
    assert [t.task_key for t in evaluator.evaluate(["held"]).dispatched] == ["deep"]


def test_reject_fails_the_task_for_good(engine: Engine) -> None:
    tt = _tables(engine)
    ids = _seed(engine, tt, "rej", ["deep"], depth={"deep": 9})
    _evaluator(engine, tt, max_depth=2).evaluate(["rej"])
    with engine.begin() as conn:
        [outcome] = queue.decide(conn, tt, [str(ids["deep"])], "rejected", actor="carol", reason="runaway")
    assert outcome.done
    t = tt.tasks
    with engine.connect() as conn:
        row = conn.execute(sa.select(t.c.status, t.c.attempts, t.c.max_attempts).where(t.c.id == ids["deep"])).one()
    assert row.status == "failed" and row.attempts == row.max_attempts
    with engine.begin() as conn:
        [again] = queue.decide(conn, tt, [str(ids["deep"])], "released", actor="dave", reason="oops")
    assert not again.done and again.detail == "not parked (already rejected by carol)"


def test_the_limit_is_shared_through_the_flag(engine: Engine) -> None:
    """A type's max_depth in its flag overrides every process's setting (one value for all schedulers)."""
    tt = _tables(engine)
    _seed(engine, tt, "flagged", ["a"], depth={"a": 4})
    store = FlagStore(engine)
    store.change("agents", "cutover", actor="t", reason="t", thresholds={"max_depth": 3})
    router = FlagRouter(store, refresh_interval=3600)
    router.refresh()
    result = _evaluator(engine, tt, router, max_depth=100).evaluate(["flagged"])
    assert result.stopped and not result.dispatched
    assert [(e.measured, e.limit) for e in _queue(engine)] == [(4, 3)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depths=st.lists(st.integers(0, 6), min_size=1, max_size=8), max_depth=st.integers(1, 5),
       max_dispatches=st.integers(1, 8), released=st.sets(st.integers(0, 7), max_size=3))
def test_guards_invariant(engine: Engine, depths: list[int], max_depth: int, max_dispatches: int,
                          released: set[int]) -> None:
    """Whatever the depths and limits: no task past max_depth is dispatched unless a person released it,
    an instance never gets more than max_dispatches dispatches but for released tasks, every ready task is
    either dispatched or parked, and every parked task has exactly one open review row."""
    with engine.begin() as conn:
        for name in ("tasks", "workflow_instances", "pollbridge_dispatch_log", "pollbridge_review",
                     "pollbridge_outbox"):
            conn.execute(sa.text(f"DELETE FROM {name}"))
    tt = _tables(engine)
    keys = [f"t{i}" for i in range(len(depths))]
    ids = _seed(engine, tt, "inv", keys, depth=dict(zip(keys, depths, strict=True)))
    exempt = {keys[i] for i in released if i < len(keys)}
    with engine.begin() as conn:  # a person released these earlier (a decided row exempts them)
        for key in exempt:
            conn.execute(review.insert().values(
                task_id=str(ids[key]), instance_id="inv", workflow_type="agents", task_key=key, guard="depth",
                measured=0, limit_value=0, parked_at=sa.func.current_timestamp(), parked_by="earlier",
                decision="released", decided_by="p", decision_reason="r"))
    result = _evaluator(engine, tt, max_depth=max_depth, max_dispatches=max_dispatches).evaluate(["inv"])
    depth_of = dict(zip(keys, depths, strict=True))
    dispatched = {t.task_key for t in result.dispatched}
    stopped = {t.task_key for t in result.stopped}
    assert dispatched | stopped == set(keys) and not dispatched & stopped
    assert all(depth_of[k] <= max_depth or k in exempt for k in dispatched)
    assert len(dispatched - exempt) <= max_dispatches
    open_rows = [e for e in _queue(engine) if e.decision is None]
    assert sorted(e.task_key for e in open_rows) == sorted(stopped)


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).with_name("pollbridge"))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60,
                          env={"POLLBRIDGE_DATABASE_URL": url, "PATH": "/usr/bin:/bin"})


def test_review_cli(engine: Engine) -> None:
    tt = _tables(engine)
    ids = _seed(engine, tt, "cli", ["deep", "deeper"], depth={"deep": 7, "deeper": 8})
    _evaluator(engine, tt, max_depth=2).evaluate(["cli"])
    url = engine.url.render_as_string(hide_password=False)
    # The type has no flag (polling): a decision that writes the task table is refused, nothing changes.
    refused = _cli(url, "review", "reject", str(ids["deep"]), "--reason", "no")
    assert refused.returncode == 1 and "is in polling" in refused.stdout, refused.stdout + refused.stderr
    assert _status(engine, tt, "cli") == {"deep": "review", "deeper": "review"}
    FlagStore(engine).change("agents", "cutover", actor="t", reason="t")
    listed = _cli(url, "review", "list")
    assert listed.returncode == 0, listed.stderr
    assert "causation depth 7 > max_depth 2" in listed.stdout and "2 parked" in listed.stdout
    unknown = _cli(url, "review", "release", "424242")
    assert unknown.returncode == 1 and "no such task" in unknown.stdout
    bad = _cli(url, "review", "release", "not-a-number")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr, bad.stderr
    no_reason = _cli(url, "review", "reject", str(ids["deep"]))
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    done = _cli(url, "review", "reject", str(ids["deep"]), "--reason", "runaway agent", "--actor", "erin")
    assert done.returncode == 0 and f"task {ids['deep']}: rejected" in done.stdout, done.stdout + done.stderr
    mixed = _cli(url, "review", "release", "0" + str(ids["deeper"]), str(ids["deep"]), "--actor", "erin")
    assert mixed.returncode == 1
    assert f"task {ids['deeper']}: released" in mixed.stdout and "already rejected by erin" in mixed.stdout
    trail = _cli(url, "review", "list", "--all", "--json")
    assert trail.returncode == 0
    assert "runaway agent" in trail.stdout and '"decided_by": "erin"' in trail.stdout


def test_a_release_restarts_the_fallbacks_grace_and_wakes_the_scheduler(engine: Engine) -> None:
    """Released from the queue (no review status: the task stayed pending, long ready), the task is not taken at
    once by the poller's fallback as an event-path miss; a wake-up row in the outbox brings its instance to
    the event scheduler."""
    tt = _tables(engine, review_status=False)
    ids = _seed(engine, tt, "wake", ["deep"], depth={"deep": 9})
    store = FlagStore(engine)
    store.change("agents", "selective", actor="t", reason="t", grace_seconds=30)
    router = FlagRouter(store, refresh_interval=3600)
    router.refresh()
    assert _evaluator(engine, tt, router, max_depth=2).evaluate(["wake"]).stopped
    with engine.begin() as conn:  # ready for a minute: past the fallback's grace
        conn.execute(tt.tasks.update().values(updated_at=datetime.now(UTC) - timedelta(seconds=60)))
        [outcome] = queue.decide(conn, tt, [str(ids["deep"])], "released", actor="a", reason="ok",
                                 phase_of=lambda t: "selective")
    assert outcome.done
    assert LegacyPoller(engine, tt, router=router, registry=CollectorRegistry()).scan_once().dispatched == 0
    with engine.connect() as conn:
        woken = conn.execute(sa.select(outbox.c.instance_id, outbox.c.change, outbox.c.published_at)
                             .where(outbox.c.task_id == str(ids["deep"]))).all()
    # (the insert's own captured row is there too: this database has the capture triggers)
    assert [(w.instance_id, w.change, w.published_at) for w in woken if w.change != "insert"] == \
        [("wake", "status", None)]
    assert [t.task_key for t in _evaluator(engine, tt, router).evaluate(["wake"]).dispatched] == ["deep"]


def test_a_release_notifies_a_listening_relay(engine: Engine) -> None:
    """PostgreSQL: the wake-up row of a release left pending NOTIFYs at its commit, so a listening relay publishes
    it at once (its idle probe is seconds apart; the task table is not written, so no trigger notifies)."""
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite has no NOTIFY: a release's commit wakes the relay of its process (bridge.db.changes)")
    tt = _tables(engine, review_status=False)
    ids = _seed(engine, tt, "notified", ["deep"], depth={"deep": 9})
    assert _evaluator(engine, tt, max_depth=2).evaluate(["notified"]).stopped
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {OUTBOX_CHANNEL}")
        with engine.begin() as conn:
            [outcome] = queue.decide(conn, tt, [str(ids["deep"])], "released", actor="a", reason="ok",
                                     phase_of=lambda t: "cutover")
        assert outcome.done
        assert list(listener.notifies(timeout=5, stop_after=1)), "no notification for the wake-up row"


def test_a_task_moved_by_hand_is_not_stuck_in_the_queue(engine: Engine) -> None:
    tt = _tables(engine)
    ids = _seed(engine, tt, "hand", ["a", "b"], depth={"a": 9, "b": 9})
    _evaluator(engine, tt, max_depth=2).evaluate(["hand"])
    with engine.begin() as conn:  # someone puts both back to pending by hand
        conn.execute(tt.tasks.update().where(tt.tasks.c.instance_id == "hand").values(status="pending"))
    with engine.begin() as conn:
        [released] = queue.decide(conn, tt, [str(ids["a"])], "released", actor="p", reason="r")
        [rejected] = queue.decide(conn, tt, [str(ids["b"])], "rejected", actor="p", reason="r")
    assert released.done and "pending already" in released.detail
    assert rejected.done and _status(engine, tt, "hand") == {"a": "pending", "b": "failed"}
    assert not [e for e in _queue(engine) if e.decision is None]


def test_the_reconciler_judges_no_path_for_a_parked_task(engine: Engine) -> None:
    """Parked (no review status: still pending and ready), the task is no path's miss; released and then
    dispatched long after its readiness, its wait was the person's, so it is ``held``, never ``late``."""
    tt = _tables(engine, review_status=False)
    ids = _seed(engine, tt, "rc", ["deep"], depth={"deep": 9})
    store = FlagStore(engine)
    store.change("agents", "cutover", actor="t", reason="t")
    router = FlagRouter(store, refresh_interval=3600)
    router.refresh()
    evaluator = _evaluator(engine, tt, router, max_depth=2)
    assert evaluator.evaluate(["rc"]).stopped
    with engine.begin() as conn:  # ready a minute ago: past any tolerance
        conn.execute(tt.tasks.update().values(updated_at=datetime.now(UTC) - timedelta(seconds=60)))
    since = datetime.now(UTC) - timedelta(hours=1)
    counts = count_by_type(engine, tt, since, datetime.now(UTC) + timedelta(seconds=1), tolerance=10.0)
    assert counts.get("agents") is None or counts["agents"]["missing"] == 0  # before: missing 1, verdict fail
    with engine.begin() as conn:
        queue.decide(conn, tt, [str(ids["deep"])], "released", actor="p", reason="ok")
    assert [t.task_key for t in evaluator.evaluate(["rc"]).dispatched] == ["deep"]
    counts = count_by_type(engine, tt, since, datetime.now(UTC) + timedelta(seconds=1), tolerance=10.0)
    assert (counts["agents"]["held"], counts["agents"]["late"], counts["agents"]["missing"]) == (1, 0, 0)
