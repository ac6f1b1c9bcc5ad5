"""pollbridge: move a workflow platform from a polling scheduler to an event-driven one.

The ``bridge`` package holds the toolkit's core: settings and the mapping of the existing task
table, the database helpers, pollbridge's own schema, the dispatch transition both paths share,
and the command-line interface.
"""

from __future__ import annotations

__version__ = "0.1.0"
