"""Apache Airflow's own readiness latency: when an upstream task ended → when the scheduler scheduled its downstream.

    python -m bench.airflow_latency [--runs 3] [--quick] [--admin-url URL] [--json F]
    python -m bench.airflow_latency --database-url postgresql://…/airflow [--json F]
    python -m bench.airflow_latency --with-pollbridge [--runs 5] [--burst 3] [--bus-url URL] [--quick] [--deadline S]
                                    [--json F]

The first form starts a real Airflow 3.3 (PostgreSQL, LocalExecutor; tests/support/airflow.py: its own database and
legacy role, the virtualenv of ``$POLLBRIDGE_AIRFLOW_VENV`` or ``~/.cache/pollbridge/airflow-3.3``), runs every DAG of
tests/acceptance/airflow_dags/pollbridge_shapes.py ``--runs`` times (a wave of one run of each DAG at a time, waiting
for the wave to finish), then reads Airflow's tables and stops it. The second reads an existing Airflow 3.3 database
after its runs (pollbridge's views are installed for the query and dropped again if they were not there before).

The latency of a task is its first try's ``task_instance.scheduled_dttm`` minus the latest ``end_date`` of its upstream
task instances in the same run (``tests.support.airflow.READINESS_SQL``; the edges come from pollbridge's view
``pollbridge_airflow_edges``). Tasks without an upstream are left out. This is the figure pollbridge's event path is
compared with: Airflow's scheduler loop finds a ready task only when it next looks (``[scheduler]
scheduler_idle_sleep_time``, 1 s, when idle), plus its own processing.

The third form (issue 17) runs pollbridge beside that Airflow as tests/acceptance/test_beside_airflow.py does: the
installed ``pollbridge`` console script with the shipped ``integrations/airflow/pollbridge.toml`` (embedded bus) as the
admin role (``init``, ``relay run``, ``scheduler run``), one warm-up wave in ``polling``, then ``flags set DAG
dual_write`` for every DAG. It then runs ``--runs`` *paced* waves (every DAG with the same run id, waiting until all
have finished) and one *burst* (``--burst`` run ids in every DAG at once), and reports per regime, over the dispatched
tasks that have an upstream (readiness = the latest upstream ``end_date``, from Airflow's tables):

* Airflow's readiness latency (upstream end → the first try's ``scheduled_dttm``), p50/p99;
* pollbridge's decision latency (the same upstream end → ``decided_at`` of the shadow decision for attempt 1 of that
  task in ``pollbridge_decisions``, joined by ``dag_id/run_id`` and ``task_id/map_index``), p50/p99;
* how much earlier pollbridge decided (``scheduled_dttm`` - ``decided_at`` per task), p50/p99, and the share of the
  decided tasks where pollbridge decided first;
* the decision latency split in two: upstream end → the capture of the last upstream's completion (Airflow writing
  the state: ``created_at`` of its row in ``pollbridge_outbox``) and that capture → the decision (relay, bus and
  scheduler: pollbridge's own part), the latter split again at the relay's claim of the row (its ``published_at``):
  the relay's wake-up, then the publish, the bus, the scheduler's read, evaluation and decision;
* counts: tasks, matched decisions, Airflow's dispatches (every try it queued, from its tables), the legacy
  dispatches pollbridge recorded (``pollbridge_dispatch_log``, path ``poller``), all shadow decisions, and decisions
  for which Airflow dispatched no such try.

All timestamps are of one host (PostgreSQL's ``clock_timestamp()`` for ``decided_at``, Airflow's processes for its
own columns). Everything runs on 127.0.0.1 and is stopped (pollbridge's processes, then Airflow, its database and role)
on the way out, also on an error, Ctrl-C or SIGTERM; ``--deadline`` bounds the whole run. It exits 1 when a regime had
no measured task or not one shadow decision (the figures are still printed and written). ``--bus-url redis://…``
runs pollbridge on a Redis bus instead of the shipped embedded one, with a bus namespace of the run's own (deleted
afterwards). docs/airflow.md has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import IO, Any

import psycopg

from bench.common import PG_ADMIN_URL, latency_summary, machine, write_json
from bridge.reference.oracle import percentile
from tests.support.airflow import (
    FIRST_TRIES_CTE,
    READINESS_SQL,
    REPO,
    SHAPE_DAGS,
    AirflowError,
    AirflowRig,
    Dispatch,
    Latency,
    load_sql_blocks,
)

#: The configuration pollbridge ships for Airflow, used as it is.
CONFIG = REPO / "integrations" / "airflow" / "pollbridge.toml"
#: Run ids of the pollbridge mode: the warm-up wave (``polling``, not measured), the paced waves and the burst.
WARM_RUN = "manual__bench_warm"
PACED_PREFIX = "manual__bench_paced_"
BURST_PREFIX = "manual__bench_burst_"
REGIMES = ("paced", "burst")
#: Issue 17's targets: the shadow decision p50 at most this long after the upstream's end ...
TARGET_DECISION_P50_MS = 50.0
#: ... and, paced, at least this much ahead of Airflow (p50).
TARGET_AHEAD_P50_MS = 500.0
#: How long to wait, after the last wave, for pollbridge's last decisions and recorded dispatches.
SETTLE_SECONDS = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h

#: Per dispatched task with an upstream: Airflow's readiness latency (as READINESS_SQL) and the decision latency of
#: pollbridge's shadow decision for attempt 1 of the same task (NULL when there is none), both from the latest
#: upstream end_date, in seconds; how many attempt-1 decisions there are (more than one would be a duplicate); and
#: when the last upstream's completion was captured (the ``created_at`` of its change into success/skipped in
#: ``pollbridge_outbox``, the database clock inside Airflow's own transaction; NULL once the relay's retention
#: window purged the row): the earliest moment pollbridge could know, which splits the decision latency into
#: Airflow's part (end_date → its write of the state) and pollbridge's (that write → the decision).
BESIDE_SQL = FIRST_TRIES_CTE + """, ready AS (
  SELECT f.dag_id, f.run_id, f.task_id, f.map_index, f.scheduled_dttm, max(up.end_date) AS upstream_end,
         max(c.captured_at) AS captured_at, max(c.published_at) AS published_at
    FROM first_try f
    JOIN pollbridge_airflow_edges e ON e.dag_version_id = f.dag_version_id AND e.task_id = f.task_id
    JOIN task_instance up ON up.dag_id = f.dag_id AND up.run_id = f.run_id AND up.task_id = e.upstream_task_id
    CROSS JOIN LATERAL (
      SELECT min(o.created_at) AS captured_at, min(o.published_at) AS published_at FROM pollbridge_outbox o
       WHERE o.instance_id = up.dag_id || '/' || up.run_id AND o.task_key = up.task_id || '/' || up.map_index
         AND o.new_status IN ('success', 'skipped')
    ) c
   GROUP BY f.dag_id, f.run_id, f.task_id, f.map_index, f.scheduled_dttm
)
SELECT r.dag_id, r.run_id, r.task_id, r.map_index,
       EXTRACT(EPOCH FROM r.scheduled_dttm - r.upstream_end)::float8,
       EXTRACT(EPOCH FROM d.decided_at - r.upstream_end)::float8,
       d.decisions,
       EXTRACT(EPOCH FROM r.captured_at - r.upstream_end)::float8,
       EXTRACT(EPOCH FROM r.published_at - r.upstream_end)::float8
  FROM ready r
  CROSS JOIN LATERAL (
    SELECT min(pd.decided_at) AS decided_at, count(*) AS decisions FROM pollbridge_decisions pd
     WHERE pd.instance_id = r.dag_id || '/' || r.run_id AND pd.task_key = r.task_id || '/' || r.map_index
       AND pd.attempt = 1
  ) d
 ORDER BY 1, 2, 3, 4
"""

#: Every shadow decision and every legacy dispatch pollbridge recorded: (instance_id, task_key, attempt).
DECISIONS_SQL = "SELECT instance_id, task_key, attempt FROM pollbridge_decisions"
RECORDED_SQL = "SELECT instance_id, task_key, attempt FROM pollbridge_dispatch_log WHERE path = 'poller'"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.airflow_latency", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=None,
                        help="waves of one run of every shape DAG (default 3; with --with-pollbridge: paced waves, "
                             "default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="one wave (a smoke run); with --with-pollbridge one paced wave and a burst of 2")
    parser.add_argument("--admin-url", default=PG_ADMIN_URL,
                        help="PostgreSQL role that may create a database and a role (default $POLLBRIDGE_BENCH_PG_URL)")
    parser.add_argument("--database-url", help="read this existing Airflow 3.3 database instead of starting Airflow")
    parser.add_argument("--with-pollbridge", action="store_true",
                        help="run pollbridge beside Airflow in dual_write and compare its shadow decisions (issue 17)")
    parser.add_argument("--burst", type=int, default=3,
                        help="with --with-pollbridge: run ids triggered in every DAG at once (default 3)")
    parser.add_argument("--deadline", type=float, default=1500.0,
                        help="with --with-pollbridge: seconds the whole run may take before it gives up (default 1500)")
    parser.add_argument("--bus-url",
                        help="with --with-pollbridge: pollbridge's bus (redis://...; default: the shipped "
                             "configuration's, the embedded bus in Airflow's database)")
    parser.add_argument("--capture-mode", choices=["trigger", "wal"], default=None,
                        help="with --with-pollbridge: [capture] mode for pollbridge (default: the shipped "
                             "configuration's, trigger; wal needs wal_level = logical)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser


def read_latencies(database_url: str) -> list[Latency]:
    """Airflow's readiness latencies in an Airflow database; pollbridge's views are left as they were found."""
    blocks = load_sql_blocks()
    with psycopg.connect(database_url, autocommit=True) as conn:
        had_views = conn.execute("SELECT to_regclass('pollbridge_airflow_edges') IS NOT NULL").fetchone() == (True,)
        if not had_views:
            conn.execute(blocks["install"].encode())
        try:
            return [Latency(*row) for row in conn.execute(READINESS_SQL.encode()).fetchall()]
        finally:
            if not had_views:
                conn.execute(blocks["uninstall"].encode())


def run_airflow(admin_url: str, waves: int) -> tuple[list[Latency], dict[str, float]]:
    """Start Airflow, run ``waves`` waves of the shape DAGs, read the latencies, stop it."""
    with AirflowRig(admin_url) as rig:
        rig.wait_serialized(SHAPE_DAGS)
        began = time.monotonic()
        for wave in range(1, waves + 1):
            for dag_id in SHAPE_DAGS:
                rig.trigger(dag_id, f"manual__bench_{wave}")
            rig.wait_finished(deadline=300)
        rig.timings["runs"] = time.monotonic() - began
        failed = [run for run in rig.dag_runs() if run[2] != "success"]
        if failed:
            raise SystemExit(f"DAG runs did not succeed: {failed}")
        rig.install_views()
        return rig.readiness_latencies(), dict(rig.timings)


def airflow_only(args: argparse.Namespace) -> int:
    timings: dict[str, float] = {}
    if args.database_url:
        latencies = read_latencies(args.database_url)
    else:
        latencies, timings = run_airflow(args.admin_url, 1 if args.quick else (args.runs or 3))
    if not latencies:
        print("no dispatched task with an upstream task: nothing to measure", file=sys.stderr)
        return 1
    overall = latency_summary([latency.seconds * 1000 for latency in latencies])
    per_dag: dict[str, list[float]] = defaultdict(list)
    for latency in latencies:
        per_dag[latency.dag_id].append(latency.seconds * 1000)
    print(f"Airflow readiness latency (upstream end_date -> downstream scheduled_dttm), {overall['n']} tasks:")
    print(f"  p50 {overall['p50_ms']:.0f} ms   p90 {overall['p90_ms']:.0f} ms   p99 {overall['p99_ms']:.0f} ms   "
          f"max {overall['max_ms']:.0f} ms")
    for dag_id, values in sorted(per_dag.items()):
        summary = latency_summary(values)
        print(f"  {dag_id:<12} n={summary['n']:<3} p50 {summary['p50_ms']:.0f} ms  p99 {summary['p99_ms']:.0f} ms")
    if timings:
        print("Airflow timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    payload: dict[str, Any] = {"readiness_latency": overall, "per_dag": {d: latency_summary(v) for d, v in
                                                                        per_dag.items()},
                               "timings_s": timings, "machine": machine()}
    write_json(args.json, payload)
    return 0


# --- pollbridge beside Airflow (issue 17) -------------------------------------------------------------


class BenchError(RuntimeError):
    """The run could not be completed (a process exited, the deadline passed); the message says what."""


class Budget:
    """The time the whole run may still take."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self, cap: float) -> float:
        """At most ``cap`` seconds, and no more than what is left; :class:`BenchError` when nothing is."""
        remaining = self.end - time.monotonic()
        if remaining <= 1:
            raise BenchError(f"the deadline of {self.seconds:.0f} s (--deadline) passed")
        return min(cap, remaining)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Pollbridge:
    """The installed ``pollbridge`` console script with the shipped Airflow configuration, as the admin role on the
    rig's database (as tests/acceptance/test_beside_airflow.py runs it); its processes log into ``folder``."""

    def __init__(self, database_url: str, folder: Path, bus_url: str | None = None,
                 capture_mode: str | None = None) -> None:
        exe = shutil.which("pollbridge")
        if exe is None:
            raise BenchError("the `pollbridge` console script is not on PATH: `pip install -e .` first")
        self.exe = exe
        self.folder = folder
        # Nothing of the caller's pollbridge settings leaks in (the embedded bus, as the test runs it).
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
        self.env.update(POLLBRIDGE_CONFIG=str(CONFIG), POLLBRIDGE_DATABASE_URL=database_url)
        if capture_mode:
            self.env["POLLBRIDGE_CAPTURE_MODE"] = capture_mode
        self.bus_url = bus_url
        self.namespace: str | None = None
        if bus_url and bus_url != "embedded":
            # A Redis bus: the shipped configuration with a bus namespace of this run's own (a [bus] table added
            # to a copy beside its SQL file), so nothing else on that Redis is read or deleted.
            self.namespace = f"pb_bench_af_{secrets.token_hex(4)}"
            config = folder / CONFIG.name
            config.write_text(CONFIG.read_text(encoding="utf-8") + f'\n[bus]\nnamespace = "{self.namespace}"\n',
                              encoding="utf-8")
            shutil.copy(CONFIG.parent / "pollbridge.sql", folder / "pollbridge.sql")
            self.env.update(POLLBRIDGE_CONFIG=str(config), POLLBRIDGE_BUS_URL=bus_url)
        self.processes: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def ok(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run([self.exe, *args], cwd=self.folder, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if done.returncode != 0:
            raise BenchError(f"pollbridge {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done.stdout

    def start(self, *args: str) -> None:
        log = (self.folder / f"{'-'.join(args)}.log").open("wb")
        process = subprocess.Popen([self.exe, *args], cwd=self.folder, env=self.env, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=_die_with_parent)
        self.processes.append((process, log))

    def check_alive(self) -> None:
        for process, _ in self.processes:
            if process.poll() is not None:
                raise BenchError(f"{process.args!r} exited {process.returncode}:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM to every process group started here, SIGKILL after 20 s."""
        for process, _ in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process, log in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.close()
        self.processes.clear()
        if self.namespace and self.bus_url:
            import redis

            from bridge.bus import redis_streams

            client = redis.Redis.from_url(self.bus_url)
            try:
                redis_streams.delete_namespace(client, self.namespace)
            finally:
                client.close()
            self.namespace = None

    def warnings(self, limit: int = 5) -> list[dict[str, Any]]:
        """The distinct WARNING/ERROR lines of the processes' logs (timestamps cut off, run ids as DAG/RUN, at most
        300 characters each), most frequent first, with their counts: what to look at when decisions are missing."""
        seen: Counter[str] = Counter()
        for log in sorted(self.folder.glob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                for level in (" WARNING ", " ERROR ", " CRITICAL "):
                    if level in line:
                        text = re.sub(r"\bpb_\w+/manual__bench_\w+", "DAG/RUN", line.split(level, 1)[1])
                        seen[f"{log.stem}:{level}{text[:300]}"] += 1
        return [{"line": line, "count": count} for line, count in seen.most_common(limit)]

    def tail(self, lines: int = 20) -> str:
        return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                         for log in sorted(self.folder.glob("*.log")))


@dataclass(frozen=True)
class TaskTiming:
    """One dispatched task with an upstream, in one run: Airflow's and pollbridge's latency from the upstream end."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    airflow_ms: float
    decision_ms: float | None  # None: no shadow decision for attempt 1
    decisions: int
    captured_ms: float | None  # the last upstream's completion in pollbridge's outbox (None: not found)
    published_ms: float | None = None  # ... and when the relay published it to the bus (None: not found)

    @property
    def ahead_ms(self) -> float | None:
        """Airflow's scheduled_dttm - pollbridge's decided_at (positive: pollbridge decided first)."""
        return None if self.decision_ms is None else self.airflow_ms - self.decision_ms


def regime_of(run_id: str) -> str | None:
    """``paced``, ``burst``, or None (the warm-up wave, or a run of someone else's)."""
    if run_id.startswith(PACED_PREFIX):
        return "paced"
    if run_id.startswith(BURST_PREFIX):
        return "burst"
    return None


def _split(instance_id: str, task_key: str) -> tuple[str, str, str, int]:
    dag_id, _, run_id = instance_id.partition("/")
    task_id, _, map_index = task_key.rpartition("/")
    return dag_id, run_id, task_id, int(map_index)


def read_beside(rig: AirflowRig) -> tuple[list[TaskTiming], list[Dispatch], set[tuple[str, str, str, int, int]],
                                          list[tuple[str, str, str, int, int]]]:
    """The task timings, Airflow's dispatches, the legacy dispatches pollbridge recorded and its shadow decisions."""
    timings = [TaskTiming(d, r, t, int(m), a * 1000, None if s is None else s * 1000, int(n),
                          None if c is None else c * 1000, None if p is None else p * 1000)
               for d, r, t, m, a, s, n, c, p in rig.query(BESIDE_SQL)]
    dispatches = rig.dispatches()
    recorded = {(*_split(i, k), int(a)) for i, k, a in rig.query(RECORDED_SQL)}
    decisions = [(*_split(i, k), -1 if a is None else int(a)) for i, k, a in rig.query(DECISIONS_SQL)]
    return timings, dispatches, recorded, decisions


def _ms(values: Sequence[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value, 1)


def _spread(values: Sequence[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "p50_ms": _ms(values, 50), "p99_ms": _ms(values, 99),
            "min_ms": _ms(values, 0), "max_ms": _ms(values, 100)}


def summarize(timings: Iterable[TaskTiming], dispatches: Iterable[Dispatch],
              recorded: Iterable[tuple[str, str, str, int, int]],
              decisions: Iterable[tuple[str, str, str, int, int]]) -> dict[str, dict[str, Any]]:
    """The figures of each regime (see the module's docstring)."""
    tries = {(d.dag_id, d.run_id, d.task_id, d.map_index, d.try_number) for d in dispatches}
    out: dict[str, dict[str, Any]] = {}
    by_regime: dict[str, list[TaskTiming]] = defaultdict(list)
    for timing in timings:
        regime = regime_of(timing.run_id)
        if regime:
            by_regime[regime].append(timing)
    tries_per = Counter(regime_of(t[1]) for t in tries)
    recorded_per = Counter(regime_of(t[1]) for t in recorded)
    decisions_list = list(decisions)
    decisions_per = Counter(regime_of(t[1]) for t in decisions_list)
    stray_per = Counter(regime_of(t[1]) for t in decisions_list if t not in tries)
    for regime in REGIMES:
        rows = by_regime.get(regime, [])
        matched = [row for row in rows if row.decision_ms is not None]
        ahead = [row.ahead_ms for row in matched if row.ahead_ms is not None]
        per_dag: dict[str, dict[str, Any]] = {}
        for dag_id in sorted({row.dag_id for row in rows}):
            mine = [row for row in matched if row.dag_id == dag_id]
            per_dag[dag_id] = {
                "tasks": sum(1 for row in rows if row.dag_id == dag_id), "matched": len(mine),
                "airflow_p50_ms": _ms([row.airflow_ms for row in rows if row.dag_id == dag_id], 50),
                "decision_p50_ms": _ms([row.decision_ms for row in mine if row.decision_ms is not None], 50),
            }
        out[regime] = {
            "runs": len({(row.dag_id, row.run_id) for row in rows}),
            "tasks": len(rows),
            "matched_decisions": len(matched),
            "duplicate_decisions": sum(max(0, row.decisions - 1) for row in rows),
            "airflow_dispatches": tries_per.get(regime, 0),
            "recorded_dispatches": recorded_per.get(regime, 0),
            "shadow_decisions": decisions_per.get(regime, 0),
            "decisions_without_airflow_dispatch": stray_per.get(regime, 0),
            "airflow_readiness": _spread([row.airflow_ms for row in rows]),
            "pollbridge_decision": _spread([row.decision_ms for row in matched if row.decision_ms is not None]),
            "pollbridge_ahead": _spread(ahead),
            "airflow_state_written": _spread([row.captured_ms for row in rows if row.captured_ms is not None]),
            "pollbridge_own": _spread([row.decision_ms - row.captured_ms for row in matched
                                       if row.decision_ms is not None and row.captured_ms is not None]),
            # The own part split where the relay claims the row (its published_at, set by the claim just
            # before the publish; in wal mode the batch's write): the relay's wake-up (capture -> claimed),
            # then the publish, the bus, the scheduler's read, evaluation and decision (claimed -> decided).
            "pollbridge_relay": _spread([row.published_ms - row.captured_ms for row in matched
                                         if row.published_ms is not None and row.captured_ms is not None]),
            "pollbridge_bus_and_scheduler": _spread([row.decision_ms - row.published_ms for row in matched
                                                     if row.decision_ms is not None and row.published_ms is not None]),
            "pollbridge_first_share": round(sum(1 for a in ahead if a > 0) / len(ahead), 4) if ahead else None,
            "decided_before_upstream_end": sum(1 for row in matched if (row.decision_ms or 0) < 0),
            "per_dag": per_dag,
        }
    return out


def targets(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 17's targets against the figures: decision p50 ≤ 50 ms, ≥ 500 ms ahead of Airflow paced (p50)."""
    paced = figures.get("paced", {})
    decision = paced.get("pollbridge_decision", {}).get("p50_ms")
    ahead = paced.get("pollbridge_ahead", {}).get("p50_ms")
    return {
        "decision_p50_ms": {"target": TARGET_DECISION_P50_MS, "paced": decision,
                            "burst": figures.get("burst", {}).get("pollbridge_decision", {}).get("p50_ms"),
                            "met": decision is not None and decision <= TARGET_DECISION_P50_MS},
        "ahead_p50_ms_paced": {"target": TARGET_AHEAD_P50_MS, "measured": ahead,
                               "met": ahead is not None and ahead >= TARGET_AHEAD_P50_MS},
    }


def _wave(rig: AirflowRig, pb: Pollbridge, budget: Budget, run_ids: Sequence[str], cap: float) -> float:
    """Trigger every run id in every DAG at once, wait until all runs finished; the seconds it took."""
    began = time.monotonic()
    for run_id in run_ids:
        for dag_id in SHAPE_DAGS:
            rig.trigger(dag_id, run_id)
    rig.wait_finished(deadline=budget.left(cap))
    pb.check_alive()
    return time.monotonic() - began


def _settle(rig: AirflowRig, pb: Pollbridge, budget: Budget) -> float:
    """Wait (at most :data:`SETTLE_SECONDS`) until pollbridge decided every measured task and recorded every dispatch
    of the measured runs; what is still missing then is reported as missing, not waited for."""
    began = time.monotonic()
    end = began + budget.left(SETTLE_SECONDS)
    while time.monotonic() < end:
        pb.check_alive()
        timings, dispatches, recorded, _ = read_beside(rig)
        measured = [t for t in timings if regime_of(t.run_id)]
        tries = {(d.dag_id, d.run_id, d.task_id, d.map_index, d.try_number) for d in dispatches
                 if regime_of(d.run_id)}
        if all(t.decision_ms is not None for t in measured) and tries <= recorded:
            break
        time.sleep(0.5)
    return time.monotonic() - began


def run_beside(admin_url: str, waves: int, burst: int, deadline: float, bus_url: str | None = None,
               capture_mode: str | None = None) -> dict[str, Any]:
    """Start Airflow and pollbridge beside it in dual_write, run the paced waves and the burst, read the figures;
    stop everything it started (pollbridge's processes first, then the rig: its processes, database and role)."""
    budget = Budget(deadline)
    wall: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="pb-bench-airflow-") as folder, AirflowRig(admin_url) as rig:
        pb = Pollbridge(rig.superuser_url, Path(folder), bus_url, capture_mode)
        try:
            rig.wait_serialized(SHAPE_DAGS, deadline=budget.left(90))
            mark = time.monotonic()
            pb.ok("init")
            pb.start("relay", "run")
            pb.start("scheduler", "run")
            wall["pollbridge_init"] = time.monotonic() - mark
            # History first, as on any running Airflow: one wave while pollbridge is in `polling` (not measured).
            wall["warm_up"] = _wave(rig, pb, budget, [WARM_RUN], 240)
            for dag_id in SHAPE_DAGS:
                pb.ok("flags", "set", dag_id, "dual_write", "--reason", "bench.airflow_latency: shadow Airflow")
            time.sleep(1.5)  # the router's refresh interval (1 s): every process follows the flags
            wall["paced"] = sum(_wave(rig, pb, budget, [f"{PACED_PREFIX}{wave}"], 240)
                                for wave in range(1, waves + 1))
            if burst > 0:
                wall["burst"] = _wave(rig, pb, budget, [f"{BURST_PREFIX}{i}" for i in range(1, burst + 1)], 480)
            wall["settle"] = _settle(rig, pb, budget)
            failed = [run for run in rig.dag_runs() if run[2] != "success"]
            if failed:
                raise BenchError(f"DAG runs did not succeed: {failed}")
            timings, dispatches, recorded, decisions = read_beside(rig)
            pb.check_alive()
            warnings = pb.warnings()
        except BaseException:
            print(pb.tail(), file=sys.stderr)
            raise
        finally:
            pb.stop()
        figures = summarize(timings, dispatches, recorded, decisions)
        return {"regimes": figures, "targets": targets(figures), "pollbridge_warnings": warnings,
                "timings_s": {**{k: round(v, 1) for k, v in rig.timings.items()},
                              **{k: round(v, 1) for k, v in wall.items()}}}


def _fmt(value: object, unit: str = "") -> str:
    if isinstance(value, float):
        return f"{value:.1f}{unit}" if abs(value) < 100 else f"{value:.0f}{unit}"
    return "-" if value is None else f"{value}{unit}"


def print_beside(result: dict[str, Any]) -> None:
    print(f"pollbridge beside Apache Airflow (dual_write: shadow decisions; bus: {result['bus']}; capture: "
          f"{result.get('capture_mode', 'trigger')}), dispatched tasks "
          "with an upstream; latency from the latest upstream end_date, ms:")
    header = (f"  {'regime':<6} {'runs':>4} {'tasks':>5} {'decided':>7} {'dispatches':>10}  "
              f"{'Airflow p50/p99':>15}  {'pollbridge p50/p99':>18}  {'ahead p50/p99':>13}  {'first':>6}")
    print(header)
    for regime, f in result["regimes"].items():
        air, dec, ahead = f["airflow_readiness"], f["pollbridge_decision"], f["pollbridge_ahead"]
        first = "-" if f["pollbridge_first_share"] is None else f"{100 * f['pollbridge_first_share']:.0f}%"
        print(f"  {regime:<6} {f['runs']:>4} {f['tasks']:>5} {f['matched_decisions']:>7} "
              f"{f['airflow_dispatches']:>10}  "
              f"{_fmt(air['p50_ms']) + ' / ' + _fmt(air['p99_ms']):>15}  "
              f"{_fmt(dec['p50_ms']) + ' / ' + _fmt(dec['p99_ms']):>18}  "
              f"{_fmt(ahead['p50_ms']) + ' / ' + _fmt(ahead['p99_ms']):>13}  {first:>6}")
    for regime, f in result["regimes"].items():
        wrote, own = f["airflow_state_written"], f["pollbridge_own"]
        print(f"  {regime}: upstream end -> Airflow wrote its state (captured) p50/p99 {_fmt(wrote['p50_ms'])} / "
              f"{_fmt(wrote['p99_ms'])} ms; captured -> shadow decision p50/p99 {_fmt(own['p50_ms'])} / "
              f"{_fmt(own['p99_ms'])} ms")
        relay, rest = f.get("pollbridge_relay"), f.get("pollbridge_bus_and_scheduler")
        if relay and rest:
            print(f"  {regime}: of which captured -> claimed by the relay p50/p99 {_fmt(relay['p50_ms'])} / "
                  f"{_fmt(relay['p99_ms'])} ms; claimed -> decided (publish, bus, evaluation, decision) p50/p99 "
                  f"{_fmt(rest['p50_ms'])} / {_fmt(rest['p99_ms'])} ms")
    for regime, f in result["regimes"].items():
        print(f"  {regime}: pollbridge recorded {f['recorded_dispatches']} of Airflow's {f['airflow_dispatches']} "
              f"dispatches; {f['shadow_decisions']} shadow decisions, {f['decisions_without_airflow_dispatch']} "
              f"without such an Airflow try, {f['duplicate_decisions']} duplicate, "
              f"{f['decided_before_upstream_end']} before the upstream's end")
    for warning in result["pollbridge_warnings"]:
        print(f"  pollbridge logged {warning['count']}x: {warning['line']}")
    t = result["targets"]
    dec, ahead = t["decision_p50_ms"], t["ahead_p50_ms_paced"]
    print(f"  target: decision p50 <= {dec['target']:.0f} ms: paced {_fmt(dec['paced'])}, burst "
          f"{_fmt(dec['burst'])} ms ({'met' if dec['met'] else 'NOT met'}, paced); ahead of Airflow p50 >= "
          f"{ahead['target']:.0f} ms paced: {_fmt(ahead['measured'])} ms ({'met' if ahead['met'] else 'NOT met'})")
    print("  timings (s): " + ", ".join(f"{k} {v}" for k, v in result["timings_s"].items()))
    print(f"  load average: before {result['load_average']['before']}, after {result['load_average']['after']}")


def with_pollbridge(args: argparse.Namespace) -> int:
    if args.database_url:
        print("--with-pollbridge starts its own Airflow: --database-url does not apply", file=sys.stderr)
        return 2
    waves = 1 if args.quick else (args.runs if args.runs is not None else 5)
    burst = 2 if args.quick else args.burst
    if waves < 1 or burst < 0:
        print("--runs must be at least 1 and --burst at least 0", file=sys.stderr)
        return 2
    started = datetime.now(UTC)
    before = [round(x, 2) for x in os.getloadavg()]
    try:
        result = run_beside(args.admin_url, waves, burst, args.deadline, args.bus_url, args.capture_mode)
    except (BenchError, AirflowError) as exc:
        print(f"bench.airflow_latency --with-pollbridge: {exc}", file=sys.stderr)
        return 1
    result["load_average"] = {"before": before, "after": [round(x, 2) for x in os.getloadavg()]}
    result.update(started=started.isoformat(timespec="seconds"), paced_waves=waves, burst_run_ids=burst,
                  bus=args.bus_url or "embedded (the shipped configuration's default)",
                  capture_mode=args.capture_mode or "trigger (the shipped configuration's default)",
                  dags=list(SHAPE_DAGS), machine=machine())
    print_beside(result)
    write_json(args.json, result)
    regimes = result["regimes"].values()
    if not any(f["tasks"] for f in regimes) or any(f["tasks"] and not f["matched_decisions"] for f in regimes):
        # A smoke run fails when there was nothing to measure or pollbridge decided nothing in a regime.
        print("bench.airflow_latency --with-pollbridge: a regime without a measured task or without any shadow "
              "decision (see pollbridge's warnings above)", file=sys.stderr)
        return 1
    return 0


def _terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM as an exit: the ``finally`` blocks stop pollbridge and Airflow."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    if args.with_pollbridge:
        return with_pollbridge(args)
    return airflow_only(args)


if __name__ == "__main__":
    sys.exit(main())
