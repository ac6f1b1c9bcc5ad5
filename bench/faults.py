"""The fault-injection soak: ``tests/faults/test_chaos.py``'s engine, for as long as you like.

    python -m bench.faults --minutes 30 [--seed N] [--rate 2] [--retention 600] [--json F] [--keep-db]

Runs in a PostgreSQL database of its own (dropped afterwards unless ``--keep-db``) with a private
``redis-server``; prints every fault as it is injected, a progress line every minute, then the figure
line (faults by kind, tasks, lost, double, early, ...) and the load average of the machine during the
run. Exit 0 when every invariant held, 1 otherwise. The engine, the faults and the checks are
described in ``tests/support/chaos/`` (the package :mod:`tests.support.chaos`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

from bench.common import machine, scratch_database, write_json
from bridge.app import install
from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from tests.support.chaos import ChaosOptions, log_tails, new_workdir, run_chaos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="Minutes of faults (default 5).")
    parser.add_argument("--seed", type=int, default=None, help="Seed of the fault schedule (default: random).")
    parser.add_argument("--rate", type=float, default=2.0, help="Instances seeded per second (3-7 tasks each).")
    parser.add_argument("--retention", type=float, default=600.0,
                        help="The relay's retention window in seconds (what a bus loss replays).")
    parser.add_argument("--settle-timeout", type=float, default=300.0,
                        help="Seconds the workload may take to finish after the faults stop.")
    parser.add_argument("--json", default=None, help="Also write the report as JSON to this file.")
    parser.add_argument("--keep-db", action="store_true", help="Keep the database for inspection.")
    args = parser.parse_args(argv)

    workdir = new_workdir()
    name = f"pb_faults_{uuid.uuid4().hex[:8]}"
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with scratch_database(name, keep=args.keep_db) as url:
        engine = create_engine(url)
        try:
            install.init(engine, demo_schema=True, mapping=TaskTableMapping())
        finally:
            engine.dispose()
        report = run_chaos(ChaosOptions(
            db_url=url, workdir=workdir, seconds=args.minutes * 60, seed=args.seed, rate=args.rate,
            retention=args.retention, settle_timeout=args.settle_timeout, progress_every=60.0,
            say=lambda line: print(line, flush=True)))
    load_after = os.getloadavg()
    print(report.figure_line())
    print(report.latency_line())
    print(f"load average (1 min) during the faults: mean {report.load['mean']}, max {report.load['max']}; "
          f"at the start {load_before[0]:.2f}, at the end {load_after[0]:.2f} (2 cores shared with other work); "
          f"started {started}, {report.elapsed_s / 60:.1f} min")
    for note in report.notes:
        print(f"note: {note}")
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    if not report.ok:
        print(log_tails(workdir))
    print(f"logs: {workdir}" + (f"; database {name} kept" if args.keep_db else ""))
    write_json(args.json, {**report.to_json(), "machine": machine(), "started": started,
                           "load_before": load_before, "load_after": load_after})
    if args.json:
        print(f"report: {args.json} ({len(json.dumps(report.to_json()))} bytes)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
