"""Change-data capture: triggers that write the outbox, the relay that publishes it to the bus,
one active relay per partition, and the relay's metrics.
"""

from __future__ import annotations
