"""A real Apache Airflow 3.3 (PostgreSQL, LocalExecutor) run by tests/support/airflow.py, and pollbridge's SQL views
over its serialized DAGs (integrations/airflow/pollbridge.sql).

Airflow runs from its own virtualenv (``$POLLBRIDGE_AIRFLOW_VENV``, else ``~/.cache/pollbridge/airflow-3.3``, created
with pip the first time) as a legacy role that owns its database and nothing else. Every DAG of
tests/acceptance/airflow_dags/pollbridge_shapes.py runs twice, under the same two run ids, and the test checks
Airflow's own record of what it dispatched and the edges and trigger rules the views give. Without PostgreSQL or
Airflow it skips, with the command that provides the missing piece; under ``POLLBRIDGE_REQUIRE_SERVICES=1`` (CI) it
fails instead.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from bridge.reference.oracle import percentile
from tests.support.airflow import (
    SHAPE_DAGS,
    AirflowRig,
    AirflowUnavailable,
    airflow_venv,
    load_sql_blocks,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

PG_ADMIN_URL = os.environ.get("POLLBRIDGE_TEST_PG_URL", "postgresql://root@127.0.0.1:5432/postgres")
REQUIRE_SERVICES = os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1"
#: The same run ids in every DAG: pollbridge must tell runs apart by (dag_id, run_id), not by run_id alone.
RUN_IDS = ("manual__pb_1", "manual__pb_2")

#: task -> its upstream tasks, per DAG (what pollbridge_airflow_edges must give, and nothing else).
UPSTREAMS: dict[str, dict[str, set[str]]] = {
    "pb_chain": {"a": set(), "b": {"a"}, "c": {"b"}, "d": {"c"}},
    "pb_diamond": {"a": set(), "b": {"a"}, "c": {"a"}, "d": {"b", "c"}},
    "pb_fan": {"a": set(), **{f"p{i}": {"a"} for i in range(1, 7)}, "z": {f"p{i}" for i in range(1, 7)}},
    "pb_branch": {"choose": set(), "left": {"choose"}, "right": {"choose"}, "join": {"left", "right"}},
    "pb_retry": {"flaky": set(), "after": {"flaky"}},
}
RULES = {(dag_id, task_id): "all_success" for dag_id, tasks in UPSTREAMS.items() for task_id in tasks}
RULES["pb_branch", "join"] = "none_failed_min_one_success"
#: (task_id, try_number, final state of that try) of every try that ran, per run of each DAG: the branch always picks
#: "left" (so "right" never runs), and "flaky" fails its first try and succeeds on the retry.
TRIES: dict[str, Counter[tuple[str, int, str]]] = {
    dag_id: Counter((task_id, 1, "success") for task_id in tasks if (dag_id, task_id) != ("pb_branch", "right"))
    for dag_id, tasks in UPSTREAMS.items()
}
TRIES["pb_retry"] = Counter({("flaky", 1, "failed"): 1, ("flaky", 2, "success"): 1, ("after", 1, "success"): 1})
TRIED = {(dag_id, task_id) for dag_id, tries in TRIES.items() for task_id, _, _ in tries}


#: Every write to task_instance and task_instance_history, in commit order within a row, recorded by row triggers
#: (as pollbridge's capture triggers would see them): what a try looks like to a trigger, pinned against Airflow.
#: Created by the admin role; the trigger function is SECURITY DEFINER, so Airflow's role needs no grant on the table.
TRACE_SQL = """
CREATE TABLE pollbridge_test_trace (
  seq bigserial PRIMARY KEY, tbl text, op text, old_id uuid, id uuid, dag_id text, run_id text, task_id text,
  try_number int, state text, scheduled_dttm timestamptz, queued_dttm timestamptz);
CREATE FUNCTION pollbridge_test_trace() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = public
AS $body$
DECLARE
  row_id uuid := CASE WHEN TG_TABLE_NAME = 'task_instance' THEN (to_jsonb(NEW) ->> 'id')::uuid
                      ELSE (to_jsonb(NEW) ->> 'task_instance_id')::uuid END;
  old_id uuid := CASE WHEN TG_OP = 'UPDATE' AND TG_TABLE_NAME = 'task_instance' THEN (to_jsonb(OLD) ->> 'id')::uuid END;
BEGIN
  INSERT INTO pollbridge_test_trace (tbl, op, old_id, id, dag_id, run_id, task_id, try_number, state, scheduled_dttm,
                                     queued_dttm)
  VALUES (TG_TABLE_NAME, TG_OP, old_id, row_id, NEW.dag_id, NEW.run_id, NEW.task_id, NEW.try_number, NEW.state,
          NEW.scheduled_dttm, NEW.queued_dttm);
  RETURN NULL;
END
$body$;
CREATE TRIGGER pollbridge_test_trace AFTER INSERT OR UPDATE ON task_instance
  FOR EACH ROW EXECUTE FUNCTION pollbridge_test_trace();
CREATE TRIGGER pollbridge_test_trace AFTER INSERT OR UPDATE ON task_instance_history
  FOR EACH ROW EXECUTE FUNCTION pollbridge_test_trace();
"""


def _unavailable(message: str) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"{message} (POLLBRIDGE_REQUIRE_SERVICES=1: services are required)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def rig(pg_server: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowRig]:
    """Airflow started once for the module, every shape DAG run under both run ids and finished."""
    try:
        venv = airflow_venv()
    except AirflowUnavailable as exc:  # its message names the command that installs Airflow
        _unavailable(f"Apache Airflow is not available: {exc}")
    began = time.monotonic()
    with AirflowRig(PG_ADMIN_URL, venv=venv, home=tmp_path_factory.mktemp("airflow")) as started:
        started.wait_serialized(SHAPE_DAGS, deadline=90)
        with started.connect() as conn:
            conn.execute(TRACE_SQL.encode())
        mark = time.monotonic()
        for run_id in RUN_IDS:
            for dag_id in SHAPE_DAGS:
                started.trigger(dag_id, run_id)
        started.timings["trigger_all"] = time.monotonic() - mark
        started.wait_finished(deadline=150)
        started.timings["until_finished"] = time.monotonic() - began
        yield started
        pids = started.pids()
    # stop() ended every process group and dropped the database and the role: nothing of Airflow is left behind.
    assert pids and not [pid for pid in pids if _group_alive(pid)]
    with psycopg.connect(PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        for query, name in (("SELECT count(*) FROM pg_database WHERE datname = %s", started.database),
                            ("SELECT count(*) FROM pg_roles WHERE rolname = %s", started.role)):
            assert conn.execute(query, [name]).fetchone() == (0,), name


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _print_timings(rig: AirflowRig) -> None:
    print("airflow timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in rig.timings.items()))


def test_every_run_succeeded(rig: AirflowRig) -> None:
    _print_timings(rig)
    assert rig.dag_runs() == sorted((dag_id, run_id, "success") for dag_id in SHAPE_DAGS for run_id in RUN_IDS)


def test_airflow_runs_as_the_legacy_role_that_owns_its_database(rig: AirflowRig) -> None:
    (superuser, createdb, createrole), = rig.query(
        "SELECT rolsuper, rolcreatedb, rolcreaterole FROM pg_roles WHERE rolname = %s", [rig.role])
    assert (superuser, createdb, createrole) == (False, False, False)
    assert rig.query("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()") == [
        (rig.role,)]
    owners = dict(rig.query("SELECT tablename, tableowner FROM pg_tables WHERE tablename IN "
                            "('task_instance', 'task_instance_history', 'serialized_dag', 'dag_run')"))
    assert owners == dict.fromkeys(("task_instance", "task_instance_history", "serialized_dag", "dag_run"), rig.role)


def test_dispatches_are_one_row_per_try_that_ran(rig: AirflowRig) -> None:
    dispatches = rig.dispatches()
    by_run: dict[tuple[str, str], Counter[tuple[str, int, str]]] = {}
    for d in dispatches:
        by_run.setdefault((d.dag_id, d.run_id), Counter())[d.task_id, d.try_number, str(d.state)] += 1
    assert by_run == {(dag_id, run_id): TRIES[dag_id] for dag_id in SHAPE_DAGS for run_id in RUN_IDS}
    for d in dispatches:
        assert d.map_index == -1
        # Airflow's order of events for one try: scheduled (try_number raised), queued to the executor, started, ended.
        assert d.scheduled_dttm is not None and d.queued_dttm is not None
        assert d.start_date is not None and d.end_date is not None
        assert d.scheduled_dttm <= d.queued_dttm <= d.start_date <= d.end_date, d


def test_a_retry_is_a_new_task_instance_id_and_the_earlier_try_moves_to_history(rig: AirflowRig) -> None:
    for run_id in RUN_IDS:
        key = ("pb_retry", run_id, "flaky")
        tries = sorted((d for d in rig.dispatches() if (d.dag_id, d.run_id, d.task_id) == key),
                       key=lambda d: d.try_number)
        assert [(d.try_number, d.source, d.state) for d in tries] == [
            (1, "task_instance_history", "failed"), (2, "task_instance", "success")]
        first, second = tries
        assert first.ti_id != second.ti_id
        assert first.end_date is not None and second.scheduled_dttm is not None
        assert second.scheduled_dttm > first.end_date  # rescheduled after retry_delay, not before the failure


def test_the_skipped_branch_side_never_ran(rig: AirflowRig) -> None:
    rows = rig.query("SELECT run_id, state, try_number, scheduled_dttm, queued_dttm, start_date, end_date "
                     "FROM task_instance WHERE dag_id = 'pb_branch' AND task_id = 'right' ORDER BY run_id")
    # try_number rises only when the scheduler schedules a try, which a skipped task never gets; the branch's skip
    # stamps start_date and end_date (the moment of the skip) but never scheduled_dttm or queued_dttm.
    assert [row[:5] for row in rows] == [(run_id, "skipped", 0, None, None) for run_id in RUN_IDS]
    assert all(started is not None and started == ended for *_, started, ended in rows), rows
    assert rig.query("SELECT count(*) FROM task_instance_history WHERE task_id = 'right'") == [(0,)]


def _trace(rig: AirflowRig, dag_id: str, run_id: str, task_id: str) -> list[tuple[str, str, int, str | None]]:
    """(table, op, try_number, state) of each write to one task's rows, consecutive repeats folded."""
    rows = rig.query("SELECT tbl, op, try_number, state FROM pollbridge_test_trace "
                     "WHERE dag_id = %s AND run_id = %s AND task_id = %s ORDER BY seq", [dag_id, run_id, task_id])
    folded: list[tuple[str, str, int, str | None]] = []
    for row in rows:
        if not folded or tuple(row) != folded[-1]:
            folded.append((str(row[0]), str(row[1]), int(row[2]), row[3]))
    return folded


def test_what_a_trigger_on_task_instance_sees_of_each_try(rig: AirflowRig) -> None:
    """The row writes of a try, as capture triggers see them (the mapping of pollbridge's Airflow integration
    relies on these): the row is inserted at run creation with try 0; the scheduler's UPDATE to ``scheduled`` raises
    try_number and sets scheduled_dttm, a second one sets ``queued`` and queued_dttm; the task itself (through the
    api-server) sets ``running`` and its final state. A retry archives the try to task_instance_history (as
    ``failed``) and then changes the row's primary key ``id`` in place, with the same try_number, in
    ``up_for_retry``."""
    ti, tih = "task_instance", "task_instance_history"
    for run_id in RUN_IDS:
        assert _trace(rig, "pb_chain", run_id, "b") == [
            (ti, "INSERT", 0, None), (ti, "UPDATE", 1, "scheduled"), (ti, "UPDATE", 1, "queued"),
            (ti, "UPDATE", 1, "running"), (ti, "UPDATE", 1, "success")]
        assert _trace(rig, "pb_branch", run_id, "right") == [(ti, "INSERT", 0, None), (ti, "UPDATE", 0, "skipped")]
        assert _trace(rig, "pb_retry", run_id, "flaky") == [
            (ti, "INSERT", 0, None), (ti, "UPDATE", 1, "scheduled"), (ti, "UPDATE", 1, "queued"),
            (ti, "UPDATE", 1, "running"), (ti, "UPDATE", 1, "up_for_retry"), (tih, "INSERT", 1, "failed"),
            (ti, "UPDATE", 1, "up_for_retry"), (ti, "UPDATE", 2, "scheduled"), (ti, "UPDATE", 2, "queued"),
            (ti, "UPDATE", 2, "running"), (ti, "UPDATE", 2, "success")]
        # The id changes exactly once, right after the history row took the old one.
        changes = rig.query("SELECT old_id, id FROM pollbridge_test_trace WHERE dag_id = 'pb_retry' AND run_id = %s "
                            "AND task_id = 'flaky' AND tbl = 'task_instance' AND old_id <> id", [run_id])
        archived = rig.query("SELECT id FROM pollbridge_test_trace WHERE dag_id = 'pb_retry' AND run_id = %s "
                             "AND task_id = 'flaky' AND tbl = 'task_instance_history'", [run_id])
        assert len(changes) == 1 and archived == [(changes[0][0],)]
        # The scheduled_dttm of try 2 is new, but until it is queued again the row still holds try 1's queued_dttm.
        (stale,), = rig.query("SELECT queued_dttm FROM pollbridge_test_trace WHERE dag_id = 'pb_retry' AND run_id = %s "
                              "AND task_id = 'flaky' AND try_number = 2 AND state = 'scheduled' LIMIT 1", [run_id])
        first = next(d for d in rig.dispatches() if (d.dag_id, d.run_id, d.task_id, d.try_number) ==
                     ("pb_retry", run_id, "flaky", 1))
        assert stale == first.queued_dttm


def _edges(conn: psycopg.Connection[tuple[object, ...]]) -> dict[str, dict[str, set[str]]]:
    found: dict[str, dict[str, set[str]]] = {}
    for dag_id, task_id, upstream in conn.execute(
            "SELECT dag_id, task_id, upstream_task_id FROM pollbridge_airflow_edges").fetchall():
        found.setdefault(str(dag_id), {}).setdefault(str(task_id), set()).add(str(upstream))
    return found


def test_views_give_each_dags_edges_and_trigger_rules(rig: AirflowRig) -> None:
    blocks = rig.install_views()
    assert set(blocks) == {"install", "uninstall", "check"}
    with rig.connect() as conn:
        conn.execute(blocks["install"].encode())  # idempotent: a second install replaces the views
        views = {row[0] for row in conn.execute(
            "SELECT table_name FROM information_schema.views WHERE table_name LIKE 'pollbridge%'").fetchall()}
        assert {"pollbridge_airflow_edges", "pollbridge_airflow_rules"} <= views
        assert all(name.startswith("pollbridge_") for name in views)

        expected = {dag_id: {task: ups for task, ups in tasks.items() if ups} for dag_id, tasks in UPSTREAMS.items()}
        assert _edges(conn) == expected
        # One serialized version per DAG (the file never changes during the test), so the rows are exactly the edges.
        assert conn.execute("SELECT count(*) FROM pollbridge_airflow_edges").fetchone() == (
            sum(len(ups) for tasks in UPSTREAMS.values() for ups in tasks.values()),)

        rules = {(str(d), str(t)): str(r) for d, t, r in conn.execute(
            "SELECT dag_id, task_id, trigger_rule FROM pollbridge_airflow_rules").fetchall()}
        assert rules == RULES
        edge_rules = {(str(d), str(t), str(r)) for d, t, r in conn.execute(
            "SELECT dag_id, task_id, trigger_rule FROM pollbridge_airflow_edges").fetchall()}
        assert edge_rules == {(d, t, RULES[d, t]) for d, tasks in expected.items() for t in tasks}

        # How pollbridge uses them: every task_instance row finds its edges by an equality join on
        # (dag_version_id, task_id), in both runs of every DAG.
        joined = conn.execute(
            "SELECT ti.dag_id, ti.run_id, ti.task_id, array_agg(e.upstream_task_id ORDER BY e.upstream_task_id), "
            "       min(r.trigger_rule) "
            "FROM task_instance ti "
            "JOIN pollbridge_airflow_rules r ON r.dag_version_id = ti.dag_version_id AND r.task_id = ti.task_id "
            "LEFT JOIN pollbridge_airflow_edges e ON e.dag_version_id = ti.dag_version_id AND e.task_id = ti.task_id "
            "GROUP BY 1, 2, 3").fetchall()
        assert {(str(d), str(run), str(t)): ({str(u) for u in ups if u is not None}, str(rule))
                for d, run, t, ups, rule in joined} == {
            (d, run, t): (ups, RULES[d, t]) for d, tasks in UPSTREAMS.items() for run in RUN_IDS
            for t, ups in tasks.items()}

        assert conn.execute(blocks["check"].encode()).fetchone() is None  # no problem row


def test_views_uninstall_cleanly_and_reinstall(rig: AirflowRig) -> None:
    blocks = load_sql_blocks()
    with rig.connect() as conn:
        conn.execute(blocks["install"].encode())
        for _ in range(2):  # idempotent: DROP VIEW IF EXISTS
            conn.execute(blocks["uninstall"].encode())
        assert conn.execute("SELECT count(*) FROM information_schema.views "
                            "WHERE table_name LIKE 'pollbridge%'").fetchone() == (0,)
    rig.install_views()


def test_airflow_readiness_latency(rig: AirflowRig, capsys: pytest.CaptureFixture[str]) -> None:
    """Airflow's own upstream end_date -> downstream scheduled_dttm, reported (and sanity-checked, not gated)."""
    rig.install_views()
    latencies = [latency.seconds for latency in rig.readiness_latencies()]
    # Every dispatched task with an upstream task, in each run: all but the roots and the skipped branch side.
    downstream = sum(1 for d, tasks in UPSTREAMS.items() for t, ups in tasks.items() if ups and (d, t) in TRIED)
    assert len(latencies) == downstream * len(RUN_IDS)
    assert all(seconds > 0 for seconds in latencies)  # never scheduled before its upstream ended
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    assert p50 is not None and p99 is not None
    with capsys.disabled():
        print(f"\nairflow readiness latency over {len(latencies)} tasks: p50 {p50 * 1000:.0f} ms, "
              f"p99 {p99 * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
        _print_timings(rig)


def test_a_rig_that_never_started_stops_cleanly(tmp_path: Path) -> None:
    """What a fixture's teardown does after a failure before anything was created: nothing to end, no error."""
    rig = AirflowRig(PG_ADMIN_URL, venv=tmp_path / "no-venv", home=tmp_path)
    rig.stop()
    assert rig.pids() == []
