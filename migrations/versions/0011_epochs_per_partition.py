"""The bus epoch a relay stores holds one token per bus partition.

``pollbridge_relay_state.bus_epoch`` becomes text: it stores the bus's per-partition epochs as JSON
(``{"0": token, ...}``), so a bus that lost one shard's partitions (a Redis Cluster shard) has only
those partitions' retained outbox rows republished.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Batch mode: SQLite cannot ALTER a column's type in place (alembic copies the table there; on
    # PostgreSQL it is one ALTER COLUMN ... TYPE text, which rewrites nothing: varchar -> text is binary).
    with op.batch_alter_table("pollbridge_relay_state") as batch:
        batch.alter_column("bus_epoch", existing_type=sa.String(64), type_=sa.Text(), existing_nullable=True)


def downgrade() -> None:
    # A stored JSON of epochs does not fit the old column: forget it (the next check stores the epochs
    # again, without a replay).
    op.execute("UPDATE pollbridge_relay_state SET bus_epoch = NULL")
    with op.batch_alter_table("pollbridge_relay_state") as batch:
        batch.alter_column("bus_epoch", existing_type=sa.Text(), type_=sa.String(64), existing_nullable=True)
