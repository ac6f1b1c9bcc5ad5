"""The event bus: the interface (``abc``), the Redis Streams backend and the embedded backend."""

from __future__ import annotations

from bridge.bus.base import Delivery, EventBus
from bridge.bus.factory import SUPPORTED_SCHEMES, open_bus, validate_bus_url

__all__ = ["SUPPORTED_SCHEMES", "Delivery", "EventBus", "open_bus", "validate_bus_url"]
