"""What a ``pollbridge`` command imports at start-up: only what it runs.

A short command (``pollbridge signal``, run once per approval; ``--version``) paid for every other
command's modules at each start: 694 ms of CPU for a ``signal`` on this machine, 411 ms once the command
modules and the components were imported only where used (docs/benchmarks.md, "CLI start-up").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from bridge.cli.common import PollbridgeGroup
from bridge.cli.main import LAZY_COMMANDS, cli

#: Modules only some commands need; none of them is the signal's or the version's business.
HEAVY = ("bridge.app.install", "bridge.capture.wal", "bridge.capture.relay", "bridge.rollout.guardian",
         "bridge.reconcile.report", "event_scheduler.scheduler", "legacy_poller.poller", "bridge.serve.app",
         "starlette", "bridge.cli.reconcile", "bridge.cli.serve", "bridge.cli.observe")


def _imported_by(*args: str, code: int = 0) -> set[str]:
    """The modules a fresh interpreter holds after running ``pollbridge ARGS`` (through click's runner), which
    must exit ``code``."""
    code_text = ("import json, sys\n"
            "from click.testing import CliRunner\n"
            "from bridge.cli.main import cli\n"
            f"result = CliRunner().invoke(cli, {list(args)!r})\n"
            f"assert result.exit_code == {code}, (result.exit_code, result.output)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", code_text], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_a_short_command_does_not_import_the_other_commands_modules(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'startup.db'}"
    assert CliRunner().invoke(cli, ["--database-url", database, "init", "--demo-schema"]).exit_code == 0
    # A signal run through to its lookup (a task that does not exist: exit 2, one line), and two that stop early.
    for args, code in ((("--database-url", database, "signal", "999999", "--kind", "callback"), 2),
                       (("signal", "--help"), 0), (("--version",), 0)):
        loaded = _imported_by(*args, code=code)
        assert not loaded & set(HEAVY), f"pollbridge {' '.join(args)} imported {sorted(loaded & set(HEAVY))}"
        if "999999" in args:
            assert "event_scheduler.signals" in loaded  # it did run the signal's code


def test_the_full_help_lists_every_command_and_loads_each_lazy_one() -> None:
    loaded = _imported_by("--help")
    assert {module.partition(":")[0] for module in LAZY_COMMANDS.values()} <= loaded
    output = CliRunner().invoke(cli, ["--help"]).output
    for name in [*LAZY_COMMANDS, "init", "signal", "relay", "scheduler", "dlq"]:
        assert f"\n  {name} " in output, f"{name} missing from --help"


def test_each_lazy_command_resolves_to_the_command_of_its_name() -> None:
    ctx = click.Context(cli)
    for name in LAZY_COMMANDS:
        command = cli.get_command(ctx, name)
        assert command is not None and command.name == name
    assert cli.get_command(ctx, "no-such-command") is None


def test_a_lazy_entry_that_names_the_wrong_command_is_an_error_not_another_command() -> None:
    group = PollbridgeGroup("g", lazy={"status": "bridge.cli.observe:explain"})
    with pytest.raises(RuntimeError, match="not the command 'status'"):
        group.get_command(click.Context(group), "status")
