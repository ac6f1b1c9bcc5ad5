"""Smoke tests of the benchmark scripts' pure parts (the scripts themselves run in CI with --quick)."""

from __future__ import annotations

import importlib
import sqlite3
from pathlib import Path

import pytest

from bench import _paths_common as pc
from bench.paths import build_workload
from bridge.reference.oracle import percentile


@pytest.mark.parametrize("module", ["bench.paths", "bench.scale", "bench.peers", "bench.minimal", "bench.cost",
                                    "bench.backends", "bench.e2e", "bench.hops"])
def test_help_parses(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(["--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_e2e_plan_puts_approvals_on_tasks_with_a_dependency_and_classifies_what_made_a_task_ready() -> None:
    from types import SimpleNamespace

    from bench.e2e import _kind, build_plan

    plan = build_plan(40, 6, 4.0, 0.5, 7, "p")
    assert plan == build_plan(40, 6, 4.0, 0.5, 7, "p")  # the same for every configuration
    assert plan.offsets[:3] == [0.0, 0.25, 0.5]
    assert 10 <= len(plan.approvals) <= 30
    for spec in plan.specs:
        awaiting = [t for t in spec.tasks if t.awaits_signal]
        if spec.instance_id in plan.approvals:
            key, at = plan.approvals[spec.instance_id]
            assert [t.key for t in awaiting] == [key] and awaiting[0].depends_on
            assert 0.3 <= at - plan.offsets[plan.specs.index(spec)] <= 2.5
        else:
            assert not awaiting

    def row(ready: str, due: str | None = None, signal: str | None = None, deps: object = "[]") -> SimpleNamespace:
        return SimpleNamespace(ready_at=ready, due_at=due, signal_received_at=signal, depends_on=deps)

    t, later = "2026-12-06 10:00:00.000", "2026-12-06 10:00:01.000"
    assert _kind(row(t, signal=t, due=later, deps='["a"]')) == "approval"
    # The signal's updated_at, the ready time, stamped microseconds after its signal_received_at: still the approval.
    assert _kind(row("2026-12-06 10:00:00.000007", signal=t, deps=["a"])) == "approval"
    assert _kind(row("2026-12-06 10:00:00.002", signal=t, deps=["a"])) == "dependency"
    assert _kind(row(t, due=t, signal=later, deps=["a"])) == "timer"
    assert _kind(row(later, due=t, signal=t, deps=["a"])) == "dependency"
    assert _kind(row(later, deps='["a"]')) == "dependency"
    assert _kind(row(later, due=t)) == "arrival"


def test_scale_is_reachable_from_paths(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.paths import main

    with pytest.raises(SystemExit):
        main(["--scale", "--help"])
    assert "python -m bench.scale" in capsys.readouterr().out


def test_workload_is_the_same_for_every_path() -> None:
    a = build_workload(30, 10, 10.0, "steady", seed=3)
    b = build_workload(30, 10, 10.0, "steady", seed=3)
    assert a == b
    assert {s.workflow_type for s in a.specs} == {"orders", "reports", "etl"}
    assert a.tasks == sum(len(s.tasks) for s in a.specs)
    assert a.offsets[:3] == [0.0, 0.1, 0.2]
    burst = build_workload(5, 4, 10.0, "burst", seed=3)
    assert burst.offsets == [0.0] * 5
    poisson = build_workload(50, 4, 10.0, "poisson", seed=3)
    assert poisson.offsets == sorted(poisson.offsets)


def test_percentiles_ranked_in_sql_match_nearest_rank() -> None:
    values = [float(v) for v in (7, 1, 3, 9, 4, 4, 12, 0.5, 30, 2)]
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE l (ms REAL)")
    conn.executemany("INSERT INTO l VALUES (?)", [(v,) for v in values])
    n, got = pc.ranked(lambda q, p: conn.execute(q, p).fetchall(), "SELECT ms FROM l", (), (0.5, 0.9, 0.99, 1.0))
    assert n == len(values)
    for q in (0.5, 0.9, 0.99, 1.0):
        assert got[q] == percentile(values, q * 100)
    assert pc.summary(n, got)["max_ms"] == 30.0


def test_table_and_no_png() -> None:
    text = pc.table(["path", "p50 ms"], [["events", 3.14159], ["poller", 1234.0], ["x", None]])
    assert "3.14" in text and "1,234" in text and "-" in text
    assert pc.plot(None, "t", "x", "y", {"a": [[1.0, 0.5]]}) is None


def test_png_drawn_when_matplotlib_is_there(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "cdf.png"
    assert pc.plot(str(png), "t", "x", "y", {"a": [[1.0, 0.5], [2.0, 1.0]]}, logx=True, step=True) is None
    assert png.stat().st_size > 1000


def test_cost_counts_sqlite_write_transactions_and_plots(tmp_path: Path) -> None:
    from bench import cost

    before = {"n": 3, "texts": {"BEGIN IMMEDIATE": 2, "SELECT 1": 1}}
    after = {"n": 9, "texts": {"BEGIN IMMEDIATE": 5, "BEGIN": 1, "SELECT 1": 3}}
    assert cost._begins(before, after) == 3
    assert cost.plot(None, {"windows": []}) is None
    pytest.importorskip("matplotlib")
    windows = [{"config": "trigger", "rate": r, "transactions_per_completion": 60 / r, "statements_per_completion": 4.0,
                "p50_ms": 4.0, "p99_ms": 20.0} for r in (2.0, 20.0)]
    windows += [{"config": "embedded", "rate": 20.0, "statements_per_completion": 80.0, "p50_ms": 16.0, "p99_ms": 90.0},
                {"config": "trigger", "rate": 0.0, "transactions_per_completion": None, "p50_ms": None, "p99_ms": None},
                {"config": "wal", "rate": 2.0, "error": "broke"}]
    png = tmp_path / "cost.png"
    assert cost.plot(str(png), {"windows": windows}) is None
    assert png.stat().st_size > 1000


def test_cost_splits_latency_at_the_completers_commit() -> None:
    """Each dispatch's latency is split where its completion's batch committed; one outside every batch is left
    out (not paired with a neighbour's commit)."""
    from bench import cost

    commits = [(100.0, 100.002), (100.5004, 100.530)]  # the second commit took 30 ms
    rows = [(100.001, 100.005), (100.501, 100.534), (100.2, 100.3)]  # the last falls between batches
    stages = cost._stages(lambda _q, _p: rows, "postgresql", "ready_at >= :t0", {}, commits)
    assert stages["completer_commit"]["n"] == 2 and stages["commit_to_dispatch"]["n"] == 2
    assert stages["completer_commit"]["max_ms"] == pytest.approx(29.0)
    assert stages["commit_to_dispatch"]["max_ms"] == pytest.approx(4.0)
    assert stages["commit_to_dispatch"]["p50_ms"] == pytest.approx(3.0)
    # SQLite's millisecond stamp, rounded down, can fall just before its batch began: still that batch's.
    sqlite = cost._stages(lambda _q, _p: [(100.500, 100.534)], "sqlite", "ready_at >= :t0", {}, commits)
    assert sqlite["completer_commit"]["n"] == 1 and sqlite["commit_to_dispatch"]["max_ms"] == pytest.approx(4.0)


def test_e2e_splits_a_dependencys_wait_at_its_last_upstreams_commit_and_the_bus() -> None:
    """The split takes the latest of a join's upstream commits (not the first), the bus time of the latest event,
    and leaves out (counted) a dispatch whose upstream commit is unknown or not between its ready time and its
    dispatch, and from the bus split one whose upstream event was added after the dispatch."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from bench.e2e import DependencySplit

    t0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)

    def at(ms: float) -> datetime:
        return t0 + timedelta(milliseconds=ms)

    join = SimpleNamespace(instance_id="i1", task_key="join", depends_on='["a", "b"]', ready_at=at(0),
                           dispatched_at=at(20))
    commits = {("i1", "a"): at(-30), ("i1", "b"): at(2), ("i2", "a"): at(50)}
    published = {("i1", "a"): at(-29), ("i1", "b"): at(9)}
    split = DependencySplit()
    assert split.add(join, commits, published) == (pytest.approx(2.0), pytest.approx(7.0))
    unknown = SimpleNamespace(instance_id="i3", task_key="x", depends_on=["a"], ready_at=at(0), dispatched_at=at(5))
    rewritten = SimpleNamespace(instance_id="i2", task_key="x", depends_on=["a"], ready_at=at(0),
                                dispatched_at=at(5))
    assert split.add(unknown, commits, published) == (None, None)
    assert split.add(rewritten, commits, published) == (None, None)
    # A join dispatched on its first upstream's event: the second's event was added after the dispatch.
    early = SimpleNamespace(instance_id="i4", task_key="join", depends_on=["a", "b"], ready_at=at(0),
                            dispatched_at=at(6))
    assert split.add(early, {("i4", "a"): at(-5), ("i4", "b"): at(1)},
                     {("i4", "a"): at(-4), ("i4", "b"): at(8)}) == (pytest.approx(1.0), None)
    summary = split.summary()
    assert summary is not None
    assert summary["left_out"] == 2 and summary["left_out_of_bus"] == 1
    assert summary["worker_commit"]["n"] == 2 and summary["commit_to_dispatch"]["max_ms"] == pytest.approx(18.0)
    assert summary["commit_to_bus_ms_resolution"]["n"] == 1
    assert summary["bus_to_dispatch_ms_resolution"]["max_ms"] == pytest.approx(11.0)
    # Without the bus's times (SQLite, the embedded bus) the commit split stands alone.
    alone = DependencySplit()
    assert alone.add(join, commits, {}) == (pytest.approx(2.0), None)
    assert DependencySplit().summary() is None


def test_backends_reports_an_unknown_backend_and_summarises() -> None:
    import contextlib

    from bench import backends

    with contextlib.ExitStack() as resources, pytest.raises(backends.Unavailable, match="unknown backend"):
        backends.set_up("nosuch", resources)
    assert backends.ordered([1, 2, 3], 0) == [1, 2, 3] and backends.ordered([1, 2, 3], 1) == [3, 2, 1]
    lat = {"p50_ms": 2.0, "p99_ms": 9.0}
    results = {
        "relay": [{"backend": "redis", "throughput": {"rows_per_s": r}, "latency": {"p50_ms": 1.0, "p99_ms": 4.0}}
                  for r in (100.0, 300.0)] + [{"backend": "redis", "error": "broke"}],
        "paths": [{"backend": "redis", "stack": s, "latency": lat, "cpu_per_s": {"relays": 0.5, "bus_server": None}}
                  for s in ("1+1", "2+2")],
        "flat_out": [{"backend": "redis", "stack": "1+1", "transitions_per_s": 1000.0},
                     {"backend": "redis", "stack": "2+2", "transitions_per_s": 1500.0}],
    }
    (row,) = backends.summarise(results, ["redis"])
    assert row["relay_rows_per_s"] == 200.0 and row["1+1 p99_ms"] == 9.0 and row["2+2 / 1+1"] == 1.5
    (rabbit,) = backends.summarise(results, ["rabbitmq"])
    assert rabbit["relay_rows_per_s"] is None and rabbit["2+2 / 1+1"] is None
    cpu = backends.cpu_rows(results)
    assert [r[:3] for r in cpu] == [["redis 1+1", "at rate", 0.5], ["redis 2+2", "at rate", 0.5]]
