"""What monitoring reads from ``pollbridge serve`` and ``pollbridge metrics serve``, as a user runs them (the installed
script in a subprocess): every ``/metrics`` scrape passes ``promtool check metrics``, the two endpoints give one
concept one name, and ``serve`` answers an unknown route or method with JSON like every other error.

promtool comes with the Debian package ``prometheus``; without it the promtool test skips, and fails under
``POLLBRIDGE_REQUIRE_SERVICES=1`` (CI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.reference.workload import TaskSpec, WorkflowSpec, seed
from bridge.tasktable.tables import reflect_tables
from legacy_poller.poller import LegacyPoller
from tests.support import Run, stop_processes, wait_for

PROMTOOL_HINT = "promtool is not installed: apt-get install prometheus"


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{PROMTOOL_HINT} (POLLBRIDGE_REQUIRE_SERVICES=1: services are required)", pytrace=False)
        pytest.skip(PROMTOOL_HINT)
    return promtool


def _installed_with_a_dispatch(pollbridge: Run, url: str) -> None:
    """pollbridge and the reference schema in ``url``, one instance, its first task dispatched by the poller (so the
    status gauges and the windowed latency have samples)."""
    init = pollbridge("--database-url", url, "init", "--demo-schema")
    assert init.returncode == 0, init.stderr
    engine = create_engine(url)
    try:
        tables = reflect_tables(engine, TaskTableMapping())
        with engine.begin() as conn:
            seed(conn, tables, [WorkflowSpec("prom-1", "orders", (TaskSpec("a"), TaskSpec("b", ("a",))))])
        assert LegacyPoller(engine, tables).scan_once().dispatched == 1
    finally:
        engine.dispose()


@contextmanager
def _running(cwd: Path, url: str, args: tuple[str, ...], first_line: str, **env: str) -> Iterator[str]:
    """Run ``pollbridge ARGS`` until the block ends (SIGTERM, exit 0); yield the base URL its first line names."""
    exe = shutil.which("pollbridge")
    assert exe
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")},
            "POLLBRIDGE_DATABASE_URL": url, **env}
    proc = subprocess.Popen([exe, *args], cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.match(first_line, line)
        assert match, line + (proc.stderr.read() if proc.poll() is not None else "")
        yield match.group(1)
    finally:
        [(_, err)] = stop_processes([proc])
    assert proc.returncode == 0 and "Traceback" not in err, err


def _scrape(url: str) -> str:
    bodies: list[str] = []

    def answered() -> bool:
        try:
            response = httpx.get(url, timeout=10)
        except httpx.TransportError:
            return False
        assert response.status_code == 200, response.text
        bodies.append(response.text)
        return True

    wait_for(answered, 30, what=f"{url} to answer")
    return bodies[-1]


def _families(scrape: str) -> dict[str, str]:
    """Metric family name -> type, from the ``# TYPE`` lines."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", scrape, re.MULTILINE)}


def test_every_metrics_scrape_passes_promtool_and_both_endpoints_share_their_names(
        pollbridge: Run, empty_db_url: str, tmp_path: Path) -> None:
    promtool = _promtool()
    _installed_with_a_dispatch(pollbridge, empty_db_url)
    with _running(tmp_path, empty_db_url, ("serve",), r"serving on (http://127\.0\.0\.1:\d+) ",
                  POLLBRIDGE_SERVE_PORT="0") as base:
        served = _scrape(f"{base}/metrics")
    with _running(tmp_path, empty_db_url, ("metrics", "serve"), r"metrics on (http://127\.0\.0\.1:\d+/metrics) ",
                  POLLBRIDGE_METRICS_SERVE_PORT="0") as url:
        exported = _scrape(url)
    # The scrapes have samples of the status gauges and of the windowed latency (a gauge histogram).
    assert "pollbridge_status_up 1.0" in served and "pollbridge_status_up 1.0" in exported
    assert "# TYPE pollbridge_dispatch_latency_window_seconds histogram" in served
    assert re.search(r'^pollbridge_dispatch_latency_window_seconds_bucket\{le="\+Inf",path="poller",'
                     r'workflow_type="orders"\} 1\.0$', served, re.MULTILINE), served
    assert re.search(r'^pollbridge_dispatch_latency_window_seconds_gcount\{path="poller",'
                     r'workflow_type="orders"\} 1\.0$', served, re.MULTILINE), served
    for name, scrape in (("pollbridge serve", served), ("pollbridge metrics serve", exported)):
        result = subprocess.run([promtool, "check", "metrics"], input=scrape, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
            f"promtool check metrics of {name}'s /metrics:\n{result.stdout}{result.stderr}"
    # One name per concept: what `metrics serve` exports, `serve` exports under the same name and type.
    both, only_serve = _families(exported), _families(served)
    assert both and {name: only_serve.get(name) for name in both} == both
    assert all(name.startswith(("pollbridge_serve_", "pollbridge_dispatch_latency_window_seconds"))
               for name in set(only_serve) - set(both)), sorted(set(only_serve) - set(both))


def test_serve_answers_an_unknown_route_or_method_with_json(pollbridge: Run, sqlite_url: str, tmp_path: Path) -> None:
    with _running(tmp_path, sqlite_url, ("serve",), r"serving on (http://127\.0\.0\.1:\d+) ",
                  POLLBRIDGE_SERVE_PORT="0") as base, httpx.Client(base_url=base, timeout=10) as http:
        missing = http.get("/nowhere")
        assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
        assert missing.json() == {"error": "not_found", "message": "Not Found: GET /nowhere"}
        wrong = http.delete("/tasks/1")
        assert wrong.status_code == 405 and set(wrong.headers["allow"].split(", ")) == {"GET", "HEAD"}
        assert wrong.json() == {"error": "method_not_allowed", "message": "Method Not Allowed: DELETE /tasks/1"}
