"""The reconciler: both paths side by side (classify), the report (table, JSON, HTML), one task's story
(explain) and the state of the migration on one screen (status).
"""

from __future__ import annotations
