"""Validation of SQL identifiers that come from configuration.

Names of the user's tables and columns are never pasted into SQL: they are validated here and then
handed to SQLAlchemy, which quotes them. The rule is deliberately narrower than what PostgreSQL or
SQLite accept (letters, digits and underscores, not starting with a digit, at most 63 bytes) so a
name that is valid here is valid, and means the same thing, on both dialects.
"""

from __future__ import annotations

import re

from bridge.core.errors import MappingError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def validate_identifier(value: object, what: str) -> str:
    """Return ``value`` if it is a safe identifier, else raise :class:`MappingError` naming ``what``."""
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise MappingError(
            f"invalid identifier for {what}: {value!r}; use letters, digits and underscores "
            "(not starting with a digit, at most 63 characters)"
        )
    return value


def validate_optional_identifier(value: object, what: str) -> str | None:
    """Like :func:`validate_identifier`, but ``None`` or ``""`` mean "not mapped"."""
    if value is None or value == "":
        return None
    return validate_identifier(value, what)
