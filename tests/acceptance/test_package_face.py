"""One package face (issue 16): ``python -m pollbridge`` from a user's folder, and what ``pip install .`` installs.

A user's project often holds its own Alembic ``migrations`` package. pollbridge's migrations are package
data inside ``pollbridge/`` found by path, so ``init`` and ``doctor`` work from such a folder, and the
wheel puts no top-level ``migrations`` into site-packages. One wheel is built and installed per session,
into a fresh venv (``--no-deps``: the dependencies come from this interpreter's site-packages through a
``.pth`` file).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What a checkout holds that `pip install .` must not see (a stale build/ would end up in the wheel).
NOT_SOURCE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".mypy_cache",
                                    ".ruff_cache", ".pytest_cache", ".hypothesis", "*.db", "*.db-*")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("POLLBRIDGE_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _user_folder(path: Path) -> Path:
    """A folder as a user's project has it: its own ``migrations`` package, whose env.py must never run."""
    (path / "migrations" / "versions").mkdir(parents=True)
    (path / "migrations" / "__init__.py").write_text('"""The user\'s own Alembic migrations."""\n')
    (path / "migrations" / "env.py").write_text('raise RuntimeError("pollbridge loaded the user\'s migrations")\n')
    (path / "migrations" / "versions" / "__init__.py").write_text("")
    return path


def _init_then_doctor(python: str, folder: Path) -> None:
    url = "sqlite:///x.db"
    init = _run([python, "-m", "pollbridge", "--database-url", url, "init", "--demo-schema"], folder)
    assert init.returncode == 0, init.stdout + init.stderr
    assert "migrated empty -> " in init.stdout, init.stdout
    doctor = _run([python, "-m", "pollbridge", "--database-url", url, "doctor"], folder)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "[ok] migrations: at head" in doctor.stdout, doctor.stdout
    assert "[fail]" not in doctor.stdout and "Traceback" not in doctor.stderr


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the venv's python, its site-packages) after `pip install .` of a copy of this checkout."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     base).stdout.strip())
    assert site.is_dir() and site.is_relative_to(venv), site
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                      "--disable-pip-version-check", str(source)], base, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # The dependencies: this interpreter's site-packages, after the venv's own (no editable finder: .pth
    # files of a directory a .pth adds are not read).
    (site / "zz_pollbridge_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


def test_init_and_doctor_from_a_folder_with_its_own_migrations(tmp_path: Path) -> None:
    """This checkout (the editable install), run as `python -m pollbridge` from the user's folder."""
    _init_then_doctor(sys.executable, _user_folder(tmp_path))


@pytest.mark.slow
def test_the_wheel_installs_no_top_level_migrations(installed: tuple[Path, Path]) -> None:
    _, site = installed
    assert not (site / "migrations").exists(), sorted(p.name for p in site.iterdir())
    scripts = site / "pollbridge" / "migrations"
    assert (scripts / "env.py").is_file() and (scripts / "script.py.mako").is_file()
    assert sorted(p.name for p in (scripts / "versions").glob("*.py")) == sorted(
        p.name for p in (ROOT / "migrations" / "versions").glob("*.py"))
    assert (site / "pollbridge" / "py.typed").is_file() and (site / "pollbridge" / "__main__.py").is_file()
    for package in ("bridge", "event_scheduler", "legacy_poller"):
        assert (site / package / "__init__.py").is_file(), package
    assert sorted((site / "bridge" / "db" / "sql").glob("*.sql"))


@pytest.mark.slow
def test_the_installed_wheel_runs_from_a_folder_with_its_own_migrations(installed: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    python, site = installed
    folder = _user_folder(tmp_path)
    where = _run([str(python), "-c", "import pollbridge, bridge.db.migrate as m; "
                  "print(pollbridge.__file__); print(m.script_location()); print(pollbridge.__version__)"], folder)
    assert where.returncode == 0, where.stderr
    module, scripts, version = where.stdout.split()
    assert Path(module).is_relative_to(site) and Path(scripts) == site / "pollbridge" / "migrations"
    assert version == __import__("pollbridge").__version__
    _init_then_doctor(str(python), folder)
    assert _run([str(python), "-m", "pollbridge", "--help"], folder).returncode == 0
