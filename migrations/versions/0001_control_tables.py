"""Control tables: progress per applier (with the skip LSN) and prepared transactions kept for SQLite.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "applier_progress",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("lsn", sa.Text, nullable=False),  # end LSN of the last applied source transaction, X/Y
        sa.Column("commit_time", sa.BigInteger, nullable=True),  # its source commit time, µs since 2000
        sa.Column("skip_lsn", sa.Text, nullable=True),  # finish LSN of one transaction to skip, set by `applier skip`
        sa.Column("source_system", sa.Text, nullable=True),  # IDENTIFY_SYSTEM systemid of the source
        sa.Column("updated_at", sa.Text, nullable=True),
    )
    op.create_table(
        "applier_prepared",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("gid", sa.Text, primary_key=True),  # the source's GID
        sa.Column("xid", sa.BigInteger, nullable=False),
        sa.Column("prepare_lsn", sa.Text, nullable=False),
        sa.Column("end_lsn", sa.Text, nullable=False),
        sa.Column("prepare_time", sa.BigInteger, nullable=True),
        sa.Column("target_gid", sa.Text, nullable=True),  # PostgreSQL target: the PREPARE TRANSACTION id
        sa.Column("changes", sa.LargeBinary, nullable=True),  # SQLite target: the spooled changes
    )


def downgrade() -> None:
    op.drop_table("applier_prepared")
    op.drop_table("applier_progress")
