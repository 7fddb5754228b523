"""User-defined types of the published columns: read from the source catalog, created or checked on a PostgreSQL
target.

Which types (``source_types``): every type a published column's type leads to that is not built in
(``pg_catalog``, ``information_schema``): the column's own type, an array's element type, a domain's base type, a
composite type's attribute types, a range's subtype, a multirange's range; in dependency order (what a type
needs comes before it), each once, with the (table, column)s that use it.

What is created: enums (labels in order), domains (base type with modifier, collation other than the base type's,
DEFAULT, NOT NULL, CHECK constraints by name as ``pg_get_constraintdef`` writes them), composite types
(attributes with types and collations), range types (subtype, operator class and collation other than the
subtype's default, subtype_diff function, and the multirange's name when both servers have multiranges, 14+),
in the source's schema under the source's name. What cannot be: base types (written in C), types that belong to
an extension, row types of tables, ranges with a canonical function or a subtype_diff function that is not built
in; ``reason`` says which.

On the target (``plan_types``), a type of the same schema and name that exists is reused when its definition
(``spec``: kind-specific and free of OIDs, so two servers compare) is the same, and is a problem naming the type
and each difference otherwise; one that is missing is created, or, when it cannot be, a problem naming every
table and column that needs it. The caller runs the statements in its transaction, with the tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from applier.text import quote_ident, quote_literal

BUILT_IN = ("pg_catalog", "information_schema")


@dataclass
class SourceType:
    """One user-defined type. Invariant: ``spec`` holds only names and values that mean the same on another server
    (type names as ``format_type`` writes them, no OIDs); ``depends`` are the OIDs of the user types it needs."""

    schema: str
    name: str
    oid: int
    kind: str  # 'enum', 'domain', 'composite', 'range', 'base'
    spec: dict[str, Any]
    depends: list[int] = field(default_factory=list)
    reason: str | None = None  # why it cannot be created; None: it can
    used_by: list[tuple[str, str]] = field(default_factory=list)  # (table, column)

    @property
    def qualified(self) -> str:
        """schema.type as text (for people)."""
        return f"{self.schema}.{self.name}"

    @property
    def qname(self) -> str:
        """Quoted "schema"."type" for SQL."""
        return f"{quote_ident(self.schema)}.{quote_ident(self.name)}"


_TYPE = """
SELECT t.oid::int, n.nspname, t.typname, t.typtype::text, t.typcategory::text, t.typelem::int, t.typrelid::int,
       t.typbasetype::int, format_type(t.typbasetype, t.typtypmod), t.typnotnull, t.typdefault,
       CASE WHEN t.typcollation <> coalesce(b.typcollation, 0) THEN format('%%I.%%I', cn.nspname, co.collname) END,
       t.typinput::regproc::text,
       (SELECT e.extname FROM pg_depend d JOIN pg_extension e ON e.oid = d.refobjid
        WHERE d.classid = 'pg_type'::regclass AND d.objid = t.oid AND d.refclassid = 'pg_extension'::regclass
        AND d.deptype = 'e' LIMIT 1)
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace LEFT JOIN pg_type b ON b.oid = t.typbasetype
LEFT JOIN pg_collation co ON co.oid = t.typcollation LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
WHERE t.oid = %s
"""

_ATTRIBUTES = """
SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod),
       CASE WHEN a.attcollation <> t.typcollation THEN format('%%I.%%I', cn.nspname, co.collname) END
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_collation co ON co.oid = a.attcollation LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum
"""

_RANGE = """
SELECT r.rngsubtype::int, format_type(r.rngsubtype, NULL),
       CASE WHEN NOT oc.opcdefault THEN format('%%I.%%I', ocn.nspname, oc.opcname) END,
       CASE WHEN r.rngcollation <> s.typcollation THEN format('%%I.%%I', cn.nspname, co.collname) END,
       r.rngcanonical::regproc::text, r.rngcanonical <> 0,
       CASE WHEN r.rngsubdiff <> 0 THEN format('%%I.%%I', fn.nspname, f.proname) END, fn.nspname, {multirange}
FROM pg_range r JOIN pg_type s ON s.oid = r.rngsubtype
JOIN pg_opclass oc ON oc.oid = r.rngsubopc JOIN pg_namespace ocn ON ocn.oid = oc.opcnamespace
LEFT JOIN pg_collation co ON co.oid = r.rngcollation LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
LEFT JOIN pg_proc f ON f.oid = r.rngsubdiff LEFT JOIN pg_namespace fn ON fn.oid = f.pronamespace
WHERE r.rngtypid = %s
"""


class _Reader:
    """Reads types of one server by OID, each once; ``order`` is the dependency order (post-order)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.multiranges = conn.info.server_version >= 140000
        self.types: dict[int, SourceType | None] = {}  # None: built in, or not a type of its own (array)
        self.order: list[int] = []

    def user_types(self, oid: int) -> list[int]:
        """The user types ``oid`` leads to (itself, or an array's element, a multirange's range), read with
        everything they need."""
        row = self.conn.execute(_TYPE, [oid]).fetchone()
        if row is None or row[1] in BUILT_IN:
            return []
        typtype, category, elem = row[3], row[4], row[5]
        if typtype == "b" and category == "A" and elem:
            return self.user_types(elem)
        if typtype == "m":
            rng = self.conn.execute("SELECT rngtypid::int FROM pg_range WHERE rngmultitypid = %s", [oid]).fetchone()
            return self.user_types(rng[0]) if rng else []
        self.read(oid)
        return [oid] if self.types.get(oid) else []

    def read(self, oid: int) -> SourceType | None:
        """The type ``oid`` as a SourceType (its dependencies read first), or None if it is built in."""
        if oid in self.types:
            return self.types[oid]
        self.types[oid] = None  # no cycles among these types; guards against surprises
        row = self.conn.execute(_TYPE, [oid]).fetchone()
        if row is None or row[1] in BUILT_IN:
            return None
        (_, schema, name, typtype, _, _, relid, basetype, base_sql, notnull, default, collation, typinput,
         extension) = row
        depends: list[int] = []
        reason: str | None = None
        spec: dict[str, Any]
        if typtype == "e":
            kind = "enum"
            spec = {"labels": [r[0] for r in self.conn.execute(
                "SELECT enumlabel FROM pg_enum WHERE enumtypid = %s ORDER BY enumsortorder", [oid])]}
        elif typtype == "d":
            kind = "domain"
            depends = self.user_types(basetype)
            checks = sorted((r[0], r[1]) for r in self.conn.execute(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE contypid = %s AND contype = 'c'",
                [oid]))
            spec = {"base type": base_sql, "collation": collation, "default": default, "not null": notnull,
                    "checks": checks}
        elif typtype == "c":
            kind = "composite"
            relkind = self.conn.execute("SELECT relkind::text, relname FROM pg_class WHERE oid = %s",
                                        [relid]).fetchone()
            attrs = []
            for attname, atttypid, att_sql, att_coll in self.conn.execute(_ATTRIBUTES, [relid]):
                depends += [d for d in self.user_types(atttypid) if d not in depends]
                attrs.append((attname, att_sql, att_coll))
            spec = {"attributes": attrs}
            if relkind is None or relkind[0] != "c":
                reason = "it is the row type of a table, not a composite type of its own"
        elif typtype == "r":
            kind = "range"
            multi = "format('%%I.%%I', mn.nspname, m.typname) FROM pg_type m JOIN pg_namespace mn " \
                    "ON mn.oid = m.typnamespace WHERE m.oid = r.rngmultitypid" if self.multiranges else "NULL"
            sql = _RANGE.format(multirange=f"(SELECT {multi})" if self.multiranges else "NULL")
            r = self.conn.execute(sql, [oid]).fetchone()
            assert r is not None  # every range type has its pg_range row
            subtype, sub_sql, opclass, rcoll, canonical, has_canonical, subdiff, diff_schema, multirange = r
            depends = self.user_types(subtype)
            spec = {"subtype": sub_sql, "operator class": opclass, "collation": rcoll, "subtype_diff": subdiff,
                    "multirange": multirange}
            if has_canonical:
                reason = f"a range type with a canonical function ({canonical}, written in C)"
            elif subdiff and diff_schema not in BUILT_IN:
                reason = f"a range type with a subtype_diff function of its own ({subdiff})"
        else:
            kind = "base"
            spec = {"input function": typinput}
            reason = f"a base type (input function {typinput}, written in C)"
        if extension:
            reason = f"it belongs to extension {extension}: install the extension on the target first"
        t = SourceType(schema, name, oid, kind, spec, depends, reason)
        self.types[oid] = t
        self.order.append(oid)
        return t


def source_types(conn: psycopg.Connection[Any], columns: Iterable[tuple[str, str, int]]) -> list[SourceType]:
    """The user types of ``columns`` ((table, column, type OID)s) and what they need, in dependency order, each
    with the (table, column)s whose type leads to it (directly or through other types)."""
    reader = _Reader(conn)
    for table, column, oid in columns:
        seen: set[int] = set()
        todo = reader.user_types(oid)
        while todo:
            t = todo.pop()
            if t not in seen:
                seen.add(t)
                found = reader.types[t]
                assert found is not None
                found.used_by.append((table, column))
                todo += found.depends
    return [t for t in (reader.types[o] for o in reader.order) if t is not None]


def target_type(conn: psycopg.Connection[Any], schema: str, name: str) -> SourceType | None:
    """The target's type of this schema and name, described as ``source_types`` describes a source's, or None."""
    row = conn.execute("SELECT t.oid::int FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
                       "WHERE n.nspname = %s AND t.typname = %s", [schema, name]).fetchone()
    return None if row is None else _Reader(conn).read(row[0])


def differences(source: SourceType, target: SourceType) -> list[str]:
    """How the target's type differs from the source's ('' list: the same). A multirange name is compared only
    when both servers have one."""
    if source.kind != target.kind:
        return [f"a {source.kind} on the source, a {target.kind} on the target"]
    out = []
    for key, want in source.spec.items():
        have = target.spec.get(key)
        if key == "multirange" and (want is None or have is None):
            continue
        if have != want:
            out.append(f"{key}: source {_shown(want)}, target {_shown(have)}")
    return out


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value if v is not None)
    return "none" if value is None else str(value)


def create_statements(t: SourceType, multiranges: bool) -> list[str]:
    """CREATE TYPE / DOMAIN for a type that can be created (``reason`` None); ``multiranges``: the target has them
    (14+), so a range's multirange keeps its source name."""
    s = t.spec
    if t.kind == "enum":
        body = f"CREATE TYPE {t.qname} AS ENUM (" + ", ".join(quote_literal(v) for v in s["labels"]) + ")"
    elif t.kind == "domain":
        body = f"CREATE DOMAIN {t.qname} AS {s['base type']}"
        if s["collation"]:
            body += f" COLLATE {s['collation']}"
        if s["default"] is not None:
            body += f" DEFAULT {s['default']}"
        if s["not null"]:
            body += " NOT NULL"
        for conname, condef in s["checks"]:
            body += f" CONSTRAINT {quote_ident(conname)} {condef}"
    elif t.kind == "composite":
        body = f"CREATE TYPE {t.qname} AS (" + ", ".join(
            f"{quote_ident(n)} {sql}" + (f" COLLATE {coll}" if coll else "") for n, sql, coll in s["attributes"]) + ")"
    elif t.kind == "range":
        opts = [f"SUBTYPE = {s['subtype']}"]
        for key, opt in (("operator class", "SUBTYPE_OPCLASS"), ("collation", "COLLATION"),
                         ("subtype_diff", "SUBTYPE_DIFF")):
            if s[key]:
                opts.append(f"{opt} = {s[key]}")
        if multiranges and s["multirange"]:
            opts.append(f"MULTIRANGE_TYPE_NAME = {s['multirange']}")
        body = f"CREATE TYPE {t.qname} AS RANGE (" + ", ".join(opts) + ")"
    else:
        raise ValueError(f"type {t.qualified} cannot be created: {t.reason}")
    return [f"CREATE SCHEMA IF NOT EXISTS {quote_ident(t.schema)}", body]


def plan_types(conn: psycopg.Connection[Any], types: list[SourceType]) -> tuple[list[str], list[str]]:
    """(statements creating the missing types in order, problems) on the target ``conn``: see the module
    docstring."""
    multiranges = conn.info.server_version >= 140000
    statements: list[str] = []
    problems: list[str] = []
    for t in types:
        have = target_type(conn, t.schema, t.name)
        if have is not None:
            diff = differences(t, have) if t.kind != "base" else []
            if diff:
                problems.append(f"type {t.qualified} exists on the target with another definition: "
                                + "; ".join(diff))
        elif t.reason:
            for table, column in t.used_by:
                problems.append(f"target table {table}, column {column}: type {t.qualified} cannot be created on "
                                f"the target: {t.reason}")
        else:
            statements += create_statements(t, multiranges)
    return statements, problems
