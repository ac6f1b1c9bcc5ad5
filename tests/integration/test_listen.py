"""LISTEN/NOTIFY waits (bridge.db.listen): the relay's between claims, the embedded bus's listener."""

from __future__ import annotations

import select
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import waiting

from bridge.db.engine import create_engine
from bridge.db.listen import ListenWaiter

CHANNEL = "pollbridge_test_listen"


@pytest.mark.postgres
def test_a_listener_waits_on_its_socket_not_in_psycopgs_timed_wait(pg_url: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg's ``notifies(timeout=t)`` spins through the last millisecond of every wait: 0.75 ms of CPU per 2 ms
    wait, which a busy relay makes between claims (about a third of a core at 500 completions/s). The waiter
    selects on the socket and reads with a zero timeout: no timed wait of psycopg's, and what arrives mid-wait,
    one notification or several at once, still wakes it with every payload."""
    engine = create_engine(pg_url)
    timed: list[float] = []
    real = waiting.wait

    def recording(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("timeout"):
            timed.append(kwargs["timeout"])
        return real(*args, **kwargs)

    monkeypatch.setattr(waiting, "wait", recording)
    waiter = ListenWaiter(engine, threading.Event(), CHANNEL)
    try:
        waiter.ensure_listening()
        assert [waiter.wait(0.002) for _ in range(5)] == [False] * 5  # the busy relay's poll interval
        assert timed == []

        def notify(*payloads: str) -> None:
            with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn, \
                    conn.transaction():
                for payload in payloads:
                    conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))

        sender = threading.Timer(0.2, notify, args=("one", "two"))
        sender.start()
        try:
            assert waiter.wait(10)
        finally:
            sender.join()
        assert waiter.take_payloads() == {"one", "two"}
        assert timed == []
    finally:
        waiter.close()
        engine.dispose()


@pytest.mark.postgres
def test_a_listener_on_a_descriptor_past_1024_still_waits_and_wakes(pg_url: str) -> None:
    """An application embedding the bus may hold more than 1,024 descriptors: ``select`` refuses such a one
    (``ValueError``, which no handler expects); the wait polls."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files is {hard}: `ulimit -Hn 2048` or more")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard) if hard != resource.RLIM_INFINITY else 2048,
                                                    hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    engine = create_engine(pg_url)
    waiter = ListenWaiter(engine, threading.Event(), CHANNEL)
    try:
        waiter.ensure_listening()
        assert waiter._conn is not None and waiter._conn.fileno() >= 1024
        assert waiter.wait(0.01) is False
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            conn.execute("SELECT pg_notify(%s, 'late')", (CHANNEL,))
        assert waiter.wait(10)
        assert waiter.take_payloads() == {"late"}
    finally:
        waiter.close()
        engine.dispose()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.postgres
def test_what_arrived_since_the_last_wait_is_heard_without_waiting(pg_url: str) -> None:
    """``hear_pending`` (the relay, before housekeeping or a claim that is due): a notification already on the
    listener's socket is taken in at once, none is nothing, and a closed listener is not reconnected for it."""
    engine = create_engine(pg_url)
    waiter = ListenWaiter(engine, threading.Event(), CHANNEL)
    try:
        assert not waiter.hear_pending()  # never listened: nothing, and no connection made
        assert waiter._conn is None
        waiter.ensure_listening()
        assert not waiter.hear_pending()
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            conn.execute("SELECT pg_notify(%s, 'pending')", (CHANNEL,))
        # On the socket by now or soon: the listener's backend sends it once the sender's commit signals it.
        conn_fd = waiter._conn.fileno()  # type: ignore[union-attr]
        poller = select.poll()
        poller.register(conn_fd, select.POLLIN)
        assert poller.poll(10_000), "the notification never reached the listener's socket"
        assert waiter.hear_pending()
        assert waiter.take_notices("pend") == ["pending"]
        assert not waiter.hear_pending()
        waiter.close()
        assert not waiter.hear_pending()
        assert waiter._conn is None
    finally:
        waiter.close()
        engine.dispose()


@pytest.mark.postgres
def test_a_listener_lost_is_found_by_hear_pending_and_listens_afresh(pg_url: str) -> None:
    """The listener's backend ended: ``hear_pending`` says nothing is pending and closes it, and the next
    ``ensure_listening`` connects again and says so (the relay then claims what committed meanwhile)."""
    engine = create_engine(pg_url)
    waiter = ListenWaiter(engine, threading.Event(), CHANNEL)
    try:
        waiter.ensure_listening()
        assert waiter._conn is not None
        pid = waiter._conn.info.backend_pid
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        # The backend sends its FATAL message, then closes the socket: the read that meets the end of the
        # connection (not the one that meets the message) fails, and hear_pending closes the listener.
        poller = select.poll()
        poller.register(waiter._conn.fileno(), select.POLLIN)
        deadline = time.monotonic() + 10
        while waiter._conn is not None and time.monotonic() < deadline:
            assert poller.poll(10_000), "the terminated backend never wrote to the listener's socket"
            assert not waiter.hear_pending()
        assert waiter._conn is None, "the lost listener was not closed"
        assert waiter.ensure_listening(), "a fresh LISTEN must be reported, so that the caller looks again"
        assert waiter._conn is not None and waiter._conn.info.backend_pid != pid
    finally:
        waiter.close()
        engine.dispose()
