"""Locks on files beside a SQLite database: who is alive, without a statement.

The embedded default runs on one host: SQLite's WAL mode, which pollbridge sets, works only there (its
readers and writers share the ``-shm`` file through memory; https://www.sqlite.org/wal.html, "Disadvantages").
So every pollbridge process of one SQLite installation can see the same file locks, and a lock the kernel
holds for a process is the cheapest honest liveness there is: it is released the moment the process dies
(SIGKILL included, its descriptors close), and holding it costs the database nothing. Before this, a
relay proved it was alive by renewing a lease row every 2.5 s, a write transaction (``BEGIN IMMEDIATE``
and an ``UPDATE``), which also woke every process's watcher: 0.8 of the idle embedded event path's 4.4
statements a second (``python -m bench.cost --rates 0 --configs embedded``, issue 20).

A lock is ``flock(2)`` on its own file, ``<database>-pollbridge_lock_<name>``: ``flock`` locks belong to
the open file description, so two holders in one process (tests, ``run-all``) exclude each other as two
processes do, and closing the descriptor releases the lock. The holder's name is written into the file
for whoever asks who holds it. A file removed while held (``uninstall`` beside a running process) would let a
second holder lock a new file of the same name: :meth:`FileLock.held` compares the path's inode with the
held descriptor's, so the first holder sees it lost the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

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

    def acquire(self, holder: str) -> bool:
        """Take the lock without waiting; write ``holder`` into the file. True if held now."""
        if self.held():
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        self._fd = fd
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

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


def holder_of(path: Path) -> str | None:
    """Who holds the lock on ``path`` ("" when the holder wrote no name); None when nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 256, 0).decode(errors="replace").strip()
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def remove_locks(engine: Engine) -> list[Path]:
    """Delete the lock files of ``engine``'s SQLite database file (``uninstall``); the paths removed."""
    path = database_path(engine)
    if path is None:
        return []
    removed = []
    for lock in sorted(path.parent.glob(f"{path.name}{LOCK_INFIX}*")):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            removed.append(lock)
    return removed


__all__ = ["LOCK_INFIX", "FileLock", "holder_of", "lock_path", "remove_locks"]
