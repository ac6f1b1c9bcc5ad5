"""SQLite wake-ups without statements (bridge.db.changes): a commit to the database file wakes this process's
waiters, whoever made it; a quiet commit (a lease renewal) wakes no one; another process's commit is never
taken for a quiet one.

"Another process" is played by a plain ``sqlite3`` connection (not pollbridge's, so only the file watcher can
see its commits) and, for the bus, by a real subprocess.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from bridge.bus.embedded import EmbeddedBus
from bridge.db.changes import ChangeSignal, TopicView, add_topics, changes_of
from bridge.db.engine import about, create_engine, quiet
from tests.support import wait_for

#: Longer than any wake-up here: a waiter that returns before it was woken by a commit, not by its timeout.
LONG = 5.0


MARKS = sa.table("marks", sa.column("mark", sa.String))


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[Engine]:
    engine = create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE marks (mark TEXT)")
    yield engine
    engine.dispose()


def _signal(engine: Engine, *topics: str) -> TopicView:
    """The engine's signal for ``topics`` (``data`` by default) with its watcher running (a starting watcher wakes
    every waiter once: absorbed here, so a wake-up the tests see is a commit's)."""
    signal = changes_of(engine, *(topics or ("data",)))
    assert signal is not None
    signal.wait(signal.generation, 0.1)  # starts the watcher (and takes its wake-up) if it is not running
    return signal


def test_a_starting_watcher_wakes_the_waiters_once(engine: Engine) -> None:
    """Its baseline is taken after the waiter's last look: a commit between them would be seen by neither, so
    the waiter is woken to look again."""
    signal = changes_of(engine, "data")
    assert signal is not None
    seen = signal.generation
    assert signal.wait(seen, 2.0) == seen + 1
    assert signal.wait(seen + 1, 0.3) == seen + 1  # running: no more wake-ups without a commit


def test_a_wake_up_is_sure_only_when_a_commit_about_the_topic_made_it(engine: Engine, tmp_path: Any) -> None:
    """A waiter woken by a commit about its topic may act without looking first; woken by a starting watcher,
    or by a commit whose topics could not be told (a program other than pollbridge: no journal slot), it may
    not (the relay's claim and the bus reader's take go first only after a sure one)."""
    # The rule, on a signal of its own (no watcher): one wake-up that may not be about the topic, among sure ones,
    # makes every span that contains it unsure.
    own = ChangeSignal(tmp_path / "rule.db")
    g0 = own.generation("data")
    assert not own.surely_since("data", g0)  # nothing since
    own.notify(("data",))
    assert own.surely_since("data", g0)
    own.notify(("bus",))
    assert own.generation("data") == g0 + 1  # another topic's commit does not move it
    g1 = own.generation("data")
    own.notify(sure=False)  # every topic, maybe
    own.notify(("data",))
    assert not own.surely_since("data", g1) and not own.surely_since("data", g0)
    assert own.surely_since("data", g1 + 1)
    # The real signal: its watcher's start and a stranger's commit are wake-ups that only may be about data.
    signal = changes_of(engine, "data")
    assert signal is not None
    seen = signal.generation
    started = signal.wait(seen, 2.0)
    assert started != seen and not signal.surely_since(seen)
    took = _woken_within(signal, started, threading.Thread(target=_foreign, args=(engine, "stranger")), LONG)
    assert took < 1.0, took
    assert not signal.surely_since(started)  # its topics cannot be told
    # This process's commit about data is sure, even when the watcher samples the file between the commit and its
    # note (test_a_watcher_that_looks_between_a_commit_here_and_its_note_waits_for_the_note).
    before = signal.generation
    _loud(engine, "here")
    assert signal.surely_since(before)


def _woken_within(signal: TopicView, seen: int, act: threading.Thread, limit: float) -> float:
    """Start ``act`` and wait for the generation to move past ``seen``; seconds it took (fails past ``limit``)."""
    started = time.monotonic()
    act.start()
    now = seen
    while now == seen and time.monotonic() - started < limit:
        now = signal.wait(seen, limit)
    act.join(5)
    assert now != seen, f"no wake-up within {limit} s"
    return time.monotonic() - started


def _loud(engine: Engine, mark: str) -> None:
    with engine.begin() as conn:
        conn.execute(MARKS.insert().values(mark=mark))


def _quiet(engine: Engine, mark: str) -> None:
    with quiet(engine).begin() as conn:
        conn.execute(MARKS.insert().values(mark=mark))


def _bus(engine: Engine, mark: str) -> None:
    with about(engine, "bus").begin() as conn:
        conn.execute(MARKS.insert().values(mark=mark))


def _foreign(engine: Engine, mark: str) -> None:
    other = sqlite3.connect(engine.url.database or "", isolation_level=None)
    try:
        other.execute("INSERT INTO marks (mark) VALUES (?)", (mark,))
    finally:
        other.close()


def test_a_commit_here_wakes_a_waiter_after_it_landed(engine: Engine) -> None:
    """Woken by this process's commit, and the change is there to read: the signal follows the commit."""
    _loud(engine, "setup")
    signal = _signal(engine)
    seen = signal.generation
    writer = threading.Thread(target=_loud, args=(engine, "here"))
    writer.start()
    deadline = time.monotonic() + 2.0
    while signal.generation == seen and time.monotonic() < deadline:
        signal.wait(seen, 0.1)
    with engine.connect() as conn:  # read at once, before the writer thread is joined
        marks = set(conn.execute(sa.select(MARKS.c.mark)).scalars())
    writer.join(5)
    assert signal.generation != seen and "here" in marks


def test_another_processes_commit_wakes_a_waiter(engine: Engine) -> None:
    _loud(engine, "setup")
    signal = _signal(engine)
    took = _woken_within(signal, signal.generation,
                         threading.Thread(target=_foreign, args=(engine, "elsewhere")), LONG)
    assert took < 1.0, took


def test_a_quiet_commit_wakes_no_one_but_a_foreign_one_right_after_it_does(engine: Engine) -> None:
    _loud(engine, "setup")
    signal = _signal(engine)
    seen = signal.generation
    _quiet(engine, "lease")
    assert signal.wait(seen, 0.5) == seen  # neither the commit nor the watcher signalled it
    took = _woken_within(signal, seen, threading.Thread(target=_foreign, args=(engine, "other")), LONG)
    assert took < 1.0, took


def test_a_commit_wakes_the_waiters_of_its_topic_only(engine: Engine) -> None:
    """A bus publish's commit wakes the bus's readers, not the relay or the workers (who wait for data); a data
    commit wakes them, not the bus's readers. Another process's commit wakes both (its topic is unknown)."""
    _loud(engine, "setup")
    data, bus = _signal(engine, "data"), _signal(engine, "bus")
    seen_data, seen_bus = data.generation, bus.generation
    _bus(engine, "published")
    assert bus.wait(seen_bus, 2.0) != seen_bus
    assert data.wait(seen_data, 0.3) == seen_data
    seen_bus = bus.generation
    _loud(engine, "task written")
    assert data.wait(seen_data, 2.0) != seen_data
    assert bus.wait(seen_bus, 0.3) == seen_bus
    seen_data = data.generation
    _foreign(engine, "elsewhere")
    assert data.wait(seen_data, LONG) != seen_data and bus.wait(seen_bus, LONG) != seen_bus


def test_a_watcher_that_looks_between_a_commit_here_and_its_note_waits_for_the_note(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher samples the file every few milliseconds; a commit of this process is noted as its own (and its
    topics journalled) just after SQLite's COMMIT returns. A committer descheduled in between (a loaded machine)
    left the watcher a counter move it could not explain: it woke every topic, not surely. It waits for this
    process's commit in flight instead, and the commit wakes its own topic only, surely, and once."""
    _loud(engine, "setup")
    data, bus = _signal(engine, "data"), _signal(engine, "bus")
    real = ChangeSignal.header_now
    committer = threading.get_ident()

    def descheduled(self: ChangeSignal) -> bytes | None:  # right after COMMIT, before the note
        if threading.get_ident() == committer:
            time.sleep(0.05)  # ten of the watcher's looks
        return real(self)

    monkeypatch.setattr(ChangeSignal, "header_now", descheduled)
    seen_data, seen_bus = data.generation, bus.generation
    _loud(engine, "task written")
    assert data.wait(seen_data, 2.0) == seen_data + 1
    assert data.signal.surely_since("data", seen_data), "woken as by a stranger's commit"
    assert bus.wait(seen_bus, 0.3) == seen_bus, "a data commit woke the bus's readers"
    assert data.generation == seen_data + 1, "the watcher woke the data waiters a second time for the same commit"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["quiet", "bus", "loud", "foreign"]), min_size=1, max_size=6))
def test_every_commit_but_a_quiet_one_wakes_a_waiter(engine: Engine, kinds: list[str]) -> None:
    """Whatever the order of quiet, bus, loud (this process's data) and foreign commits: each loud or foreign
    commit wakes a data waiter, even straight after this process's other commits (a foreign commit is never
    taken for one of ours)."""
    _loud(engine, "setup")
    signal = _signal(engine)
    for i, kind in enumerate(kinds):
        seen = signal.generation
        act = {"quiet": _quiet, "bus": _bus, "loud": _loud, "foreign": _foreign}[kind]
        if kind in ("quiet", "bus"):
            act(engine, f"q{i}")
            continue
        _woken_within(signal, seen, threading.Thread(target=act, args=(engine, f"{kind}{i}")), LONG)


def test_an_idle_bus_reader_is_woken_by_another_processes_publish(engine: Engine) -> None:
    """A reader blocked on the embedded bus (its own look every 5 s) has an entry published by a real other
    process within a second: the file watcher saw that process's commit."""
    bus = EmbeddedBus(engine, partitions=1)
    bus.ensure_group("g")
    assert bus.read("g", "c", [0], 10, 0.1) == []
    publish = (
        "import sys\n"
        "from datetime import UTC, datetime\n"
        "from bridge.bus.embedded import EmbeddedBus\n"
        "from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id, new_trace_id\n"
        "from bridge.db.engine import create_engine\n"
        "bus = EmbeddedBus(create_engine(sys.argv[1]), partitions=1)\n"
        "bus.publish([CloudEvent(id=new_event_id(), type=TASK_STATUS_CHANGED, subject='i', partitionkey='i',\n"
        "                        time=datetime.now(UTC), traceid=new_trace_id(), data={'instance_id': 'i'})])\n"
    )
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(bus.read("g", "c", [0], 10, LONG)))
    reader.start()
    wait_for(lambda: reader.is_alive(), 2, what="the reader to block")
    threading.Event().wait(0.2)  # the reader is past its first look, waiting
    done = subprocess.run([sys.executable, "-c", publish, str(engine.url)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    published = time.monotonic()
    reader.join(LONG + 1)
    assert len(got) == 1 and time.monotonic() - published < 1.5, (got, time.monotonic() - published)
    bus.close()


@pytest.mark.parametrize("before", ["a write rolled back", "an update to the same value"])
def test_a_commit_that_moved_nothing_does_not_hide_the_next_foreign_one(engine: Engine, before: str) -> None:
    """A commit of ours that SQLite did not have to write (after a rolled-back write, or an UPDATE to the same
    bytes) does not move the change counter: registered as ours, it would have let another process's next
    commit pass unseen."""
    _loud(engine, "same")
    signal = _signal(engine)
    if before == "a write rolled back":
        with engine.connect() as conn:
            conn.execute(MARKS.insert().values(mark="undone"))
            conn.rollback()
        with engine.begin() as conn:
            conn.execute(sa.select(MARKS.c.mark)).all()
    else:
        with engine.begin() as conn:
            conn.execute(MARKS.update().where(MARKS.c.mark == "same").values(mark="same"))
    signal.wait(signal.generation, 0.1)
    took = _woken_within(signal, signal.generation, threading.Thread(target=_foreign, args=(engine, "other")), LONG)
    assert took < 1.0, took


def test_a_first_commit_racing_the_first_wait_does_not_deadlock(sqlite_url: str) -> None:
    """The first header read of a commit (under SQLite's write lock) and the first waiter starting the watcher
    took two locks in opposite orders: a commit could hang holding the database's write lock."""
    for attempt in range(20):
        engine = create_engine(sqlite_url)
        signal = changes_of(engine, "data")
        assert signal is not None
        fresh = signal.signal
        fresh._shm = None  # as a new process sees it: no descriptor yet
        start = threading.Barrier(2)

        def commit(start: threading.Barrier = start, fresh: ChangeSignal = fresh) -> None:
            start.wait()
            fresh.change_counter()

        def wait(start: threading.Barrier = start, fresh: ChangeSignal = fresh) -> None:
            start.wait()
            fresh._watcher = None
            fresh.wait("data", fresh.generation("data"), 0.01)

        threads = [threading.Thread(target=commit, daemon=True), threading.Thread(target=wait, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads), f"deadlocked on attempt {attempt}"
        engine.dispose()


_COMMITTER = (
    "import sys\n"
    "import sqlalchemy as sa\n"
    "from bridge.db.engine import about, create_engine, quiet\n"
    "engine = create_engine(sys.argv[1])\n"
    "marks = sa.table('marks', sa.column('mark', sa.String))\n"
    "for n, line in enumerate(sys.stdin):\n"
    "    kind = line.strip()\n"
    "    chosen = {'quiet': quiet(engine), 'bus': about(engine, 'bus'), 'work': about(engine, 'work'),\n"
    "              'data': engine}[kind]\n"
    "    with chosen.begin() as conn:\n"
    "        conn.execute(marks.insert().values(mark=f'{kind}{n}'))\n"
    "    print('ok', flush=True)\n"
)


@contextlib.contextmanager
def _another_process(engine: Engine, first: TopicView, second: TopicView,
                     second_within: float = 0.3) -> Iterator[Callable[[str], tuple[bool, bool]]]:
    """Another pollbridge process committing on demand: ``commit(kind)`` makes one commit of ``kind`` there (one of
    :data:`_COMMITTER`'s) and says whether ``first`` and ``second`` were woken."""
    other = subprocess.Popen([sys.executable, "-c", _COMMITTER, str(engine.url)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert other.stdin is not None and other.stdout is not None

    def commit(kind: str) -> tuple[bool, bool]:
        seen_first, seen_second = first.generation, second.generation
        other.stdin.write(f"{kind}\n")  # type: ignore[union-attr]
        other.stdin.flush()  # type: ignore[union-attr]
        assert other.stdout.readline().strip() == "ok"  # type: ignore[union-attr]
        woke_second = second.wait(seen_second, second_within) != seen_second
        return first.wait(seen_first, 0.05 if woke_second else 0.3) != seen_first, woke_second

    try:
        commit("quiet")  # the other process's start-up commits (its first journal write) are behind us
        yield commit
    finally:
        other.stdin.close()
        other.wait(30)


def test_another_pollbridge_process_wakes_only_the_topics_of_its_commits(engine: Engine) -> None:
    """Another pollbridge process's commits carry their topics through the journal beside the database: its
    quiet commits (lease renewals, a bus reader's bookkeeping) wake no one here, its bus publishes wake the bus's
    readers and not the relay, its data commits wake the relay. Before the journal, each woke every waiter.
    (A few wake-ups too many are allowed: a commit whose process is descheduled before it writes its slot is
    taken for a stranger's, on purpose.)"""
    _loud(engine, "setup")
    data, bus = _signal(engine, "data"), _signal(engine, "bus")
    with _another_process(engine, data, bus) as commit:
        quiet_wakes = [commit("quiet") for _ in range(10)]
        bus_wakes = [commit("bus") for _ in range(10)]
        data_wakes = [commit("data") for _ in range(5)]
    assert sum(d or b for d, b in quiet_wakes) <= 3, quiet_wakes
    assert all(b for _, b in bus_wakes) and sum(d for d, _ in bus_wakes) <= 3, bus_wakes
    assert all(d for d, _ in data_wakes), data_wakes


def test_a_dispatch_wakes_the_workers_and_not_the_relay(engine: Engine) -> None:
    """The event scheduler's dispatch commits about ``work``: it wakes the workers (who wait for data and work), not
    the relay (data only; the dispatch's outbox row is a quiet change), in this process and from another. A data
    commit wakes both. (From another process a few wake-ups too many are allowed, as above.)"""
    _loud(engine, "setup")
    relay, workers = _signal(engine, "data"), _signal(engine, "data", "work")
    seen_relay, seen_workers = relay.generation, workers.generation
    with about(engine, "work").begin() as conn:
        conn.execute(MARKS.insert().values(mark="dispatched here"))
    assert workers.wait(seen_workers, 2.0) != seen_workers
    assert relay.wait(seen_relay, 0.3) == seen_relay
    with _another_process(engine, relay, workers, LONG) as commit:
        work_wakes = [commit("work") for _ in range(8)]
        data_wakes = [commit("data") for _ in range(3)]
    assert all(w for _, w in work_wakes) and sum(r for r, _ in work_wakes) <= 3, work_wakes
    assert all(r and w for r, w in data_wakes), data_wakes


def test_a_shared_quiet_transaction_wakes_the_topics_its_writers_added(engine: Engine) -> None:
    """The bus's take is quiet; the event scheduler's dispatch inside it adds ``work`` (the workers wake, the relay
    does not), and a data write inside it (a skip, a hold) adds ``data`` (both wake)."""
    _loud(engine, "setup")
    relay, workers = _signal(engine, "data"), _signal(engine, "data", "work")
    seen_relay, seen_workers = relay.generation, workers.generation
    with quiet(engine).begin() as conn:
        add_topics(conn, "work")
        conn.execute(MARKS.insert().values(mark="dispatched in the take"))
    assert workers.wait(seen_workers, 2.0) != seen_workers
    assert relay.wait(seen_relay, 0.3) == seen_relay
    seen_relay = relay.generation
    with quiet(engine).begin() as conn:
        add_topics(conn)  # a write through the plain engine (a skip): data, kept when the dispatch adds work
        add_topics(conn, "work")
        conn.execute(MARKS.insert().values(mark="dispatched and skipped in the take"))
    assert relay.wait(seen_relay, 2.0) != seen_relay


def test_uninstall_removes_the_topic_journal(sqlite_url: str) -> None:
    from bridge.app import install
    from bridge.core.mapping import TaskTableMapping
    from bridge.db.changes import JOURNAL_SUFFIX

    engine = create_engine(sqlite_url)
    try:
        install.init(engine, demo_schema=True, mapping=TaskTableMapping())
        with engine.begin() as conn:  # a commit of pollbridge's writes the journal
            conn.exec_driver_sql("CREATE TABLE marks (mark TEXT)")
            conn.exec_driver_sql("INSERT INTO marks VALUES ('x')")
        journal = f"{engine.url.database}{JOURNAL_SUFFIX}"
        assert os.path.exists(journal)
        install.uninstall(engine, TaskTableMapping())
        assert not os.path.exists(journal)
    finally:
        engine.dispose()


def test_a_second_writer_of_this_process_waits_on_the_process_lock_not_in_sqlite(engine: Engine) -> None:
    """Two threads of one process writing: the second issues its BEGIN IMMEDIATE only once the first committed
    (it waited on the process's write lock, woken at the release), never into SQLite's busy handler, which
    sleeps 1, 2, 5, 10 … ms between tries whatever the lock does."""
    signal = changes_of(engine, "data")
    assert signal is not None
    order: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _seen(conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        if statement == "BEGIN IMMEDIATE":
            order.append(f"begin {threading.current_thread().name}")

    first_open = threading.Event()
    second_started = threading.Event()

    def first() -> None:
        with engine.begin() as conn:
            conn.execute(MARKS.insert().values(mark="first"))
            first_open.set()
            assert second_started.wait(5)
            wait_for(lambda: signal.signal.write_lock.locked(), 5, what="the lock held")
            threading.Event().wait(0.2)  # the second thread is waiting by now
            order.append("first commits")
        order.append("first committed")

    def second() -> None:
        assert first_open.wait(5)
        second_started.set()
        _loud(engine, "second")

    threads = [threading.Thread(target=first, name="a"), threading.Thread(target=second, name="b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    sa.event.remove(engine, "before_cursor_execute", _seen)
    assert order == ["begin a", "first commits", "first committed", "begin b"], order
    assert not signal.signal.write_lock.locked()


def test_a_connection_closed_inside_its_write_transaction_lets_the_lock_go(engine: Engine) -> None:
    signal = changes_of(engine, "data")
    assert signal is not None
    conn = engine.connect()
    conn.begin()
    conn.execute(MARKS.insert().values(mark="dropped"))
    assert signal.signal.write_lock.locked()
    conn.invalidate()  # the DBAPI connection is closed, its transaction undone by SQLite
    conn.close()
    assert not signal.signal.write_lock.locked()
    _loud(engine, "after")  # a new writer is not kept waiting
    with engine.connect() as check:
        assert set(check.execute(sa.select(MARKS.c.mark)).scalars()) == {"after"}


_CRASHING_WRITER = (
    "import os, sys\n"
    "import sqlalchemy as sa\n"
    "from bridge.db.engine import create_engine, quiet\n"
    "engine = create_engine(sys.argv[1])\n"
    "with engine.begin() as conn:\n"
    "    conn.exec_driver_sql('CREATE TABLE marks (mark TEXT)')\n"
    "for n in range(12):\n"
    "    with quiet(engine).begin() as conn:\n"
    "        conn.exec_driver_sql('INSERT INTO marks VALUES (?)', (f'lease{n}',))\n"
    "os._exit(0)  # killed: no checkpoint, the -wal and -shm files stay\n"
)


def test_a_recovered_wal_does_not_match_the_journal_of_the_run_before_the_crash(sqlite_url: str) -> None:
    """SQLite recovering a WAL after a crash restarts the change counter from 0 in the same -shm file, with
    the same salt: the crashed run's journal slots (quiet lease renewals) named the new counter values, and
    another program's commits after the restart woke no one (found in review, reproduced). The slots carry the
    WAL's frame count, which only grows within a salt, and no longer match."""
    done = subprocess.run([sys.executable, "-c", _CRASHING_WRITER, sqlite_url], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    engine = create_engine(sqlite_url)
    held = engine.connect()  # the first connection recovers the WAL; held, the WAL is not checkpointed away
    try:
        held.exec_driver_sql("SELECT count(*) FROM marks").scalar_one()
        held.rollback()
        signal = _signal(engine, "data")
        for i in range(3):
            took = _woken_within(signal, signal.generation,
                                 threading.Thread(target=_foreign, args=(engine, f"task{i}")), LONG)
            assert took < 1.0, took
    finally:
        held.close()
        engine.dispose()


def test_a_reader_keeps_reading_after_another_bus_emptied_the_bus(sqlite_url: str) -> None:
    """A reader that has taken entries remembers its group's rows exist (its takes then join them); after
    another bus instance emptied the bus (``uninstall`` does) and entries were published again, its next look
    finds the rows gone and its take makes them again (found in review: it read nothing until restarted)."""
    from bridge.app import install
    from bridge.core.events import CloudEvent, new_event_id, new_trace_id
    from bridge.core.mapping import TaskTableMapping

    engine = create_engine(sqlite_url)
    try:
        install.init(engine, demo_schema=True, mapping=TaskTableMapping())
        running, other = EmbeddedBus(engine, partitions=1), EmbeddedBus(engine, partitions=1)

        def publish() -> None:
            other.publish([CloudEvent(id=new_event_id(), type="task.status.changed", subject="i", partitionkey="i",
                                      time=datetime.now(UTC), traceid=new_trace_id(), data={"instance_id": "i"})])

        publish()
        assert len(running.read("g", "c", [0], 10, 1.0)) == 1
        publish()
        assert len(running.read("g", "c", [0], 10, 1.0)) == 1
        other.purge_all()
        publish()
        assert len(running.read("g", "c", [0], 10, LONG)) == 1
        running.close()
        other.close()
    finally:
        engine.dispose()


def test_a_failed_commit_lets_the_process_write_lock_go(engine: Engine) -> None:
    """A COMMIT that fails (a deferred foreign key) ends in a rollback: the next writer of the process does not
    wait for the lock."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("CREATE TABLE child (id INTEGER PRIMARY KEY, parent INTEGER REFERENCES parent(id) "
                             "DEFERRABLE INITIALLY DEFERRED)")
    signal = changes_of(engine, "data")
    assert signal is not None
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO child VALUES (1, 99)")
    assert not signal.signal.write_lock.locked()
    _loud(engine, "after")


def test_an_unknown_topic_is_refused() -> None:
    from bridge.db.changes import check_topics

    assert check_topics(["bus"]) == frozenset({"bus"})
    with pytest.raises(ValueError, match="unknown topic"):
        check_topics(["bsu"])


def test_autocommit_reads_on_sqlite_send_no_begin_and_see_each_commit(engine: Engine) -> None:
    """``autocommit()`` on SQLite, as on PostgreSQL: each read in its own (implicit) transaction, no ``BEGIN``
    statement, and a second read on the same connection sees what committed after the first; ``read_only()``
    keeps its deferred ``BEGIN`` (one snapshot for the transaction)."""
    from bridge.db.engine import autocommit, read_only

    _loud(engine, "first")
    sent: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        with autocommit(engine).connect() as conn:
            before = conn.execute(sa.select(sa.func.count()).select_from(MARKS)).scalar_one()
            _loud(engine, "second")  # another connection commits between the two reads
            after = conn.execute(sa.select(sa.func.count()).select_from(MARKS)).scalar_one()
        assert (before, after) == (1, 2)
        reads = [s for s in sent if not s.upper().startswith(("INSERT", "BEGIN IMMEDIATE"))]
        assert reads and "BEGIN" not in reads, sent
        sent.clear()
        with read_only(engine).connect() as conn:
            conn.execute(sa.select(sa.func.count()).select_from(MARKS)).scalar_one()
        assert sent[0] == "BEGIN", sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
