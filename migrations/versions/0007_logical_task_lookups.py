"""Look shadow decisions up by logical task (instance, task key), as dispatches already are.

A scheduler pollbridge did not write may give a retry a new physical row id (Airflow does), so the
reconciler and ``explain`` find a task's decisions and dispatches by (instance, task key, attempt), not by
row id. The dispatch log has been indexed by instance since 0004 (that index also serves the relay's
check that a captured dispatch of a foreign scheduler is not recorded twice); this revision gives the
decisions the same index.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("pollbridge_decisions_instance_idx", "pollbridge_decisions", ["instance_id"])


def downgrade() -> None:
    op.drop_index("pollbridge_decisions_instance_idx", table_name="pollbridge_decisions")
