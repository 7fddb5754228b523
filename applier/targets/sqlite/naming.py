"""Which SQLite table a source table lands in (``Backend.target_table``; see ``applier.targets.naming``).

SQLite has no schemas: ``target.tables`` maps a source ``schema.table`` to a target name (one identifier, dots and
all); otherwise a table of schema ``public`` keeps its bare name and any other is named ``schema.table`` as one
identifier.
"""

from __future__ import annotations

from applier.decoder.messages import Relation
from applier.targets.base import source_name


def sqlite_target_table(rel: Relation, table_map: dict[str, str]) -> tuple[str | None, str]:
    """(None, table) on a SQLite target for a source relation."""
    mapped = table_map.get(source_name(rel))
    if mapped:
        return None, mapped
    return None, (rel.name if rel.namespace in ("public", "") else f"{rel.namespace}.{rel.name}")
