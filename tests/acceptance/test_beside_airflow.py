"""pollbridge beside a scheduler we did not write: a real Apache Airflow 3.3, shadowed in ``dual_write``.

Airflow (PostgreSQL, LocalExecutor, its api-server, dag-processor and scheduler) runs as a legacy role that owns
its database and has no grant on anything of pollbridge's. pollbridge is installed from the shipped
``integrations/airflow/pollbridge.toml`` alone (``init``, ``relay run``, ``scheduler run``, ``flags set DAG
dual_write``) by the admin role, and the DAG shapes of tests/acceptance/airflow_dags run under the same run ids in
every DAG, paced and in a burst. Asserted against Airflow's own tables:

* every task-instance try Airflow dispatched is a legacy dispatch pollbridge recorded (no more, no less);
* at least 95% of them are matched by a shadow decision (joins after a skipped branch and second tries
  included); none early; none duplicated;
* pollbridge wrote nothing to Airflow's ``task_instance`` (a row trigger records the role of every write);
* Airflow's components are still running, under their role, without an extra grant.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.airflow import SHAPE_DAGS, AirflowRig, AirflowUnavailable, airflow_venv

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "integrations" / "airflow" / "pollbridge.toml"
PG_ADMIN_URL = os.environ.get("POLLBRIDGE_TEST_PG_URL", "postgresql://root@127.0.0.1:5432/postgres")
REQUIRE_SERVICES = os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1"

#: Who writes task_instance, recorded by a test-only row trigger (not a pollbridge_ object: uninstall must not
#: be what removes it, and capture must not mistake it for its own).
AUDIT_SQL = """
CREATE TABLE pbtest_writers (seq bigserial PRIMARY KEY, who text NOT NULL, op text NOT NULL);
CREATE FUNCTION pbtest_writer() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = public AS $b$
BEGIN
  INSERT INTO pbtest_writers (who, op) VALUES (session_user, TG_OP);
  RETURN NULL;
END
$b$;
CREATE TRIGGER pbtest_writer AFTER INSERT OR UPDATE OR DELETE ON task_instance
  FOR EACH STATEMENT EXECUTE FUNCTION pbtest_writer();
"""


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowRig]:
    try:
        venv = airflow_venv()
        started = AirflowRig(PG_ADMIN_URL, venv=venv).start()
    except AirflowUnavailable as exc:
        if REQUIRE_SERVICES:
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))
    try:
        yield started
    finally:
        started.stop()


class Pollbridge:
    """The installed CLI with the shipped Airflow configuration, against the rig's database as the admin role."""

    def __init__(self, rig: AirflowRig, folder: Path) -> None:
        exe = shutil.which("pollbridge")
        if exe is None:
            pytest.fail("the `pollbridge` console script is not installed: run `pip install .` first", pytrace=False)
        self.exe = exe
        self.folder = folder
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
        self.env.update(POLLBRIDGE_CONFIG=str(CONFIG), POLLBRIDGE_DATABASE_URL=rig.superuser_url)
        self.processes: list[subprocess.Popen[bytes]] = []

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.exe, *args], cwd=self.folder, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def ok(self, *args: str) -> str:
        done = self.run(*args)
        assert done.returncode == 0, (f"pollbridge {' '.join(args)} exited {done.returncode}:\n"
                                      f"{done.stdout}{done.stderr}")
        return done.stdout

    def start(self, *args: str) -> None:
        log = open(self.folder / f"{'-'.join(args)}.log", "wb")  # noqa: SIM115 - closed with the process
        self.processes.append(subprocess.Popen([self.exe, *args], cwd=self.folder, env=self.env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))

    def alive(self) -> None:
        for p in self.processes:
            assert p.poll() is None, f"{p.args} exited {p.returncode}: " + _tail(self.folder)

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _tail(folder: Path) -> str:
    return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                     for log in sorted(folder.glob("*.log")))


def _wait(condition: Any, deadline: float, what: str) -> None:
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline:.0f} s waiting for {what}")
        time.sleep(0.2)


def _scalar(url: str, sql: str) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
        return None if row is None else row[0]


def test_pollbridge_shadows_airflow_from_the_shipped_config(rig: AirflowRig, tmp_path: Path) -> None:
    rig.wait_serialized(SHAPE_DAGS)
    with psycopg.connect(rig.superuser_url, autocommit=True) as conn:
        conn.execute(AUDIT_SQL.encode())
    pb = Pollbridge(rig, tmp_path)
    try:
        pb.ok("init")
        doctor = pb.run("doctor")
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        pb.start("relay", "run")
        pb.start("scheduler", "run")
        # History first, as on any running Airflow: one run of every DAG while pollbridge is in `polling`.
        for dag_id in SHAPE_DAGS:
            rig.trigger(dag_id, "manual__pb_warm")
        rig.wait_finished(deadline=180)
        flipped = datetime.now(UTC)
        for dag_id in SHAPE_DAGS:
            pb.ok("flags", "set", dag_id, "dual_write", "--reason", "shadow Airflow")
        time.sleep(1.5)  # the router's refresh interval (1 s): every process follows the flags
        # Paced: one wave of runs at a time, the same run id in every DAG.
        for wave in range(3):
            for dag_id in SHAPE_DAGS:
                rig.trigger(dag_id, f"manual__pb_{wave}")
            rig.wait_finished(deadline=180)
        # A burst: two run ids in every DAG at once.
        for run_id in ("manual__pb_burst_1", "manual__pb_burst_2"):
            for dag_id in SHAPE_DAGS:
                rig.trigger(dag_id, run_id)
        rig.wait_finished(deadline=240)
        pb.alive()

        airflow = {(d.dag_id, d.run_id, d.task_id, d.map_index, d.try_number) for d in rig.dispatches()
                   if d.scheduled_dttm is not None and d.scheduled_dttm >= flipped}
        assert airflow, "Airflow dispatched nothing after the flip"

        def recorded() -> set[tuple[str, str, str, int, int]]:
            with psycopg.connect(rig.superuser_url, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT instance_id, task_key, attempt FROM pollbridge_dispatch_log WHERE path = 'poller' "
                    "AND dispatched_at >= %s", (flipped,)).fetchall()
            out = set()
            for instance_id, task_key, attempt in rows:
                dag_id, run_id = instance_id.split("/", 1)
                task_id, map_index = task_key.rsplit("/", 1)
                out.add((dag_id, run_id, task_id, int(map_index), int(attempt)))
            return out

        _wait(lambda: recorded() >= airflow, 60, "pollbridge to record Airflow's dispatches")
        legacy = recorded()
        assert legacy == airflow, (f"not recorded: {sorted(airflow - legacy)[:5]}; "
                                   f"recorded but not Airflow's: {sorted(legacy - airflow)[:5]}")
        with psycopg.connect(rig.superuser_url, autocommit=True) as conn:
            duplicates = conn.execute(
                "SELECT count(*) FROM (SELECT 1 FROM pollbridge_dispatch_log WHERE path = 'poller' "
                "GROUP BY instance_id, task_key, attempt HAVING count(*) > 1) d").fetchone()
        assert duplicates == (0,)

        def report() -> dict[str, Any]:
            done = pb.run("reconcile", "--format", "json", "--since", flipped.isoformat())
            assert done.returncode in (0, 1), done.stdout + done.stderr
            parsed: dict[str, Any] = json.loads(done.stdout)
            return parsed

        def matched_share(r: dict[str, Any]) -> float:
            types = r["types"]
            matched = sum(t["matched"] + t["late"] for t in types)
            return matched / len(airflow)

        _wait(lambda: matched_share(report()) >= 0.95, 60, "shadow decisions for 95% of Airflow's dispatches")
        final = report()
        by_type = {t["workflow_type"]: t for t in final["types"]}
        assert set(by_type) >= set(SHAPE_DAGS)
        for dag_id in SHAPE_DAGS:
            t = by_type[dag_id]
            assert t["early"] == 0, t
            assert t["duplicate"] == 0, t
        # Joins after a skipped branch and second tries were decided too.
        with psycopg.connect(rig.superuser_url, autocommit=True) as conn:
            decided = {(r[0], r[1], r[2]) for r in conn.execute(
                "SELECT instance_id, task_key, attempt FROM pollbridge_decisions WHERE decided_at >= %s",
                (flipped,)).fetchall()}
        joins = {k for k in decided if k[0].startswith("pb_branch/") and k[1] == "join/-1"}
        second_tries = {k for k in decided if k[0].startswith("pb_retry/") and k[1] == "flaky/-1" and k[2] == 2}
        assert len(joins) == 5, sorted(decided)[:20]
        assert len(second_tries) == 5, sorted(k for k in decided if k[0].startswith("pb_retry/"))

        # pollbridge wrote nothing to Airflow's table: every write was Airflow's own role.
        with psycopg.connect(rig.superuser_url, autocommit=True) as conn:
            writers = {r[0] for r in conn.execute("SELECT DISTINCT who FROM pbtest_writers").fetchall()}
        assert writers == {rig.role}, writers
        rig.check_alive()
        # Airflow's role got no grant on anything of pollbridge's: the capture function runs with its owner's rights.
        grants = _scalar(rig.superuser_url,
                         f"SELECT count(*) FROM information_schema.role_table_grants WHERE grantee = '{rig.role}' "
                         "AND table_name LIKE 'pollbridge%'")
        assert grants == 0
    except BaseException:
        print(_tail(tmp_path))
        raise
    finally:
        pb.stop()
    done = pb.run("uninstall", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    views = _scalar(rig.superuser_url, "SELECT count(*) FROM pg_views WHERE viewname LIKE 'pollbridge%'")
    assert views == 0
