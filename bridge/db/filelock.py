"""Locks on files beside a SQLite database: who is alive, without a statement.

The embedded default runs on one host: SQLite's WAL mode, which pollbridge sets, works only there (its
readers and writers share the ``-shm`` file through memory; https://www.sqlite.org/wal.html, "Disadvantages").
So every pollbridge process of one SQLite installation can see the same file locks, and a lock the kernel
holds for a process is the cheapest honest liveness there is: it is released the moment the process dies
(SIGKILL included, its descriptors close), and holding it costs the database nothing. Before this, a
relay proved it was alive by renewing a lease row every 2.5 s, a write transaction (``BEGIN IMMEDIATE``
and an ``UPDATE``): 0.8 of the idle embedded event path's 4.4 statements a second (``python -m bench.cost
--rates 0 --configs embedded``, issue 20), and a scheduler by a lease round of six statements.

A lock is ``flock(2)`` on its own file, ``<database>-pollbridge_lock_<name>``: ``flock`` locks belong to
the open file description, so two holders in one process (tests, ``run-all``) exclude each other as two
processes do, and closing the descriptor releases the lock. The holder's name is written into the file
for whoever asks who holds it, and the holder touches the file's modification time whenever it proves it is
working (the relay at each leadership check, a scheduler at each lease round): a process that holds a lock
but stopped working is told from a live one by that time (``status``, the checks). A file removed while held
(``uninstall`` beside a running process) would let a second holder lock a new file of the same name:
:meth:`FileLock.held` compares the path's inode with the held descriptor's, so the first holder sees it lost
the lock.

All of a SQLite installation's relays and schedulers must run one version of this: an older one leads by the
lease rows and does not see the locks (stop them all before upgrading).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import time
import weakref
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from bridge.db.changes import database_path

#: The lock files' names: the database file's name, then this, then the lock's name.
LOCK_INFIX = "-pollbridge_lock_"


def lock_path(engine: Engine, name: str) -> Path | None:
    """The lock file ``name`` of ``engine``'s SQLite database file (None: not a SQLite file)."""
    path = database_path(engine)
    return None if path is None else Path(f"{path}{LOCK_INFIX}{name}")


class FileLock:
    """An exclusive lock this object holds on one lock file (not thread-safe: one owner)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._closer: weakref.finalize[Any, FileLock] | None = None

    def acquire(self, holder: str) -> bool:
        """Take the lock without waiting; write ``holder`` into the file. True if held now."""
        if self.held():
            return True
        fd = _open(self.path)
        try:
            if not _try_lock(fd, fcntl.LOCK_EX):
                os.close(fd)
                return False
            with contextlib.suppress(OSError):  # a file others created read-only for us: held, without a name
                name = holder.encode()
                os.pwrite(fd, name, 0)  # the new name over the old, then cut: never an empty file between
                os.ftruncate(fd, len(name))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # A FileLock dropped without release() lets go of its lock when it is collected, as a process's exit does.
        self._closer = weakref.finalize(self, _close, fd)
        return self.held()  # False if the file was removed between our open and our lock: the next try makes it

    def held(self) -> bool:
        """Whether this object still holds the lock of the file at :attr:`path` (a ``stat``, no statement)."""
        if self._fd is None:
            return False
        try:
            same = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except OSError:
            same = False
        if not same:
            self.release()
        return same

    def touch(self) -> None:
        """Mark the holder alive now (the file's modification time; a ``futimens``, no statement): a process
        that holds a lock but stopped working (stalled, stuck) is told from a working one by this time."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.utime(self._fd)

    def release(self) -> None:
        if self._closer is not None:
            self._closer()  # closing the descriptor releases the lock
            self._closer = None
        self._fd = None


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock file ("" when the holder could write no name) and when it last touched it (aware UTC)."""

    name: str
    touched_at: datetime


def holder_of(path: Path) -> LockHolder | None:
    """Who holds the lock on ``path``; None when nobody holds it (or there is no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        # A shared lock taken to ask: a taker that meets it fails for that moment and retries (_try_lock).
        if _try_lock(fd, fcntl.LOCK_SH, retry=False):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        touched = datetime.fromtimestamp(os.fstat(fd).st_mtime, UTC)
        return LockHolder(os.pread(fd, 256, 0).decode(errors="replace").strip(), touched)
    finally:
        os.close(fd)


def remove_locks(engine: Engine) -> list[Path]:
    """Delete the lock files of ``engine``'s SQLite database file (``uninstall``); the paths removed."""
    path = database_path(engine)
    if path is None:
        return []
    removed = []
    for lock in sorted(path.parent.glob(f"{glob.escape(path.name)}{LOCK_INFIX}*")):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            removed.append(lock)
    return removed


def _open(path: Path) -> int:
    """Open (creating it with the database file's permissions, as SQLite does its ``-wal`` and ``-shm``: a
    database shared by a group stays usable by each of its users) or, when only reading is allowed, read only."""
    database = Path(str(path).split(LOCK_INFIX, 1)[0])
    try:
        mode = database.stat().st_mode & 0o666
    except OSError:
        mode = 0o644
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        try:
            return os.open(path, os.O_RDWR)
        except PermissionError:
            return os.open(path, os.O_RDONLY)  # flock needs no write access
    with contextlib.suppress(OSError):
        os.fchmod(fd, mode)  # past the umask, as SQLite does
    return fd


def _try_lock(fd: int, kind: int, retry: bool = True) -> bool:
    """``flock`` without waiting; once more 10 ms later when ``retry`` (someone asking who holds it holds a
    shared lock for a moment)."""
    for attempt in range(2 if retry else 1):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt == 0 and retry:
                time.sleep(0.01)
    return False


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


__all__ = ["LOCK_INFIX", "FileLock", "LockHolder", "holder_of", "lock_path", "remove_locks"]
