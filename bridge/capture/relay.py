"""The outbox relay: unpublished outbox rows → events on the bus, at least once, in batches.

Each cycle takes up to ``batch_size`` unpublished rows of its partition with ``FOR UPDATE SKIP
LOCKED``, publishes them (one pipelined round trip) and marks them published in the same
transaction, only after the bus acknowledged. Rows are selected by ``published_at IS NULL``, never
above a high-water id, so a row whose transaction committed after larger ids were published is
still found on the next cycle. A crash between publish and commit republishes the batch: the
duplicates carry the same event id and consumers dedupe on it.

A malformed row (missing ids, an unknown change, a stored status value the mapping does not know at
all) is moved to ``pollbridge_outbox_dead`` with the reason and the relay carries on. A NULL status and a
value the mapping declares (a logical status, ``skipped`` or a pass-through ``other`` value) are published:
an event only says which instance to look at, and the scheduler reads the row through the mapping.

Bus loss: every ``epoch_check_interval`` the relay compares the bus epoch with the one it stored;
when it changed (Redis flushed or restarted without persistence) it marks every row published within
the retention window unpublished again, so they are republished. Changes older than the retention
window are not replayed: the scheduler's catch-up from the database and the poller fallback cover them.

With capture triggers on PostgreSQL and a bus apart from the database, the event of a notifying change also rides in
its notification and is published as soon as it is heard (:meth:`Relay._publish_notices`); the claim then only marks
its row, and waits (:func:`mark_delay`, 1 to 1.5 s) so that one claim marks a trickle's rows. The row stays
unpublished until then, so at least once holds as above.

The statements are built in :mod:`bridge.capture.queries`; the relay only runs them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Connection, Engine

from bridge.bus.base import EventBus, partition_for
from bridge.capture.evidence import record_foreign_dispatches
from bridge.capture.leadership import Leadership, ensure_state_row, leadership_for
from bridge.capture.metrics import RelayMetrics
from bridge.capture.outbox import Backlog, read_backlog
from bridge.capture.queries import (
    ARM_HORIZON_SQL,
    EVENT_NOTICE,
    EVENT_WINDOW,
    HORIZON_PASSED_SQL,
    REASSERT_ARMED_SQL,
    RelayQueries,
)
from bridge.capture.queries import event_payload_sql as event_payload_sql  # re-exported: tests import it here
from bridge.capture.triggers import (
    CAPTURE_CHANGED,
    NOTIFY_CHANNEL,
    installed_triggers,
    is_quiet,
    loud_first,
    quiet_statuses,
)
from bridge.core.backoff import Backoff
from bridge.core.errors import first_line
from bridge.core.events import TASK_CHANGES, CloudEvent, EventFormatError, change_event_type, encoded_event
from bridge.core.idle import idle_poll
from bridge.core.mapping import StatusValues, TaskTableMapping
from bridge.core.settings import RelaySettings, WakeMode
from bridge.core.urls import mask_url
from bridge.db.changes import changes_of
from bridge.db.clock import as_utc
from bridge.db.engine import discard, finds_a_row, read_only
from bridge.db.listen import ListenWaiter, Waiter
from bridge.db.schema import relay_state

log = logging.getLogger(__name__)

CHANGES = TASK_CHANGES
#: How often the embedded relay (SQLite, no NOTIFY) probes an idle outbox.
EMBEDDED_IDLE_PROBE = 0.02
#: The window over which the relay measures its change rate (``adaptive``: notify or poll).
RATE_WINDOW = 1.0
#: At most this many ids of notified events waiting for the claim that marks them (more are ids another relay
#: claimed; forgetting one costs a duplicate publish at most).
NOTICED_LIMIT = 10_000
#: Seconds a row whose event went out from its notification may wait for the claim that marks it published, so
#: that one claim marks every such row of a trickle: at 2 completions/s a claim per completion was a third of the
#: event path's transactions. A change whose notification carried no event (folded into its transaction's first,
#: behind an unpublished row of its instance, too large), anything else heard, or a notice left to the claim makes
#: the claim come at once. The cost of waiting: a crash or a takeover in between publishes those events again
#: (duplicates, same ids), and quiet rows (dispatches) wait up to this long (times 1 + MARK_SPREAD) for their publish.
MARK_AFTER = 1.0
#: The marking claim's timer is drawn from ``MARK_AFTER`` to ``(1 + MARK_SPREAD) * MARK_AFTER``: a fixed second kept
#: step with a load at a steady rate (2 completions/s in ``bench.cost``: every other completion's notification came as
#: the marking claim began, and waited for it).
MARK_SPREAD = 0.5
#: At most this many rows published from their notifications wait for the claim that marks them: the claim comes at
#: once at the next. Without it, at 100 completions/s a claim came only when a notice fell outside EVENT_WINDOW (every
#: ~30 completions), that completion's event with it, and with it the window's quiet rows in one burst: p99 3.5 ms
#: became 6.1 to 6.4 (``bench.cost``, alternating runs, 2026-12-07).
MARK_LIMIT = 16


def mark_delay() -> float:
    """Seconds until the claim that marks rows published from their notifications (:data:`MARK_SPREAD`)."""
    return MARK_AFTER * (1.0 + MARK_SPREAD * random.random())


def row_to_event(row: Any, statuses: StatusValues | None) -> CloudEvent:
    """Build the CloudEvent for an outbox row; :class:`EventFormatError` says why a row is unusable."""
    for column in ("task_id", "instance_id", "task_key"):
        if getattr(row, column) in (None, ""):
            raise EventFormatError(f"outbox row {row.id}: {column} is empty")
    if row.change not in CHANGES:
        raise EventFormatError(f"outbox row {row.id}: unknown change {row.change!r}; expected {', '.join(CHANGES)}")
    if statuses is not None:
        for column in ("old_status", "new_status"):
            value = getattr(row, column)
            # NULL is published whatever the mapping says of it: the event only names the instance to look at.
            if value is not None and not statuses.known(value):
                raise EventFormatError(f"outbox row {row.id}: unknown {column} {value!r}; the mapping's status "
                                       f"values are {describe_statuses(statuses)}")
    created = as_utc(row.created_at) or datetime.now(UTC)
    data: dict[str, Any] = {
        "task_id": row.task_id,
        "instance_id": row.instance_id,
        "workflow_type": row.workflow_type,
        "task_key": row.task_key,
        "old_status": row.old_status,
        "new_status": row.new_status,
        "change": row.change,
        "version": row.id,
    }
    attempt = getattr(row, "attempt", None)
    if attempt is not None:
        data["attempt"] = attempt
    return CloudEvent(
        id=row.event_id,
        type=change_event_type(row.change),
        subject=row.task_id,
        partitionkey=row.instance_id,
        time=created,
        traceid=row.trace_id,
        depth=_depth(getattr(row, "depth", None)),
        data=data,
    )


def publishable(task_id: object, instance_id: object, task_key: object, change: object, new_status: object,
                old_status: object, valid: Collection[object] | None) -> bool:
    """The quick form of :func:`row_to_event`'s checks, for the claim's rows and the notified events alike (an event
    published before its claim must never be one the claim would dead-letter); ``valid``: the mapping's stored
    status values (None: any)."""
    return bool(task_id and instance_id and task_key and change in CHANGES
                and (valid is None or ((new_status is None or new_status in valid)
                                       and (old_status is None or old_status in valid))))


def _depth(value: Any) -> int:
    """The captured causation depth (``mapping.columns.depth``); 0 when not mapped, NULL or negative."""
    return value if isinstance(value, int) and value > 0 else 0


def _with_depth(payload: str, depth: int) -> str:
    """The event JSON with its ``depth`` attribute set (only for a depth above 0: the payload has 0 already)."""
    if depth <= 0:
        return payload
    event = json.loads(payload)
    event["depth"] = depth
    return json.dumps(event, separators=(",", ":"))


class RateWindow:
    """Rows claimed per second, over windows of :data:`RATE_WINDOW` seconds: whether the relay is busy."""

    def __init__(self) -> None:
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.start, self.rows = now, 0
        #: The rate of the last complete window.
        self.rate = 0.0

    def add(self, rows: int, now: float) -> None:
        self.rows += rows
        self._roll(now)

    def _roll(self, now: float) -> None:
        elapsed = now - self.start
        if elapsed >= RATE_WINDOW:
            self.rate = self.rows / elapsed
            self.start, self.rows = now, 0

    def busy(self, now: float, limit: float) -> bool:
        """Whether the rate is above ``limit``: the last window's, or already this window's rows alone (a burst
        is seen within its first ``limit`` rows, not a window later)."""
        self._roll(now)
        return self.rate > limit or self.rows > limit * RATE_WINDOW


def describe_statuses(statuses: StatusValues) -> str:
    """Every stored value the mapping knows, by logical status (for a dead letter's reason)."""
    parts = []
    for name in (*statuses.names(), "other"):
        values = statuses.of(name)
        if values:
            parts.append(f"{name} = " + ", ".join("NULL" if v is None else repr(v) for v in values))
    return "; ".join(parts)


#: Rows unpublished per statement after one bus partition's loss (a bounded IN list).
_REQUEUE_CHUNK = 500


def parse_epochs(stored: str | None) -> dict[int, str]:
    """The per-partition epochs a relay stored (JSON ``{"0": token, ...}``); ``{}`` for nothing stored or a
    single token stored before migration 0011 (compared with nothing: stored again, not replayed)."""
    if not stored:
        return {}
    try:
        raw = json.loads(stored)
    except ValueError:
        return {}
    if not isinstance(raw, dict):
        return {}
    return {int(p): str(t) for p, t in raw.items() if str(p).isdigit()}


class Relay:
    def __init__(
        self,
        engine: Engine,
        bus: EventBus,
        settings: RelaySettings,
        *,
        statuses: StatusValues | None = None,
        partition: int = 0,
        wake: WakeMode = "adaptive",
        registry: CollectorRegistry | None = None,
        leadership: Leadership | None = None,
        foreign: TaskTableMapping | None = None,
        depth_of: Callable[[Connection, list[str]], dict[str, int]] | None = None,
    ) -> None:
        self.engine = engine
        #: The mapping of a scheduler pollbridge did not write (``[legacy] kind = "foreign"``): its dispatches
        #: are recorded from the captured transitions, in the transaction that marks them published.
        self.foreign = foreign
        #: ``mapping.columns.spawned_by``: the causation depth of captured tasks, by task id (one query a batch).
        self.depth_of = depth_of
        self.bus = bus
        self.settings = settings
        self.statuses = statuses
        self.partition = partition
        self.wake = wake
        self.metrics = RelayMetrics(registry if registry is not None else CollectorRegistry())
        self.leadership = leadership or leadership_for(engine, partition, settings.lease_timeout)
        self.pg = engine.dialect.name == "postgresql"
        #: The bus's epochs as last stored, per bus partition (None: not read yet).
        self._epochs: dict[int, str] | None = None
        self._armed = False
        #: Set while this relay holds its partition. The write-ahead log's stream of partition 0 runs only then
        #: (:func:`bridge.capture.wal.stream_when_installed`): one process does the partition's whole work.
        self.leading = threading.Event()
        #: Cleared while publishing is paused (the bus near its memory limit, ``relay.max_bus_memory``): the
        #: write-ahead log's stream pauses with it.
        self.publishing = threading.Event()
        self.publishing.set()
        #: PostgreSQL: whether capture triggers are installed, as read when the listener (re)connected and at each
        #: notification that capture changed (None: not read yet, taken as yes). Without them (the write-ahead
        #: log captures) a row reaches the outbox unpublished only with a notification (a review release) or by
        #: this relay's own hand (a bus-loss requeue): the listening relay then has no timer probe at all.
        self._triggers: bool | None = None
        #: ``adaptive``: the first transaction id not started when the relay last armed, until every
        #: transaction before it has ended (:meth:`_idle_listening`).
        self._horizon: str | None = None
        self._unsafe_wait = settings.poll_interval
        self._rate = RateWindow()
        #: Whether the loop's next cycle looks at the outbox (False after a wait only housekeeping ended).
        self._look = True
        #: When an idle relay probes on its own next (monotonic; None: not idle).
        self._probe_at: float | None = None
        #: SQLite: this process's signal of commits to the database file (bridge.db.changes), and its
        #: generation when the relay last looked.
        self._changes = changes_of(engine, "data")
        self._seen = 0
        #: SQLite: a commit about data woke the idle relay; the next cycle claims without looking first.
        self._claim_next = False
        # PostgreSQL: the backlog gauges are due, to be read inside the next claim's transaction (a statement,
        # not a transaction of its own: measured at 2 completions/s over 60 s, 3.03 transactions per completion
        # against 3.08 with the probe); if no claim comes before the next purge time, the probe reads them alone.
        self._backlog_due = False
        # The loop's connection, kept while run() runs: a pool checkout per cycle would add the pool's
        # pre-ping, a statement per idle second.
        self._conn: Connection | None = None
        # When the oldest published row this relay keeps passes the retention window (monotonic time;
        # None: it keeps none, so nothing can be due until it publishes again). An idle relay so does
        # not ask the database every purge_interval whether anything expired.
        self._purge_due: float | None = 0.0
        #: Set by the write-ahead log's stream (another thread: :meth:`note_captured`) when it wrote rows; the
        #: relay's own thread turns it into a due purge, so ``_purge_due`` has one writer.
        self._log_wrote = False
        self._labels = {"partition": str(partition)}
        # The SQL, built once for this partition (bridge.capture.queries); the relay only runs it.
        self.queries = RelayQueries.build(engine.dialect, partition, settings.batch_size)
        # SQLite: every claim is a write transaction, and one process at a time holds the write lock; reads
        # (the peek before a claim, the backlog probe) go through a deferred, lock-free transaction.
        self._reader = None if self.pg else read_only(engine)
        self._valid_statuses = statuses.values() if statuses is not None else None
        #: Status values whose changes notify no one (the trigger's quiet_statuses), and how many of the last
        #: claim's rows were not such changes: only those count towards ``notify_max_rate``.
        self._quiet = frozenset(quiet_statuses(statuses)) if statuses is not None else frozenset()
        self._loud = 0
        #: The events published from their notifications (:meth:`_publish_notices`), outbox id → event id: the
        #: claim that marks such a row published does not publish it again. Both must match: anyone who can connect
        #: can NOTIFY, and a made-up notice must not make the claim skip a real row (its event id is a random UUID
        #: only those who can read the outbox know).
        self._noticed: dict[int, str] = {}
        #: The largest outbox id a committed claim of this relay took: a notice of a row at or below it is most likely
        #: stale (read after the claims of a busy spell took its row; or a transaction's that committed late, whose
        #: row the next claim takes), and is left to the claim.
        self._claimed_to = 0
        #: When the claim that marks the rows published from their notifications is due (:data:`MARK_AFTER` after
        #: the first of them), or None: no such row waits.
        self._mark_due: float | None = None
        #: How many rows published from their notifications the claim that marks them is waiting for.
        self._unmarked = 0
        #: Whether a notified event may be published before the claim: the bus publishes apart from the claim's
        #: transaction, and the event needs nothing the claim adds (the causation depth read from the chain).
        self._notices = self.pg and not bus.in_database and depth_of is None
        ensure_state_row(engine, partition)

    # --- one batch ----------------------------------------------------------------------------------
    def publish_batch(self) -> int:
        """Publish up to one batch; return the number of outbox rows handled (published or dead-lettered)."""
        self._mark_due, self._unmarked = None, 0  # it marks them (or, failing, the loop's retry does)
        with self._begin() as conn:
            # Claim and mark in one statement; if publishing fails the transaction rolls back and
            # the rows are unpublished again.
            rows = self.queries.claim_run.all(conn, {})  # once per cycle: straight to the driver
            if self._backlog_due:  # what is left after this claim (its own rows read as published)
                self._backlog_due = False
                self._gauge(read_backlog(conn, self.partition))
            if self._changes is not None:
                # SQLite, holding the write lock: every commit before this one is in the claim, so only a
                # commit after it may wake the relay to claim again (taken before the lock, the generation let a
                # commit the claim took wake it for an empty one).
                self._seen = self._changes.generation
            if not rows:
                self._loud = 0
                return 0
            quiet = self._quiet
            loud = [r.instance_id for r in rows if not is_quiet(r.change, r.new_status, quiet)]
            self._loud = len(loud)
            rows = loud_first(rows, set(loud))
            good: list[Any] = []
            dead: list[tuple[Any, str]] = []
            valid = self._valid_statuses
            for row in rows:
                if publishable(row.task_id, row.instance_id, row.task_key, row.change, row.new_status, row.old_status,
                               valid):
                    good.append(row)
                    continue
                try:  # the slow path says exactly what is wrong
                    row_to_event(row, self.statuses)
                    raise EventFormatError(f"outbox row {row.id}: not publishable")
                except EventFormatError as exc:
                    dead.append((row, str(exc)))
            depths: dict[str, int] = {}
            if self.depth_of is not None and good:
                # ``mapping.columns.spawned_by``: the capture trigger cannot know the depth (a walk up the chain
                # inside the scheduler's write); one query per batch here, and the events carry it.
                depths = self.depth_of(conn, [str(r.task_id) for r in good])
            fresh = good  # the rows whose events this claim publishes
            if self._noticed:  # published from their notifications already: marked here, not published again
                noticed = self._noticed
                fresh = [r for r in good if noticed.get(r.id) != r.event_id]
                for r in rows:
                    noticed.pop(r.id, None)
            events: list[CloudEvent] = [
                encoded_event(r.event_id, r.instance_id, r.task_id,
                              _with_depth(r.payload, depths.get(str(r.task_id), 0)) if depths else r.payload)
                for r in fresh]
            if self.foreign is not None and good:
                # Before the publish: a database error here happens before anything reached the bus.
                record_foreign_dispatches(conn, self.foreign, good)
            if events:
                self.bus.publish_in(conn, events)
            if dead:
                conn.execute(self.queries.dead_letter(), [
                    {"outbox_id": r.id, "reason": reason, "payload": _row_json(r),
                     "created_at": datetime.now(UTC)} for r, reason in dead])
                conn.execute(self.queries.delete_rows([r.id for r, _ in dead]))
        # Once committed: a claim rolled back leaves its rows unpublished, ahead of any early event of their instances.
        self._claimed_to = max(self._claimed_to, max(r.id for r in rows))
        self._record(good, len(dead), fresh)
        return len(rows)

    def _heard_meanwhile(self, waiter: Waiter) -> None:
        """Before a purge and before the claim decision, when no claim is owed (the relay woke for a timer: the
        marking claim, the bus epoch's check, a purge): a notification that came since the last wait is handled as a
        wake-up is (:meth:`_after_wait`), its event published first. Read only after that work, it waited for all of
        it: ``bench.cost`` at 2 completions/s (strace, 2026-12-07) traced a completion whose notification came during
        the epoch check and waited for the marking claim and the backlog probe too, 10 ms, the window's slowest
        dispatch. One non-blocking read of the listener's socket.

        When a claim is owed already (a fresh LISTEN, a bus-loss replay, a full batch, the idle probe, a notice left to
        the claim) nothing is published here: that claim comes first and takes the notified rows with the rest, in
        their order (a notified event published ahead of a replay would overtake its instance's replayed rows); what
        was heard is dropped with the next wait's payloads, as a notice of a row already claimed would be."""
        if self._look or not waiter.hear_pending():
            return
        self._look = True  # a notice left to the claim (or anything else heard) is claimed now
        self._publish_notices(waiter)

    def _publish_notices(self, waiter: Waiter) -> None:
        """Publish the events the capture trigger sent in its notifications (``send_event``: the first notifying
        change of each transaction) at once, before the claim that marks their rows published.

        At a trickle this takes the claim's two round trips (its ``BEGIN`` and its statement) out of the path
        from a completion's commit to the dispatch it makes possible. At least once still holds: the outbox
        row stays unpublished until the claim marks it, so a publish lost here (a failure, a crash before the
        claim) is made again by the claim, a duplicate with the same event id. A notice this relay cannot use
        (another partition's, unreadable, a row the claim would dead-letter) is left to the claim, and so is one
        of a row a claim may have taken already (at or below the largest id claimed: a notice read after a busy
        spell's claims, or a late commit's), and one more than :data:`EVENT_WINDOW` ids above it (the trigger
        looked for an earlier unpublished row of the instance only that far back, and rows further back may wait
        for the claim: a relay just started, another partition's writes in between); leaving one to the claim only
        costs its latency."""
        notices = waiter.take_notices(EVENT_NOTICE)
        if not notices or not self._notices:
            return
        prefix = f"{EVENT_NOTICE}{self.partition}:"
        valid = self._valid_statuses
        found: list[tuple[int, CloudEvent]] = []  # (outbox id, event)
        left = False  # a notice of this partition left to the claim
        for notice in notices:
            if not notice.startswith(prefix):
                continue  # another partition's: its relay's
            payload = notice[len(prefix):]
            try:
                doc = json.loads(payload)
                data = doc["data"]
                version = int(data["version"])
                if self._claimed_to < version <= self._claimed_to + EVENT_WINDOW and publishable(
                        data["task_id"], data["instance_id"], data["task_key"], data["change"], data["new_status"],
                        data["old_status"], valid):
                    found.append((version, encoded_event(str(doc["id"]), str(doc["partitionkey"]),
                                                         str(doc["subject"]), payload)))
                    continue
            except Exception:  # anything unreadable (anyone can NOTIFY; a deep JSON raises RecursionError)
                pass  # is the claim's: it publishes the row, or dead-letters it with the reason
            left = True
        if not found:
            return
        found.sort(key=lambda f: f[0])  # the outbox's order
        try:
            self.bus.publish([event for _, event in found])
        except Exception as exc:  # the claim that follows publishes them (and meets the outage itself)
            log.info("relay partition %d: publishing %d notified event(s) failed (%s); the claim publishes them",
                     self.partition, len(found), first_line(exc))
            return
        if len(self._noticed) > NOTICED_LIMIT:  # ids no claim of this relay took (another relay's): forgotten
            self._noticed.clear()
        self._noticed.update((version, event.id) for version, event in found)
        self.metrics.noticed.inc(len(found))
        self._unmarked += len(found)
        # Not while the flag is down (adaptive, busy): most changes then commit without a notification, and a late
        # notice of a writer that read the flag up must not hold back the claim that publishes them.
        if not left and not waiter.heard_other() and self._horizon is None and self._unmarked < MARK_LIMIT \
                and (self.wake == "notify" or self._armed):
            # Every change heard went out already: the claim that marks them waits for more (mark_delay).
            self._look = False
            if self._mark_due is None:
                self._mark_due = time.monotonic() + mark_delay()

    def _record(self, published: Sequence[Any], dead: int, fresh: Sequence[Any]) -> None:
        """Metrics of a claim: ``published`` rows (``fresh``: those whose events this claim published, not only
        marked), ``dead`` dead-lettered."""
        self.metrics.published.inc(len(published))
        if published and self._purge_due is None:
            self._purge_due = time.monotonic() + self.settings.retention
        self.metrics.batch_size.observe(len(published) + dead)
        if fresh:
            # One observation per batch, of its oldest row: the batch's worst case, at a cost that does not grow with
            # the batch. Rows only marked are left out: their publish came earlier, their mark up to MARK_AFTER later.
            stamps = [t for t in (as_utc(r.created_at) for r in fresh) if t is not None]
            created = min(stamps, default=None)
            if created is not None:
                self.metrics.publish_latency.observe(max(0.0, (datetime.now(UTC) - created).total_seconds()))
        if dead:
            self.metrics.dead_letters.inc(dead)
            log.warning("relay set aside %d malformed outbox row(s) in pollbridge_outbox_dead", dead)

    def _has_unpublished(self) -> bool:
        """Whether a claim would find a row, asked without the write lock (SQLite).

        On SQLite an empty claim still takes the database's one write lock, and the relay claims every
        ``poll_interval`` while changes trickle in: the application, the workers and the schedulers then
        queue behind a claim that finds nothing. This read (on the partial index of unpublished rows)
        takes no lock; a row it misses by a moment is found on the next cycle."""
        assert self._reader is not None
        if self._changes is not None:  # before the look: a commit during it moves the generation
            self._seen = self._changes.generation
        return finds_a_row(self._reader, self.queries.peek)

    def note_captured(self, rows: int) -> None:
        """The write-ahead log's capture committed ``rows`` outbox rows, published (called from its stream's
        thread, in this process): their purge is due once they pass the retention window, as for rows this
        relay published itself (the loop schedules it: :meth:`_schedule_log_purge`)."""
        if rows:
            self._log_wrote = True

    def _schedule_log_purge(self, now: float) -> None:
        """In the relay's thread: a purge for what the log's capture wrote since the last look. The log's rows of
        the other partitions (``capture.relay_partitions`` > 1) are written by the stream beside partition 0's
        relay, so no relay of theirs hears of them: without capture triggers such a relay looks again one
        retention window after a purge that left nothing (one statement an hour by default)."""
        if self._log_wrote:
            self._log_wrote = False
            if self._purge_due is None:
                self._purge_due = now + self.settings.retention
        elif self._purge_due is None and self._triggers is False and self.partition != 0:
            self._purge_due = now + self.settings.retention

    # --- housekeeping -------------------------------------------------------------------------------
    def probe(self) -> int:
        """Backlog and oldest age of this partition (the idle fallback probe; also feeds the gauges)."""
        if self._reader is not None:  # SQLite: a read needs no write lock
            with self._reader.connect() as conn:
                backlog = read_backlog(conn, self.partition)
                conn.rollback()
        else:
            with self._begin() as conn:
                backlog = read_backlog(conn, self.partition)
        self._gauge(backlog)
        return backlog.unpublished

    def _gauge(self, backlog: Backlog) -> None:
        self.metrics.backlog.labels(**self._labels).set(backlog.unpublished)
        self.metrics.oldest_age.labels(**self._labels).set(backlog.oldest_age)

    def check_bus_epoch(self) -> bool:
        """Detect bus loss; on loss queue the retained rows of the partitions that lost their data for
        republishing (every partition's when the whole bus lost it). True if a reset was handled."""
        epochs = self.bus.epochs()
        if self._epochs is None:
            with self._begin() as conn:
                self._epochs = parse_epochs(conn.execute(self.queries.bus_epoch()).scalar())
        # A partition with no stored epoch (the first check, an installation that stored one token before
        # migration 0011, a changed partition count) has nothing to compare with: stored, not replayed.
        lost = sorted(p for p, token in epochs.items() if self._epochs.get(p) not in (None, token))
        if self._epochs == epochs:
            return False
        count = 0
        with self._begin() as conn:
            # Unlike the relay's other writes, this one must not be lost in a server crash: the in-memory
            # epochs move on after it, and a lost requeue would never be redone.
            if self.pg:
                conn.exec_driver_sql("SET LOCAL synchronous_commit = on")
            if lost:
                since = datetime.now(UTC) - timedelta(seconds=self.settings.retention)
                if not self.pg:
                    since = since.replace(tzinfo=None)
                # Requeued now: created_at is "queued for publishing since", so the guardian does not read a
                # replay of old rows as a relay stuck for as long as they are old (the replayed events carry the
                # replay time; their trace ids and the database are unchanged).
                if len(lost) == len(epochs):
                    count = conn.execute(self.queries.requeue(since)).rowcount
                else:  # one shard of a cluster: only the rows whose instances its partitions hold
                    wanted = set(lost)
                    ids = [row.id for row in conn.execute(self.queries.retained(since))
                           if partition_for(row.instance_id or "", self.bus.partitions) in wanted]
                    for start in range(0, len(ids), _REQUEUE_CHUNK):
                        count += conn.execute(self.queries.requeue_ids(ids[start:start + _REQUEUE_CHUNK])).rowcount
            conn.execute(self.queries.set_bus_epoch(json.dumps({str(p): t for p, t in sorted(epochs.items())})))
        self._epochs = epochs
        if lost:
            # A notified event published before the loss may be gone with it: the claim publishes every row again.
            self._noticed.clear()
            self.metrics.bus_resets.inc()
            self.metrics.republished.inc(count)
            which = "every partition" if len(lost) == len(epochs) else f"partition(s) {lost}"
            log.warning("bus lost the data of %s (epoch changed): republishing %d retained outbox row(s)",
                        which, count)
        return bool(lost)

    def _memory_paused(self) -> bool:
        pressure = self.bus.memory_pressure()
        paused = pressure is not None and pressure >= self.settings.max_bus_memory
        if paused != bool(self.metrics.value("pollbridge_relay_paused")):
            if paused:
                log.warning("bus memory at %.0f%% of its limit (pause threshold %.0f%%): publishing paused",
                            100 * (pressure or 0), 100 * self.settings.max_bus_memory)
            else:
                log.info("bus memory below the threshold again: publishing resumed")
        self.metrics.paused.set(1 if paused else 0)
        return paused

    def _purge_if_due(self, now: float) -> None:
        if self._purge_due is not None and now >= self._purge_due:
            self.purge()

    def purge(self) -> int:
        """Delete published rows older than the retention window, in small batches, and trim the bus to the
        same window."""
        cutoff_utc = datetime.now(UTC) - timedelta(seconds=self.settings.retention)
        cutoff = cutoff_utc if self.pg else cutoff_utc.replace(tzinfo=None)
        total = 0
        for _ in range(100):
            with self._begin() as conn:
                n = conn.execute(self.queries.purge(cutoff, self.settings.purge_batch)).rowcount
                if n < self.settings.purge_batch:
                    oldest = as_utc(conn.execute(self.queries.oldest_published()).scalar_one())
            total += n
            if n < self.settings.purge_batch:
                self._purge_due = None if oldest is None else time.monotonic() + max(
                    0.0, (oldest - cutoff_utc).total_seconds())
                break
        self.metrics.purged.inc(total)
        # The bus keeps what the outbox keeps: entries past the retention window that every consumer group
        # has read and acknowledged (the trim keeps anything undelivered or pending, whatever its age).
        self.metrics.bus_trimmed.inc(self.bus.trim(self.settings.retention))
        return total

    def _set_armed(self, armed: bool) -> None:
        if armed == self._armed:
            return
        with self._begin() as conn:
            conn.execute(self.queries.set_armed(armed))
        self._armed = armed

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        """A transaction on the loop's kept connection (a pooled one outside run()); a failure drops the
        kept connection, so the next cycle reconnects."""
        if self._conn is None:
            with self.engine.begin() as conn:
                yield conn
            return
        try:
            with self._conn.begin():
                yield self._conn
        except BaseException:
            self._drop_connection()
            raise

    def _connect(self) -> Connection:
        conn = self.engine.connect()
        if self.pg:
            # The driver prepares a statement after a few runs and PostgreSQL may then switch to a generic
            # plan, blind to the batch LIMIT. Measured on a kept connection: the claim took 0.3 to 1 s per
            # 5,000-row batch during a benchmark (the relay the bottleneck at ~5,000 rows/s), and forcing
            # custom plans brought it back. A custom plan per run costs a fraction of a ms.
            conn.exec_driver_sql("SET plan_cache_mode = force_custom_plan")
            # The relay's transactions only mark rows published (and purge, and arm): one lost in a server
            # crash before its WAL reached the disk leaves its rows unpublished, and they are published
            # again, duplicates that consumers drop by event id. So the relay need not wait for the flush
            # at each commit (the changes themselves were committed by the application, synchronously).
            conn.exec_driver_sql("SET synchronous_commit = off")
            conn.commit()
        return conn

    def _drop_connection(self) -> None:
        # Invalidated, not returned to the pool: it carries the relay's session settings (asynchronous commit,
        # custom plans), which another user of the engine (run-all) must not inherit.
        discard(self._conn)
        self._conn = None

    # --- the loop -----------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Publish until ``stop`` is set; as a standby, wait for the partition; reconnect with backoff."""
        listen = self.pg and self.wake in ("notify", "adaptive")
        waiter: Waiter = ListenWaiter(self.engine, stop, NOTIFY_CHANNEL) if listen else Waiter(stop)
        backoff = Backoff()
        next_heartbeat = next_epoch = next_purge = 0.0
        leader = False
        standby_of: str | None = None  # while a standby: who held the partition when it started waiting
        paused = False
        handled = -1  # unknown before the first claim
        last_rows = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                    now = time.monotonic()
                    if now >= next_heartbeat or not leader:
                        was = leader
                        leader = self.leadership.try_acquire()
                        self.metrics.leader.labels(**self._labels).set(1 if leader else 0)
                        if leader:
                            self.leading.set()
                        else:
                            self.leading.clear()
                        # A lease row (SQLite in memory) must be renewed well within its timeout, and a lock
                        # file's time (a SQLite file) touched as often, for the checks; the advisory lock lives
                        # with its connection, and checking that connection once per timeout is enough.
                        next_heartbeat = now + self.settings.lease_timeout / (1 if self.pg else 2)
                        if leader and not was:
                            # What the previous leader kept (its own rows, the log's) is purged from now on: a purge
                            # looks at the next purge time (one statement).
                            self._purge_due = 0.0
                            if standby_of is not None:
                                log.info("relay %s: took over partition %d (previously held by %s)",
                                         self.leadership.holder, self.partition, standby_of)
                            else:
                                log.info("relay %s holds partition %d", self.leadership.holder, self.partition)
                            standby_of = None
                            self._noticed.clear()  # kept from an earlier lead: another relay claimed those rows
                            self._mark_due, self._unmarked = None, 0
                            self._armed = True
                            self._set_armed(False)
                        if not leader:  # a hot standby: retry soon so a takeover is quick
                            # Not listening meanwhile: PostgreSQL keeps every notification until each listener has read
                            # it, and the server's queue, once full, fails the writers' commits. A leader listens anew
                            # and claims what committed before.
                            waiter.close()
                            if standby_of is None:  # said once, not at every retry
                                standby_of = self._holder_for_log()
                                log.info("relay %s: standby for partition %d (held by %s)", self.leadership.holder,
                                         self.partition, standby_of)
                            stop.wait(min(1.0, self.settings.lease_timeout / 3))
                            continue
                    if now >= next_epoch:
                        if self.check_bus_epoch():  # requeued rows notify no one: claim them now
                            self._look, self._probe_at = True, None
                        was_paused, paused = paused, self._memory_paused()
                        (self.publishing.clear if paused else self.publishing.set)()
                        if was_paused and not paused:
                            self._look, self._probe_at = True, None
                        next_epoch = now + self.settings.epoch_check_interval
                    self._schedule_log_purge(now)
                    if paused:  # backpressure: the outbox keeps the changes until the bus has room
                        if self._armed:  # unheard while paused, the writers' NOTIFYs would only fill the queue
                            self._set_armed(False)
                        waiter.close()  # and other partitions' writers still notify: not listening meanwhile
                        # The purge goes on: its trim of what every consumer acknowledged is what gives the bus room
                        # again (skipped while paused, a bus full of acknowledged entries kept the relay paused).
                        if now >= next_purge:
                            self._purge_if_due(now)
                            next_purge = now + self.settings.purge_interval
                        stop.wait(self.settings.epoch_check_interval)
                        continue
                    if now >= next_purge:
                        if listen:
                            self._heard_meanwhile(waiter)
                        # The bus trim rides on the outbox's purge: its entries are the same publishes. An
                        # entry still unacknowledged at a purge waits for the next one (after the next
                        # publish), which bounds it without an idle relay asking anything.
                        self._purge_if_due(now)
                        if handled and self.pg and not self._backlog_due:
                            self._backlog_due = True  # read by the next claim (see __init__)
                        elif handled or self._backlog_due:  # SQLite, or no claim came since the last purge
                            self._backlog_due = False
                            self.probe()
                        else:  # the last claim found nothing: the backlog was empty, no need to ask again
                            self.metrics.backlog.labels(**self._labels).set(0)
                            self.metrics.oldest_age.labels(**self._labels).set(0.0)
                        next_purge = now + self.settings.purge_interval
                    if listen:
                        self._heard_meanwhile(waiter)
                    if self._mark_due is not None and now >= self._mark_due:
                        self._look = True  # the claim that marks what went out from notifications
                    look, self._look = self._look, True
                    claim_now, self._claim_next = self._claim_next, False
                    handled = 0 if not look else self.publish_batch() \
                        if self.pg or handled >= self.settings.batch_size or claim_now or self._has_unpublished() \
                        else 0
                    backoff.reset()
                    if handled:
                        last_rows = time.monotonic()
                        # The rate that NOTIFY's lock costs the writers: changes that notify, not quiet ones.
                        self._rate.add(self._loud, last_rows)
                    # Housekeeping that is due wakes the loop, but only a change or the probe's own timer
                    # makes it look at the outbox (_look).
                    until = min(next_heartbeat, next_epoch, next_purge)
                    if self._mark_due is not None:  # the claim that marks what went out from notifications
                        until = min(until, self._mark_due)
                    if not listen:
                        # SQLite: a claim that took less than a batch held the write lock, so it took all there
                        # was; the next look waits for a commit (an empty look after every claim was half the
                        # relay's statements at a trickle).
                        if not handled or (self._changes is not None and handled < self.settings.batch_size):
                            self._idle(waiter, last_rows, until)
                        continue
                    if handled >= self.settings.batch_size:  # more is waiting
                        continue
                    # A claim that took less than a batch took all there was: no second, empty claim to be
                    # sure (at a trickle that confirmation was a transaction per change).
                    self._idle_listening(waiter, last_rows, until)
                    self._publish_notices(waiter)
                except Exception as exc:  # the relay must survive any outage and retry
                    self.metrics.errors.labels(kind=type(exc).__name__).inc()
                    pause = backoff.next()
                    log.warning("relay cycle failed (%s: %s); retrying in %.1f s", type(exc).__name__,
                                _masked(str(exc), self.engine), pause)
                    leader = False if self.pg else leader
                    if self.pg:
                        self.leading.clear()
                        self.leadership.release()
                    # Unread through the backoff, a listener would keep the server's notification queue from being
                    # trimmed; a fresh LISTEN is followed by a claim of what committed meanwhile.
                    waiter.close()
                    stop.wait(pause)
        finally:
            if self._noticed and self.pg:
                # Marked on the way out, or the next relay publishes them again: only marked (their events went out),
                # no claim and no publish (the bus may be full, the lead stale; a bus lost meanwhile is found by the
                # next relay's epoch check, which republishes what the retention window holds).
                with contextlib.suppress(Exception), self._begin() as conn:
                    conn.execute(self.queries.mark_noticed(list(self._noticed.items())))
            self.leading.clear()
            waiter.close()
            with contextlib.suppress(Exception):  # best effort on the way out
                self._set_armed(False)
            self._drop_connection()
            self.leadership.release()
            self.metrics.leader.labels(**self._labels).set(0)

    def _holder_for_log(self) -> str:
        """Who holds this relay's partition (``pollbridge_relay_state.holder``), for the standby's log line only."""
        try:
            with (self._reader or self.engine).connect() as conn:
                holder = conn.execute(sa.select(relay_state.c.holder)
                                      .where(relay_state.c.relay_partition == self.partition)).scalar()
                conn.rollback()
        except Exception as exc:  # a log line must not stop the relay: the loop meets the outage itself
            return f"unknown ({first_line(exc)})"
        return str(holder) if holder else "unknown"

    def _idle(self, waiter: Waiter, last_rows: float, until: float) -> None:
        """No LISTEN (``wake = "poll"``, SQLite). SQLite: sleep until a commit changes the database (this
        process's at once, another's within a few ms: :mod:`bridge.db.changes`), probing on its own only every
        ``idle_probe_interval``. ``poll`` (and a SQLite database in memory): probe every ``poll_interval``;
        idle longer, the embedded relay probes less often (20 ms to 0.1 s)."""
        s = self.settings
        now = time.monotonic()
        if self._changes is not None:
            if self._probe_at is None:
                self._probe_at = now + s.idle_probe_interval
            moved = self._changes.wait(self._seen, max(0.0, min(self._probe_at, until) - now)) != self._seen
            # Surely woken by a commit about data: nearly every one is a task write, whose capture trigger wrote
            # the outbox rows in the same transaction, so the claim goes first, without the look (a read
            # transaction per change; `bench.cost`, embedded, 2 completions/s: 4 of 33 statements per
            # completion were the relay's looks). A commit without outbox rows (a flag) costs an empty claim,
            # as many statements as the look; a wake-up that only may be about data (the watcher's start, a
            # commit whose topics could not be told) still looks first. Only partition 0: on SQLite the
            # triggers write every row to it.
            self._claim_next = moved and self.partition == 0 and self._changes.surely_since(self._seen)
            self._after_wait(moved)
            return
        idle_for = now - last_rows
        interval = s.poll_interval if (self.pg or idle_for < s.arm_after) \
            else idle_poll(max(s.poll_interval, EMBEDDED_IDLE_PROBE), idle_for)
        waiter.wait(interval)

    def _after_wait(self, woken: bool) -> None:
        """After an idle wait: look at the outbox if a change woke the relay or its probe is due; a wait cut
        short by housekeeping (a lease, the bus epoch) does not look. At a timer's probe an armed relay also
        makes sure its flag is still up (a relay that lost the partition may have lowered it on its way out)."""
        if woken or (self._probe_at is not None and time.monotonic() >= self._probe_at):
            self._probe_at = None
            self.metrics.wakeups.labels(cause="notify" if woken else "timer").inc()
            if not woken and self.pg and self.wake == "adaptive" and self._armed and self._flag_was_down():
                log.warning("relay partition %d: its NOTIFY flag was down; raised again", self.partition)
                self._armed = False
                self._arm()
        else:
            self._look = False

    def _flag_was_down(self) -> bool:
        with self._begin() as conn:
            return conn.execute(sa.text(REASSERT_ARMED_SQL), {"partition": self.partition}).first() is not None

    def _idle_listening(self, waiter: Waiter, last_rows: float, until: float) -> None:
        """Between claims on PostgreSQL with ``notify`` or ``adaptive``: sleep until a notification, or poll
        while the change rate is too high for the trigger to notify (``adaptive``).

        What a change costs the database is one claim, at any rate: armed, the commit's notification wakes
        the relay and the claim takes whatever has committed since the last one; busy (more than
        ``notify_max_rate`` rows/s), the trigger stops notifying and every ``poll_interval`` probe finds rows.
        The timer only guards what a notification cannot: the moment of arming (a writer that read the flag
        down and commits after the re-probe) until every transaction that could have done so has ended
        (from ``poll_interval`` doubling up to ``fallback_interval``), and a listener lost without an error
        (``idle_probe_interval``)."""
        assert isinstance(waiter, ListenWaiter)
        s = self.settings
        now = time.monotonic()
        if CAPTURE_CHANGED in waiter.take_payloads():  # heard in any wait since the last call, whichever
            self._capture_changed()
        if self.wake == "adaptive":
            busy = self._rate.busy(now, s.notify_max_rate if self._armed else 0.75 * s.notify_max_rate)
            if busy and now - last_rows < s.arm_after:
                if self._armed:
                    self._set_armed(False)
                    log.info("relay partition %d: %.0f changes/s, above relay.notify_max_rate (%.0f): polling",
                             self.partition, self._rate.rate, s.notify_max_rate)
                waiter.wait(s.poll_interval)
                return
        try:
            fresh = waiter.ensure_listening()
        except Exception as exc:  # the listener alone cannot connect: poll meanwhile, keep the partition
            log.warning("relay partition %d cannot LISTEN (%s); probing every %.1f s meanwhile", self.partition,
                        first_line(exc), s.fallback_interval)
            waiter.stop.wait(min(s.fallback_interval, max(0.0, until - now)))
            return
        if self.wake == "adaptive" and not self._armed:
            self._arm()
            fresh = True
        if fresh:  # what committed before the LISTEN (or the flag) is read by the next cycle's claim
            if self.pg:  # and a change of capture while it did not listen
                self._read_capture()
            return
        if self._horizon is not None:
            # A writer that read the flag down may still commit without a notification: look again soon, then
            # less often (poll_interval, doubling up to fallback_interval), until none is left.
            woken = waiter.wait(self._unsafe_wait)
            self._unsafe_wait = min(2 * self._unsafe_wait, s.fallback_interval)
            if self._horizon_passed():  # then the claim that follows sees whatever such a writer committed
                self._horizon = None
            self.metrics.wakeups.labels(cause="notify" if woken else "timer").inc()
            return
        if self._triggers is False:
            # The log captures: nothing to probe for (see _triggers); the listener's connection is watched by its
            # TCP keepalives, and one lost is a fresh LISTEN followed by a claim.
            self._probe_at = None
            woken = waiter.wait(max(0.0, until - time.monotonic()))
        else:
            if self._probe_at is None:
                self._probe_at = now + s.idle_probe_interval
            woken = waiter.wait(max(0.0, min(self._probe_at, until) - time.monotonic()))
        self._after_wait(woken)  # a notification that capture changed is read at the next call's start

    def _capture_changed(self) -> None:
        """Triggers were installed or removed: read which; with triggers back, make sure the NOTIFY flag is up
        (unread while the log captured, with no timer probe: a relay that left meanwhile may have lowered it)."""
        self._read_capture()
        if self._triggers and self.wake == "adaptive" and self._armed and self._flag_was_down():
            log.warning("relay partition %d: its NOTIFY flag was down; raised again", self.partition)
            self._armed = False
            self._arm()

    def _read_capture(self) -> None:
        """Whether capture triggers are installed (see ``_triggers``): at each notification that capture changed
        (``capture switch``, ``init``: :func:`bridge.capture.triggers.install_capture` and
        :func:`bridge.capture.triggers.remove_capture` send it) and when the listener (re)connects."""
        # Unknown until read, taken as yes (the probe goes on): a read that fails leaves no stale "no triggers".
        before, self._triggers = self._triggers, None
        with self._begin() as conn:
            triggers = bool(installed_triggers(conn))
        if triggers != before and before is not None:
            log.info("relay partition %d: capture is now %s", self.partition,
                     "by trigger (an idle probe every relay.idle_probe_interval)" if triggers
                     else "from the write-ahead log (no idle probe)")
        self._triggers = triggers

    def _arm(self) -> None:
        """Raise the trigger's flag and note the arming horizon: until every transaction that could have read
        the flag down has ended, one of them may commit a row without a notification. Armed (``_armed``) only
        once the horizon is known: "armed, no horizon" means past it, never "not yet noted" (a test that waited for
        the relay to settle read that state in between and watched the horizon's probes it had not expected)."""
        with self._begin() as conn:
            conn.execute(self.queries.set_armed(True))
        self._unsafe_wait = self.settings.poll_interval
        # A new window: the busy spell's rate must not disarm it again at the first change that follows.
        self._rate.reset(time.monotonic())
        try:
            with self._begin() as conn:
                self._horizon = str(conn.exec_driver_sql(ARM_HORIZON_SQL).scalar_one())
        finally:
            # Also when the read failed: the flag is up, so armed as far as lowering it goes (the way out, a
            # takeover), which a relay that never raised it skips. The failure ends the cycle, and leadership with
            # it: the next arming starts afresh.
            self._armed = True

    def _horizon_passed(self) -> bool:
        with self._begin() as conn:
            return bool(conn.execute(sa.text(HORIZON_PASSED_SQL), {"horizon": self._horizon}).scalar_one())


def _row_json(row: Any) -> str:
    return json.dumps({k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row._asdict().items()
                       if k != "payload"}, default=str)


def _masked(text: str, engine: Engine) -> str:
    password = engine.url.password
    if password:
        text = text.replace(str(password), "***")
    return text.replace(engine.url.render_as_string(hide_password=False), mask_url(engine.url))
