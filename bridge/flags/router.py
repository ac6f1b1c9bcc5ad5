"""The flag router: every running process's view of the flags, refreshed within one poll interval.

A :class:`FlagRouter` keeps the flags in memory and re-reads the store from a background thread (or
when a caller asks, :meth:`refresh`), so a phase change takes effect in every relay, scheduler and
poller without a restart, and the hot paths (asked per ready task) never touch the database. It
re-reads every ``refresh_interval`` seconds (on a SQLite file: after a commit to it, at most that often, and
every ``fallback_interval`` without one); on PostgreSQL it LISTENs instead for the notification
every flag change sends at commit (:data:`bridge.flags.store.FLAGS_CHANNEL`) and re-reads at once, with a
re-read every ``fallback_interval`` seconds for a notification that never came (a flag row written
by hand, a listener that reconnected), and every ``refresh_interval`` while the store is unreadable.
An idle process so reads the flags once per fallback interval, not once a second.

When the store cannot be read, the two paths fail safe in opposite directions, so a type is never
left without a dispatcher: the poller's view (:meth:`poller_flags`) treats every type as ``polling``
(authoritative) until a read succeeds again, while the event path keeps the last flags it read
(both dispatch through the same compare-and-set, so the overlap can never dispatch twice).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime

from prometheus_client import CollectorRegistry, Gauge

from bridge.core.errors import FlagStoreUnavailable
from bridge.core.phases import PHASES, EventRoute, Flag, poller_should_handle
from bridge.db.changes import changes_of
from bridge.db.listen import ChangeWaiter, ListenWaiter, Waiter
from bridge.flags.store import FLAGS_CHANNEL, FlagStore

log = logging.getLogger(__name__)

ChangeListener = Callable[[dict[str, Flag], dict[str, Flag]], None]


def event_share(flag: Flag | None) -> float:
    """The percentage of a type's instances the event path dispatches for."""
    if flag is None or flag.phase in ("polling", "dual_write"):
        return 0.0
    return 100.0 if flag.phase == "cutover" or flag.percent is None else flag.percent


def shadow_share(flag: Flag | None) -> float:
    """The percentage of a type's instances the event path records shadow decisions for."""
    return 100.0 if flag is not None and flag.phase == "dual_write" else 0.0


class FlagRouter:
    """Implements :class:`bridge.core.phases.EventRouter` from the stored flags."""

    def __init__(self, store: FlagStore, *, refresh_interval: float = 1.0, fallback_interval: float = 30.0,
                 registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.refresh_interval = refresh_interval
        self.fallback_interval = max(fallback_interval, refresh_interval)
        self._lock = threading.Lock()
        self._flags: dict[str, Flag] = {}
        self._healthy = False
        self._listeners: list[ChangeListener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_refresh = 0.0
        registry = registry if registry is not None else CollectorRegistry()
        self._phase_gauge = Gauge("pollbridge_flag_phase", "1 for the current phase of each workflow type with a flag",
                                  ["workflow_type", "phase"], registry=registry)
        self._percent_gauge = Gauge("pollbridge_flag_percent", "Selective percentage of each workflow type "
                                    "(100 when all instances)", ["workflow_type"], registry=registry)
        self._store_up = Gauge("pollbridge_flag_store_up", "1 when the last read of the flag store succeeded",
                               registry=registry)

    # --- reading -------------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Re-read the store; ``False`` (and the poller view falls back to ``polling``) when it cannot."""
        try:
            fresh = self.store.all()
        except FlagStoreUnavailable as exc:
            with self._lock:
                was_healthy, self._healthy = self._healthy, False
            self._store_up.set(0)
            if was_healthy:
                log.error("%s; pollers treat every workflow type as polling until it can be read", exc)
            return False
        with self._lock:
            old, self._flags = self._flags, fresh
            recovered = not self._healthy
            self._healthy = True
            self.last_refresh = time.monotonic()
            listeners = list(self._listeners)
        self._store_up.set(1)
        if recovered and self.last_refresh:
            log.info("flag store readable: %d workflow type(s) with a flag", len(fresh))
        self._export(fresh)
        if old != fresh:
            for listener in listeners:
                try:
                    listener(old, fresh)
                except Exception:  # a listener's bug must not stop the router
                    log.exception("flag change listener failed")
        return True

    def _export(self, fresh: dict[str, Flag]) -> None:
        for name, flag in fresh.items():
            for phase in PHASES:
                self._phase_gauge.labels(workflow_type=name, phase=phase).set(1 if phase == flag.phase else 0)
            self._percent_gauge.labels(workflow_type=name).set(100 if flag.percent is None else flag.percent)

    @property
    def healthy(self) -> bool:
        return self._healthy

    def flag(self, workflow_type: str | None) -> Flag:
        """The flag of a type as this process sees it (``polling`` without a row)."""
        with self._lock:
            found = self._flags.get(workflow_type or "")
        return found or Flag(workflow_type or "", grace_seconds=self.store.default_grace)

    def flags(self) -> dict[str, Flag]:
        with self._lock:
            return dict(self._flags)

    def poller_flags(self) -> dict[str, Flag]:
        """The flags a poller acts on: none (every type ``polling``) while the store is unreadable."""
        with self._lock:
            return dict(self._flags) if self._healthy else {}

    def event_route(self, workflow_type: str | None, instance_id: str) -> EventRoute:
        return self.flag(workflow_type).event_route(instance_id)

    def uniform_route(self, workflow_type: str | None) -> EventRoute | None:
        """The route of every instance of the type, None when it depends on the instance (see EventRouter)."""
        return self.flag(workflow_type).uniform_event_route()

    def thresholds(self, workflow_type: str | None) -> Mapping[str, float]:
        return self.flag(workflow_type).thresholds

    def poller_should_handle(self, workflow_type: str | None, instance_id: str, ready_since: datetime | None,
                             now: datetime) -> bool:
        """For your own poller: whether it should dispatch this ready task now (see :mod:`bridge.core.phases`)."""
        flag = self.poller_flags().get(workflow_type or "")
        return poller_should_handle(flag, instance_id, ready_since, now)

    def on_change(self, listener: ChangeListener) -> None:
        """Call ``listener(old, new)`` after a refresh that saw different flags."""
        with self._lock:
            self._listeners.append(listener)

    def on_event_share_growth(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when the event path becomes responsible for more instances (a type entering
        ``dual_write``, ``selective`` or ``cutover``, or a larger percentage): tasks that were ready already
        produce no new event, so the scheduler should catch up from the database rather than leave them to
        the fallback (or, in ``dual_write``, leave them without a shadow decision: a false miss)."""

        def listener(old: dict[str, Flag], new: dict[str, Flag]) -> None:
            if any(event_share(flag) > event_share(old.get(name))
                   or shadow_share(flag) > shadow_share(old.get(name)) for name, flag in new.items()):
                callback()

        self.on_change(listener)

    # --- the refresh thread --------------------------------------------------------------------------
    def start(self) -> FlagRouter:
        """Read once now, then refresh in a daemon thread until :meth:`stop`."""
        waiter = self._listener()
        self.refresh()  # after LISTEN: a change committed in between is notified, not missed
        self._thread = threading.Thread(target=self._loop, args=(waiter,), name="pollbridge-flag-router",
                                        daemon=True)
        self._thread.start()
        return self

    def _listener(self) -> Waiter:
        engine = self.store.engine
        if engine.dialect.name != "postgresql":
            signal = changes_of(engine, "data")  # a SQLite file: re-read after a commit, at most every refresh_interval
            return Waiter(self._stop) if signal is None else ChangeWaiter(signal, self._stop, self.refresh_interval)
        waiter = ListenWaiter(engine, self._stop, FLAGS_CHANNEL)
        try:
            waiter.ensure_listening()
        except Exception as exc:  # the store is down: the loop reads every refresh_interval until it is back
            log.warning("flag router cannot LISTEN yet (%s); re-reading every %g s", type(exc).__name__,
                        self.refresh_interval)
        return waiter

    def _loop(self, waiter: Waiter) -> None:
        listening = isinstance(waiter, ListenWaiter | ChangeWaiter)
        try:
            while not self._stop.is_set():
                # Notified changes are read at once; without a notification, a re-read per fallback interval
                # (per refresh interval while the store is unreadable or nothing can be listened for).
                waiter.wait(self.fallback_interval if listening and self._healthy else self.refresh_interval)
                if self._stop.is_set():
                    break
                try:
                    self.refresh()
                except Exception:  # never let the thread die: the paths would stop following the flags
                    log.exception("flag refresh failed")
        finally:
            waiter.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
