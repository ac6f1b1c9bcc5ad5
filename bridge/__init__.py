"""pollbridge: move a workflow platform from a polling scheduler to an event-driven one.

The ``bridge`` package holds the toolkit's core: settings and the mapping of the existing task
table, the database helpers, pollbridge's own schema, the dispatch transition both paths share,
and the command-line interface. The public face is the ``pollbridge`` package (``import pollbridge``,
``python -m pollbridge``); ``bridge`` is its internal layout.
"""

from __future__ import annotations

# The one place the version is written: pyproject.toml reads it (`dynamic = ["version"]`), `pollbridge`
# re-exports it and `pollbridge --version` prints it.
__version__ = "0.1.0"
