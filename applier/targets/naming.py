"""Names of target tables, for people and for SQL, whatever the kind of target.

Which target table a source table lands in is each kind's rule (``Backend.target_table``, in
``applier/targets/<kind>/naming.py``), written once for the apply engine and the copy alike: ``target.tables``
maps a source ``schema.table`` to a target name, else the kind's own rule.
"""

from __future__ import annotations

from applier.text import quote_ident


def shown_name(schema: str | None, table: str) -> str:
    """The table's name for people: ``schema.table``, or the table alone."""
    return f"{schema}.{table}" if schema else table


def quoted_name(schema: str | None, table: str) -> str:
    """The table's name for SQL: quoted, schema-qualified when there is a schema."""
    return (quote_ident(schema) + "." if schema else "") + quote_ident(table)
