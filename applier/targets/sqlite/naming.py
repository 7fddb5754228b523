"""Which SQLite table a source table lands in (``Backend.target_table``; see ``applier.targets.naming``).

SQLite has no schemas: ``target.tables`` maps a source ``schema.table`` to a target name (one identifier, dots and
all); otherwise a table of schema ``public`` keeps its bare name and any other is named ``schema.table`` as one
identifier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from applier.decoder.messages import Relation

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.ddl.shape import TableShape


def sqlite_table_name(namespace: str, name: str, table_map: dict[str, str]) -> str:
    """The SQLite table of the source table ``namespace.name`` (an empty namespace is ``pg_catalog``'s, as
    pgoutput sends it)."""
    mapped = table_map.get(f"{namespace or 'pg_catalog'}.{name}")
    if mapped:
        return mapped
    return name if namespace in ("public", "") else f"{namespace}.{name}"


def sqlite_target_table(rel: Relation, table_map: dict[str, str]) -> tuple[str | None, str]:
    """(None, table) on a SQLite target for a source relation."""
    return None, sqlite_table_name(rel.namespace, rel.name, table_map)


def sqlite_shape_table(shape: TableShape, table_map: dict[str, str]) -> str:
    """The SQLite table of a source table known by its shape (``applier.ddl``)."""
    return sqlite_table_name(shape.schema, shape.name, table_map)
