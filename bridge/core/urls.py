"""URLs in settings: which bus schemes exist, which namespaces are safe, and masking passwords.

Pure string checks, used by the settings (at load time, before anything connects) and by every layer
that prints a URL.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from sqlalchemy.engine import URL

from bridge.core.errors import ConfigError

SUPPORTED_SCHEMES = ("embedded", "redis", "rediss", "unix", "amqp", "amqps")
DEFAULT_NAMESPACE = "pollbridge"

# Letters, digits, '_', '-', '.': no ':' (the key separator), no '{' '}' (cluster hash tags), no glob
# characters, no whitespace or control bytes (the namespace is part of every Redis key).
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]{1,100}")

_CREDENTIALS = re.compile(r"^(?P<scheme>[A-Za-z][\w+.-]*://)(?P<user>[^:/@]*):(?P<password>.*)@(?P<rest>[^@]*)$",
                          re.DOTALL)
_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd|pwd)=)[^&#]*", re.IGNORECASE)


def mask_url(url: str | URL) -> str:
    """The URL as text with any password replaced by ``***``; safe for logs, errors and reports.

    Everything between ``user:`` and the *last* ``@`` is treated as the password, so a password
    with an unescaped ``@`` (a malformed URL, but a real secret) is still masked whole."""
    text = url.render_as_string(hide_password=False) if isinstance(url, URL) else str(url)
    # libpq and redis-py also take the password as a query parameter (?password=...).
    text = _QUERY_PASSWORD.sub(r"\1***", text)
    match = _CREDENTIALS.match(text)
    if match is None:
        return text
    return f"{match['scheme']}{match['user']}:***@{match['rest']}"


def bus_scheme(url: str) -> str:
    return "embedded" if url == "embedded" else urlsplit(url).scheme


def validate_bus_url(url: str) -> None:
    """Raise :class:`ConfigError` for a URL whose scheme no backend handles, listing the supported ones."""
    scheme = bus_scheme(url)
    if scheme not in SUPPORTED_SCHEMES:
        raise ConfigError(
            f"unsupported bus URL {mask_url(url)!r}: scheme {scheme or '(none)'!r}; supported: "
            "'embedded', redis://host:6379/0, rediss://host:6380/0 (TLS), unix:///path/redis.sock, "
            "amqp://user:password@host:5672/vhost (RabbitMQ), amqps://user:password@host:5671/vhost (TLS)"
        )


def validate_namespace(namespace: object) -> str:
    """The bus namespace, or :class:`ConfigError`: it is part of every Redis key."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise ConfigError(f"invalid bus namespace {namespace!r}: use 1-100 letters, digits, '_', '-' or '.'")
    return namespace
