"""The users of the platform during a chaos run: instances seeded at a steady rate and the signals their
tasks await, some through ``pollbridge signal``, some rejected."""

from __future__ import annotations

import heapq
import json
import random
import shutil
import subprocess
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bridge.reference.workload import SHAPES, WorkflowSpec, make_shape, seed
from bridge.tasktable.tables import TaskTable
from event_scheduler.exceptions import SignalError
from event_scheduler.signals import record_signal
from tests.support.chaos.fleet import classify_cli_failure

if TYPE_CHECKING:
    from tests.support.chaos.engine import ChaosOptions

#: The workflow types of the workload (and of the flag faults).
TYPES = ("orders", "reports", "etl", "billing")


class Workload:
    """Seeds instances and sends the signals their tasks await (a thread each)."""

    def __init__(self, engine: Engine, tables: TaskTable, opts: ChaosOptions, fleet_env: dict[str, str],
                 workdir: Path, rng_seed: int) -> None:
        self.engine = engine
        self.tables = tables
        self.opts = opts
        self.env = fleet_env
        self.workdir = workdir
        self.rng = random.Random(rng_seed)
        self.signal_rng = random.Random(rng_seed + 1)
        self.prefix = f"c{rng_seed % 100000:05d}"
        self.instances: list[str] = []
        self.tasks = 0
        self.lock = threading.Lock()
        self.pending_signals: list[tuple[float, int, str]] = []  # (monotonic due, task id, awaited kind)
        self.signals_sent: Counter[str] = Counter()
        self.problems: list[str] = []
        self.seeding_stopped = threading.Event()
        self.flush_signals = threading.Event()
        self.stop = threading.Event()
        self._n = 0

    def spec(self) -> WorkflowSpec:
        rng = self.rng
        workflow_type = rng.choice(TYPES)
        shape = {"orders": "chain", "reports": "fanout", "etl": "diamond"}.get(workflow_type) or rng.choice(SHAPES)
        tasks = make_shape(shape, rng.randint(3, 7), rng, due_fraction=0.25, max_due=4.0)
        tasks = tuple(replace(t, awaits_signal=rng.choice(("callback", "approval"))) if rng.random() < 0.1 else t
                      for t in tasks)
        self._n += 1
        return WorkflowSpec(f"{self.prefix}-{self._n:06d}", workflow_type, tasks)

    def seed_batch(self, count: int) -> None:
        specs = [self.spec() for _ in range(count)]
        for attempt in range(20):
            try:
                with self.engine.begin() as conn:
                    added = seed(conn, self.tables, specs)
                    ids = [s.instance_id for s in specs]
                    awaiting = conn.execute(sa.text(
                        "SELECT id, awaits_signal FROM tasks WHERE instance_id = ANY(:ids) "
                        "AND awaits_signal IS NOT NULL"), {"ids": ids}).all()
                break
            except sa.exc.OperationalError:
                if attempt == 19:
                    raise
                time.sleep(0.5)
        now = time.monotonic()
        with self.lock:
            self.instances.extend(ids)
            self.tasks += added
            for task_id, kind in awaiting:
                heapq.heappush(self.pending_signals, (now + self.signal_rng.uniform(0.3, 4.0), int(task_id), str(kind)))

    def take_signal_task(self) -> int | None:
        """Hand one not yet signalled task to someone else (the long transaction records its signal)."""
        with self.lock:
            if not self.pending_signals:
                return None
            index = self.rng.randrange(len(self.pending_signals))
            _, task_id, _ = self.pending_signals.pop(index)
            heapq.heapify(self.pending_signals)
            return task_id

    def give_back(self, task_id: int) -> None:
        with self.lock:
            heapq.heappush(self.pending_signals, (time.monotonic(), task_id, "callback"))

    def seeder(self, until: float) -> None:
        try:
            interval = 0.5
            per_tick = max(self.opts.rate * interval, 0.0)
            carry = 0.0
            while not self.stop.is_set() and time.monotonic() < until:
                carry += per_tick
                count = int(carry)
                carry -= count
                if count:
                    self.seed_batch(count)
                self.stop.wait(interval)
        except Exception as exc:
            self.problems.append(f"seeder failed: {type(exc).__name__}: {exc}")
        finally:
            self.seeding_stopped.set()

    def signaller(self) -> None:
        n = 0
        while not self.stop.is_set():
            with self.lock:
                due = self.pending_signals and (self.flush_signals.is_set()
                                                or self.pending_signals[0][0] <= time.monotonic())
                item = heapq.heappop(self.pending_signals) if due else None
                done = not self.pending_signals and self.seeding_stopped.is_set()
            if item is None:
                if done and self.flush_signals.is_set():
                    return
                self.stop.wait(0.05)
                continue
            _, task_id, awaited = item
            n += 1
            # A rejection answers an approval only (a callback takes a callback: another kind is refused).
            reject = self.signal_rng.random() < 0.08 and awaited == "approval"
            kind = "rejection" if reject else ("approval" if awaited == "approval" else "callback")
            payload = json.dumps({"chaos": n, "note": "signal é ✓"}) if self.signal_rng.random() < 0.5 else None
            via_cli = self.opts.cli_signal_every > 0 and n % self.opts.cli_signal_every == 0
            try:
                self._send(task_id, kind, payload, via_cli)
                self.signals_sent[f"{kind}{' (cli)' if via_cli else ''}"] += 1
            except SignalError as exc:
                if "already received" in str(exc):
                    self.signals_sent["already received"] += 1
                else:
                    self.problems.append(f"signal for task {task_id} refused: {exc}")
            except Exception as exc:  # the database is being disturbed: try again shortly
                with self.lock:
                    heapq.heappush(self.pending_signals, (time.monotonic() + 0.5, task_id, awaited))
                self.signals_sent["retried"] += 1
                if not isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError | RuntimeError):
                    self.problems.append(f"signal for task {task_id} failed: {type(exc).__name__}: {exc}")

    def _send(self, task_id: int, kind: str, payload: str | None, via_cli: bool) -> None:
        if not via_cli:
            record_signal(self.engine, self.tables, str(task_id), kind, payload=payload, actor="chaos")
            return
        args = [shutil.which("pollbridge") or "pollbridge", "signal", str(task_id), "--kind", kind, "--actor", "chaos"]
        if payload is not None:
            args += ["--payload", payload]
        done = subprocess.run(args, cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=120)
        if done.returncode == 2 and "already received" in done.stderr:
            raise SignalError(done.stderr.strip())
        if done.returncode != 0:
            if classify_cli_failure(done.returncode, done.stderr) is None:
                self.problems.append(f"`pollbridge signal {task_id}` exited {done.returncode}: "
                                     f"{done.stderr.strip()[-500:]}")
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")


