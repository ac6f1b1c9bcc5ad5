"""Errors of the bridge package.

Every error an operator can cause (bad configuration, a mapping that does not match the database,
an unreachable server) is a :class:`PollbridgeError`; the CLI prints its message on one line and
exits with its ``exit_code``, without a traceback. Messages say what was wrong and what to do.
"""

from __future__ import annotations


class PollbridgeError(Exception):
    """An expected error: printed as one line, no traceback."""

    exit_code = 1


class ConfigError(PollbridgeError):
    """The configuration (file, environment or flags) is invalid. A usage error: exit 2."""

    exit_code = 2


class MappingError(ConfigError):
    """The task-table mapping is invalid in itself (bad identifier, status mapped twice, ...)."""


class MappingMismatch(PollbridgeError):
    """The mapping names a table or column the database does not have."""


class DatabaseUnavailable(PollbridgeError):
    """The database cannot be reached. The message carries the URL with its password masked."""


class SchemaNotInstalled(PollbridgeError):
    """pollbridge's own objects are missing or not at the migration head: run ``pollbridge init``."""


class WorkloadError(PollbridgeError):
    """A workflow definition is invalid: a dependency cycle or a dependency on an unknown task key.

    Bad input, so a usage error (exit 2)."""

    exit_code = 2


class FlagError(PollbridgeError):
    """A flag change that is bad input: unknown phase, bad type name or percentage, a skipped step
    without ``--force``, a missing reason. Nothing is changed; exit 2."""

    exit_code = 2


class ReviewError(PollbridgeError):
    """A review-queue command with bad input (an id that is not a task id, no reason for a rejection).
    Nothing is changed; exit 2."""

    exit_code = 2


class GateRefused(PollbridgeError):
    """A promotion the reconciler's evidence does not support. Nothing is changed; exit 1.

    ``gate`` carries the :class:`bridge.reconcile.gate.GateResult` with every criterion."""

    exit_code = 1
    gate: object = None


class FlagStoreUnavailable(PollbridgeError):
    """The flag store cannot be read (database down, schema missing). Pollers then treat every type as
    ``polling``; the event path keeps the last flags it read."""


def first_line(exc: BaseException) -> str:
    """An error as one line: the first non-empty line of its message (a wrapped DBAPI error's own message
    when SQLAlchemy wrapped one), or its class name when the message is empty."""
    orig = getattr(exc, "orig", None)
    source: BaseException = orig if isinstance(orig, BaseException) else exc
    for line in str(source).splitlines():
        if line.strip():
            return line.strip()
    return type(source).__name__
