"""The composition root: components built from settings in one place, with one bus timeout."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import bridge.bus.factory as bus_factory  # the composition root imports open_bus where it opens a bus
from bridge.app.components import BUS_TIMEOUT, Components
from bridge.core.errors import ConfigError
from bridge.core.settings import BusSettings, RouterSettings, Settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bridge", "event_scheduler", "legacy_poller", "pollbridge")
ROOT_MODULE = Path("bridge/app/components.py")


def _calls(name: str) -> list[tuple[Path, ast.Call]]:
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    func = node.func
                    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) \
                        else None
                    if called == name:
                        found.append((path.relative_to(ROOT), node))
    return found


def test_only_the_composition_root_opens_a_bus_from_settings() -> None:
    assert {str(path) for path, _ in _calls("open_bus")} == {str(ROOT_MODULE)}


def test_only_the_composition_root_configures_a_flag_store() -> None:
    """Elsewhere a flag store is only a library default (``FlagStore(engine)`` when the caller gave none)."""
    configured = [f"{path}:{call.lineno}" for path, call in _calls("FlagStore") if call.keywords or len(call.args) > 1]
    assert configured == [f"{ROOT_MODULE}:{call.lineno}" for path, call in _calls("FlagStore") if path == ROOT_MODULE]


def test_one_bus_timeout() -> None:
    defined = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) else []
                if any(isinstance(t, ast.Name) and t.id == "BUS_TIMEOUT" for t in targets):
                    defined.append(path.relative_to(ROOT))
    assert defined == [ROOT_MODULE]


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    calls: list[tuple[str, dict[str, Any]]] = []

    def fake_open_bus(url: str, **kwargs: Any) -> Any:
        calls.append((url, kwargs))
        if "127.0.0.1:1" in url:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        return object()

    monkeypatch.setattr(bus_factory, "open_bus", fake_open_bus)
    return calls


def test_the_bus_follows_the_settings_and_gets_a_timeout_only_when_asked(
        opened: list[tuple[str, dict[str, Any]]]) -> None:
    engine = sa.create_engine("sqlite://")
    redis = Components(Settings(bus_url="redis://h:6379/0", bus=BusSettings(partitions=3, namespace="ns")))
    redis.bus(engine)
    redis.bus_opener(engine)()
    Components(Settings()).bus(engine, timeout=BUS_TIMEOUT)  # embedded: no socket timeout to give
    Components(Settings(bus=BusSettings(listen=False))).bus(engine)
    assert opened == [
        ("redis://h:6379/0", {"engine": engine, "partitions": 3, "namespace": "ns"}),
        ("redis://h:6379/0", {"engine": engine, "partitions": 3, "namespace": "ns", "socket_timeout": BUS_TIMEOUT}),
        ("embedded", {"engine": engine, "partitions": 8, "namespace": "pollbridge", "listen": True}),
        ("embedded", {"engine": engine, "partitions": 8, "namespace": "pollbridge", "listen": False}),
    ]


def test_an_optional_bus_that_cannot_be_opened_says_why_masked(opened: list[tuple[str, dict[str, Any]]]) -> None:
    engine = sa.create_engine("sqlite://")
    missing = Components(Settings(bus_url="redis://:pw@127.0.0.1:1/0")).optional_bus(engine)
    assert missing.bus is None and missing.label == "redis://:***@127.0.0.1:1/0"
    assert missing.error is not None
    assert missing.error.startswith("bus redis://:***@127.0.0.1:1/0 could not be opened: ")
    missing.close()  # nothing to close
    present = Components(Settings(bus_url="redis://h:6379/0")).optional_bus(engine)
    assert present.bus is not None and present.error is None


def test_a_bad_bus_url_stays_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(url: str, **_: Any) -> Any:
        raise ConfigError(f"unsupported bus URL {url!r}")

    monkeypatch.setattr(bus_factory, "open_bus", refuse)
    with pytest.raises(ConfigError):
        Components(Settings()).optional_bus(sa.create_engine("sqlite://"))


def test_flag_store_and_router_follow_the_settings() -> None:
    engine = sa.create_engine("sqlite://")
    c = Components(Settings(router=RouterSettings(grace=7.0, refresh_interval=0.5, fallback_interval=9.0)))
    assert c.flag_store(engine).default_grace == 7.0
    router = c.flag_router(engine)
    assert (router.store.default_grace, router.refresh_interval, router.fallback_interval) == (7.0, 0.5, 9.0)
