"""Errors of the event scheduler package; messages say what was wrong and what to do."""

from __future__ import annotations

from bridge.core.errors import PollbridgeError


class SignalError(PollbridgeError):
    """A signal that cannot apply (unknown task, awaits none, already received, task done). Bad input: exit 2."""

    exit_code = 2


class DeadLetterError(PollbridgeError):
    """A dead-letter operation named an entry that does not exist."""

    exit_code = 2
