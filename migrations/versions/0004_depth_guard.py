"""Index the dispatch log by instance: the depth guard counts an instance's dispatches.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("pollbridge_dispatch_log_instance_idx", "pollbridge_dispatch_log", ["instance_id"])


def downgrade() -> None:
    op.drop_index("pollbridge_dispatch_log_instance_idx", table_name="pollbridge_dispatch_log")
