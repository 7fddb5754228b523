"""What the published columns need from the source catalog (user-defined types, the functions and collations they
and the columns use): read, created or checked on a PostgreSQL target.

Which types (``source_types``): every type a published column's type leads to that is not built in
(``pg_catalog``, ``information_schema``): the column's own type, an array's element type, a domain's base type, a
composite type's attribute types, a range's subtype, a multirange's range. Which functions and collations: those the
source's ``pg_depend`` records (normal dependencies on user objects) for a column (its collation), a generated
column's expression, a domain (its DEFAULT, collation and CHECK constraints), a composite type's attributes, a range
type (its collation, subtype_diff function), and a function (its argument and result types, the functions a
SQL-standard body calls). All in dependency order (what an object needs comes before it), each once, with the
(table, column)s that need it.

What is created: enums (labels in order), domains (base type with modifier, collation other than the base type's,
DEFAULT, NOT NULL, CHECK constraints by name as ``pg_get_constraintdef`` writes them), composite types
(attributes with types and collations), range types (subtype, operator class and collation other than the
subtype's default, subtype_diff function, and the multirange's name when both servers have multiranges, 14+),
functions in SQL or PL/pgSQL (as ``pg_get_functiondef`` writes them, with ``check_function_bodies`` off, as
pg_dump restores them), collations (provider, locale or lc_collate/lc_ctype, deterministic, ICU rules), in the
source's schema under the source's name. What cannot be: base types (written in C), types and functions that
belong to an extension, row types of tables, ranges with a canonical function, functions in another language
(C, internal) and aggregates; ``reason`` says which.

On the target (``plan_types``), a type of the same schema and name that exists is reused when its definition
(``spec``: kind-specific and free of OIDs, so two servers compare) is the same, and is a problem naming the type
and each difference otherwise; a function of the same name and argument types, or a collation of the same name,
that exists is reused as it is. One that is missing is created, or, when it cannot be, named in one problem line
listing every missing object with every table and column that needs it. The caller runs the statements in its
transaction, with the tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from applier.text import quote_ident, quote_literal

BUILT_IN = ("pg_catalog", "information_schema")


# An object of the source catalog: ('type' | 'function' | 'collation', its OID in pg_type, pg_proc, pg_collation).
Key = tuple[str, int]
# The catalogs pg_depend names, by the kind of object their rows are.
_CATALOG_KIND = {"pg_type": "type", "pg_proc": "function", "pg_collation": "collation"}
FIRST_NORMAL_OID = 16384  # objects below it are made by initdb (pg_catalog, information_schema)


@dataclass
class SourceType:
    """One user-defined object the tables need: a type, a function or a collation. Invariant: ``spec`` holds only
    names and values that mean the same on another server (type names as ``format_type`` writes them, no OIDs);
    ``depends`` are the keys of the user objects it needs."""

    schema: str
    name: str
    oid: int
    kind: str  # 'enum', 'domain', 'composite', 'range', 'base', 'function', 'collation'
    spec: dict[str, Any]
    depends: list[Key] = field(default_factory=list)
    reason: str | None = None  # why it cannot be created; None: it can
    used_by: list[tuple[str, str]] = field(default_factory=list)  # (table, column)

    @property
    def noun(self) -> str:
        """'type', 'function' or 'collation' (for people; the first part of its ``Key``)."""
        return self.kind if self.kind in ("function", "collation") else "type"

    @property
    def qualified(self) -> str:
        """schema.name as text (for people; a function with its argument types)."""
        args = f"({self.spec['arguments']})" if self.kind == "function" else ""
        return f"{self.schema}.{self.name}{args}"

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


_NEEDS = """
SELECT DISTINCT d.refclassid::regclass::text, d.refobjid::int FROM pg_depend d
WHERE d.classid = %s::regclass AND d.objid = %s AND (%s::int IS NULL OR d.objsubid = %s) AND d.deptype = 'n'
  AND d.refclassid IN ('pg_type'::regclass, 'pg_proc'::regclass, 'pg_collation'::regclass) AND d.refobjid >= %s
ORDER BY 1, 2
"""

_EXTENSION = """(SELECT e.extname FROM pg_depend d JOIN pg_extension e ON e.oid = d.refobjid
    WHERE d.classid = '{catalog}'::regclass AND d.objid = {outer}.oid AND d.refclassid = 'pg_extension'::regclass
    AND d.deptype = 'e' LIMIT 1)"""

_FUNCTION = f"""
SELECT n.nspname, p.proname, oidvectortypes(p.proargtypes), l.lanname, p.prokind::text,
       {_EXTENSION.format(catalog='pg_proc', outer='p')}
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace JOIN pg_language l ON l.oid = p.prolang
WHERE p.oid = %s
"""

_COLLATION = f"""
SELECT n.nspname, c.collname, to_jsonb(c), {_EXTENSION.format(catalog='pg_collation', outer='c')}
FROM pg_collation c JOIN pg_namespace n ON n.oid = c.collnamespace WHERE c.oid = %s
"""

CREATED_LANGUAGES = ("sql", "plpgsql")  # functions in these languages are created from their definitions
_PROVIDERS = {"c": "libc", "i": "icu", "b": "builtin"}


class _Reader:
    """Reads the objects of one server by key, each once; ``order`` is the dependency order (post-order)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.multiranges = conn.info.server_version >= 140000
        self.types: dict[Key, SourceType | None] = {}  # None: built in, or not a type of its own (array)
        self.order: list[Key] = []

    def user_types(self, oid: int) -> list[Key]:
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
        return [("type", oid)] if self.types.get(("type", oid)) else []

    def needs(self, catalog: str, oid: int, subid: int | None = None) -> list[Key]:
        """The user types, functions and collations the source's ``pg_depend`` says object ``oid`` of ``catalog``
        (its column ``subid`` of a table, or any) needs, each read with everything it needs."""
        out: list[Key] = []
        for refclass, ref in self.conn.execute(_NEEDS, [catalog, oid, subid, subid, FIRST_NORMAL_OID]).fetchall():
            kind = _CATALOG_KIND[refclass]
            found = self.user_types(ref) if kind == "type" else [k for k in [self.read_other(kind, ref)] if k]
            out += [k for k in found if k not in out]
        return out

    def column_needs(self, table: int, attnum: int, generated: bool) -> list[Key]:
        """What a table's column needs besides its type: its collation, and a generated column's expression's
        functions (a default that is not a constant is not created, so what it calls is not needed)."""
        out = self.needs("pg_class", table, attnum)
        if generated:
            row = self.conn.execute("SELECT oid::int FROM pg_attrdef WHERE adrelid = %s AND adnum = %s",
                                    [table, attnum]).fetchone()
            if row is not None:
                out += [k for k in self.needs("pg_attrdef", row[0]) if k not in out]
        return out

    def read_other(self, kind: str, oid: int) -> Key | None:
        """The function or collation ``oid`` read (its dependencies first); its key, or None if it is built in."""
        key = (kind, oid)
        if key in self.types:
            return key if self.types[key] else None
        self.types[key] = None  # guards against cycles (a function calling itself)
        depends: list[Key] = []
        reason: str | None = None
        spec: dict[str, Any]
        if kind == "function":
            row = self.conn.execute(_FUNCTION, [oid]).fetchone()
            if row is None or row[0] in BUILT_IN:
                return None
            schema, name, args, language, prokind, extension = row
            spec = {"arguments": args}
            if prokind not in ("f", "p"):
                reason = "an aggregate or window function"
            elif language not in CREATED_LANGUAGES:
                reason = f"a function in language {language}; only SQL and PL/pgSQL functions are created"
            else:
                definition = self.conn.execute("SELECT pg_get_functiondef(%s)", [oid]).fetchone()
                assert definition is not None  # the function was just read
                spec["definition"] = definition[0]
                depends = self.needs("pg_proc", oid)
        else:
            row = self.conn.execute(_COLLATION, [oid]).fetchone()
            if row is None or row[0] in BUILT_IN:
                return None
            schema, name, c, extension = row
            provider = _PROVIDERS.get(c["collprovider"])
            spec = {"provider": provider, "deterministic": c["collisdeterministic"],
                    "locale": c.get("colllocale") or c.get("colliculocale"), "lc_collate": c.get("collcollate"),
                    "lc_ctype": c.get("collctype"), "rules": c.get("collicurules")}
            if provider is None:
                reason = f"a collation of provider {c['collprovider']!r}"
        if extension:
            reason = f"it belongs to extension {extension}: install the extension on the target first"
        self.types[key] = SourceType(schema, name, oid, kind, spec, depends, reason)
        self.order.append(key)
        return key

    def read(self, oid: int) -> SourceType | None:
        """The type ``oid`` as a SourceType (its dependencies read first), or None if it is built in."""
        key = ("type", oid)
        if key in self.types:
            return self.types[key]
        self.types[key] = None  # no cycles among these types; guards against surprises
        row = self.conn.execute(_TYPE, [oid]).fetchone()
        if row is None or row[1] in BUILT_IN:
            return None
        (_, schema, name, typtype, _, _, relid, basetype, base_sql, notnull, default, collation, typinput,
         extension) = row
        depends: list[Key] = []
        reason: str | None = None
        spec: dict[str, Any]
        if typtype == "e":
            kind = "enum"
            spec = {"labels": [r[0] for r in self.conn.execute(
                "SELECT enumlabel FROM pg_enum WHERE enumtypid = %s ORDER BY enumsortorder", [oid])]}
        elif typtype == "d":
            kind = "domain"
            depends = self.user_types(basetype)
            checks = []
            for conoid, conname, condef in self.conn.execute(
                    "SELECT oid::int, conname, pg_get_constraintdef(oid) FROM pg_constraint "
                    "WHERE contypid = %s AND contype = 'c' ORDER BY conname", [oid]).fetchall():
                checks.append((conname, condef))
                depends += [k for k in self.needs("pg_constraint", conoid) if k not in depends]
            depends += [k for k in self.needs("pg_type", oid) if k not in depends]  # DEFAULT, collation
            spec = {"base type": base_sql, "collation": collation, "default": default, "not null": notnull,
                    "checks": checks}
        elif typtype == "c":
            kind = "composite"
            relkind = self.conn.execute("SELECT relkind::text, relname FROM pg_class WHERE oid = %s",
                                        [relid]).fetchone()
            attrs = []
            for attname, atttypid, att_sql, att_coll in self.conn.execute(_ATTRIBUTES, [relid]).fetchall():
                depends += [d for d in self.user_types(atttypid) if d not in depends]
                attrs.append((attname, att_sql, att_coll))
            depends += [k for k in self.needs("pg_class", relid) if k not in depends]  # attributes' collations
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
            subtype, sub_sql, opclass, rcoll, canonical, has_canonical, subdiff, _, multirange = r
            depends = self.user_types(subtype)
            depends += [k for k in self.needs("pg_type", oid) if k not in depends]  # collation, subtype_diff
            spec = {"subtype": sub_sql, "operator class": opclass, "collation": rcoll, "subtype_diff": subdiff,
                    "multirange": multirange}
            if has_canonical:
                reason = f"a range type with a canonical function ({canonical}, written in C)"
        else:
            kind = "base"
            spec = {"input function": typinput}
            reason = f"a base type (input function {typinput}, written in C)"
        if extension:
            reason = f"it belongs to extension {extension}: install the extension on the target first"
        t = SourceType(schema, name, oid, kind, spec, depends, reason)
        self.types[key] = t
        self.order.append(key)
        return t


def source_types(conn: psycopg.Connection[Any],
                 columns: Iterable[tuple[str, str, int, tuple[int, int, bool] | None]]) -> list[SourceType]:
    """The user types, functions and collations of ``columns`` ((table, column, type OID, (source table OID, attnum,
    generated) or None)) and what they need, in dependency order, each with the (table, column)s that need it
    (directly or through other objects)."""
    reader = _Reader(conn)
    for table, column, oid, where in columns:
        seen: set[Key] = set()
        todo = reader.user_types(oid)
        if where is not None:
            todo += reader.column_needs(*where)
        while todo:
            k = todo.pop()
            if k not in seen:
                seen.add(k)
                found = reader.types[k]
                assert found is not None
                found.used_by.append((table, column))
                todo += found.depends
    return [t for t in (reader.types[k] for k in reader.order) if t is not None]


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
    elif t.kind == "function" and t.reason is None:
        body = s["definition"]
    elif t.kind == "collation" and t.reason is None:
        opts = [f"provider = {s['provider']}"]
        if s["provider"] == "libc":
            opts += [f"lc_collate = {quote_literal(s['lc_collate'])}", f"lc_ctype = {quote_literal(s['lc_ctype'])}"]
        else:
            opts.append(f"locale = {quote_literal(s['locale'] or s['lc_collate'])}")
        if s["rules"]:
            opts.append(f"rules = {quote_literal(s['rules'])}")
        opts.append(f"deterministic = {'true' if s['deterministic'] else 'false'}")
        body = f"CREATE COLLATION {t.qname} (" + ", ".join(opts) + ")"
    else:
        raise ValueError(f"{t.noun} {t.qualified} cannot be created: {t.reason}")
    return [f"CREATE SCHEMA IF NOT EXISTS {quote_ident(t.schema)}", body]


def _exists(conn: psycopg.Connection[Any], t: SourceType) -> bool:
    """Whether the target has a function of ``t``'s name and argument types, or a collation of its name."""
    if t.kind == "function":
        sql, params = ("SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s "
                       "AND p.proname = %s AND oidvectortypes(p.proargtypes) = %s",
                       [t.schema, t.name, t.spec["arguments"]])
    else:
        sql, params = ("SELECT 1 FROM pg_collation c JOIN pg_namespace n ON n.oid = c.collnamespace "
                       "WHERE n.nspname = %s AND c.collname = %s AND c.collencoding IN (-1, "
                       "(SELECT encoding FROM pg_database WHERE datname = current_database()))", [t.schema, t.name])
    return conn.execute(sql, params).fetchone() is not None


def plan_types(conn: psycopg.Connection[Any], types: list[SourceType]) -> tuple[list[str], list[str]]:
    """(statements creating the missing objects in order, problems) on the target ``conn``: see the module
    docstring. Every missing object that cannot be created is named in one problem line, with the (table, column)s
    that need it."""
    multiranges = conn.info.server_version >= 140000
    statements: list[str] = []
    problems: list[str] = []
    missing: list[str] = []
    for t in types:
        if t.noun == "type" and (have := target_type(conn, t.schema, t.name)) is not None:
            diff = differences(t, have) if t.kind != "base" else []
            if diff:
                problems.append(f"type {t.qualified} exists on the target with another definition: "
                                + "; ".join(diff))
        elif t.noun != "type" and _exists(conn, t):
            continue
        elif t.reason:
            users = ", ".join(f"{table} column {column}" for table, column in t.used_by)
            missing.append(f"{t.noun} {t.qualified} ({t.reason}) for {users}")
        else:
            if t.kind == "function" and not any(s.startswith("SET LOCAL check_function_bodies") for s in statements):
                statements.insert(0, "SET LOCAL check_function_bodies = off")  # as pg_dump restores functions
            statements += create_statements(t, multiranges)
    if missing:
        problems.append("the target lacks what the tables need, and it cannot be created: " + "; ".join(missing))
    return statements, problems
