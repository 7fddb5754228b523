"""Repairs of replicated tables (``applier repair``, ``applier.migrate.repair``).

``applier_repairs``: per ``apply.name``, one row per key range that a repair rewrote, written in the target
transaction that rewrote it (the range's differing rows deleted, the source's rows of them at the repair's
snapshot inserted; several ranges may share a transaction): the repair run, the source table, the snapshot's consistent point, the key range (0-1023, or -1: the
whole table), and the rows inserted (keys only on the source), updated (keys on both sides, rows different) and
deleted (keys only on the target). A repair killed half-way leaves the ranges it finished recorded, and only those.

``applier_progress`` gets ``resynced_from`` and ``resynced_at`` (``applier resync``, ``applier.migrate.resync``): the
slot that was lost and the position applied from it (``slot 'applier' (dropped) at 0/1A2B3C4``), and when the
replica was resynced onto the new slot (its name and start are the row's ``slot`` and ``lsn``).

``applier_sync_tables.state`` gets two values (no schema change): 'repair' (a repair asked the running applier to
hold the table's changes; no snapshot yet) and 'repairing' (the applier holds them; ``snapshot_lsn`` once taken).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "applier_repairs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("name", sa.Text, nullable=False),  # apply.name
        sa.Column("run", sa.Text, nullable=False),
        sa.Column("schema_name", sa.Text, nullable=False),  # the source table
        sa.Column("table_name", sa.Text, nullable=False),
        sa.Column("snapshot_lsn", sa.Text, nullable=False),
        sa.Column("key_range", sa.Integer, nullable=False),
        sa.Column("rows_inserted", sa.BigInteger, nullable=False),
        sa.Column("rows_updated", sa.BigInteger, nullable=False),
        sa.Column("rows_deleted", sa.BigInteger, nullable=False),
        sa.Column("repaired_at", sa.Text, nullable=False),
    )
    op.create_index("applier_repairs_name", "applier_repairs", ["name", "run"])
    with op.batch_alter_table("applier_progress") as batch:
        batch.add_column(sa.Column("resynced_from", sa.Text, nullable=True))
        batch.add_column(sa.Column("resynced_at", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("applier_progress") as batch:
        batch.drop_column("resynced_at")
        batch.drop_column("resynced_from")
    op.drop_index("applier_repairs_name", "applier_repairs")
    op.drop_table("applier_repairs")
