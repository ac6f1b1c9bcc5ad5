"""``pollbridge serve`` against a real HTTP client: the service runs on uvicorn (a thread of the test), the
client is httpx (or a raw socket where a client must misbehave), the database and the bus are real.

Signatures (accepted, wrong, stale, missing, replayed: 401 with nothing recorded), the signal errors of the
CLI as 4xx, SSE streams fed from the bus (every status change of an instance in order, resumed after a
disconnect without a gap, a type stream resumed across partitions), a slow client dropped with a reason
while others carry on, 200 idle SSE clients beside a running event path, /tasks, /healthz, /metrics.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from bridge.bus.base import DeadLetter, Delivery, EventBus, entry_order, partition_for
from bridge.capture.relay import Relay
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent, new_event_id
from bridge.core.phases import FixedRouter
from bridge.core.settings import RelaySettings, SchedulerSettings, ServeSettings, Settings, WorkerSettings
from bridge.db.schema import outbox, signals
from bridge.reference.oracle import percentile, verify
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.serve.app import BackgroundServer, ServeApp, ServeContext
from bridge.serve.auth import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from event_scheduler.scheduler import EventScheduler
from legacy_poller.workers import WorkerPool
from tests.support import Env, wait_for

SECRET = "serve-test-secret-0123456789"
RELAY = RelaySettings(poll_interval=0.002, arm_after=0.05, fallback_interval=0.2, lease_timeout=1.0,
                      purge_interval=3600)
SCHED = SchedulerSettings(block=0.1, lease_ttl=2.0, claim_interval=0.5)
WORKERS = WorkerSettings(concurrency=3, min_duration=0.0, max_duration=0.002, idle_sleep=0.01)


# ------------------------------------------------------------------------------------------------ harness

@dataclass
class Served:
    app: ServeApp
    server: BackgroundServer
    http: httpx.Client
    bus: EventBus
    threads: list[tuple[threading.Thread, threading.Event]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    def background(self, target: Callable[[threading.Event], None]) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=target, args=(stop,), daemon=True)
        thread.start()
        self.threads.append((thread, stop))


@contextmanager
def serving(env: Env, secret: str | None = SECRET, **serve: Any) -> Iterator[Served]:
    settings = Settings(database_url=env.url, serve=ServeSettings(sse_keepalive=0.5, **serve))
    bus = env.open_bus()
    app = ServeApp(ServeContext(settings, env.engine, env.tables, bus, secret, bus_label=env.kind),
                   registry=CollectorRegistry())
    server = BackgroundServer(app, "127.0.0.1", 0).start()
    http = httpx.Client(base_url=server.url, timeout=httpx.Timeout(20.0))
    served = Served(app, server, http, bus)
    try:
        wait_for(lambda: app.hub is not None and app.hub.ready, 20, what="the SSE bus reader to start")
        yield served
    finally:
        http.close()
        server.stop()
        for _, stop in served.threads:
            stop.set()
        for thread, _ in served.threads:
            thread.join(20)


def _signed(body: dict[str, Any] | bytes, secret: str = SECRET,
            at: float | None = None) -> tuple[bytes, dict[str, str]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    ts = str(int(time.time() if at is None else at))
    return raw, {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: sign(secret, ts, raw), "Content-Type": "application/json"}


class Stream:
    """A real SSE client: httpx streaming, frames parsed as the EventSource spec says."""

    def __init__(self, http: httpx.Client, path: str, last_event_id: str | None = None) -> None:
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self._cm = http.stream("GET", path, headers=headers)
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        assert self.response.headers["content-type"].startswith("text/event-stream")
        self._lines = self.response.iter_lines()
        self.last_id: str | None = None
        first = self.frame()
        assert first.get("id"), first  # the cursor the stream starts from

    def frame(self) -> dict[str, str]:
        """The next frame (comments skipped; a keep-alive alone is an empty frame)."""
        fields: dict[str, str] = {}
        for line in self._lines:
            if line == "":
                if "id" in fields:
                    self.last_id = fields["id"]
                return fields
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value
        return {"eof": "1", **fields}

    def events(self, n: int, timeout: float = 30.0) -> list[dict[str, str]]:
        got: list[dict[str, str]] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            assert time.monotonic() < deadline, f"only {len(got)} of {n} events arrived: {got[-3:]}"
            f = self.frame()
            assert "eof" not in f, f"the stream ended after {len(got)} events: {f}"
            if f.get("event"):
                got.append(f)
        return got

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def _event_ids(frames: list[dict[str, str]]) -> list[str]:
    return [json.loads(f["data"])["id"] for f in frames]


def _outbox_ids(env: Env, **where: str) -> list[str]:
    with env.engine.connect() as conn:
        rows = conn.execute(sa.select(outbox.c.event_id).where(*(outbox.c[k] == v for k, v in where.items()))
                            .order_by(outbox.c.id)).all()
    return [str(r[0]) for r in rows]


def _published(env: Env) -> bool:
    with env.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).where(outbox.c.published_at.is_(None))).scalar_one() == 0


def _set_status(env: Env, task_id: int, status: str) -> None:
    """What the existing scheduler and its workers do: write the task table (capture turns it into an event)."""
    with env.engine.begin() as conn:
        conn.execute(env.tables.tasks.update().where(env.tables.col("id") == task_id).values(
            {env.tables.mapping.columns.status: status}))


def _ids(env: Env, instance_id: str) -> dict[str, int]:
    with env.engine.connect() as conn:
        return {str(k): int(i) for k, i in conn.execute(
            sa.select(env.tables.col("task_key"), env.tables.col("id"))
            .where(env.tables.col("instance_id") == instance_id)).all()}


def _signal_rows(env: Env) -> int:
    with env.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(signals)).scalar_one())


@pytest.fixture
def sqlite_env(sqlite_url: str) -> Iterator[Env]:
    """SQLite + embedded bus only: for what does not depend on the stack (signatures, errors)."""
    from bridge.bus import open_bus
    from bridge.core.mapping import TaskTableMapping
    from bridge.db.engine import create_engine
    from bridge.tasktable.tables import reflect_tables

    engine = create_engine(sqlite_url)
    buses: list[EventBus] = []

    def opener() -> EventBus:
        buses.append(open_bus("embedded", engine=engine, partitions=4))
        return buses[-1]

    yield Env(engine, reflect_tables(engine, TaskTableMapping()), opener, "sqlite-embedded", None, sqlite_url)
    for bus in buses:
        bus.close()
    engine.dispose()


# ------------------------------------------------------------------------------------------------ signals

def test_signed_signal_is_accepted_recorded_and_its_event_reaches_the_stream(env: Env) -> None:
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("sig-1", "orders", (TaskSpec("approve", awaits_signal="manager"),
                                                                   TaskSpec("after", ("approve",))))])
    ids = _ids(env, "sig-1")
    with serving(env) as s:
        s.background(Relay(env.engine, env.open_bus(), RELAY, statuses=env.tables.mapping.statuses).run)
        wait_for(lambda: _published(env), 20, what="the inserts to be published")
        stream = Stream(s.http, "/instances/sig-1/events")
        try:
            body, headers = _signed({"task_id": str(ids["approve"]), "kind": "approval", "payload": {"ticket": "T-1"},
                                     "actor": "ann"})
            r = s.http.post(f"/signals/{ids['approve']}", content=body, headers=headers)
            assert r.status_code == 202, r.text
            doc = r.json()
            assert doc["task_id"] == str(ids["approve"]) and doc["kind"] == "approval"
            assert doc["status"] == "pending" and doc["event_id"]
            assert doc["event_id"] == _outbox_ids(env, task_id=str(ids["approve"]), change="signal")[0]
            # A new stream starts where the hub's reader is, which may be just before the seed's inserts were
            # read: those may come first, but nothing else, and the signal's event must follow.
            event = json.loads(stream.events(1)[0]["data"])
            while event["data"]["change"] == "insert":
                event = json.loads(stream.events(1)[0]["data"])
            assert event["id"] == doc["event_id"] and event["data"]["change"] == "signal"
        finally:
            stream.close()
        with env.engine.connect() as conn:
            kind, actor, payload = conn.execute(sa.select(signals.c.kind, signals.c.actor, signals.c.payload)).one()
        assert (kind, actor, json.loads(payload)) == ("approval", "ann", {"ticket": "T-1"})
        task = s.http.get(f"/tasks/{ids['approve']}").json()
        assert task["signal_received_at"] and task["awaits_signal"] == "manager" and task["status"] == "pending"
        assert s.app.metrics.value("pollbridge_serve_signals_total", {"outcome": "accepted"}) == 1


def test_wrong_stale_missing_or_replayed_signatures_are_refused_and_record_nothing(sqlite_env: Env) -> None:
    env = sqlite_env
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("sig-2", "orders", (TaskSpec("cb", awaits_signal="hook"),))])
    task = _ids(env, "sig-2")["cb"]
    path = f"/signals/{task}"
    with serving(env, max_clock_skew=60) as s:
        good_body, good = _signed({"task_id": task, "kind": "callback"})
        cases: list[tuple[str, bytes, dict[str, str]]] = [
            ("wrong secret", *_signed({"task_id": task, "kind": "callback"}, secret="another-secret-0123456789")),
            ("body changed", json.dumps({"task_id": task, "kind": "rejection"}).encode(), good),
            ("stale", *_signed({"task_id": task, "kind": "callback"}, at=time.time() - 120)),
            ("from the future", *_signed({"task_id": task, "kind": "callback"}, at=time.time() + 120)),
            ("no signature", good_body, {TIMESTAMP_HEADER: good[TIMESTAMP_HEADER]}),
            ("no timestamp", good_body, {SIGNATURE_HEADER: good[SIGNATURE_HEADER]}),
            ("not hex", good_body, {**good, SIGNATURE_HEADER: "v1=zz"}),
            ("other scheme", good_body, {**good, SIGNATURE_HEADER: good[SIGNATURE_HEADER].replace("v1=", "v0=")}),
        ]
        for what, body, headers in cases:
            r = s.http.post(path, content=body, headers=headers)
            assert r.status_code == 401, (what, r.text)
            assert r.json()["error"] == "unauthorized", what
        assert "stale timestamp" in s.http.post(path, content=cases[2][1], headers=cases[2][2]).json()["message"]
        assert _signal_rows(env) == 0
        assert s.http.get(f"/tasks/{task}").json()["signal_received_at"] is None

        assert s.http.post(path, content=good_body, headers=good).status_code == 202
        replay = s.http.post(path, content=good_body, headers=good)
        assert replay.status_code == 401 and "replayed" in replay.json()["message"]
        assert _signal_rows(env) == 1
        # The same signed request sent to another task: a replay (401); a fresh signature over a body that
        # names another task than the path: refused (400). Either way nothing is recorded for that task.
        with env.engine.begin() as conn:
            seed(conn, env.tables, [WorkflowSpec("sig-3", "orders", (TaskSpec("cb", awaits_signal="hook"),))])
        other = _ids(env, "sig-3")["cb"]
        assert s.http.post(f"/signals/{other}", content=good_body, headers=good).status_code == 401
        moved_body, moved = _signed({"task_id": task, "kind": "callback", "actor": "moved"})
        assert s.http.post(f"/signals/{other}", content=moved_body, headers=moved).status_code == 400
        assert _signal_rows(env) == 1
        assert s.app.metrics.value("pollbridge_serve_signals_total", {"outcome": "unauthorized"}) == len(cases) + 3


def test_signals_that_cannot_apply_get_the_clis_errors_as_4xx(sqlite_env: Env) -> None:
    env = sqlite_env
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("sig-4", "orders", (TaskSpec("plain"),
                                                                   TaskSpec("gate", awaits_signal="boss")))])
    ids = _ids(env, "sig-4")
    with serving(env) as s:
        def post(task: Any, body: dict[str, Any] | bytes) -> httpx.Response:
            if isinstance(body, dict):
                body = {"task_id": str(task), **body}
            raw, headers = _signed(body)
            return s.http.post(f"/signals/{task}", content=raw, headers=headers)

        r = post(ids["plain"], {"kind": "approval"})
        assert (r.status_code, r.json()) == (409, {"error": "conflict", "message": f"task {ids['plain']} awaits no "
                                                                                      "signal"})
        r = post(999999, {"kind": "approval"})
        assert r.status_code == 404 and r.json()["message"] == "no task '999999' in tasks"
        assert post("not-a-number", {"kind": "approval"}).status_code == 404
        r = post(ids["gate"], {"kind": "maybe"})
        assert r.status_code == 400 and "unknown signal kind" in r.json()["message"]
        assert post(ids["gate"], b"not json").status_code == 400
        assert post(ids["gate"], {"kind": "approval", "task_id": str(ids["plain"]), "actor": "x"}).status_code == 400
        assert post(ids["gate"], json.dumps({"kind": "approval"}).encode()).status_code == 400  # no task_id
        assert post(ids["gate"], {"kind": "approval", "colour": "red"}).status_code == 400
        assert _signal_rows(env) == 0
        r = post(ids["gate"], {"kind": "rejection", "task_id": ids["gate"]})
        assert r.status_code == 202 and r.json()["status"] == "failed"
        r = post(ids["gate"], {"kind": "approval"})
        assert r.status_code == 409 and "already received" in r.json()["message"]
        big, headers = _signed({"task_id": ids["gate"], "kind": "callback", "payload": "x" * 300_000})
        assert s.http.post(f"/signals/{ids['gate']}", content=big, headers=headers).status_code == 413
        assert s.http.get("/tasks/424242").status_code == 404
    with serving(env, secret=None) as s:
        raw, headers = _signed({"task_id": ids["gate"], "kind": "approval"})
        r = s.http.post(f"/signals/{ids['gate']}", content=raw, headers=headers)
        assert r.status_code == 503 and "POLLBRIDGE_SIGNAL_SECRET" in r.json()["message"]


# ------------------------------------------------------------------------------------------------ SSE

def test_an_instance_stream_gets_every_change_in_order_and_resumes_without_gaps(env: Env) -> None:
    st = env.tables.statuses
    with serving(env) as s:
        s.background(Relay(env.engine, env.open_bus(), RELAY, statuses=env.tables.mapping.statuses).run)
        live = Stream(s.http, "/instances/sse-1/events")
        by_type = Stream(s.http, "/types/orders/events")
        type_cursor = by_type.last_id
        by_type.close()  # it comes back at the end with the cursor it started from
        with env.engine.begin() as conn:
            seed(conn, env.tables, [
                WorkflowSpec("sse-1", "orders", (TaskSpec("a"), TaskSpec("b", ("a",)), TaskSpec("c", ("b",)))),
                WorkflowSpec("sse-other", "orders", (TaskSpec("x"),)),
                WorkflowSpec("sse-etl", "etl", (TaskSpec("y"),)),
            ])
        ids, other, etl = _ids(env, "sse-1"), _ids(env, "sse-other"), _ids(env, "sse-etl")
        for status in (st.dispatched, st.running, st.completed):
            _set_status(env, ids["a"], status)
            _set_status(env, other["x"], status)
        first = live.events(5)  # 3 inserts, a dispatched and running
        live.close()  # the client goes away...
        for status in (st.dispatched, st.running, st.completed):  # ...while its instance moves on
            _set_status(env, ids["b"], status)
            _set_status(env, etl["y"], status)
        _set_status(env, ids["c"], st.dispatched)
        wait_for(lambda: _published(env), 20, what="every change to be on the bus")
        resumed = Stream(s.http, "/instances/sse-1/events", last_event_id=live.last_id)
        expected = _outbox_ids(env, instance_id="sse-1")
        assert len(expected) == 3 + 3 + 3 + 1
        rest = resumed.events(len(expected) - len(first))
        assert _event_ids(first + rest) == expected  # every change, in order, no gap, no duplicate
        ids_seen = [f["id"] for f in first + rest]
        part = partition_for("sse-1", s.bus.partitions)
        assert all(i.startswith(f"{part}:") for i in ids_seen)
        assert [entry_order(i.split(":")[1]) for i in ids_seen] == sorted(entry_order(i.split(":")[1])
                                                                          for i in ids_seen)
        _set_status(env, ids["c"], st.running)  # and it is live again
        (late,) = resumed.events(1)
        assert _event_ids([late]) == _outbox_ids(env, instance_id="sse-1")[-1:]
        resumed.close()

        # The type stream, resumed from the cursor it started with: every change of an 'orders' task, across
        # partitions, each instance's in order; 'etl' left out.
        replayed = Stream(s.http, "/types/orders/events", last_event_id=type_cursor)
        wanted = _outbox_ids(env, workflow_type="orders")
        frames = replayed.events(len(wanted))
        replayed.close()
        assert sorted(_event_ids(frames)) == sorted(wanted)
        for instance in ("sse-1", "sse-other"):
            mine = [json.loads(f["data"])["id"] for f in frames if json.loads(f["data"])["partitionkey"] == instance]
            assert mine == _outbox_ids(env, instance_id=instance)
        assert all(json.loads(f["data"])["data"]["workflow_type"] == "orders" for f in frames)
        # The feed tails the bus without a consumer group: the scheduler's group still has everything to read.
        assert sum(s.bus.lag(SCHED.group).values()) == len(_outbox_ids(env))
        bad = s.http.get("/instances/sse-1/events", headers={"Last-Event-ID": "nonsense:1"})
        assert bad.status_code == 400 and bad.json()["error"] == "bad_last_event_id"


def _slow_client(url: str, path: str) -> socket.socket:
    """A client that sends its request and then reads nothing (a small receive buffer, never drained)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.connect((host, int(port)))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n".encode())
    return sock


def _read_all(sock: socket.socket, until: bytes, timeout: float = 60.0) -> bytes:
    """Read until ``until`` and the end of the frame it starts (a chunk may end in the middle of a line)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while (until not in data or b"\n\n" not in data.split(until, 1)[1]) and time.monotonic() < deadline:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("env", ["sqlite-embedded", pytest.param("postgresql-redis", marks=[
    pytest.mark.postgres, pytest.mark.redis])], indirect=True)
def test_a_slow_client_is_dropped_with_a_reason_and_never_holds_up_the_others(env: Env) -> None:
    total, batch = 3000, 25
    with serving(env, sse_buffer=256) as s:
        hub = s.app.hub
        assert hub is not None
        slow = _slow_client(s.url, "/types/orders/events")
        fast = Stream(s.http, "/types/orders/events")
        wait_for(lambda: hub.stats.clients["type"] == 2, 10, what="both clients to subscribe")
        events = [CloudEvent(id=new_event_id(), type=TASK_STATUS_CHANGED, subject=str(n), partitionkey=f"slow-{n % 7}",
                             time=datetime.now(UTC), data={"workflow_type": "orders", "n": n, "pad": "p" * 2500})
                  for n in range(total)]
        publisher = env.open_bus()

        def publish(stop: threading.Event) -> None:
            for start in range(0, total, batch):
                publisher.publish(events[start:start + batch])
                time.sleep(0.005)

        s.background(publish)
        frames = fast.events(total, timeout=120)
        fast.close()
        got = [json.loads(f["data"])["id"] for f in frames]
        assert sorted(got) == sorted(e.id for e in events) and len(set(got)) == total
        key_of = {e.id: e.partitionkey for e in events}
        for key in set(key_of.values()):  # each instance's events in publish order
            assert [g for g in got if key_of[g] == key] == [e.id for e in events if e.partitionkey == key]
        assert hub.stats.dropped == 1 and s.app.metrics.value("pollbridge_serve_sse_dropped_total") == 1
        # The bus reader reached the end of the bus: nothing held it up.
        assert hub.positions() == s.bus.end_positions(range(s.bus.partitions))
        tail = _read_all(slow, b"event: dropped")
        slow.close()
        assert b"event: dropped" in tail
        reason = json.loads(tail.split(b"event: dropped\ndata: ", 1)[1].split(b"\n", 1)[0])["reason"]
        assert reason.startswith("too slow: 256 events were waiting for this client")


def _chain(prefix: str, instances: int, length: int) -> list[WorkflowSpec]:
    return [WorkflowSpec(f"{prefix}-{n:04d}", "orders",
                         tuple(TaskSpec(f"t{k}", (f"t{k - 1}",) if k else ()) for k in range(length)))
            for n in range(instances)]


def _run_workload(env: Env, prefix: str) -> tuple[float, float | None]:
    """Seed a small workload on the running event path; seconds until it settles, p50 ready->dispatch in ms."""
    specs = _chain(prefix, 20, 5)
    ids = [s.instance_id for s in specs]
    started = time.monotonic()
    with env.engine.begin() as conn:
        seed(conn, env.tables, specs)

    def settled() -> bool:
        with env.engine.connect() as conn:
            return verify(conn, env.tables, ids).unsettled == 0

    wait_for(settled, 120, interval=0.05, what=f"workload {prefix} to settle")
    elapsed = time.monotonic() - started
    with env.engine.connect() as conn:
        verdict = verify(conn, env.tables, ids)
    assert (verdict.lost, verdict.double_dispatched, verdict.early) == (0, 0, 0), verdict.problems
    assert verdict.completed == verdict.tasks == 100
    return elapsed, percentile(verdict.latencies_ms.get("events", []), 50)


@pytest.mark.slow
@pytest.mark.parametrize("env", ["sqlite-embedded", pytest.param("postgresql-redis", marks=[
    pytest.mark.postgres, pytest.mark.redis])], indirect=True)
def test_two_hundred_idle_sse_clients_do_not_slow_the_dispatch_path(env: Env) -> None:
    """Figures (printed with -s) go to docs/serve.md; the asserts are generous bounds and the reader's state."""
    with serving(env) as s:
        hub = s.app.hub
        assert hub is not None
        s.background(Relay(env.engine, env.open_bus(), RELAY, statuses=env.tables.mapping.statuses).run)
        s.background(EventScheduler(env.engine, env.tables, env.open_bus(), SCHED, FixedRouter("cutover"),
                                    visibility_timeout=1.0, registry=CollectorRegistry()).run)
        pool = WorkerPool(env.engine, env.tables, WORKERS, seed=5)
        pool.start()
        try:
            _run_workload(env, "warm")
            without = _run_workload(env, "bare")
            clients = [_slow_client(s.url, f"/instances/idle-{n}/events") for n in range(100)]
            clients += [_slow_client(s.url, f"/types/idle-type-{n}/events") for n in range(100)]
            wait_for(lambda: hub.stats.clients == {"instance": 100, "type": 100}, 30,
                     what="200 idle clients to subscribe")
            with_clients = _run_workload(env, "crowd")
            wait_for(lambda: _published(env), 20, what="the outbox to drain")
            wait_for(lambda: hub.positions() == s.bus.end_positions(range(s.bus.partitions)), 10,
                     what="the SSE bus reader to reach the end of the bus")
            assert hub.healthy and hub.stats.clients == {"instance": 100, "type": 100}
            assert hub.stats.dropped == 0
            health = s.http.get("/healthz")
            assert health.status_code == 200 and health.json()["bus_reader"]["clients"]["instance"] == 100
            scrape = s.http.get("/metrics").text  # ready->dispatch latency of the window, by path
            assert 'pollbridge_dispatch_latency_window_seconds_bucket{le="+Inf",path="events",workflow_type="orders"}' \
                in scrape
            for sock in clients:
                sock.close()
        finally:
            pool.stop()
    print(f"\n[{env.kind}] 100 tasks, event path: without SSE clients {without[0]:.2f} s (p50 {without[1]} ms); "
          f"with 200 idle SSE clients {with_clients[0]:.2f} s (p50 {with_clients[1]} ms)")
    assert with_clients[0] < 60.0  # generous: a blocked dispatch path would not finish at all


# ------------------------------------------------------------------------------------------------ the rest

def test_healthz_metrics_and_tasks(sqlite_env: Env) -> None:
    env = sqlite_env
    with env.engine.begin() as conn:
        seed(conn, env.tables, [WorkflowSpec("obs-1", "orders", (TaskSpec("a"),))])
    task = _ids(env, "obs-1")["a"]
    with serving(env) as s:
        health = s.http.get("/healthz")
        assert health.status_code == 200, health.text
        doc = health.json()
        assert doc["status"] == "ok" and doc["database"]["up"] and doc["bus_reader"]["up"]
        assert doc["signals"] == "enabled"
        metrics = s.http.get("/metrics")
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
        text = metrics.text
        for name in ("pollbridge_status_up 1.0", "pollbridge_outbox_backlog 1.0", "pollbridge_bus_up 1.0",
                     "pollbridge_serve_bus_reader_up 1.0", 'pollbridge_serve_sse_clients{stream="instance"} 0.0',
                     "# TYPE pollbridge_serve_signals_total counter", "# TYPE pollbridge_dispatches_window gauge"):
            assert name in text, name
        assert SECRET not in text and SECRET not in health.text
        t = s.http.get(f"/tasks/{task}").json()
        assert {k: t[k] for k in ("task_id", "instance_id", "task_key", "workflow_type", "status",
                                  "logical_status")} == {"task_id": str(task), "instance_id": "obs-1",
                                                         "task_key": "a", "workflow_type": "orders",
                                                         "status": "pending", "logical_status": "pending"}
        assert s.http.get("/nowhere").status_code == 404
    # The bus reader cannot reach its bus: /healthz says so (503) while everything else still answers.
    settings = Settings(database_url=env.url, serve=ServeSettings(sse_keepalive=0.5))
    app = ServeApp(ServeContext(settings, env.engine, env.tables, _Unreachable(env.open_bus()), None),
                   registry=CollectorRegistry())
    server = BackgroundServer(app, "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=20) as http:
            wait_for(lambda: app.hub is not None and app.hub.stats.failures > 0, 10, what="a failed bus read")
            r = http.get("/healthz")
            assert r.status_code == 503 and not r.json()["bus_reader"]["up"]
            assert "bus down for the test" in r.json()["bus_reader"]["detail"]
            assert http.get("/instances/x/events").status_code == 503
            assert http.get(f"/tasks/{task}").status_code == 200
            assert "pollbridge_serve_bus_reader_up 0.0" in http.get("/metrics").text
    finally:
        server.stop()


class _Unreachable(EventBus):
    """A bus that cannot be tailed (as when Redis is down for the feed); the rest is the real bus."""

    def __init__(self, inner: EventBus) -> None:
        self.inner = inner
        self.partitions = inner.partitions

    def end_positions(self, partitions: Any) -> dict[int, str]:
        raise ConnectionError("bus down for the test")

    def tail(self, after: Any, count: int, block: float) -> list[Delivery]:
        raise ConnectionError("bus down for the test")

    def publish(self, events: Any) -> None:
        self.inner.publish(events)

    def ensure_group(self, group: str) -> None:
        self.inner.ensure_group(group)

    def read(self, group: str, consumer: str, partitions: Any, count: int, block: float) -> list[Delivery]:
        return self.inner.read(group, consumer, partitions, count, block)

    def ack(self, group: str, deliveries: Any) -> None:
        self.inner.ack(group, deliveries)

    def claim_stale(self, group: str, consumer: str, partitions: Any, min_idle: float, count: int) -> list[Delivery]:
        return self.inner.claim_stale(group, consumer, partitions, min_idle, count)

    def pending_count(self, group: str) -> int:
        return self.inner.pending_count(group)

    def lag(self, group: str) -> dict[int, int]:
        return self.inner.lag(group)

    def dead_letter(self, group: str, delivery: Delivery, reason: str) -> None:
        self.inner.dead_letter(group, delivery, reason)

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        return self.inner.dead_letters(limit)

    def remove_dead_letters(self, ids: Any) -> int:
        return self.inner.remove_dead_letters(ids)

    def trim(self, retention: float) -> int:
        return self.inner.trim(retention)

    def epoch(self) -> str:
        return self.inner.epoch()

    def close(self) -> None:
        self.inner.close()
