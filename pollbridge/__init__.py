"""pollbridge: move a workflow platform from a polling scheduler to an event-driven one.

The public face of the toolkit: ``import pollbridge`` for the library, ``python -m pollbridge`` (or the
``pollbridge`` command) for the command line. The names below are the ones the documentation tells
users to import; each is loaded on first use, so ``import pollbridge`` costs no SQLAlchemy import.
Everything else lives in ``bridge``, ``event_scheduler`` and ``legacy_poller`` (internal layout).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from bridge import __version__

if TYPE_CHECKING:
    from bridge.bus.factory import open_bus
    from bridge.core.events import CloudEvent
    from bridge.core.mapping import TaskTableMapping
    from bridge.core.settings import Settings, load_settings
    from bridge.flags.router import FlagRouter
    from bridge.flags.store import FlagStore
    from bridge.tasktable.tables import TaskTable, reflect_tables

# name -> the module that defines it (imported on first attribute access).
_LAZY: dict[str, str] = {
    "CloudEvent": "bridge.core.events",
    "FlagRouter": "bridge.flags.router",
    "FlagStore": "bridge.flags.store",
    "Settings": "bridge.core.settings",
    "TaskTable": "bridge.tasktable.tables",
    "TaskTableMapping": "bridge.core.mapping",
    "load_settings": "bridge.core.settings",
    "open_bus": "bridge.bus.factory",
    "reflect_tables": "bridge.tasktable.tables",
}

__all__ = [
    "CloudEvent",
    "FlagRouter",
    "FlagStore",
    "Settings",
    "TaskTable",
    "TaskTableMapping",
    "__version__",
    "load_settings",
    "open_bus",
    "reflect_tables",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
