"""Unit tests of bridge.core.settings: precedence, file discovery, validation."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from bridge.core.errors import ConfigError, MappingError
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import (
    DEFAULT_BUS_URL,
    DEFAULT_DATABASE_URL,
    PollerSettings,
    Settings,
    WorkerSettings,
    load_settings,
    settings_from_dict,
)

FILE_TOML = """
[database]
url = "sqlite:///file.db"
[bus]
url = "redis://file-host:6379/0"
[poller]
interval = 2.5
batch_size = 50
[workers]
concurrency = 8
min_duration = 0.0
max_duration = 0.2
failure_rate = 0.25
idle_sleep = 0.5
[mapping]
table = "jobs"
[mapping.columns]
workflow_type = "kind"
"""


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test in an empty directory with no POLLBRIDGE_* variables in the real environment."""
    for name in ("POLLBRIDGE_CONFIG", "POLLBRIDGE_DATABASE_URL", "POLLBRIDGE_BUS_URL"):
        monkeypatch.delenv(name, raising=False)
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------
# defaults, file, precedence


def test_defaults_without_any_file() -> None:
    settings = load_settings(environ={})
    assert settings == Settings()
    assert settings.database_url == DEFAULT_DATABASE_URL == "sqlite:///pollbridge.db"
    assert settings.bus_url == DEFAULT_BUS_URL == "embedded"
    assert settings.poller == PollerSettings(interval=10.0, batch_size=500)
    assert settings.workers == WorkerSettings()
    assert settings.mapping == TaskTableMapping()
    assert settings.config_file is None


def test_file_values_are_read(tmp_path: Path) -> None:
    path = _write(tmp_path / "conf.toml", FILE_TOML)
    settings = load_settings(path, environ={})
    assert settings.database_url == "sqlite:///file.db"
    assert settings.bus_url == "redis://file-host:6379/0"
    assert settings.poller == PollerSettings(interval=2.5, batch_size=50)
    assert settings.workers == WorkerSettings(concurrency=8, min_duration=0.0, max_duration=0.2,
                                              failure_rate=0.25, idle_sleep=0.5)
    assert settings.mapping.table == "jobs"
    assert settings.mapping.columns.workflow_type == "kind"
    assert settings.mapping.instances is None
    assert settings.config_file == str(path)


def test_partial_file_keeps_other_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path / "conf.toml", "[poller]\ninterval = 3\n")
    settings = load_settings(path, environ={})
    assert settings.poller.interval == 3
    assert settings.poller.batch_size == 500
    assert settings.poller.running_timeout == 0
    assert load_settings(_write(tmp_path / "t.toml", "[poller]\nrunning_timeout = 5\n"),
                         environ={}).poller.running_timeout == 5
    assert settings.database_url == DEFAULT_DATABASE_URL
    assert settings.workers == WorkerSettings()


def test_precedence_defaults_file_environment_flags(tmp_path: Path) -> None:
    path = _write(tmp_path / "conf.toml", FILE_TOML)
    env = {"POLLBRIDGE_DATABASE_URL": "sqlite:///env.db", "POLLBRIDGE_BUS_URL": "redis://env-host/1"}

    from_file = load_settings(path, environ={})
    assert (from_file.database_url, from_file.bus_url) == ("sqlite:///file.db", "redis://file-host:6379/0")

    from_env = load_settings(path, environ=env)
    assert (from_env.database_url, from_env.bus_url) == ("sqlite:///env.db", "redis://env-host/1")
    # The environment overrides only the URLs: the rest of the file still applies.
    assert from_env.poller.interval == 2.5
    assert from_env.config_file == str(path)

    from_flags = load_settings(path, environ=env, database_url="sqlite:///flag.db", bus_url="embedded")
    assert (from_flags.database_url, from_flags.bus_url) == ("sqlite:///flag.db", "embedded")

    # Each layer independently: a flag for one URL leaves the other to the environment.
    mixed = load_settings(path, environ=env, bus_url="redis://flag-host/2")
    assert (mixed.database_url, mixed.bus_url) == ("sqlite:///env.db", "redis://flag-host/2")


def test_environment_overrides_defaults_without_a_file() -> None:
    settings = load_settings(environ={"POLLBRIDGE_DATABASE_URL": "postgresql://u@h/db"})
    assert settings.database_url == "postgresql://u@h/db"
    assert settings.bus_url == DEFAULT_BUS_URL
    assert settings.config_file is None


def test_empty_environment_values_are_ignored(tmp_path: Path) -> None:
    path = _write(tmp_path / "conf.toml", FILE_TOML)
    settings = load_settings(path, environ={"POLLBRIDGE_DATABASE_URL": "", "POLLBRIDGE_BUS_URL": ""})
    assert settings.database_url == "sqlite:///file.db"
    assert settings.bus_url == "redis://file-host:6379/0"


def test_none_flags_do_not_override() -> None:
    settings = load_settings(environ={"POLLBRIDGE_BUS_URL": "redis://env/0"}, database_url=None, bus_url=None)
    assert settings.bus_url == "redis://env/0"
    assert settings.database_url == DEFAULT_DATABASE_URL


def test_explicit_environ_replaces_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLLBRIDGE_DATABASE_URL", "sqlite:///process.db")
    assert load_settings(environ={}).database_url == DEFAULT_DATABASE_URL
    assert load_settings().database_url == "sqlite:///process.db"


def test_with_overrides_skips_none() -> None:
    base = Settings()
    changed = base.with_overrides(database_url="sqlite:///x.db", bus_url=None)
    assert changed.database_url == "sqlite:///x.db"
    assert changed.bus_url == base.bus_url
    assert base.database_url == DEFAULT_DATABASE_URL  # the original is untouched


# --------------------------------------------------------------------------------------------------
# which file


def test_discovers_pollbridge_toml_in_current_directory() -> None:
    _write(Path("pollbridge.toml"), '[database]\nurl = "sqlite:///cwd.db"\n')
    settings = load_settings(environ={})
    assert settings.database_url == "sqlite:///cwd.db"
    assert settings.config_file == "pollbridge.toml"


def test_pollbridge_config_env_var_selects_the_file(tmp_path: Path) -> None:
    _write(Path("pollbridge.toml"), '[database]\nurl = "sqlite:///cwd.db"\n')
    other = _write(tmp_path / "other.toml", '[database]\nurl = "sqlite:///other.db"\n')
    settings = load_settings(environ={"POLLBRIDGE_CONFIG": str(other)})
    assert settings.database_url == "sqlite:///other.db"
    assert settings.config_file == str(other)


def test_explicit_file_beats_pollbridge_config(tmp_path: Path) -> None:
    env_file = _write(tmp_path / "env.toml", '[database]\nurl = "sqlite:///env-file.db"\n')
    flag_file = _write(tmp_path / "flag.toml", '[database]\nurl = "sqlite:///flag-file.db"\n')
    settings = load_settings(flag_file, environ={"POLLBRIDGE_CONFIG": str(env_file)})
    assert settings.database_url == "sqlite:///flag-file.db"
    assert settings.config_file == str(flag_file)


def test_empty_pollbridge_config_falls_back_to_discovery() -> None:
    _write(Path("pollbridge.toml"), '[bus]\nurl = "redis://cwd/0"\n')
    assert load_settings(environ={"POLLBRIDGE_CONFIG": ""}).bus_url == "redis://cwd/0"


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    _write(Path("pollbridge.toml"), "")  # must not be used as a fallback
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_settings(missing, environ={})
    assert str(missing) in str(info.value)
    assert "not found" in str(info.value)
    assert info.value.exit_code == 2


def test_explicit_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path, environ={})


def test_missing_file_from_pollbridge_config_is_an_error(tmp_path: Path) -> None:
    _write(Path("pollbridge.toml"), "")
    missing = tmp_path / "gone.toml"
    with pytest.raises(ConfigError) as info:
        load_settings(environ={"POLLBRIDGE_CONFIG": str(missing)})
    assert str(missing) in str(info.value)
    assert "POLLBRIDGE_CONFIG" in str(info.value)


@pytest.mark.parametrize(
    "text",
    ["[database\nurl = 1\n", "[poller]\ninterval = \n", "a = 1\na = 2\n", '[bus]\nurl = "unterminated\n',
     "just some words\n"],
)
def test_invalid_toml_is_a_one_line_config_error(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    assert "not valid TOML" in message
    assert "line" in message  # the parser's location is kept
    assert info.value.__cause__ is None  # no chained traceback


def test_undecodable_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[database]\nurl = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(path, environ={})


def test_errors_in_discovered_file_are_reported() -> None:
    _write(Path("pollbridge.toml"), "[poller]\ninterval = -1\n")
    with pytest.raises(ConfigError, match=re.escape("poller.interval")):
        load_settings(environ={})


def test_mapping_errors_from_file_are_config_errors(tmp_path: Path) -> None:
    path = _write(tmp_path / "conf.toml", '[mapping]\ntable = "tasks; drop table x"\n')
    with pytest.raises(MappingError, match=re.escape("mapping.table")):
        load_settings(path, environ={})


# --------------------------------------------------------------------------------------------------
# validation of the parsed file


@pytest.mark.parametrize(
    ("raw", "word"),
    [
        ({"databse": {"url": "x"}}, "databse"),
        ({"schedular": {}}, "schedular"),
        ({"database": {"uri": "sqlite://"}}, "uri"),
        ({"bus": {"host": "x"}}, "host"),
        ({"poller": {"intervall": 1}}, "intervall"),
        ({"workers": {"threads": 2}}, "threads"),
        ({"mapping": {"tabel": "x"}}, "tabel"),
    ],
)
def test_unknown_sections_and_keys_are_rejected(raw: dict[str, Any], word: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(raw)
    assert word in str(info.value)
    assert "unknown" in str(info.value)


@pytest.mark.parametrize("section", ["database", "bus", "poller", "workers", "mapping"])
def test_sections_must_be_tables(section: str) -> None:
    with pytest.raises(ConfigError, match=section):
        settings_from_dict({section: "x"})


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("poller", "interval", "x"),
        ("poller", "interval", -1),
        ("poller", "interval", 0),
        ("poller", "interval", True),
        ("poller", "interval", [1]),
        ("poller", "batch_size", 0),
        ("poller", "batch_size", -5),
        ("poller", "batch_size", 1.5),
        ("poller", "batch_size", "500"),
        ("poller", "batch_size", True),
        ("workers", "concurrency", 0),
        ("workers", "concurrency", 2.0),
        ("workers", "concurrency", False),
        ("workers", "min_duration", -0.1),
        ("workers", "min_duration", "0"),
        ("workers", "max_duration", -1),
        ("workers", "idle_sleep", 0),
        ("workers", "failure_rate", 2),
        ("workers", "failure_rate", -0.1),
        ("workers", "failure_rate", 1.0001),
        ("workers", "failure_rate", True),
        ("workers", "failure_rate", "0.5"),
        ("database", "url", ""),
        ("database", "url", 5),
        ("bus", "url", ""),
        ("bus", "url", ["embedded"]),
    ],
)
def test_wrong_values_are_rejected_naming_the_key(section: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict({section: {key: value}})
    assert f"{section}.{key}" in str(info.value)


def test_max_duration_below_min_duration_is_rejected() -> None:
    with pytest.raises(ConfigError, match="max_duration"):
        settings_from_dict({"workers": {"min_duration": 0.5, "max_duration": 0.1}})


@pytest.mark.parametrize(
    ("toml", "word"),
    [
        ('[poller]\ninterval = "x"\n', "poller.interval"),
        ("[poller]\ninterval = -1\n", "poller.interval"),
        ("[poller]\ninterval = true\n", "poller.interval"),
        ("[workers]\nfailure_rate = 2\n", "workers.failure_rate"),
        ("[poller]\nbatch_size = 2.5\n", "poller.batch_size"),
        ("[poller]\nrunning_timeout = -5\n", "poller.running_timeout"),
        ("[bus]\nlisten = 1\n", "bus.listen"),
    ],
)
def test_wrong_values_in_toml_file(tmp_path: Path, toml: str, word: str) -> None:
    path = _write(tmp_path / "conf.toml", toml)
    with pytest.raises(ConfigError, match=word):
        load_settings(path, environ={})


@pytest.mark.parametrize(
    ("raw", "attr", "expected"),
    [
        ({"poller": {"interval": 1}}, ("poller", "interval"), 1),
        ({"poller": {"interval": 0.001}}, ("poller", "interval"), 0.001),
        ({"poller": {"batch_size": 1}}, ("poller", "batch_size"), 1),
        ({"workers": {"failure_rate": 0}}, ("workers", "failure_rate"), 0),
        ({"workers": {"failure_rate": 1}}, ("workers", "failure_rate"), 1),
        ({"workers": {"min_duration": 0, "max_duration": 0}}, ("workers", "max_duration"), 0),
    ],
)
def test_boundary_values_are_accepted(raw: dict[str, Any], attr: tuple[str, str], expected: object) -> None:
    settings = settings_from_dict(raw)
    assert getattr(getattr(settings, attr[0]), attr[1]) == expected


@pytest.mark.parametrize(
    ("section", "key"),
    [("poller", "interval"), ("workers", "idle_sleep"), ("workers", "min_duration"), ("workers", "max_duration")],
)
def test_nan_is_rejected(section: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"{section}.{key}"):
        settings_from_dict({section: {key: math.nan}})


def test_nan_failure_rate_is_rejected() -> None:
    with pytest.raises(ConfigError, match=re.escape("workers.failure_rate")):
        settings_from_dict({"workers": {"failure_rate": math.nan}})


def test_dataclasses_validate_on_direct_construction() -> None:
    with pytest.raises(ConfigError, match=re.escape("poller.interval")):
        PollerSettings(interval=-0.5)
    with pytest.raises(ConfigError, match=re.escape("workers.concurrency")):
        WorkerSettings(concurrency=-1)


def test_non_table_mapping_dependencies_is_a_config_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "conf.toml", '[mapping]\ndependencies = "edges"\n')
    with pytest.raises(ConfigError):
        load_settings(path, environ={})
