"""The composition root: every component built from one :class:`~bridge.core.settings.Settings`.

How an engine, the bus, the flag store and router, the relay, the event scheduler, the poller, the
guardian and the demo workers are configured from the settings is written here once; ``run-all``,
each ``… run`` command, ``serve``, ``status``, ``explain``, ``metrics serve``, ``guardian``, ``flags``,
``dlq``, ``preflight``, ``doctor`` and the demo take them from :class:`Components`.

Nothing here starts a thread or keeps a reference: the caller owns what it gets and closes, stops or
disposes of it. ``doctor`` and ``preflight`` (:mod:`bridge.rollout`, a layer below this one) are given
the flag store and a way to open the bus from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from bridge.core.errors import ConfigError, first_line
from bridge.core.settings import Settings, WorkerSettings
from bridge.core.urls import bus_scheme, mask_url

if TYPE_CHECKING:
    import threading

    from prometheus_client import CollectorRegistry
    from sqlalchemy.engine import Connection, Engine

    from bridge.bus.base import EventBus
    from bridge.capture.relay import Relay
    from bridge.capture.wal import WalCapture
    from bridge.core.phases import EventRouter
    from bridge.flags.router import FlagRouter
    from bridge.flags.store import FlagStore
    from bridge.rollout.checks import CheckResult
    from bridge.rollout.guardian import Guardian
    from bridge.rollout.preflight import PreflightReport
    from bridge.tasktable.tables import TaskTable
    from event_scheduler.scheduler import EventScheduler
    from legacy_poller.poller import LegacyPoller
    from legacy_poller.workers import WorkerPool

# Each component's module is imported by the method that builds it, not here: every ``pollbridge`` command
# imports this module, and importing every component took 160 ms of a command's start-up on this machine
# (`python -X importtime`), which a short command such as ``pollbridge signal`` paid for nothing.

#: Seconds one Redis call may take in the commands that only look at the bus (``status``, ``explain``,
#: ``metrics serve``, ``serve``, ``guardian``, ``preflight``, ``doctor``): a hung bus must fail a check or
#: be reported as unknown, never hang them or delay the guardian's other criteria. The services that
#: publish and consume (``relay run``, ``scheduler run``, ``run-all``) and ``dlq`` keep the bus's own
#: timeout. The embedded bus lives in the database and takes no timeout.
BUS_TIMEOUT = 3.0


@dataclass(frozen=True)
class OptionalBus:
    """A bus that may be missing: ``bus`` is ``None`` when it could not be opened, and ``error`` says why."""

    bus: EventBus | None
    label: str            # the bus URL, masked
    error: str | None = None

    def close(self) -> None:
        if self.bus is not None:
            self.bus.close()


@dataclass(frozen=True)
class Components:
    """Builds the components of one configuration (see the module docstring)."""

    settings: Settings

    # --- connections ----------------------------------------------------------------------------------
    def engine(self, *, pool_size: int = 5) -> Engine:
        """An engine for the configured database (not connected yet)."""
        from bridge.db.engine import create_engine

        return create_engine(self.settings.database_url, pool_size=pool_size)

    def bus(self, engine: Engine, *, timeout: float | None = None) -> EventBus:
        """The configured bus; ``engine`` is the database the embedded bus lives in. ``timeout``: seconds
        a Redis call may take (default: the bus's own)."""
        from bridge.bus.factory import open_bus

        s = self.settings
        options: dict[str, Any] = {}
        if timeout is not None and bus_scheme(s.bus_url) != "embedded":
            options["socket_timeout"] = timeout
        if bus_scheme(s.bus_url) == "embedded":
            options["listen"] = s.bus.listen
        return open_bus(s.bus_url, engine=engine, partitions=s.bus.partitions, namespace=s.bus.namespace, **options)

    def bus_opener(self, engine: Engine) -> Callable[[], EventBus]:
        """Opens the bus with :data:`BUS_TIMEOUT` when called (the checks open it only if one needs it)."""
        return partial(self.bus, engine, timeout=BUS_TIMEOUT)

    def optional_bus(self, engine: Engine) -> OptionalBus:
        """The bus with :data:`BUS_TIMEOUT`, or none with the reason: for the commands that still work
        without it. A bus URL that is bad input stays an error."""
        label = mask_url(self.settings.bus_url)
        try:
            bus = self.bus(engine, timeout=BUS_TIMEOUT)
        except ConfigError:
            raise  # bad input is a usage error, not an outage
        except Exception as exc:
            return OptionalBus(None, label, f"bus {label} could not be opened: {first_line(exc)}")
        return OptionalBus(bus, label)

    # --- flags ----------------------------------------------------------------------------------------
    def flag_store(self, engine: Engine) -> FlagStore:
        from bridge.flags.store import FlagStore

        return FlagStore(engine, default_grace=self.settings.router.grace)

    def flag_router(self, engine: Engine, *, registry: CollectorRegistry | None = None) -> FlagRouter:
        """A router over a new flag store; not started (``.start()``, and ``.stop()`` when done)."""
        from bridge.flags.router import FlagRouter

        r = self.settings.router
        return FlagRouter(self.flag_store(engine), refresh_interval=r.refresh_interval,
                          fallback_interval=r.fallback_interval, registry=registry)

    # --- the services ---------------------------------------------------------------------------------
    def relay(self, engine: Engine, bus: EventBus, *, partition: int = 0,
              registry: CollectorRegistry | None = None) -> Relay:
        from bridge.capture.relay import Relay
        from bridge.tasktable.queries import spawn_depths
        from bridge.tasktable.tables import reflect_tables

        s = self.settings
        depth_of: Callable[[Connection, list[str]], dict[str, int]] | None = None
        if s.mapping.columns.spawned_by:  # events carry the depth derived from the spawning chain
            tables = reflect_tables(engine, s.mapping)

            def spawned_depths(conn: Connection, task_ids: list[str]) -> dict[str, int]:
                return spawn_depths(conn, tables, task_ids)

            depth_of = spawned_depths
        return Relay(engine, bus, s.relay, statuses=s.mapping.statuses, partition=partition,
                     wake=s.capture.wake, registry=registry,  # type: ignore[arg-type]
                     foreign=s.mapping if s.legacy.foreign else None, depth_of=depth_of)

    def wal_capture(self, engine: Engine, bus: EventBus, relay: Relay | None = None) -> WalCapture:
        """The write-ahead-log capture (``[capture] mode = "wal"``), run by the relay of partition 0 (``relay``:
        it streams while that relay leads, and tells it what it wrote)."""
        from bridge.capture.wal import WalCapture
        from bridge.tasktable.tables import reflect_tables

        s = self.settings
        return WalCapture(engine, reflect_tables(engine, s.mapping), bus,
                          relay_partitions=s.capture.relay_partitions,
                          foreign=s.mapping if s.legacy.foreign else None,
                          hold_quiet=s.relay.idle_probe_interval,
                          leading=relay.leading if relay is not None else None,
                          publishing=relay.publishing if relay is not None else None,
                          on_flush=relay.note_captured if relay is not None else None)

    def log_stream(self, engine: Engine, bus: EventBus, relay: Relay,
                   ran: list[WalCapture]) -> Callable[[threading.Event], object] | None:
        """Beside the relay of partition 0 on PostgreSQL, while the write-ahead log's capture is configured or
        installed: the loop (run it in a thread of its own until ``stop``) that streams the log while that
        relay leads (``relay run`` and ``run-all``); ``ran`` collects the captures it ran, as they start (for
        their counts). None where there is none to run: a relay that captures by trigger so adds no look of its
        own to its idle cost; after a switch to the log, the relay's next start streams it."""
        from bridge.app import install
        from bridge.capture.wal import stream_when_installed

        if relay.partition != 0 or engine.dialect.name != "postgresql" or not (
                self.settings.capture.mode == "wal" or install.wal_installed(engine)):
            return None
        return partial(stream_when_installed, engine, lambda: self.wal_capture(engine, bus, relay), ran=ran,
                       leading=relay.leading)

    def scheduler(self, engine: Engine, tables: TaskTable, bus: EventBus, router: EventRouter, *,
                  registry: CollectorRegistry | None = None) -> EventScheduler:
        from event_scheduler.scheduler import EventScheduler

        s = self.settings
        # Beside a foreign scheduler (by default) its retries and timeouts stay its own: pollbridge writes neither.
        return EventScheduler(engine, tables, bus, s.scheduler, router, visibility_timeout=s.bus.visibility_timeout,
                              registry=registry, pollbridge_retries=s.legacy.pollbridge_retries)

    def poller(self, engine: Engine, tables: TaskTable, router: FlagRouter | None, *,
               registry: CollectorRegistry | None = None) -> LegacyPoller:
        from legacy_poller.poller import LegacyPoller

        return LegacyPoller(engine, tables, batch_size=self.settings.poller.batch_size, registry=registry,
                            router=router, running_timeout=self.settings.poller.running_timeout,
                            limits=self.settings.scheduler)

    def guardian(self, engine: Engine, *, bus: EventBus | None, store: FlagStore | None = None,
                 registry: CollectorRegistry | None = None, bus_label: str | None = None,
                 interval: float | None = None) -> Guardian:
        """The guardian; ``interval`` overrides ``guardian.interval``, ``store`` defaults to a new flag store."""
        from bridge.rollout.guardian import Guardian

        s = self.settings
        settings = replace(s.guardian, interval=interval) if interval else s.guardian
        return Guardian(engine, settings, bus=bus, group=s.scheduler.group,
                        store=store if store is not None else self.flag_store(engine), registry=registry,
                        bus_label=bus_label)

    def workers(self, engine: Engine, tables: TaskTable, *, settings: WorkerSettings | None = None,
                registry: CollectorRegistry | None = None, seed: int | None = None) -> WorkerPool:
        """The demo worker pool; ``settings`` overrides ``[workers]`` (a ``--concurrency`` option)."""
        from legacy_poller.workers import WorkerPool

        return WorkerPool(engine, tables, settings or self.settings.workers, registry=registry, seed=seed)

    # --- the checks -----------------------------------------------------------------------------------
    def doctor(self, engine: Engine) -> list[CheckResult]:
        from bridge.rollout.doctor import run_doctor

        return run_doctor(engine, self.settings, store=self.flag_store(engine), open_bus=self.bus_opener(engine))

    def preflight(self, engine: Engine, workflow_type: str, phase: str, *,
                  percent: float | None = None) -> PreflightReport:
        from bridge.rollout.preflight import run_preflight

        return run_preflight(engine, self.settings, workflow_type, phase, percent=percent,
                             store=self.flag_store(engine), open_bus=self.bus_opener(engine))
