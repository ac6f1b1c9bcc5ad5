"""A private PostgreSQL server for a fault test that must restart or crash the database: the machine's server is
shared with every other test running in parallel, so a test never restarts that one.

``initdb`` in a temporary directory (as the ``postgres`` user when the tests run as root: PostgreSQL refuses to
run as root), logical decoding on, trust authentication on 127.0.0.1 and a free port; ``pg_ctl`` starts,
restarts and stops it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support.ports import free_port

CONF = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{dir}'
wal_level = logical
max_replication_slots = 8
max_wal_senders = 8
track_commit_timestamp = on
max_slot_wal_keep_size = '1GB'
shared_buffers = '32MB'
fsync = on
"""


def _bin(name: str) -> str:
    """A PostgreSQL server binary (initdb, pg_ctl): on PATH, or Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which(name)
    if found:
        return found
    root = Path("/usr/lib/postgresql")
    for version in sorted(root.iterdir(), reverse=True) if root.is_dir() else []:
        candidate = version / "bin" / name
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(f"{name} (PostgreSQL's server binaries)")


class PrivatePostgres:
    def __init__(self) -> None:
        self.initdb, self.pg_ctl = _bin("initdb"), _bin("pg_ctl")
        self.root = Path(tempfile.mkdtemp(prefix="pb-private-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.root, "postgres", "postgres")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> None:
        done = subprocess.run([*self._as, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed: {(done.stderr or done.stdout).strip()[-800:]}")

    def start(self) -> None:
        if not (self.data / "PG_VERSION").exists():
            self._run(self.initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                      "--no-instructions")
            with (self.data / "postgresql.conf").open("a") as conf:
                conf.write(CONF.format(port=self.port, dir=self.root))
        self._run(self.pg_ctl, "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")

    def restart(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown (sessions ended, a checkpoint); ``immediate``: a crash, recovered at start."""
        self._run(self.pg_ctl, "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "-m", mode,
                  "restart")

    def log(self, tail: int = 4000) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run([*self._as, self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                           capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)
