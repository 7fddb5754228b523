"""The progress row remembers that the replica needs a re-copy.

``recopy_needed`` (one line, or NULL): set by ``applier init --new-slot``, which makes a new slot after the
one the progress followed was lost (dropped or invalidated): the source's changes between the old slot's
position and the new one's never reach the replica. ``applier status`` shows it until ``applier sync``
completes a copy, which clears it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("applier_progress") as batch:
        batch.add_column(sa.Column("recopy_needed", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("applier_progress") as batch:
        batch.drop_column("recopy_needed")
