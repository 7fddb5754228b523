"""Schema changes followed on the target (``apply.schema_changes = "follow"``, ``applier.engine.ddl``).

``applier_ddl_tables``: per ``apply.name`` and source table OID, the shape of the source table the target has
followed (``applier.ddl.shape.TableShape`` as JSON: schema, name, columns with attnums, keys, indexes), its source
schema and name, and the LSN of the change that made it; written in the target transaction of that change, so the
shape and the target table never disagree. A rename is told from a drop and an add by the attnums kept here.

``applier_ddl_log``: one row per schema change applied, skipped or refused by policy (``applier status`` shows the
newest): LSN, the source table, its class (``[ddl]``), the result, the change in words and the source's statement.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "applier_ddl_tables",
        sa.Column("name", sa.Text, primary_key=True),  # apply.name
        sa.Column("source_oid", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("schema_name", sa.Text, nullable=False),  # the source table's schema and name now
        sa.Column("table_name", sa.Text, nullable=False),
        sa.Column("shape", sa.Text, nullable=False),
        sa.Column("lsn", sa.Text, nullable=False),
        sa.Column("updated_at", sa.Text, nullable=True),
    )
    op.create_table(
        "applier_ddl_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.Text, nullable=False),  # apply.name
        sa.Column("lsn", sa.Text, nullable=False),
        sa.Column("table_name", sa.Text, nullable=False),
        sa.Column("ddl_class", sa.Text, nullable=False),
        sa.Column("result", sa.Text, nullable=False),  # 'applied', 'skipped'
        sa.Column("change", sa.Text, nullable=False),
        sa.Column("statement", sa.Text, nullable=True),
        sa.Column("applied_at", sa.Text, nullable=False),
    )
    op.create_index("applier_ddl_log_name", "applier_ddl_log", ["name", "id"])


def downgrade() -> None:
    op.drop_index("applier_ddl_log_name", table_name="applier_ddl_log")
    op.drop_table("applier_ddl_log")
    op.drop_table("applier_ddl_tables")
