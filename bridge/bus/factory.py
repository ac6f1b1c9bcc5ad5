"""Opening a bus from its URL: ``embedded`` (a log in pollbridge's database), ``redis://`` / ``rediss://`` /
``unix://`` (Redis Streams) or ``amqp://`` / ``amqps://`` (RabbitMQ streams)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from bridge.bus.base import EventBus
from bridge.core.errors import ConfigError
from bridge.core.urls import SUPPORTED_SCHEMES, bus_scheme, validate_bus_url

__all__ = ["SUPPORTED_SCHEMES", "bus_scheme", "open_bus", "validate_bus_url"]



def open_bus(url: str, *, engine: Engine | None = None, partitions: int = 8, namespace: str = "pollbridge",
             **options: Any) -> EventBus:
    """Open the bus named by ``url``. The embedded bus needs the database ``engine`` it lives in."""
    validate_bus_url(url)
    if url == "embedded":
        if engine is None:
            raise ConfigError("the embedded bus needs the database engine it lives in")
        from bridge.bus.embedded import EmbeddedBus

        return EmbeddedBus(engine, partitions=partitions, **options)
    if bus_scheme(url) in ("amqp", "amqps"):
        from bridge.bus.rabbitmq import RabbitMQBus

        return RabbitMQBus(url, partitions=partitions, namespace=namespace, **options)
    from bridge.bus.redis_streams import RedisStreamsBus

    return RedisStreamsBus(url, partitions=partitions, namespace=namespace, **options)
