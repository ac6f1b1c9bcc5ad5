"""Bus backends side by side (issue 21): the relay and the event path on each bus, same load, one run.

    python -m bench.backends [--backends embedded,redis,redis-cluster,rabbitmq] [--rate 500] [--seconds 10]
                             [--rows 50000] [--throughput-seconds 8] [--rounds 2] [--quick] [--json F]

Backends, each opened by its URL (``bridge.bus.open_bus``), each with PostgreSQL scratch databases:

* ``embedded``: the log in the scratch database (PostgreSQL).
* ``redis``: Redis Streams on ``$POLLBRIDGE_BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``).
* ``redis-cluster``: a private Redis Cluster of 3 primaries and 3 replicas started for the run
  (``tests.support.redis_cluster``; the bus detects the cluster and uses redis-py's cluster client).
* ``rabbitmq``: RabbitMQ streams on ``$POLLBRIDGE_BENCH_RABBITMQ_URL`` (default
  ``amqp://guest:guest@127.0.0.1:5672/%2F``).

A backend that cannot be set up (no server, no module, no ``redis-server`` binary) is reported as skipped,
with the reason, and the run goes on.

For each backend:

1. *relay rows/s into the bus*: ``--rows`` tasks inserted in one statement, the outbox drained by the relay
   in this process, batch 5000 (``bench.relay.throughput``).
2. *commit -> readable* at ``--rate`` changes/s: ``pollbridge relay run`` as a process, single-row status
   updates committed by this process, read by a consumer group in this process (``bench.relay.latency``).
3. *ready -> dispatch* at ``--rate`` completions/s: chains of 10 tasks, completed by this process, each
   completion making the next task ready; ``dispatched_at - ready_at`` from the dispatch log
   (``bench.minimal.window`` on ``bench.minimal.start_pollbridge``), with **1 relay + 1 scheduler** and with
   **2 relays + 2 schedulers** (``[capture] relay_partitions = 2``: the capture trigger gives each change a
   relay partition by a hash of its instance, one ``pollbridge relay run --partition N`` each; the schedulers
   split the 8 bus partitions by leases).
4. *sustained transitions/s*: the same two stacks, completions flat out; completions + dispatches per second.

Alternation: each measurement goes round every backend (and both stacks) in this one process, ``--rounds``
times, the order reversed every other round, so load from outside falls on all alike. Every stack is started
once and stopped (SIGSTOP) except while it is measured. For the event path, CPU-seconds per second of the
relays, the schedulers, the scratch database's PostgreSQL backends, the bus server's processes and this
process (the completer) are read from ``/proc`` over each window. The bus servers on 6379 and 5672 are shared
with whatever else runs on the machine: their CPU includes others' use.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import _paths_common as pc
from bench import minimal
from bench import relay as relay_bench
from bench.common import REDIS_URL, scratch_database, write_json
from bridge.app import install
from bridge.bus import open_bus
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import BusSettings, CaptureSettings
from bridge.db.engine import create_engine
from event_scheduler.leases import lease_snapshot

BACKENDS = ("embedded", "redis", "redis-cluster", "rabbitmq")
QUICK_BACKENDS = ("embedded", "redis")
RABBITMQ_URL = os.environ.get("POLLBRIDGE_BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
STACKS = (1, 2)  # 1 relay + 1 scheduler, 2 relays + 2 schedulers
RELAY_BATCH = 5000


class Unavailable(Exception):
    """The backend cannot be set up here; the message says why."""


@dataclass
class Backend:
    name: str
    url: str
    #: The bus server's processes, for their CPU (none for the embedded bus: it is PostgreSQL).
    server_pids: Callable[[], list[int]] = field(default=lambda: [])
    note: str = ""


def _pids_named(comm: str) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if Path(entry.path, "comm").read_text().strip() == comm:
                    pids.append(int(entry.name))
    return pids


def _local(url: str) -> bool:
    return any(h in url for h in ("@127.0.0.1", "//127.0.0.1", "@localhost", "//localhost"))


def set_up(name: str, resources: contextlib.ExitStack) -> Backend:
    """The backend ``name`` ready to open by URL, or :class:`Unavailable`. Servers started for the run are
    stopped when ``resources`` closes."""
    if name == "embedded":
        return Backend(name, "embedded", note="the log in the scratch PostgreSQL database")
    if name == "redis":
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=3, socket_connect_timeout=3)
        try:
            info = client.info()
        except redis.RedisError as exc:
            raise Unavailable(f"no Redis at {REDIS_URL} ({type(exc).__name__}: {exc})") from exc
        finally:
            client.close()
        if info.get("cluster_enabled"):
            raise Unavailable(f"{REDIS_URL} is a cluster node (redis-cluster starts a cluster of its own)")
        pid = int(info.get("process_id", 0))
        return Backend(name, REDIS_URL, (lambda: [pid]) if pid and _local(REDIS_URL) else (lambda: []),
                       note=f"Redis {info.get('redis_version', '?')}, Streams")
    if name == "redis-cluster":
        try:
            from tests.support.redis_cluster import PRIMARIES, running_cluster
        except ImportError as exc:  # run from outside the checkout, or without the test extra
            raise Unavailable(f"tests.support.redis_cluster cannot be imported ({exc})") from exc
        try:
            cluster = resources.enter_context(running_cluster())
        except (OSError, RuntimeError) as exc:
            raise Unavailable(f"a local Redis Cluster could not be started ({type(exc).__name__}: {exc})") from exc
        pids = [p.pid for p in cluster.processes.values()]
        return Backend(name, cluster.url, lambda: pids,
                       note=f"private cluster, {PRIMARIES} primaries + {PRIMARIES} replicas, ports {cluster.ports}")
    if name == "rabbitmq":
        ns = f"pbbkprobe{uuid.uuid4().hex[:6]}"
        try:
            bus = open_bus(RABBITMQ_URL, partitions=8, namespace=ns)
            try:
                bus.ensure_group("probe")
            finally:
                with contextlib.suppress(Exception):
                    bus.purge_all()
                bus.close()
        except Exception as exc:  # anything here means "cannot be used": reported, the run goes on
            raise Unavailable(f"RabbitMQ bus at {RABBITMQ_URL.split('@')[-1]} unusable "
                              f"({type(exc).__name__}: {exc})") from exc
        return Backend(name, RABBITMQ_URL, (lambda: _pids_named("beam.smp")) if _local(RABBITMQ_URL) else (lambda: []),
                       note="RabbitMQ streams (bridge/bus/rabbitmq.py)")
    raise Unavailable(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")


def purge(backend: Backend, namespace: str) -> None:
    """Delete what the run left on a shared bus server (the embedded log goes with its scratch database)."""
    if backend.url == "embedded":
        return
    with contextlib.suppress(Exception):
        bus = open_bus(backend.url, partitions=BusSettings().partitions, namespace=namespace)
        try:
            bus.purge_all()
        finally:
            bus.close()


def new_namespace() -> str:
    return f"pbbk{uuid.uuid4().hex[:8]}"


def db_name(*parts: str) -> str:
    return "pollbridge_bench_backends_" + "_".join(p.replace("-", "_") for p in parts)


# --- 1 and 2: the relay ----------------------------------------------------------------------------------
def relay_figures(backend: Backend, rows: int, rate: float, seconds: float) -> dict[str, Any]:
    """Relay throughput into the bus and commit -> readable latency, in a fresh scratch database."""
    tp_ns, lat_ns = new_namespace(), new_namespace()
    try:
        with scratch_database(db_name("relay", backend.name)) as url:
            engine = create_engine(url)
            install.init(engine, demo_schema=True, mapping=TaskTableMapping(), capture=CaptureSettings())
            try:
                tp = relay_bench.throughput(url, rows, RELAY_BATCH, tp_ns, bus_url=backend.url)
                lat = relay_bench.latency(url, rate, seconds, "adaptive", lat_ns, bus_url=backend.url)
            finally:
                install.uninstall(engine, TaskTableMapping())
                engine.dispose()
    finally:
        purge(backend, tp_ns)
        purge(backend, lat_ns)
    return {"backend": backend.name, "throughput": tp, "latency": lat}


# --- 3 and 4: the event path, 1 + 1 and 2 + 2 -------------------------------------------------------------
@dataclass
class Stack:
    backend: Backend
    n: int  # relays = schedulers = n
    url: str
    namespace: str
    pipeline: minimal.Pollbridge
    children: pc.Children

    @property
    def label(self) -> str:
        return f"{self.backend.name} {self.n}+{self.n}"

    @property
    def dbname(self) -> str:
        return self.url.rsplit("/", 1)[1]

    def signal(self, signum: int) -> None:
        for c in self.children.items:
            if c.proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.kill(c.proc.pid, signum)

    def leases_fresh(self) -> bool:
        """Every scheduler registered and every bus partition leased to one of them, unexpired."""
        engine = create_engine(self.url)
        bus = open_bus(self.backend.url, engine=engine, partitions=BusSettings().partitions,
                       namespace=self.namespace)
        try:
            snap = lease_snapshot(engine, bus)
            return snap.settled(self.n, bus.partitions) and snap.held_by(set(snap.members)) >= set(
                range(bus.partitions))
        finally:
            bus.close()
            engine.dispose()


def start_stack(backend: Backend, n: int, resources: contextlib.ExitStack) -> Stack:
    """A scratch database with pollbridge, ``n`` relays and ``n`` schedulers on the backend; stopped (SIGSTOP)."""
    namespace = new_namespace()
    resources.callback(purge, backend, namespace)
    url = resources.enter_context(scratch_database(db_name(backend.name, f"{n}x{n}")))
    workdir = Path(tempfile.mkdtemp(prefix=f"pbbk-{backend.name}-{n}x{n}-"))
    p, children = minimal.start_pollbridge(url, workdir, namespace, schedulers=n, bus_url=backend.url, relays=n)
    resources.callback(children.stop_all)  # before the database is dropped (callbacks run last-in first-out)
    stack = Stack(backend, n, url, namespace, p, children)
    resources.callback(stack.signal, signal.SIGCONT)  # first: a stopped process would hold its SIGTERM
    stack.signal(signal.SIGSTOP)
    return stack


@contextlib.contextmanager
def running(stack: Stack) -> Iterator[None]:
    """The stack continued (SIGCONT) for the block and its leases fresh again; stopped again after."""
    stack.signal(signal.SIGCONT)
    try:
        if not minimal.wait_until(stack.leases_fresh, 60, stack.children):
            print(f"warning: {stack.label}: the schedulers' leases did not settle within 60 s", file=sys.stderr)
        yield
    finally:
        stack.signal(signal.SIGSTOP)


def cpu_meter(stack: Stack) -> Callable[[], dict[str, Any]]:
    """Start counting CPU seconds of the stack's processes, its database's backends, the bus server and this
    process; the returned function stops and gives CPU-seconds per second of each."""
    started = time.perf_counter()
    kids0 = stack.children.cpu()
    backends = pc.BackendCpu(stack.dbname)
    backends.start()
    servers = stack.backend.server_pids()
    server0 = {pid: pc.cpu_seconds(pid) or 0.0 for pid in servers}
    me0 = pc.cpu_seconds(os.getpid()) or 0.0

    def stop() -> dict[str, Any]:
        elapsed = max(time.perf_counter() - started, 1e-9)
        kids1 = stack.children.cpu()
        per = {k: v - kids0.get(k, 0.0) for k, v in kids1.items()}
        server = sum((pc.cpu_seconds(pid) or server0[pid]) - server0[pid] for pid in servers)
        postgres = backends.stop()
        me = (pc.cpu_seconds(os.getpid()) or me0) - me0

        def rate(value: float | None) -> float | None:
            return None if value is None else round(value / elapsed, 3)

        return {"cpu_per_s": {
            "relays": rate(sum(v for k, v in per.items() if k.startswith("relay"))),
            "schedulers": rate(sum(v for k, v in per.items() if k.startswith("scheduler"))),
            "postgres": rate(postgres),
            "bus_server": rate(server) if servers else None,
            "bench": rate(me),
        }}

    return stop


def path_window(stack: Stack, rate: float | None, seconds: float) -> dict[str, Any]:
    with running(stack):
        r = minimal.window(stack.pipeline, stack.children, rate, seconds, meter=lambda: cpu_meter(stack))
    r.update(backend=stack.backend.name, stack=f"{stack.n}+{stack.n}", pipeline="pollbridge")
    return r


# --- the run -----------------------------------------------------------------------------------------------
def ordered(items: Sequence[Any], round_no: int) -> list[Any]:
    return list(items) if round_no % 2 == 0 else list(items)[::-1]


def median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 2) if got else None


def summarise(results: dict[str, Any], names: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        relay_runs = [r for r in results["relay"] if r["backend"] == name and "error" not in r]
        row: dict[str, Any] = {
            "backend": name,
            "relay_rows_per_s": median([r["throughput"]["rows_per_s"] for r in relay_runs]),
            "readable_p50_ms": median([r["latency"]["p50_ms"] for r in relay_runs]),
            "readable_p99_ms": median([r["latency"]["p99_ms"] for r in relay_runs]),
        }
        for n in STACKS:
            key = f"{n}+{n}"
            at_rate = [w for w in results["paths"] if w["backend"] == name and w["stack"] == key and "error" not in w]
            flat = [w for w in results["flat_out"] if w["backend"] == name and w["stack"] == key and "error" not in w]
            row[f"{key} p50_ms"] = median([w["latency"]["p50_ms"] for w in at_rate])
            row[f"{key} p99_ms"] = median([w["latency"]["p99_ms"] for w in at_rate])
            row[f"{key} transitions_per_s"] = median([w["transitions_per_s"] for w in flat])
        one, two = row["1+1 transitions_per_s"], row["2+2 transitions_per_s"]
        row["2+2 / 1+1"] = round(two / one, 2) if one and two else None
        rows.append(row)
    return rows


def cpu_rows(results: dict[str, Any]) -> list[list[Any]]:
    """Mean CPU-seconds per second of each part, per backend and stack, for the windows at the rate and flat out."""
    out = []
    for kind in ("paths", "flat_out"):
        keys: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for w in results[kind]:
            if "cpu_per_s" in w:
                keys.setdefault((w["backend"], w["stack"]), []).append(w["cpu_per_s"])
        for (backend, stack), cpus in keys.items():
            def mean(part: str, cpus: list[dict[str, Any]] = cpus) -> float | None:
                got = [c[part] for c in cpus if c.get(part) is not None]
                return round(statistics.fmean(got), 2) if got else None

            parts = [mean(p) for p in ("relays", "schedulers", "postgres", "bus_server", "bench")]
            out.append([f"{backend} {stack}", "at rate" if kind == "paths" else "flat out", *parts,
                        round(sum(p for p in parts if p is not None), 2)])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backends", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", help=f"comma-separated, from {','.join(BACKENDS)} "
                                           f"[default: all; with --quick: {','.join(QUICK_BACKENDS)}]")
    parser.add_argument("--rate", type=float, default=500, help="changes/s and completions/s of the latency runs")
    parser.add_argument("--seconds", type=float, default=10, help="each latency window")
    parser.add_argument("--rows", type=int, default=50_000, help="rows of the relay throughput run")
    parser.add_argument("--throughput-seconds", type=float, default=8, help="each flat-out window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI (< 90 s)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if args.quick:
        args.rate, args.seconds, args.rows, args.throughput_seconds, args.rounds = 200, 2, 5000, 2, 1
    names = [b.strip() for b in (args.backends or ",".join(QUICK_BACKENDS if args.quick else BACKENDS)).split(",")
             if b.strip()]
    pc.exit_on_signals()
    started = time.monotonic()
    results: dict[str, Any] = {
        "command": " ".join(["python -m bench.backends", *(sys.argv[1:] if argv is None else argv)]),
        "machine": pc.machine_info(), "rate": args.rate, "seconds": args.seconds, "rows": args.rows,
        "throughput_seconds": args.throughput_seconds, "rounds": args.rounds,
        "backends": {}, "skipped": {}, "relay": [], "paths": [], "flat_out": []}
    print(f"load average at start: {results['machine']['load_at_start']}", flush=True)
    with contextlib.ExitStack() as resources:
        backends: list[Backend] = []
        for name in names:
            try:
                b = set_up(name, resources)
            except Unavailable as exc:
                results["skipped"][name] = str(exc)
                print(f"{name}: skipped: {exc}", flush=True)
                continue
            backends.append(b)
            results["backends"][name] = {"url": b.url.split("@")[-1], "note": b.note}

        results["phase_seconds"] = {"set_up": round(time.monotonic() - started, 1)}
        mark = time.monotonic()
        # 1 and 2: the relay, alternating backends.
        for n in range(args.rounds):
            for b in ordered(backends, n):
                try:
                    r = relay_figures(b, args.rows, args.rate, args.seconds)
                except Exception as exc:  # one backend's failure is reported; the run goes on
                    r = {"backend": b.name, "error": f"{type(exc).__name__}: {exc}"}
                    print(f"round {n + 1} {b.name:>13} relay: error: {r['error']}", flush=True)
                else:
                    tp, lat = r["throughput"], r["latency"]
                    print(f"round {n + 1} {b.name:>13} relay: {tp['rows_per_s']:,.0f} rows/s; commit -> readable "
                          f"at {lat['rate_per_s']:g}/s: p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms "
                          f"({lat['received']}/{lat['updates']}); load {pc.load_average()}", flush=True)
                r["round"] = n + 1
                results["relay"].append(r)

        results["phase_seconds"]["relay"] = round(time.monotonic() - mark, 1)
        mark = time.monotonic()
        # 3 and 4: the event path, every stack started once and stopped while another is measured.
        stacks: list[Stack] = []
        for b in backends:
            for k in STACKS:
                try:
                    stacks.append(start_stack(b, k, resources))
                except Exception as exc:  # reported; the run goes on without this stack
                    err = f"{type(exc).__name__}: {str(exc)[-1500:]}"
                    results.setdefault("stack_errors", {})[f"{b.name} {k}+{k}"] = err
                    print(f"{b.name} {k}+{k}: could not start: {err}", flush=True)
        results["phase_seconds"]["start_stacks"] = round(time.monotonic() - mark, 1)
        for kind, rate, seconds in (("paths", args.rate, args.seconds), ("flat_out", None, args.throughput_seconds)):
            mark = time.monotonic()
            for n in range(args.rounds):
                for s in ordered(stacks, n):
                    try:
                        w = path_window(s, rate, seconds)
                    except Exception as exc:  # reported; the run goes on
                        w = {"backend": s.backend.name, "stack": f"{s.n}+{s.n}",
                             "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
                        print(f"round {n + 1} {s.label:>17}: error: {w['error']}", flush=True)
                    else:
                        lat, cpu = w["latency"], w["cpu_per_s"]
                        what = (f"at {w['completions_per_s']}/s: ready -> dispatch p50 {lat['p50_ms']} ms, "
                                f"p99 {lat['p99_ms']} ms (n={lat['n']})" if rate else
                                f"flat out: {w['transitions_per_s']:,.0f} transitions/s")
                        print(f"round {n + 1} {s.label:>17} {what}; CPU/s relays {cpu['relays']}, schedulers "
                              f"{cpu['schedulers']}, postgres {cpu['postgres']}, bus server {cpu['bus_server']}; "
                              f"load {w['load_after']}, others {w['other_cpu_pct']}% of a core", flush=True)
                    w["round"] = n + 1
                    results[kind].append(w)
            results["phase_seconds"][kind] = round(time.monotonic() - mark, 1)
        for s in stacks:
            s.signal(signal.SIGCONT)  # stop_all's SIGTERM must reach running processes
            s.children.stop_all()
            results.setdefault("processes", {})[s.label] = {c.name: {"peak_rss_mb": c.peak_rss_mb}
                                                             for c in s.children.items}
    results["summary"] = summarise(results, [b.name for b in backends])
    results["machine"]["load_at_end"] = pc.load_average()
    results["wall_seconds"] = round(time.monotonic() - started, 1)
    print()
    print(pc.table(["backend", "relay rows/s", "readable p50", "p99", "1+1 r->d p50", "p99", "2+2 r->d p50", "p99",
                    "1+1 trans/s", "2+2 trans/s", "2+2/1+1"],
                   [[r["backend"], r["relay_rows_per_s"], r["readable_p50_ms"], r["readable_p99_ms"],
                     r["1+1 p50_ms"], r["1+1 p99_ms"], r["2+2 p50_ms"], r["2+2 p99_ms"],
                     r["1+1 transitions_per_s"], r["2+2 transitions_per_s"], r["2+2 / 1+1"]]
                    for r in results["summary"]]))
    print(f"(ms; medians over {args.rounds} round(s); readable at {args.rate:g} changes/s, ready -> dispatch at "
          f"{args.rate:g} completions/s)")
    print()
    print(pc.table(["CPU-s/s", "window", "relays", "schedulers", "postgres", "bus server", "bench", "total"],
                   cpu_rows(results)))
    for name, reason in results["skipped"].items():
        print(f"skipped {name}: {reason}")
    print(f"load average at start {results['machine']['load_at_start']}, at end {results['machine']['load_at_end']}; "
          f"{results['wall_seconds']} s ({results.get('phase_seconds')})", flush=True)
    write_json(args.json_path, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
