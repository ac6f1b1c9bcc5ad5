"""Event path vs. poller, end to end on PostgreSQL + Redis: ready → dispatch latency and throughput.

    python -m bench.scheduler [--rate 500] [--seconds 20] [--poll-interval 1.0] [--schedulers 2] [--quick] [--json F]

Processes: ``pollbridge relay run`` and ``--schedulers`` x ``pollbridge scheduler run`` (phase cutover),
or ``pollbridge poller run`` for the comparison, each its own process. The bench process plays the
workers: it completes dispatched tasks (queued → completed) of chain workflows, so each completion
makes the next task of the chain ready. Latency is computed in SQL from the dispatch log
(``dispatched_at - ready_at``, both from the database clock).

1. *Latency*: completions paced at ``--rate`` per second for ``--seconds``.
2. *Throughput*: completions as fast as the completer can go for ``--seconds``; task transitions/s
   counts both the dispatch (pending → queued) and the completion (queued → completed).
3. *Memory*: the schedulers' resident set size at the start and the end of the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.common import REDIS_URL, delete_namespace, latency_summary, machine, scratch_database, write_json
from bridge import install
from bridge.bus import open_bus
from bridge.db import create_engine
from bridge.mapping import TaskTableMapping
from bridge.settings import CaptureSettings

COMPLETE_BATCH = """
UPDATE tasks SET status = 'completed', completed_at = clock_timestamp(), updated_at = clock_timestamp()
WHERE id IN (SELECT id FROM tasks WHERE status = 'queued' ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED)
"""


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


class Processes:
    def __init__(self, url: str, namespace: str) -> None:
        self.workdir = tempfile.mkdtemp()
        Path(self.workdir, "pollbridge.toml").write_text(
            f'[bus]\nnamespace = "{namespace}"\n[scheduler]\nphase = "cutover"\nbatch_size = 1000\n')
        self.env = {**os.environ, "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_BUS_URL": REDIS_URL}
        self.exe = shutil.which("pollbridge") or sys.exit("pollbridge is not installed")
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.namespace = namespace

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(Path(self.workdir, f"{name}.log"), "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([self.exe, "--log-level", "INFO", *args], cwd=self.workdir, env=self.env,
                                stderr=log, stdout=log)
        self.procs.append((name, proc))
        return proc

    def caught_up(self) -> bool:
        """The schedulers have read and acknowledged everything on the bus (the seeding burst is over)."""
        bus = open_bus(REDIS_URL, namespace=self.namespace)
        try:
            return sum(bus.lag("pollbridge-scheduler").values()) == 0 and bus.pending_count("pollbridge-scheduler") == 0
        finally:
            bus.close()

    def stop(self) -> None:
        for _, proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for _, proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


def seed_chains(engine: sa.Engine, prefix: str, instances: int, length: int) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO workflow_instances (id, workflow_type) "
                             "SELECT :p || g, 'bench' FROM generate_series(1, :n) g"), {"p": prefix, "n": instances})
        conn.execute(sa.text(
            "INSERT INTO tasks (instance_id, task_key, depends_on) "
            "SELECT :p || g, 't' || k, CASE WHEN k = 0 THEN '[]' ELSE json_build_array('t' || (k - 1)) END "
            "FROM generate_series(1, :n) g, generate_series(0, :len - 1) k"), {"p": prefix, "n": instances,
                                                                             "len": length})


def complete(engine: sa.Engine, rate: float | None, seconds: float, stop_early: threading.Event) -> int:
    """Complete dispatched tasks, paced at ``rate`` per second (None: as fast as possible)."""
    done = 0
    started = time.perf_counter()
    with engine.connect() as conn:
        while time.perf_counter() - started < seconds and not stop_early.is_set():
            if rate:
                due = int((time.perf_counter() - started) * rate) - done
                if due <= 0:
                    time.sleep(0.001)
                    continue
                n = min(due, 200)
            else:
                n = 500
            with conn.begin():
                done += conn.execute(sa.text(COMPLETE_BATCH), {"n": n}).rowcount
    return done


def measure(url: str, path: str, since: str) -> dict[str, Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT extract(epoch FROM dispatched_at - ready_at) * 1000 FROM pollbridge_dispatch_log "
                "WHERE path = :path AND instance_id LIKE :since || '%'"),
                {"path": path, "since": since}).scalars().all()
    finally:
        engine.dispose()
    return latency_summary([float(r) for r in rows])


def run_phase(url: str, procs: Processes, label: str, rate: float | None, seconds: float,
              instances: int, length: int, path: str) -> dict[str, Any]:
    engine = create_engine(url, pool_size=4)
    try:
        seed_chains(engine, f"{label}-", instances, length)
        # Let the root tasks be dispatched before the clock starts.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                queued = conn.execute(sa.text("SELECT count(*) FROM tasks WHERE status = 'queued' "
                                              "AND instance_id LIKE :p || '%'"), {"p": f"{label}-"}).scalar_one()
            if queued >= instances * 0.99 and (path != "events" or procs.caught_up()):
                break
            time.sleep(0.2)
        stop = threading.Event()
        started = time.perf_counter()
        completed = complete(engine, rate, seconds, stop)
        elapsed = time.perf_counter() - started
        time.sleep(1.5 if path == "events" else 0)  # let in-flight dispatches land
        with engine.connect() as conn:
            dispatched = conn.execute(sa.text(
                "SELECT count(*) FROM pollbridge_dispatch_log WHERE instance_id LIKE :p || '%'"),
                {"p": f"{label}-"}).scalar_one()
    finally:
        engine.dispose()
    result = {"completions": completed, "seconds": round(elapsed, 2),
              "completions_per_s": round(completed / elapsed, 1),
              "transitions_per_s": round((completed + dispatched - instances) / elapsed, 1),
              "latency": measure(url, path, f"{label}-")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small and short, for CI (< 1 minute)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database for inspection")
    parser.add_argument("--skip-poller", action="store_true", help="measure the event path only")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 4
    length = 10
    instances = max(200, int(args.rate * args.seconds * 2 / length) + 1)
    namespace = f"pbbench{uuid.uuid4().hex[:6]}"
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(["python -m bench.scheduler", *sys.argv[1:]])}
    try:
        with scratch_database("pollbridge_bench_scheduler", keep=args.keep) as url:
            engine = create_engine(url)
            install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings())
            engine.dispose()
            procs = Processes(url, namespace)
            procs.start("relay", "relay", "run")
            schedulers = [procs.start(f"scheduler{i}", "scheduler", "run") for i in range(args.schedulers)]
            time.sleep(2.0)
            rss_start = [rss_mb(p.pid) for p in schedulers]
            results["events_latency"] = run_phase(url, procs, "lat", args.rate, args.seconds, instances, length,
                                                  "events")
            results["events_throughput"] = run_phase(url, procs, "tp", None, args.seconds, instances * 3, length,
                                                     "events")
            results["scheduler_rss_mb"] = {"start": rss_start, "end": [rss_mb(p.pid) for p in schedulers]}
            procs.stop()
            if not args.skip_poller:
                procs.start("poller", "poller", "run", "--interval", str(args.poll_interval))
                time.sleep(1.0)
                results["poller_latency"] = run_phase(url, procs, "pol", args.rate, args.seconds, instances, length,
                                                      "poller")
                results["poller_latency"]["interval_s"] = args.poll_interval
                procs.stop()
    finally:
        delete_namespace(namespace)
    for name in ("events_latency", "events_throughput", "poller_latency"):
        if name not in results:
            continue
        r = results[name]
        lat = r["latency"]
        print(f"{name:18} {r['completions_per_s']:>8} completions/s {r['transitions_per_s']:>8} transitions/s  "
              f"ready->dispatch p50 {lat['p50_ms']} ms p90 {lat['p90_ms']} ms p99 {lat['p99_ms']} ms "
              f"max {lat['max_ms']} ms (n={lat['n']})")
    print(f"process logs in {procs.workdir}")
    print(f"scheduler RSS MB start {results['scheduler_rss_mb']['start']} end {results['scheduler_rss_mb']['end']}")
    write_json(args.json_path, results)


if __name__ == "__main__":
    main()
