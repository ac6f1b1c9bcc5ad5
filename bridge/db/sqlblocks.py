"""Named SQL blocks kept as package data (``bridge/db/sql/<dialect>.sql``), loaded with importlib.resources.

A file holds blocks introduced by ``-- name: NAME`` lines. Blocks are ``string.Template`` texts:
``$placeholders`` are filled only with identifiers that were validated and quoted by the dialect's
identifier preparer, or with literals quoted by :func:`sql_literal` (DDL cannot take bound parameters).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from string import Template

_NAME = re.compile(r"^-- name: ([a-z0-9_]+)\s*$", re.MULTILINE)


def parse_blocks(text: str) -> dict[str, str]:
    """The ``-- name: NAME`` blocks of a SQL text (what precedes the first name line is a comment)."""
    parts = _NAME.split(text)
    return {parts[i]: parts[i + 1].strip() for i in range(1, len(parts), 2)}


@cache
def load_blocks(dialect_name: str) -> dict[str, str]:
    text = resources.files("bridge.db").joinpath("sql", f"{dialect_name}.sql").read_text(encoding="utf-8")
    return parse_blocks(text)


def render(dialect_name: str, block: str, **values: str) -> str:
    """The named ``block`` with its placeholders filled; a missing placeholder is a KeyError."""
    return Template(load_blocks(dialect_name)[block]).substitute(values)


def sql_literal(value: str) -> str:
    """A SQL string literal (single quotes doubled). Used only for values pollbridge itself controls."""
    return "'" + value.replace("'", "''") + "'"
