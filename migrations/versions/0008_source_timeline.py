"""The progress row remembers the source's timeline.

``source_timeline`` (IDENTIFY_SYSTEM's timeline, or NULL: not recorded yet, or read through the SQL interface):
written with each progress write beside ``source_system``. A promotion keeps the system identifier and starts a
new timeline, so at start a new timeline of the same system is a failover followed (logged), while another system
identifier is another cluster (refused).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("applier_progress") as batch:
        batch.add_column(sa.Column("source_timeline", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("applier_progress") as batch:
        batch.drop_column("source_timeline")
