"""A Redis Cluster primary SIGKILLed mid-run: its replica is promoted, pollbridge reconnects, and every change
still reaches the scheduler.

A private 3-primary, 3-replica cluster (tests/support/redis_cluster.py) carries the bus; ``pollbridge relay
run``, ``workers run`` and two ``scheduler run`` processes work through a few hundred tasks (DAGs, due times
spread over several seconds). While they dispatch, the primary holding partition 0's stream (and whatever other
partitions share its slots' node) is SIGKILLed; the cluster promotes its replica, and the killed node is started
again (it rejoins as a replica). Writes the asynchronous replication lost are found by the relay's epoch check
and republished from the outbox (:meth:`bridge.bus.redis_streams.RedisStreamsBus.epochs`). At the end every task
is completed, nothing was dispatched twice or early, and only the event path dispatched.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.bus import open_bus
from bridge.bus.keys import BusKeys
from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine, read_only
from bridge.db.schema import dispatch_log
from bridge.reference.oracle import verify
from bridge.reference.workload import seed
from bridge.tasktable.tables import reflect_tables
from tests.faults.test_scheduler_kill import PARTITIONS, Processes, _dispatches, _unfinished, _workload
from tests.support import wait_for
from tests.support.redis_cluster import running_cluster

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]


def test_a_primary_killed_mid_run_loses_nothing(tmp_path: Path, pg_url: str) -> None:
    namespace = "pbfailover"
    (tmp_path / "pollbridge.toml").write_text(
        f'[bus]\nnamespace = "{namespace}"\npartitions = {PARTITIONS}\nvisibility_timeout = 2\n'
        "[scheduler]\nlease_ttl = 3\nclaim_interval = 1\n"
        "[workers]\nconcurrency = 4\nmin_duration = 0.005\nmax_duration = 0.02\n")
    engine = create_engine(pg_url)
    tables = reflect_tables(engine, TaskTableMapping())
    specs = _workload("fo", random.Random(23))
    ids = [s.instance_id for s in specs]
    with running_cluster() as cluster:
        bus = open_bus(cluster.url, engine=engine, partitions=PARTITIONS, namespace=namespace)
        procs = Processes(tmp_path, pg_url, cluster.url)
        try:
            procs.start("relay", "run", ready="relay partition")
            procs.start("workers", "run", ready="workers on")
            procs.scheduler()
            procs.scheduler()
            with engine.begin() as conn:
                total = seed(conn, tables, specs)
            wait_for(lambda: _dispatches(engine) >= total // 5, 60, what="a fifth of the workload to be dispatched")
            victim = cluster.primary_of(BusKeys(namespace).stream(0))
            at_kill = _dispatches(engine)
            cluster.kill(victim)
            assert at_kill < total, "the workload finished before the kill: spread the due times further"
            # The replica takes the dead primary's slots over (cluster-node-timeout 2 s, then an election) ...
            successor = cluster.wait_failover(victim, timeout=60)
            assert successor != victim and cluster.primary_of(BusKeys(namespace).stream(0)) == successor
            # ... and the killed node comes back as a replica of its successor.
            cluster.restart(victim)

            def settled() -> bool:
                with read_only(engine).connect() as conn:
                    v = verify(conn, tables, ids)
                return v.completed == v.tasks
            wait_for(settled, 180, interval=0.2, what="every task to be completed after the failover")
            assert all(p.poll() is None for p in procs.procs), procs.logs()
            after_kill = _dispatches(engine) - at_kill
        except BaseException:
            try:  # the diagnosis must not replace the failure it is for
                procs.dump_stacks()
                print(_unfinished(engine, bus, tables, ids))
            except Exception as exc:
                print(f"(diagnostics failed: {type(exc).__name__}: {exc})")
            print(procs.logs(tail=20_000))
            raise
        finally:
            procs.stop_all()
            bus.close()
    for proc in procs.procs:
        assert proc.returncode == 0, procs.logs()  # every process survived the failover and stops cleanly
    assert after_kill > 0
    with engine.connect() as conn:
        verdict = verify(conn, tables, ids)
        paths: dict[str, int] = dict(conn.execute(
            sa.select(dispatch_log.c.path, sa.func.count()).group_by(dispatch_log.c.path)).all())
    engine.dispose()
    assert verdict.completed == verdict.tasks == total, verdict
    assert verdict.lost == 0 and verdict.double_dispatched == 0 and verdict.early == 0, verdict.problems
    assert verdict.dispatches == total
    assert paths == {"events": total}
