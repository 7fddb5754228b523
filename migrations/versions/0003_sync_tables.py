"""Sync control tables as migrations, and the per-table state of tables added to a running replica.

``applier_sync`` (one row per ``apply.name``: the full copy's state, run, slot, consistent point, times) and
``applier_sync_parts`` (partitions of a run written, in the same transaction as their rows) were created by
``applier sync`` itself until now: on a target where they exist they are kept as they are.

``applier_sync_tables``: one row per table that ``applier sync --table`` joins to the running stream
(``applier.migrate.add_table``): ``state`` 'init' (row made, no snapshot yet), 'copying' (copy at
``snapshot_lsn``, a consistent point S as text X/Y) or 'ready' (copied); the engine skips that table's changes of
source transactions committed before S and applies the others (``applier.engine.apply``).

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-12
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    have = set(sa.inspect(op.get_bind()).get_table_names())
    if "applier_sync" not in have:
        op.create_table(
            "applier_sync",
            sa.Column("name", sa.Text, primary_key=True),
            sa.Column("state", sa.Text, nullable=False),  # 'copying' or 'done'
            sa.Column("run", sa.Text, nullable=False),
            sa.Column("slot", sa.Text, nullable=True),
            sa.Column("consistent_point", sa.Text, nullable=True),
            sa.Column("started_at", sa.Text, nullable=True),
            sa.Column("finished_at", sa.Text, nullable=True),
        )
    if "applier_sync_parts" not in have:
        op.create_table(
            "applier_sync_parts",
            sa.Column("name", sa.Text, primary_key=True),
            sa.Column("run", sa.Text, primary_key=True),
            sa.Column("tbl", sa.Text, primary_key=True),
            sa.Column("part", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("rows", sa.BigInteger, nullable=False),
            sa.Column("bytes", sa.BigInteger, nullable=False),
        )
    op.create_table(
        "applier_sync_tables",
        sa.Column("name", sa.Text, primary_key=True),  # apply.name
        sa.Column("schema_name", sa.Text, primary_key=True),  # the source table's schema
        sa.Column("table_name", sa.Text, primary_key=True),  # the source table's name
        sa.Column("state", sa.Text, nullable=False),  # 'init', 'copying' or 'ready'
        sa.Column("snapshot_lsn", sa.Text, nullable=True),  # the copy's consistent point S, X/Y
        sa.Column("run", sa.Text, nullable=False),
        sa.Column("started_at", sa.Text, nullable=True),
        sa.Column("finished_at", sa.Text, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("applier_sync_tables")
    op.drop_table("applier_sync_parts")
    op.drop_table("applier_sync")
