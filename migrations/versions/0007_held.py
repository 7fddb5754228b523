"""Changes held for tables joining the stream (``applier.engine.holding``).

``applier_held``: per ``apply.name``, the changes of a source table that is being copied (``applier sync --table``,
or a table that started to be published under ``apply.new_tables = "sync"``) received while its copy runs. They are
written in the target transaction of their source transaction, with its progress, so the stream goes on for every
other table; once the table's copy is 'ready' they are applied in commit order (those committed before the copy's
snapshot skipped: they are in the copy) and deleted, in one target transaction. One row per source transaction and
table (more for a large one: ``id`` orders them): its commit LSN, xid and commit time, and its changes as spool
records (``applier.engine.spool``), headed by the Relation and Type messages they need.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "applier_held",
        # bigint on PostgreSQL (a long life of holds); SQLite's rowid alias must be spelt INTEGER
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("name", sa.Text, nullable=False),  # apply.name
        sa.Column("source_oid", sa.BigInteger, nullable=False),
        sa.Column("schema_name", sa.Text, nullable=False),  # the source table, as its applier_sync_tables row names it
        sa.Column("table_name", sa.Text, nullable=False),
        sa.Column("commit_lsn", sa.Text, nullable=False),
        sa.Column("xid", sa.BigInteger, nullable=False),
        sa.Column("commit_time", sa.BigInteger, nullable=True),
        sa.Column("changes", sa.LargeBinary, nullable=False),
    )
    op.create_index("applier_held_name", "applier_held", ["name", "source_oid", "id"])


def downgrade() -> None:
    op.drop_index("applier_held_name", table_name="applier_held")
    op.drop_table("applier_held")
