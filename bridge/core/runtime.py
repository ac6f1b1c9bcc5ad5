"""Process-level set-up for pollbridge's long-running commands (relay, scheduler, poller, guardian, run-all)."""

from __future__ import annotations

import faulthandler
import gc
import signal
import sys


def settle_heap() -> None:
    """Collect once, then move everything start-up allocated out of the garbage collector's sight.

    Call it in a long-running command just before its loop, never in a library or a test process.
    Python's full collection walks every tracked object; after start-up that is hundreds of thousands
    (SQLAlchemy, redis-py, prometheus-client, the reflected tables) that live as long as the process.
    Measured in ``bench.scheduler`` at 500 completions/s (a ``gc.callbacks`` probe): full collections
    paused the relay for up to 100 ms and each scheduler for up to 110 ms; after the freeze they took
    1 to 2 ms. Frozen objects are never collected, which is what they are meant for; what the loop
    allocates later is collected as before."""
    gc.collect()
    gc.freeze()


def enable_stack_dumps() -> None:
    """``kill -USR1 PID`` writes every thread's stack to the process's stderr, and the process goes on.

    For a process that looks stuck (no progress, nothing in its log): where each thread waits tells a
    lock wait from a busy loop from an idle one, without a debugger on a production host. Written by
    the interpreter's signal handler, so it works even when Python code cannot run (a thread holding
    the GIL in C). Not available on Windows (no SIGUSR1)."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None:
        return
    # faulthandler writes to a file descriptor: under click's CliRunner (tests, embedding) sys.stderr is an
    # in-memory stream without one, and the process's own stderr is the one to use; with none, no dumps.
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                faulthandler.register(usr1, file=stream.fileno(), all_threads=True)
                return
        except (AttributeError, OSError, ValueError, RuntimeError):
            continue
