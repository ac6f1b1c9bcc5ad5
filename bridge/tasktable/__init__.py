"""The scheduler's task table as both paths see it: the mapped tables, readiness as SQL and the one
compare-and-set dispatch transition (invariant 3).
"""

from __future__ import annotations
