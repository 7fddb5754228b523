"""Which target table a source table lands in: written once, for the apply engine and the copy alike.

``target.tables`` maps a source ``schema.table`` to a target name. Otherwise PostgreSQL keeps the source's
schema and name, and SQLite, which has no schemas, keeps the bare name of a table of schema ``public`` and
names any other ``schema.table`` as one identifier. A mapped PostgreSQL name without a schema is found
through the search path (schema None); a mapped SQLite name is one identifier, dots and all.
"""

from __future__ import annotations

from applier.decoder.messages import Relation
from applier.targets.base import source_name
from applier.text import quote_ident


def target_table(rel: Relation, dialect: str, table_map: dict[str, str]) -> tuple[str | None, str]:
    """(schema or None, table) on a target of ``dialect`` ('postgresql' or 'sqlite') for a source relation."""
    mapped = table_map.get(source_name(rel))
    if dialect == "sqlite":
        if mapped:
            return None, mapped
        return None, (rel.name if rel.namespace in ("public", "") else f"{rel.namespace}.{rel.name}")
    if mapped:
        schema, _, table = mapped.rpartition(".")
        return (schema or None), table
    return rel.namespace or "public", rel.name


def shown_name(schema: str | None, table: str) -> str:
    """The table's name for people: ``schema.table``, or the table alone."""
    return f"{schema}.{table}" if schema else table


def quoted_name(schema: str | None, table: str) -> str:
    """The table's name for SQL: quoted, schema-qualified when there is a schema."""
    return (quote_ident(schema) + "." if schema else "") + quote_ident(table)
