"""Write transactions on the embedded default (SQLite): how often the relay, the event scheduler and the
demo workers take the database's one write lock, idle and while changes trickle in.

    python -m bench.sqlite_locks [--seconds 5] [--interval 0.02] [--json F] [--quick]

In a scratch SQLite file: the reference schema, a relay (default settings, embedded bus), an event
scheduler (every type in ``cutover``) and a pool of 4 demo workers, all in this process. After two
seconds of settling it counts ``BEGIN IMMEDIATE`` (every write transaction on SQLite begins with it, see
``bridge.db.engine``) for ``--seconds`` idle, then for
``--seconds`` while the application inserts one task every ``--interval`` seconds (its own inserts are
not counted; each is dispatched, run and completed, so the figure includes that work), and, busy, the
lock-free looks before a claim (the relay's) or a take (the bus's reader's). Twice: with the
relay, the scheduler's bus reads and the workers looking for work without the lock first (what they do),
then with those looks switched off (what they did until 2026-12-01). Every write transaction of one
process makes the others wait: on SQLite the idle ones are pure contention.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from bench.common import machine, write_json
from bridge.app import install
from bridge.bus import open_bus
from bridge.bus.embedded import EmbeddedBus
from bridge.capture.relay import Relay
from bridge.core.mapping import TaskTableMapping
from bridge.core.phases import FixedRouter
from bridge.core.settings import RelaySettings, SchedulerSettings, WorkerSettings
from bridge.db.engine import create_engine
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from event_scheduler.scheduler import EventScheduler
from legacy_poller.workers import WorkerPool


def measure(directory: Path, *, look_first: bool, seconds: float, interval: float) -> dict[str, float]:
    engine = create_engine(f"sqlite:///{directory / ('look.db' if look_first else 'claim.db')}")
    install.init(engine, demo_schema=True, mapping=TaskTableMapping())
    tables = reflect_tables(engine, TaskTableMapping())
    relay = Relay(engine, open_bus("embedded", engine=engine, partitions=4), RelaySettings(),
                  statuses=tables.mapping.statuses)
    bus = open_bus("embedded", engine=engine, partitions=4)
    scheduler = EventScheduler(engine, tables, bus, SchedulerSettings(), FixedRouter("cutover"),
                               registry=CollectorRegistry())
    pool = WorkerPool(engine, tables, WorkerSettings(concurrency=4))
    if not look_first:  # the behaviour before 2026-12-01: claim every cycle, found or not
        pool._peek = None
        relay._has_unpublished = lambda: True  # type: ignore[method-assign]
        assert isinstance(bus, EmbeddedBus)
        bus._look_first = False
    writes = [0]
    looks = [0]  # with tasks: the lock-free looks before a claim (the relay) or a take (the bus's reader)
    counting = threading.Lock()  # the relay's thread and the workers' count at once

    def seen(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if statement.startswith("BEGIN IMMEDIATE"):
            with counting:
                writes[0] += 1
        elif _is_look(statement):
            with counting:
                looks[0] += 1

    stop = threading.Event()
    threads = [threading.Thread(target=relay.run, args=(stop,), daemon=True),
               threading.Thread(target=scheduler.run, args=(stop,), daemon=True)]
    for thread in threads:
        thread.start()
    pool.start()
    try:
        stop.wait(2.0)  # leadership, first claims, the workers' first looks
        sa.event.listen(engine, "before_cursor_execute", seen)
        with counting:
            writes[0] = 0
        stop.wait(seconds)
        with counting:
            idle, writes[0], looks[0] = writes[0] / seconds, 0, 0
        inserted, started = 0, time.monotonic()
        while time.monotonic() - started < seconds:
            with engine.begin() as conn:
                seed(conn, tables, [WorkflowSpec(f"trickle-{inserted}", "orders", (TaskSpec("a"),))])
            inserted += 1
            stop.wait(interval)
        elapsed = time.monotonic() - started
        with counting:
            trickle = (writes[0] - inserted) / elapsed
            looked = looks[0] / elapsed
        completed = pool.stats().completed
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        pool.stop()
        engine.dispose()
    return {"idle_writes_per_s": round(idle, 1), "trickle_writes_per_s": round(trickle, 1),
            "trickle_looks_per_s": round(looked, 1), "changes_per_s": round(inserted / elapsed, 1),
            "inserted": inserted, "completed": completed}


def _is_look(statement: str) -> bool:
    """The relay's peek at the outbox, or the embedded bus's look at the log (the offsets and "anything after")."""
    return statement.startswith("SELECT pollbridge_outbox.id FROM pollbridge_outbox") or (
        statement.startswith("SELECT (SELECT count(*)") and "pollbridge_bus_groups" in statement)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sqlite_locks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="each measurement window")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between the application's inserts")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--quick", action="store_true", help="one-second windows (CI)")
    args = parser.parse_args(argv)
    seconds = 1.0 if args.quick else args.seconds
    with tempfile.TemporaryDirectory(prefix="pollbridge-bench-locks-") as tmp:
        results = {"look first (now)": measure(Path(tmp), look_first=True, seconds=seconds, interval=args.interval),
                   "claim every cycle (before)": measure(Path(tmp), look_first=False, seconds=seconds,
                                                         interval=args.interval)}
    print(f"{'relay, scheduler, 4 workers':<32} {'idle writes/s':>14} {'writes/s with tasks':>20} "
          f"{'looks/s with tasks':>19}")
    for name, r in results.items():
        print(f"{name:<32} {r['idle_writes_per_s']:>14} {r['trickle_writes_per_s']:>20} "
              f"{r['trickle_looks_per_s']:>19}  "
              f"({r['changes_per_s']} tasks/s inserted; {r['completed']} of {r['inserted']} completed)")
    write_json(args.json_path, {"machine": machine(), "seconds": seconds, "interval": args.interval,
                                "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
