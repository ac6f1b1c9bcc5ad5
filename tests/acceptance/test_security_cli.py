"""Security as a user meets it: real processes, real servers.

* **Passwords never show.** Every command that takes the database and bus URLs runs with URLs carrying a
  unique password (with characters that need URL encoding): against a reachable PostgreSQL (trust
  authentication accepts any password) and a private ``redis-server --requirepass``, against unreachable hosts,
  against the shared Redis that has no password and with a wrong Redis password. The long
  running ones (relay, scheduler, poller, guardian, workers, metrics serve, run-all, serve) run at DEBUG log
  level and are scraped. Nothing they print, log, report (``reconcile --output``) or serve contains the
  password, encoded or not.
* **Listeners bind to this host only.** Each process with a ``--metrics-port``, ``metrics serve`` and ``serve``
  is started on a port of its own with its defaults, and the kernel's socket table shows it listening on
  127.0.0.1 and nowhere else.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import click
import pytest

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from tests.support.ports import free_port

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

CORE_PG = uuid.uuid4().hex[:12]
CORE_REDIS = uuid.uuid4().hex[:12]
CORE_WRONG = uuid.uuid4().hex[:12]
CORE_SECRET = uuid.uuid4().hex[:12]
PG_PASSWORD = f"Pg@{CORE_PG}:/%é"
REDIS_PASSWORD = f"Rd@{CORE_REDIS}#?&"
SECRETS = {"database password": CORE_PG, "redis password": CORE_REDIS, "wrong redis password": CORE_WRONG,
           "signal secret": CORE_SECRET}


def _with_password(url: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{quote(password, safe='')}@{host}"


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[int]:
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1":
            pytest.fail("redis-server is not installed", pytrace=False)
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--requirepass", REDIS_PASSWORD, "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@dataclass
class Run:
    args: list[str]
    env: dict[str, str]
    long: bool = False
    port: int | None = None        # a listener to check and scrape
    ready: str | None = None       # a line that says it is up (long runs)
    proc: subprocess.Popen[str] | None = None
    out: str = ""
    scraped: str = ""
    listening: list[str] = field(default_factory=list)


def _listening(port: int) -> list[str]:
    """Local addresses the kernel has a listening TCP socket on for ``port``."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, state = fields[1], fields[3]
            host, _, hex_port = address.partition(":")
            if state == "0A" and int(hex_port, 16) == port and len(host) == width:
                if width == 8:
                    found.append(".".join(str(b) for b in reversed(bytes.fromhex(host))))
                else:
                    found.append("ipv6:" + host)
    return found


def _run_all(runs: list[Run], cwd: Path, exe: str, settle: float = 4.0, timeout: float = 120.0) -> None:
    """Start every run at once (output to a file each: a full pipe would block a process); one-shot runs are
    waited for; long ones until up, plus ``settle`` seconds of work, their listener checked and scraped, then
    SIGTERM."""
    logs: dict[int, Path] = {}
    for n, run in enumerate(runs):
        log = cwd / f"run-{uuid.uuid4().hex[:6]}-{n}.log"
        logs[id(run)] = log
        with log.open("w") as out:
            run.proc = subprocess.Popen([exe, *run.args], cwd=cwd, env=run.env, stdout=out, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        long_runs = [r for r in runs if r.long]

        def is_up(run: Run) -> bool:
            assert run.proc is not None
            if run.proc.poll() is not None:
                return True
            text = logs[id(run)].read_text(errors="replace")
            return (run.ready is None or run.ready in text) and (run.port is None or bool(_listening(run.port)))

        while not all(is_up(r) for r in long_runs) and time.monotonic() < deadline:
            time.sleep(0.1)
        if long_runs:
            time.sleep(settle)
        for run in long_runs:
            if run.port is not None:
                run.listening = _listening(run.port)
                paths = ["/healthz", "/metrics"] if run.args[0] == "serve" else ["/metrics"]
                for path in paths:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{run.port}{path}", timeout=10) as response:
                            run.scraped += response.read().decode("utf-8", "replace")
                    except OSError as exc:
                        run.scraped += f"(scrape of {path} failed: {exc})"
            assert run.proc is not None
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGTERM)
        for run in runs:
            assert run.proc is not None
            run.proc.wait(max(10.0, deadline - time.monotonic()))
            run.out = logs[id(run)].read_text(errors="replace")
    finally:
        for run in runs:
            if run.proc is not None and run.proc.poll() is None:
                os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait(10)


def _leaks(text: str) -> list[str]:
    return [what for what, core in SECRETS.items() if core in text]


def test_passwords_never_show_and_listeners_bind_to_this_host_only(pg_url: str, private_redis: int,
                                                                     redis_server: str, tmp_path: Path) -> None:
    exe = shutil.which("pollbridge")
    assert exe, "the pollbridge console script is not installed"
    engine = create_engine(pg_url)
    try:
        with engine.begin() as conn:
            seed(conn, reflect_tables(engine, TaskTableMapping()),
                 [WorkflowSpec("s-1", "orders", (TaskSpec("a"), TaskSpec("b", ("a",), awaits_signal="callback")))])
    finally:
        engine.dispose()

    db = _with_password(pg_url, PG_PASSWORD)
    bus = f"redis://:{quote(REDIS_PASSWORD, safe='')}@127.0.0.1:{private_redis}/0"
    base = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
    reachable = {**base, "POLLBRIDGE_DATABASE_URL": db, "POLLBRIDGE_BUS_URL": bus, "POLLBRIDGE_LOG_LEVEL": "DEBUG",
                 "POLLBRIDGE_SIGNAL_SECRET": f"secret-{CORE_SECRET}-padding"}
    no_db = {**reachable, "POLLBRIDGE_DATABASE_URL": _with_password("postgresql://root@127.0.0.1:1/nope", PG_PASSWORD)}
    no_bus = {**reachable, "POLLBRIDGE_BUS_URL": f"redis://:{quote(REDIS_PASSWORD, safe='')}@127.0.0.1:1/0"}
    # The shared Redis has no password: it rejects AUTH, or (redis-py 8 sends AUTH with the user "default",
    # who has nopass) accepts any password. Either way the password is sent and must not show.
    shared = redis_server.split("://", 1)[1]
    rejects_auth = {**reachable, "POLLBRIDGE_BUS_URL": f"redis://:{quote(REDIS_PASSWORD, safe='')}@{shared}"}
    wrong = {**reachable, "POLLBRIDGE_BUS_URL": f"redis://:wrong{CORE_WRONG}@127.0.0.1:{private_redis}/0"}
    report = tmp_path / "report.html"

    one_shot = [
        ["init"], ["doctor"], ["doctor", "--json"], ["status"], ["status", "--json"], ["flags", "list"],
        ["flags", "set", "orders", "dual_write", "--reason", "security test", "--force"], ["flags", "history"],
        ["explain", "1", "--json"], ["reconcile", "--format", "html", "--output", str(report)],
        ["dlq", "list", "--json"], ["guardian", "check", "--dry-run"], ["preflight", "dual_write", "--type", "orders"],
        ["signal", "1", "--kind", "callback"],
    ]
    ports = {name: free_port() for name in ("relay", "scheduler", "poller", "guardian", "metrics", "run-all", "serve")}
    long_runs = [
        Run(["relay", "run", "--metrics-port", str(ports["relay"])], reachable, True, ports["relay"],
            "relay partition"),
        Run(["scheduler", "run", "--metrics-port", str(ports["scheduler"])], reachable, True, ports["scheduler"],
            "scheduler "),
        Run(["poller", "run", "--metrics-port", str(ports["poller"])], reachable, True, ports["poller"], "poller "),
        Run(["guardian", "run", "--metrics-port", str(ports["guardian"])], reachable, True, ports["guardian"],
            "guardian checking"),
        Run(["workers", "run"], reachable, True, None, "workers on"),
        Run(["metrics", "serve", "--port", str(ports["metrics"])], reachable, True, ports["metrics"]),
        Run(["run-all", "--metrics-port", str(ports["run-all"])], reachable, True, ports["run-all"]),
    ]
    from bridge.cli.main import cli

    if "serve" in cli.list_commands(click.Context(cli)):
        long_runs.append(Run(["serve", "--port", str(ports["serve"])], reachable, True, ports["serve"]))
    failing = [
        *(Run(args, no_db) for args in (["init"], ["doctor"], ["status"], ["flags", "list"], ["relay", "run"],
                                         ["explain", "1"])),
        *(Run(args, no_bus) for args in (["doctor"], ["status", "--json"])),
        # A relay partition each, so every one leads (a standby would never touch the bus).
        Run(["relay", "run", "--partition", "1"], no_bus, True, None, "relay partition"),
        *(Run(args, rejects_auth) for args in (["doctor"], ["status"])),
        Run(["relay", "run", "--partition", "2"], rejects_auth, True, None, "relay partition"),
        *(Run(args, wrong) for args in (["doctor"], ["status", "--json"])),
        Run(["relay", "run", "--partition", "3"], wrong, True, None, "relay partition"),
    ]
    runs = [Run(args, reachable) for args in one_shot]
    # In waves, so a loaded machine is not asked to start thirty Python processes at once.
    _run_all(runs[:7], tmp_path, exe)
    _run_all(runs[7:], tmp_path, exe)
    _run_all(long_runs, tmp_path, exe)
    _run_all(failing, tmp_path, exe)

    problems = []
    for run in runs + long_runs + failing:
        leaked = _leaks(run.out) + _leaks(run.scraped)
        if leaked:
            problems.append(f"`pollbridge {' '.join(run.args)}` showed the {', '.join(leaked)}:\n{run.out[-2000:]}")
    if report.exists():
        problems += [f"the HTML report holds the {what}" for what in _leaks(report.read_text(errors="replace"))]
    assert report.exists(), "reconcile wrote no report"
    assert not problems, "\n\n".join(problems)

    # The reachable runs worked (so the secrets were really in use), and nothing crashed.
    for run in runs:
        assert run.proc is not None and run.proc.returncode in (0, 1, 2), (run.args, run.out[-1500:])
        assert "Traceback" not in run.out, (run.args, run.out[-3000:])
    for run in long_runs:
        assert run.proc is not None and run.proc.returncode == 0, (run.args, run.out[-3000:])
        if run.port is not None:
            assert run.listening == ["127.0.0.1"], f"`pollbridge {' '.join(run.args)}` listens on {run.listening}"
            assert run.scraped and "failed:" not in run.scraped, (run.args, run.scraped)
    auth_ok = next(r for r in long_runs if r.args[0] == "relay")
    assert "relay stopped" in auth_ok.out and "AuthenticationError" not in auth_ok.out, auth_ok.out[-2000:]
    assert any(" DEBUG " in r.out for r in long_runs), "the long runs were meant to log at DEBUG level"
    # The failing runs failed for the reason intended, so their secrets were really sent.
    refused = next(r for r in failing if r.long and r.env is wrong)
    assert "invalid username-password" in refused.out or "AuthenticationError" in refused.out, refused.out[-1500:]
    no_database = next(r for r in failing if r.args == ["init"])
    assert no_database.proc is not None and no_database.proc.returncode == 1 and "***" in no_database.out


@pytest.mark.parametrize("which", ["database", "bus"])
def test_a_password_given_as_a_query_parameter_is_masked_too(which: str, pg_url: str, redis_server: str,
                                                             tmp_path: Path) -> None:
    exe = shutil.which("pollbridge")
    assert exe
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
    env["POLLBRIDGE_DATABASE_URL"] = f"{pg_url}?password=q{CORE_PG}" if which == "database" else pg_url
    env["POLLBRIDGE_BUS_URL"] = f"{redis_server}?password=q{CORE_REDIS}" if which == "bus" else "embedded"
    run = Run(["relay", "run"], env, True, None, "relay partition")
    _run_all([run], tmp_path, exe, settle=1.0)
    assert not _leaks(run.out), run.out[-1500:]


def test_the_scheduler_started_while_the_bus_is_down_waits_or_says_so_in_one_line(sqlite_url: str,
                                                                                  tmp_path: Path) -> None:
    exe = shutil.which("pollbridge")
    assert exe
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
    env.update({"POLLBRIDGE_DATABASE_URL": sqlite_url, "POLLBRIDGE_BUS_URL": "redis://127.0.0.1:1/0"})
    run = Run(["scheduler", "run"], env, True, None, "scheduler ")
    _run_all([run], tmp_path, exe, settle=2.0, timeout=60)
    assert "Traceback" not in run.out, run.out[-1500:]
