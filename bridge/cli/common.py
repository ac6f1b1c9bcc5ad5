"""What every ``pollbridge`` subcommand shares: the group's error handling, the settings and components
of the invocation, shared options and helpers.

:mod:`bridge.cli.main` (the group and its own commands) and each subcommand module import this module,
and none of them imports :mod:`bridge.cli.main` back.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console

from bridge.core.errors import ConfigError, PollbridgeError, first_line
from bridge.core.settings import Settings, load_settings
from bridge.core.urls import mask_url

if TYPE_CHECKING:
    from bridge.app.components import Components

err_console = Console(stderr=True)

JSON_OPTION = click.option("--json", "as_json", is_flag=True, envvar="POLLBRIDGE_JSON", show_envvar=True,
                           help="Machine-readable output.")


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"pollbridge: error: {message}", err=True)
    sys.exit(code)


class WholeHelpGroup(click.Group):
    """A group whose ``--help`` lists each command with its short help whole (wrapped, never cut with "...")."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class PollbridgeGroup(WholeHelpGroup):
    """Turns :class:`PollbridgeError` into a one-line message and its exit code, and imports the module of a
    command in ``lazy`` (name → ``"module:attribute"``) only when that command is run or listed.

    Why lazily: each command module imports what its commands need (the reconciler's report, the web server,
    the guardian), and a command such as ``pollbridge signal``, run once per approval, paid for all of them
    at every start (issue 20 names the CLI's start-up as a cost taken from the pipeline on two cores)."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            module, _, attribute = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attribute)
            if not isinstance(command, click.Command) or command.name != cmd_name:
                raise RuntimeError(f"{self.lazy[cmd_name]} is not the command {cmd_name!r}")
            self.add_command(command)
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PollbridgeError as exc:
            fail(str(exc), exc.exit_code)
        except Exception as exc:
            # An outage in the middle of a command (a connection terminated, Redis gone) is one line, exit 1;
            # the text of the error never carries the password, and any URL in it is masked.
            import redis
            from sqlalchemy.exc import OperationalError

            if not isinstance(exc, OperationalError | redis.RedisError):
                raise
            reason = first_line(exc)
            fail(f"{'database' if isinstance(exc, OperationalError) else 'bus'} error: {mask_urls(reason)}", 1)


def confirm(question: str) -> bool:
    """Ask on stderr (stdout stays the command's output, JSON included); no answer (end of input) is a no.
    When the answer is not echoed (input from a pipe), the question's line is ended, so an error after a
    no is still a line of its own."""
    try:
        answer = click.confirm(question, err=True)
    except click.Abort:
        answer = False
    if not sys.stdin.isatty():
        click.echo(err=True)
    return answer


def mask_urls(text: str) -> str:
    """``text`` with every URL in it masked."""
    return re.sub(r"[a-z][a-z0-9+.-]*://\S+", lambda m: mask_url(m.group(0)), text)


def settings_of(ctx: click.Context) -> Settings:
    """The settings of this invocation (loaded once, from the root command's options)."""
    obj = ctx.find_root().obj
    if obj.get("settings") is None:
        obj["settings"] = load_settings(obj["config"], database_url=obj["database_url"], bus_url=obj["bus_url"])
    settings: Settings = obj["settings"]
    return settings


def components_of(ctx: click.Context) -> Components:
    """The composition root for this invocation's settings."""
    from bridge.app.components import Components

    return Components(settings_of(ctx))


def bus_error(ctx: click.Context, exc: BaseException) -> None:
    """A bus that cannot be reached (refused, TLS to a plain server, timeout) is one line, exit 1."""
    import redis

    if isinstance(exc, redis.RedisError | OSError):
        url = mask_url(settings_of(ctx).bus_url)
        reason = first_line(exc)
        fail(f"cannot reach the bus {url}: {reason}", 1)


def stop_on_signals() -> threading.Event:
    """An event set on SIGTERM or SIGINT: how a long-running command is told to stop cleanly."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        logging.getLogger("pollbridge").info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def check_output_path(path: str, option: str = "--output") -> Path:
    """The file an option names to write, checked before any work is done: its folder exists and may be
    written, and the file itself (if it exists) is a file that may be written. Bad input: exit 2."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ConfigError(f"{option} {path}: is a directory; give a file name")
    if not folder.is_dir():
        raise ConfigError(f"{option} {path}: the folder {str(folder)!r} does not exist")
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(f"{option} {path}: the file cannot be written (permission denied)")
    if not target.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: the folder {str(folder)!r} cannot be written (permission denied)")
    return target


def write_output(target: Path, text: str, option: str = "--output") -> None:
    """Write ``text`` to a file checked by :func:`check_output_path`; a failure (disk full, the folder
    removed meanwhile) is one line, exit 1."""
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        fail(f"{option} {target}: cannot write: {exc.strerror or first_line(exc)}", 1)
