"""Every built-in type's edge values through ``applier sync``: binary and text COPY into PostgreSQL, the value
mapping into SQLite (PostgreSQL 15 and 18).

What a user relies on: whatever the source holds arrives equal, whatever the type: empty strings, arrays,
tsqueries, tsvectors and JSON, NULLs, the extremes of numbers, dates and times, infinities and NaN, empty
ranges and multiranges, zero-length bytea, unicode. The list of types is read from the server's ``pg_type``
(every built-in base, range and multirange type, with its array type), so a type a new PostgreSQL adds fails
here until it has edge values (or a reason it cannot be stored). Each type has a table of its own
(``t_<type>``: the value and an array of it), so ``sync`` chooses binary COPY wherever the type allows it and
a failure names the type; one more table holds every type beside an enum, which makes ``sync`` copy it in
text. Types whose binary input rejects some of their own binary output (an empty tsquery, an empty
int2vector or oidvector) go in text; so do they through the stream in binary mode, by which the same values inserted
after the sync arrive. On PostgreSQL the values are compared as their output functions print
them; on SQLite as README's mapping promises (integers as INTEGER, floats as REAL with NaN as 'NaN',
booleans as 1/0, bytea as BLOB, everything else as the source prints it with the sync's pinned settings).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.engine.runner import Runner
from applier.migrate.spark.pgread import pinned_dsn
from applier.migrate.sync import sync
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config

pytest.importorskip("pyspark")

# type name -> SQL expressions of its edge values (cast to the type by the test); (expression, first major) for
# values a version before that one cannot read
EDGES: dict[str, list[str | tuple[str, int]]] = {
    "bool": ["true", "false"],
    "char": ["''", "'a'", "'\\'", "'\"'"],
    "name": ["''", "'x'", "repeat('n', 63)", "'é ✓'"],
    "int2": ["-32768", "32767", "0"],
    "int4": ["-2147483648", "2147483647", "0"],
    "int8": ["-9223372036854775808", "9223372036854775807", "0"],
    "oid": ["0", "4294967295"],
    "float4": ["'NaN'", "'Infinity'", "'-Infinity'", "'-0'", "'1.17549435e-38'", "'3.4028235e38'", "'1.4e-45'",
               "'0.1'"],
    "float8": ["'NaN'", "'Infinity'", "'-Infinity'", "'-0'", "'4.9e-324'", "'1.7976931348623157e308'", "'0.1'"],
    "numeric": ["'NaN'", "'Infinity'", "'-Infinity'", "'0'", "'-0.000'", "'1e-16383'", "'-1e100000'",
                "'123456789.000000000001'"],
    "money": ["'-92233720368547758.08'", "'92233720368547758.07'", "'0'"],
    "date": ["'infinity'", "'-infinity'", "'epoch'", "'4713-01-01 BC'", "'5874897-12-31'", "'2000-02-29'"],
    "time": ["'allballs'", "'24:00:00'", "'23:59:59.999999'"],
    "timetz": ["'00:00+15:59'", "'24:00:00-15:59'", "'12:34:56.789+05:30:15'"],
    "timestamp": ["'infinity'", "'-infinity'", "'epoch'", "'4713-01-01 00:00 BC'", "'294276-12-31 23:59:59.999999'"],
    "timestamptz": ["'infinity'", "'-infinity'", "'epoch'", "'4713-01-01 00:00+00 BC'",
                    "'294276-12-31 23:59:59.999999+00'", "'2000-01-01 12:00+05:30'"],
    "interval": ["'0'", "'-178000000 years'", "'178000000 years'", "'-2147483647 days -2562047787:59:59.999999'",
                 "'1 mon -1 day 00:00:00.000001'", ("'infinity'", 17), ("'-infinity'", 17)],
    "point": ["'(0,0)'", "'(Infinity,-Infinity)'", "'(NaN,NaN)'", "'(1e308,-1e-308)'"],
    "lseg": ["'[(0,0),(0,0)]'", "'[(1,2),(NaN,Infinity)]'"],
    "path": ["'((0,0))'", "'[(0,0),(1,1)]'", "'((0,0),(1,1),(2,0))'"],
    "box": ["'(0,0),(0,0)'", "'(Infinity,Infinity),(-Infinity,-Infinity)'"],
    "polygon": ["'((0,0))'", "'((0,0),(1,1),(1,0))'"],
    "line": ["'{1,-1,0}'", "'{0,1,-1e308}'"],
    "circle": ["'<(0,0),0>'", "'<(1,1),Infinity>'"],
    "cidr": ["'0.0.0.0/0'", "'::/0'", "'255.255.255.255/32'", "'ffff:ffff::/32'"],
    "inet": ["'0.0.0.0'", "'::'", "'::ffff:1.2.3.4/128'", "'10.1.2.3/8'"],
    "macaddr": ["'00:00:00:00:00:00'", "'ff:ff:ff:ff:ff:ff'"],
    "macaddr8": ["'00:00:00:00:00:00:00:00'", "'ff:ff:ff:ff:ff:ff:ff:ff'"],
    "text": ["''", "'é ✓ 𝄞'", "E'tab\\there\\nnl\\r\\\\ back \"q\" ,;{}'", "repeat('x', 100000)"],
    "varchar": ["''", "'é ✓ 𝄞'", "E'tab\\there\\nnl\\r\\\\'"],
    "bpchar": ["''", "' a  '", "'é'"],
    "bytea": ["'\\x'", "'\\x00ff5c0a0d'", "decode(repeat('ab', 5000), 'hex')"],
    "tid": ["'(0,0)'", "'(4294967295,65535)'"],
    "xid": ["'0'", "'4294967295'"],
    "cid": ["'0'", "'4294967295'"],
    "xid8": ["'0'", "'18446744073709551615'"],
    "json": ["'\"\"'", "'{}'", "'[]'", "'null'", "'  {\"a\" : 1,  \"a\": 2 }  '", "'\"\\u0000 é\"'"],
    "jsonb": ["'{}'", "'[]'", "'null'", "'\"\"'", "'1e1000'", "'{\"a\": [1, \"é\", null, true, -0.0]}'"],
    "jsonpath": ["'$'", "'strict $.a[*] ? (@ > 1)'", "'$.\"\"'", "'lax $'"],
    "xml": ["''", "'<a/>'", "'text only &amp; é'", "'<?xml version=\"1.0\"?><a>x</a>'"],
    "refcursor": ["''", "'c'"],
    "uuid": ["'00000000-0000-0000-0000-000000000000'", "'ffffffff-ffff-ffff-ffff-ffffffffffff'"],
    "txid_snapshot": ["'1:1:'", "'10:20:10,11,19'"],
    "pg_snapshot": ["'1:1:'", "'10:20:10,11,19'"],
    "pg_lsn": ["'0/0'", "'FFFFFFFF/FFFFFFFF'"],
    "tsvector": ["''", "'a'", "'a:1A b:2,3 ''x y'':4'", "'é:16383'"],
    "tsquery": ["''", "'a'", "'!a'", "'a & (b | !c) <-> d'", "'a:*AB <3> é'"],
    "bit": ["''", "'0'", "'10101'"],
    "varbit": ["''", "'1'", "'0101010101'"],
    "int2vector": ["''", "'1 -2 32767'"],
    "oidvector": ["''", "'0 4294967295'"],
    "aclitem": ["format('=r/%I', current_user)"],
    "int4range": ["'empty'", "'(,)'", "'[-2147483648,2147483647)'"],
    "int8range": ["'empty'", "'(,)'", "'[-9223372036854775808,9223372036854775807)'"],
    "numrange": ["'empty'", "'(,)'", "'[-Infinity,Infinity]'", "'(0,1e-100]'"],
    "tsrange": ["'empty'", "'(,)'", "'[-infinity,infinity]'", "'[epoch,2000-01-01)'"],
    "tstzrange": ["'empty'", "'(,)'", "'[-infinity,infinity]'"],
    "daterange": ["'empty'", "'(,)'", "'[-infinity,infinity)'", "'[4713-01-01 BC,5874897-12-30]'"],
    "int4multirange": ["'{}'", "'{[1,2),[5,)}'"],
    "int8multirange": ["'{}'", "'{(,)}'"],
    "nummultirange": ["'{}'", "'{[-Infinity,0],[1,Infinity]}'"],
    "tsmultirange": ["'{}'", "'{[-infinity,infinity]}'"],
    "tstzmultirange": ["'{}'", "'{[epoch,infinity)}'"],
    "datemultirange": ["'{}'", "'{[-infinity,epoch),[2000-01-01,infinity)}'"],
    "regproc": ["'-'", "'now'"],
    "regprocedure": ["'-'", "'abs(integer)'"],
    "regoper": ["'0'", "'||/'"],
    "regoperator": ["'0'", "'+(integer,integer)'"],
    "regclass": ["'-'", "'pg_class'"],
    "regtype": ["'-'", "'integer[]'"],
    "regconfig": ["'-'", "'english'"],
    "regdictionary": ["'-'", "'simple'"],
    "regnamespace": ["'-'", "'pg_catalog'"],
    "regrole": ["'-'", "'pg_monitor'"],
    "regcollation": ["'-'", "'\"C\"'"],
}
# built-in types a table cannot hold a value of: their input functions refuse every value (statistics and
# planner internals, the index-only gtsvector)
NOT_STORABLE = {"pg_node_tree", "pg_ndistinct", "pg_dependencies", "pg_mcv_list", "pg_brin_bloom_summary",
                "pg_brin_minmax_multi_summary", "gtsvector"}
# types whose binary input rejects some of their own binary output (found by this test), or that have no binary
# form (aclitem), or whose binary form is a catalog OID (the reg* types): their tables go in text
TEXT_COPIED = {"tsquery", "int2vector", "oidvector", "aclitem", "regproc", "regprocedure", "regoper", "regoperator",
               "regclass", "regtype", "regconfig", "regdictionary", "regnamespace", "regrole", "regcollation"}

BUILTIN_TYPES = """
SELECT typname FROM pg_type WHERE oid < 10000 AND typtype IN ('b', 'r', 'm') AND typnamespace = 'pg_catalog'::regnamespace
  AND NOT (typcategory = 'A' AND typname LIKE '\\_%') ORDER BY 1
"""
SQLITE_INTEGER = {"int2", "int4", "int8", "oid"}


def _values(version: int, typname: str) -> list[str]:
    return [v if isinstance(v, str) else v[0] for v in EDGES[typname] if isinstance(v, str) or v[1] <= version]


def _make_source(db: ScratchDb, version: int, leave_out: frozenset[str] = frozenset()) -> list[str]:
    """The source's tables (``t_<type>`` each, ``every`` with an enum) and publication; the types stored (not those
    in ``leave_out``)."""
    listed = [r[0] for r in db.cluster.execute(BUILTIN_TYPES, db.dbname)]
    assert sorted(set(listed) - NOT_STORABLE) == sorted(EDGES), "every built-in type has edge values"
    stored = []
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        for typname in sorted(set(EDGES) - leave_out):
            t = f'pg_catalog."{typname}"'
            try:
                conn.execute(f"SELECT ({_values(version, typname)[-1]})::{t}")
            except psycopg.errors.FeatureNotSupported:
                continue  # this server was built without it (xml without libxml)
            stored.append(typname)
            vals = [f"({v})::{t}" for v in _values(version, typname)]
            conn.execute(f"CREATE TABLE t_{typname} (id int PRIMARY KEY, v {t}, a {t}[])")
            conn.execute(f"INSERT INTO t_{typname} VALUES (0, NULL, NULL), (-1, NULL, '{{}}'), "
                         f"(-2, NULL, ARRAY[{', '.join(vals)}, NULL])"
                         + "".join(f", ({i}, {v}, ARRAY[{v}])" for i, v in enumerate(vals, 1)))
        conn.execute("CREATE TYPE mood AS ENUM ('ok')")
        conn.execute("CREATE TABLE every (id int PRIMARY KEY, m mood, "
                     + ", ".join(f'v_{n} pg_catalog."{n}", a_{n} pg_catalog."{n}"[]' for n in stored) + ")")
        conn.execute("INSERT INTO every (id) SELECT g FROM generate_series(0, 8) g")
        for n in stored:
            for i, v in enumerate(_values(version, n), 1):
                conn.execute(f'UPDATE every SET v_{n} = ({v})::pg_catalog."{n}", '
                             f'a_{n} = ARRAY[({v})::pg_catalog."{n}", NULL] WHERE id = {i}')
            conn.execute(f"UPDATE every SET a_{n} = '{{}}' WHERE id = 0")
        conn.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    return stored


def _tables(stored: list[str]) -> list[tuple[str, list[str]]]:
    return [(f"t_{n}", ["v", "a"]) for n in stored] + [("every", [c for n in stored for c in (f"v_{n}", f"a_{n}")])]


def _printed(conn: psycopg.Connection[Any], table: str, columns: list[str]) -> list[tuple[Any, ...]]:
    """The rows of ``table`` as the output functions print them (NULL as None), by id (``format``: a value's output
    function; ``::text`` is not always that, e.g. xml's declaration)."""
    printed = ", ".join(f"CASE WHEN {c} IS NOT NULL THEN format('%s', {c}) END" for c in columns)
    return conn.execute(f"SELECT id, {printed} FROM {table} ORDER BY id").fetchall()


def test_every_builtin_type_into_postgres(spark, source_db: ScratchDb, target_db: ScratchDb, pg_install: Any,
                                          tmp_path: Path) -> None:
    stored = _make_source(source_db, pg_install.version)
    res = sync(make_config(source_db, target_db.url, tmp_path / "work", partitions=1), spark=spark)
    formats = {t.table: t.copy_format for t in res.tables}
    assert formats == {f"public.t_{n}": "text" if n in TEXT_COPIED else "binary" for n in stored} | {
        "public.every": "text"}
    with psycopg.connect(source_db.dsn, autocommit=True) as src, psycopg.connect(target_db.dsn, autocommit=True) as dst:
        for table, columns in _tables(stored):
            assert _printed(dst, table, columns) == _printed(src, table, columns), table


def test_every_builtin_type_streamed_in_binary_mode_into_postgres(spark, source_db: ScratchDb, target_db: ScratchDb,
                                                                 pg_install: Any, tmp_path: Path) -> None:
    """After the sync, the same edge values inserted on the source arrive through the stream in binary mode
    (``source.binary = true``): in COPY's binary format where the type allows it, else as text (an empty
    tsquery, int2vector or oidvector, which their binary input refuses). Not aclitem: pgoutput cannot send a table
    with an aclitem[] column in binary mode at all (applier.targets.binary)."""
    stored = _make_source(source_db, pg_install.version, frozenset({"aclitem"}))
    cfg = make_config(source_db, target_db.url, tmp_path / "work", partitions=1, **{"source.binary": True})
    sync(cfg, spark=spark)
    source_db.cluster.execute("".join(f"INSERT INTO t_{n} SELECT id + 100, v, a FROM t_{n};" for n in stored)
                              + "INSERT INTO every SELECT id + 100, m, " + ", ".join(
                                  f"v_{n}, a_{n}" for n in stored) + " FROM every", source_db.dbname)
    Runner(cfg, catchup=True).run()
    with psycopg.connect(source_db.dsn, autocommit=True) as src, psycopg.connect(target_db.dsn, autocommit=True) as dst:
        for table, columns in _tables(stored):
            want = _printed(src, table, columns)
            assert len(want) > 2 and _printed(dst, table, columns) == want, table


def _sqlite_value(typname: str, text: str | None) -> Any:
    """README's mapping of a source value (as the sync's pinned session prints it) into SQLite."""
    if text is None or typname.startswith("_"):
        return text
    if typname in SQLITE_INTEGER:
        return int(text)
    if typname in ("float4", "float8"):
        return "NaN" if text == "NaN" else float(text)
    if typname == "bool":
        return 1 if text == "t" else 0
    if typname == "bytea":
        return bytes.fromhex(text[2:])
    return text


def test_every_builtin_type_into_sqlite(spark, source_db: ScratchDb, pg_install: Any, tmp_path: Path) -> None:
    stored = _make_source(source_db, pg_install.version)
    db = tmp_path / "replica.db"
    sync(make_config(source_db, f"sqlite:///{db}", tmp_path / "work", partitions=1), spark=spark)
    lite = sqlite3.connect(db)
    pinned = psycopg.connect(pinned_dsn(source_db.dsn), autocommit=True)
    try:
        for table, columns in _tables(stored):
            kinds = [c[2:] if c.startswith("v_") else "_" for c in columns] if table == "every" else \
                [table[2:], "_"]
            want = [(r[0], *(_sqlite_value(k, v) for k, v in zip(kinds, r[1:], strict=True)))
                    for r in _printed(pinned, table, columns)]
            got = lite.execute(f"SELECT id, {', '.join(columns)} FROM {table} ORDER BY id").fetchall()
            assert got == want, table
    finally:
        lite.close()
        pinned.close()
