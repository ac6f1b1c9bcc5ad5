"""Hot statements straight through the driver (bridge.db.driver): the same rows, errors and events as SQLAlchemy."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import SchedulerSettings, TypeSettings
from bridge.db.clock import as_utc
from bridge.db.driver import DriverStatement
from bridge.db.engine import StatementCounter, create_engine
from bridge.db.schema import dispatch_log
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.dispatch import ReadyTask, _pg_dispatch_statement, dispatch_many
from bridge.tasktable.tables import TaskTable, reflect_tables
from event_scheduler.evaluate import Evaluator
from event_scheduler.metrics import SchedulerMetrics
from tests.support import wait_for


def _evaluator(engine: Engine, tables: TaskTable) -> Evaluator:
    settings = SchedulerSettings(defaults=TypeSettings(running_timeout=60.0))
    return Evaluator(engine, tables, FixedRouter("dual_write"), settings, SchedulerMetrics(CollectorRegistry()))


def _seed_mixed(engine: Engine, tables: TaskTable) -> list[str]:
    """Instances whose tasks are in every state the evaluation reads: ready, waiting, due later, failed with
    attempts left, running, finished."""
    chain = (TaskSpec("a"), TaskSpec("b", ("a",)), TaskSpec("c", ("b",)), TaskSpec("later", due_in=3600),
             TaskSpec("fan", ("a", "b")))
    ids = [f"drv{n}" for n in range(6)]
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(i, "orders", chain) for i in ids])
        t = tables.tasks.c
        conn.execute(tables.tasks.update().where(t.task_key == "a").values(status="completed"))
        conn.execute(tables.tasks.update().where(t.instance_id == "drv1", t.task_key == "b")
                     .values(status="failed", attempts=1, max_attempts=3))
        conn.execute(tables.tasks.update().where(t.instance_id == "drv2", t.task_key == "b")
                     .values(status="running", attempts=1))
        conn.execute(tables.tasks.update().where(t.instance_id == "drv3").values(status="completed"))
    return [*ids, "drv-unknown"]


def test_the_evaluation_reads_the_same_rows_as_through_sqlalchemy(engine: Engine, tables: TaskTable) -> None:
    ids = _seed_mixed(engine, tables)
    evaluator = _evaluator(engine, tables)
    run = evaluator._query_run
    assert run.direct == (engine.dialect.name == "postgresql")
    params: dict[str, Any] = {"ids": ids}
    if engine.dialect.name == "postgresql":
        params["scope"] = json.dumps({i: {"w": 1} for i in ids})
    with evaluator.connect() as conn:
        through_sqlalchemy = [tuple(r) for r in conn.execute(evaluator._query, params).all()]
        rows = run.all(conn, params)
    assert [tuple(r) for r in rows] == through_sqlalchemy
    # Same Python types, not only equal values (a datetime stays an aware datetime, an id an int).
    assert [tuple(map(type, r)) for r in rows] == [tuple(map(type, r)) for r in through_sqlalchemy]
    assert {r.instance_id for r in rows} == set(ids) - {"drv-unknown"}
    assert any(r.ready for r in rows) and any(r.due_future for r in rows)
    # Named access is what the evaluator uses.
    assert all(r.task_key == tuple(r)[2] for r in rows)


def test_the_dispatch_through_the_driver_writes_task_and_log_once(engine: Engine, tables: TaskTable) -> None:
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec("d1", "orders", (TaskSpec("a"), TaskSpec("b", ("a",))))])
        ids = dict(conn.execute(sa.select(tables.tasks.c.task_key, tables.tasks.c.id)).all())
    ready = [ReadyTask(ids["a"], "d1", "a", "orders", 1, None),
             ReadyTask(ids["b"], "d1", "b", "orders", 1, None)]  # b is not ready: its dependency is pending
    with engine.begin() as conn:
        assert _pg_dispatch_statement(tables, "events", conn.dialect).direct == (engine.dialect.name == "postgresql")
        won = dispatch_many(conn, tables, ready, "events", {"d1": "trace-1"})
    assert won == ready[:1]
    with engine.begin() as conn:  # the same task again: the compare-and-set finds it dispatched already
        assert dispatch_many(conn, tables, ready, "events", {"d1": "trace-2"}) == []
    with engine.connect() as conn:
        log = conn.execute(sa.select(dispatch_log.c.task_id, dispatch_log.c.path, dispatch_log.c.trace_id,
                                     dispatch_log.c.attempt, dispatch_log.c.task_key)).all()
        status = dict(conn.execute(sa.select(tables.tasks.c.task_key, tables.tasks.c.status)).all())
    assert [tuple(r) for r in log] == [(str(ids["a"]), "events", "trace-1", 1, "a")]
    assert status == {"a": "queued", "b": "pending"}


def test_a_rolled_back_transaction_takes_the_driver_dispatch_with_it(engine: Engine, tables: TaskTable) -> None:
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec("r1", "orders", (TaskSpec("a"),))])
        task_id = conn.execute(sa.select(tables.tasks.c.id)).scalar_one()
    with engine.connect() as conn:
        with conn.begin() as tx:
            assert dispatch_many(conn, tables, [ReadyTask(task_id, "r1", "a", "orders", 1, None)], "poller")
            tx.rollback()
        assert conn.execute(sa.select(tables.tasks.c.status)).scalar_one() == "pending"
        assert conn.execute(sa.select(sa.func.count()).select_from(dispatch_log)).scalar_one() == 0


def test_statement_listeners_see_the_driver_statements(engine: Engine, tables: TaskTable) -> None:
    ids = _seed_mixed(engine, tables)
    evaluator = _evaluator(engine, tables)
    counter = StatementCounter()
    counter.attach(engine)
    seen: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *args: seen.append(args[2]))
    params: dict[str, Any] = {"ids": ids, "scope": json.dumps({i: {"w": 1} for i in ids})}
    if engine.dialect.name != "postgresql":
        del params["scope"]
    with evaluator.connect() as conn:
        before = counter.count
        evaluator._query_run.all(conn, params)
    # One statement on both: the evaluation's connection is autocommit on PostgreSQL, and on SQLite its reads
    # run in SQLite's implicit transaction, without a BEGIN of their own (bridge.db.engine.autocommit).
    assert counter.count == before + 1, seen[-3:]
    assert "pb_eval" in seen[-1]


class _Shout(sa.types.TypeDecorator[str]):
    """A type with a bind and a result processor, both of which the direct path must apply."""

    impl = sa.String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else value.upper()

    def process_result_value(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else f"<{value}>"


def test_bind_and_result_processors_are_applied_as_sqlalchemy_would(engine: Engine) -> None:
    stmt = sa.select(sa.bindparam("word", type_=_Shout).label("word"), sa.literal(7).label("seven"))
    run = DriverStatement(stmt, engine.dialect)
    assert run.direct == (engine.dialect.name == "postgresql")
    with engine.connect() as conn:
        expected = tuple(conn.execute(stmt, {"word": "hi"}).one())
        (row,) = run.all(conn, {"word": "hi"})
        assert tuple(row) == expected == ("<HI>", 7)
        assert row.word == "<HI>" and row.seven == 7
        assert run.scalars(conn, {"word": "yo"}) == ["<YO>"]


@pytest.mark.postgres
def test_what_the_direct_path_cannot_prove_equal_goes_through_sqlalchemy(pg_url: str) -> None:
    from bridge.db.engine import create_engine

    engine = create_engine(pg_url)
    try:
        expanding = sa.select(sa.literal_column("x")).select_from(
            sa.text("(VALUES (1), (2), (3)) AS v(x)")).where(sa.literal_column("x").in_(sa.bindparam("xs",
                                                                                                 expanding=True)))
        run = DriverStatement(expanding, engine.dialect)
        assert not run.direct  # the IN list is rendered per call
        with engine.connect() as conn:
            assert sorted(run.scalars(conn, {"xs": [1, 3]})) == [1, 3]
        duplicate_labels = sa.select(sa.literal(1).label("a"), sa.literal(2).label("a"))
        assert not DriverStatement(duplicate_labels, engine.dialect).direct
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_cut_connection_is_a_wrapped_error_and_never_reused(pg_url: str) -> None:
    from bridge.db.engine import create_engine

    engine = create_engine(pg_url)
    try:
        run = DriverStatement(sa.select(sa.literal(1).label("one")), engine.dialect)
        assert run.direct
        with engine.connect() as conn:
            assert run.scalars(conn, {}) == [1]
            raw = conn.connection.driver_connection
            assert raw is not None
            with psycopg.connect(pg_url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (raw.info.backend_pid,))
            with pytest.raises(sa.exc.DBAPIError) as raised:
                run.scalars(conn, {})
            assert raised.value.connection_invalidated
            assert isinstance(raised.value.orig, psycopg.OperationalError)
            assert conn.invalidated
        with engine.connect() as conn:  # the pool hands out a working connection
            assert run.scalars(conn, {}) == [1]
    finally:
        engine.dispose()


def test_numeric_and_float_results_are_converted_as_sqlalchemy_converts_them(engine: Engine) -> None:
    # psycopg's NUMERIC and FLOAT result processors need the type the server reports: a reflected legacy
    # column of either type must not break the scheduler's evaluation.
    stmt = sa.select(sa.cast(sa.literal("1.25"), sa.Numeric(10, 2)).label("n"),
                     sa.cast(sa.literal("2.5"), sa.Float).label("f"),
                     sa.cast(sa.literal("3"), sa.Numeric(10, 0, asdecimal=False)).label("m"))
    run = DriverStatement(stmt, engine.dialect)
    with engine.connect() as conn:
        expected = tuple(conn.execute(stmt).one())
        (row,) = run.all(conn, {})
    assert tuple(row) == expected
    assert [type(v) for v in row] == [type(v) for v in expected]


def test_a_statement_outside_a_transaction_begins_one_as_sqlalchemy_would(engine: Engine,
                                                                           tables: TaskTable) -> None:
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec("a1", "orders", (TaskSpec("a"),))])
        task_id = conn.execute(sa.select(tables.tasks.c.id)).scalar_one()
    with engine.connect() as conn:  # no begin(): the dispatch must belong to a transaction commit() ends
        assert dispatch_many(conn, tables, [ReadyTask(task_id, "a1", "a", "orders", 1, None)], "poller")
        assert conn.in_transaction()
        conn.commit()
    with engine.connect() as conn:
        assert conn.execute(sa.select(tables.tasks.c.status)).scalar_one() == "queued"
        assert conn.execute(sa.select(sa.func.count()).select_from(dispatch_log)).scalar_one() == 1


@pytest.mark.postgres
def test_a_bind_computed_per_execution_goes_through_sqlalchemy(pg_url: str) -> None:
    from bridge.db.engine import create_engine

    engine = create_engine(pg_url)
    try:
        calls = iter(range(100))
        stmt = sa.select(sa.bindparam("n", callable_=lambda: next(calls), type_=sa.Integer).label("n"))
        run = DriverStatement(stmt, engine.dialect)
        assert not run.direct
        with engine.connect() as conn:
            assert run.scalars(conn, {}) != run.scalars(conn, {})
    finally:
        engine.dispose()


def test_a_missing_parameter_is_the_same_error_on_both_paths(engine: Engine) -> None:
    stmt = sa.select(sa.bindparam("word", type_=_Shout).label("word"))
    run = DriverStatement(stmt, engine.dialect)
    with engine.connect() as conn:
        with pytest.raises(sa.exc.SQLAlchemyError, match="A value is required for bind parameter 'word'"):
            conn.execute(stmt, {}).all()
        conn.rollback()
        with pytest.raises(sa.exc.SQLAlchemyError, match="A value is required for bind parameter 'word'"):
            run.all(conn, {})


def test_a_warm_evaluator_dispatches_in_the_statement_that_evaluates(engine: Engine, tables: TaskTable) -> None:
    """Issue 20: on PostgreSQL, once the evaluator has seen a type on the dispatching route, a batch that finds
    a task of it ready dispatches it in the evaluation's own statement (the evaluation and the compare-and-set
    took a round trip and a transaction each: 4 transactions per completion with triggers, now 3). The
    dispatch log's row is the one the two-statement path writes. SQLite has no data-modifying CTE: there the
    evaluator keeps the two statements."""
    pg = engine.dialect.name == "postgresql"
    evaluator = Evaluator(engine, tables, FixedRouter("cutover"), SchedulerSettings(),
                          SchedulerMetrics(CollectorRegistry()))
    chain = (TaskSpec("a"), TaskSpec("b", ("a",)))
    with engine.begin() as conn:
        seed(conn, tables, [WorkflowSpec(i, "orders", chain) for i in ("w1", "w2")])
        t = tables.tasks.c
        conn.execute(tables.tasks.update().where(t.task_key == "a")
                     .values(status="completed", attempts=1, completed_at=sa.func.now()))
    counter = StatementCounter()
    counter.attach(engine)
    seen: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *args: seen.append(args[2]))
    runs = []
    ready_at = {}
    for instance in ("w1", "w2"):  # w1: the type's first batch (two statements); w2: the type is known
        with evaluator.connect() as conn:
            before = counter.count
            result = evaluator.evaluate([instance], {instance: f"trace-{instance}"}, conn=conn)
            runs.append((counter.count - before, [(d.instance_id, d.task_key) for d in result.dispatched]))
            ready_at.update({d.instance_id: as_utc(d.ready_at) for d in result.dispatched})
    # PostgreSQL: the evaluation, then the dispatch's one statement; SQLite: the evaluation, then BEGIN
    # IMMEDIATE, the compare-and-set and the log's insert.
    assert runs[0] == ((2 if pg else 4), [("w1", "b")]), seen[-3:]
    assert runs[1] == ((1 if pg else 4), [("w2", "b")]), seen[-3:]
    log = dispatch_log.c
    with engine.connect() as conn:
        rows = {r.instance_id: r for r in conn.execute(sa.select(dispatch_log).order_by(log.instance_id))}
    assert sorted(rows) == ["w1", "w2"]
    for instance, row in rows.items():
        assert (row.task_key, row.workflow_type, row.attempt, row.path, row.trace_id) == \
            ("b", "orders", 1, "events", f"trace-{instance}")
        assert as_utc(row.ready_at) == ready_at[instance] is not None and row.dispatched_at is not None
    assert (getattr(evaluator.queries, "evaluate_and_dispatch_run", None) is not None) == pg
    assert evaluator.metrics.value("pollbridge_scheduler_dispatches_total",
                                   {"workflow_type": "orders", "path": "events"}) == 2


def test_a_task_another_dispatcher_takes_during_the_combined_statement_is_a_lost_race(pg_url: str) -> None:
    """PostgreSQL: the combined statement's evaluation reads the task pending, and another dispatcher's write
    holds the row; when that write commits, the compare-and-set inside the statement finds the task no longer
    pending: no dispatch, no dispatch-log row, a lost race counted, and no recheck (the task left pending)."""
    engine = create_engine(pg_url)
    try:
        tables = reflect_tables(engine, TaskTableMapping())
        evaluator = Evaluator(engine, tables, FixedRouter("cutover"), SchedulerSettings(),
                              SchedulerMetrics(CollectorRegistry()))
        evaluator._types.add("orders")  # as after a first batch of the type: the combined statement runs
        with engine.begin() as conn:
            seed(conn, tables, [WorkflowSpec("race", "orders", (TaskSpec("a"),))])
        t = tables.tasks
        results: list[Any] = []
        with engine.connect() as other:
            tx = other.begin()
            other.execute(t.update().where(t.c.instance_id == "race").values(status="queued"))

            def evaluate() -> None:
                with evaluator.connect() as conn:
                    results.append(evaluator.evaluate(["race"], conn=conn))

            thread = threading.Thread(target=evaluate)
            thread.start()
            # The statement waits for the other write's row lock. Autocommit: pg_stat_activity is read once per
            # transaction, so looks in one transaction all saw the first one (a CI run beside a CPU hog looked
            # before the statement waited, and timed out).
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as watch:
                wait_for(lambda: watch.execute(sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "  # cluster-wide view
                    "AND wait_event_type = 'Lock' AND query LIKE 'WITH pb_ev %'"
                )).scalar_one() == 1, 15, what="the combined statement to wait for the row lock")
            tx.commit()
            thread.join(15)
        [result] = results
        assert result.dispatched == [] and result.timers == []
        assert evaluator.metrics.value("pollbridge_scheduler_lost_races_total") == 1
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(dispatch_log)).scalar_one() == 0
            assert conn.execute(sa.select(t.c.status)).scalar_one() == "queued"
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_long_statement_is_converted_once_not_per_call(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg converts a ``%(name)s`` query on every call when it is over 4,096 bytes or 50 parameters (the
    scheduler's combined evaluation is 8 KB with 55): a quarter of the scheduler's Python time at 500
    completions/s. The driver path hands psycopg the server form, converted once: the same rows as through
    SQLAlchemy (a literal percent sign, a parameter used twice), and no conversion per call."""
    from psycopg import _queries

    from bridge.db.engine import create_engine

    word = sa.bindparam("word", type_=sa.String)
    columns = [sa.literal(n).label(f"c{n}") for n in range(60)]  # 60 constant parameters
    padding = sa.literal_column("'" + "x" * 4200 + "'").label("pad")  # over psycopg's 4,096-byte cache limit
    stmt = sa.select(*columns, padding, sa.literal_column("'5%'").label("pct"),
                     (word + sa.literal("-") + word).label("twice"))
    engine = create_engine(pg_url)
    try:
        run = DriverStatement(stmt, engine.dialect)
        assert run.direct
        with engine.connect() as conn:
            expected = tuple(conn.execute(stmt, {"word": "ab"}).one())
            assert expected[-2:] == ("5%", "ab-ab")
            conversions: list[bytes] = []
            real = _queries._query2pg_nocache

            def counting(query: bytes, encoding: str) -> Any:
                conversions.append(query)
                return real(query, encoding)

            monkeypatch.setattr(_queries, "_query2pg_nocache", counting)
            monkeypatch.setattr(_queries, "_query2pg", counting)
            for _ in range(3):
                (row,) = run.all(conn, {"word": "ab"})
                assert tuple(row) == expected
            assert run.scalars(conn, {"word": "cd"}) == [0]
            assert conversions == []
    finally:
        engine.dispose()
