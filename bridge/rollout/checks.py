"""The checks of ``pollbridge doctor`` and ``pollbridge preflight``: one result type, one registry.

Each check in :data:`REGISTRY` has a stable snake_case name, a one-line description, the checks it
``needs`` and a function of a :class:`Probe` that returns ``(passed, detail)``. ``doctor`` runs its
selection (:data:`bridge.rollout.doctor.DOCTOR`), ``preflight`` the checks its phase matrix selects
(:data:`bridge.rollout.preflight.CHECKS`); both through :func:`run_checks`, so a check measures and words
the same thing in both.

**Dependencies.** A check runs only when none of its ``needs`` failed in the same run; a need that was
not selected does not hold it back (``preflight`` does not check the mapping, so ``capture_installed``
then says what the reflection of the task table found). What becomes of a held-back check is the
caller's choice: ``report`` (preflight) records it as failed with ``not checked: X failed``, naming the
failed checks at the root; ``omit`` (doctor) leaves it out.

**Failures.** A check may raise: a :class:`PollbridgeError` fails it with its message, a database error
with ``database error: …``, anything else (a bus client error, a timeout) with its type and first line;
URLs in a reason are always masked.

**What the probe is given.** This layer is below the composition root, so the flag store and the way to
open the bus come from the caller (:class:`bridge.app.components.Components` builds both from the
settings); the probe opens the bus once, on first use, and closes it in :meth:`Probe.close`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from bridge.bus.base import EventBus
from bridge.capture.leadership import ADVISORY_NAMESPACE, relay_lock_name
from bridge.capture.wal import capture_state
from bridge.core.errors import PollbridgeError, first_line
from bridge.core.phases import PHASES, Flag, Phase
from bridge.core.settings import Settings
from bridge.core.urls import mask_url
from bridge.db import migrate
from bridge.db.clock import as_utc, db_clock
from bridge.db.engine import check_connection, read_only
from bridge.db.filelock import holder_of, lock_path
from bridge.db.schema import outbox_dead, relay_state
from bridge.flags.store import FlagStore, describe
from bridge.reference.workload import find_cycle
from bridge.rollout.guardian import Guardian
from bridge.rollout.promotion import RANK, evaluate_gate, is_promotion
from bridge.tasktable import usersql
from bridge.tasktable.dispatch import write_blocker, written_columns
from bridge.tasktable.tables import TaskTable, reflect_tables

#: Most task rows the ``dags`` check reads, so it stays quick on a large table.
DAG_CHECK_LIMIT = 200_000

Outcome = tuple[bool, str]
BusOpener = Callable[[], EventBus]
Blocked = Literal["report", "omit"]


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict: ``passed`` with a one-line ``detail`` (the reason when it failed)."""

    name: str
    passed: bool
    detail: str
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail, "description": self.description}


@dataclass(frozen=True)
class Check:
    """One entry of the registry: what it checks, how, and after which other checks."""

    name: str
    description: str
    run: Callable[[Probe], Outcome] = field(repr=False, compare=False)
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Move:
    """What preflight is asked about: moving ``workflow_type`` into ``target`` (at ``percent``)."""

    workflow_type: str
    target: Phase
    percent: float | None = None


class Probe:
    """What the checks of one run share: the engine, the settings, the flag store, and lazily the task
    table, the bus and (for preflight) the type's flag, each opened or read once.

    ``open_bus`` opens the bus (the probe closes it); ``database_label`` names the database in the
    ``database`` check (default: the engine's URL, masked); ``move`` is preflight's question."""

    def __init__(self, engine: Engine, settings: Settings, *, store: FlagStore, open_bus: BusOpener,
                 database_label: str | None = None, move: Move | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.store = store
        self.database_label = database_label if database_label is not None else mask_url(engine.url)
        self._bus_opener = open_bus
        self._move = move
        self._bus: EventBus | None = None
        self._tables: TaskTable | None = None
        self._flag: Flag | None = None

    @property
    def move(self) -> Move:
        if self._move is None:
            raise PollbridgeError("this check needs a workflow type and a target phase (preflight)")
        return self._move

    @property
    def tables(self) -> TaskTable:
        if self._tables is None:
            self._tables = reflect_tables(self.engine, self.settings.mapping)
        return self._tables

    @property
    def flag(self) -> Flag:
        if self._flag is None:
            self._flag = self.store.get(self.move.workflow_type)
        return self._flag

    @property
    def bus(self) -> EventBus:
        if self._bus is None:
            self._bus = self._bus_opener()
        return self._bus

    def guardian(self, *, with_bus: bool) -> Guardian:
        """A guardian for its measurements only (it never acts here)."""
        return Guardian(self.engine, self.settings.guardian, bus=self.bus if with_bus else None,
                        group=self.settings.scheduler.group, store=self.store, registry=CollectorRegistry(),
                        bus_label=mask_url(self.settings.bus_url))

    def close(self) -> None:
        if self._bus is not None:
            self._bus.close()
        self._bus = None


# --- the checks -----------------------------------------------------------------------------------------

def _database(p: Probe) -> Outcome:
    check_connection(p.engine)
    return True, f"connected to {p.database_label}"


def _mapping(p: Probe) -> Outcome:
    m = p.tables.mapping
    source = f"column {m.columns.workflow_type}" if m.columns.workflow_type else (
        f"table {m.instances.table}" if m.instances else "?")
    deps = "JSON column" if m.dependency_mode == "json" else f"edges table {m.edges.table if m.edges else '?'}"
    return True, (f"table {m.table}: {len(m.columns.mapped())} mapped columns found; "
                  f"workflow type from {source}; dependencies in {deps}")


def _integration_sql(p: Probe) -> Outcome:
    m = p.settings.mapping
    if m.install_sql is None:
        return True, "no [mapping] install_sql"
    with p.engine.connect() as conn:
        problems = usersql.problems(conn, m)
    if problems:
        return False, "; ".join(problems)
    return True, f"{m.install_sql}: its check reports no problem"


def _migrations(p: Probe) -> Outcome:
    head = migrate.head_revision()
    current = migrate.current_revision(p.engine)
    if current == head:
        return True, f"at head ({head})"
    if current is None:
        return False, "pollbridge is not installed in this database: run `pollbridge init`"
    return False, f"at {current}, head is {head}: run `pollbridge init` to upgrade"


def _capture(p: Probe) -> Outcome:
    capture = p.settings.capture
    with read_only(p.engine).connect() as conn:
        # With the configured [capture] settings: a capture installed with others is outdated too.
        return capture_state(conn, p.tables, capture.mode, wake=capture.wake,
                             relay_partitions=capture.relay_partitions)


def _dispatch_writable(p: Probe) -> Outcome:
    tt = p.tables
    with read_only(p.engine).connect() as conn:
        blocker = write_blocker(conn, tt)
    if blocker is not None:
        return False, blocker
    written = ", ".join(written_columns(tt))
    if tt.mapping.read_table is None or tt.mapping.read_table == tt.mapping.table:
        return True, f"writes ({written}) go to table {tt.mapping.table}"
    return True, f"writes ({written}) go through the view {tt.mapping.read_table}, updatable for each"


def _dags(p: Probe) -> Outcome:
    tt = p.tables
    deps: dict[str, dict[str, list[str]]] = defaultdict(dict)
    rows: Sequence[Any]
    with read_only(p.engine).connect() as conn:
        if tt.mapping.dependency_mode == "json":
            q = sa.select(tt.col("instance_id"), tt.col("task_key"), tt.col("depends_on")).limit(DAG_CHECK_LIMIT)
            rows = conn.execute(q).all()
            for instance_id, key, raw in rows:
                value = json.loads(raw) if isinstance(raw, str) else (raw or [])
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    return False, (f"instance {instance_id!r} task {key!r}: dependencies are not a JSON array "
                                   "of task keys")
                deps[str(instance_id)][str(key)] = value
        elif tt.mapping.dependency_mode == "keys":
            # Edges between key-column values of one definition (e.g. a DAG version): the graph of an
            # instance is over its rows' key-column values (several rows may share one: mapped tasks).
            edges = tt.mapping.edges
            assert tt.edges is not None and edges is not None and edges.task_key and edges.depends_on_key
            e = tt.edges
            key_col = tt.tasks.c[tt.mapping.dependency_key_column]
            q = (sa.select(tt.col("instance_id"), key_col, e.c[edges.depends_on_key])
                 .select_from(tt.tasks.outerjoin(e, sa.and_(e.c[edges.task_key] == key_col,
                                                            *(e.c[m] == tt.tasks.c[m] for m in edges.match))))
                 .limit(DAG_CHECK_LIMIT))
            rows = conn.execute(q).all()
            for instance_id, key, dep_key in rows:
                entry = deps[str(instance_id)].setdefault(str(key), [])
                if dep_key is not None and str(dep_key) not in entry:
                    entry.append(str(dep_key))
        else:
            assert tt.edges is not None and tt.mapping.edges is not None
            e = tt.edges
            dep = tt.tasks.alias("pb_dep")
            q = (sa.select(tt.col("instance_id"), tt.col("task_key"), tt.col("task_key", dep),
                           tt.col("instance_id", dep))
                 .select_from(tt.tasks.outerjoin(e, e.c[tt.mapping.edges.task_id] == tt.col("id"))
                              .outerjoin(dep, tt.col("id", dep) == e.c[tt.mapping.edges.depends_on_id]))
                 .limit(DAG_CHECK_LIMIT))
            rows = conn.execute(q).all()
            row: Any
            for row in rows:
                instance_id, key, dep_key, dep_instance = row
                entry = deps[str(instance_id)].setdefault(str(key), [])
                if dep_key is not None:
                    if dep_instance != instance_id:
                        return False, (f"instance {instance_id!r} task {key!r} depends on a task of another "
                                       f"instance ({dep_instance!r})")
                    entry.append(str(dep_key))
    problems = []
    for instance_id, graph in deps.items():
        for key, wanted in graph.items():
            for d in wanted:
                if d not in graph:
                    problems.append(f"instance {instance_id!r}: task {key!r} depends on unknown task key {d!r}")
        cycle = find_cycle(graph)
        if cycle:
            problems.append(f"instance {instance_id!r}: dependency cycle {' -> '.join(cycle)}")
    scanned = sum(len(g) for g in deps.values())
    capped = " (first rows only)" if len(rows) >= DAG_CHECK_LIMIT else ""
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return False, "; ".join(problems[:3]) + more
    return True, f"{len(deps)} instances, {scanned} tasks checked{capped}: no cycle, no unknown key"


def _bus(p: Probe) -> Outcome:
    url = mask_url(p.settings.bus_url)
    try:
        p.bus.epoch()
    except (PollbridgeError, SQLAlchemyError):
        raise
    except Exception as exc:  # any client error (refused, TLS, auth, timeout): the check fails with the reason
        return False, f"cannot reach the bus {url}: {_reason(exc)}"
    placement = p.bus.placement()
    where = "" if placement is None else f", on {len(set(placement.values()))} cluster primaries"
    return True, f"{url} reachable ({p.settings.bus.partitions} partitions{where})"


def _age(now: datetime, then: datetime) -> str:
    return f"{max(0.0, (now - then).total_seconds()):.1f} s ago"


def _relay_alive(p: Probe) -> Outcome:
    s = p.settings
    partitions = s.capture.relay_partitions
    rs = relay_state.c
    with read_only(p.engine).connect() as conn:
        rows = {int(r.relay_partition): r for r in conn.execute(
            sa.select(rs.relay_partition, rs.holder, rs.heartbeat_at).where(rs.relay_partition < partitions))}
        if p.engine.dialect.name == "postgresql":
            # The relay holds a session advisory lock (ADVISORY_NAMESPACE, partition) for as long as it lives: a
            # dead relay's connection closes and releases it at once. (Its relay_state row is written when it
            # takes the lock, not renewed while it holds it.)
            held = set(conn.execute(sa.text(
                "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = :ns "
                "AND objsubid = 2 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
                {"ns": ADVISORY_NAMESPACE}).scalars())
            conn.rollback()
            return _relay_locks(rows, partitions, lambda part: "" if part in held else None, "lock")
    if lock_path(p.engine, relay_lock_name(0)) is not None:
        # SQLite on a file: the relay holds its partition's lock file for as long as it lives (the kernel
        # releases it when the process dies) and touches it at every leadership check (lease_timeout / 2): a
        # holder that stopped touching it is stuck. Its relay_state row is written when it takes the lock.
        limit = s.preflight.heartbeat_timeouts * s.relay.lease_timeout
        now = datetime.now(UTC)
        stuck: list[str] = []

        def file_holder(part: int) -> str | None:
            path = lock_path(p.engine, relay_lock_name(part))
            holder = holder_of(path) if path is not None else None
            if holder is not None and (now - holder.touched_at).total_seconds() > limit:
                stuck.append(f"partition {part}: held by {holder.name or 'unknown'}, whose last heartbeat (its "
                             f"lock file's time) was {_age(now, holder.touched_at)}, older than {limit:g} s: "
                             "the relay is stuck")
            return None if holder is None else holder.name

        passed, detail = _relay_locks(rows, partitions, file_holder, "lock file")
        return (False, "; ".join(stuck)) if stuck else (passed, detail)
    # SQLite in memory: a lease row renewed every lease_timeout / 2 with the host's UTC clock.
    limit = s.preflight.heartbeat_timeouts * s.relay.lease_timeout
    now = datetime.now(UTC)
    alive, dead = [], []
    for part in range(partitions):
        row = rows.get(part)
        beat = as_utc(row.heartbeat_at) if row is not None else None
        if row is None or row.holder is None or beat is None:
            dead.append(f"partition {part}: no relay holds it (start `pollbridge relay run --partition {part}`)")
        elif (now - beat).total_seconds() > limit:
            dead.append(f"partition {part}: last heartbeat {_age(now, beat)} by {row.holder}, "
                        f"older than {limit:g} s: the relay is down or stuck")
        else:
            alive.append(f"partition {part} held by {row.holder}, heartbeat {_age(now, beat)}")
    return (False, "; ".join(dead)) if dead else (True, "; ".join(alive))


def _relay_locks(rows: dict[int, Any], partitions: int, holder_of_lock: Callable[[int], str | None],
                 lock: str) -> Outcome:
    """Every partition's relay is alive when it holds the partition's lock (``holder_of_lock``: the name the
    lock gives, "" when it gives none; None when nobody holds it); the relay_state row says who and since when."""
    alive, dead = [], []
    for part in range(partitions):
        row = rows.get(part)
        holder = holder_of_lock(part)
        if holder is not None:
            name = holder or (row.holder if row is not None and row.holder else "unknown")
            since = as_utc(row.heartbeat_at) if row is not None else None
            taken = f" since {since.isoformat(timespec='seconds')}" if since else ""
            alive.append(f"partition {part} held by {name}{taken}")
        else:
            last = f" (last holder {row.holder})" if row is not None and row.holder else ""
            dead.append(f"partition {part}: no relay holds its {lock}{last}: the relay is down "
                        f"(start `pollbridge relay run --partition {part}`)")
    return (False, "; ".join(dead)) if dead else (True, "; ".join(alive))


def _scheduler_alive(p: Probe) -> Outcome:
    from event_scheduler.leases import lease_snapshot

    s = p.settings
    limit = s.preflight.heartbeat_timeouts * s.scheduler.lease_ttl
    # Where the leases are: beside a Redis bus (its clock), else in the database (the hosts' UTC clocks).
    snap = lease_snapshot(p.engine, p.bus)
    now = snap.now
    live = snap.live_members(limit)
    if not snap.members and snap.locks:
        return False, ("no scheduler process holds a member lock file beside the database: "
                       "start `pollbridge scheduler run`")
    if not live:
        newest = max(snap.members.values(), default=None)
        seen = f"the last heartbeat was {_age(now, newest)}" if newest else "no scheduler process is registered"
        return False, (f"no scheduler process heartbeat within {limit:g} s ({seen}): "
                       "start `pollbridge scheduler run`")
    wanted = s.bus.partitions
    orphaned = sorted(set(range(wanted)) - snap.held_by(live))
    figures = f"{len(live)} live scheduler process(es), newest heartbeat {_age(now, max(live.values()))}"
    if orphaned:
        return False, (f"{figures}, but bus partition(s) {', '.join(map(str, orphaned))} of {wanted} have no live "
                       "consumer (a process died and its leases have not been taken over yet)")
    return True, f"{figures}, holding all {wanted} bus partitions"


def _outbox_backlog(p: Probe) -> Outcome:
    limit = p.settings.preflight.max_backlog_age
    unpublished, age, _ = p.guardian(with_bus=False).outbox_age()
    detail = (f"{unpublished} unpublished outbox row(s), the oldest {age:.1f} s old "
              f"({'within' if age <= limit else 'above'} max_backlog_age {limit:g} s)")
    if age > limit:
        detail += ": the relay is not keeping up, or not publishing"
    return age <= limit, detail


def _consumer_lag(p: Probe) -> Outcome:
    limit = p.settings.preflight.max_lag
    partitions, detail = p.guardian(with_bus=True).lag()
    if partitions is None:
        return False, f"lag unknown: {detail}"
    lag = sum(partitions.values())
    return lag <= limit, f"{detail} ({'within' if lag <= limit else 'above'} max_lag {limit})"


def _dead_letters(p: Probe) -> Outcome:
    from bridge.reconcile.status import dead_letter_count

    limit = p.settings.preflight.max_dead_letters
    on_bus = dead_letter_count(p.bus)
    with read_only(p.engine).connect() as conn:
        relay = int(conn.execute(sa.select(sa.func.count()).select_from(outbox_dead)).scalar_one())
    total = on_bus + relay
    detail = (f"{on_bus} dead letter(s) on the bus, {relay} set aside by the relay "
              f"({'within' if total <= limit else 'above'} max_dead_letters {limit})")
    if total > limit:
        detail += ": see `pollbridge dlq list`, then `pollbridge dlq replay` or `pollbridge dlq purge`"
        if relay:
            detail += "; the relay's are in pollbridge_outbox_dead"
    return total <= limit, detail


def _reconciler_gate(p: Probe) -> Outcome:
    flag = p.flag
    move = p.move
    change = f"{describe(flag)} -> {describe(Flag(flag.workflow_type, move.target, move.percent))}"
    if RANK[move.target] > RANK[flag.phase] + 1:
        step = PHASES[RANK[flag.phase] + 1]
        return False, f"{change} skips a step: `flags set` promotes one step at a time (next: {step})"
    if not is_promotion(flag, move.target, move.percent):
        return True, f"{change} is not a promotion: `flags set` applies no gate"
    gate = evaluate_gate(p.engine, p.tables, flag, move.target, p.settings.gates)
    criteria = "; ".join(f"{c.name} {'ok' if c.passed else 'FAILED'} ({c.detail})" for c in gate.criteria)
    return gate.passed, f"gate {change}: {criteria}"


def _rollback_rehearsed(p: Probe) -> Outcome:
    days = p.settings.preflight.rollback_rehearsal_days
    workflow_type = p.move.workflow_type
    last = as_utc(p.store.last_rollback(workflow_type))
    if last is None:
        return False, (f"no rollback of {workflow_type} was ever recorded: rehearse one "
                       f"(`pollbridge rollback {workflow_type} --reason rehearsal`)")
    age_days = max(0.0, (db_clock(p.engine) - last).total_seconds()) / 86400
    when = f"last rollback {last.isoformat(timespec='seconds')} ({age_days:.1f} day(s) ago)"
    if age_days > days:
        return False, f"{when}, older than rollback_rehearsal_days {days:g}: rehearse it again"
    return True, f"{when}, within rollback_rehearsal_days {days:g}"


#: Every check, by name.
REGISTRY: dict[str, Check] = {c.name: c for c in (
    Check("database", "the database is reachable", _database),
    Check("mapping", "the mapping matches the real tables and columns", _mapping, ("database",)),
    Check("install_sql", "the mapping's own SQL (install_sql) reports no problem", _integration_sql,
          ("database", "mapping")),
    Check("migrations", "pollbridge's schema is at the migration head", _migrations, ("database",)),
    Check("capture_installed", "the capture triggers are on the task table (not a view), enabled, and what the "
          "mapping generates", _capture, ("database", "mapping")),
    Check("dispatch_writable", "pollbridge's writes (dispatch, skip, retry) reach the task table, through the "
          "read view when there is one", _dispatch_writable, ("database", "mapping")),
    Check("dags", "the workflows in the task table are DAGs (no cycle, no unknown task key)", _dags,
          ("database", "mapping")),
    Check("bus", "the event bus is reachable", _bus),
    Check("relay_alive", "every relay partition has a live relay (its lock held, its heartbeat fresh)", _relay_alive,
          ("database", "migrations")),
    Check("scheduler_alive", "a scheduler process has a fresh heartbeat and every bus partition a consumer",
          _scheduler_alive, ("database", "migrations", "bus")),
    Check("outbox_backlog", "the oldest unpublished outbox row is younger than max_backlog_age", _outbox_backlog,
          ("database", "migrations")),
    Check("consumer_lag", "the scheduler's consumer lag is at most max_lag", _consumer_lag, ("bus",)),
    Check("dead_letters", "dead letters (bus and relay) are at most max_dead_letters", _dead_letters,
          ("database", "migrations", "bus")),
    Check("reconciler_gate", "the promotion gate `flags set` applies to this step passes", _reconciler_gate,
          ("database", "migrations")),
    Check("rollback_rehearsed", "a rollback of the type was rehearsed within rollback_rehearsal_days",
          _rollback_rehearsed, ("database", "migrations")),
)}


# --- running them ---------------------------------------------------------------------------------------

def _reason(exc: BaseException) -> str:
    return mask_url(first_line(exc))


def run_one(check: Check, probe: Probe) -> CheckResult:
    """Run one check; whatever it raises becomes its failure (see the module docstring)."""
    try:
        passed, detail = check.run(probe)
    except PollbridgeError as exc:
        passed, detail = False, str(exc)
    except SQLAlchemyError as exc:
        passed, detail = False, f"database error: {_reason(exc)}"
    except Exception as exc:  # a bus client error, a timeout: the check fails with the reason, masked
        passed, detail = False, f"{type(exc).__name__}: {_reason(exc)}"
    return CheckResult(check.name, passed, detail, check.description)


def run_checks(selected: Sequence[Check], probe: Probe, *, blocked: Blocked = "report") -> list[CheckResult]:
    """Run ``selected`` in order, holding back a check whose ``needs`` failed (``blocked``: report or omit it)."""
    results: list[CheckResult] = []
    roots: dict[str, list[str]] = {}  # failed or held-back check -> the failed checks at the root of it
    for check in selected:
        held: list[str] = []
        for need in check.needs:
            held += [root for root in roots.get(need, []) if root not in held]
        if held:
            roots[check.name] = held
            if blocked == "report":
                results.append(CheckResult(check.name, False, f"not checked: {', '.join(held)} failed",
                                           check.description))
            continue
        result = run_one(check, probe)
        if not result.passed:
            roots[check.name] = [check.name]
        results.append(result)
    return results
