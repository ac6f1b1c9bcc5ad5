"""doctor: each check passes on a good installation and names the problem on a bad one."""

from __future__ import annotations

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
