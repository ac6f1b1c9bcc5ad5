"""Flags: the phase of each workflow type, its audit trail, and the poller's routing function.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)

# The routing functions as this revision created them (PostgreSQL only: SQLite registers pollbridge_bucket
# per connection), frozen here: a migration must do the same thing forever, whatever later happens to
# bridge/db/sql/*.sql. The bucket is the frozen hash documented in bridge/core/phases.py: the first 32 bits
# of md5(workflow_type || '/' || instance_id), modulo 10000. Never change it: instances would move in and
# out of a selective percentage. A later change to these functions is a new revision.
BUCKET_FUNCTION = """\
CREATE OR REPLACE FUNCTION pollbridge_bucket(workflow_type text, instance_id text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT (('x' || substr(md5(coalesce(workflow_type, '') || '/' || instance_id), 1, 8))::bit(32)::bigint
          % 10000)::integer
$$"""

SHOULD_HANDLE_FUNCTION = """\
CREATE OR REPLACE FUNCTION pollbridge_poller_should_handle(workflow_type text, instance_id text,
                                                           ready_since timestamptz) RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT CASE coalesce(f.phase, 'polling')
    WHEN 'selective' THEN
      NOT (f.percent IS NULL OR pollbridge_bucket($1, $2) < round(f.percent * 100))
      OR $3 IS NULL OR $3 <= clock_timestamp() - make_interval(secs => f.grace_seconds)
    WHEN 'cutover' THEN false
    ELSE true
  END
  FROM (SELECT 1) AS one LEFT JOIN pollbridge_flags AS f ON f.workflow_type = $1
$$"""

DROP_SHOULD_HANDLE_FUNCTION = "DROP FUNCTION IF EXISTS pollbridge_poller_should_handle(text, text, timestamptz)"

DROP_BUCKET_FUNCTION = "DROP FUNCTION IF EXISTS pollbridge_bucket(text, text)"


def upgrade() -> None:
    op.create_table(
        "pollbridge_flags",
        sa.Column("workflow_type", sa.String(200), primary_key=True),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("percent", sa.Float, nullable=True),
        sa.Column("grace_seconds", sa.Float, nullable=False, server_default="5"),
        sa.Column("thresholds", sa.Text, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=False),
    )
    op.create_table(
        "pollbridge_flag_audit",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("workflow_type", sa.String(200), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("old_phase", sa.String(16), nullable=False),
        sa.Column("new_phase", sa.String(16), nullable=False),
        sa.Column("old_percent", sa.Float, nullable=True),
        sa.Column("new_percent", sa.Float, nullable=True),
        sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("gate", sa.Text, nullable=True),
        sa.Column("changed_at", TS, nullable=False),
    )
    op.create_index("pollbridge_flag_audit_type_time_idx", "pollbridge_flag_audit", ["workflow_type", "changed_at"])
    if op.get_bind().dialect.name == "postgresql":  # SQLite registers pollbridge_bucket per connection
        op.execute(BUCKET_FUNCTION)
        op.execute(SHOULD_HANDLE_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(DROP_SHOULD_HANDLE_FUNCTION)
        op.execute(DROP_BUCKET_FUNCTION)
    op.drop_index("pollbridge_flag_audit_type_time_idx", table_name="pollbridge_flag_audit")
    op.drop_table("pollbridge_flag_audit")
    op.drop_table("pollbridge_flags")
