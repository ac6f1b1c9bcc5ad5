"""Helpers shared by tests (importable because tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from bridge.bus.abc import EventBus
from bridge.tasktable import TaskTable
from bridge.verify import Verdict, verify
from legacy_poller.poller import LegacyPoller


@dataclass
class Env:
    """A database with pollbridge installed plus a way to open buses on it (see the ``env`` fixture)."""

    engine: Engine
    tables: TaskTable
    open_bus: Callable[[], EventBus]
    kind: str
    namespace: str | None = None
    url: str = ""


#: Runs the installed ``pollbridge`` script: ``run(*args, env=..., timeout=..., cwd=..., input=...)``.
Run = Callable[..., subprocess.CompletedProcess[str]]


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    """Deadline-bounded wait: return as soon as ``condition()`` holds, fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def drive_until_settled(
    engine: Engine,
    tables: TaskTable,
    pollers: Sequence[LegacyPoller],
    instance_ids: Sequence[str],
    timeout: float = 60.0,
) -> Verdict:
    """Scan with every poller in turn (workers run elsewhere) until the instances settle; return the verdict."""
    deadline = time.monotonic() + timeout
    while True:
        for poller in pollers:
            poller.scan_once()
        with engine.connect() as conn:
            verdict = verify(conn, tables, instance_ids)
        if verdict.unsettled == 0:
            return verdict
        if time.monotonic() > deadline:
            raise AssertionError(f"workload not settled after {timeout} s: {verdict}")
        time.sleep(0.02)
