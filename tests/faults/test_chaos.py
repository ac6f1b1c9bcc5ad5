"""Random faults under a running mixed workload, every component its own process, PostgreSQL + Redis.

The engine is :mod:`tests.support.chaos` (its docstrings list the faults and the checks); ``python -m bench.faults
--minutes N`` runs the same engine for a long soak. This CI instance injects faults for
``POLLBRIDGE_CHAOS_SECONDS`` (default 60) seconds and takes about two and a half minutes in all. The seed is
random and printed; ``POLLBRIDGE_CHAOS_SEED=N`` replays a run's fault schedule.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.chaos import KINDS, ChaosOptions, log_tails, new_workdir, run_chaos

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]


def _chaos(pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], record_property: Any, *,
           binaries: tuple[str, ...], seconds_env: str, seconds: str, bus: str) -> tuple[Any, str]:
    """One chaos run (the seed from ``POLLBRIDGE_CHAOS_SEED``, its length from ``seconds_env``), said as it goes;
    the report and the failure text. The faults need Redis servers of their own: without ``binaries`` the test
    fails in CI and skips elsewhere."""
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        message = f"{', '.join(missing)} not installed (the chaos suite starts a private Redis to flush and restart)"
        if os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    seed = os.environ.get("POLLBRIDGE_CHAOS_SEED")
    workdir = new_workdir(tmp_path)

    def say(line: str) -> None:
        if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's terminal is not shown: captured, `-rP` shows it
            print(line, flush=True)
            return
        with capsys.disabled():  # the seed and the faults are worth seeing as they happen
            print(line, flush=True)

    options = ChaosOptions(db_url=pg_url, workdir=workdir, seconds=float(os.environ.get(seconds_env, seconds)),
                           seed=int(seed) if seed else None, settle_timeout=90, say=say, bus=bus)
    report = run_chaos(options)
    record_property("figure_line", report.figure_line())
    say(report.figure_line())
    say(report.latency_line())
    for note in report.notes:
        say(f"note: {note}")
    return report, "\n".join(report.problems) + f"\nseed {report.seed}; logs in {workdir}\n" + log_tails(workdir)


def test_no_trigger_lost_doubled_or_early_under_random_faults(pg_url: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              record_property: Any) -> None:
    report, failure = _chaos(pg_url, tmp_path, capsys, record_property, binaries=("redis-server",),
                             seconds_env="POLLBRIDGE_CHAOS_SECONDS", seconds="60", bus="redis")
    assert report.ok, failure
    assert set(report.faults) == set(KINDS), f"a kind of fault was never injected: {report.faults}"
    assert report.tasks >= 300 and report.completed > report.tasks // 2, report.figure_line()
    assert report.dead_letters.get("malformed", 0) >= 2, report.figure_line()  # at least the final round


def test_a_bus_loss_replay_is_not_a_stuck_relay_for_the_guardian(sqlite_url: str) -> None:
    from datetime import UTC, datetime, timedelta

    import sqlalchemy as sa

    from bridge.bus.embedded import EmbeddedBus
    from bridge.capture.relay import Relay
    from bridge.core.settings import GuardianSettings, RelaySettings
    from bridge.db.engine import create_engine
    from bridge.flags.store import FlagStore
    from bridge.rollout.guardian import Guardian

    class LosingBus(EmbeddedBus):
        token = "epoch-1"

        def epoch(self) -> str:
            return self.token

    engine = create_engine(sqlite_url)
    bus = LosingBus(engine, partitions=2)
    try:
        FlagStore(engine).change("orders", "cutover", actor="test", reason="test", forced=True)
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) VALUES ('i', 'orders')"))
            conn.execute(sa.text("INSERT INTO tasks (instance_id, task_key) VALUES ('i', 'a'), ('i', 'b')"))
        relay = Relay(engine, bus, RelaySettings())
        relay.check_bus_epoch()
        while relay.publish_batch():
            pass
        old = (datetime.now(UTC) - timedelta(minutes=5)).replace(tzinfo=None)
        with engine.begin() as conn:  # the changes were captured five minutes ago
            conn.execute(sa.text("UPDATE pollbridge_outbox SET created_at = :t, published_at = :t"), {"t": old})
        bus.token = "epoch-2"  # Redis restarted without persistence
        assert relay.check_bus_epoch()
        report = Guardian(engine, GuardianSettings(), bus=bus).check_once(act=False)
        assert report.would_demote == [], report.to_json()
    finally:
        bus.close()
        engine.dispose()


def test_no_trigger_lost_doubled_or_early_under_random_faults_on_a_redis_cluster(
        pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], record_property: Any) -> None:
    """The same chaos on a private 3-primary, 3-replica Redis Cluster: its Redis faults SIGKILL a primary (its
    replica takes over; what replication had not copied is lost and found by the relay's epoch check) or FLUSHALL
    every primary. Shorter (``POLLBRIDGE_CHAOS_CLUSTER_SECONDS``, default 40) to keep CI's time."""
    report, failure = _chaos(pg_url, tmp_path, capsys, record_property, binaries=("redis-server", "redis-cli"),
                             seconds_env="POLLBRIDGE_CHAOS_CLUSTER_SECONDS", seconds="40", bus="redis-cluster")
    assert report.ok, failure
    assert report.faults.get("redis:restart", 0) >= 1 and report.faults.get("redis:flushall", 0) >= 1, report.faults
    assert report.tasks >= 150 and report.completed > report.tasks // 2, report.figure_line()
