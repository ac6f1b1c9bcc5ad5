"""Settings: one frozen object built from ``pollbridge.toml``, the environment and flags.

Precedence, lowest first: built-in defaults, the configuration file, ``POLLBRIDGE_*`` environment
variables, command-line options. The file is ``--config FILE`` / ``POLLBRIDGE_CONFIG`` if given
(it must then exist), else ``./pollbridge.toml`` if present.

File layout::

    [database]
    url = "sqlite:///pollbridge.db"
    [bus]
    url = "embedded"
    [poller]
    interval = 10.0        # seconds between scans
    batch_size = 500       # most tasks dispatched per scan
    [bus]                  # also: partitions = 8, namespace = "pollbridge", visibility_timeout = 30
    [capture]
    wake = "adaptive"      # poll | notify | adaptive (PostgreSQL wake-up of the relay)
    relay_partitions = 1
    [relay]                # batch_size, poll_interval, arm_after, fallback_interval, retention, ...
    [workers]
    concurrency = 4
    min_duration = 0.01    # seconds a demo task "runs"
    max_duration = 0.05
    failure_rate = 0.0
    [router]               # refresh_interval = 1.0, fallback_interval = 30.0, grace = 5.0, sweep_interval = 300.0
    [gates]                # window, min_tasks, miss_budget, confidence, objective, tolerance
    [guardian]             # interval, max_outbox_age, max_lag, max_miss_rate, min_tasks, window
    [serve]                # host, port, signal_secret, max_clock_skew, sse_buffer, sse_keepalive
    [preflight]            # rollback_rehearsal_days, max_backlog_age, max_lag, max_dead_letters, heartbeat_timeouts
    [mapping]              # see bridge.core.mapping; defaults to the reference legacy schema
    table = "tasks"
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from bridge.core.errors import ConfigError
from bridge.core.mapping import TaskTableMapping
from bridge.core.urls import validate_bus_url, validate_namespace

# How the relay learns of new outbox rows (docs/capture.md).
WakeMode = Literal["poll", "notify", "adaptive"]
WAKE_MODES: tuple[WakeMode, ...] = ("poll", "notify", "adaptive")
CAPTURE_MODES = ("trigger", "wal")

DEFAULT_DATABASE_URL = "sqlite:///pollbridge.db"
DEFAULT_BUS_URL = "embedded"
DEFAULT_CONFIG_FILE = "pollbridge.toml"

ENV_CONFIG = "POLLBRIDGE_CONFIG"
ENV_DATABASE_URL = "POLLBRIDGE_DATABASE_URL"
ENV_BUS_URL = "POLLBRIDGE_BUS_URL"
ENV_CAPTURE_MODE = "POLLBRIDGE_CAPTURE_MODE"


@dataclass(frozen=True)
class PollerSettings:
    interval: float = 10.0
    batch_size: int = 500
    running_timeout: float = 0.0     # the reference poller fails a task of its share running longer; 0 = never

    def __post_init__(self) -> None:
        _positive(self.interval, "poller.interval")
        _positive(self.batch_size, "poller.batch_size", integer=True)
        _non_negative(self.running_timeout, "poller.running_timeout")


@dataclass(frozen=True)
class WorkerSettings:
    concurrency: int = 4
    min_duration: float = 0.01
    max_duration: float = 0.05
    failure_rate: float = 0.0
    idle_sleep: float = 0.05

    def __post_init__(self) -> None:
        _positive(self.concurrency, "workers.concurrency", integer=True)
        _non_negative(self.min_duration, "workers.min_duration")
        _non_negative(self.max_duration, "workers.max_duration")
        _positive(self.idle_sleep, "workers.idle_sleep")
        if self.max_duration < self.min_duration:
            raise ConfigError("workers.max_duration must be >= workers.min_duration")
        rate = self.failure_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
            raise ConfigError(f"workers.failure_rate must be between 0 and 1, got {self.failure_rate!r}")


@dataclass(frozen=True)
class BusSettings:
    partitions: int = 8
    namespace: str = "pollbridge"
    visibility_timeout: float = 30.0
    #: The embedded bus on PostgreSQL: publishes NOTIFY and waiting readers LISTEN, so another process's idle
    #: reader is woken at once. Off behind a transaction-pooling proxy (PgBouncer), where LISTEN cannot work:
    #: idle readers then look every 0.1 s.
    listen: bool = True

    def __post_init__(self) -> None:
        _positive(self.partitions, "bus.partitions", integer=True)
        _positive(self.visibility_timeout, "bus.visibility_timeout")
        if not isinstance(self.listen, bool):
            raise ConfigError(f"bus.listen must be true or false, got {self.listen!r}")
        if not isinstance(self.namespace, str):
            raise ConfigError(f"bus.namespace must be a string, got {self.namespace!r}")
        validate_namespace(self.namespace)


@dataclass(frozen=True)
class CaptureSettings:
    wake: str = "adaptive"
    relay_partitions: int = 1
    #: ``trigger`` (row triggers write the outbox in the writer's transaction; SQLite, or PostgreSQL without
    #: logical decoding) or ``wal`` (PostgreSQL's write-ahead log, streamed from a replication slot).
    mode: str = "trigger"

    def __post_init__(self) -> None:
        if self.mode not in CAPTURE_MODES:
            raise ConfigError(f"capture.mode must be one of {', '.join(CAPTURE_MODES)}, got {self.mode!r}")
        if self.wake not in WAKE_MODES:
            raise ConfigError(f"capture.wake must be one of {', '.join(WAKE_MODES)}, got {self.wake!r}")
        _positive(self.relay_partitions, "capture.relay_partitions", integer=True)


LEGACY_KINDS = ("reference", "foreign")
RETRY_OWNERS = ("auto", "legacy", "pollbridge")


@dataclass(frozen=True)
class LegacySettings:
    """The scheduler pollbridge is installed beside.

    ``kind = "reference"``: pollbridge's own reference poller (``legacy_poller``), which records its
    dispatches in ``pollbridge_dispatch_log``. ``kind = "foreign"``: a scheduler pollbridge did not
    write (Airflow, ...): its dispatches are read from the captured transitions of the task table into
    a dispatched status, and pollbridge never writes a retry or a timeout for it.
    ``retries``: who re-pends failed tasks and fails timed-out ones on the dispatching route
    (``auto`` = ``legacy`` for a foreign scheduler, ``pollbridge`` for the reference one)."""

    kind: str = "reference"
    retries: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in LEGACY_KINDS:
            raise ConfigError(f"legacy.kind must be one of {', '.join(LEGACY_KINDS)}, got {self.kind!r}")
        if self.retries not in RETRY_OWNERS:
            raise ConfigError(f"legacy.retries must be one of {', '.join(RETRY_OWNERS)}, got {self.retries!r}")

    @property
    def foreign(self) -> bool:
        return self.kind == "foreign"

    @property
    def pollbridge_retries(self) -> bool:
        """Whether pollbridge itself re-pends failed tasks and times out running ones (dispatching phases only)."""
        if self.retries == "auto":
            return not self.foreign
        return self.retries == "pollbridge"


@dataclass(frozen=True)
class RelaySettings:
    batch_size: int = 5000
    poll_interval: float = 0.002
    #: ``adaptive``: after a busy spell, the outbox found empty this long means the spell is over: arm again.
    arm_after: float = 0.05
    #: ``adaptive``: the change rate (rows/s, over one-second windows) above which the relay stops the trigger's
    #: NOTIFY and polls instead (it arms again below three quarters of it). NOTIFY serialises committing
    #: transactions on one lock: 74-91 % less write throughput with 8 writers flat out (docs/capture.md).
    notify_max_rate: float = 200.0
    #: While a wake-up could have been missed (just armed, some writer that read the flag down still running):
    #: the listening relay probes this often.
    fallback_interval: float = 1.0
    #: Once none could have been missed: the idle listening relay probes only this often (a last resort
    #: behind the listener's own connection checks).
    idle_probe_interval: float = 5.0
    retention: float = 3600.0
    purge_interval: float = 10.0
    purge_batch: int = 1000
    lease_timeout: float = 5.0
    epoch_check_interval: float = 1.0
    #: Pause publishing while the bus uses more than this fraction of its memory limit (Redis maxmemory).
    max_bus_memory: float = 0.9

    def __post_init__(self) -> None:
        if isinstance(self.max_bus_memory, bool) or not isinstance(self.max_bus_memory, int | float) \
                or not 0 < self.max_bus_memory <= 1:
            raise ConfigError(f"relay.max_bus_memory must be in (0, 1], got {self.max_bus_memory!r}")
        for name in ("batch_size", "purge_batch"):
            _positive(getattr(self, name), f"relay.{name}", integer=True)
        for name in ("poll_interval", "arm_after", "notify_max_rate", "fallback_interval", "idle_probe_interval",
                     "retention", "purge_interval", "lease_timeout", "epoch_check_interval"):
            _positive(getattr(self, name), f"relay.{name}")


@dataclass(frozen=True)
class TypeSettings:
    """Per-workflow-type behaviour of the event scheduler (``[scheduler.defaults]``, ``[scheduler.types.T]``)."""

    retry_base: float = 1.0          # first retry after about this many seconds
    retry_max: float = 300.0         # backoff cap
    retry_jitter: float = 0.5        # +/- this fraction of the delay, so retries do not stampede
    running_timeout: float = 0.0     # a task running longer is failed; 0 = no timeout
    rate: float = 0.0                # dispatches per second (token bucket); 0 = unlimited
    burst: int = 100                 # token bucket size
    max_in_flight: int = 0           # dispatched + running tasks of the type; 0 = unlimited

    def __post_init__(self) -> None:
        for name in ("retry_base", "retry_max"):
            _positive(getattr(self, name), f"scheduler.{name}")
        for name in ("retry_jitter", "running_timeout", "rate"):
            _non_negative(getattr(self, name), f"scheduler.{name}")
        if self.retry_jitter > 1:
            raise ConfigError(f"scheduler.retry_jitter must be between 0 and 1, got {self.retry_jitter!r}")
        _positive(self.burst, "scheduler.burst", integer=True)
        if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int) or self.max_in_flight < 0:
            raise ConfigError(f"scheduler.max_in_flight must be an integer >= 0, got {self.max_in_flight!r}")


@dataclass(frozen=True)
class SchedulerSettings:
    group: str = "pollbridge-scheduler"
    batch_size: int = 500
    block: float = 0.5
    lease_ttl: float = 10.0
    max_deliveries: int = 5
    #: The depth guard: a task whose causation depth (``mapping.columns.depth`` or ``spawned_by``) is past this
    #: is parked for review instead of dispatched. Inert without a depth column in the mapping.
    max_depth: int = 50
    #: The dispatch-count guard: a task whose instance already had this many dispatches is parked for review.
    max_dispatches: int = 10_000
    claim_interval: float = 5.0
    #: A phase for every type, overriding the flags (benchmarks, tests); ``None``: the flags decide per type.
    phase: str | None = None
    defaults: TypeSettings = field(default_factory=TypeSettings)
    types: tuple[tuple[str, TypeSettings], ...] = ()

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_deliveries", "max_depth", "max_dispatches"):
            _positive(getattr(self, name), f"scheduler.{name}", integer=True)
        for name in ("block", "lease_ttl", "claim_interval"):
            _positive(getattr(self, name), f"scheduler.{name}")
        from bridge.core.phases import PHASES

        if self.phase is not None and self.phase not in PHASES:
            raise ConfigError(f"scheduler.phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        _string(self.group, "scheduler.group")
        if any(ch.isspace() for ch in self.group):
            raise ConfigError(f"scheduler.group must not contain whitespace, got {self.group!r}")

    def for_type(self, workflow_type: str | None) -> TypeSettings:
        for name, settings in self.types:
            if name == workflow_type:
                return settings
        return self.defaults


@dataclass(frozen=True)
class RouterSettings:
    """How running processes follow the flags (``[router]``)."""

    #: Seconds between reads of the flag store: a phase change reaches every process within this. On
    #: PostgreSQL a change is notified and read at once; this is then the pace only while the store is
    #: unreadable.
    refresh_interval: float = 1.0
    #: PostgreSQL: seconds between re-reads when no change was notified (a flag row written by hand).
    fallback_interval: float = 30.0
    #: In ``selective``, the poller dispatches a task of a canary instance only once it has been ready this
    #: long (a few seconds above the event path's p99), recording path ``fallback``.
    grace: float = 5.0
    #: In ``cutover``, the safety sweep's interval.
    sweep_interval: float = 300.0

    def __post_init__(self) -> None:
        for name in ("refresh_interval", "fallback_interval", "grace", "sweep_interval"):
            _positive(getattr(self, name), f"router.{name}")


@dataclass(frozen=True)
class GateSettings:
    """What the reconciler must show before a promotion (``[gates]``); per type overridable by flag thresholds."""

    window: float = 3600.0           # seconds of history the gate looks at
    min_tasks: int = 1000            # compared tasks needed
    miss_budget: float = 0.001       # the miss rate's upper confidence bound must be below this
    confidence: float = 0.95
    objective: float = 1.0           # ready -> action latency above this is ``late``
    tolerance: float = 10.0          # a task ready for less than this without an action is ``pending``

    def __post_init__(self) -> None:
        for name in ("window", "objective", "tolerance"):
            _positive(getattr(self, name), f"gates.{name}")
        _positive(self.min_tasks, "gates.min_tasks", integer=True)
        for name in ("miss_budget", "confidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
                raise ConfigError(f"gates.{name} must be between 0 and 1 (exclusive), got {value!r}")


@dataclass(frozen=True)
class GuardianSettings:
    """When the guardian demotes a type to ``polling`` (``[guardian]``)."""

    interval: float = 5.0
    max_outbox_age: float = 60.0     # seconds the oldest unpublished outbox row may wait
    max_lag: int = 10_000            # bus entries not yet consumed, over all partitions
    max_miss_rate: float = 0.01      # fallback dispatches / event-path dispatches over ``window``
    min_tasks: int = 50              # dispatches in the window before the miss rate is judged
    window: float = 300.0

    def __post_init__(self) -> None:
        for name in ("interval", "max_outbox_age", "window"):
            _positive(getattr(self, name), f"guardian.{name}")
        for name in ("max_lag", "min_tasks"):
            _positive(getattr(self, name), f"guardian.{name}", integer=True)
        value = self.max_miss_rate
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise ConfigError(f"guardian.max_miss_rate must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class PreflightSettings:
    """What ``pollbridge preflight`` requires before a phase change (``[preflight]``)."""

    rollback_rehearsal_days: float = 7.0  # a ``rollback`` of the type recorded within this many days
    max_backlog_age: float = 10.0    # seconds the oldest unpublished outbox row may wait
    max_lag: int = 1000              # bus entries not yet delivered to the scheduler's group, over all partitions
    max_dead_letters: int = 0        # dead letters (bus and relay) tolerated
    heartbeat_timeouts: float = 2.0  # a relay or scheduler is alive when it heartbeat within this many lease timeouts

    def __post_init__(self) -> None:
        for name in ("rollback_rehearsal_days", "max_backlog_age", "heartbeat_timeouts"):
            _positive(getattr(self, name), f"preflight.{name}")
        _positive(self.max_lag, "preflight.max_lag", integer=True)
        value = self.max_dead_letters
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"preflight.max_dead_letters must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class ServeSettings:
    """``pollbridge serve`` (``[serve]``): the signal webhook, the SSE feeds, /tasks, /healthz, /metrics."""

    host: str = "127.0.0.1"          # this host only; "0.0.0.0" exposes the service to the network
    port: int = 8470
    #: Shared secret of the signal webhook's HMAC-SHA256 signatures (POLLBRIDGE_SIGNAL_SECRET overrides it);
    #: none: POST /signals answers 503. Never printed (not even in this object's repr).
    signal_secret: str | None = field(default=None, repr=False)
    max_clock_skew: float = 300.0    # seconds a signed timestamp may differ from the server's clock
    sse_buffer: int = 1024           # events waiting for one SSE client before it is dropped as too slow
    sse_keepalive: float = 15.0      # seconds between keep-alive comments on an idle SSE stream

    def __post_init__(self) -> None:
        _string(self.host, "serve.host")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port must be an integer from 0 to 65535, got {self.port!r}")
        if self.signal_secret is not None and (not isinstance(self.signal_secret, str)
                                               or len(self.signal_secret) < 16):
            raise ConfigError("serve.signal_secret must be a string of at least 16 characters")
        for name in ("max_clock_skew", "sse_keepalive"):
            _positive(getattr(self, name), f"serve.{name}")
        _positive(self.sse_buffer, "serve.sse_buffer", integer=True)


@dataclass(frozen=True)
class Settings:
    database_url: str = DEFAULT_DATABASE_URL
    bus_url: str = DEFAULT_BUS_URL
    poller: PollerSettings = field(default_factory=PollerSettings)
    workers: WorkerSettings = field(default_factory=WorkerSettings)
    mapping: TaskTableMapping = field(default_factory=TaskTableMapping)
    bus: BusSettings = field(default_factory=BusSettings)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    relay: RelaySettings = field(default_factory=RelaySettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    gates: GateSettings = field(default_factory=GateSettings)
    guardian: GuardianSettings = field(default_factory=GuardianSettings)
    preflight: PreflightSettings = field(default_factory=PreflightSettings)
    serve: ServeSettings = field(default_factory=ServeSettings)
    legacy: LegacySettings = field(default_factory=LegacySettings)
    config_file: str | None = None

    def __post_init__(self) -> None:
        validate_bus_url(self.bus_url)

    def with_overrides(self, **overrides: Any) -> Settings:
        """A copy with the non-``None`` overrides applied (flags that were not given are ``None``)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    database_url: str | None = None,
    bus_url: str | None = None,
) -> Settings:
    """Build :class:`Settings` from file, environment and flags (flags win)."""
    env = os.environ if environ is None else environ
    path: Path | None
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"configuration file not found: {path}")
    elif env.get(ENV_CONFIG):
        path = Path(env[ENV_CONFIG])
        if not path.is_file():
            raise ConfigError(f"configuration file not found: {path} (from {ENV_CONFIG})")
    else:
        candidate = Path(DEFAULT_CONFIG_FILE)
        path = candidate if candidate.is_file() else None

    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from None
    settings = settings_from_dict(raw)
    if path is not None:
        settings = replace(settings, config_file=str(path))
        install_sql = settings.mapping.install_sql
        if install_sql is not None and not Path(install_sql).is_absolute():
            # Relative to the configuration file, so an integration's folder works from anywhere.
            settings = replace(settings, mapping=replace(settings.mapping,
                                                         install_sql=str(path.parent.resolve() / install_sql)))
    settings = settings.with_overrides(
        database_url=env.get(ENV_DATABASE_URL) or None, bus_url=env.get(ENV_BUS_URL) or None
    )
    if env.get(ENV_CAPTURE_MODE):
        try:
            settings = replace(settings, capture=replace(settings.capture, mode=env[ENV_CAPTURE_MODE]))
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from {ENV_CAPTURE_MODE})") from None
    return settings.with_overrides(database_url=database_url, bus_url=bus_url)


def settings_from_dict(raw: Mapping[str, Any]) -> Settings:
    """Validate the parsed configuration file. Unknown sections or keys are errors, not ignored."""
    known = {"database", "bus", "poller", "workers", "mapping", "capture", "relay", "scheduler", "router", "gates",
             "guardian", "preflight", "serve", "legacy"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown section(s) in configuration: {', '.join(map(repr, unknown))}; "
                          f"expected some of: {', '.join(sorted(known))}")
    database = _table(raw, "database", {"url"})
    bus = _table(raw, "bus", {"url", "partitions", "namespace", "visibility_timeout", "listen"})
    capture = _table(raw, "capture", {"wake", "relay_partitions", "mode"})
    relay = _table(raw, "relay", {f.name for f in fields(RelaySettings)})
    scheduler = _scheduler_settings(raw)
    poller = _table(raw, "poller", {"interval", "batch_size", "running_timeout"})
    workers = _table(raw, "workers", {"concurrency", "min_duration", "max_duration", "failure_rate",
                                      "idle_sleep"})
    router = _table(raw, "router", {f.name for f in fields(RouterSettings)})
    gates = _table(raw, "gates", {f.name for f in fields(GateSettings)})
    guardian = _table(raw, "guardian", {f.name for f in fields(GuardianSettings)})
    preflight = _table(raw, "preflight", {f.name for f in fields(PreflightSettings)})
    serve = _table(raw, "serve", {f.name for f in fields(ServeSettings)})
    legacy = _table(raw, "legacy", {f.name for f in fields(LegacySettings)})
    mapping_raw = raw.get("mapping", {})
    if not isinstance(mapping_raw, Mapping):
        raise ConfigError("[mapping] must be a table")
    try:
        return Settings(
            database_url=_string(database.get("url", DEFAULT_DATABASE_URL), "database.url"),
            bus_url=_string(bus.pop("url", DEFAULT_BUS_URL), "bus.url"),
            bus=BusSettings(**bus),
            capture=CaptureSettings(**capture),
            relay=RelaySettings(**relay),
            scheduler=scheduler,
            poller=PollerSettings(**poller),
            workers=WorkerSettings(**workers),
            router=RouterSettings(**router),
            gates=GateSettings(**gates),
            guardian=GuardianSettings(**guardian),
            preflight=PreflightSettings(**preflight),
            serve=ServeSettings(**serve),
            legacy=LegacySettings(**legacy),
            mapping=TaskTableMapping.from_dict(mapping_raw),
        )
    except (TypeError, ValueError) as exc:  # a wrongly typed value reaching a dataclass
        raise ConfigError(f"invalid configuration value: {exc}") from None


def _scheduler_settings(raw: Mapping[str, Any]) -> SchedulerSettings:
    type_keys = {f.name for f in fields(TypeSettings)}
    section = _table(raw, "scheduler", {f.name for f in fields(SchedulerSettings)})
    try:
        defaults = TypeSettings(**_table(section, "defaults", type_keys)) if "defaults" in section else TypeSettings()
        types_raw = section.pop("types", {})
        if not isinstance(types_raw, Mapping):
            raise ConfigError("[scheduler.types] must be a table of workflow types")
        types = tuple(
            (str(name), replace(defaults, **_table(types_raw, str(name), type_keys)))
            for name in sorted(types_raw)
        )
        section.pop("defaults", None)
        return SchedulerSettings(**section, defaults=defaults, types=types)
    except TypeError as exc:
        raise ConfigError(f"invalid [scheduler] value: {exc}") from None


def _table(raw: Mapping[str, Any], name: str, allowed: set[str]) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{name}] must be a table")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"unknown key(s) in [{name}]: {', '.join(map(repr, unknown))}; "
                          f"expected some of: {', '.join(sorted(allowed))}")
    return dict(value)


def _string(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be a non-empty string")
    return value


def _positive(value: object, what: str, *, integer: bool = False) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"{what} must be a positive {'integer' if integer else 'number'}, got {value!r}")


def _non_negative(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what} must be a number >= 0, got {value!r}")
