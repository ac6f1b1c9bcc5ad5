"""What every ``pollbridge`` subcommand shares: the group's error handling, the settings and components
of the invocation, shared options and helpers.

:mod:`bridge.cli.main` (the group and its own commands) and each subcommand module import this module,
and none of them imports :mod:`bridge.cli.main` back.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
from typing import Any, NoReturn

import click
from rich.console import Console

from bridge.app.components import Components
from bridge.core.errors import PollbridgeError, first_line
from bridge.core.settings import Settings, load_settings
from bridge.core.urls import mask_url

err_console = Console(stderr=True)

JSON_OPTION = click.option("--json", "as_json", is_flag=True, envvar="POLLBRIDGE_JSON", show_envvar=True,
                           help="Machine-readable output.")


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"pollbridge: error: {message}", err=True)
    sys.exit(code)


class PollbridgeGroup(click.Group):
    """Turns :class:`PollbridgeError` into a one-line message and its exit code."""

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
