"""Helpers of ``bench.paths``, ``bench.scale``, ``bench.peers`` and ``bench.minimal``.

* :class:`Children`: child processes in process groups of their own, stopped (SIGTERM, then SIGKILL) on
  exit, on Ctrl-C, on SIGTERM/SIGHUP of the bench, and through ``PR_SET_PDEATHSIG`` when the bench is
  SIGKILLed; with per-process CPU seconds and peak RSS from ``/proc``.
* Statement counting: a ``sitecustomize`` put on the children's ``PYTHONPATH`` counts every statement a
  process executes (``psycopg.Cursor.execute``/``executemany``, so the pool's pre-ping ``SELECT 1`` and
  ``LISTEN`` count too; SQLAlchemy's ``before_cursor_execute`` on SQLite) and writes the count to a file
  every 0.5 s and at exit. The server-side cross-check is ``pg_stat_database`` (transactions).
* The bench worker fleet (``python -m bench._paths_common fleet``): the existing platform's workers, as
  a set-based loop that cannot become the bottleneck (see :func:`fleet_main`).
* Latency percentiles and CDF points computed in SQL from ``pollbridge_dispatch_log``; the PNG plot;
  a plain-text table; what else ran on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import heapq
import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg

from bench.common import PG_ADMIN_URL, command, machine

PR_SET_PDEATHSIG = 1
STMT_ENV = "POLLBRIDGE_BENCH_STMT_FILE"
CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parents[1]


# --- processes ---------------------------------------------------------------------------------------
def _child_setup() -> None:
    """In the child before exec: a process group of its own (so stopping it stops whatever it starts)
    and SIGTERM when the bench dies, however it dies (Linux)."""
    os.setpgrp()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def status_kb(pid: int, key: str) -> int | None:
    """A ``/proc/PID/status`` field in kB (``VmHWM``: peak resident set; ``VmRSS``: now)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    stmt_file: Path | None
    log: Path
    cpu_end: float | None = None
    peak_rss_mb: float | None = None


@dataclass
class Children:
    """The processes one measurement runs; every one is stopped by :meth:`stop_all` (also registered
    with ``atexit``)."""

    workdir: Path
    env: dict[str, str]
    items: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        atexit.register(self.stop_all)

    def spawn(self, name: str, argv: Sequence[str], *, count: str = "site", extra_env: dict[str, str] | None = None
              ) -> Child:
        """``count``: ``site`` (the counting ``sitecustomize``), ``self`` (the child counts its own statements
        into ``$POLLBRIDGE_BENCH_STMT_FILE``) or ``none``."""
        stmt_file = self.workdir / f"statements-{name}.txt" if count != "none" else None
        env = {**self.env, **(extra_env or {})}
        paths = [str(REPO), env.get("PYTHONPATH", "")]  # the bench package, for ``python -m bench...`` children
        if stmt_file is not None:
            env[STMT_ENV] = str(stmt_file)
        if count == "site":
            paths.insert(0, str(counter_dir()))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(list(argv), cwd=self.workdir, env=env, stdout=out, stderr=out,
                                    stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
        child = Child(name, proc, stmt_file, log)
        self.items.append(child)
        return child

    def get(self, name: str) -> Child:
        return next(c for c in self.items if c.name == name)

    def cpu(self) -> dict[str, float]:
        return {c.name: cpu_seconds(c.proc.pid) or 0.0 for c in self.items if c.proc.poll() is None}

    def statements(self) -> dict[str, int]:
        return {c.name: read_count(c.stmt_file) for c in self.items if c.stmt_file is not None}

    def statement_texts(self) -> dict[str, dict[str, Any]]:
        return {c.name: read_counts(c.stmt_file) for c in self.items if c.stmt_file is not None}

    def check_alive(self) -> None:
        dead = [c for c in self.items if c.proc.poll() is not None]
        if dead:
            tail = dead[0].log.read_text(errors="replace")[-2000:] if dead[0].log.exists() else ""
            raise RuntimeError(f"{dead[0].name} exited with {dead[0].proc.returncode}; its log ends:\n{tail}")

    def stop_all(self, timeout: float = 15.0) -> None:
        """Record CPU and peak RSS of each live child, then SIGTERM its process group (SIGKILL after
        ``timeout``) and wait for it."""
        live = [c for c in self.items if c.proc.poll() is None]
        for c in live:
            c.cpu_end = cpu_seconds(c.proc.pid)
            hwm = status_kb(c.proc.pid, "VmHWM")
            c.peak_rss_mb = None if hwm is None else round(hwm / 1024, 1)
            with contextlib.suppress(OSError):
                os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        for c in self.items:  # anything left in a group (a grandchild) goes too
            with contextlib.suppress(OSError):
                os.killpg(c.proc.pid, signal.SIGKILL)


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: children stopped, databases dropped


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C (KeyboardInterrupt) does."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)


# --- statement counting in child processes ------------------------------------------------------------
SITECUSTOMIZE = textwrap.dedent('''
    """bench._paths_common: count the statements this process executes (a benchmark child)."""
    import atexit as _atexit
    import json as _json
    import os as _os
    import threading as _threading
    import time as _time

    _path = _os.environ.get("POLLBRIDGE_BENCH_STMT_FILE")
    if _path:
        _count = [0]
        _texts = {}
        _lock = _threading.Lock()

        _short = {}

        def _bump(n=1, query=None):
            # Shortened once per statement text: the scheduler's 8 KB evaluation split and joined on every call
            # was 5 % of its samples at 20 completions/s (py-spy), time added to each dispatch measured.
            try:
                text = _short.get(query) if query is not None else "?"
            except TypeError:  # unhashable
                text = None
            if text is None:
                text = " ".join(str(query).split())[:90]
                if len(_short) < 500:  # a process runs a few dozen texts; varying ones are not kept
                    try:
                        _short[query] = text
                    except TypeError:
                        pass
            with _lock:
                _count[0] += n
                _texts[text] = _texts.get(text, 0) + n

        def _dump():
            tmp = _path + ".tmp"
            with _lock:
                payload = _json.dumps({"n": _count[0], "texts": _texts})
            with open(tmp, "w") as f:
                f.write(payload)
            _os.replace(tmp, _path)

        try:
            import psycopg as _psycopg

            _exec = _psycopg.Cursor.execute
            _many = _psycopg.Cursor.executemany

            def _execute(self, query, *args, **kwargs):
                _bump(1, query if isinstance(query, str) else getattr(query, "as_string", lambda *_: query)(self))
                return _exec(self, query, *args, **kwargs)

            def _executemany(self, query, params_seq, *args, **kwargs):
                params_seq = list(params_seq)
                _bump(len(params_seq), query)
                return _many(self, query, params_seq, *args, **kwargs)

            _psycopg.Cursor.execute = _execute
            _psycopg.Cursor.executemany = _executemany
        except ImportError:
            pass
        try:
            from sqlalchemy import event as _event
            from sqlalchemy.engine import Engine as _Engine

            def _on_execute(conn, cursor, statement, parameters, context, executemany):
                if conn.dialect.name == "sqlite":
                    _bump(len(parameters) if executemany else 1, statement)

            _event.listen(_Engine, "before_cursor_execute", _on_execute)
        except ImportError:
            pass

        def _loop():
            while True:
                _time.sleep(0.5)
                _dump()

        _threading.Thread(target=_loop, daemon=True).start()
        _atexit.register(_dump)
''')

_COUNTER_DIR: Path | None = None


def counter_dir() -> Path:
    """A directory holding the counting ``sitecustomize.py`` (made once per bench process)."""
    global _COUNTER_DIR
    if _COUNTER_DIR is None:
        _COUNTER_DIR = Path(tempfile.mkdtemp(prefix="pbbench-site-"))
        (_COUNTER_DIR / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return _COUNTER_DIR


def read_count(path: Path | None) -> int:
    return int(read_counts(path).get("n", 0))


def read_counts(path: Path | None) -> dict[str, Any]:
    """``{"n": statements, "texts": {statement text (90 chars): count}}`` as a child last wrote it."""
    if path is None:
        return {}
    try:
        raw = path.read_text().strip()
    except OSError:
        return {}
    if raw.isdigit():  # a child that counts itself writes the number alone
        return {"n": int(raw), "texts": {}}
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def text_deltas(before: dict[str, Any], after: dict[str, Any], seconds: float, top: int = 8) -> dict[str, float]:
    """Per-second rate of each statement text between two :func:`read_counts` snapshots, largest first."""
    old = before.get("texts", {})
    rates = {t: (n - old.get(t, 0)) / seconds for t, n in after.get("texts", {}).items() if n - old.get(t, 0) > 0}
    return {t: round(r, 2) for t, r in sorted(rates.items(), key=lambda kv: -kv[1])[:top]}


class CountingConnection:
    """The bench process's own PostgreSQL access: one autocommit connection that counts its statements
    and transactions, so they can be taken out of the database's transaction count."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(libpq(url), autocommit=True)
        self.statements = 0
        self.transactions = 0

    def execute(self, query: str, params: Any = None) -> psycopg.Cursor[Any]:
        self.statements += 1
        if self.conn.autocommit and not self.conn.info.transaction_status:
            self.transactions += 1
        return self.conn.execute(query, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Statements inside count one transaction together."""
        with self.conn.transaction():
            self.transactions += 1
            yield

    def scalar(self, query: str, params: Any = None) -> Any:
        row = self.execute(query, params).fetchone()
        return None if row is None else row[0]

    def close(self) -> None:
        self.conn.close()


def libpq(url: str) -> str:
    """A SQLAlchemy-style PostgreSQL URL as libpq takes it."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def db_xacts(dbname: str) -> int:
    """Committed + rolled back transactions of ``dbname`` (read from the admin database: not counted)."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                           (dbname,)).fetchone()
    return int(row[0]) if row else 0


def backend_pids(dbname: str) -> list[int]:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
                            (dbname,)).fetchall()
    return [int(r[0]) for r in rows]


class BackendCpu:
    """CPU seconds of a database's client backends between :meth:`start` and :meth:`stop` (backends seen
    at either moment; one that came and went in between is missed)."""

    def __init__(self, dbname: str | None) -> None:
        self.dbname = dbname
        self.first: dict[int, float] = {}

    def start(self) -> None:
        if self.dbname:
            self.first = {p: cpu_seconds(p) or 0.0 for p in backend_pids(self.dbname)}

    def stop(self) -> float | None:
        if not self.dbname:
            return None
        total = 0.0
        for pid in set(self.first) | set(backend_pids(self.dbname)):
            now = cpu_seconds(pid)
            if now is not None:
                total += now - self.first.get(pid, 0.0)
        return round(total, 2)


def cpu_totals() -> tuple[int, int]:
    """The whole machine's CPU ticks so far (``/proc/stat``): ``(busy, total)``, busy being all but idle and
    iowait; divide by :data:`CLK_TCK` for seconds."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts[:8]) - idle, sum(parts[:8])


class MachineLoad:
    """How busy the machine was between :meth:`start` and :meth:`stop`: all CPUs (from ``/proc/stat``), and
    the part of it used by processes that are not this bench, its children or its databases' backends
    (others' tests and benchmarks on a shared machine), both in % of one core (out of 100 x cores)."""

    def __init__(self, dbnames: Sequence[str] = ()) -> None:
        self.dbnames = list(dbnames)
        self.t0 = 0.0
        self.busy0 = self.total0 = 0
        self.ours0 = 0.0

    def _ours(self) -> float:
        me = os.getpid()
        total = 0.0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                raw = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = raw.rpartition(")")[2].split()
            pgid, comm = int(fields[2]), raw[raw.index("(") + 1:raw.rindex(")")]
            mine = pid == me or int(fields[1]) == me or pgid in self._groups
            if not mine and comm == "postgres" and self.dbnames:
                with contextlib.suppress(OSError):
                    title = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    mine = any(f" {d} " in title for d in self.dbnames)
            if mine:
                total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        return total

    _groups: set[int] = set()

    def start(self, groups: Sequence[int] = ()) -> None:
        self._groups = set(groups)
        self.t0 = time.perf_counter()
        self.busy0, self.total0 = cpu_totals()
        self.ours0 = self._ours()
        self.load0 = load_average()

    def stop(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.t0
        busy, total = cpu_totals()
        cpus = os.cpu_count() or 1
        busy_pct = 100 * cpus * (busy - self.busy0) / max(1, total - self.total0)
        ours_pct = 100 * (self._ours() - self.ours0) / max(elapsed, 1e-9)
        return {"load_before": self.load0, "load_after": load_average(),
                "machine_busy_pct": round(busy_pct, 1),
                "other_cpu_pct": round(max(0.0, busy_pct - ours_pct), 1)}


# --- latency in SQL ------------------------------------------------------------------------------------
def latency_expr(dialect: str) -> str:
    if dialect == "postgresql":
        return "extract(epoch FROM dispatched_at - ready_at) * 1000"
    return "(julianday(dispatched_at) - julianday(ready_at)) * 86400000.0"


CDF_QUANTILES = [i / 200 for i in range(1, 200)] + [0.995, 0.999, 1.0]


def nearest_rank(q: float, n: int) -> int:
    return max(1, min(n, math.ceil(round(q * n, 9))))


def latency_from_sql(execute: Any, dialect: str, where: str, params: dict[str, Any] | Sequence[Any],
                     quantiles: Sequence[float] = (0.5, 0.9, 0.99, 1.0)) -> tuple[int, dict[float, float]]:
    """(n, {quantile: ms}) of ``dispatched_at - ready_at`` over the dispatch log rows matching ``where``;
    nearest-rank percentiles, the ranking done by the database (a window function; both dialects).

    ``execute(sql, params)`` returns rows; ``where`` uses the driver's parameter style."""
    return ranked(execute, f"SELECT {latency_expr(dialect)} AS ms FROM pollbridge_dispatch_log "
                           f"WHERE ready_at IS NOT NULL AND {where}", params, quantiles)


def ranked(execute: Any, select_ms: str, params: dict[str, Any] | Sequence[Any],
           quantiles: Sequence[float]) -> tuple[int, dict[float, float]]:
    """(n, {quantile: value}) of the column ``ms`` of the query ``select_ms``, nearest-rank, ranked in SQL."""
    rows = list(execute(f"SELECT count(*) FROM ({select_ms}) l", params))
    n = int(rows[0][0]) if rows else 0
    if n == 0:
        return 0, {}
    ranks = sorted({nearest_rank(q, n) for q in quantiles})
    rank_list = ",".join(str(r) for r in ranks)
    got = {int(r): float(ms) for r, ms in execute(
        f"SELECT rn, ms FROM (SELECT ms, row_number() OVER (ORDER BY ms) AS rn FROM ({select_ms}) l) r "
        f"WHERE rn IN ({rank_list})", params)}
    return n, {q: got[nearest_rank(q, n)] for q in quantiles}


def summary(n: int, values: dict[float, float]) -> dict[str, Any]:
    def r(q: float) -> float | None:
        return round(values[q], 2) if q in values else None

    return {"n": n, "p50_ms": r(0.5), "p90_ms": r(0.9), "p99_ms": r(0.99), "max_ms": r(1.0)}


def cdf_points(n: int, values: dict[float, float]) -> list[list[float]]:
    return [[round(values[q], 3), q] for q in CDF_QUANTILES if q in values] if n else []


# --- output --------------------------------------------------------------------------------------------
def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths,
                                                                                           strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def plot(png: str | None, title: str, xlabel: str, ylabel: str,
         series: dict[str, list[list[float]]], *, logx: bool = False, logy: bool = False,
         step: bool = False) -> str | None:
    """Draw ``series`` ({label: [[x, y], ...]}) to ``png`` with matplotlib's Agg backend. Returns a message
    when nothing was drawn (matplotlib missing, or no file asked for)."""
    if not png:
        return None
    plt = pyplot()
    if plt is None:
        return f"matplotlib is not installed (pip install 'pollbridge[bench]'): {png} not drawn"
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    for label, points in series.items():
        if not points:
            continue
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        if step:
            ax.step(xs, ys, where="post", label=label)
        else:
            ax.plot(xs, ys, marker="o", label=label)
    style(ax, title, xlabel, ylabel, logx=logx, logy=logy)
    save(plt, fig, png)
    return None


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def style(ax: Any, title: str, xlabel: str, ylabel: str, *, logx: bool = False, logy: bool = False,
          legend_size: int = 8) -> None:
    """The benches' look of one panel: scales, labels, a grid and the legend."""
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


def save(plt: Any, fig: Any, png: str) -> None:
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def machine_info() -> dict[str, Any]:
    info = machine()
    info["nproc"] = command("nproc").strip()
    info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    with contextlib.suppress(Exception), psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        info["postgresql_server"] = row[0] if row else "?"
    info["load_at_start"] = load_average()
    return info


# --- the worker fleet ----------------------------------------------------------------------------------
def task_duration(task_id: int, low: float, high: float) -> float:
    """A task's run time, uniform in [low, high], the same for a task id in every path."""
    return low if high <= low else random.Random(task_id).uniform(low, high)


PG_CLAIM = ("UPDATE tasks SET status = 'running', attempts = attempts + 1, updated_at = clock_timestamp() "
            "WHERE id = ANY(ARRAY(SELECT id FROM tasks WHERE status = 'queued' ORDER BY id LIMIT %s "
            "FOR UPDATE SKIP LOCKED)) RETURNING id")
PG_FINISH = ("UPDATE tasks SET status = 'completed', completed_at = clock_timestamp(), updated_at = clock_timestamp() "
             "WHERE id = ANY(%s) AND status = 'running'")
SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f','now')"
SQLITE_CLAIM = (f"UPDATE tasks SET status = 'running', attempts = attempts + 1, updated_at = {SQLITE_NOW} "
                "WHERE id IN (SELECT id FROM tasks WHERE status = 'queued' ORDER BY id LIMIT ?) RETURNING id")
SQLITE_FINISH = (f"UPDATE tasks SET status = 'completed', completed_at = {SQLITE_NOW}, updated_at = {SQLITE_NOW} "
                 "WHERE status = 'running' AND id IN ({})")


def fleet_main(argv: Sequence[str] | None = None) -> None:
    """The existing platform's workers, as one process that cannot become the bottleneck: every
    ``--poll`` seconds it claims every dispatched (``queued``) task (→ ``running``, one statement),
    and completes each when its run time (uniform in [``--min-duration``, ``--max-duration``], fixed
    per task id) has passed (→ ``completed``, one statement for all that are due). Unlimited
    concurrency: a task's run time is its own, never a wait for a free worker. Every statement is a
    transaction of its own; the count is written to ``$POLLBRIDGE_BENCH_STMT_FILE``."""
    parser = argparse.ArgumentParser(prog="python -m bench._paths_common fleet")
    parser.add_argument("--url", required=True)
    parser.add_argument("--min-duration", type=float, default=0.01)
    parser.add_argument("--max-duration", type=float, default=0.05)
    parser.add_argument("--poll", type=float, default=0.005)
    parser.add_argument("--batch", type=int, default=2000)
    args = parser.parse_args(argv)
    stmt_file = os.environ.get(STMT_ENV)
    stop = False

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    statements = 0
    last_dump = 0.0
    running: list[tuple[float, int]] = []  # (finish at, task id)
    sqlite_path = args.url.removeprefix("sqlite:///") if args.url.startswith("sqlite:///") else None
    pg: psycopg.Connection[Any] | None = None
    lite: sqlite3.Connection | None = None
    if sqlite_path is not None:
        lite = sqlite3.connect(sqlite_path, isolation_level=None, timeout=30)
        lite.execute("PRAGMA busy_timeout=30000")
    else:
        pg = psycopg.connect(libpq(args.url), autocommit=True)

    def dump() -> None:
        if stmt_file:
            Path(stmt_file + ".tmp").write_text(str(statements))
            os.replace(stmt_file + ".tmp", stmt_file)

    try:
        while not stop:
            now = time.monotonic()
            if lite is not None:
                claimed = [r[0] for r in lite.execute(SQLITE_CLAIM, (args.batch,)).fetchall()]
            else:
                assert pg is not None
                claimed = [r[0] for r in pg.execute(PG_CLAIM, (args.batch,)).fetchall()]
            statements += 1
            for task_id in claimed:
                heapq.heappush(running, (now + task_duration(task_id, args.min_duration, args.max_duration), task_id))
            due: list[int] = []
            now = time.monotonic()
            while running and running[0][0] <= now:
                due.append(heapq.heappop(running)[1])
            if due:
                if lite is not None:
                    for start in range(0, len(due), 500):
                        chunk = due[start:start + 500]
                        lite.execute(SQLITE_FINISH.format(",".join("?" * len(chunk))), chunk)
                        statements += 1
                else:
                    assert pg is not None
                    pg.execute(PG_FINISH, (due,))
                    statements += 1
            if now - last_dump > 0.5:
                dump()
                last_dump = now
            wait = args.poll
            if running:
                wait = min(wait, max(0.0, running[0][0] - time.monotonic()))
            if not claimed and not due:
                time.sleep(wait)
    finally:
        dump()
        if lite is not None:
            lite.close()
        if pg is not None:
            pg.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fleet":
        fleet_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m bench._paths_common fleet --url URL [--min-duration S] [--max-duration S]")
