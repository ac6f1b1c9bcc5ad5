"""Backpressure holds and the review queue, shared through the database.

``pollbridge_holds``: the ready tasks the event scheduler holds back by backpressure, so the poller's
fallback and safety sweep, the reconciler and the guardian can tell a legitimate hold from a miss.
``pollbridge_review``: the tasks the depth guard stopped, for a person to release or reject; a parked task
stays parked whatever another scheduler process's settings say, until ``pollbridge review`` decides.
``pollbridge_outbox.depth``: the captured row's causation depth, carried on its event.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

Key = sa.String(200).with_variant(sa.Text(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # The causation depth of the captured row (mapping.columns.depth), carried on the event.
    op.add_column("pollbridge_outbox", sa.Column("depth", sa.Integer, nullable=True))
    op.create_table(
        "pollbridge_holds",
        sa.Column("task_id", Key, primary_key=True),
        sa.Column("instance_id", Key, nullable=False),
        sa.Column("workflow_type", Key, nullable=True),
        sa.Column("task_key", Key, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=True),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("held_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("pollbridge_holds_type_idx", "pollbridge_holds", ["workflow_type", "held_at"])
    op.create_table(
        "pollbridge_review",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("task_id", Key, nullable=False),
        sa.Column("instance_id", Key, nullable=False),
        sa.Column("workflow_type", Key, nullable=True),
        sa.Column("task_key", Key, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=True),
        sa.Column("guard", sa.String(16), nullable=False),
        sa.Column("measured", sa.Integer, nullable=False),
        sa.Column("limit_value", sa.Integer, nullable=False),
        sa.Column("moved", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("parked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("parked_by", sa.String(200), nullable=False),
        sa.Column("decision", sa.String(16), nullable=True),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("decided_by", sa.String(200), nullable=True),
        sa.Column("decision_reason", sa.Text, nullable=True),
    )
    op.create_index("pollbridge_review_task_idx", "pollbridge_review", ["task_id"])
    op.create_index("pollbridge_review_open_key", "pollbridge_review", ["task_id"], unique=True,
                    postgresql_where=sa.text("decision IS NULL"), sqlite_where=sa.text("decision IS NULL"))


def downgrade() -> None:
    op.drop_table("pollbridge_review")
    op.drop_table("pollbridge_holds")
    op.drop_column("pollbridge_outbox", "depth")  # SQLite >= 3.35 drops a column in place
