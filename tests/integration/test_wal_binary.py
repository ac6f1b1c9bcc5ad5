"""The write-ahead-log capture's binary tuples (pgoutput ``binary``): the server's send functions cost the
walsender less than the text output functions of every column of every change (docs/capture.md), so the stream
asks for them whenever each column capture reads as text is of a type whose binary form it reads
(:data:`bridge.capture.pgoutput.BINARY_TEXT`), and for text tuples otherwise.

Checked here against a real server: each binary reader gives exactly PostgreSQL's text output of the value; a
table shaped like Airflow 3's ``task_instance`` (a uuid id, an enum status, a domain attempt count, columns of
other types that are only compared) is captured from binary tuples with the same text as from text ones; a
text-read column of another type makes the stream text; and a column whose type changes while the stream runs
(the log decoded under the old catalog) ends the stream, which comes back in text and loses nothing.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.app import install
from bridge.bus import open_bus
from bridge.bus.base import EventBus
from bridge.capture.pgoutput import BINARY_TEXT, Change, decode
from bridge.capture.queries import TEXT_COLUMN_TYPES_SQL
from bridge.capture.wal import WalCapture
from bridge.core.mapping import StatusValues, TaskColumns, TaskTableMapping
from bridge.core.settings import CaptureSettings
from bridge.db.engine import create_engine
from bridge.db.schema import outbox
from bridge.tasktable.tables import TaskTable, reflect_tables
from tests.support import wait_for
from tests.support.wal import wal_available

pytestmark = pytest.mark.postgres

#: Each reader, the SQL type of its values and a strategy for them (text as PostgreSQL stores it: no NUL).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
CASES: dict[str, tuple[str, Any]] = {
    "int2send": ("smallint", st.integers(-(2**15), 2**15 - 1)),
    "int4send": ("integer", st.integers(-(2**31), 2**31 - 1)),
    "int8send": ("bigint", st.integers(-(2**63), 2**63 - 1)),
    "oidsend": ("oid", st.integers(0, 2**32 - 1)),
    "uuid_send": ("uuid", st.uuids().map(str)),
    "boolsend": ("boolean", st.booleans()),
    "textsend": ("text", _TEXT),
    "varcharsend": ("varchar", _TEXT),
    "bpcharsend": ("char(12)", _TEXT.map(lambda s: s[:12])),
    "namesend": ("name", st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)),
    "enum_send": ("pb_test_mood", st.sampled_from(["sad", "ok", "happy ünï"])),
}


@pytest.fixture
def pg_engine(pg_empty_url: str) -> Iterator[sa.Engine]:
    engine = create_engine(pg_empty_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TYPE pb_test_mood AS ENUM ('sad', 'ok', 'happy ünï')")
    yield engine
    engine.dispose()


def test_every_binary_reader_has_a_case() -> None:
    assert set(CASES) == set(BINARY_TEXT)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_each_binary_reader_gives_postgresqls_text_output(pg_engine: sa.Engine, data: st.DataObject) -> None:
    send = data.draw(st.sampled_from(sorted(CASES)))
    sql_type, values = CASES[send]
    value = data.draw(values)
    with pg_engine.connect() as conn:
        # format's %s is the type's output function, what a text tuple carries (a cast to text may differ:
        # a boolean's is 'false', its output 'f').
        text, raw = conn.execute(sa.text(f"SELECT format('%s', CAST(:v AS {sql_type})), "
                                         f"{send}(CAST(:v AS {sql_type}))"), {"v": str(value)}).one()
    assert BINARY_TEXT[send](bytes(raw)) == text


def test_the_catalog_query_follows_domains_and_names_the_send_functions(pg_engine: sa.Engine) -> None:
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("CREATE DOMAIN pb_test_count AS bigint CHECK (VALUE >= 0)")
        conn.exec_driver_sql("CREATE DOMAIN pb_test_count2 AS pb_test_count")
        conn.exec_driver_sql('CREATE TABLE "T t" (a pb_test_count2, b pb_test_mood, c timestamptz, d "char", '
                             "e varchar(5))")
        found = {c: send for _, c, _, send in conn.execute(sa.text(TEXT_COLUMN_TYPES_SQL), {
            "tables": ['"T t"'] * 6, "columns": ["a", "b", "c", "d", "e", "nope"]})}
    assert found == {"a": "int8send", "b": "enum_send", "c": "timestamptz_send", "d": "charsend",
                     "e": "varcharsend", "nope": None}


# --- capture from binary tuples ------------------------------------------------------------------------

STATUSES = StatusValues(pending=["up_for_retry"], null="pending", dispatched="queued", running="running",
                        completed="success", failed="failed", skipped="skipped", other=["deferred"])


class AirflowLike:
    """A table shaped like Airflow 3's ``task_instance`` (uuid ids, a run is (dag_id, run_id), a task (task_id,
    map_index)), with the status an enum and the attempt count a domain, and columns capture never reads as text
    (a timestamp, JSON, bytes); WAL capture installed on it, streaming to the embedded bus."""

    def __init__(self, url: str, map_index_type: str = "integer") -> None:
        wal_available(url)
        self.engine = create_engine(url)
        with self.engine.begin() as conn:
            conn.exec_driver_sql("CREATE TYPE ti_state AS ENUM ('queued', 'running', 'success', 'failed', "
                                 "'skipped', 'up_for_retry', 'deferred')")
            conn.exec_driver_sql("CREATE DOMAIN ti_try AS bigint CHECK (VALUE >= 0)")
            conn.exec_driver_sql(
                "CREATE TABLE task_instance (id uuid PRIMARY KEY, dag_id varchar(250) NOT NULL, "
                f"run_id varchar(250) NOT NULL, task_id varchar(250) NOT NULL, map_index {map_index_type} NOT NULL "
                "DEFAULT -1, state ti_state, try_number ti_try NOT NULL DEFAULT 0, depends_on text NOT NULL DEFAULT "
                "'[]', queued_dttm timestamptz, executor_config bytea, rendered jsonb)")
        self.mapping = TaskTableMapping(
            table="task_instance", instances=None,
            columns=TaskColumns(instance_id=("dag_id", "run_id"), task_key=("task_id", "map_index"), status="state",
                                workflow_type="dag_id", attempts="try_number", due_at=None, awaits_signal=None,
                                signal_received_at=None, dispatched_at=None, completed_at=None, updated_at=None,
                                max_attempts=None),
            statuses=STATUSES)
        install.init(self.engine, mapping=self.mapping, capture=CaptureSettings(mode="wal"))
        self.tables: TaskTable = reflect_tables(self.engine, self.mapping)
        self.bus: EventBus = open_bus("embedded", engine=self.engine, partitions=1)

    def write(self, sql: str, **params: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(sql), params)

    def rows(self) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(outbox).order_by(outbox.c.id)).all())

    def close(self) -> None:
        install.uninstall(self.engine, self.mapping)
        self.bus.close()
        self.engine.dispose()


@pytest.fixture
def airflow_like(pg_empty_url: str) -> Iterator[AirflowLike]:
    t = AirflowLike(pg_empty_url)
    yield t
    t.close()


def _a_task_lives(t: AirflowLike, ti: str) -> None:
    t.write("INSERT INTO task_instance (id, dag_id, run_id, task_id, map_index, state, executor_config, rendered) "
            "VALUES (CAST(:id AS uuid), 'etl', 'manual__ü', 'load', 2, NULL, '\\x00ff', '{\"a\": 1}')", id=ti)
    t.write("UPDATE task_instance SET state = 'queued', try_number = 1, queued_dttm = now() WHERE id = :id", id=ti)
    # Only columns capture does not watch: nothing captured (compared in their binary form).
    t.write("UPDATE task_instance SET rendered = '{\"a\": 2}', executor_config = '\\x01' WHERE id = :id", id=ti)
    t.write("UPDATE task_instance SET state = 'success' WHERE id = :id", id=ti)


EXPECTED = [("insert", None, None, 0), ("status", None, "queued", 1), ("status", "queued", "success", 1)]


class Recording(WalCapture):
    """A WAL capture that keeps each change as the stream sent it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.changes: list[Change] = []

    def handle(self, payload: bytes) -> None:
        message = decode(payload)
        if isinstance(message, Change):
            self.changes.append(message)
        super().handle(payload)

    def kinds(self) -> set[type]:
        return {type(v) for c in self.changes for v in (c.new or ()) if v is not None}


def test_a_table_of_uuids_enums_and_domains_is_captured_from_binary_tuples(airflow_like: AirflowLike) -> None:
    ti = str(uuid.uuid4())
    _a_task_lives(airflow_like, ti)
    capture = Recording(airflow_like.engine, airflow_like.tables, airflow_like.bus)
    assert capture.catch_up() == 3
    assert capture.binary
    assert capture.kinds() == {bytes}  # the server did send binary tuples
    rows = airflow_like.rows()
    assert [(r.change, r.old_status, r.new_status, r.attempt) for r in rows] == EXPECTED
    with airflow_like.engine.connect() as conn:
        keys = conn.execute(sa.select(airflow_like.tables.key_text("instance_id"),
                                      airflow_like.tables.key_text("task_key"))).one()
    # The text the rest of pollbridge computes for the keys (TaskTable.key_text), and the uuid as PostgreSQL
    # prints it.
    assert {(r.task_id, r.instance_id, r.task_key, r.workflow_type) for r in rows} == {
        (ti, keys[0], keys[1], "etl")} == {(ti, "etl/manual__ü", "load/2", "etl")}


def test_a_text_read_column_of_another_type_makes_the_stream_text(pg_empty_url: str) -> None:
    t = AirflowLike(pg_empty_url, map_index_type="numeric")  # numeric's binary form is not read
    try:
        ti = str(uuid.uuid4())
        _a_task_lives(t, ti)
        capture = Recording(t.engine, t.tables, t.bus)
        assert capture.catch_up() == 3
        assert not capture.binary
        assert capture.kinds() == {str}
        rows = t.rows()
        assert [(r.change, r.old_status, r.new_status, r.attempt) for r in rows] == EXPECTED
        assert {(r.task_id, r.task_key) for r in rows} == {(ti, "load/2")}
    finally:
        t.close()


def test_a_column_type_changed_while_streaming_restarts_the_stream_in_text_and_loses_nothing(
        airflow_like: AirflowLike) -> None:
    capture = WalCapture(airflow_like.engine, airflow_like.tables, airflow_like.bus)
    stop = threading.Event()
    thread = threading.Thread(target=capture.run, args=(stop,), daemon=True)
    thread.start()
    try:
        first = str(uuid.uuid4())
        _a_task_lives(airflow_like, first)
        wait_for(lambda: len(airflow_like.rows()) == 3, 30.0, what="the first task's changes captured")
        assert capture.binary
        # The stream's relation for the changes after this carries numeric, which the catalog read when the stream
        # started did not give: the stream ends, and comes back in text from the confirmed position.
        airflow_like.write("ALTER TABLE task_instance ALTER COLUMN map_index TYPE numeric")
        second = str(uuid.uuid4())
        _a_task_lives(airflow_like, second)
        wait_for(lambda: len(airflow_like.rows()) >= 6, 60.0, what="the second task's changes captured")
        assert not capture.binary
    finally:
        stop.set()
        thread.join(20)
    rows = airflow_like.rows()
    assert [(r.task_id, r.change, r.new_status) for r in rows] == [
        (ti, change, new) for ti in (first, second) for change, _, new, _ in EXPECTED]
    assert len({r.event_id for r in rows}) == 6
