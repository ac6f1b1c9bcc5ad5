"""The job queues a user might pick instead: procrastinate and pgqueuer next to pollbridge's event path.

    python -m bench.peers [--rate 500] [--seconds 15] [--throughput-seconds 10] [--concurrency 10]
                          [--peers procrastinate,pgqueuer] [--quick] [--json F]

Needs the optional extra: ``pip install -e '.[bench]'``. A peer whose library is not installed (or
fails to set up) is reported as skipped, with the reason; the run goes on.

Each runs on the same PostgreSQL, in a scratch database of its own, its worker in a process of its own:

* **procrastinate** (``PsycopgConnector``, ``run_worker_async(concurrency=--concurrency)``, LISTEN/NOTIFY on);
* **pgqueuer** (``PsycopgDriver``, ``QueueManager.run(batch_size=--concurrency)``, LISTEN/NOTIFY);
* **pollbridge**: ``pollbridge relay run`` + ``--schedulers`` x ``pollbridge scheduler run --phase cutover``
  on Redis Streams, driven as in ``bench.minimal``: tasks of 10-task chains are completed, each
  completion makes the next task ready, the event path dispatches it.

*Latency*, "the job became ready → a worker picked it up": for a peer, the bench enqueues a no-op job
at ``--rate`` per second for ``--seconds``, each carrying the wall clock just before its enqueue call
(which commits it); the worker records the wall clock when the job function starts (same host, same
clock). For pollbridge: ``dispatched_at - ready_at`` of the dispatch log (ready = the predecessor's
completion, dispatched = the compare-and-set that hands the task to the platform's workers; how fast
those workers pick a dispatched task up is the platform's own business and not measured).
*Throughput*: jobs enqueued flat out (batches of 100) for ``--throughput-seconds``, jobs picked up per
second until the queue is drained; for pollbridge, completions as fast as possible, completions +
dispatches per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import _paths_common as pc
from bench.common import delete_namespace, latency_summary, scratch_database, write_json

PEERS = ("procrastinate", "pgqueuer")


# --- worker processes (``--role``) --------------------------------------------------------------------
class Recorder:
    """Appends ``enqueued picked`` lines to a file, flushed every 0.1 s (the bench reads it while running)."""

    def __init__(self, path: str) -> None:
        self.out = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (closed by the flusher at exit)
        self.lock = threading.Lock()
        threading.Thread(target=self._flush, daemon=True).start()

    def record(self, enqueued: float) -> None:
        picked = time.time()
        with self.lock:
            self.out.write(f"{enqueued!r} {picked!r}\n")

    def _flush(self) -> None:
        while True:
            time.sleep(0.1)
            with self.lock:
                self.out.flush()


def procrastinate_app(url: str) -> Any:
    import procrastinate

    # It warns that the app lives in ``__main__`` (python -m bench.peers): harmless here, tasks are found by name.
    logging.getLogger("procrastinate.blueprints").setLevel(logging.ERROR)
    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=pc.libpq(url)))


def procrastinate_worker(url: str, out: str, concurrency: int) -> None:
    app = procrastinate_app(url)
    recorder = Recorder(out)

    @app.task(name="noop")  # type: ignore[untyped-decorator]
    async def noop(enq: float) -> None:
        recorder.record(enq)

    async def run() -> None:
        async with app.open_async():
            await app.run_worker_async(concurrency=concurrency, wait=True, listen_notify=True)

    asyncio.run(run())


def pgqueuer_worker(url: str, out: str, concurrency: int) -> None:
    import psycopg
    from pgqueuer import Job, Queries, QueueManager

    recorder = Recorder(out)

    async def run() -> None:
        conn = await psycopg.AsyncConnection.connect(pc.libpq(url), autocommit=True)
        qm = QueueManager(Queries.from_psycopg_connection(conn))

        @qm.entrypoint("noop")
        async def noop(job: Job) -> None:
            recorder.record(float(job.payload or b"0"))

        await qm.run(batch_size=concurrency)

    asyncio.run(run())


# --- enqueuing from the bench --------------------------------------------------------------------------
Enqueue = Callable[[int], Awaitable[None]]


async def paced(enqueue: Enqueue, rate: float | None, seconds: float) -> int:
    """Call ``enqueue(n)`` paced at ``rate`` jobs/s: the jobs due so far in one call (at most 200), as
    the pollbridge completer completes them (None: batches of 100 as fast as possible)."""
    done = 0
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        if rate:
            due = int(elapsed * rate) - done
            if due <= 0:
                await asyncio.sleep(max(0.0, (done + 1) / rate - elapsed))
                continue
            n = min(due, 200)
            await enqueue(n)
            done += n
        else:
            await enqueue(100)
            done += 100
    return done


def read_records(path: Path) -> list[tuple[float, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((float(parts[0]), float(parts[1])))
    return out


async def procrastinate_setup(url: str, install: bool) -> tuple[Enqueue, Callable[[], Awaitable[None]]]:
    app = procrastinate_app(url)

    @app.task(name="noop")  # type: ignore[untyped-decorator]
    async def noop(enq: float) -> None:  # the worker's twin: only its name and arguments matter here
        return None

    await app.open_async()
    if install:
        await app.schema_manager.apply_schema_async()

    async def enqueue(n: int) -> None:
        now = time.time()
        if n == 1:
            await noop.defer_async(enq=now)
        else:
            await noop.batch_defer_async(*[{"enq": now}] * n)

    async def close() -> None:
        await app.close_async()

    return enqueue, close


async def pgqueuer_setup(url: str, install: bool) -> tuple[Enqueue, Callable[[], Awaitable[None]]]:
    import psycopg
    from pgqueuer import Queries

    conn = await psycopg.AsyncConnection.connect(pc.libpq(url), autocommit=True)
    queries = Queries.from_psycopg_connection(conn)
    if install:
        await queries.install()

    async def enqueue(n: int) -> None:
        payload = repr(time.time()).encode()
        if n == 1:
            await queries.enqueue("noop", payload)
        else:
            await queries.enqueue(["noop"] * n, [payload] * n, [0] * n)

    async def close() -> None:
        await conn.close()

    return enqueue, close


def run_peer(name: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        __import__(name)
    except ImportError as exc:
        return {"peer": name, "skipped": f"not installed ({exc}); pip install -e '.[bench]'"}
    setup = procrastinate_setup if name == "procrastinate" else pgqueuer_setup
    workdir = Path(tempfile.mkdtemp(prefix=f"pbpeers-{name}-"))
    result: dict[str, Any] = {"peer": name, "version": _version(name)}
    with scratch_database(f"pollbridge_bench_peers_{name}") as url:
        children = pc.Children(workdir, dict(os.environ))
        out = workdir / "picked.txt"

        async def phase(rate: float | None, seconds: float) -> tuple[int, float]:
            """Start the worker (the first time), then enqueue; (jobs enqueued, wall clock at the start)."""
            enqueue, close = await setup(url, not children.items)
            try:
                if not children.items:
                    children.spawn(f"{name}-worker", [sys.executable, "-m", "bench.peers", "--role", name, "--url",
                                                      url, "--out", str(out), "--concurrency", str(args.concurrency)],
                                   count="none")
                    await _warm_up(enqueue, out, children)
                start = time.time()
                return await paced(enqueue, rate, seconds), start
            finally:
                await close()

        try:
            load = pc.MachineLoad([f"pollbridge_bench_peers_{name}"])
            load.start()
            sent, start = asyncio.run(phase(args.rate, args.seconds))
            records = picked_since(out, start, sent, children, 30)
            lat = [(p - e) * 1000 for e, p in records]
            result["latency"] = {"rate": args.rate, "enqueued": sent, "picked": len(records),
                                 "jobs_per_s": round(sent / args.seconds, 1), **latency_summary(lat), **load.stop()}
            if args.throughput_seconds:
                load = pc.MachineLoad([f"pollbridge_bench_peers_{name}"])
                load.start()
                sent, start = asyncio.run(phase(None, args.throughput_seconds))
                mine = picked_since(out, start, sent, children, 60)
                # Every pickup since the start counts (a backlog left by the latency phase is work too).
                picks = [p for _, p in read_records(out) if p >= start]
                span = max(picks) - start if picks else 0.0
                result["throughput"] = {"enqueued": sent, "picked_since_start": len(picks),
                                        "enqueued_per_s": round(sent / args.throughput_seconds, 1),
                                        "picked_per_s": round(len(picks) / span, 1) if span else None,
                                        "drained": len(mine) >= sent, **load.stop()}
        except Exception as exc:  # a peer that fails to set up or run is reported, not fatal
            cause = exc.__cause__ or exc.__context__
            result["skipped"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}" + (
                f" (caused by {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
                if cause else "")
            traceback.print_exc()
        finally:
            children.stop_all()
            result["worker_peak_rss_mb"] = next((c.peak_rss_mb for c in children.items), None)
            result["logs"] = str(workdir)
    return result


def picked_since(out: Path, start: float, expected: int, children: pc.Children,
                 timeout: float) -> list[tuple[float, float]]:
    """The jobs enqueued since ``start`` that the worker picked up, once all ``expected`` were (or at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        records = [r for r in read_records(out) if r[0] >= start]
        if len(records) >= expected or time.monotonic() > deadline:
            return records
        children.check_alive()
        time.sleep(0.2)


async def _warm_up(enqueue: Enqueue, out: Path, children: pc.Children) -> None:
    """Until the worker picks up a job (it is up and listening); those jobs are not measured."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children.check_alive()
        await enqueue(1)
        await asyncio.sleep(0.3)
        if read_records(out):
            await asyncio.sleep(0.5)
            return
    raise RuntimeError("the worker picked up no job within 60 s")


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run_pollbridge(args: argparse.Namespace) -> dict[str, Any]:
    from bench.minimal import start_pollbridge, window

    namespace = f"pbpeers{uuid.uuid4().hex[:6]}"
    result: dict[str, Any] = {"peer": "pollbridge (event path)", "version": _version("pollbridge")}
    try:
        with scratch_database("pollbridge_bench_peers_pollbridge") as url:
            p, children = start_pollbridge(url, Path(tempfile.mkdtemp(prefix="pbpeers-pb-")), namespace,
                                           args.schedulers)
            try:
                r = window(p, children, args.rate, args.seconds)
                result["latency"] = {"rate": args.rate, "enqueued": r["completions"], "picked": r["latency"]["n"],
                                     "jobs_per_s": r["completions_per_s"], **r["latency"],
                                     **{k: r[k] for k in ("load_before", "load_after", "machine_busy_pct",
                                                          "other_cpu_pct")}}
                if args.throughput_seconds:
                    t = window(p, children, None, args.throughput_seconds)
                    result["throughput"] = {"completions_per_s": t["completions_per_s"],
                                            "transitions_per_s": t["transitions_per_s"],
                                            "picked_per_s": round(t["transitions_per_s"] - t["completions_per_s"], 1),
                                            **{k: t[k] for k in ("load_before", "load_after", "machine_busy_pct",
                                                                 "other_cpu_pct")}}
            finally:
                children.stop_all()
    finally:
        delete_namespace(namespace)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=500, help="jobs (completions for pollbridge) per second")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--throughput-seconds", type=float, default=10, help="0: skip the flat-out phase")
    parser.add_argument("--concurrency", type=int, default=10, help="peer worker concurrency / batch size")
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--quick", action="store_true", help="short, for CI (< 1 minute)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--role", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        (procrastinate_worker if args.role == "procrastinate" else pgqueuer_worker)(args.url, args.out,
                                                                                    args.concurrency)
        return 0
    if args.quick:
        # The flat-out phase leaves a backlog each worker must drain (procrastinate picks about 500 jobs/s
        # here): half a second of it keeps the whole run under a minute.
        args.rate, args.seconds, args.throughput_seconds = 100, 3, 0.5
    pc.exit_on_signals()
    results: dict[str, Any] = {"command": " ".join(["python -m bench.peers", *(argv or sys.argv[1:])]),
                               "machine": pc.machine_info(), "results": []}
    for name in [p.strip() for p in args.peers.split(",") if p.strip()]:
        if name not in PEERS:
            parser.error(f"unknown peer {name!r}; expected {', '.join(PEERS)}")
        print(f"[{name}] ...", flush=True)
        results["results"].append(run_peer(name, args))
    print("[pollbridge] ...", flush=True)
    results["results"].append(run_pollbridge(args))
    head = ["system", "version", "rate/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "picked",
            "flat out picked/s", "load avg", "other CPU %", "note"]
    rows = []
    for r in results["results"]:
        if "skipped" in r and "latency" not in r:
            rows.append([r["peer"], r.get("version"), None, None, None, None, None, None, None, None, None,
                         "skipped: " + r["skipped"]])
            continue
        lat, tp = r.get("latency", {}), r.get("throughput", {})
        rows.append([r["peer"], r.get("version"), lat.get("jobs_per_s"), lat.get("p50_ms"), lat.get("p90_ms"),
                     lat.get("p99_ms"), lat.get("max_ms"), f"{lat.get('picked')}/{lat.get('enqueued')}",
                     tp.get("picked_per_s"), (lat.get("load_after") or [None])[0], lat.get("other_cpu_pct"),
                     r.get("skipped", "")])
    print()
    print(pc.table(head, rows))
    write_json(args.json_path, results)
    print(json.dumps({r["peer"]: r.get("skipped") for r in results["results"] if r.get("skipped")}) if any(
        r.get("skipped") for r in results["results"]) else "all peers ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
