"""The conflict log: each conflict the apply met, recorded in the target transaction of the change it concerns.

``applier_conflicts``: one row per conflict (``applier.engine.conflicts``): when it was recorded (ISO 8601 UTC, as
text so that both dialects compare it the same), its type (PostgreSQL 18's names), the target table, the row's key
as text, the local row and the remote row as JSON text (column -> value; the remote values as the source sent
them), the source transaction (xid, commit LSN X/Y, commit time ISO 8601 UTC), the configured policy and what was
done ('skip', 'apply_remote', 'keep_local'). A conflict whose policy is 'error' leaves no row: its transaction rolls
back and the apply stops naming it. Rows are trimmed by age (``conflicts.prune_after``, ``applier conflicts
--prune``), through the (name, recorded_at) index.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "applier_conflicts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.Text, nullable=False),  # apply.name
        sa.Column("recorded_at", sa.Text, nullable=False),
        sa.Column("conflict_type", sa.Text, nullable=False),
        sa.Column("table_name", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=True),
        sa.Column("local_row", sa.Text, nullable=True),
        sa.Column("remote_row", sa.Text, nullable=True),
        sa.Column("xid", sa.BigInteger, nullable=True),
        sa.Column("commit_lsn", sa.Text, nullable=True),
        sa.Column("commit_time", sa.Text, nullable=True),
        sa.Column("policy", sa.Text, nullable=False),
        sa.Column("resolution", sa.Text, nullable=False),
    )
    op.create_index("applier_conflicts_name_time", "applier_conflicts", ["name", "recorded_at"])


def downgrade() -> None:
    op.drop_index("applier_conflicts_name_time", table_name="applier_conflicts")
    op.drop_table("applier_conflicts")
