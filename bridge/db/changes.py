"""Wake-ups when a SQLite database changes, without asking the database.

SQLite has no NOTIFY. Without a signal, every component of the embedded default polled for the others:
the relay for outbox rows, the bus's readers for entries, the flag router for flags, about 60 idle
statements a second for the event path alone (issue 20). A :class:`ChangeSignal` per database file and
process replaces those polls with two signals:

* **this process's commits**: every SQLite connection pollbridge opens is a :class:`NotifyingConnection`,
  which signals after a ``commit()`` that wrote rows (``total_changes`` moved), so a change made in
  ``run-all`` or ``demo`` wakes the relay, the scheduler and the workers at once;
* **other processes' commits**: while someone waits, one watcher thread per database reads the WAL-index
  header at the start of the ``-shm`` file every :data:`WATCH_INTERVAL`: its change counter ``iChange`` is
  incremented by every committing transaction (https://www.sqlite.org/walformat.html, "The WAL-Index
  Header"; native byte order, offset 8). A ``stat`` and a ``pread``, no statement, no lock. Without a
  header (a database not in WAL mode) it compares the size and modification time of the files instead.

**Quiet commits.** The leases pollbridge renews on SQLite (the relay's, the scheduler's partitions) are
commits no waiter cares about, yet idle they were the only commits, and every one woke every waiter into a
look: about ten statements a second. A commit through a :func:`bridge.db.engine.quiet` engine does not
signal, and tells the watcher which counter value is its own: read inside the transaction, while it holds
the database's one write lock (no other commit can come between), plus one. The watcher signals any value it
was not told about, so another process's commit is never taken for a quiet one (the worst case is the
opposite: a spurious wake-up, a look that finds nothing).

Waiters compare generations (``seen``), so a signal between their last look and their wait is never
missed. A waiter still looks now and then (its own fallback, seconds apart) against what a file signal
cannot promise (a database not in WAL mode, a file system that does not update what is watched).
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
#: Quiet commits remembered until the watcher meets their counter values.
QUIET_REMEMBERED = 1000


class ChangeSignal:
    """A generation counter for one database file in this process; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.generation = 0
        self._cond = threading.Condition()
        self._watcher: threading.Thread | None = None
        self._last_wait = 0.0
        self._shm: tuple[int, int] | None = None  # (descriptor, inode), the watcher's alone
        #: Counter values of this process's quiet commits the watcher has not met yet (bounded).
        self._quiet: collections.deque[int] = collections.deque(maxlen=QUIET_REMEMBERED)

    def notify(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.notify_all()

    def change_counter(self) -> int | None:
        """The WAL-index header's ``iChange`` now (None: no header to read)."""
        header = _read_header(self.path)
        return None if header is None else _counter(header)

    def expect_quiet(self, counter: int) -> None:
        """The counter value a quiet commit of this process made: the watcher does not signal it."""
        with self._cond:
            self._quiet.append(counter)

    def wait(self, seen: int, timeout: float) -> int:
        """Wait until the generation moves past ``seen`` (a commit here or in another process) or ``timeout``
        passes; returns the current generation."""
        self._watch()
        with self._cond:
            if self.generation == seen and timeout > 0:
                self._cond.wait(timeout)
            return self.generation

    def _watch(self) -> None:
        with self._cond:
            self._last_wait = time.monotonic()
            if self._watcher is not None and self._watcher.is_alive():
                return
            self._watcher = threading.Thread(target=self._run, name="pollbridge-sqlite-watch", daemon=True)
            self._watcher.start()

    def _header(self) -> bytes | None:
        """The WAL-index header, through a descriptor kept open (reopened when the ``-shm`` file was replaced:
        SQLite deletes it when its last connection closes)."""
        shm = f"{self.path}-shm"
        try:
            inode = os.stat(shm).st_ino
            if self._shm is None or self._shm[1] != inode:
                self._close_shm()
                self._shm = (os.open(shm, os.O_RDONLY), inode)
            return os.pread(self._shm[0], _HEADER_BYTES, 0)
        except OSError:
            self._close_shm()
            return None

    def _close_shm(self) -> None:
        if self._shm is not None:
            with contextlib.suppress(OSError):
                os.close(self._shm[0])
            self._shm = None

    def _files(self) -> tuple[Any, ...]:
        parts: list[Any] = []
        for suffix in ("", "-wal"):
            try:
                st = os.stat(f"{self.path}{suffix}")
                parts.append((st.st_size, st.st_mtime_ns, st.st_ino))
            except OSError:
                parts.append(None)
        return tuple(parts)

    def _signature(self) -> tuple[str, Any]:
        header = self._header()
        return ("counter", _counter(header)) if header is not None and len(header) >= 12 else ("files", self._files())

    def _changed(self, last: tuple[str, Any], now: tuple[str, Any]) -> bool:
        """Whether someone other than this process's quiet commits committed between two signatures."""
        if now == last:
            return False
        if last[0] != "counter" or now[0] != "counter":
            return True
        gap = (now[1] - last[1]) % 2**32
        with self._cond:
            quiet = set(self._quiet)
            if gap > len(quiet):
                return True
            ours = {(last[1] + i) % 2**32 for i in range(1, gap + 1)}
            if not ours <= quiet:
                return True
            for value in ours:
                self._quiet.remove(value)
            return False

    def _run(self) -> None:
        last = self._signature()
        while True:
            time.sleep(WATCH_INTERVAL)
            now = self._signature()
            if self._changed(last, now):
                self.notify()
            last = now
            with self._cond:
                if time.monotonic() - self._last_wait > WATCH_IDLE_STOP:
                    self._watcher = None
                    self._close_shm()
                    return


def _read_header(path: Path) -> bytes | None:
    try:
        fd = os.open(f"{path}-shm", os.O_RDONLY)
    except OSError:
        return None
    try:
        header = os.pread(fd, _HEADER_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return header if len(header) >= 12 else None


def _counter(header: bytes) -> int:
    return int(struct.unpack_from("=I", header, 8)[0])


class NotifyingConnection(sqlite3.Connection):
    """A SQLite connection that signals its database's :class:`ChangeSignal` after a commit that wrote rows
    (after, not before: a waiter woken before the commit would look and not find the change); a quiet commit
    (``pb_quiet``, set per transaction by :mod:`bridge.db.engine`) tells the signal its counter instead."""

    pb_signal: ChangeSignal | None = None
    pb_quiet = False
    _pb_changes = 0

    def commit(self) -> None:
        wrote = self.total_changes != self._pb_changes
        signal, quiet = self.pb_signal, self.pb_quiet
        self.pb_quiet = False
        # Inside the transaction, holding the write lock: no other commit can move the counter before ours.
        before = signal.change_counter() if signal is not None and wrote and quiet else None
        super().commit()
        if not wrote:
            return
        self._pb_changes = self.total_changes
        if signal is None:
            return
        if before is not None:
            signal.expect_quiet((before + 1) % 2**32)
        elif not quiet:
            signal.notify()


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
