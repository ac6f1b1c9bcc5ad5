"""Database access: engines and the database clock, statements through the driver, pollbridge's schema,
named SQL blocks, LISTEN/NOTIFY wake-ups and the Alembic migrations. Imports only :mod:`bridge.core`.
"""

from __future__ import annotations
