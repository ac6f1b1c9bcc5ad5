"""Every component in one process: relay, event scheduler, poller (with its safety sweep), guardian and,
optionally, the demo workers — for the embedded default and small deployments (``pollbridge run-all``).

Every component is built by :class:`bridge.app.components.Components`. Each keeps its own engine (so
its statements can be counted apart, and a slow one cannot starve another's connections) and its own
thread; all of them follow one :class:`FlagRouter`. In production each is its own command (``relay
run``, ``scheduler run``, ``poller run``, ``guardian run``), so that each can be restarted, scaled and
watched on its own.

A component that raises is logged and restarted after a pause (each loop already retries its own
transient failures), so one failing part never stops the others; :meth:`Stack.stop` stops them all
and waits for them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from bridge.app.components import Components
from bridge.bus.base import EventBus
from bridge.core.phases import EventRouter, FixedRouter
from bridge.core.settings import Settings
from bridge.db.engine import StatementCounter, check_connection
from bridge.db.migrate import require_head
from bridge.flags.router import FlagRouter
from bridge.tasktable.tables import TaskTable, reflect_tables
from legacy_poller.runner import PollerRunner
from legacy_poller.workers import WorkerPool

if TYPE_CHECKING:
    from bridge.capture.wal import WalCapture

log = logging.getLogger(__name__)

COMPONENTS = ("relay", "scheduler", "poller", "guardian", "workers")
RESTART_PAUSE = 1.0


@dataclass
class StackOptions:
    poll_interval: float | None = None      # default: settings.poller.interval
    sweep_interval: float | None = None     # default: settings.router.sweep_interval
    demo_workers: bool = False
    scheduler_phase: str | None = None      # a fixed phase for every type instead of the flags
    count_statements: bool = False
    worker_seed: int | None = None


@dataclass
class Stack:
    settings: Settings
    options: StackOptions = field(default_factory=StackOptions)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.components = Components(self.settings)
        self.engines: dict[str, Engine] = {}
        self.counters: dict[str, StatementCounter] = {}
        self.buses: list[EventBus] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.runner: PollerRunner | None = None
        self.workers: WorkerPool | None = None
        self.router: FlagRouter | None = None

    def _engine(self, component: str, pool_size: int = 5) -> Engine:
        engine = self.components.engine(pool_size=pool_size)
        if self.options.count_statements:
            counter = StatementCounter()
            counter.attach(engine)
            self.counters[component] = counter
        self.engines[component] = engine
        return engine

    def _bus(self, engine: Engine) -> EventBus:
        bus = self.components.bus(engine)
        self.buses.append(bus)
        return bus

    def start(self) -> Stack:
        s = self.settings
        c = self.components
        main = self._engine("router")
        check_connection(main)
        require_head(main)
        tables: TaskTable = reflect_tables(main, s.mapping)
        self.tables = tables
        self.router = c.flag_router(main, registry=self.registry).start()
        router: EventRouter = (FixedRouter(self.options.scheduler_phase)  # type: ignore[arg-type]
                               if self.options.scheduler_phase else self.router)

        relay_engine = self._engine("relay")
        relay_bus = self._bus(relay_engine)
        self.relay = c.relay(relay_engine, relay_bus, registry=self.registry)
        #: The write-ahead log's captures this stack ran (PostgreSQL, ``[capture] mode = "wal"``).
        self.log_captures: list[WalCapture] = []
        log_stream = c.log_stream(relay_engine, relay_bus, self.relay, self.log_captures)
        sched_engine = self._engine("scheduler")
        self.scheduler = c.scheduler(sched_engine, tables, self._bus(sched_engine), router, registry=self.registry)
        self.router.on_event_share_growth(self.scheduler.request_catch_up)
        poller_engine = self._engine("poller")
        self.poller = c.poller(poller_engine, tables, self.router, registry=self.registry)
        guardian_engine = self._engine("guardian")
        self.guardian = c.guardian(guardian_engine, bus=self._bus(guardian_engine), registry=self.registry)

        self._spawn("relay", self.relay.run)
        if log_stream is not None:  # streams while the relay leads partition 0
            self._spawn("wal", log_stream)
        self._spawn("scheduler", self.scheduler.run)
        self._spawn("guardian", self.guardian.run)
        self.runner = PollerRunner(self.poller, self.options.poll_interval or s.poller.interval,
                                   sweep_interval=self.options.sweep_interval or s.router.sweep_interval)
        self.runner.start()
        if self.options.demo_workers:
            worker_engine = self._engine("workers", pool_size=s.workers.concurrency + 1)
            self.workers = c.workers(worker_engine, tables, registry=self.registry, seed=self.options.worker_seed)
            self.workers.start()
        return self

    def _spawn(self, name: str, target: Callable[[threading.Event], object]) -> None:
        def supervise() -> None:
            while not self._stop.is_set():
                try:
                    target(self._stop)
                    return
                except Exception:  # one failing component must not stop the others
                    log.exception("%s failed; restarting it in %.0f s", name, RESTART_PAUSE)
                    self._stop.wait(RESTART_PAUSE)

        thread = threading.Thread(target=supervise, name=f"pollbridge-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def statements(self) -> dict[str, int]:
        return {name: counter.count for name, counter in self.counters.items()}

    def stop(self) -> None:
        self._stop.set()
        if self.runner is not None:
            self.runner.stop()
        if self.workers is not None:
            self.workers.stop()
        for thread in self._threads:
            thread.join(timeout=30)
        if self.router is not None:
            self.router.stop()
        for bus in self.buses:
            bus.close()
        for engine in self.engines.values():
            engine.dispose()
