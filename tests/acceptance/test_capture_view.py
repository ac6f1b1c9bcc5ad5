"""A view as the capture target, through the real CLI: `init` and `doctor` refuse it in one line naming the
base table, `init` creates nothing, and the configuration the line asks for works."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import sqlalchemy as sa

from bridge.db.engine import create_engine
from bridge.reference.schema import create_demo_schema
from tests.support import Run

LINE = ("pollbridge: error: mapping.table 'tasks_fixed' is a view: capture needs the base table; set mapping.table "
        "to the base table 'tasks' and mapping.read_table to the view 'tasks_fixed'")


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


def _scheduler_tables_and_a_view(url: str) -> None:
    """The scheduler's tables, and a fix-up view over its task table (as a user would read it)."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            create_demo_schema(conn)
            conn.exec_driver_sql("CREATE VIEW tasks_fixed AS SELECT * FROM tasks WHERE task_key <> ''")
    finally:
        engine.dispose()


def _pollbridge_objects(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            names = [n for n in sa.inspect(conn).get_table_names() if n.startswith("pollbridge_")]
            if engine.dialect.name == "postgresql":
                names += list(conn.execute(sa.text(
                    "SELECT proname FROM pg_proc WHERE proname LIKE 'pollbridge%'")).scalars())
                names += list(conn.execute(sa.text(
                    "SELECT tgname FROM pg_trigger WHERE tgname LIKE 'pollbridge%'")).scalars())
            else:
                names += list(conn.execute(sa.text(
                    "SELECT name FROM sqlite_master WHERE name LIKE 'pollbridge%'")).scalars())
        return names
    finally:
        engine.dispose()


def test_init_and_doctor_refuse_a_view_in_one_line_and_init_creates_nothing(
        pollbridge: Run, empty_db_url: str, tmp_path: Path) -> None:
    _scheduler_tables_and_a_view(empty_db_url)
    (tmp_path / "pollbridge.toml").write_text('[mapping]\ntable = "tasks_fixed"\n')
    init = pollbridge("--database-url", empty_db_url, "init")
    _no_traceback(init)
    assert init.returncode == 1  # the database does not match the mapping (MappingMismatch), as for a missing table
    assert init.stderr.strip().splitlines() == [LINE]
    assert _pollbridge_objects(empty_db_url) == []

    doctor = pollbridge("--database-url", empty_db_url, "doctor", "--json")
    _no_traceback(doctor)
    assert doctor.returncode == 1
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["capture"]["ok"] is False
    assert checks["capture"]["detail"] == LINE.removeprefix("pollbridge: error: ")

    # what the line says to do: capture on the base table, reads through the view
    (tmp_path / "pollbridge.toml").write_text('[mapping]\ntable = "tasks"\nread_table = "tasks_fixed"\n')
    init = pollbridge("--database-url", empty_db_url, "init")
    assert init.returncode == 0, init.stderr
    assert "capture triggers installed on tasks" in init.stdout
    doctor = pollbridge("--database-url", empty_db_url, "doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "[ok] capture: capture triggers installed on 'tasks' and current" in doctor.stdout
