"""Which PostgreSQL table a source table lands in (``Backend.target_table``; see ``applier.targets.naming``).

``target.tables`` maps a source ``schema.table`` to a target name; otherwise the source's schema and name. A mapped
name without a schema is found through the search path (schema None).
"""

from __future__ import annotations

from applier.decoder.messages import Relation
from applier.targets.base import source_name


def pg_target_table(rel: Relation, table_map: dict[str, str]) -> tuple[str | None, str]:
    """(schema or None, table) on a PostgreSQL target for a source relation."""
    mapped = table_map.get(source_name(rel))
    if mapped:
        schema, _, table = mapped.rpartition(".")
        return (schema or None), table
    return rel.namespace or "public", rel.name
