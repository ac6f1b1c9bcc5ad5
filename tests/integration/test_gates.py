"""Promotion gates on the reconciler's evidence, set_phase's rules, rollback, and the reconciler's
classification of each kind of evidence. SQLite and PostgreSQL.

Evidence is planted through the real dispatch compare-and-set (``dispatch_many`` with the path a
dispatcher would record) and shadow decisions in ``pollbridge_decisions``, on tasks seeded in the task
table, so the reconciler re-derives readiness from real rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.capture.gaps import WAL_SLOT, record_gap_statement
from bridge.capture.triggers import install_capture, remove_capture
from bridge.core.errors import FlagError, GateRefused
from bridge.core.settings import GateSettings
from bridge.db.clock import db_clock
from bridge.db.engine import db_now
from bridge.db.schema import decisions, dispatch_log, flag_audit, flags
from bridge.flags.store import FlagStore
from bridge.reconcile.classify import count_by_type
from bridge.reconcile.gate import GateResult
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.rollout.promotion import evaluate_gate, rollback, set_phase
from bridge.tasktable.dispatch import Path, ReadyTask, dispatch_many
from bridge.tasktable.readiness import ready_predicate, ready_since
from bridge.tasktable.tables import TaskTable
from tests.support import SHARED_DB_PARAMS, shared_engine

#: Small gates for tests: 20 compared tasks; 0 misses in 20 (upper bound 13.9%) passes a 15% budget,
#: 1 miss in 21 (20.7%) does not.
THRESHOLDS = {"min_tasks": 20, "miss_budget": 0.15}
GATES = GateSettings()  # the defaults (min_tasks 1000): the flag's thresholds must override them
CRITERIA = ["min_tasks", "no_early", "no_duplicate", "miss_rate", "no_capture_gap"]


@pytest.fixture(params=SHARED_DB_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    """Overrides the per-test database: the module's shared one for the dialect, emptied (``shared_engine``)."""
    return shared_engine(request)


# --- planting evidence ----------------------------------------------------------------------------

def _at(engine: Engine, value: datetime) -> datetime:
    """A UTC time as the dialect's DateTime binds expect it (naive on SQLite)."""
    value = value.astimezone(UTC)
    return value.replace(tzinfo=None) if engine.dialect.name == "sqlite" else value


def _seed(engine: Engine, tt: TaskTable, workflow_type: str, ids: Sequence[str], ago: float = 0.0,
          tasks: tuple[TaskSpec, ...] = (TaskSpec("a"),)) -> None:
    with engine.begin() as conn:
        seed(conn, tt, [WorkflowSpec(i, workflow_type, tasks) for i in ids],
             now=datetime.now(UTC) - timedelta(seconds=ago))


def _ready(engine: Engine, tt: TaskTable, ids: Sequence[str]) -> list[ReadyTask]:
    """The ready tasks of these instances, with the facts a dispatcher records (as the poller selects them)."""
    t = tt.tasks
    src, workflow_type = tt.workflow_type_source(t)
    q = (sa.select(tt.col("id"), tt.col("instance_id"), tt.col("task_key"), workflow_type,
                   tt.col("attempts") + 1, ready_since(tt, t))
         .select_from(src).where(ready_predicate(tt, t), tt.col("instance_id").in_(list(ids)))
         .order_by(tt.col("id")))
    with engine.connect() as conn:
        return [ReadyTask(*row) for row in conn.execute(q).all()]


def _dispatch(engine: Engine, tt: TaskTable, ids: Sequence[str], path: Path,
              ready_at: datetime | None = None) -> list[ReadyTask]:
    tasks = _ready(engine, tt, ids)
    if ready_at is not None:
        tasks = [ReadyTask(r.task_id, r.instance_id, r.task_key, r.workflow_type, r.attempt, ready_at) for r in tasks]
    with engine.begin() as conn:
        won = dispatch_many(conn, tt, tasks, path)
    assert len(won) == len(tasks) == len(ids), "every planted task must be ready and won"
    return won


def _decide(engine: Engine, tasks: Sequence[ReadyTask], decided_at: datetime | None = None) -> None:
    """Shadow decisions (what the event path records in dual_write)."""
    at: Any = db_now(engine.dialect.name) if decided_at is None else _at(engine, decided_at)
    with engine.begin() as conn:
        for task in tasks:
            conn.execute(decisions.insert().values(
                task_id=str(task.task_id), instance_id=task.instance_id, workflow_type=task.workflow_type,
                task_key=task.task_key, attempt=task.attempt, ready_at=task.ready_at, decided_at=at))


def _shadowed(engine: Engine, tt: TaskTable, workflow_type: str, ids: Sequence[str]) -> None:
    """dual_write clean evidence: the event path decided, the poller dispatched."""
    _seed(engine, tt, workflow_type, ids)
    _decide(engine, _ready(engine, tt, ids))
    _dispatch(engine, tt, ids, "poller")


def _events(engine: Engine, tt: TaskTable, workflow_type: str, ids: Sequence[str]) -> None:
    """selective/cutover clean evidence: the event path dispatched."""
    _seed(engine, tt, workflow_type, ids)
    _dispatch(engine, tt, ids, "events")


def _ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{k:03d}" for k in range(n)]


def _writes(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (conn.execute(sa.select(sa.func.count()).select_from(flags)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(flag_audit)).scalar_one())


def _settle() -> None:
    """SQLite's clock has millisecond resolution and the gate window ends *before* its own 'now': let the
    last planted row fall strictly inside the window."""
    time.sleep(0.005)


def _refused(engine: Engine, tt: TaskTable, store: FlagStore, phase: str, **kwargs: Any) -> GateResult:
    """set_phase must raise GateRefused carrying the gate, and write nothing."""
    before = _writes(engine)
    flag_before = store.get("orders")
    _settle()
    with pytest.raises(GateRefused) as info:
        set_phase(engine, tt, store, GATES, "orders", phase, reason="promote", actor="op", **kwargs)
    assert info.value.exit_code == 1
    assert _writes(engine) == before
    assert (store.get("orders").phase, store.get("orders").percent) == (flag_before.phase, flag_before.percent)
    gate = info.value.gate
    assert isinstance(gate, GateResult)
    assert [c.name for c in gate.criteria] == CRITERIA
    assert not gate.passed
    return gate


def _failed(gate: GateResult) -> set[str]:
    return {c.name for c in gate.failed}


@pytest.fixture
def store(engine: Engine) -> FlagStore:
    return FlagStore(engine)


# --- the test -----------------------------------------------------------------------------

def test_gate_refuses_few_samples_passes_clean_refuses_after_a_miss(engine: Engine, tables: TaskTable,
                                                                    store: FlagStore) -> None:
    """dual_write -> selective: too few compared tasks refuses; enough clean ones (shadow decision + poller
    dispatch each) pass; one planted miss (a poller dispatch with no decision in dual_write) refuses on the
    miss rate alone. Refusals write nothing; the pass, once taken, is audited with its gate."""
    store.change("orders", "dual_write", actor="op", reason="shadow", thresholds=THRESHOLDS)
    _shadowed(engine, tables, "orders", _ids("clean", 5))
    gate = _refused(engine, tables, store, "selective", percent=10)
    assert _failed(gate) == {"min_tasks", "miss_rate"}  # 0 in 5: the bound (45%) is no evidence either
    assert gate.counts["compared"] == gate.counts["matched"] == 5

    _shadowed(engine, tables, "orders", _ids("more", 15))
    _settle()
    passing = evaluate_gate(engine, tables, store.get("orders"), "selective", GATES)
    assert passing.passed, passing.to_json()
    assert passing.counts["compared"] == passing.counts["matched"] == 20

    _seed(engine, tables, "orders", ["missed"])
    _dispatch(engine, tables, ["missed"], "poller")  # the event path never decided it
    gate = _refused(engine, tables, store, "selective", percent=10)
    assert _failed(gate) == {"miss_rate"}
    assert (gate.counts["compared"], gate.counts["missing"]) == (21, 1)
    detail = next(c.detail for c in gate.criteria if c.name == "miss_rate")
    assert "1 miss(es) in 21" in detail


def test_a_capture_gap_in_the_window_refuses_a_gate_that_would_pass(engine: Engine, tables: TaskTable,
                                                                     store: FlagStore) -> None:
    """Clean evidence passes; a capture gap recorded in the window (the WAL slot lost, tasks re-derived) makes the
    window incomplete evidence: the gate refuses on ``no_capture_gap`` alone, and says when and what."""
    store.change("orders", "dual_write", actor="op", reason="shadow", thresholds=THRESHOLDS)
    _shadowed(engine, tables, "orders", _ids("clean", 20))
    _settle()
    assert evaluate_gate(engine, tables, store.get("orders"), "selective", GATES).passed
    with engine.begin() as conn:
        conn.execute(record_gap_statement(engine.dialect.name, WAL_SLOT, 7, "slot pollbridge_x was gone"))
    gate = _refused(engine, tables, store, "selective", percent=10)
    assert _failed(gate) == {"no_capture_gap"}
    detail = next(c.detail for c in gate.criteria if c.name == "no_capture_gap")
    assert "1 capture gap(s)" in detail and "7 task(s) re-derived" in detail and WAL_SLOT in detail


def test_passing_gate_is_recorded_in_the_audit_row(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """A gated promotion that passes writes the flag with forced=False and the gate's JSON in its audit row."""
    store.change("orders", "selective", actor="op", reason="canary", percent=10, thresholds=THRESHOLDS)
    _events(engine, tables, "orders", _ids("ok", 20))
    _settle()
    outcome = set_phase(engine, tables, store, GATES, "orders", "selective", percent=50, reason="widen", actor="op")
    assert outcome.change is not None and outcome.gate is not None and outcome.gate.passed
    assert (outcome.change.forced, outcome.change.old_percent, outcome.change.new_percent) == (False, 10.0, 50.0)
    row = store.history("orders")[-1]
    assert row.gate is not None and row.gate["passed"] is True
    assert [c["name"] for c in row.gate["criteria"]] == CRITERIA
    assert row.gate["counts"]["compared"] == 20
    assert store.get("orders").percent == 50.0


def test_only_evidence_since_the_current_phase_began_counts(engine: Engine, tables: TaskTable,
                                                            store: FlagStore) -> None:
    """After selective 10% -> 50%, the 20 clean tasks gathered at 10% do not count for cutover."""
    store.change("orders", "selective", actor="op", reason="canary", percent=10, thresholds=THRESHOLDS)
    _events(engine, tables, "orders", _ids("ok", 20))
    _settle()
    set_phase(engine, tables, store, GATES, "orders", "selective", percent=50, reason="widen", actor="op")
    gate = _refused(engine, tables, store, "cutover")
    assert "min_tasks" in _failed(gate)
    assert gate.counts["compared"] == 0
    _events(engine, tables, "orders", _ids("late-ok", 20))
    _settle()
    outcome = set_phase(engine, tables, store, GATES, "orders", "cutover", reason="done", actor="op")
    assert outcome.gate is not None and outcome.gate.counts["compared"] == 20
    assert store.get("orders").phase == "cutover"


def test_each_safety_violation_fails_its_own_criterion(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """On top of 20 clean tasks (a passing gate): a fallback dispatch is a miss (miss_rate fails); a dispatch
    before a dependency's completed_at, re-derived from the task table, is early (no_early fails); two
    dispatch-log rows for one (task, attempt) are a duplicate (no_duplicate fails)."""
    store.change("orders", "selective", actor="op", reason="canary", percent=10, thresholds=THRESHOLDS)
    _events(engine, tables, "orders", _ids("ok", 20))
    _settle()
    assert evaluate_gate(engine, tables, store.get("orders"), "cutover", GATES).passed

    _seed(engine, tables, "orders", ["fb"])
    _dispatch(engine, tables, ["fb"], "fallback")
    gate = _refused(engine, tables, store, "cutover")
    assert _failed(gate) == {"miss_rate"}
    assert (gate.counts["missing"], gate.counts["compared"]) == (1, 21)

    _seed(engine, tables, "orders", ["dag"], tasks=(TaskSpec("first"), TaskSpec("second", ("first",))))
    t = tables.tasks
    first = sa.and_(t.c.instance_id == "dag", t.c.task_key == "first")
    with engine.begin() as conn:
        conn.execute(t.update().where(first).values(status="completed"))
    _dispatch(engine, tables, ["dag"], "events")  # 'second' is ready by status ...
    later = _at(engine, db_clock(engine) + timedelta(minutes=5))
    with engine.begin() as conn:  # ... but its dependency completed after the dispatch
        conn.execute(t.update().where(first).values(completed_at=later))
    gate = _refused(engine, tables, store, "cutover")
    assert _failed(gate) == {"miss_rate", "no_early"}
    assert gate.counts["early"] == 1

    dl = dispatch_log
    cols = ["task_id", "instance_id", "workflow_type", "task_key", "attempt", "ready_at", "dispatched_at"]
    with engine.begin() as conn:
        conn.execute(dl.insert().from_select([*cols, "path"], sa.select(
            *[dl.c[c] for c in cols], sa.literal("poller")).where(dl.c.instance_id == "ok-007")))
    gate = _refused(engine, tables, store, "cutover")
    # Only matched evidence counts toward min_tasks (issue 17): the duplicate took one of the 20 matched.
    assert _failed(gate) == {"min_tasks", "miss_rate", "no_early", "no_duplicate"}
    assert gate.counts["duplicate"] == 1
    assert gate.counts["compared"] == 22  # the duplicate replaces a matched task, it does not add one
    assert gate.counts["matched"] == 19


def test_gate_settings_apply_without_flag_thresholds(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """Without per-flag thresholds the [gates] settings decide: min_tasks 3 passes with 3 clean tasks where
    the default (1000) would refuse."""
    store.change("orders", "selective", actor="op", reason="canary", percent=10)
    _events(engine, tables, "orders", _ids("ok", 3))
    _settle()
    small = GateSettings(min_tasks=3, miss_budget=0.9)
    assert evaluate_gate(engine, tables, store.get("orders"), "cutover", small).passed
    assert _failed(evaluate_gate(engine, tables, store.get("orders"), "cutover", GATES)) == {"min_tasks", "miss_rate"}


# --- set_phase rules ------------------------------------------------------------------------------

def test_force_overrides_a_refused_gate_and_is_audited(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """--force writes despite a failing gate: forced=True, and the failing gate's JSON is in the audit row."""
    store.change("orders", "dual_write", actor="op", reason="shadow")
    outcome = set_phase(engine, tables, store, GATES, "orders", "selective", percent=5, reason="incident drill",
                        actor="op", force=True)
    assert outcome.change is not None and outcome.change.forced is True
    row = store.history("orders")[-1]
    assert (row.forced, row.reason, row.actor, row.new_phase, row.new_percent) == (True, "incident drill", "op",
                                                                                   "selective", 5.0)
    assert row.gate is not None and row.gate["passed"] is False
    assert {c["name"] for c in row.gate["criteria"] if not c["passed"]} >= {"min_tasks"}
    assert outcome.gate is not None
    assert row.gate == json.loads(json.dumps(outcome.gate.to_json()))


def test_skipping_a_step_needs_force(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """polling -> selective or cutover without force is bad input (exit 2) and writes nothing; with force
    it is written, forced, with the gate that was evaluated."""
    for target in ("selective", "cutover"):
        with pytest.raises(FlagError, match="one step at a time") as info:
            set_phase(engine, tables, store, GATES, "orders", target, reason="skip", actor="op")
        assert info.value.exit_code == 2
    assert _writes(engine) == (0, 0)
    outcome = set_phase(engine, tables, store, GATES, "orders", "cutover", reason="skip", actor="op", force=True)
    assert outcome.change is not None and outcome.change.forced
    assert store.get("orders").phase == "cutover"
    assert store.history("orders")[-1].gate is not None


def test_demotion_and_rollback_are_never_gated(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """With no evidence at all, lowering a percentage, demoting a phase (even several steps) and rollback
    all go through, unforced and without a gate."""
    store.change("orders", "cutover", actor="op", reason="there", forced=True)
    down = set_phase(engine, tables, store, GATES, "orders", "selective", percent=50, reason="wobbly", actor="op")
    assert down.change is not None and down.gate is None and not down.change.forced
    lower = set_phase(engine, tables, store, GATES, "orders", "selective", percent=10, reason="less", actor="op")
    assert lower.change is not None and lower.gate is None
    to_polling = set_phase(engine, None, store, GATES, "orders", "polling", reason="way back", actor="op")
    assert to_polling.change is not None and to_polling.gate is None
    assert store.get("orders").phase == "polling"

    store.change("orders", "cutover", actor="op", reason="again", forced=True)
    store.change("reports", "selective", actor="op", reason="canary", percent=5)
    changes = rollback(store, None, reason="incident 42", actor="oncall")
    assert sorted((c.workflow_type, c.old_phase, c.new_phase, c.action, c.forced) for c in changes) == [
        ("orders", "cutover", "polling", "rollback", False), ("reports", "selective", "polling", "rollback", False)]
    assert all(c.gate is None and c.actor == "oncall" and c.reason == "incident 42" for c in changes)
    assert {f.phase for f in store.all().values()} == {"polling"}
    assert rollback(store, None, reason="nothing left", actor="oncall") == []
    rehearsal = rollback(store, ["orders"], reason="rehearsal", actor="oncall")
    assert [(c.old_phase, c.new_phase, c.action) for c in rehearsal] == [("polling", "polling", "rollback")]
    assert store.last_rollback("orders") is not None


def test_no_op_and_bad_input_write_nothing(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """Asking for the current phase changes nothing (no audit row); an unknown phase, a percentage outside
    selective, a blank reason or a percentage of 150 is a FlagError; nothing is written in either case."""
    store.change("orders", "dual_write", actor="op", reason="shadow")
    before = _writes(engine)
    outcome = set_phase(engine, tables, store, GATES, "orders", "dual_write", reason="again", actor="op")
    assert outcome.change is None and outcome.gate is None
    bad: list[tuple[str, dict[str, Any]]] = [
        ("everywhere", {}), ("cutover", {"percent": 10}), ("selective", {"reason": " "}),
        ("selective", {"percent": 150}), ("selective", {"percent": 10, "actor": " "}),
    ]
    for phase, kwargs in bad:
        call: dict[str, Any] = {"reason": "r", "actor": "op", **kwargs}
        with pytest.raises(FlagError):
            set_phase(engine, tables, store, GATES, "orders", phase, **call)
    assert _writes(engine) == before


def test_bad_thresholds_or_grace_on_a_promotion_are_bad_input(engine: Engine, tables: TaskTable,
                                                               store: FlagStore) -> None:
    """An unknown or negative threshold, or a negative grace, is bad input (FlagError, exit 2) whatever the gate
    would have said: the operator must fix the command, not go and gather evidence."""
    store.change("orders", "dual_write", actor="op", reason="shadow")
    bad: list[dict[str, Any]] = [{"thresholds": {"bogus": 1}}, {"thresholds": {"min_tasks": -5}},
                                 {"grace_seconds": -1.0}]
    for kwargs in bad:
        with pytest.raises(FlagError):
            set_phase(engine, tables, store, GATES, "orders", "selective", percent=10, reason="r", actor="op",
                      **kwargs)


def test_entering_dual_write_needs_the_capture_triggers(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """polling -> dual_write is gated on the capture triggers alone: refused without them, allowed with."""
    with engine.begin() as conn:
        remove_capture(conn)
    before = _writes(engine)
    with pytest.raises(GateRefused) as info:
        set_phase(engine, tables, store, GATES, "orders", "dual_write", reason="shadow", actor="op")
    gate = info.value.gate
    assert isinstance(gate, GateResult)
    assert [(c.name, c.passed) for c in gate.criteria] == [("capture_installed", False)]
    assert _writes(engine) == before
    with engine.begin() as conn:
        install_capture(conn, tables)
    outcome = set_phase(engine, tables, store, GATES, "orders", "dual_write", reason="shadow", actor="op")
    assert outcome.change is not None and outcome.gate is not None and outcome.gate.passed
    assert store.get("orders").phase == "dual_write"


# --- the reconciler's classification --------------------------------------------------------------

def test_count_by_type_classifies_each_kind(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """One planted scenario per kind (see bridge/reconcile/classify.py):

    * polling type, poller dispatch -> poller (not compared);
    * dual_write: decision + poller dispatch -> matched; poller dispatch without decision -> missing;
      decision alone, recent -> pending; decision alone, older than the tolerance -> extra;
    * selective: events dispatch -> matched; events dispatch 30 s after readiness -> late; fallback ->
      missing; two dispatches of one attempt -> duplicate; dispatch before a dependency completed -> early;
      a task ready longer than the tolerance that nobody dispatched -> missing; a fresh one -> pending.
    """
    store.change("dw", "dual_write", actor="op", reason="r")
    store.change("sel", "selective", actor="op", reason="r", percent=50)
    clock = db_clock(engine)

    _seed(engine, tables, "poll", ["p1"])
    _dispatch(engine, tables, ["p1"], "poller")

    _shadowed(engine, tables, "dw", ["dw-matched"])
    _seed(engine, tables, "dw", ["dw-missing", "dw-pending", "dw-extra"])
    _dispatch(engine, tables, ["dw-missing"], "poller")
    _decide(engine, _ready(engine, tables, ["dw-pending"]))
    _decide(engine, _ready(engine, tables, ["dw-extra"]), decided_at=clock - timedelta(seconds=60))
    t = tables.tasks
    with engine.begin() as conn:  # the worker has them: not ready any more, so not "unacted"
        conn.execute(t.update().where(t.c.instance_id.in_(["dw-pending", "dw-extra"])).values(status="running"))

    _events(engine, tables, "sel", ["sel-matched"])
    _seed(engine, tables, "sel", ["sel-late", "sel-fallback", "sel-dup"])
    _dispatch(engine, tables, ["sel-late"], "events", ready_at=_at(engine, db_clock(engine) - timedelta(seconds=30)))
    _dispatch(engine, tables, ["sel-fallback"], "fallback")
    _dispatch(engine, tables, ["sel-dup"], "events")
    dl = dispatch_log
    cols = ["task_id", "instance_id", "workflow_type", "task_key", "attempt", "ready_at", "dispatched_at"]
    with engine.begin() as conn:
        conn.execute(dl.insert().from_select([*cols, "path"], sa.select(
            *[dl.c[c] for c in cols], sa.literal("fallback")).where(dl.c.instance_id == "sel-dup")))
    _seed(engine, tables, "sel", ["sel-early"], tasks=(TaskSpec("first"), TaskSpec("second", ("first",))))
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.instance_id == "sel-early", t.c.task_key == "first")
                     .values(status="completed"))
    _dispatch(engine, tables, ["sel-early"], "events")
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.instance_id == "sel-early", t.c.task_key == "first")
                     .values(completed_at=_at(engine, clock + timedelta(minutes=5))))
    _seed(engine, tables, "sel", ["sel-unacted-old"], ago=60)
    _seed(engine, tables, "sel", ["sel-unacted-new"])
    _settle()

    until = db_clock(engine)
    counts = count_by_type(engine, tables, until - timedelta(hours=1), until, objective=5.0, tolerance=10.0)
    assert set(counts) == {"poll", "dw", "sel"}
    assert counts["poll"].counts == {"poller": 1}
    assert counts["poll"].compared == 0
    assert counts["dw"].counts == {"matched": 1, "missing": 1, "pending": 1, "extra": 1}
    assert counts["dw"].compared == 3
    assert counts["sel"].counts == {"matched": 1, "late": 1, "missing": 2, "duplicate": 1, "early": 1,
                                    "pending": 1}
    assert counts["sel"].compared == 6
    assert counts["sel"].tasks == 7
    # The window bounds the dispatch evidence: an hour later none of it counts.
    later = count_by_type(engine, tables, until + timedelta(seconds=1), until + timedelta(hours=1), types=["dw"])
    assert later == {}


def test_early_is_rederived_from_every_readiness_fact(engine: Engine, tables: TaskTable, store: FlagStore) -> None:
    """Whatever the dispatcher recorded, the reconciler re-derives readiness from the task table: a dispatch
    while one of two dependencies is still pending, a dispatch before the due time, and one before the
    dependency's completion are each ``early``; a diamond dispatched after both of its dependencies is
    ``matched``, and an early attempt's explanation says by how much it came first."""
    store.change("sel", "selective", actor="op", reason="r", percent=50)
    clock = db_clock(engine)
    diamond = (TaskSpec("a"), TaskSpec("b"), TaskSpec("c", ("a", "b")))
    _seed(engine, tables, "sel", ["unmet", "clean", "late-dep"], tasks=diamond)
    _seed(engine, tables, "sel", ["due"], tasks=(TaskSpec("d", due_in=-1.0),))
    t = tables.tasks
    done = clock - timedelta(seconds=30)
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.task_key.in_(["a", "b"]))
                     .values(status="completed", completed_at=_at(engine, done)))
    _dispatch(engine, tables, ["unmet", "clean", "late-dep", "due"], "events")
    with engine.begin() as conn:
        # After the dispatch: 'b' of "unmet" turns out never to have completed, 'a' of "late-dep" completed
        # a minute later than the dispatch, and the due time of "due" moves an hour ahead.
        conn.execute(t.update().where(t.c.instance_id == "unmet", t.c.task_key == "b")
                     .values(status="pending", completed_at=None))
        conn.execute(t.update().where(t.c.instance_id == "late-dep", t.c.task_key == "a")
                     .values(completed_at=_at(engine, clock + timedelta(minutes=1))))
        conn.execute(t.update().where(t.c.instance_id == "due")
                     .values(due_at=_at(engine, clock + timedelta(hours=1))))
    _settle()
    until = db_clock(engine)
    counts = count_by_type(engine, tables, until - timedelta(hours=1), until, objective=5.0, tolerance=10.0,
                           include_unacted=False)
    assert counts["sel"].counts == {"matched": 1, "early": 3}
    from bridge.reconcile.report import build_report

    report = build_report(engine, tables, until - timedelta(hours=1), until, settings=GATES, now=until)
    early = {m.task_id: m.detail for m in report.mismatches if m.kind == "early"}
    assert len(early) == 3
    ahead = sorted(float(d.split("acted (events) ")[1].split(" ms")[0]) for d in early.values())
    # "unmet": its readiness is unknown (the dependency never completed): a readiness of its own facts only.
    assert 55_000 < ahead[1] < 61_000  # "late-dep": a minute before its dependency completed
    assert 3_550_000 < ahead[2] < 3_601_000  # "due": an hour before its due time
