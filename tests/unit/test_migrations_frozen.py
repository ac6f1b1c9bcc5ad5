"""Migrations are frozen: a revision does the same thing forever, whatever later happens to the live SQL.

A migration that rendered ``bridge/db/sql/*.sql`` through :mod:`bridge.db.sqlblocks` would change what an
old revision does (on a new install, or a downgrade) as soon as someone edits that file; its SQL must be
carried in the migration file itself, and a change to it is a new revision.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.resources
import pathlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, NoReturn

import pytest

import bridge.db.sqlblocks

VERSIONS = Path(__file__).resolve().parents[2] / "migrations" / "versions"
MIGRATIONS = sorted(p for p in VERSIONS.glob("*.py") if p.name != "__init__.py")

#: Calls that read a file or package data.
READERS = {"open", "read_text", "read_bytes", "files", "get_data", "open_text", "open_binary", "read_binary"}


def test_there_are_migrations() -> None:
    assert len(MIGRATIONS) >= 5


def _imports(tree: ast.AST) -> list[str]:
    """Every module (and ``module.name`` for ``from module import name``) the file imports."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("path", MIGRATIONS, ids=lambda p: p.name)
def test_a_migration_imports_no_live_sql(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    banned = ("bridge.db.sqlblocks", "importlib.resources", "pkgutil")
    for name in _imports(tree):
        assert not any(name == b or name.startswith(b + ".") for b in banned), (
            f"{path.name} imports {name}: a migration must carry its SQL frozen in the file itself")


@pytest.mark.parametrize("path", MIGRATIONS, ids=lambda p: p.name)
def test_a_migration_reads_no_sql_file(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert ".sql" not in node.value.lower(), f"{path.name} names a .sql file ({node.value!r})"
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            assert name not in READERS, f"{path.name} line {node.lineno}: {name}() reads a file"


class _Op:
    """Stands in for ``alembic.op``: records what a migration executes, accepts every other operation."""

    def __init__(self, dialect: str) -> None:
        self.executed: list[Any] = []
        self._bind = SimpleNamespace(dialect=SimpleNamespace(name=dialect))

    def get_bind(self) -> Any:
        return self._bind

    def execute(self, statement: Any, *args: Any, **kwargs: Any) -> None:
        self.executed.append(statement)

    @contextlib.contextmanager
    def batch_alter_table(self, *args: Any, **kwargs: Any) -> Iterator[_Op]:
        yield self  # its operations are recorded or accepted as the op's own

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _refuse(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("a migration read live SQL")


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
@pytest.mark.parametrize("path", MIGRATIONS, ids=lambda p: p.name)
def test_a_migration_runs_without_reading_live_sql(path: Path, dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upgrade and downgrade, with every way to the live SQL refused (an indirect one included)."""
    for name in ("load_blocks", "render"):
        monkeypatch.setattr(bridge.db.sqlblocks, name, _refuse)
    module = ModuleType(f"pollbridge_migration_{path.stem}")
    module.__file__ = str(path)
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)
    # Package data refused from here on (not while the file imports: a first import may read some).
    monkeypatch.setattr(importlib.resources, "files", _refuse)
    monkeypatch.setattr(pathlib.Path, "read_text", _refuse)
    for step in ("upgrade", "downgrade"):
        op = _Op(dialect)
        module.op = op  # type: ignore[attr-defined]
        getattr(module, step)()


def test_the_flags_migration_carries_its_routing_functions() -> None:
    """0005 creates (and drops) PostgreSQL's routing functions from SQL of its own, and none on SQLite."""
    path = VERSIONS / "0005_flags.py"
    module = ModuleType("pollbridge_migration_0005")
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)
    for dialect, up, down in (("postgresql", ["pollbridge_bucket", "pollbridge_poller_should_handle"],
                               ["pollbridge_poller_should_handle", "pollbridge_bucket"]),
                              ("sqlite", [], [])):
        op = _Op(dialect)
        module.op = op  # type: ignore[attr-defined]
        module.upgrade()
        assert [next(n for n in ("pollbridge_poller_should_handle", "pollbridge_bucket") if n in s)
                for s in op.executed] == up
        assert all(s.startswith("CREATE OR REPLACE FUNCTION") for s in op.executed)
        op = _Op(dialect)
        module.op = op  # type: ignore[attr-defined]
        module.downgrade()
        assert [next(n for n in ("pollbridge_poller_should_handle", "pollbridge_bucket") if n in s)
                for s in op.executed] == down
