"""Which PostgreSQL table a source table lands in (``Backend.target_table``; see ``applier.targets.naming``).

``target.tables`` maps a source ``schema.table`` to a target name; otherwise the source's schema and name. A mapped
name without a schema is found through the search path (schema None).
"""

from __future__ import annotations

from applier.decoder.messages import Relation
from applier.targets.base import source_name


def pg_target_table(rel: Relation, table_map: dict[str, str]) -> tuple[str | None, str]:
    """(schema or None, table) on a PostgreSQL target for a source relation."""
    return _mapped(source_name(rel), rel.namespace or "public", rel.name, table_map)


def pg_shape_table(schema: str, name: str, table_map: dict[str, str]) -> tuple[str | None, str]:
    """(schema or None, table) on a PostgreSQL target for the source table ``schema.name`` (a captured shape's)."""
    return _mapped(f"{schema}.{name}", schema, name, table_map)


def _mapped(source: str, schema: str, name: str, table_map: dict[str, str]) -> tuple[str | None, str]:
    mapped = table_map.get(source)
    if mapped:
        target_schema, _, table = mapped.rpartition(".")
        return (target_schema or None), table
    return schema, name
