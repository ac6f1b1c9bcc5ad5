"""One package face (issue 16): ``import pollbridge`` and ``python -m pollbridge``, and how the wheel is laid out.

The installed wheel itself (no top-level ``migrations``, the scripts inside ``pollbridge/``, ``init`` from a
folder holding its own ``migrations`` package) is tests/acceptance/test_package_face.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import bridge
import pollbridge
from bridge.db import migrate

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_") and k != "PYTHONPATH"}


def test_version_has_one_source() -> None:
    assert pollbridge.__version__ == bridge.__version__
    assert pollbridge.__version__.count(".") >= 2
    assert "version" not in PYPROJECT["project"], "the version is written in bridge/__init__.py only"
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert SETUPTOOLS["dynamic"]["version"] == {"attr": "bridge.__version__"}


def test_every_name_in_all_is_exposed() -> None:
    assert "__version__" in pollbridge.__all__
    assert pollbridge.__all__ == sorted(set(pollbridge.__all__)), "keep __all__ sorted, without repeats"
    for name in ("Settings", "TaskTableMapping", "TaskTable", "open_bus", "CloudEvent"):
        assert name in pollbridge.__all__, name
    for name in pollbridge.__all__:
        value = getattr(pollbridge, name)
        assert value is not None, name
        if name != "__version__":
            assert value.__name__ == name and value.__module__.startswith("bridge."), (name, value)
    assert set(dir(pollbridge)) >= set(pollbridge.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pollbridge.Nope  # noqa: B018


def test_star_import_gives_the_documented_names() -> None:
    namespace: dict[str, object] = {}
    exec("from pollbridge import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(pollbridge.__all__)


def test_import_pollbridge_is_light() -> None:
    """The classes load on first use: ``import pollbridge`` alone imports neither SQLAlchemy nor the CLI."""
    code = "import sys, pollbridge; print(sorted(m for m in ('sqlalchemy', 'click', 'alembic') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_python_m_pollbridge_is_the_cli(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pollbridge", "--help"], capture_output=True, text=True,
                          env=_env(), cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: pollbridge "), done.stdout
    assert "init" in done.stdout and "doctor" in done.stdout
    version = subprocess.run([sys.executable, "-m", "pollbridge", "--version"], capture_output=True, text=True,
                             env=_env(), cwd=tmp_path, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"pollbridge, version {pollbridge.__version__}"


def test_migrations_are_found_by_path_in_a_checkout() -> None:
    location = Path(migrate.script_location())
    assert location == ROOT / "migrations"
    assert (location / "env.py").is_file() and (location / "script.py.mako").is_file()
    assert sorted(location.glob("versions/0001_*.py"))
    assert "import_module" not in (ROOT / "bridge" / "db" / "migrate.py").read_text(encoding="utf-8")


def test_missing_scripts_are_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from bridge.core.errors import PollbridgeError

    monkeypatch.setattr(migrate, "_CANDIDATES", (tmp_path / "pollbridge" / "migrations", tmp_path / "migrations"))
    with pytest.raises(PollbridgeError, match="migration scripts are missing"):
        migrate.script_location()


def _package_dirs() -> dict[str, Path]:
    """Every directory the wheel must carry as a package, by the name it is installed under."""
    found: dict[str, Path] = {}
    roots = {"bridge": ROOT / "bridge", "event_scheduler": ROOT / "event_scheduler",
             "legacy_poller": ROOT / "legacy_poller", "pollbridge": ROOT / "pollbridge",
             "pollbridge.migrations": ROOT / "migrations"}
    for name, base in roots.items():
        found[name] = base
        for path in base.rglob("*"):
            rel = path.relative_to(base)
            named = all(p.isidentifier() and p != "__pycache__" for p in rel.parts)
            # A directory holding files (not a leftover holding only __pycache__).
            if path.is_dir() and named and any(f.is_file() for f in path.iterdir()):
                found[".".join([name, *rel.parts])] = path
    return found


def test_the_packages_list_matches_the_tree() -> None:
    """pyproject.toml lists the packages (a `find` cannot install migrations/ as pollbridge/migrations/):
    a new package directory missing from the list would silently be left out of the wheel."""
    listed = set(SETUPTOOLS["packages"])
    tree = _package_dirs()
    assert not set(tree) - listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(set(tree) - listed)}"
    assert not listed - set(tree), f"listed but not in the tree: {sorted(listed - set(tree))}"
    assert "migrations" not in listed and not any(p.startswith("migrations.") for p in listed)
    assert SETUPTOOLS["package-dir"] == {"pollbridge.migrations": "migrations"}
    assert "script.py.mako" in SETUPTOOLS["package-data"]["pollbridge.migrations"]
    assert "py.typed" in SETUPTOOLS["package-data"]["pollbridge"] and (ROOT / "pollbridge" / "py.typed").is_file()


def test_mypy_checks_pollbridge() -> None:
    assert "pollbridge" in PYPROJECT["tool"]["mypy"]["packages"]
