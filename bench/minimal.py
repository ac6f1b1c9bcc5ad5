"""The floor: a hand-written minimal event pipeline next to pollbridge's event path, same load, one run.

    python -m bench.minimal [--rate 500] [--seconds 15] [--rounds 2] [--throughput-seconds 10]
                            [--schedulers 2] [--wake adaptive] [--quick] [--json F]

*Minimal* (this file, nothing of pollbridge): chains of tasks in a table of its own; a row trigger writes
an outbox row for every status change; a relay process claims outbox rows (``DELETE … RETURNING``,
``FOR UPDATE SKIP LOCKED``, probing every 2 ms), ``XADD``s them to one Redis stream and commits; a consumer
process reads the stream (``XREADGROUP``) and, for every completed task, dispatches the next task of its
chain with one compare-and-set ``UPDATE`` per batch (pending → queued, only if the predecessor is
completed), then ``XACK``s. No scopes, phases, leases, timers, signals, dead letters or retries.

*pollbridge*: the same chains in the reference schema, ``pollbridge relay run`` and ``--schedulers`` x
``pollbridge scheduler run --phase cutover`` (defaults otherwise), on Redis Streams.

For each, the bench process completes dispatched (queued) tasks at ``--rate`` per second for
``--seconds`` (each completion makes the next task of its chain ready), and the latency is
``dispatched_at`` of a task minus ``completed_at`` of its predecessor, for predecessors completed in the
window, computed in SQL (nearest rank). The two alternate ``--rounds`` times, so load from outside falls
on both alike. Then each is driven flat out for ``--throughput-seconds``: completions + dispatches per
second. The ratio pollbridge / minimal is the "within 2x of a minimal pipeline" target. The minimal
pipeline's processes are stopped (SIGSTOP) through pollbridge's windows: its relay polls every 2 ms even
when idle and would otherwise load the machine pollbridge is measured on; pollbridge's idle processes
(one statement a second) stay up through the minimal's windows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench import _paths_common as pc
from bench.common import REDIS_URL, WORKER_QUEUE_INDEX, delete_namespace, scratch_database, write_json
from bridge.app import install
from bridge.bus import open_bus
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import BusSettings, CaptureSettings, SchedulerSettings
from bridge.db.engine import create_engine
from event_scheduler.leases import lease_snapshot

CHAIN = 10

MINIMAL_SCHEMA = """
CREATE TABLE mtasks (id bigserial PRIMARY KEY, instance_id int NOT NULL, seq int NOT NULL,
                     status text NOT NULL DEFAULT 'pending', completed_at timestamptz, dispatched_at timestamptz,
                     UNIQUE (instance_id, seq));
CREATE INDEX mtasks_queued ON mtasks (id) WHERE status = 'queued';
CREATE TABLE moutbox (id bigserial PRIMARY KEY, task_id bigint NOT NULL, instance_id int NOT NULL, seq int NOT NULL,
                      status text NOT NULL);
CREATE FUNCTION mcapture() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO moutbox (task_id, instance_id, seq, status) VALUES (NEW.id, NEW.instance_id, NEW.seq, NEW.status);
  RETURN NULL;
END $$;
CREATE TRIGGER mcapture AFTER UPDATE OF status ON mtasks FOR EACH ROW
  WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION mcapture();
"""

CLAIM = ("DELETE FROM moutbox WHERE id = ANY(ARRAY(SELECT id FROM moutbox ORDER BY id LIMIT 2000 "
         "FOR UPDATE SKIP LOCKED)) RETURNING id, instance_id, seq, status")
DISPATCH = ("UPDATE mtasks t SET status = 'queued', dispatched_at = clock_timestamp() "
            "FROM unnest(%s::int[], %s::int[]) AS e(i, s) "
            "WHERE t.instance_id = e.i AND t.seq = e.s + 1 AND t.status = 'pending' "
            "AND EXISTS (SELECT 1 FROM mtasks p WHERE p.instance_id = t.instance_id AND p.seq = t.seq - 1 "
            "AND p.status = 'completed')")


# --- the minimal pipeline's two processes --------------------------------------------------------------
def relay_main(url: str, stream: str) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    with psycopg.connect(pc.libpq(url)) as conn:
        while True:
            with conn.transaction():
                rows = conn.execute(CLAIM).fetchall()
                if rows:
                    pipe = r.pipeline(transaction=False)
                    for _id, instance, seq, status in rows:
                        pipe.xadd(stream, {"i": instance, "s": seq, "st": status})
                    pipe.execute()
            if not rows:
                time.sleep(0.002)


def consumer_main(url: str, stream: str) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    with contextlib.suppress(redis.ResponseError):  # it exists
        r.xgroup_create(stream, "g", id="0", mkstream=True)
    with psycopg.connect(pc.libpq(url), autocommit=True) as conn:
        while True:
            got = r.xreadgroup("g", "c", {stream: ">"}, count=2000, block=100)
            if not got:
                continue
            entries = got[0][1]
            done = [(int(f[b"i"]), int(f[b"s"])) for _id, f in entries if f[b"st"] == b"completed"]
            if done:
                conn.execute(DISPATCH, ([i for i, _ in done], [s for _, s in done]))
            r.xack(stream, "g", *[entry_id for entry_id, _ in entries])  # type: ignore[no-untyped-call]


# --- driving either pipeline ---------------------------------------------------------------------------
class Pipeline:
    """One pipeline in its scratch database: seeding, the completer, latency in SQL."""

    def __init__(self, name: str, url: str, table: str, extra_set: str) -> None:
        self.name, self.url, self.table = name, url, table
        self.complete_sql = (f"UPDATE {table} SET status = 'completed', completed_at = clock_timestamp(){extra_set} "
                             f"WHERE id = ANY(ARRAY(SELECT id FROM {table} WHERE status = 'queued' ORDER BY id "
                             f"LIMIT %s FOR UPDATE SKIP LOCKED))")
        self.seeded = 0

    def conn(self) -> psycopg.Connection[Any]:
        return psycopg.connect(pc.libpq(self.url), autocommit=True)

    def queued(self) -> int:
        with self.conn() as conn:
            row = conn.execute(f"SELECT count(*) FROM {self.table} WHERE status = 'queued'").fetchone()
        return int(row[0]) if row else 0

    def now(self) -> datetime:
        with self.conn() as conn:
            row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        value: datetime = row[0]
        return value

    def complete(self, rate: float | None, seconds: float) -> int:
        """Complete queued tasks, paced at ``rate`` per second (None: as fast as possible)."""
        done = 0
        with self.conn() as conn:
            started = time.perf_counter()
            while (elapsed := time.perf_counter() - started) < seconds:
                if rate:
                    due = int(elapsed * rate) - done
                    if due <= 0:
                        time.sleep(0.001)
                        continue
                    n = min(due, 200)
                else:
                    n = 500
                got = conn.execute(self.complete_sql, (n,)).rowcount
                done += got
                if not got:
                    time.sleep(0.001)  # nothing queued: do not spin
        return done

    def seed(self, instances: int) -> None:
        raise NotImplementedError

    def latency(self, t0: datetime, t1: datetime) -> dict[str, Any]:
        raise NotImplementedError

    def dispatched_between(self, t0: datetime, t1: datetime) -> int:
        with self.conn() as conn:
            row = conn.execute(f"SELECT count(*) FROM {self.table} WHERE dispatched_at >= %s AND dispatched_at < %s",
                               (t0, t1)).fetchone()
        return int(row[0]) if row else 0

    def _ranked(self, select_ms: str, params: tuple[Any, ...]) -> dict[str, Any]:
        with self.conn() as conn:
            def execute(query: str, p: Any) -> Any:
                return conn.execute(query, p).fetchall()

            n, values = pc.ranked(execute, select_ms, params, (0.5, 0.9, 0.99, 1.0))
        return pc.summary(n, values)


class Minimal(Pipeline):
    def seed(self, instances: int) -> None:
        with self.conn() as conn:
            conn.execute("INSERT INTO mtasks (instance_id, seq, status) SELECT g, k, "
                         "CASE WHEN k = 0 THEN 'queued' ELSE 'pending' END "
                         "FROM generate_series(%s::int, %s::int) g, generate_series(0, %s::int - 1) k",
                         (self.seeded + 1, self.seeded + instances, CHAIN))
            conn.execute("ANALYZE mtasks")
            conn.execute("DELETE FROM moutbox")
        self.seeded += instances

    def latency(self, t0: datetime, t1: datetime) -> dict[str, Any]:
        return self._ranked(
            "SELECT extract(epoch FROM t.dispatched_at - p.completed_at) * 1000 AS ms FROM mtasks p "
            "JOIN mtasks t ON t.instance_id = p.instance_id AND t.seq = p.seq + 1 "
            "WHERE p.completed_at >= %s AND p.completed_at < %s AND t.dispatched_at IS NOT NULL", (t0, t1))


class Pollbridge(Pipeline):
    namespace = "pollbridge"
    bus_url = REDIS_URL

    def caught_up(self) -> bool:
        """Nothing left to publish or consume: the seeding's insert events are all handled."""
        with self.conn() as conn:
            row = conn.execute("SELECT count(*) FROM pollbridge_outbox WHERE published_at IS NULL").fetchone()
        if row is None or row[0]:
            return False
        engine = create_engine(self.url) if self.bus_url == "embedded" else None
        bus = open_bus(self.bus_url, engine=engine, namespace=self.namespace)
        try:
            group = SchedulerSettings().group
            return sum(bus.lag(group).values()) == 0 and bus.pending_count(group) == 0
        finally:
            bus.close()
            if engine is not None:
                engine.dispose()

    def seed(self, instances: int) -> None:
        a, b = self.seeded + 1, self.seeded + instances
        with self.conn() as conn:
            conn.execute("INSERT INTO workflow_instances (id, workflow_type) "
                         "SELECT 'c' || g, 'bench' FROM generate_series(%s::int, %s::int) g", (a, b))
            conn.execute("INSERT INTO tasks (instance_id, task_key, depends_on) "
                         "SELECT 'c' || g, 't' || k, CASE WHEN k = 0 THEN '[]' "
                         "ELSE json_build_array('t' || (k - 1)) END FROM generate_series(%s::int, %s::int) g, "
                         "generate_series(0, %s::int - 1) k", (a, b, CHAIN))
            conn.execute(WORKER_QUEUE_INDEX)  # what mtasks_queued is to the minimal pipeline
            conn.execute("ANALYZE tasks, workflow_instances")
        self.seeded += instances

    def latency(self, t0: datetime, t1: datetime) -> dict[str, Any]:
        return self._ranked(f"SELECT {pc.latency_expr('postgresql')} AS ms FROM pollbridge_dispatch_log "
                            "WHERE path = 'events' AND ready_at >= %s AND ready_at < %s", (t0, t1))

    def dispatched_between(self, t0: datetime, t1: datetime) -> int:
        with self.conn() as conn:
            row = conn.execute("SELECT count(*) FROM pollbridge_dispatch_log WHERE dispatched_at >= %s "
                               "AND dispatched_at < %s", (t0, t1)).fetchone()
        return int(row[0]) if row else 0


def wait_until(check: Callable[[], bool], timeout: float, children: pc.Children) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children.check_alive()
        if check():
            return True
        time.sleep(0.1)
    return False


def window(p: Pipeline, children: pc.Children, rate: float | None, seconds: float,
           meter: Callable[[], Callable[[], dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Seed enough chains, wait for their first tasks to be queued, complete for ``seconds``. ``meter``, called
    as the completions start, returns what to call as they end; its dict is added to the result."""
    per_chain = CHAIN - 1
    instances = max(200, int((rate or 3000) * seconds * 1.5 / per_chain) + 1)
    before = p.queued()
    p.seed(instances)
    if not wait_until(lambda: p.queued() >= before + instances * 0.99
                      and (not isinstance(p, Pollbridge) or p.caught_up()), 180, children):
        print(f"warning: {p.name}: the seeded chains' first tasks were not all dispatched (and, for pollbridge, "
              "the bus drained) within 180 s", file=sys.stderr)
    time.sleep(0.5)
    load = pc.MachineLoad([p.url.rsplit("/", 1)[1]])
    load.start([c.proc.pid for c in children.items])
    t0 = p.now()
    stop_meter = meter() if meter is not None else None
    started = time.perf_counter()
    completed = p.complete(rate, seconds)
    elapsed = time.perf_counter() - started
    metered = stop_meter() if stop_meter is not None else {}
    t1 = p.now()
    time.sleep(1.0)  # the window's last dispatches
    dispatched = p.dispatched_between(t0, t1)
    return {"pipeline": p.name, "rate": rate, "seconds": round(elapsed, 2), "completions": completed,
            "completions_per_s": round(completed / elapsed, 1),
            "transitions_per_s": round((completed + dispatched) / elapsed, 1),
            "latency": p.latency(t0, t1), **load.stop(), **metered}


@contextlib.contextmanager
def paused(children: pc.Children | None) -> Iterator[None]:
    """``children`` stopped (SIGSTOP) for the block, continued after (None: nothing to stop)."""
    pids = [c.proc.pid for c in children.items] if children is not None else []
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def start_minimal(url: str, workdir: Path, namespace: str) -> tuple[Minimal, pc.Children]:
    with psycopg.connect(pc.libpq(url), autocommit=True) as conn:
        conn.execute(MINIMAL_SCHEMA)
    children = pc.Children(workdir, dict(os.environ))
    stream = f"{namespace}:minimal"
    children.spawn("minimal-relay", [sys.executable, "-m", "bench.minimal", "--role", "relay", "--url", url,
                                     "--stream", stream], count="none")
    children.spawn("minimal-consumer", [sys.executable, "-m", "bench.minimal", "--role", "consumer", "--url", url,
                                        "--stream", stream], count="none")
    return Minimal("minimal", url, "mtasks", ""), children


def start_pollbridge(url: str, workdir: Path, namespace: str, schedulers: int, wake: str = "adaptive",
                     bus_url: str = REDIS_URL, relays: int = 1) -> tuple[Pollbridge, pc.Children]:
    """pollbridge's event path on ``bus_url``: ``relays`` relay processes (``[capture] relay_partitions``, one
    ``pollbridge relay run --partition N`` each) and ``schedulers`` schedulers, their leases settled."""
    engine = create_engine(url)
    install.init(engine, demo_schema=True, mapping=TaskTableMapping(),
                 capture=CaptureSettings(wake=wake, relay_partitions=relays))
    engine.dispose()
    (workdir / "pollbridge.toml").write_text(f'[bus]\nnamespace = "{namespace}"\n[capture]\nwake = "{wake}"\n'
                                             f'relay_partitions = {relays}\n')
    exe = shutil.which("pollbridge") or sys.exit("pollbridge is not installed (pip install -e .)")
    children = pc.Children(workdir, {**os.environ, "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_BUS_URL": bus_url})
    if relays == 1:
        children.spawn("relay", [exe, "--log-level", "INFO", "relay", "run"], count="none")
    else:
        for n in range(relays):
            children.spawn(f"relay{n + 1}", [exe, "--log-level", "INFO", "relay", "run", "--partition", str(n)],
                           count="none")
    for n in range(schedulers):
        children.spawn(f"scheduler{n + 1}", [exe, "--log-level", "INFO", "scheduler", "run", "--phase", "cutover"],
                       count="none")
    p = Pollbridge("pollbridge", url, "tasks", ", updated_at = clock_timestamp()")
    p.namespace, p.bus_url = namespace, bus_url

    engine = create_engine(url)
    bus = open_bus(bus_url, engine=engine, partitions=BusSettings().partitions, namespace=namespace)
    try:
        if not wait_until(lambda: lease_snapshot(engine, bus).settled(schedulers, bus.partitions), 60, children):
            print("warning: the schedulers did not settle their leases within 60 s", file=sys.stderr)
    finally:
        bus.close()
        engine.dispose()
    return p, children


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.minimal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=500, help="completions per second")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--throughput-seconds", type=float, default=10, help="0: skip the flat-out phase")
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--wake", choices=("poll", "notify", "adaptive"), default="adaptive",
                        help="pollbridge's capture wake-up mode (its default: adaptive)")
    parser.add_argument("--quick", action="store_true", help="short, for CI (< 1 minute)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--role", choices=["relay", "consumer"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--stream", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "relay":
        relay_main(args.url, args.stream)
        return 0
    if args.role == "consumer":
        consumer_main(args.url, args.stream)
        return 0
    if args.quick:
        args.rate, args.seconds, args.rounds, args.throughput_seconds = 200, 4, 1, 3
    pc.exit_on_signals()
    namespace = f"pbmin{uuid.uuid4().hex[:6]}"
    results: dict[str, Any] = {"command": " ".join(["python -m bench.minimal", *(argv or sys.argv[1:])]),
                               "machine": pc.machine_info(), "rate": args.rate, "wake": args.wake, "rounds": [],
                               "throughput": []}
    try:
        with scratch_database("pollbridge_bench_minimal") as murl, \
                scratch_database("pollbridge_bench_minimal_pb") as purl:
            minimal, mchildren = start_minimal(murl, Path(tempfile.mkdtemp(prefix="pbmin-")), namespace)
            pollbridge, pchildren = start_pollbridge(purl, Path(tempfile.mkdtemp(prefix="pbmin-pb-")), namespace,
                                                     args.schedulers, args.wake)
            try:
                pipelines = [(minimal, mchildren), (pollbridge, pchildren)]
                for n in range(args.rounds):
                    order = pipelines if n % 2 == 0 else pipelines[::-1]
                    for p, children in order:
                        # The minimal relay polls its outbox every 2 ms even when idle: left running through
                        # pollbridge's window it would load the machine pollbridge is measured on. (Pollbridge's
                        # idle processes send one statement a second, so they stay up through the minimal's.)
                        with paused(mchildren if p is pollbridge else None):
                            r = window(p, children, args.rate, args.seconds)
                        r["round"] = n + 1
                        results["rounds"].append(r)
                        lat = r["latency"]
                        print(f"round {n + 1} {p.name:>10} at {r['completions_per_s']}/s: p50 {lat['p50_ms']} ms, "
                              f"p90 {lat['p90_ms']} ms, p99 {lat['p99_ms']} ms, max {lat['max_ms']} ms "
                              f"(n={lat['n']}); load {r['load_after']}, others {r['other_cpu_pct']}% of a core",
                              flush=True)
                if args.throughput_seconds:
                    for p, children in pipelines:
                        with paused(mchildren if p is pollbridge else None):
                            r = window(p, children, None, args.throughput_seconds)
                        results["throughput"].append(r)
                        print(f"flat out {p.name:>10}: {r['completions_per_s']} completions/s, "
                              f"{r['transitions_per_s']} transitions/s; load {r['load_after']}, "
                              f"others {r['other_cpu_pct']}% of a core", flush=True)
                for _, children in pipelines:
                    children.stop_all()
                    results.setdefault("processes", {}).update(
                        {c.name: {"peak_rss_mb": c.peak_rss_mb} for c in children.items})
            finally:
                mchildren.stop_all()
                pchildren.stop_all()
    finally:
        delete_namespace(namespace)
    summary = {}
    for name in ("minimal", "pollbridge"):
        rows = [r["latency"] for r in results["rounds"] if r["pipeline"] == name and r["latency"]["n"]]
        summary[name] = {k: round(statistics.median(r[k] for r in rows), 2) if rows else None
                         for k in ("p50_ms", "p90_ms", "p99_ms")}
    ratio: dict[str, float | None] = {}
    for k in ("p50_ms", "p99_ms"):
        mine, floor = summary["pollbridge"][k], summary["minimal"][k]
        ratio[k] = round(mine / floor, 2) if mine and floor else None
    results["summary"], results["ratio"] = summary, ratio
    print(f"median over rounds: minimal p50 {summary['minimal']['p50_ms']} / p99 {summary['minimal']['p99_ms']} ms; "
          f"pollbridge p50 {summary['pollbridge']['p50_ms']} / p99 {summary['pollbridge']['p99_ms']} ms; "
          f"pollbridge / minimal: p50 x{ratio['p50_ms']}, p99 x{ratio['p99_ms']} (target: <= 2)")
    write_json(args.json_path, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
