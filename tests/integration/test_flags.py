"""The flag store, the routing hash in SQL and the flag router, on SQLite and PostgreSQL."""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.core.errors import FlagError, FlagStoreUnavailable
from bridge.core.phases import Flag, bucket, percent_threshold, poller_should_handle
from bridge.db.clock import db_clock
from bridge.db.engine import create_engine
from bridge.db.schema import flag_audit, flags
from bridge.flags.router import FlagRouter
from bridge.flags.store import FlagStore
from tests.support import SHARED_DB_PARAMS, reset_shared, shared_engine, wait_for


@pytest.fixture(params=SHARED_DB_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    """Overrides the per-test database: the module's shared one for the dialect, emptied (``shared_engine``)."""
    return shared_engine(request)


@pytest.fixture
def store(engine: Engine) -> FlagStore:
    return FlagStore(engine, default_grace=7.0)


def _counts(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (conn.execute(sa.select(sa.func.count()).select_from(flags)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(flag_audit)).scalar_one())


def _split(workflow_type: str, percent: float, n: int = 2) -> tuple[list[str], list[str]]:
    """``n`` instance ids inside ``percent`` for the type and ``n`` outside."""
    threshold = percent_threshold(percent)
    ids = [f"inst-{k}" for k in range(2000)]
    inside = [i for i in ids if bucket(workflow_type, i) < threshold][:n]
    outside = [i for i in ids if bucket(workflow_type, i) >= threshold][:n]
    return inside, outside


# --- the store ------------------------------------------------------------------------------------

def test_round_trip_and_audit_rows(engine: Engine, store: FlagStore) -> None:
    """A change writes the flag and one audit row with actor, reason, old and new phase/percent, forced and
    the gate JSON; reading back gives the same values; a type without a row is polling with the default grace."""
    assert store.all() == {}
    default = store.get("orders")
    assert (default.phase, default.percent, default.grace_seconds) == ("polling", None, 7.0)

    first = store.change("orders", "dual_write", actor="alice", reason="  shadow it  ")
    assert (first.workflow_type, first.action, first.actor, first.reason) == ("orders", "set", "alice", "shadow it")
    assert (first.old_phase, first.new_phase, first.old_percent, first.new_percent) == ("polling", "dual_write",
                                                                                        None, None)
    assert (first.forced, first.gate) == (False, None)

    gate = {"passed": False, "criteria": [{"name": "min_tasks", "passed": False, "detail": "3 compared"}]}
    second = store.change("orders", "selective", actor="bob", reason="canary", percent=25, forced=True, gate=gate,
                          grace_seconds=2.5, thresholds={"min_tasks": 5})
    assert (second.old_phase, second.new_phase, second.old_percent, second.new_percent) == ("dual_write", "selective",
                                                                                            None, 25.0)
    assert second.forced is True
    assert second.gate == gate
    assert second.changed_at >= first.changed_at

    flag = store.get("orders")
    assert (flag.phase, flag.percent, flag.grace_seconds, flag.updated_by) == ("selective", 25.0, 2.5, "bob")
    assert flag.thresholds == {"min_tasks": 5.0}
    assert flag.updated_at is not None
    assert set(store.all()) == {"orders"}

    # Thresholds merge; the grace stays when not given.
    store.change("orders", "selective", actor="bob", reason="budget", percent=25, thresholds={"miss_budget": 0.01})
    flag = store.get("orders")
    assert flag.thresholds == {"min_tasks": 5.0, "miss_budget": 0.01}
    assert flag.grace_seconds == 2.5

    history = store.history("orders")
    assert [(c.old_phase, c.new_phase) for c in history] == [
        ("polling", "dual_write"), ("dual_write", "selective"), ("selective", "selective")]
    assert [c.id for c in history] == sorted(c.id for c in history)
    assert history[1] == second
    assert history[1].to_json()["gate"] == gate
    assert _counts(engine) == (1, 3)


def test_history_filters_and_limits(store: FlagStore) -> None:
    """history(type) keeps that type's rows; limit keeps the most recent, still oldest first."""
    store.change("orders", "dual_write", actor="a", reason="1")
    store.change("reports", "dual_write", actor="a", reason="2")
    store.change("orders", "selective", actor="a", reason="3", percent=10)
    store.change("orders", "cutover", actor="a", reason="4")
    assert [c.reason for c in store.history()] == ["1", "2", "3", "4"]
    assert [c.reason for c in store.history("orders")] == ["1", "3", "4"]
    assert [c.reason for c in store.history("orders", limit=2)] == ["3", "4"]
    assert [c.reason for c in store.history(limit=1)] == ["4"]
    assert store.history("nothing") == []


def test_last_rollback(store: FlagStore) -> None:
    """last_rollback is the time of the latest change recorded as action 'rollback' (None before any)."""
    store.change("orders", "dual_write", actor="a", reason="up")
    assert store.last_rollback("orders") is None
    back = store.change("orders", "polling", actor="a", reason="rehearsal", action="rollback")
    store.change("orders", "dual_write", actor="a", reason="up again")
    last = store.last_rollback("orders")
    assert last is not None
    assert last.replace(tzinfo=None) == back.changed_at.replace(tzinfo=None)
    assert store.last_rollback("reports") is None


def test_stale_expected_flag_refuses_and_writes_nothing(engine: Engine, store: FlagStore) -> None:
    """Two operators racing: a change based on a flag that changed meanwhile is refused, nothing written."""
    seen = store.get("orders")
    store.change("orders", "dual_write", actor="guardian", reason="first")
    before = _counts(engine)
    with pytest.raises(FlagError, match="changed meanwhile"):
        store.change("orders", "cutover", actor="bob", reason="late", expected=seen)
    assert _counts(engine) == before
    assert store.get("orders").phase == "dual_write"
    # The current view is accepted.
    store.change("orders", "selective", actor="bob", reason="fresh", percent=5, expected=store.get("orders"))
    assert store.get("orders").percent == 5.0


def test_a_percent_change_alone_is_a_conflict(store: FlagStore) -> None:
    """expected compares the percentage too: selective 10% is not selective 50%."""
    store.change("orders", "selective", actor="a", reason="x", percent=10)
    seen = store.get("orders")
    store.change("orders", "selective", actor="a", reason="y", percent=50)
    with pytest.raises(FlagError, match="changed meanwhile"):
        store.change("orders", "cutover", actor="a", reason="z", expected=seen)


INVALID_CHANGES: list[tuple[tuple[str, str], dict[str, object]]] = [
    (("bad name", "dual_write"), {}),
    (("orders", "everywhere"), {}),
    (("orders", "selective"), {"percent": 150}),
    (("orders", "cutover"), {"percent": 10}),
    (("orders", "dual_write"), {"reason": "   "}),
    (("orders", "dual_write"), {"actor": ""}),
    (("orders", "selective"), {"grace_seconds": 0}),
    (("orders", "selective"), {"grace_seconds": float("nan")}),
    (("orders", "selective"), {"thresholds": {"min_tasks": -1}}),
    (("orders", "selective"), {"thresholds": {"bogus": 1}}),
]


def test_invalid_change_writes_nothing(engine: Engine, store: FlagStore) -> None:
    """Every invalid request (bad name, phase, percentage, reason, actor, grace, threshold) is a FlagError
    (exit 2) and leaves both tables untouched."""
    store.change("orders", "dual_write", actor="a", reason="baseline")
    before = _counts(engine)
    for args, kwargs in INVALID_CHANGES:
        call: dict[str, object] = {"actor": "a", "reason": "r", **kwargs}
        with pytest.raises(FlagError) as info:
            store.change(*args, **call)  # type: ignore[arg-type]
        assert info.value.exit_code == 2, (args, kwargs)
        assert _counts(engine) == before, (args, kwargs)
    assert store.get("orders").phase == "dual_write"


# --- the routing hash in SQL ----------------------------------------------------------------------

def _sql_buckets(engine: Engine, pairs: Sequence[tuple[str | None, str]]) -> list[int]:
    out: list[int] = []
    with engine.connect() as conn:
        for start in range(0, len(pairs), 200):
            chunk = pairs[start:start + 200]
            cols = [sa.func.pollbridge_bucket(sa.literal(t, sa.String), sa.literal(i, sa.String)).label(f"b{n}")
                    for n, (t, i) in enumerate(chunk)]
            out.extend(int(v) for v in conn.execute(sa.select(*cols)).one())
    return out


def test_sql_bucket_equals_python_bucket(engine: Engine) -> None:
    """pollbridge_bucket in SQL (a PostgreSQL function; registered on SQLite connections) gives exactly
    routing.bucket for 600 random pairs, including ones whose 32-bit prefix has the top bit set (a signed
    cast would go negative), non-ASCII text and a NULL type."""
    rng = random.Random(5)
    alphabet = string.ascii_letters + string.digits + "-_./:@é☃"
    pairs: list[tuple[str | None, str]] = [
        ("".join(rng.choices(alphabet, k=rng.randint(1, 20))), "".join(rng.choices(alphabet, k=rng.randint(0, 30))))
        for _ in range(600)
    ]
    pairs += [("orders", "i-1"), (None, "x"), ("", "x")]
    expected = [bucket(t, i) for t, i in pairs]
    assert _sql_buckets(engine, pairs) == expected
    assert expected[-3:] == [2167, 1280, 1280]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.none() | st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30),
                          st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30)),
                min_size=1, max_size=40))
def test_sql_bucket_equals_python_bucket_property(engine: Engine, pairs: list[tuple[str | None, str]]) -> None:
    """Property: for any (type, instance) text pairs, SQL and Python agree on the bucket."""
    assert _sql_buckets(engine, pairs) == [bucket(t, i) for t, i in pairs]


@pytest.mark.postgres
def test_pg_poller_should_handle_matches_python(pg_shared: Engine) -> None:
    """pollbridge_poller_should_handle (for users' own pollers) agrees with routing.poller_should_handle for
    every phase: no flag, polling, dual_write, cutover, selective without a percentage, and selective 50%
    for instances inside and outside it, before and after the grace period, and with no readiness time."""
    engine = reset_shared(pg_shared)
    store = FlagStore(engine)
    store.change("p", "polling", actor="t", reason="r")
    store.change("dw", "dual_write", actor="t", reason="r")
    store.change("cut", "cutover", actor="t", reason="r", grace_seconds=5)
    store.change("all", "selective", actor="t", reason="r", grace_seconds=5)
    store.change("half", "selective", actor="t", reason="r", percent=50, grace_seconds=5)
    stored = store.all()
    inside, outside = _split("half", 50.0, 1)
    instances = [*inside, *outside, "i-1"]
    checked = 0
    fn = sa.func.pollbridge_poller_should_handle
    with engine.connect() as conn:
        for workflow_type in ("none", "p", "dw", "cut", "all", "half"):
            for instance in instances:
                now = db_clock(engine)
                for ready_since in (None, now + timedelta(seconds=1), now, now - timedelta(seconds=3),
                                    now - timedelta(seconds=8), now - timedelta(hours=1)):
                    got = conn.execute(sa.select(fn(workflow_type, instance, ready_since))).scalar_one()
                    want = poller_should_handle(stored.get(workflow_type), instance, ready_since, now)
                    assert got is want, (workflow_type, instance, ready_since)
                    checked += 1
        # The cases that matter, spelled out.
        recent, old = now - timedelta(seconds=1), now - timedelta(seconds=60)
        assert conn.execute(sa.select(fn("half", inside[0], recent))).scalar_one() is False
        assert conn.execute(sa.select(fn("half", inside[0], old))).scalar_one() is True
        assert conn.execute(sa.select(fn("half", outside[0], recent))).scalar_one() is True
        assert conn.execute(sa.select(fn("cut", outside[0], old))).scalar_one() is False
        assert conn.execute(sa.select(fn("none", "x", recent))).scalar_one() is True
    assert checked == 6 * len(instances) * 6


# --- the flag router ------------------------------------------------------------------------------

@pytest.fixture
def router(store: FlagStore) -> Iterator[FlagRouter]:
    r = FlagRouter(store, refresh_interval=0.05, registry=CollectorRegistry())
    yield r
    r.stop()


def _rename_flags(engine: Engine, away: bool) -> None:
    old, new = ("pollbridge_flags", "pollbridge_flags_away") if away else ("pollbridge_flags_away", "pollbridge_flags")
    with engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {old} RENAME TO {new}"))


def test_phase_change_visible_after_refresh(store: FlagStore, router: FlagRouter) -> None:
    """The router answers from memory: a change shows only after refresh(), then in every route."""
    assert router.refresh() is True
    assert router.event_route("orders", "i-1") == "off"
    assert router.flag("orders").grace_seconds == 7.0  # no row: the store's default grace
    store.change("orders", "dual_write", actor="a", reason="r")
    assert router.event_route("orders", "i-1") == "off"  # not re-read yet
    assert router.refresh() is True
    assert router.event_route("orders", "i-1") == "shadow"
    assert router.event_route("reports", "i-1") == "off"
    inside, outside = _split("orders", 30.0, 1)
    store.change("orders", "selective", actor="a", reason="r", percent=30)
    router.refresh()
    assert router.event_route("orders", inside[0]) == "dispatch"
    assert router.event_route("orders", outside[0]) == "off"
    assert set(router.flags()) == set(router.poller_flags()) == {"orders"}


def test_listeners_get_old_and_new_flags(store: FlagStore, router: FlagRouter) -> None:
    """on_change listeners are called once per refresh that saw different flags, with (old, new); a failing
    listener neither stops the others nor the router."""
    calls: list[tuple[dict[str, Flag], dict[str, Flag]]] = []

    def broken(old: dict[str, Flag], new: dict[str, Flag]) -> None:
        raise RuntimeError("listener bug")

    router.on_change(broken)
    router.on_change(lambda old, new: calls.append((old, new)))
    router.refresh()
    assert calls == []  # nothing stored, nothing changed
    store.change("orders", "dual_write", actor="a", reason="r")
    assert router.refresh() is True
    assert len(calls) == 1
    old, new = calls[0]
    assert old == {}
    assert new["orders"].phase == "dual_write"
    router.refresh()
    assert len(calls) == 1  # unchanged: no call
    store.change("orders", "polling", actor="a", reason="back", action="rollback")
    router.refresh()
    assert len(calls) == 2
    assert (calls[1][0]["orders"].phase, calls[1][1]["orders"].phase) == ("dual_write", "polling")


def test_unreadable_store_fails_safe_both_ways_and_recovers(engine: Engine, store: FlagStore) -> None:
    """Store unreadable: the poller's view is empty (every type polling, the poller takes everything back),
    while the event path keeps the last flags it read; the gauge says the store is down. Once readable,
    both views are the stored flags again."""
    registry = CollectorRegistry()
    router = FlagRouter(store, registry=registry)
    store.change("orders", "cutover", actor="a", reason="r")
    inside, outside = _split("reports", 50.0, 1)
    store.change("reports", "selective", actor="a", reason="r", percent=50)
    assert router.refresh() is True
    now = db_clock(engine)
    assert router.healthy
    assert router.poller_should_handle("orders", "i-1", now, now) is False
    assert registry.get_sample_value("pollbridge_flag_store_up") == 1
    assert registry.get_sample_value("pollbridge_flag_phase", {"workflow_type": "orders", "phase": "cutover"}) == 1

    _rename_flags(engine, away=True)
    try:
        with pytest.raises(FlagStoreUnavailable):
            store.all()
        assert router.refresh() is False
        assert not router.healthy
        assert router.poller_flags() == {}
        assert router.poller_should_handle("orders", "i-1", now, now) is True
        assert router.poller_should_handle("reports", inside[0], now, now) is True
        assert router.event_route("orders", "i-1") == "dispatch"
        assert router.event_route("reports", inside[0]) == "dispatch"
        assert router.event_route("reports", outside[0]) == "off"
        assert registry.get_sample_value("pollbridge_flag_store_up") == 0
    finally:
        _rename_flags(engine, away=False)
    assert router.refresh() is True
    assert router.healthy
    assert set(router.poller_flags()) == {"orders", "reports"}
    assert router.poller_should_handle("orders", "i-1", now, now) is False
    assert registry.get_sample_value("pollbridge_flag_store_up") == 1


def test_dead_engine_is_unavailable_not_a_crash(tmp_path: object) -> None:
    """A store on a database that cannot be opened raises FlagStoreUnavailable; the router reports it and
    gives the poller an empty (all polling) view."""
    engine = create_engine(f"sqlite:///{tmp_path}/no/such/dir/x.db")
    try:
        store = FlagStore(engine)
        with pytest.raises(FlagStoreUnavailable, match="cannot read the flag store"):
            store.all()
        router = FlagRouter(store)
        assert router.refresh() is False
        assert router.poller_flags() == {}
        assert router.event_route("orders", "i") == "off"
    finally:
        engine.dispose()


def test_refresh_thread_follows_changes(store: FlagStore, router: FlagRouter) -> None:
    """start(): a phase change reaches the router within its refresh interval, without an explicit refresh."""
    router.start()
    assert router.event_route("orders", "i-1") == "off"
    store.change("orders", "cutover", actor="a", reason="r")
    wait_for(lambda: router.event_route("orders", "i-1") == "dispatch", 5, what="router to see cutover")
    store.change("orders", "polling", actor="a", reason="back", action="rollback")
    wait_for(lambda: router.event_route("orders", "i-1") == "off", 5, what="router to see the rollback")
    router.stop()
    assert router._thread is None


def test_a_change_is_notified_to_every_router_at_once(engine: Engine, store: FlagStore) -> None:
    """PostgreSQL: a change commits with a NOTIFY and every started router re-reads at once. With both
    intervals an hour long, only the notification can explain a router that sees the change."""
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite has no LISTEN/NOTIFY: its routers re-read every refresh_interval")
    routers = [FlagRouter(store, refresh_interval=3600, fallback_interval=3600, registry=CollectorRegistry()).start()
               for _ in range(2)]
    try:
        store.change("orders", "dual_write", actor="a", reason="r")
        for r in routers:
            wait_for(lambda r=r: r.flag("orders").phase == "dual_write", 5, what="the notified re-read")
        store.change("orders", "polling", actor="a", reason="back", action="rollback")
        for r in routers:
            wait_for(lambda r=r: r.flag("orders").phase == "polling", 5, what="the notified rollback")
    finally:
        for r in routers:
            r.stop()


def test_flag_timestamps_are_database_time(engine: Engine, store: FlagStore) -> None:
    """updated_at and changed_at come from the database clock (comparable with the dispatch log)."""
    before = db_clock(engine)
    change = store.change("orders", "dual_write", actor="a", reason="r")
    after = db_clock(engine)
    flag = store.get("orders")
    assert flag.updated_at is not None

    def naive(value: datetime) -> datetime:
        return value.replace(tzinfo=None) if value.tzinfo is None else value.astimezone(before.tzinfo).replace(
            tzinfo=None)

    lo, hi = naive(before) - timedelta(milliseconds=2), naive(after) + timedelta(milliseconds=2)
    assert lo <= naive(change.changed_at) <= hi
    assert lo <= naive(flag.updated_at) <= hi
