"""LISTEN/NOTIFY waits (bridge.db.listen): the relay's between claims, the embedded bus's listener."""

from __future__ import annotations

import threading
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
