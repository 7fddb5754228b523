"""Progress knows its owner and its last failure: the slot it follows, the last error and when.

The progress row of an ``apply.name`` belongs to one slot of one source system
(``source_system`` since 0001): a second applier that would write the same row
from another slot is refused before it applies anything. ``last_error`` and
``last_error_at`` (ISO 8601, UTC) are what ``applier status`` shows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("applier_progress") as batch:
        batch.add_column(sa.Column("slot", sa.Text, nullable=True))  # the replication slot the LSN was read from
        batch.add_column(sa.Column("last_error", sa.Text, nullable=True))  # one line, as logged
        batch.add_column(sa.Column("last_error_at", sa.Text, nullable=True))  # ISO 8601 UTC


def downgrade() -> None:
    with op.batch_alter_table("applier_progress") as batch:
        batch.drop_column("last_error_at")
        batch.drop_column("last_error")
        batch.drop_column("slot")
