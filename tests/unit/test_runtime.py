"""Process set-up of the long-running commands: the SIGUSR1 stack dump."""

from __future__ import annotations

import faulthandler
import io
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from bridge.core.runtime import enable_stack_dumps

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")


def test_a_stderr_without_a_file_descriptor_falls_back_to_the_process_stderr(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under click's CliRunner sys.stderr is in memory: registering must not fail the command."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    try:
        enable_stack_dumps()
        assert faulthandler.unregister(signal.SIGUSR1), "registered on the process's own stderr"
    finally:
        faulthandler.unregister(signal.SIGUSR1)


def test_no_stderr_at_all_means_no_dumps_and_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", None)
    monkeypatch.setattr(sys, "__stderr__", None)
    enable_stack_dumps()
    assert not faulthandler.unregister(signal.SIGUSR1)


def test_sigusr1_writes_every_threads_stack_and_the_process_goes_on() -> None:
    script = textwrap.dedent("""
        import os, signal, threading, time
        from bridge.core.runtime import enable_stack_dumps
        enable_stack_dumps()
        ready = threading.Event()
        def parked_in_a_named_function():
            ready.set()
            time.sleep(30)
        threading.Thread(target=parked_in_a_named_function, daemon=True).start()
        ready.wait()
        os.kill(os.getpid(), signal.SIGUSR1)
        print("still running")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "still running"
    assert "parked_in_a_named_function" in done.stderr and "Current thread" in done.stderr, done.stderr
