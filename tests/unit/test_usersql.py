"""``[mapping] install_sql``: the user's own SQL file, read and refused without a database."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.core.errors import ConfigError
from bridge.core.mapping import TaskTableMapping
from bridge.core.settings import load_settings
from bridge.tasktable import usersql

GOOD = """-- a comment before the first block
-- name: install
CREATE OR REPLACE VIEW pollbridge_edges AS SELECT 1 AS x;
-- name: uninstall
DROP VIEW IF EXISTS pollbridge_edges;
-- name: check
SELECT 'problem' WHERE false;
"""


def _mapping(path: Path) -> TaskTableMapping:
    return TaskTableMapping(install_sql=str(path))


def test_the_blocks_are_read(tmp_path: Path) -> None:
    path = tmp_path / "x.sql"
    path.write_text(GOOD)
    blocks = usersql.blocks(_mapping(path))
    assert blocks is not None
    assert set(blocks) == {"install", "uninstall", "check"}
    assert blocks["install"].startswith("CREATE OR REPLACE VIEW pollbridge_edges")


def test_without_install_sql_there_is_nothing() -> None:
    assert usersql.blocks(TaskTableMapping()) is None


@pytest.mark.parametrize(("text", "message"), [
    ("-- name: install\nSELECT 1;\n", "has no '-- name: uninstall' block"),
    ("-- name: uninstall\nSELECT 1;\n", "has no '-- name: install' block"),
    ("-- name: install\nCREATE VIEW edges AS SELECT 1;\n-- name: uninstall\nDROP VIEW edges;\n",
     "creates 'edges'; every object pollbridge installs must be named pollbridge_"),
    ("-- name: install\nCREATE TABLE IF NOT EXISTS public.audit (x int);\n-- name: uninstall\nSELECT 1;\n",
     "creates 'public.audit'"),
])
def test_a_file_that_is_not_fit_is_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "x.sql"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"mapping\.install_sql") as info:
        usersql.blocks(_mapping(path))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        usersql.blocks(_mapping(tmp_path / "absent.sql"))


def test_the_path_is_relative_to_the_configuration_file(tmp_path: Path) -> None:
    folder = tmp_path / "integration"
    folder.mkdir()
    (folder / "views.sql").write_text(GOOD)
    (folder / "pollbridge.toml").write_text('[mapping]\ninstall_sql = "views.sql"\n')
    settings = load_settings(folder / "pollbridge.toml", environ={})
    assert settings.mapping.install_sql == str((folder / "views.sql").resolve())
    assert usersql.blocks(settings.mapping) is not None
