"""The reference legacy schema, workloads seeded through the mapping, and the invariant oracle that
checks a run in Python, independently of the SQL both paths share.
"""

from __future__ import annotations
