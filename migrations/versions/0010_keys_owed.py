"""Target tables that `applier sync` created and whose keys it builds after their copy.

``applier_keys_owed``: one row per table created without its primary key and replica identity index
(``applier.targets.postgres.schema``), written in the transaction that creates the table and deleted in the one
that builds its keys: the table's oid on the target (so a rename keeps the row, a drop and re-creation by hand does
not inherit it) and its name when it was created (for people). Replaces the table comment that marked such a table
(a ``COMMENT ON TABLE`` by a user during the copy removed that mark, and the keys were then never built); a table
still carrying that comment when this runs gets its row here.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# the comment 0009's applier wrote on a table that owed its keys
OLD_MARK = "applier sync: its primary key and replica identity index are built after the copy"


def upgrade() -> None:
    op.create_table(
        "applier_keys_owed",
        sa.Column("table_oid", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("table_name", sa.Text, nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(sa.text(
            "INSERT INTO applier_keys_owed (table_oid, table_name) "
            "SELECT c.oid, n.nspname || '.' || c.relname FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_description d "
            "ON d.objoid = c.oid AND d.classoid = 'pg_class'::regclass AND d.objsubid = 0 "
            "WHERE d.description = :mark").bindparams(mark=OLD_MARK))
        # the old mark goes where this role may remove it (nothing reads it now; a table another role was given
        # keeps it, and the upgrade goes on)
        op.execute(sa.text(
            "DO $$ DECLARE t regclass; BEGIN FOR t IN SELECT table_oid::oid::regclass FROM applier_keys_owed LOOP "
            "BEGIN EXECUTE format('COMMENT ON TABLE %s IS NULL', t); "
            "EXCEPTION WHEN insufficient_privilege THEN NULL; END; END LOOP; END $$"))


def downgrade() -> None:
    op.drop_table("applier_keys_owed")
