"""Trigger rules, status lists with NULL and composite keys: the readiness SQL against a Python oracle.

Two table shapes, on SQLite and PostgreSQL:

* an Airflow-shaped table (``task_instance``-like): the instance key is ``(dag, run)``, the task key
  ``(task, map_index)``, a waiting task has status NULL, several stored values per logical status, and
  the dependencies with their trigger rules live in an edges table per DAG version (``keys`` mode);
* the reference table with its optional ``trigger_rule`` column (``json`` mode).

The oracle is Airflow's meaning of each rule; a task without dependencies is ready whatever its rule;
a dependency key that names no row is never done.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from bridge.core.mapping import TRIGGER_RULES, TaskTableMapping
from bridge.tasktable.readiness import ready_predicate
from bridge.tasktable.tables import reflect_tables

#: Stored states of the Airflow-shaped table and the logical status each means.
AIRFLOW_STATES: dict[str | None, str] = {
    None: "pending", "up_for_retry": "pending", "scheduled": "dispatched", "queued": "dispatched",
    "running": "running", "success": "completed", "failed": "failed", "upstream_failed": "failed",
    "skipped": "skipped", "removed": "other",
}
AIRFLOW_MAPPING = {
    "table": "pb_rule_ti",
    "columns": {"id": "id", "instance_id": ["dag", "run"], "task_key": ["task", "map_index"], "status": "state",
                "workflow_type": "dag", "completed_at": "end_date", "depends_on": "", "due_at": "",
                "awaits_signal": "", "signal_received_at": "", "dispatched_at": "", "updated_at": "",
                "attempts": "", "max_attempts": ""},
    "statuses": {"null": "pending", "pending": ["up_for_retry"], "dispatched": ["scheduled", "queued"],
                 "running": "running", "completed": "success", "failed": ["failed", "upstream_failed"],
                 "skipped": "skipped", "other": ["removed"], "review": ""},
    "dependencies": {"mode": "keys", "table": "pb_rule_edges", "task_key": "task", "depends_on_key": "upstream",
                     "key_column": "task", "match": ["dag_version"], "rule": "rule"},
    "instances": False,
}


def oracle_ready(status: str, rule: str, deps: list[str | None]) -> bool:
    """Airflow's readiness of a pending task whose dependency rows have logical statuses ``deps``
    (``None`` = a dependency naming no row)."""
    if status != "pending":
        return False
    if not deps:
        return True
    n = len(deps)
    ok = deps.count("completed")
    failed = deps.count("failed")
    skipped = deps.count("skipped")
    done = ok + failed + skipped
    return {
        "all_success": ok == n, "all_done": done == n, "all_failed": failed == n, "all_skipped": skipped == n,
        "one_success": ok >= 1, "one_failed": failed >= 1, "one_done": ok + failed >= 1,
        "none_failed": done == n and failed == 0, "none_failed_min_one_success": done == n and failed == 0 and ok >= 1,
        "none_skipped": done == n and skipped == 0, "always": True,
    }.get(rule, False)


@pytest.fixture
def airflow_shaped(empty_db_url: str) -> Iterator[Engine]:
    from bridge.db.engine import create_engine

    engine = create_engine(empty_db_url)
    metadata = sa.MetaData()
    sa.Table("pb_rule_ti", metadata,
             sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
             sa.Column("dag", sa.Text, nullable=False), sa.Column("run", sa.Text, nullable=False),
             sa.Column("task", sa.Text, nullable=False), sa.Column("map_index", sa.Integer, nullable=False),
             sa.Column("state", sa.Text, nullable=True), sa.Column("dag_version", sa.Text, nullable=False),
             sa.Column("end_date", sa.DateTime(timezone=True), nullable=True),
             sa.UniqueConstraint("dag", "task", "run", "map_index"))
    sa.Table("pb_rule_edges", metadata,
             sa.Column("dag_version", sa.Text, nullable=False), sa.Column("task", sa.Text, nullable=False),
             sa.Column("upstream", sa.Text, nullable=False), sa.Column("rule", sa.Text, nullable=True))
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@st.composite
def dags(draw: st.DrawFn) -> dict[str, Any]:
    """A DAG of up to 7 tasks (some mapped into 2 rows), each with a rule, and the states of two runs."""
    n = draw(st.integers(1, 7))
    tasks = []
    for i in range(n):
        deps = sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else []
        upstream = [f"t{d}" for d in deps]
        if i and draw(st.integers(0, 9)) == 0:
            upstream.append("missing")  # an edge to a task that has no row
        tasks.append({"task": f"t{i}", "upstream": upstream, "mapped": draw(st.booleans()) and i % 3 == 1,
                      "rule": draw(st.sampled_from([*TRIGGER_RULES, None, "not_a_rule"]))})
    runs = []
    for _ in range(2):
        runs.append([[draw(st.sampled_from(list(AIRFLOW_STATES))) for _ in range(2)] for _ in range(n)])
    return {"tasks": tasks, "runs": runs}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=dags())
def test_airflow_shaped_readiness_matches_the_oracle(airflow_shaped: Engine, spec: dict[str, Any]) -> None:
    engine = airflow_shaped
    tt = reflect_tables(engine, TaskTableMapping.from_dict(AIRFLOW_MAPPING))
    version = uuid.uuid4().hex[:8]
    dag = f"d_{version}"
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM pb_rule_ti"))
        conn.execute(sa.text("DELETE FROM pb_rule_edges"))
        edges = [{"dag_version": version, "task": t["task"], "upstream": u, "rule": t["rule"]}
                 for t in spec["tasks"] for u in t["upstream"]]
        # A second DAG version with the opposite edges: the match on dag_version must keep it out.
        edges += [{"dag_version": "other", "task": u, "upstream": t["task"], "rule": "always"}
                  for t in spec["tasks"] for u in t["upstream"]]
        if edges:
            conn.execute(sa.text("INSERT INTO pb_rule_edges VALUES (:dag_version, :task, :upstream, :rule)"), edges)
        rows = []
        next_id = 1
        # Two runs of the same DAG, and the same run id in another DAG (all its tasks succeeded): the
        # composite instance key must keep every run apart.
        for run_no, states in enumerate(spec["runs"]):
            for t, pair in zip(spec["tasks"], states, strict=True):
                for map_index in ((0, 1) if t["mapped"] else (-1,)):
                    rows.append({"id": next_id, "dag": dag, "run": f"manual__{run_no}", "task": t["task"],
                                 "map_index": map_index, "state": pair[max(map_index, 0)],
                                 "dag_version": version})
                    next_id += 1
        for t in spec["tasks"]:
            rows.append({"id": next_id, "dag": f"x_{version}", "run": "manual__0", "task": t["task"],
                         "map_index": -1, "state": "success", "dag_version": "other"})
            next_id += 1
        conn.execute(sa.text("INSERT INTO pb_rule_ti (id, dag, run, task, map_index, state, dag_version) "
                             "VALUES (:id, :dag, :run, :task, :map_index, :state, :dag_version)"), rows)
        got = set(conn.execute(sa.select(tt.col("id")).where(ready_predicate(tt, tt.tasks))).scalars())
    by_task = {t["task"]: t for t in spec["tasks"]}
    expected = set()
    for row in rows:
        if row["dag"] != dag:
            continue  # the other DAG's edges (dag_version "other") name tasks in reverse; its rows all succeeded
        t = by_task[row["task"]]
        deps: list[str | None] = []
        for u in t["upstream"]:
            matches = [r for r in rows if r["dag"] == dag and r["run"] == row["run"] and r["task"] == u]
            deps.extend(AIRFLOW_STATES[r["state"]] for r in matches) if matches else deps.append(None)
        rule = t["rule"] if t["rule"] is not None else "all_success"
        if oracle_ready(AIRFLOW_STATES[row["state"]], rule, deps):
            expected.add(row["id"])
    other_dag_ready = {r["id"] for r in rows if r["dag"] != dag} & got
    assert not other_dag_ready, "a succeeded task of another DAG was found ready"
    assert got == expected


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=dags())
def test_reference_table_rule_column_matches_the_oracle(engine: Engine, spec: dict[str, Any]) -> None:
    """The reference schema's optional ``trigger_rule`` column with ``json`` dependencies."""
    mapping = TaskTableMapping.from_dict({"columns": {"trigger_rule": "trigger_rule"},
                                          "statuses": {"skipped": "skipped"}})
    tt = reflect_tables(engine, mapping)
    logical = {"pending": "pending", "queued": "dispatched", "running": "running", "completed": "completed",
               "failed": "failed", "skipped": "skipped"}
    instance = f"r-{uuid.uuid4().hex[:10]}"
    states = [pair[0] for pair in spec["runs"][0]]
    stored = {None: "pending", "up_for_retry": "pending", "scheduled": "queued", "queued": "queued",
              "running": "running", "success": "completed", "failed": "failed", "upstream_failed": "failed",
              "skipped": "skipped", "removed": "pending"}
    with engine.begin() as conn:
        rows = [{"instance_id": instance, "task_key": t["task"], "status": stored[s], "depends_on": t["upstream"],
                 "trigger_rule": t["rule"], "workflow_type": "wf"} for t, s in zip(spec["tasks"], states, strict=True)]
        conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES (:i, 'wf')"), {"i": instance})
        conn.execute(tt.tasks.insert(), [{k: v for k, v in r.items() if k != "workflow_type"} for r in rows])
        got = set(conn.execute(sa.select(tt.col("task_key")).where(
            tt.col("instance_id") == instance, ready_predicate(tt, tt.tasks))).scalars())
    status_of = {r["task_key"]: logical[r["status"]] for r in rows}
    expected = set()
    for r in rows:
        deps: list[str | None] = [status_of.get(u) for u in r["depends_on"]]
        if oracle_ready(status_of[r["task_key"]], r["trigger_rule"] or "all_success", deps):
            expected.add(r["task_key"])
    assert got == expected


def test_null_status_is_pending_only_where_the_mapping_says_so(airflow_shaped: Engine) -> None:
    """A NULL state is pending with ``null = "pending"``; without it a NULL row is never ready."""
    with airflow_shaped.begin() as conn:
        conn.execute(sa.text("INSERT INTO pb_rule_ti (id, dag, run, task, map_index, state, dag_version) "
                             "VALUES (1, 'd', 'r', 'a', -1, NULL, 'v')"))
    with_null = reflect_tables(airflow_shaped, TaskTableMapping.from_dict(AIRFLOW_MAPPING))
    raw = {**AIRFLOW_MAPPING, "statuses": {**AIRFLOW_MAPPING["statuses"], "null": ""}}  # type: ignore[dict-item]
    without = reflect_tables(airflow_shaped, TaskTableMapping.from_dict(raw))
    with airflow_shaped.connect() as conn:
        assert conn.execute(sa.select(with_null.col("id")).where(ready_predicate(with_null, with_null.tasks))).all()
        assert not conn.execute(sa.select(without.col("id")).where(ready_predicate(without, without.tasks))).all()
