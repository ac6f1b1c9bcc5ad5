"""Wake-ups when a SQLite database changes, without asking the database.

SQLite has no NOTIFY. Without a signal, every component of the embedded default polled for the others:
the relay for outbox rows, the bus's readers for entries, the flag router for flags, about 60 idle
statements a second for the event path alone (issue 20). A :class:`ChangeSignal` per database file and
process replaces those polls with two signals:

* **this process's commits**: every SQLite connection pollbridge opens is a :class:`NotifyingConnection`,
  which signals after a ``commit()`` that wrote rows (``total_changes`` moved), so a change made in
  ``run-all`` or ``demo`` wakes the relay, the scheduler and the workers at once (those that wait for it:
  topics, below);
* **other processes' commits**: while someone waits, one watcher thread per database reads the WAL-index
  header at the start of the ``-shm`` file every :data:`WATCH_INTERVAL`: its change counter ``iChange`` is
  incremented by every committing transaction (https://www.sqlite.org/walformat.html, "The WAL-Index
  Header"; native byte order, offset 8). A ``stat`` and a ``pread``, no statement, no lock. Without a
  header (a database not in WAL mode) it compares the size and modification time of the files instead.

**Topics, and this process's own commits.** A commit says what it is about: ``data`` (the default: a task
written, an outbox row, a flag), ``bus`` (an embedded-bus publish), ``work`` (the event scheduler's dispatch: work
for the workers, and nothing the relay need hurry for: :func:`bridge.capture.triggers.quiet_statuses`), or nothing
at all (a quiet commit: a lease renewal, a bus reader's offsets and acknowledgements, which no one waits
for). A waiter waits for some topics (:meth:`ChangeSignal.view`): the relay and the flag router for
``data``, the workers for ``data`` and ``work``, the bus's readers for ``bus``. Idle, lease renewals were the
only commits, and each woke every waiter into a look; busy, every dispatch's half-dozen commits woke the bus's
readers. Every commit of this process also tells the watcher
its counter value (read inside the transaction, while it holds the database's one write lock, so no other
commit can come between; plus one), so the watcher signals only other processes' commits (on their topics,
below): a commit it was not told about is never taken for one of ours (the worst case is a spurious wake-up, a look
that finds nothing).

**Other processes' topics.** pollbridge's processes tell each other what their commits were about through a
small journal beside the database, ``<database>-pollbridge_topics``: after a commit that moved the counter by
exactly one while no other connection committed (``PRAGMA data_version``; so it is surely this commit's
value), the committing process writes the value, the commit's topics, the WAL salt, the WAL's frame count
after it and the ``-shm`` file's inode, with a check word, into the value's slot (:data:`JOURNAL_SLOTS` slots
of 24 bytes, one ``pwrite``). A watcher that sees the counter move wakes only the topics of the values it
finds there (none for a quiet commit), and only from slots whose salt is the WAL's now and whose frame
count lies between its two looks: the counter restarts from 0 when SQLite recovers a WAL after a crash, but
within one salt the frame count only grows, so a slot of an earlier run never matches. A value without its
slot (another program's commit; a slot overwritten, torn, stale, or not yet written: it is looked up once
more half a millisecond later, and after this process's own commits in flight, between SQLite's COMMIT and
their note, have been noted) wakes every topic, and so does a WAL that started over between two looks.
So a commit is never taken for another's: the worst case is still a spurious wake-up. A waiter can tell the
two apart (:meth:`ChangeSignal.surely_since`): woken only by commits about its topic (this process's, or
another's told by the journal), it may act at once (the relay claims, a bus reader takes); woken by what only
may be about it (a watcher's start, a commit whose topics could not be told), it looks first. Measured before this
(``bench.cost``, embedded, 2 completions/s): the relay looked at the outbox 7 times and the scheduler read the
bus 8.8 times per completion, woken by each other's bookkeeping.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sqlite3
import struct
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

#: How often the watcher looks at the files while someone waits (seconds): the most a change committed by
#: another process waits before it wakes this one's components.
WATCH_INTERVAL = 0.005
#: The watcher stops after this long without a waiter (the next wait starts it again).
WATCH_IDLE_STOP = 5.0
#: Bytes of the WAL-index header read (its first copy; ``iChange`` is at offset 8).
_HEADER_BYTES = 48
#: This process's commits remembered until the watcher meets their counter values.
OWN_REMEMBERED = 1000


#: What a commit can be about; a waiter waits for some of them (:meth:`ChangeSignal.view`).
TOPICS = ("data", "bus", "work")
#: A look at the files: ("counter", -shm inode, iChange, WAL salt, WAL frames) or ("files", None, sizes, 0, 0).
_Signature = tuple[str, Any, Any, int, int]
#: Slots of the topic journal (a value's slot is the value modulo this), each ``=IIIIII``: counter value, topics
#: (bit i: ``TOPICS[i]``; bit 31: a slot written), the WAL salt, the WAL's frame count after the commit, the
#: ``-shm`` inode's low 32 bits and a check word (a torn read does not match).
JOURNAL_SLOTS = 256
_SLOT = struct.Struct("=IIIIII")  # counter, topics, salt, frames, inode, check word
_WRITTEN = 1 << 31
_CHECK = 0x9E3779B9
#: Suffix of the topic journal's file name, beside the database file.
JOURNAL_SUFFIX = "-pollbridge_topics"
#: How long the watcher gives a commit's process to write its journal slot before waking every topic.
JOURNAL_GRACE = 0.0005
#: How long the watcher waits for a commit of this process between SQLite's COMMIT and its note (the journal slot)
#: before taking it for a stranger's (every topic woken, not surely): the note is a few statements of Python.
OWN_NOTE_WAIT = 0.2
#: Longest wait for this process's write lock before a write transaction goes to SQLite's own busy handler
#: (which then waits as before): a thread that opens a second write transaction under its first fails as it
#: did, after this wait, instead of hanging.
WRITE_LOCK_WAIT = 30.0


class ChangeSignal:
    """Generation counters, one per topic, for one database file in this process; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._gens = dict.fromkeys(TOPICS, 0)
        #: Per topic, its generation at the last wake-up that may not be about it (a watcher's start, a commit
        #: whose topics could not be told): a waiter woken past it knows a commit about its topic happened.
        self._unsure = dict.fromkeys(TOPICS, 0)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        #: Signalled when a commit of this process in flight is noted, on ``_cond``'s lock: only the watcher waits
        #: for that, and the waiters of the topics are not woken by it.
        self._noted = threading.Condition(lock)
        self._watcher: threading.Thread | None = None
        self._last_wait = 0.0
        self._shm: tuple[int, int] | None = None  # (descriptor, inode) of the -shm file, never closed (_header)
        self._retired: list[int] = []  # descriptors that turned out to name a replaced file (kept open too)
        self._shm_lock = threading.Lock()
        #: This process's commits the watcher has not met yet, as (counter, salt, frames) (bounded).
        self._own: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=OWN_REMEMBERED)
        self._journal: int | None = None  # descriptor of the topic journal (-1: it cannot be opened here)
        self._journal_lock = threading.Lock()
        #: The counter values of this process's commits between SQLite's COMMIT and their note (:meth:`expect_own`),
        #: guarded by ``_cond``.
        self._in_flight: set[int] = set()
        #: Held by this process's write transaction on the file, from BEGIN IMMEDIATE to its end: threads queue
        #: here and wake the moment it is released, instead of in SQLite's busy handler, which sleeps 1, 2, 5,
        #: 10, 15, 20, 25 … ms between tries whatever the lock does (see :class:`NotifyingConnection`).
        self.write_lock = threading.Lock()

    def notify(self, topics: Iterable[str] = TOPICS, *, sure: bool = True) -> None:
        """Wake the waiters of ``topics``; ``sure``: a commit about them surely happened (this process's own, or
        another's whose topics the journal told), not a wake-up that only may be about them."""
        topics = tuple(topics)
        if not topics:  # a quiet commit: nothing for anyone
            return
        with self._cond:
            for topic in topics:
                self._gens[topic] += 1
                if not sure:
                    self._unsure[topic] = self._gens[topic]
            self._cond.notify_all()

    def generation(self, topic: str | tuple[str, ...]) -> int:
        """The generation of ``topic`` (of several: their sum, which moves whenever one of them does)."""
        return self._gens[topic] if isinstance(topic, str) else sum(self._gens[t] for t in topic)

    def surely_since(self, topic: str, seen: int) -> bool:
        """Whether every wake-up of ``topic`` after generation ``seen`` was a commit about it (and there was
        one): a waiter woken past ``seen`` may then act on the change without looking for it first."""
        with self._cond:
            return self._gens[topic] != seen and self._unsure[topic] <= seen

    def view(self, *topics: str) -> TopicView:
        """The signal as seen by a waiter for ``topics`` (woken by a commit about any of them)."""
        if not topics:
            raise ValueError("a view needs a topic")
        for topic in topics:
            if topic not in self._gens:
                raise ValueError(f"unknown topic {topic!r}; one of {', '.join(TOPICS)}")
        return TopicView(self, topics[0] if len(topics) == 1 else tuple(topics))

    def change_counter(self) -> int | None:
        """The WAL-index header's ``iChange`` now (None: no header to read)."""
        header = self._header()
        return None if header is None or len(header) < 12 else _counter(header)

    def header_now(self) -> bytes | None:
        """The WAL-index header now, whole (None: none to read)."""
        header = self._header()
        return header if header is not None and len(header) >= _HEADER_BYTES else None

    def commit_started(self, value: int) -> None:
        """A commit of this process that wrote is about to COMMIT, and should move the counter to ``value`` (it holds
        the database's write lock); :meth:`commit_noted` follows it, whatever happens."""
        with self._cond:
            self._in_flight.add(value)

    def commit_noted(self, value: int) -> None:
        """The commit :meth:`commit_started` announced was noted (:meth:`expect_own`), or will not be."""
        with self._cond:
            self._in_flight.discard(value)
            self._noted.notify_all()

    def _await_own(self, values: set[int], timeout: float) -> bool:
        """Wait (up to ``timeout``) until none of the counter ``values`` is a commit of this process between its
        COMMIT and its note; whether one was. One not noted by then is let go (an interrupted committer: never again
        waited for)."""
        with self._cond:
            if not values & self._in_flight:
                return False
            if not self._noted.wait_for(lambda: not values & self._in_flight, timeout):
                log.debug("commit(s) %s of this process not noted within %.1f s", sorted(values & self._in_flight),
                          timeout)
                self._in_flight -= values
            return True

    def expect_own(self, header: bytes, topics: Iterable[str]) -> None:
        """A commit of this process made the state ``header`` (read right after it; it signalled its topics
        itself): the watcher lets it pass, and the other processes' watchers read its ``topics`` from the
        journal."""
        counter, salt, frames = _counter(header), _salt(header), _frames(header)
        with self._cond:
            self._own.append((counter, salt, frames))
        shm = self._shm
        if shm is None:
            return
        mask = _WRITTEN
        for topic in topics:
            mask |= 1 << TOPICS.index(topic)
        inode = shm[1] & 0xFFFFFFFF
        slot = _SLOT.pack(counter, mask, salt, frames, inode, counter ^ mask ^ salt ^ frames ^ inode ^ _CHECK)
        with self._journal_lock:  # the descriptor is closed only under this lock (remove_journal)
            fd = self._journal_fd()
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.pwrite(fd, slot, (counter % JOURNAL_SLOTS) * _SLOT.size)

    def _journal_fd(self) -> int:
        """The topic journal's descriptor, opened (created) once; -1 where it cannot be (a read-only directory:
        the others then wake every topic for this process's commits). Called holding ``_journal_lock``."""
        if self._journal is None:
            try:
                self._journal = os.open(f"{self.path}{JOURNAL_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                log.debug("topic journal not available (%s): other processes wake every topic", exc)
                self._journal = -1
        return self._journal

    def _journal_topics(self, values: Iterable[int], last: _Signature, now: _Signature) -> set[str] | None:
        """The union of the journal's topics for ``values`` (counter values between the looks ``last`` and
        ``now``, one WAL salt); None when one of them has no valid slot of its own."""
        topics: set[str] = set()
        with self._journal_lock:
            fd = self._journal_fd()
            if fd < 0:
                return None
            for value in values:
                try:
                    raw = os.pread(fd, _SLOT.size, (value % JOURNAL_SLOTS) * _SLOT.size)
                except OSError:
                    return None
                if len(raw) < _SLOT.size:
                    return None
                counter, mask, salt, frames, inode, check = _SLOT.unpack(raw)
                if (counter != value or not mask & _WRITTEN or salt != now[3] or inode != now[1] & 0xFFFFFFFF
                        or check != counter ^ mask ^ salt ^ frames ^ inode ^ _CHECK
                        or not last[4] < frames <= now[4]):
                    return None
                topics.update(t for i, t in enumerate(TOPICS) if mask & (1 << i))
        return topics

    def wait(self, topic: str | tuple[str, ...], seen: int, timeout: float) -> int:
        """Wait until ``topic``'s generation (:meth:`generation`) moves past ``seen`` (a commit about it here, or
        any commit of another process) or ``timeout`` passes; returns the current generation."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            self._watch()  # in slices below WATCH_IDLE_STOP: the watcher never stops under a waiter
            with self._cond:
                remaining = deadline - time.monotonic()
                now = self.generation(topic)
                if now != seen or remaining <= 0:
                    return now
                self._cond.wait(min(remaining, WATCH_IDLE_STOP / 2))

    def _watch(self) -> None:
        with self._cond:
            self._last_wait = time.monotonic()
            if self._watcher is not None and self._watcher.is_alive():
                return
        # The watcher's baseline is taken now, after the waiter's last look: a commit of another process
        # between that look and the baseline would be in neither. So a (re)started watcher wakes every
        # waiter once, and their next look covers it (measured: missed under load without this). Taken
        # outside _cond: _header takes _shm_lock, then _cond (one lock order, or a commit deadlocks with it).
        baseline = self._signature()
        with self._cond:
            if self._watcher is not None and self._watcher.is_alive():
                return
            self._watcher = threading.Thread(target=self._run, args=(baseline,), name="pollbridge-sqlite-watch",
                                             daemon=True)
            self._watcher.start()
            for topic in TOPICS:
                self._gens[topic] += 1
                self._unsure[topic] = self._gens[topic]
            self._cond.notify_all()

    def _header(self) -> bytes | None:
        """The WAL-index header, through a descriptor this signal keeps open for the life of the process.

        Never closed while it may name the ``-shm`` file SQLite uses: POSIX advisory locks belong to the
        process and the file, so closing *any* descriptor of the file drops every lock this process's
        connections hold on it, and SQLite's shared memory is then corrupted by the next writer
        (https://www.sqlite.org/howtocorrupt.html, 2.2; measured: "database disk image is malformed" within
        seconds when this look opened and closed the file). A descriptor is let go only once the path names
        another file: SQLite deletes ``-shm`` only when no connection, in any process, uses it."""
        shm = f"{self.path}-shm"
        with self._shm_lock:
            try:
                inode = os.stat(shm).st_ino
            except OSError:
                return None
            try:
                # Replaced: another inode, or the same number reused for a new file after ours was unlinked
                # (no links left to the file the descriptor names).
                if self._shm is None or self._shm[1] != inode or os.fstat(self._shm[0]).st_nlink == 0:
                    old, self._shm = self._shm, None
                    fd = os.open(shm, os.O_RDONLY)
                    if os.fstat(fd).st_ino != inode:  # replaced between the stat and the open: next time
                        self._retired.append(fd)
                        return None
                    self._shm = (fd, inode)
                    with self._cond:  # counter values of the file before belong to another count
                        self._own.clear()
                    if old is not None:
                        os.close(old[0])  # a replaced file: no connection uses it any more (see above)
                return os.pread(self._shm[0], _HEADER_BYTES, 0)
            except OSError:
                return None

    def _files(self) -> tuple[Any, ...]:
        parts: list[Any] = []
        for suffix in ("", "-wal"):
            try:
                st = os.stat(f"{self.path}{suffix}")
                parts.append((st.st_size, st.st_mtime_ns, st.st_ino))
            except OSError:
                parts.append(None)
        return tuple(parts)

    def _signature(self) -> _Signature:
        """("counter", -shm inode, iChange, WAL salt, WAL frames), or ("files", …) without a WAL-index header."""
        header = self._header()
        if header is not None and len(header) >= _HEADER_BYTES and self._shm is not None:
            # A new -shm file restarts the count; a new salt, the WAL (and its frame count).
            return ("counter", self._shm[1], _counter(header), _salt(header), _frames(header))
        return ("files", None, self._files(), 0, 0)

    def _changed(self, last: _Signature, now: _Signature) -> tuple[frozenset[str], bool]:
        """The topics other processes' commits between two signatures were about (empty: none, or only this
        process's own commits), and whether they were told; every topic, not told, when one commit's cannot be
        (see the module docstring)."""
        if now[:3] == last[:3]:
            return frozenset(), True
        if last[0] != "counter" or now[0] != "counter" or last[1] != now[1] or last[3] != now[3]:
            return frozenset(TOPICS), False
        gap = (now[2] - last[2]) % 2**32
        if gap > JOURNAL_SLOTS:
            return frozenset(TOPICS), False
        values = {(last[2] + i) % 2**32 for i in range(1, gap + 1)}
        others = values - self._take_own(values, last, now)
        if others and self._await_own(others, OWN_NOTE_WAIT):
            # Looked between a commit of this process and its note: a committing thread that lost the CPU there (a
            # loaded machine; the GIL's switch interval is 5 ms) made its own commit a stranger's, waking every
            # topic. Its note comes within microseconds of the CPU: wait for it, then it is ours like the others.
            others -= self._take_own(others, last, now)
        if not others:
            return frozenset(), True
        topics = self._journal_topics(others, last, now)
        if topics is None:  # not written yet, maybe: its process writes it right after its commit
            time.sleep(JOURNAL_GRACE)
            topics = self._journal_topics(others, last, now)
        return (frozenset(TOPICS), False) if topics is None else (frozenset(topics), True)

    def _take_own(self, values: set[int], last: _Signature, now: _Signature) -> set[int]:
        """Which of the counter ``values`` (between the looks ``last`` and ``now``) this process's noted commits made;
        their notes are used up, and so are those the looks have passed."""
        with self._cond:
            # Ours: made between the two looks (the WAL's frames), whatever the counter did before (it restarts
            # when a WAL is recovered). Entries the looks have passed, or of another salt, go.
            mine = {e for e in self._own if e[1] == now[3] and last[4] < e[2] <= now[4] and e[0] in values}
            stale = [e for e in self._own if e[1] != now[3] or e[2] <= last[4]]
            for entry in (*mine, *stale):
                with contextlib.suppress(ValueError):
                    self._own.remove(entry)
        return {e[0] for e in mine}

    def _run(self, last: _Signature) -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            now = self._signature()
            topics, told = self._changed(last, now)
            if topics:
                self.notify(topics, sure=told)
            last = now
            with self._cond:
                if time.monotonic() - self._last_wait > WATCH_IDLE_STOP:
                    self._watcher = None
                    return


def _counter(header: bytes) -> int:
    return int(struct.unpack_from("=I", header, 8)[0])


def _frames(header: bytes) -> int:
    """The WAL-index header's ``mxFrame`` (offset 16): valid frames in the WAL, growing with every commit until
    the WAL starts over (with a new salt)."""
    return int(struct.unpack_from("=I", header, 16)[0])


def _salt(header: bytes) -> int:
    """The WAL-index header's first salt (offset 32): it changes whenever the WAL starts over."""
    return int(struct.unpack_from("=I", header, 32)[0])


class TopicView:
    """One topic (or several) of a :class:`ChangeSignal`, with the interface of a generation counter
    (``generation``, ``wait(seen, timeout)``, ``notify()``)."""

    def __init__(self, signal: ChangeSignal, topic: str | tuple[str, ...]) -> None:
        self.signal = signal
        self.topic = topic

    @property
    def generation(self) -> int:
        return self.signal.generation(self.topic)

    def wait(self, seen: int, timeout: float) -> int:
        return self.signal.wait(self.topic, seen, timeout)

    def surely_since(self, seen: int) -> bool:
        """Whether a commit about this topic woke it since generation ``seen``, and nothing that only may be
        (:meth:`ChangeSignal.surely_since`; a view of one topic only)."""
        if not isinstance(self.topic, str):
            raise TypeError("surely_since needs a view of one topic")
        return self.signal.surely_since(self.topic, seen)

    def notify(self) -> None:
        self.signal.notify((self.topic,) if isinstance(self.topic, str) else self.topic)


class NotifyingConnection(sqlite3.Connection):
    """A SQLite connection that signals its database's :class:`ChangeSignal` after a commit that wrote rows
    (after, not before: a waiter woken before the commit would look and not find the change), on the
    transaction's topics (``pb_topics``, set per transaction by :mod:`bridge.db.engine`; None: ``data``; empty:
    a quiet commit), and tells the watcher the commit's counter value."""

    pb_signal: ChangeSignal | None = None
    pb_topics: frozenset[str] | None = None
    _pb_changes = 0
    _pb_holds_lock = False

    def pb_begin_write(self) -> None:
        """Before ``BEGIN IMMEDIATE``: take this process's write lock of the file (:attr:`ChangeSignal.write_lock`;
        released when the transaction ends). Measured in ``pollbridge demo`` (relay, scheduler, poller, router and
        workers as threads of one process): the busy handler's sleeps were most of the event path's tail."""
        signal = self.pb_signal
        if signal is not None and not self._pb_holds_lock and signal.write_lock.acquire(timeout=WRITE_LOCK_WAIT):
            self._pb_holds_lock = True

    def pb_end_write(self) -> None:
        """Release the write lock :meth:`pb_begin_write` took, if this connection holds it (any thread may)."""
        if self._pb_holds_lock and self.pb_signal is not None:
            self._pb_holds_lock = False
            self.pb_signal.write_lock.release()

    def commit(self) -> None:
        wrote = self.total_changes != self._pb_changes
        signal, topics = self.pb_signal, self.pb_topics
        self.pb_topics = None
        noting: ChangeSignal | None = None
        expected = 0
        try:
            # Inside the transaction, holding the write lock: no other commit can move the counter before ours.
            before = signal.change_counter() if signal is not None and wrote else None
            version = self._pb_data_version() if before is not None else None
            if signal is not None and before is not None:
                noting, expected = signal, (before + 1) % 2**32
                noting.commit_started(expected)  # until noted below: the watcher waits for it (ChangeSignal._changed)
            super().commit()
        except BaseException:
            if noting is not None:
                noting.commit_noted(expected)
            if not self.in_transaction:  # ended all the same: the next writer must not wait for us
                self.pb_end_write()
            raise
        try:
            self._pb_changes = self.total_changes
            if signal is not None and before is not None:
                # Ours only if the counter moved by exactly one and no other connection committed meanwhile: a
                # commit that wrote nothing SQLite had to keep (an UPDATE to the same bytes) does not move it,
                # and registering the value would let another process's commit, the one that moved it, pass
                # unseen (and, through the journal, unseen by every process).
                header = signal.header_now()
                if header is not None and _counter(header) == expected and self._pb_data_version() == version:
                    signal.expect_own(header, ("data",) if topics is None else topics)
            if wrote and signal is not None:
                # Before the process's write lock goes: a waiter that then takes the lock and reads the
                # generation holding it (the relay's claim, a bus reader's take) counts this commit as seen,
                # instead of being woken by it afterwards for an empty claim.
                signal.notify(("data",) if topics is None else topics)
        finally:
            try:
                if noting is not None:
                    noting.commit_noted(expected)
            finally:
                self.pb_end_write()

    def _pb_data_version(self) -> int | None:
        """``PRAGMA data_version``: changes when another connection commits to the file."""
        try:
            row = self.execute("PRAGMA data_version").fetchone()
        except sqlite3.Error:
            return None
        return None if row is None else int(row[0])

    def rollback(self) -> None:
        try:
            super().rollback()
            self._pb_changes = self.total_changes  # a rolled-back write is not the next commit's
        finally:
            self.pb_end_write()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.pb_end_write()  # closed with its transaction open (an invalidated connection): SQLite undid it


def check_topics(topics: Iterable[str]) -> frozenset[str]:
    """``topics`` as a set, each one of :data:`TOPICS` (ValueError otherwise)."""
    chosen = frozenset(topics)
    unknown = sorted(chosen - set(TOPICS))
    if unknown:
        raise ValueError(f"unknown topic(s) {', '.join(map(repr, unknown))}; known: {', '.join(TOPICS)}")
    return chosen


def _notifying(conn: Any) -> NotifyingConnection | None:
    """The SQLite connection under ``conn`` (a SQLAlchemy connection) whose commits signal, if it is one."""
    dbapi_conn = getattr(getattr(conn, "connection", None), "dbapi_connection", None)
    return dbapi_conn if isinstance(dbapi_conn, NotifyingConnection) else None


def mark_about(conn: Any, *topics: str) -> None:
    """Mark the open transaction of ``conn`` (a SQLAlchemy connection) as about ``topics`` (SQLite; else
    nothing): its commit wakes only the waiters for those."""
    chosen = check_topics(topics)
    dbapi_conn = _notifying(conn)
    if dbapi_conn is not None:
        dbapi_conn.pb_topics = chosen


def add_topics(conn: Any, *topics: str) -> None:
    """Add ``topics`` to what the open transaction of ``conn`` (a SQLAlchemy connection) is about (SQLite; else
    nothing): a transaction that several writers share (the event scheduler's evaluation inside the bus's take)
    wakes the waiters of each one's topics. No topic: ``data``, as a write through the plain engine."""
    chosen = check_topics(topics or ("data",))
    dbapi_conn = _notifying(conn)
    if dbapi_conn is not None:
        had = dbapi_conn.pb_topics
        dbapi_conn.pb_topics = (frozenset({"data"}) if had is None else had) | chosen


_signals: dict[Path, ChangeSignal] = {}
_signals_lock = threading.Lock()


def database_path(engine: Engine) -> Path | None:
    """The database file of a SQLite engine (None: not SQLite, or in memory)."""
    if engine.dialect.name != "sqlite":
        return None
    name = engine.url.database
    if not name or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(name).resolve()


def change_signal(engine: Engine) -> ChangeSignal | None:
    """The process's signal for ``engine``'s SQLite database file (None: not a SQLite file)."""
    path = database_path(engine)
    if path is None:
        return None
    with _signals_lock:
        signal = _signals.get(path)
        if signal is None:
            signal = _signals[path] = ChangeSignal(path)
        return signal


def changes_of(engine: Engine, *topics: str) -> TopicView | None:
    """What a waiter for ``topics`` waits on for ``engine``'s SQLite database file (None: not a SQLite file)."""
    signal = change_signal(engine)
    return None if signal is None else signal.view(*topics)


def remove_journal(engine: Engine) -> bool:
    """Delete the topic journal of ``engine``'s SQLite database file (``uninstall``); whether there was one. A
    pollbridge process still running makes it again with its next commit."""
    path = database_path(engine)
    if path is None:
        return False
    signal = _signals.get(path)
    if signal is not None:
        with signal._journal_lock:
            if signal._journal is not None and signal._journal >= 0:
                os.close(signal._journal)  # pollbridge's own file: no SQLite lock lives on it
            signal._journal = None
    try:
        os.unlink(f"{path}{JOURNAL_SUFFIX}")
    except FileNotFoundError:
        return False
    return True
