"""doctor: each check passes on a good installation and names the problem on a bad one."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.app.components import Components
from bridge.core.mapping import TaskColumns, TaskTableMapping
from bridge.core.settings import Settings
from bridge.db import migrate
from bridge.db.engine import create_engine
from bridge.rollout.checks import CheckResult
from bridge.rollout.doctor import to_json


def run_checks(engine: Engine, settings: Settings) -> list[CheckResult]:
    return Components(settings).doctor(engine)


def _by_name(engine: Engine, settings: Settings) -> dict[str, tuple[bool, str]]:
    return {c.name: (c.passed, c.detail) for c in run_checks(engine, settings)}


def test_all_checks_pass_on_a_fresh_installation(engine: Engine) -> None:
    checks = _by_name(engine, Settings())
    assert set(checks) == {"database", "mapping", "migrations", "capture", "dags", "bus"}
    assert all(ok for ok, _ in checks.values()), checks


def test_missing_column_is_named_with_its_table(engine: Engine) -> None:
    settings = Settings(mapping=TaskTableMapping(columns=TaskColumns(due_at="run_after")))
    ok, detail = _by_name(engine, settings)["mapping"]
    assert not ok
    assert "'run_after'" in detail and "'tasks'" in detail


def test_missing_table_is_named(engine: Engine) -> None:
    ok, detail = _by_name(engine, Settings(mapping=TaskTableMapping(table="jobs")))["mapping"]
    assert not ok and "'jobs'" in detail


def test_migrations_not_installed(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        ok, detail = _by_name(engine, Settings())["migrations"]
        assert not ok and "pollbridge init" in detail
    finally:
        engine.dispose()


def test_cycle_and_unknown_dependency_are_reported(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('c', 'w'), ('u', 'w')"))
        conn.execute(sa.text(
            """INSERT INTO tasks (instance_id, task_key, depends_on) VALUES
               ('c', 'x', '["z"]'), ('c', 'y', '["x"]'), ('c', 'z', '["y"]'),
               ('u', 'a', '["ghost"]')"""))
    ok, detail = _by_name(engine, Settings())["dags"]
    assert not ok
    assert "cycle" in detail and "'c'" in detail
    assert "'ghost'" in detail


def test_unreachable_database_masks_password() -> None:
    engine = create_engine("postgresql://admin:s3cr3tpw@127.0.0.1:1/nodb")
    try:
        checks = run_checks(engine, Settings())
    finally:
        engine.dispose()
    assert [c.name for c in checks] == ["database"]
    assert not checks[0].passed
    assert "s3cr3tpw" not in checks[0].detail and "***" in checks[0].detail


def test_head_revision_matches_installed(engine: Engine) -> None:
    assert migrate.current_revision(engine) == migrate.head_revision()


def test_capture_missing_and_bus_unreachable_are_reported(engine: Engine) -> None:
    from bridge.capture import triggers as capture

    with engine.begin() as conn:
        capture.remove_capture(conn)
    settings = Settings(bus_url="redis://:topsecret@127.0.0.1:1/0")
    checks = _by_name(engine, settings)
    ok, detail = checks["capture"]
    assert not ok and "pollbridge init" in detail
    ok, detail = checks["bus"]
    assert not ok and "topsecret" not in detail and "127.0.0.1:1" in detail


def test_a_check_without_its_prerequisite_is_left_out(engine: Engine) -> None:
    """A mapping that does not match hides the checks that need it, not the migrations or the bus."""
    checks = _by_name(engine, Settings(mapping=TaskTableMapping(table="jobs")))
    assert list(checks) == ["database", "mapping", "migrations", "bus"]
    assert checks["migrations"][0] and checks["bus"][0]


def test_json_keeps_doctor_keys(engine: Engine) -> None:
    doc = to_json(run_checks(engine, Settings()))
    assert doc["ok"] is True
    assert [set(c) for c in doc["checks"]] == [{"name", "ok", "detail"}] * 6
    assert [c["name"] for c in doc["checks"]] == ["database", "mapping", "migrations", "capture", "dags", "bus"]


def test_an_outdated_capture_is_reported_with_what_to_run(engine: Engine) -> None:
    """The installed capture is not what the mapping generates (installed by an older pollbridge, or for another
    mapping): doctor says so in one line naming `pollbridge init`, and `init` makes it current again."""
    from bridge.app import install
    from bridge.capture.triggers import install_capture
    from bridge.tasktable.tables import reflect_tables

    other = TaskTableMapping(columns=TaskColumns(due_at=None))
    with engine.begin() as conn:
        install_capture(conn, reflect_tables(conn, other))
    ok, detail = _by_name(engine, Settings())["capture"]
    assert not ok and "outdated" in detail and "`pollbridge init`" in detail and "\n" not in detail
    install.init(engine, mapping=TaskTableMapping())
    ok, detail = _by_name(engine, Settings())["capture"]
    assert ok and "current" in detail, detail


def test_capture_installed_with_other_capture_settings_is_outdated(engine: Engine) -> None:
    from bridge.core.settings import CaptureSettings

    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite's capture does not depend on the [capture] settings (no NOTIFY, one relay partition)")
    for capture in (CaptureSettings(wake="notify"), CaptureSettings(relay_partitions=2)):
        ok, detail = _by_name(engine, Settings(capture=capture))["capture"]
        assert not ok and "outdated" in detail and "`pollbridge init`" in detail


def test_capture_stays_current_after_the_scheduler_retypes_its_status_column(engine: Engine) -> None:
    """The scheduler's own migrations may retype its columns (Airflow's retype `state`): nothing in the capture
    stops them, and the capture needs nothing afterwards."""
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite has no ALTER COLUMN ... TYPE")
    for new_type in ("varchar(300)", "text"):
        with engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE tasks ALTER COLUMN status TYPE {new_type}")
        checks = _by_name(engine, Settings())
        assert all(ok for ok, _ in checks.values()), checks
        assert "current" in checks["capture"][1]


def test_a_disabled_capture_trigger_is_reported(engine: Engine) -> None:
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite cannot disable a trigger")
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE tasks DISABLE TRIGGER pollbridge_capture_update")
    ok, detail = _by_name(engine, Settings())["capture"]
    assert not ok and "disabled" in detail and "pollbridge_capture_update" in detail and "pollbridge init" in detail


def test_a_view_as_the_capture_target_is_refused_naming_its_base_table(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE VIEW tasks_fixed AS SELECT * FROM tasks")
    ok, detail = _by_name(engine, Settings(mapping=TaskTableMapping(table="tasks_fixed")))["capture"]
    assert not ok
    assert detail == ("mapping.table 'tasks_fixed' is a view: capture needs the base table; set mapping.table to "
                      "the base table 'tasks' and mapping.read_table to the view 'tasks_fixed'")
    # as the message says: reads through the view, capture on the base table
    checks = _by_name(engine, Settings(mapping=TaskTableMapping(table="tasks", read_table="tasks_fixed")))
    assert all(ok for ok, _ in checks.values()), checks
