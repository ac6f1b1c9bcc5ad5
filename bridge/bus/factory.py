"""Opening a bus from its URL: ``embedded`` (a log in pollbridge's database) or ``redis://`` / ``rediss://``."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from sqlalchemy.engine import Engine

from bridge.bus.abc import EventBus
from bridge.exceptions import ConfigError

SUPPORTED_SCHEMES = ("embedded", "redis", "rediss", "unix")


def bus_scheme(url: str) -> str:
    return "embedded" if url == "embedded" else urlsplit(url).scheme


def validate_bus_url(url: str) -> None:
    """Raise :class:`ConfigError` for a URL whose scheme no backend handles, listing the supported ones."""
    scheme = bus_scheme(url)
    if scheme not in SUPPORTED_SCHEMES:
        from bridge.db import mask_url

        raise ConfigError(
            f"unsupported bus URL {mask_url(url)!r}: scheme {scheme or '(none)'!r}; supported: "
            "'embedded', redis://host:6379/0, rediss://host:6380/0 (TLS), unix:///path/redis.sock"
        )


def open_bus(url: str, *, engine: Engine | None = None, partitions: int = 8, namespace: str = "pollbridge",
             **options: Any) -> EventBus:
    """Open the bus named by ``url``. The embedded bus needs the database ``engine`` it lives in."""
    validate_bus_url(url)
    if url == "embedded":
        if engine is None:
            raise ConfigError("the embedded bus needs the database engine it lives in")
        from bridge.bus.embedded import EmbeddedBus

        return EmbeddedBus(engine, partitions=partitions, **options)
    from bridge.bus.redis_streams import RedisStreamsBus

    return RedisStreamsBus(url, partitions=partitions, namespace=namespace, **options)
