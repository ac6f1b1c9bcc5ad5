"""Evidence from a legacy scheduler pollbridge did not write (issue 17, item 3), on SQLite and PostgreSQL.

A foreign scheduler is simulated by plain SQL on the reference task table, with the capture triggers
installed: it moves tasks ``pending`` -> ``queued`` itself (``[legacy] kind = "foreign"``), and a retry
gets a new row id while its attempts column rises at the dispatch (``attempt_moves = "dispatch"``, as
Airflow's ``try_number``). The relay publishes the captured changes and the captured dispatches are
recorded in ``pollbridge_dispatch_log`` (:mod:`bridge.capture.evidence`). Proves: exactly those
dispatches are recorded, once each however often the relay retries; the reconciler matches shadow
decisions to them by logical task and counts each attempt once; ``status``, ``explain`` and the metrics
show them; the gate counts only matched evidence and, with no legacy dispatch observed, says "no
evidence" and ``reconcile --gate`` exits 1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.bus import open_bus
from bridge.capture.evidence import is_dispatch_transition, record_foreign_dispatches
from bridge.capture.relay import Relay
from bridge.capture.triggers import install_capture
from bridge.core.errors import GateRefused
from bridge.core.mapping import StatusValues, TaskTableMapping
from bridge.core.settings import GateSettings, RelaySettings
from bridge.db.clock import db_clock
from bridge.db.engine import db_now
from bridge.db.schema import decisions, dispatch_log, flag_audit, flags, outbox
from bridge.flags.store import FlagStore
from bridge.reconcile.explain import explain_task
from bridge.reconcile.gate import NO_EVIDENCE
from bridge.reconcile.report import Report, build_report
from bridge.reconcile.status import StatusCollector, gather_status
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.rollout.promotion import evaluate_gate, set_phase
from bridge.tasktable.dispatch import ReadyTask, dispatch_many
from bridge.tasktable.tables import TaskTable, reflect_tables
from tests.support import SHARED_DB_PARAMS, shared_engine

#: The reference table seen as a foreign scheduler's: its dispatch raises the attempts column (Airflow's
#: try_number), and so does pollbridge's own dispatch ([mapping.dispatch] set).
FOREIGN = TaskTableMapping(attempt_moves="dispatch", dispatch_set=(("attempts", "increment"),))
GATES = GateSettings(tolerance=10.0)


@pytest.fixture(params=SHARED_DB_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    """The module's shared database for the dialect, emptied (``shared_engine``)."""
    engine = shared_engine(request)
    with engine.begin() as conn:
        conn.execute(outbox.delete())  # after the task table: deleting its rows captured nothing, but be sure
    return engine


@pytest.fixture
def tt(engine: Engine) -> TaskTable:
    return reflect_tables(engine, FOREIGN)


# --- the foreign scheduler: plain SQL on its own table ------------------------------------------------------

def _sql(engine: Engine, statement: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(statement), params)


def legacy_dispatch(engine: Engine, instance: str, key: str = "a", *, new_id: bool = False) -> None:
    """pending -> queued with the attempt counter raised in the same write; ``new_id``: the retry also gets a
    new primary key (Airflow gives each try a new task-instance id)."""
    renumber = "id = id + 100000, " if new_id else ""
    _sql(engine, f"UPDATE tasks SET {renumber}status = 'queued', attempts = attempts + 1 "
                 "WHERE instance_id = :i AND task_key = :k", i=instance, k=key)


def legacy_set(engine: Engine, instance: str, status: str, key: str = "a") -> None:
    _sql(engine, "UPDATE tasks SET status = :s WHERE instance_id = :i AND task_key = :k", s=status, i=instance,
         k=key)


def _seed(engine: Engine, tt: TaskTable, ids: Sequence[str], ago: float = 0.0, workflow_type: str = "orders") -> None:
    with engine.begin() as conn:
        seed(conn, tt, [WorkflowSpec(i, workflow_type, (TaskSpec("a"),)) for i in ids],
             now=db_clock(engine) - timedelta(seconds=ago))


def decide(engine: Engine, tt: TaskTable, instance: str, key: str = "a", *, ago: float = 0.0,
           after_ready: float = 0.0) -> None:
    """The event path's shadow decision for the row's next attempt (its attempts + 1), on the row's id now,
    ``ago`` seconds ago, ``after_ready`` seconds after the readiness it records."""
    t = tt.tasks
    with engine.begin() as conn:
        row = conn.execute(sa.select(t.c.id, t.c.attempts).where(t.c.instance_id == instance,
                                                                  t.c.task_key == key)).one()
        at: Any = db_now(engine.dialect.name)
        ready: Any = at
        if ago or after_ready:
            when = db_clock(engine) - timedelta(seconds=ago)
            at, ready = _bind(engine, when), _bind(engine, when - timedelta(seconds=after_ready))
        conn.execute(decisions.insert().values(
            task_id=str(row.id), instance_id=instance, workflow_type="orders", task_key=key,
            attempt=row.attempts + 1, ready_at=ready, decided_at=at))


def _bind(engine: Engine, value: Any) -> Any:
    return value.replace(tzinfo=None) if engine.dialect.name == "sqlite" else value


def relay_and_record(engine: Engine, tt: TaskTable) -> None:
    """Publish every captured change with the real relay, then record the foreign dispatches among the
    published rows in one transaction, as the relay does where it marks them published (a relay that
    already recorded them makes this call a no-op: the recording is idempotent)."""
    bus = open_bus("embedded", engine=engine, partitions=2)
    try:
        relay = Relay(engine, bus, RelaySettings(), statuses=tt.mapping.statuses)
        while relay.publish_batch():
            pass
    finally:
        bus.close()
    with engine.begin() as conn:
        ids = list(conn.execute(sa.select(outbox.c.id).where(outbox.c.published_at.is_not(None))
                                .order_by(outbox.c.id)).scalars())
        record_foreign_dispatches(conn, tt, ids)


def dual_write(engine: Engine, workflow_type: str = "orders", **thresholds: float) -> None:
    """The type in dual_write since five minutes ago (the audit trail backdated, so every action of the
    test falls in the phase)."""
    FlagStore(engine).change(workflow_type, "dual_write", actor="test", reason="shadow",
                             thresholds=thresholds or None)
    earlier = _bind(engine, db_clock(engine) - timedelta(minutes=5))
    with engine.begin() as conn:
        conn.execute(flag_audit.update().where(flag_audit.c.workflow_type == workflow_type)
                     .values(changed_at=earlier))
        conn.execute(flags.update().where(flags.c.workflow_type == workflow_type).values(updated_at=earlier))


def log_rows(engine: Engine) -> list[Any]:
    dl = dispatch_log.c
    with engine.connect() as conn:
        return list(conn.execute(sa.select(dl.task_id, dl.instance_id, dl.task_key, dl.attempt, dl.path, dl.ready_at,
                                           dl.dispatched_at, dl.trace_id).order_by(dl.id)))


def captured_dispatches(engine: Engine) -> list[Any]:
    """The outbox rows of the transitions into 'queued' (what a foreign dispatch looks like), oldest first."""
    o = outbox.c
    with engine.connect() as conn:
        return list(conn.execute(sa.select(o.task_id, o.instance_id, o.task_key, o.attempt, o.created_at, o.trace_id)
                                 .where(o.new_status == "queued").order_by(o.id)))


def report(engine: Engine, tt: TaskTable, gates: GateSettings = GATES) -> Report:
    now = db_clock(engine)
    return build_report(engine, tt, now - timedelta(minutes=10), now + timedelta(seconds=1), settings=gates)


@dataclass
class Scenario:
    """The issue's shapes in dual_write: matched, a miss, an extra, a pending decision, and a retry whose
    second try got a new row id at its dispatch."""

    retry_old_id: str
    retry_new_id: str


def scenario(engine: Engine, tt: TaskTable) -> Scenario:
    dual_write(engine)
    _seed(engine, tt, ["m1", "m2", "m3", "miss", "pend", "retry"])
    _seed(engine, tt, ["xtra"], ago=60)
    for i in ("m1", "m2", "m3", "retry"):
        decide(engine, tt, i)
        legacy_dispatch(engine, i)
    legacy_dispatch(engine, "miss")  # dispatched; the event path never decided it
    decide(engine, tt, "xtra", ago=60)  # decided a minute ago; nobody dispatched it (still ready)
    decide(engine, tt, "pend")  # decided just now; the legacy scheduler has not dispatched it yet
    # The retry: try 1 runs and fails, goes back to pending, the event path decides try 2 on the row as it is,
    # then the legacy scheduler dispatches try 2 and gives the row a new id in the same write.
    t = tt.tasks
    with engine.connect() as conn:
        old = conn.execute(sa.select(t.c.id).where(t.c.instance_id == "retry")).scalar_one()
    legacy_set(engine, "retry", "running")
    legacy_set(engine, "retry", "failed")
    legacy_set(engine, "retry", "pending")
    decide(engine, tt, "retry")
    legacy_dispatch(engine, "retry", new_id=True)
    for i in ("m1", "m2"):  # later changes of a dispatched task are no dispatch
        legacy_set(engine, i, "running")
        legacy_set(engine, i, "completed")
    relay_and_record(engine, tt)
    return Scenario(str(old), str(old + 100000))


# --- 1. the dispatches recorded -------------------------------------------------------------------------------

def test_captured_dispatches_are_recorded_once_with_the_capture_time_and_attempt(engine: Engine,
                                                                                tt: TaskTable) -> None:
    """Every transition into 'queued' (an insert directly in it too) is one dispatch-log row, path 'poller':
    the row id at the dispatch, the attempt the dispatch raised the counter to, the capture's time and trace
    id, no ready time; nothing for inserts, runs, completions, failures or re-pends. Recording again, and
    republishing every row after a bus loss (their created_at reset), adds nothing and moves nothing."""
    s = scenario(engine, tt)
    _sql(engine, "INSERT INTO workflow_instances (id, workflow_type) VALUES ('ins', 'orders')")
    _sql(engine, "INSERT INTO tasks (instance_id, task_key, status, depends_on, attempts, max_attempts) "
                 "VALUES ('ins', 'a', 'queued', '[]', 1, 3)")
    relay_and_record(engine, tt)

    rows = log_rows(engine)
    captured = captured_dispatches(engine)
    assert [(r.task_id, r.instance_id, r.task_key, r.attempt) for r in rows] == [
        (c.task_id, c.instance_id, c.task_key, c.attempt) for c in captured]
    assert sorted((r.instance_id, r.attempt) for r in rows) == [
        ("ins", 1), ("m1", 1), ("m2", 1), ("m3", 1), ("miss", 1), ("retry", 1), ("retry", 2)]
    assert [r.dispatched_at for r in rows] == [c.created_at for c in captured]
    assert [r.trace_id for r in rows] == [c.trace_id for c in captured]
    assert {r.path for r in rows} == {"poller"} and {r.ready_at for r in rows} == {None}
    retry = [r.task_id for r in rows if r.instance_id == "retry"]
    assert retry == [s.retry_old_id, s.retry_new_id]  # each try on the row id it was dispatched as

    with engine.begin() as conn:
        ids = list(conn.execute(sa.select(outbox.c.id)).scalars())
        assert record_foreign_dispatches(conn, tt, ids) == 0
        assert record_foreign_dispatches(conn, tt, list(conn.execute(sa.select(outbox)))) == 0
        # A bus loss: the relay marks the retained rows unpublished again, "queued since" now.
        conn.execute(outbox.update().values(published_at=None, created_at=db_now(engine.dialect.name)))
    relay_and_record(engine, tt)
    assert log_rows(engine) == rows


def test_pollbridges_own_dispatch_is_not_taken_for_the_legacy_schedulers(engine: Engine, tt: TaskTable) -> None:
    """In selective, the event path's compare-and-set moves the row into 'queued' too: the captured change
    is its own dispatch (its 'events' row is already in the log), not a second one by the legacy scheduler."""
    _seed(engine, tt, ["ev", "leg"])
    t = tt.tasks
    with engine.connect() as conn:
        row = conn.execute(sa.select(t.c.id, t.c.attempts).where(t.c.instance_id == "ev")).one()
    task = ReadyTask(row.id, "ev", "a", "orders", row.attempts + 1, None)
    with engine.begin() as conn:
        assert dispatch_many(conn, tt, [task], "events") == [task]
    legacy_dispatch(engine, "leg")
    relay_and_record(engine, tt)
    assert sorted((r.instance_id, r.path, r.attempt) for r in log_rows(engine)) == [
        ("ev", "events", 1), ("leg", "poller", 1)]


# --- 2. the reconciler -----------------------------------------------------------------------------------------

def test_the_report_matches_by_logical_task_and_counts_each_attempt_once(engine: Engine, tt: TaskTable) -> None:
    """matched: three decided and dispatched, and both tries of the retry (try 2 decided on the old row id,
    dispatched on the new one); missing: the dispatch nobody decided; extra: the decision nobody dispatched
    (a ready task, counted there and not a second time as unacted); pending: the fresh decision."""
    s = scenario(engine, tt)
    rep = report(engine, tt)
    (orders,) = rep.types
    assert orders.counts == {"matched": 5, "missing": 1, "extra": 1, "pending": 1}
    assert (orders.compared, orders.dispatched) == (7, 6)
    kinds = {(m.kind, m.task_id) for m in rep.mismatches}
    with engine.connect() as conn:
        t = tt.tasks
        ids: dict[str, str] = {str(i): str(n) for i, n in conn.execute(sa.select(t.c.instance_id, t.c.id))}
    assert kinds == {("missing", ids["miss"]), ("extra", ids["xtra"])}
    missing = next(m for m in rep.mismatches if m.kind == "missing")
    assert "legacy scheduler dispatched attempt 1" in missing.detail and "no shadow decision" in missing.detail
    assert ids["retry"] == s.retry_new_id
    # The legacy scheduler's latency is measured from the ready time the matched decisions recorded.
    assert orders.latency_ms["poller"]["n"] == 5


def test_a_slow_decision_is_late_only_when_matched(engine: Engine, tt: TaskTable) -> None:
    """A decision 30 s after its readiness is ``late`` when the legacy scheduler dispatched the attempt (matched,
    past the objective: matched evidence all the same) and ``extra`` when nobody did (a decision nobody
    dispatched is extra however slow): each attempt in one kind."""
    dual_write(engine, min_tasks=1, miss_budget=0.9)
    _seed(engine, tt, ["paired", "alone"], ago=90)
    for i in ("paired", "alone"):
        decide(engine, tt, i, ago=60, after_ready=30)
    legacy_dispatch(engine, "paired")
    legacy_set(engine, "alone", "running")
    relay_and_record(engine, tt)
    (orders,) = report(engine, tt).types
    assert orders.counts == {"late": 1, "extra": 1}
    assert orders.verdict == "pass", orders.criteria
    assert "1 matched (1 of them late)" in next(c.detail for c in orders.criteria if c.name == "min_tasks")


def test_status_explain_and_the_metrics_show_the_foreign_dispatches(engine: Engine, tt: TaskTable) -> None:
    s = scenario(engine, tt)
    status = gather_status(engine, window=600)
    orders = status.type("orders")
    assert orders is not None and orders.dispatches["poller"] == 6 and orders.decisions == 7
    registry = CollectorRegistry()
    registry.register(StatusCollector(lambda: gather_status(engine, window=600)))
    assert registry.get_sample_value("pollbridge_dispatches_window",
                                     {"workflow_type": "orders", "path": "poller"}) == 6

    story = explain_task(engine, tt, s.retry_new_id, foreign=True)
    # Both tries of the logical task, whichever row id each was decided and dispatched on.
    assert [(d.attempt, d.path) for d in story.dispatches] == [(1, "poller"), (2, "poller")]
    assert [d.attempt for d in story.decisions] == [1, 2]
    assert story.answer.code == "dispatched"
    assert "dispatched by the legacy scheduler" in story.answer.sentence
    assert "captured from the task table" in story.answer.sentence
    assert story.dispatches[-1].trace_event is not None  # the captured change it came from
    assert story.dispatches[-1].trace_event.new_status == "queued"


# --- an Airflow-shaped table: composite keys, NULL = pending, dependencies and trigger rules per DAG version ---

AIRFLOW_SHAPED = {
    "table": "pb_foreign_ti",
    "columns": {"id": "id", "instance_id": ["dag", "run"], "task_key": ["task", "map_index"], "status": "state",
                "workflow_type": "dag", "completed_at": "end_date", "attempts": "try_number", "depends_on": "",
                "due_at": "", "awaits_signal": "", "signal_received_at": "", "dispatched_at": "", "updated_at": "",
                "max_attempts": ""},
    "statuses": {"null": "pending", "pending": ["up_for_retry"], "dispatched": ["scheduled", "queued"],
                 "running": "running", "completed": "success", "failed": ["failed", "upstream_failed"],
                 "skipped": "skipped", "review": ""},
    "dependencies": {"mode": "keys", "table": "pb_foreign_edges", "task_key": "task", "depends_on_key": "upstream",
                     "key_column": "task", "match": ["dag_version"], "rule": "rule"},
    "instances": False,
    "dispatch": {"attempt_moves": "dispatch", "set": {"try_number": "increment"}},
}
#: (dag, task, upstream, rule) of DAG version v1: a branch whose join runs after one side was skipped, and a
#: join that needs every upstream to succeed.
EDGES = [("br", "left", "branch", None), ("br", "right", "branch", None),
         ("br", "join", "left", "none_failed_min_one_success"), ("br", "join", "right", "none_failed_min_one_success"),
         ("strict", "s2", "s1", "all_success")]


@pytest.fixture
def airflow_shaped(engine: Engine) -> Iterator[TaskTable]:
    """The table and its edges, capture moved onto it for the test (and back onto the reference table)."""
    metadata = sa.MetaData()
    sa.Table("pb_foreign_ti", metadata,
             sa.Column("id", sa.String(40), primary_key=True),
             sa.Column("dag", sa.Text, nullable=False), sa.Column("run", sa.Text, nullable=False),
             sa.Column("task", sa.Text, nullable=False), sa.Column("map_index", sa.Integer, nullable=False),
             sa.Column("state", sa.Text, nullable=True), sa.Column("try_number", sa.Integer, nullable=False),
             sa.Column("dag_version", sa.Text, nullable=False),
             sa.Column("end_date", sa.DateTime(timezone=True), nullable=True),
             sa.UniqueConstraint("dag", "run", "task", "map_index"))
    sa.Table("pb_foreign_edges", metadata,
             sa.Column("dag_version", sa.Text, nullable=False), sa.Column("task", sa.Text, nullable=False),
             sa.Column("upstream", sa.Text, nullable=False), sa.Column("rule", sa.Text, nullable=True))
    metadata.drop_all(engine)
    metadata.create_all(engine)
    tt = reflect_tables(engine, TaskTableMapping.from_dict(AIRFLOW_SHAPED))
    with engine.begin() as conn:
        install_capture(conn, tt)
    try:
        yield tt
    finally:
        reference = reflect_tables(engine, TaskTableMapping())
        with engine.begin() as conn:
            install_capture(conn, reference)
        metadata.drop_all(engine)


def test_an_airflow_shaped_table_with_keys_and_trigger_rules(engine: Engine, airflow_shaped: TaskTable) -> None:
    """Beside an Airflow-shaped table (the same run id in two DAGs, a waiting task's state NULL, edges and
    trigger rules per DAG version): the join after a skipped branch, decided and dispatched once its
    upstreams were done, is matched, not early; a join whose rule needs every upstream to succeed,
    dispatched after one was skipped, is early."""
    tt = airflow_shaped
    for dag in ("br", "strict"):
        dual_write(engine, dag)
    rows = [("br", "branch"), ("br", "left"), ("br", "right"), ("br", "join"), ("strict", "s1"), ("strict", "s2")]
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO pb_foreign_edges VALUES (:v, :t, :u, :r)"),
                     [{"v": "v1", "t": t, "u": u, "r": r} for _dag, t, u, r in EDGES])
        conn.execute(sa.text("INSERT INTO pb_foreign_ti (id, dag, run, task, map_index, state, try_number, "
                             "dag_version) VALUES (:id, :dag, 'manual__1', :task, -1, NULL, 0, 'v1')"),
                     [{"id": f"{dag}-{task}", "dag": dag, "task": task} for dag, task in rows])

    def decide_ti(dag: str, task: str) -> None:
        with engine.begin() as conn:
            tries = conn.execute(sa.text("SELECT try_number FROM pb_foreign_ti WHERE id = :id"),
                                 {"id": f"{dag}-{task}"}).scalar_one()
            at = db_now(engine.dialect.name)
            conn.execute(decisions.insert().values(
                task_id=f"{dag}-{task}", instance_id=f"{dag}/manual__1", workflow_type=dag, task_key=f"{task}/-1",
                attempt=tries + 1, ready_at=at, decided_at=at))

    def schedule(dag: str, task: str) -> None:  # Airflow's scheduling: state and try_number in one write
        _sql(engine, "UPDATE pb_foreign_ti SET state = 'scheduled', try_number = try_number + 1 WHERE id = :id",
             id=f"{dag}-{task}")

    def finish(dag: str, task: str, state: str) -> None:
        _sql(engine, "UPDATE pb_foreign_ti SET state = :s, end_date = :e WHERE id = :id", s=state, id=f"{dag}-{task}",
             e=_bind(engine, db_clock(engine) - timedelta(milliseconds=5)))

    for task in ("branch", "right"):
        decide_ti("br", task)
        schedule("br", task)
        finish("br", task, "success")
    finish("br", "left", "skipped")
    decide_ti("br", "join")
    schedule("br", "join")
    finish("strict", "s1", "skipped")
    decide_ti("strict", "s2")
    schedule("strict", "s2")
    relay_and_record(engine, tt)

    assert sorted((r.instance_id, r.task_key, r.attempt) for r in log_rows(engine)) == [
        ("br/manual__1", "branch/-1", 1), ("br/manual__1", "join/-1", 1), ("br/manual__1", "right/-1", 1),
        ("strict/manual__1", "s2/-1", 1)]
    rep = report(engine, tt)
    by_type = {t.workflow_type: t.counts for t in rep.types}
    assert by_type == {"br": {"matched": 3}, "strict": {"early": 1}}
    (early,) = [m for m in rep.mismatches if m.kind == "early"]
    assert early.task_id == "strict-s2"
    story = explain_task(engine, tt, "br-join", foreign=True)
    assert [(d.key, d.status, d.logical_status, d.met) for d in story.readiness.dependencies] == [
        ("left/-1", "skipped", "skipped", False), ("right/-1", "success", "completed", True)]
    assert story.answer.code == "dispatched" and "by the legacy scheduler" in story.answer.sentence


# --- 3. the gate ---------------------------------------------------------------------------------------------

def test_no_legacy_dispatch_observed_is_no_evidence_and_never_passes(engine: Engine, tt: TaskTable) -> None:
    """Shadow decisions only (the scheduler moved its tasks straight to running: no dispatch captured), with
    min_tasks as low as it goes and a lax budget: 30 compared, 0 matched. The report says no evidence, the
    promotion gate refuses on min_tasks."""
    dual_write(engine, min_tasks=1, miss_budget=0.5)
    ids = [f"d{i:02d}" for i in range(30)]
    _seed(engine, tt, ids, ago=60)
    for i in ids:
        decide(engine, tt, i, ago=60)
        legacy_set(engine, i, "running")
    relay_and_record(engine, tt)
    assert log_rows(engine) == []
    gate = evaluate_gate(engine, tt, FlagStore(engine).get("orders"), "selective", GATES)
    assert not gate.passed and {c.name for c in gate.failed} == {"min_tasks"}
    (orders,) = report(engine, tt).types
    assert orders.counts == {"extra": 30}
    assert orders.verdict == NO_EVIDENCE and orders.dispatched == 0
    detail = next(c.detail for c in orders.criteria if c.name == "min_tasks")
    assert "0 matched" in detail and "no dispatch observed" in detail
    with pytest.raises(GateRefused):
        set_phase(engine, tt, FlagStore(engine), GATES, "orders", "selective", percent=10, reason="promote",
                  actor="op")


def test_only_matched_evidence_counts_toward_min_tasks(engine: Engine, tt: TaskTable) -> None:
    """Five matched attempts and thirty extra decisions are 35 compared but 5 matched: a min_tasks of 20
    refuses; every legacy dispatch without a decision is a miss; dispatches observed and 0 matched fails."""
    dual_write(engine, min_tasks=20, miss_budget=0.5)
    _seed(engine, tt, [f"m{i}" for i in range(5)])
    for i in range(5):
        decide(engine, tt, f"m{i}")
        legacy_dispatch(engine, f"m{i}")
    extra = [f"x{n:02d}" for n in range(30)]
    _seed(engine, tt, extra, ago=60)
    for x in extra:
        decide(engine, tt, x, ago=60)
        legacy_set(engine, x, "running")
    relay_and_record(engine, tt)
    (orders,) = report(engine, tt).types
    assert orders.counts == {"matched": 5, "extra": 30}
    assert orders.verdict == "fail" and [c.name for c in orders.criteria if not c.passed] == ["min_tasks"]
    assert not evaluate_gate(engine, tt, FlagStore(engine).get("orders"), "selective", GATES).passed

    with engine.begin() as conn:  # the event path never decided anything: every legacy dispatch is a miss
        conn.execute(decisions.delete())
    (orders,) = report(engine, tt).types
    assert orders.counts == {"missing": 5} and orders.dispatched == 5
    assert orders.verdict == "fail"
    assert {c.name for c in orders.criteria if not c.passed} == {"min_tasks", "miss_rate"}


@pytest.fixture
def foreign_config(tmp_path: Path, engine: Engine) -> list[str]:
    """`pollbridge --config F --database-url URL`, with the foreign legacy and the mapping above."""
    config = tmp_path / "pollbridge.toml"
    config.write_text('[legacy]\nkind = "foreign"\n\n[mapping.dispatch]\nattempt_moves = "dispatch"\n'
                      'set = { attempts = "increment" }\n')
    return ["--config", str(config), "--database-url", engine.url.render_as_string(hide_password=False)]


def _cli(*args: str) -> Any:
    from bridge.cli.main import cli

    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("POLLBRIDGE_")}
    return CliRunner().invoke(cli, list(args), env=clean, prog_name="pollbridge")


def test_reconcile_gate_exits_1_without_a_legacy_dispatch(engine: Engine, tt: TaskTable,
                                                          foreign_config: list[str]) -> None:
    """`reconcile --gate` beside a foreign scheduler: shadow decisions but no legacy dispatch is "no evidence",
    exit 1 whatever min_tasks; once the legacy scheduler's dispatches are captured and matched, it passes."""
    dual_write(engine, min_tasks=1, miss_budget=0.99)
    ids = [f"d{i}" for i in range(3)]
    _seed(engine, tt, ids, ago=60)
    for i in ids:
        decide(engine, tt, i, ago=60)
        legacy_set(engine, i, "running")
    relay_and_record(engine, tt)
    refused = _cli(*foreign_config, "reconcile", "--gate", "--since", "10m")
    assert refused.exit_code == 1, refused.output
    assert "no evidence for orders (no dispatch observed in the window" in refused.stderr
    assert "verdict: no_evidence" in refused.stdout

    _seed(engine, tt, ["ok"])
    decide(engine, tt, "ok")
    legacy_dispatch(engine, "ok")
    relay_and_record(engine, tt)
    with engine.begin() as conn:  # the extra decisions are old news: only the matched one is in the window
        conn.execute(decisions.delete().where(decisions.c.instance_id != "ok"))
    passed = _cli(*foreign_config, "reconcile", "--gate", "--since", "10m")
    assert passed.exit_code == 0, passed.output
    assert "verdict: pass" in passed.stdout
    explained = _cli(*foreign_config, "explain", next(r.task_id for r in log_rows(engine) if r.instance_id == "ok"))
    assert explained.exit_code == 0, explained.output
    assert "dispatched by the legacy scheduler" in explained.stdout


# --- the recording's invariant ---------------------------------------------------------------------------------

STATUSES = StatusValues(pending=["pending", "up_for_retry"], dispatched=["queued", "scheduled"], running="running",
                        completed="completed", failed="failed", review="", null="pending")
VALUES: list[str | None] = [None, "pending", "up_for_retry", "queued", "scheduled", "running", "completed", "failed"]


@given(change=st.sampled_from(["insert", "status", "due", "signal"]), old=st.sampled_from(VALUES),
       new=st.sampled_from(VALUES))
def test_a_dispatch_transition_is_into_a_dispatched_value_from_any_other(change: str, old: str | None,
                                                                          new: str | None) -> None:
    """With several stored values per status and NULL meaning pending: a dispatch is a change into any
    dispatched value from anything that is not one (NULL and an insert count as not dispatched)."""
    dispatched = {"queued", "scheduled"}
    expected = new in dispatched and (change == "insert" or old not in dispatched)
    assert is_dispatch_transition(STATUSES, change, old, new) is expected


OPS = ("dispatch", "dispatch_new_id", "run", "fail", "repend", "requeue")


@settings(max_examples=int(os.environ.get("POLLBRIDGE_EVIDENCE_EXAMPLES", "15")), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(OPS)), min_size=1, max_size=25),
       cuts=st.lists(st.integers(1, 8), min_size=1, max_size=6), retried=st.lists(st.integers(0, 5), max_size=4),
       claim=st.booleans())
def test_each_dispatched_attempt_is_recorded_once_whatever_the_batches(engine: Engine, ops: list[tuple[int, str]],
                                                                      cuts: list[int], retried: list[int],
                                                                      claim: bool) -> None:
    """Whatever a foreign scheduler does to its rows (dispatches, new ids, runs, failures, re-pends, and a
    second dispatch of the same attempt) and however the relay cuts the outbox into batches and retries
    them: one dispatch-log row per dispatched (instance, task key, attempt), at the time of its first
    capture, with the attempt the mapping says (claim: the counter + 1), and nothing else."""
    mapping = TaskTableMapping() if claim else FOREIGN
    tt = reflect_tables(engine, mapping)
    with engine.begin() as conn:
        for table in (tt.tasks, dispatch_log, outbox):
            conn.execute(table.delete())
        if tt.instances is not None:
            conn.execute(tt.instances.delete())
    names = [f"w{n}" for n in range(3)]
    _seed(engine, tt, names)
    status = dict.fromkeys(names, "pending")
    attempts = dict.fromkeys(names, 0)
    expected: dict[tuple[str, int], int] = {}  # (instance, attempt) -> outbox id of the first capture
    for n, op in ops:
        name = names[n]
        was = status[name]
        if op in ("dispatch", "dispatch_new_id"):
            raise_by = 0 if claim else 1
            renumber = "id = id + 1000, " if op == "dispatch_new_id" else ""
            _sql(engine, f"UPDATE tasks SET {renumber}status = 'queued', attempts = attempts + :r "
                         "WHERE instance_id = :i", r=raise_by, i=name)
            attempts[name] += raise_by
            status[name] = "queued"
        elif op == "requeue":  # back to queued without touching the counter: the same attempt again
            _sql(engine, "UPDATE tasks SET status = 'queued' WHERE instance_id = :i", i=name)
            status[name] = "queued"
        else:
            new = {"run": "running", "fail": "failed", "repend": "pending"}[op]
            if claim and op == "run":  # a worker's claim raises the counter of a claim-mode table
                _sql(engine, "UPDATE tasks SET status = 'running', attempts = attempts + 1 WHERE instance_id = :i",
                     i=name)
                attempts[name] += 1
            else:
                legacy_set(engine, name, new)
            status[name] = new
        if was != "queued" and status[name] == "queued":
            attempt = attempts[name] + (1 if claim else 0)
            with engine.connect() as conn:
                last = conn.execute(sa.select(sa.func.max(outbox.c.id))).scalar_one()
            expected.setdefault((name, attempt), last)

    with engine.connect() as conn:
        all_ids = list(conn.execute(sa.select(outbox.c.id).order_by(outbox.c.id)).scalars())
    batches: list[list[int]] = []
    start = 0
    for cut in cuts * (len(all_ids) // max(1, sum(cuts)) + 1):
        if start >= len(all_ids):
            break
        batches.append(all_ids[start:start + cut])
        start += cut
    for k, batch in enumerate(batches):
        with engine.begin() as conn:
            record_foreign_dispatches(conn, tt, batch)
        for again in retried:  # an earlier batch again (a republish): nothing new
            if again <= k:
                with engine.begin() as conn:
                    record_foreign_dispatches(conn, tt, batches[again])

    o = outbox.c
    with engine.connect() as conn:
        created = dict(conn.execute(sa.select(o.id, o.created_at)).all())
    rows = log_rows(engine)
    assert sorted((r.instance_id, r.attempt) for r in rows) == sorted(expected)
    assert {(r.instance_id, r.attempt): r.dispatched_at for r in rows} == {
        key: created[outbox_id] for key, outbox_id in expected.items()}
    assert {r.path for r in rows} <= {"poller"}
