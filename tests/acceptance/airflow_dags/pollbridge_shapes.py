"""The DAG shapes pollbridge shadows in the real-Airflow acceptance test (an Airflow DAGs folder, not tests).

Every task is a real Python task (TaskFlow ``@task``), never an ``EmptyOperator``: Airflow marks an
EmptyOperator successful without sending it to the executor, and pollbridge must see every task dispatched.
Each task returns at once (returning ``None`` pushes no XCom), so a run costs Airflow's own overhead only.
All DAGs are manual (``schedule=None``) and are run by the harness with the same run ids.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import dag, get_current_context, task

# A fixed start date in the past: some Airflow code paths still read it, and "now" would change the
# serialized DAG (and its dag_version) every time the file is parsed.
_START = datetime(2024, 1, 1)
_COMMON: dict[str, Any] = {"schedule": None, "catchup": False, "start_date": _START, "tags": ["pollbridge"]}


@task
def step() -> None:
    """A task that does nothing: the shapes only test dispatch."""


@dag(dag_id="pb_chain", **_COMMON)
def pb_chain() -> None:
    a, b, c, d = (step.override(task_id=name)() for name in "abcd")
    a >> b >> c >> d


@dag(dag_id="pb_diamond", **_COMMON)
def pb_diamond() -> None:
    a, b, c, d = (step.override(task_id=name)() for name in "abcd")
    a >> [b, c]
    [b, c] >> d


@dag(dag_id="pb_fan", **_COMMON)
def pb_fan() -> None:
    a = step.override(task_id="a")()
    z = step.override(task_id="z")()
    parallel = [step.override(task_id=f"p{i}")() for i in range(1, 7)]
    a >> parallel
    parallel >> z


@task.branch(task_id="choose")
def choose() -> str:
    # Always the left side: the right side is skipped in every run, which is the point of this DAG.
    return "left"


@dag(dag_id="pb_branch", **_COMMON)
def pb_branch() -> None:
    left = step.override(task_id="left")()
    right = step.override(task_id="right")()
    join = step.override(task_id="join", trigger_rule="none_failed_min_one_success")()
    choose() >> [left, right]
    [left, right] >> join


@task(task_id="flaky", retries=1, retry_delay=timedelta(seconds=1))
def flaky() -> None:
    # try_number is 1 on the first try: fail it once, so every run has a retry (and a task_instance_history row).
    if get_current_context()["ti"].try_number <= 1:
        raise RuntimeError("pollbridge: the first try fails on purpose")


@dag(dag_id="pb_retry", **_COMMON)
def pb_retry() -> None:
    flaky() >> step.override(task_id="after")()


pb_chain()
pb_diamond()
pb_fan()
pb_branch()
pb_retry()
