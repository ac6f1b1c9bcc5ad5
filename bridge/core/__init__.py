"""The bottom layer: errors, settings, the mapping of the scheduler's table, phases and routes, events.

Nothing here does I/O; every other layer may import it.
"""

from __future__ import annotations
