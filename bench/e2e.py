"""End to end in cutover: chains, diamonds, fan-outs, due timers, approvals and a polling worker (issue 20).

    python -m bench.e2e [--runs 5] [--configs trigger,wal,embedded] [--instances 80] [--tasks 6]
                        [--arrival-rate 4] [--approvals 0.25] [--worker-poll 0.02] [--json F] [--quick]

``--quick`` (CI): one run of ``trigger`` and ``embedded``, 20 instances.

**Workload.** ``--instances`` workflow instances of ``--tasks`` tasks, shapes chain / fan-out / diamond in turn
(``bridge.reference.workload.make_shape``: about 20 % of the tasks carry a due time 0.1-2 s after the instance
arrives), arriving at ``--arrival-rate`` instances/s (one transaction each, through the mapping); in a
``--approvals`` share of the instances one task that has a dependency also awaits an approval, sent 0.3-2.5 s
after the instance arrived with ``pollbridge signal TASK --kind approval``: a fresh process, its start-up
included, as an operator or a callback would send it. *The worker* (``python -m bench._paths_common fleet
--poll``) takes the queued tasks every ``--worker-poll`` seconds (20 ms) and completes each after its run time
(10-50 ms). Every type is in ``cutover``: the event path dispatches everything.

**Configurations**, a fresh scratch database (and Redis namespace) per run, its processes started for it and
stopped after it: ``trigger`` (PostgreSQL + Redis, capture triggers), ``wal`` (the same with ``[capture] mode =
"wal"``), ``embedded`` (a SQLite file and the embedded bus); ``pollbridge relay run`` and one ``pollbridge
scheduler run --phase cutover`` each. The runs alternate between the configurations.

**Per run**: ready → dispatch (``dispatched_at - ready_at`` of every dispatch in the dispatch log, both from the
database clock; nearest rank) p50 / p90 / p99 / max, overall and by what made the task ready last: an
*arrival* (a root task inserted), a *dependency* (an upstream's completion), a *timer* (its due time) or an
*approval* (the signal); how the rest of the machine was loaded; and the invariant oracle
(``bridge.reference.oracle.verify``: nothing lost, dispatched twice or early). The slowest dispatches are listed
with their kind, for tracing the tail (``pollbridge explain`` shows a task's stages). On PostgreSQL with
``track_commit_timestamp`` a *dependency*'s wait is split where its last upstream's completion committed (the
completed row's commit timestamp): the worker's own commit, which nothing downstream can shorten, and what the
event path took after it, and on Redis that part again where the relay added the event (the entry id's
millisecond, rounded down: the time to the bus reads 0-1 ms short, the rest 0-1 ms long; Redis and PostgreSQL on
one host, one clock); the slowest list gives the worker's commit and the event's time to the bus as its last two fields.

Exit status 1 when something broke (a process died, a task never completed, a dispatch doubled or early), else
0: the figures are reported, not held against targets (issue 20's target: p99 ≤ 50 ms in five runs of five).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from bench import _paths_common as pc
from bench.common import REDIS_URL, delete_namespace, latency_summary, scratch_database, write_json
from bench.cost import CONFIGS, Config, _drop_slot, _remove_sqlite, _wal_streaming
from bench.paths import TYPES, start_processes
from bridge.app import install
from bridge.bus.base import entry_order
from bridge.bus.keys import FIELD_PAYLOAD, BusKeys
from bridge.core.errors import first_line
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import BusSettings, CaptureSettings
from bridge.db.engine import create_engine
from bridge.reference.oracle import verify
from bridge.reference.workload import SHAPES, TaskSpec, WorkflowSpec, make_shape, seed
from bridge.tasktable.tables import reflect_tables

#: How far apart a signal's two timestamps may be for the ready time to still be the signal's.
APPROVAL_STAMPS_APART = timedelta(milliseconds=1)
#: The longest a run waits, after the last arrival, for every task to complete.
FINISH_TIMEOUT = 60.0


@dataclass(frozen=True)
class Plan:
    """One run's instances, their arrival offsets (s) and, per instance with an approval, the task key and the
    offset at which the approval is sent."""

    specs: list[WorkflowSpec]
    offsets: list[float]
    approvals: dict[str, tuple[str, float]]


def build_plan(instances: int, tasks: int, rate: float, approvals: float, seed_: int, prefix: str) -> Plan:
    rng = random.Random(seed_)
    specs: list[WorkflowSpec] = []
    offsets: list[float] = []
    approve: dict[str, tuple[str, float]] = {}
    for n in range(instances):
        shape = SHAPES[n % len(SHAPES)]
        spec_tasks = list(make_shape(shape, tasks, rng))
        instance_id = f"{prefix}{n:05d}"
        offset = n / rate
        if rng.random() < approvals:
            i = rng.choice([k for k, t in enumerate(spec_tasks) if t.depends_on])
            t = spec_tasks[i]
            spec_tasks[i] = TaskSpec(t.key, t.depends_on, t.due_in, awaits_signal="approval")
            approve[instance_id] = (t.key, offset + rng.uniform(0.3, 2.5))
        specs.append(WorkflowSpec(instance_id, TYPES[shape], tuple(spec_tasks)))
        offsets.append(offset)
    return Plan(specs, offsets, approve)


def _toml(config: Config, namespace: str) -> str:
    mode = "wal" if config.capture == "wal" else "trigger"
    return f'[bus]\nnamespace = "{namespace}"\n[capture]\nmode = "{mode}"\n'


class Signaller:
    """Sends each approval at its time with ``pollbridge signal`` (a process per signal, one at a time)."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, env
        self.queue: list[tuple[float, str]] = []  # (monotonic time to send, task id)
        self.cond = threading.Condition()
        self.closed = False
        self.sent = 0
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run, name="signaller", daemon=True)
        self.thread.start()

    def add(self, at: float, task_id: str) -> None:
        with self.cond:
            self.queue.append((at, task_id))
            self.queue.sort()
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()

    def _run(self) -> None:
        exe = shutil.which("pollbridge") or "pollbridge"
        while True:
            with self.cond:
                while not self.queue or self.queue[0][0] > time.monotonic():
                    if self.closed and not self.queue:
                        return
                    self.cond.wait(self.queue[0][0] - time.monotonic() if self.queue else None)
                _, task_id = self.queue.pop(0)
            done = subprocess.run([exe, "signal", task_id, "--kind", "approval", "--actor", "bench"],
                                  cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=60)
            if done.returncode:
                self.failures.append(f"{task_id}: {(done.stderr or done.stdout).strip()[:200]}")
            else:
                self.sent += 1


def _kind(row: Any) -> str:
    """What made a dispatched task ready last: its approval (the ready time at most :data:`APPROVAL_STAMPS_APART`
    after the signal's), its due time (equal), or else a dependency's completion (a task with dependencies) or its
    instance's arrival."""
    ready = _as_time(row.ready_at)
    # ``pollbridge signal`` stamps signal_received_at and updated_at with two clock_timestamp() calls, and the
    # ready time is the later of them: microseconds apart now and then (27 pairs of 1,000 differed).
    if row.signal_received_at is not None \
            and timedelta(0) <= ready - _as_time(row.signal_received_at) < APPROVAL_STAMPS_APART:
        return "approval"
    if row.due_at is not None and _as_time(row.due_at) == ready:
        return "timer"
    return "dependency" if _deps(row) else "arrival"


def _deps(row: Any) -> list[Any]:
    """The task keys a row depends on (JSON text on SQLite)."""
    deps = json.loads(row.depends_on) if isinstance(row.depends_on, str) else row.depends_on
    return list(deps or [])


def _as_time(value: Any) -> datetime:
    """A timestamp of either backend (SQLite's are text, naive UTC) as an aware datetime."""
    moment: datetime = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _completion_commits(conn: sa.Connection) -> dict[tuple[str, str], datetime]:
    """When each completed task's completion committed, by (instance, key): the commit timestamp of the row's
    last writer (``track_commit_timestamp``; nothing writes a completed row again). Empty on SQLite or when the
    server keeps no commit timestamps."""
    if conn.dialect.name != "postgresql" or conn.execute(sa.text("SHOW track_commit_timestamp")).scalar() != "on":
        return {}
    rows = conn.execute(sa.text("SELECT instance_id, task_key, pg_xact_commit_timestamp(xmin) AS committed "
                                "FROM tasks WHERE status = 'completed'")).all()
    return {(str(r.instance_id), str(r.task_key)): r.committed for r in rows if r.committed is not None}


def _completions_published(namespace: str) -> dict[tuple[str, str], datetime]:
    """When each completion's event was first added to the Redis bus, by (instance, key): the entry id's
    millisecond, rounded down (Redis stamps an auto id with its clock; compared with PostgreSQL's, so both must run
    on one host, as the bench's defaults do); the relay may publish twice. Empty if Redis cannot be read (the run's
    other figures stand)."""
    client = redis.Redis.from_url(REDIS_URL)
    published: dict[tuple[str, str], datetime] = {}
    try:
        for stream in BusKeys(namespace).streams(BusSettings().partitions):
            after = "-"
            while entries := client.xrange(stream, min=after, count=5000):
                for entry_id, fields in entries:
                    data = json.loads(fields.get(FIELD_PAYLOAD.encode(), b"{}")).get("data", {})
                    if data.get("new_status") != "completed":
                        continue
                    at = datetime.fromtimestamp(entry_order(entry_id.decode())[0] / 1000, UTC)
                    key = (str(data.get("instance_id")), str(data.get("task_key")))
                    published[key] = min(at, published.get(key, at))
                after = "(" + entries[-1][0].decode()
    except redis.RedisError as exc:
        print(f"the bus's times not read ({first_line(exc)}): no split at the bus", file=sys.stderr)
        return {}
    finally:
        client.close()
    return published


@dataclass
class DependencySplit:
    """A dependency's wait split where its last upstream's completion committed: the worker's own commit (after the
    ``completed_at`` its UPDATE stamped; nothing downstream can shorten it), then what the event path took once the
    change was visible; with the bus's times, that part again where the relay added the event."""

    worker_commit: list[float] = field(default_factory=list)
    commit_to_dispatch: list[float] = field(default_factory=list)
    commit_to_bus: list[float] = field(default_factory=list)
    bus_to_dispatch: list[float] = field(default_factory=list)
    left_out: int = 0  # dependencies with an upstream commit unknown or outside ready .. dispatched
    left_out_of_bus: int = 0  # split at the commit, not at the bus (an event unknown or added after the dispatch)

    def add(self, row: Any, commits: dict[tuple[str, str], datetime],
            published: dict[tuple[str, str], datetime]) -> tuple[float | None, float | None]:
        """Count one dependency's dispatch (``depends_on``: its upstream keys); return its worker's commit and its
        time to the bus in ms, None where a time is missing or out of order: an upstream commit unknown or not
        between the ready time and the dispatch (the task was made ready by something else last), or an upstream
        event added after the dispatch (the scheduler dispatched a join on an earlier upstream's event, the last
        commit visible by then)."""
        deps = _deps(row)
        committed = [commits.get((str(row.instance_id), str(k))) for k in deps]
        ready, dispatched = _as_time(row.ready_at), _as_time(row.dispatched_at)
        if not committed or None in committed:
            self.left_out += 1
            return None, None
        last = _as_time(max(c for c in committed if c is not None))
        if not ready <= last <= dispatched:
            self.left_out += 1
            return None, None
        commit_ms = (last - ready).total_seconds() * 1000
        self.worker_commit.append(commit_ms)
        self.commit_to_dispatch.append((dispatched - last).total_seconds() * 1000)
        if not published:
            return commit_ms, None
        added = [published.get((str(row.instance_id), str(k))) for k in deps]
        on_bus = None if None in added else max(a for a in added if a is not None)
        # The entry id's millisecond is rounded down: an event added in the dispatch's millisecond is not after it.
        if on_bus is None or on_bus > dispatched:
            self.left_out_of_bus += 1
            return commit_ms, None
        bus_ms = (on_bus - last).total_seconds() * 1000
        self.commit_to_bus.append(bus_ms)
        self.bus_to_dispatch.append((dispatched - on_bus).total_seconds() * 1000)
        return commit_ms, bus_ms

    def summary(self) -> dict[str, Any] | None:
        if not self.worker_commit:
            return None
        return {"worker_commit": latency_summary(self.worker_commit),
                "commit_to_dispatch": latency_summary(self.commit_to_dispatch),
                "commit_to_bus_ms_resolution": latency_summary(self.commit_to_bus),
                "bus_to_dispatch_ms_resolution": latency_summary(self.bus_to_dispatch),
                "left_out": self.left_out, "left_out_of_bus": self.left_out_of_bus}


def measure(engine: sa.Engine, plan: Plan, namespace: str | None = None) -> dict[str, Any]:
    tables = reflect_tables(engine, TaskTableMapping())
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT l.task_id, l.instance_id, l.task_key, l.ready_at, l.dispatched_at, t.due_at, "
            "t.signal_received_at, t.depends_on FROM pollbridge_dispatch_log l "
            "JOIN tasks t ON CAST(t.id AS TEXT) = l.task_id WHERE l.path = 'events'")).all()
        verdict = verify(conn, tables, [s.instance_id for s in plan.specs])
        tasks = conn.execute(sa.text("SELECT count(*) FROM tasks")).scalar_one()
        commits = _completion_commits(conn)
    published = _completions_published(namespace) if namespace and commits else {}
    by_kind: dict[str, list[float]] = {}
    everything: list[float] = []
    split = DependencySplit()
    slowest: list[tuple[float, str, str, str, float | None, float | None]] = []
    for r in rows:
        dispatched, ready = _as_time(r.dispatched_at), _as_time(r.ready_at)
        ms = (dispatched - ready).total_seconds() * 1000
        kind = _kind(r)
        by_kind.setdefault(kind, []).append(ms)
        everything.append(ms)
        commit_ms, bus_ms = split.add(r, commits, published) if kind == "dependency" else (None, None)
        slowest.append((round(ms, 2), kind, str(r.instance_id), str(r.task_key),
                        None if commit_ms is None else round(commit_ms, 2),
                        None if bus_ms is None else round(bus_ms, 2)))
    slowest.sort(key=lambda s: s[0], reverse=True)
    return {"latency": latency_summary(everything),
            "by_kind": {k: latency_summary(v) for k, v in sorted(by_kind.items())},
            "dependency_split": split.summary(),
            "slowest": slowest[:8], "tasks": int(tasks), "dispatches": len(rows),
            "lost": verdict.lost, "completed": verdict.completed, "doubled": verdict.double_dispatched,
            "early": verdict.early, "problems": list(verdict.problems[:5])}


def one_run(config: Config, n: int, args: argparse.Namespace) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:6]
    plan = build_plan(args.instances, args.tasks, args.arrival_rate, args.approvals, args.seed + n, f"e{n}x")
    namespace = f"pbe2e{run_id}"
    workdir = Path(tempfile.mkdtemp(prefix=f"pbe2e-{config.name}-"))
    with contextlib.ExitStack() as stack:
        if config.pg:
            url = stack.enter_context(scratch_database(f"pollbridge_bench_e2e_{config.name}"))
            bus_url = REDIS_URL
            stack.callback(delete_namespace, namespace)
        else:
            url, bus_url = f"sqlite:///{workdir / 'pollbridge.db'}", "embedded"
            stack.callback(_remove_sqlite, workdir / "pollbridge.db")
        if config.capture == "wal":
            stack.callback(_drop_slot, url)
        engine = create_engine(url)
        stack.callback(engine.dispose)
        install.init(engine, demo_schema=True, mapping=TaskTableMapping(),
                     capture=CaptureSettings(mode="wal" if config.capture == "wal" else "trigger"))
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE INDEX IF NOT EXISTS bench_tasks_queued ON tasks (id) "
                                 "WHERE status = 'queued'"))
        tables = reflect_tables(engine, TaskTableMapping())
        (workdir / "pollbridge.toml").write_text(_toml(config, namespace))
        env = {**os.environ, "POLLBRIDGE_DATABASE_URL": url, "POLLBRIDGE_BUS_URL": bus_url}
        children = pc.Children(workdir, env)
        stack.callback(children.stop_all)
        start_processes(config.path, url, bus_url, namespace, children, argparse.Namespace(schedulers=1))
        if config.capture == "wal":
            _wal_streaming(url, children)
        children.spawn("worker", [sys.executable, "-m", "bench._paths_common", "fleet", "--url", url,
                                  "--poll", str(args.worker_poll), "--min-duration", "0.01",
                                  "--max-duration", "0.05"], count="self")
        signaller = Signaller(workdir, env)
        stack.callback(signaller.close)
        load = pc.MachineLoad([url.rsplit("/", 1)[1]] if config.pg else [])
        load.start([c.proc.pid for c in children.items])
        started = time.monotonic()
        for spec, offset in zip(plan.specs, plan.offsets, strict=True):
            time.sleep(max(0.0, started + offset - time.monotonic()))
            children.check_alive()
            with engine.begin() as conn:
                seed(conn, tables, [spec])
            if spec.instance_id in plan.approvals:
                key, at = plan.approvals[spec.instance_id]
                with engine.connect() as conn:
                    task_id = conn.execute(sa.text("SELECT id FROM tasks WHERE instance_id = :i AND task_key = :k"),
                                           {"i": spec.instance_id, "k": key}).scalar_one()
                signaller.add(started + at, str(task_id))
        arrivals = time.monotonic() - started
        deadline = time.monotonic() + FINISH_TIMEOUT + 3.0
        left = -1
        while time.monotonic() < deadline:
            children.check_alive()
            with engine.connect() as conn:
                left = conn.execute(sa.text("SELECT count(*) FROM tasks WHERE status IN "
                                            "('pending', 'queued', 'running')")).scalar_one()
            if not left:
                break
            time.sleep(0.1)
        finished = time.monotonic() - started
        machine_load = load.stop()
        signaller.close()
        children.stop_all()
        result = measure(engine, plan, namespace if config.pg else None)
    result.update({"config": config.name, "run": n + 1, "arrivals_s": round(arrivals, 1),
                   "finished_s": round(finished, 1), "unfinished": int(left), "signals_sent": signaller.sent,
                   "signal_failures": signaller.failures[:5], "load": machine_load, "logs": str(workdir)})
    return result


def broken(r: dict[str, Any]) -> bool:
    return bool(r.get("error") or r["unfinished"] or r["lost"] or r["doubled"] or r["early"] or r["problems"]
                or r["signal_failures"])


def print_report(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        if r.get("error"):
            rows.append([r["config"], r["run"], "error", r["error"][:60], "", "", "", "", "", "", ""])
            continue
        lat, kinds = r["latency"], r["by_kind"]
        rows.append([r["config"], r["run"], lat["n"], lat["p50_ms"], lat["p90_ms"], lat["p99_ms"], lat["max_ms"],
                     " ".join(f"{k}:{v['p99_ms']}" for k, v in kinds.items()), _split(r.get("dependency_split")),
                     r["load"].get("other_cpu_pct"), "BROKEN" if broken(r) else "ok"])
    print(pc.table(["config", "run", "dispatches", "p50 ms", "p90 ms", "p99 ms", "max ms", "p99 by kind (ms)",
                    "dependency: worker's commit / after it, p99 max (ms)", "others % core", "oracle"], rows))


def _split(split: dict[str, Any] | None) -> str:
    if not split:
        return ""
    w, a, b = split["worker_commit"], split["commit_to_dispatch"], split["commit_to_bus_ms_resolution"]
    bus = f" (to the bus {b['p99_ms']} {b['max_ms']})" if b["n"] else ""
    return f"{w['p99_ms']} {w['max_ms']} / {a['p99_ms']} {a['max_ms']}{bus}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--configs", default="trigger,wal,embedded")
    parser.add_argument("--instances", type=int, default=80)
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--arrival-rate", type=float, default=4.0)
    parser.add_argument("--approvals", type=float, default=0.25)
    parser.add_argument("--worker-poll", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.configs, args.instances = 1, "trigger,embedded", 20
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in ("trigger", "wal", "embedded")]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; expected trigger, wal, embedded")
    pc.exit_on_signals()
    info = pc.machine_info()
    results: list[dict[str, Any]] = []
    for n in range(args.runs):
        for name in names if n % 2 == 0 else names[::-1]:
            config = CONFIGS[name]
            print(f"[{name}] run {n + 1}: {args.instances} instances at {args.arrival_rate:g}/s ...", flush=True)
            try:
                r = one_run(config, n, args)
            except RuntimeError as exc:
                print(f"[{name}] run {n + 1} broke: {exc}", file=sys.stderr, flush=True)
                results.append({"config": name, "run": n + 1, "error": str(exc)})
                continue
            results.append(r)
            lat = r["latency"]
            print(f"[{name}] run {n + 1}: {lat['n']} dispatches, p50 {lat['p50_ms']} p99 {lat['p99_ms']} "
                  f"max {lat['max_ms']} ms; slowest {r['slowest'][:3]}", flush=True)
    print_report(results)
    write_json(args.json, {"machine": info, "args": vars(args), "runs": results})
    return 1 if any(broken(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
