"""The RabbitMQ broker SIGKILLed mid-run and started again: every change still reaches the scheduler.

A private RabbitMQ node (tests/support/rabbitmq_node.py: its own name, ports and data directory; the machine's
shared broker is never touched) carries the bus; ``pollbridge relay run``, ``workers run`` and two ``scheduler
run`` processes work through a few hundred tasks (DAGs, due times spread over several seconds). While they
dispatch, the node is SIGKILLed and started again:

* **restart**: on its own data directory. Streams, the groups' state document and the dead letters are on disk;
  every process reconnects, and what was read but not acknowledged is claimed again.
* **wipe**: its data directory deleted before the start, a broker that lost everything. The state document is new
  (a new epoch for every partition): the relay's epoch check republishes its retained outbox rows, and the
  schedulers' group starts at the beginning of the new streams.

At the end every task is completed once, none early, only the event path dispatched, and every process survived
the outage and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.bus import open_bus
from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine, read_only
from bridge.db.schema import dispatch_log
from bridge.reference.oracle import verify
from bridge.reference.workload import seed
from bridge.tasktable.tables import reflect_tables
from tests.faults.test_scheduler_kill import PARTITIONS, Processes, _dispatches, _unfinished, _workload
from tests.support import wait_for
from tests.support.rabbitmq_node import private_rabbitmq

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq, pytest.mark.slow]


def _metric(procs: Processes, text: str) -> int:
    """How many times ``text`` appears in the processes' logs."""
    return sum(p.read_text(errors="replace").count(text) for p in procs.cwd.glob("relay-*.log"))


#: The broker wiped: a due timer's ``timer.expired`` published just before is in no outbox, and the relay's replay of
#: the task events is skipped by a scheduler that remembers their ids; the scheduler therefore catches its
#: partitions up from the database when the bus's epochs change (EventScheduler.check_bus_epochs; this test found it).
#:
#: Restarted on its data, the broker usually keeps the epochs; but a node SIGKILLed while a bus held the state
#: document (taken, not yet acknowledged) returns it only once the quorum queue sees the holder's channel gone, and a
#: bus that takes the lock in those ~100 ms finds no document and makes a new one: new epochs, and the relays
#: republish their retention window (duplicates, nothing lost). Seen in about 1 run in 6; not fixed (docs/bus.md,
#: RabbitMQ), so the restart case asserts what must hold: nothing lost, doubled or early.

@pytest.mark.parametrize("fault", ["restart", "wipe"])
def test_the_broker_killed_mid_run_loses_nothing(tmp_path: Path, pg_url: str, fault: str) -> None:
    namespace = "pbfault"
    (tmp_path / "pollbridge.toml").write_text(
        f'[bus]\nnamespace = "{namespace}"\npartitions = {PARTITIONS}\nvisibility_timeout = 2\n'
        "[scheduler]\nlease_ttl = 3\nclaim_interval = 1\n"
        "[workers]\nconcurrency = 4\nmin_duration = 0.005\nmax_duration = 0.02\n")
    engine = create_engine(pg_url)
    tables = reflect_tables(engine, TaskTableMapping())
    specs = _workload(f"rb{fault[0]}", random.Random(31 if fault == "restart" else 37))
    ids = [s.instance_id for s in specs]
    with private_rabbitmq() as node:
        bus = open_bus(node.url, engine=engine, partitions=PARTITIONS, namespace=namespace)
        procs = Processes(tmp_path, pg_url, node.url)
        try:
            procs.start("relay", "run", ready="relay partition")
            procs.start("workers", "run", ready="workers on")
            procs.scheduler()
            procs.scheduler()
            epochs = bus.epochs()
            with engine.begin() as conn:
                total = seed(conn, tables, specs)
            wait_for(lambda: _dispatches(engine) >= total // 5, 60, what="a fifth of the workload to be dispatched")
            at_kill = _dispatches(engine)
            node.kill()
            assert at_kill < total, "the workload finished before the kill: spread the due times further"
            if fault == "wipe":
                node.wipe()
            node.start()
            if fault == "wipe":
                # A broker that lost everything: a new epoch for every partition, found by the relay, which
                # republishes what its outbox retained.
                wait_for(lambda: _metric(procs, "republishing") >= 1, 60,
                         what="the relay to find the bus's data lost")
                assert set(bus.epochs().values()).isdisjoint(epochs.values())
            else:  # its data survived: nothing lost (a spurious new epoch is possible, see above)
                bus.epochs()

            def settled() -> bool:
                with read_only(engine).connect() as conn:
                    v = verify(conn, tables, ids)
                return v.completed == v.tasks
            wait_for(settled, 180, interval=0.2, what=f"every task to be completed after the broker's {fault}")
            assert all(p.poll() is None for p in procs.procs), procs.logs()
            after_kill = _dispatches(engine) - at_kill
            republished = _metric(procs, "republishing")
        except BaseException:
            try:  # the diagnosis must not replace the failure it is for
                procs.dump_stacks()
                print(_unfinished(engine, bus, tables, ids))
            except Exception as exc:
                print(f"(diagnostics failed: {type(exc).__name__}: {exc})")
            print(procs.logs(tail=20_000))
            print(node.tail_log())
            raise
        finally:
            procs.stop_all()
            bus.close()
    for proc in procs.procs:
        assert proc.returncode == 0, procs.logs()  # every process survived the outage and stops cleanly
    assert after_kill > 0
    if fault == "wipe":
        assert republished == 1, procs.logs()
    with engine.connect() as conn:
        verdict = verify(conn, tables, ids)
        paths: dict[str, int] = dict(conn.execute(
            sa.select(dispatch_log.c.path, sa.func.count()).group_by(dispatch_log.c.path)).all())
    engine.dispose()
    assert verdict.completed == verdict.tasks == total, verdict
    assert verdict.lost == 0 and verdict.double_dispatched == 0 and verdict.early == 0, verdict.problems
    assert verdict.dispatches == total
    assert paths == {"events": total}
