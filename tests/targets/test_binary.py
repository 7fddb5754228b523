"""Binary-mode value conversion (applier.targets.binary) against real pgoutput from real servers.

The same rows are captured twice from one slot, with and without ``binary = true``. For SQLite,
every binary-mode value must convert to exactly what text mode stores; for PostgreSQL, the
binary-mode values inserted into an identical table on the target must read back with the
same text as the source. The text output is produced under the walsender's pinned settings
(``applier.source.walsender.session_dsn``), which the capturing session copies.
"""

from __future__ import annotations

import random
import sqlite3
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from applier.decoder.messages import BINARY, TEXT, Insert, Relation, Type
from applier.decoder.pgoutput import Decoder
from applier.errors import ApplyError
from applier.targets.base import POSTGRES, SQLITE, Binding
from applier.targets.binary import (
    PgBinary,
    binary_converters,
    binary_loader,
    float8_text,
    money_text,
    register_pg_binary,
)
from applier.targets.sqlite.values import sqlite_text_converters
from applier.text import quote_ident
from tests.plugins.clusters import ScratchDb

# What the walsender session is pinned to (applier/source/walsender.py, session_dsn).
PINNED = "-c datestyle=ISO -c intervalstyle=postgres -c timezone=UTC -c extra_float_digits=3"

USER_TYPES = """
CREATE TYPE mood AS ENUM ('happy', 'sad', 'so-so', 'with space', 'NULL');
CREATE DOMAIN posint AS int4 CHECK (VALUE > 0);
CREATE DOMAIN label AS text;
"""

# name -> SQL type of every column of the big table (besides id), in order.
COLUMNS = {
    "b": "bool", "i2": "int2", "i4": "int4", "i8": "int8", "o": "oid", "f4": "float4", "f8": "float8",
    "n": "numeric", "n10": "numeric(40,10)",
    "t": "text", "vc": "varchar(20)", "bc": "char(5)", "nm": "name", "ch": '"char"', "by": "bytea",
    "d": "date", "tm": "time", "ttz": "timetz", "ts": "timestamp", "tstz": "timestamptz", "iv": "interval",
    "u": "uuid", "j": "json", "jb": "jsonb", "jp": "jsonpath", "x": "xml",
    "ia": "int4[]", "ia2": "int2[]", "ta": "text[]", "fa": "float8[]", "f4a": "float4[]", "na": "numeric[]",
    "ba": "bool[]", "da": "date[]", "tsa": "timestamptz[]", "ua": "uuid[]", "jba": "jsonb[]", "bxa": "box[]",
    "bya": "bytea[]", "iva": "interval[]", "ipa": "inet[]",
    "e": "mood", "ea": "mood[]", "pi": "posint", "lb": "label",
    "ip": "inet", "cr": "cidr", "mac": "macaddr", "mac8": "macaddr8", "bt": "bit(4)", "vb": "varbit",
    "pt": "point", "ln": "line", "ls": "lseg", "bx": "box", "pa": "path", "pg": "polygon", "ci": "circle",
    "lsn": "pg_lsn", "tid_": "tid", "x8": "xid8", "r4": "int4range", "nr": "numrange", "tr": "tstzrange",
    "dr": "daterange", "mr": "int4multirange", "acl": "aclitem",
}

ROWS: list[dict[str, str]] = [
    {  # ordinary values
        "b": "t", "i2": "-32768", "i4": "2147483647", "i8": "-9223372036854775808", "o": "4294967295",
        "f4": "1.1", "f8": "0.1", "n": "123.4500", "n10": "-1.5",
        "t": "héllo wörld", "vc": "abc", "bc": "ab", "nm": "name", "ch": "x", "by": "\\x00ff10",
        "d": "2024-02-29", "tm": "13:14:15.5", "ttz": "13:14:15+05:30", "ts": "2024-01-02 03:04:05.123456",
        "tstz": "2024-01-02 03:04:05.1+02", "iv": "1 year 2 mons 3 days 04:05:06.789",
        "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "j": '{"b": 1,  "a": [1, 2]}',
        "jb": '{"b": 1, "a": [1, 2.50], "aa": null}', "jp": "$.a[*] ? (@ > 1)", "x": "<a b='1'>x</a>",
        "ia": "{1,2,3}", "ia2": "{-1,NULL}", "ta": '{a,"b c","",NULL,"NULL","q\\"x","back\\\\slash","{}",",","null"}',
        "fa": "{1.1,NaN,Infinity,-Infinity,1e300,-0,6.76e22}", "f4a": "{1.1,4580000000,NaN}",
        "na": "{1.50,NaN,0.000}", "ba": "{t,f,NULL}", "da": "{2024-01-01,infinity}",
        "tsa": '{"2024-01-01 00:00:00+00",-infinity}', "ua": "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
        "jba": '{"{\\"a\\": 1}","[]"}', "bxa": "{(1,1),(0,0);(3,3),(2,2)}", "bya": '{"\\\\x0102",NULL}',
        "iva": '{"1 day","-00:00:01"}', "ipa": "{10.0.0.1,::1}",
        "e": "happy", "ea": '{happy,"with space","NULL",sad}', "pi": "42", "lb": "a label",
        "ip": "192.168.0.1/24", "cr": "10.0.0.0/8", "mac": "08:00:2b:01:02:03", "mac8": "08:00:2b:01:02:03:04:05",
        "bt": "1010", "vb": "10101", "pt": "(1.5,-2)", "ln": "{1,-1,0}", "ls": "[(0,0),(1,1)]",
        "bx": "(1,1),(0,0)", "pa": "[(0,0),(1,1),(2,0)]", "pg": "((0,0),(1,1),(2,0))", "ci": "<(1,2),3>",
        "lsn": "16/B374D848", "tid_": "(42,7)", "x8": "123456789012", "r4": "[1,10)", "nr": "(1.5,]",
        "tr": '["2024-01-01 00:00:00+00","2024-02-01 00:00:00+00")', "dr": "empty", "mr": "{[1,3),[5,7)}",
        "acl": "=r/postgres",
    },
    {  # infinities, NaN, empties, odd bounds
        "b": "f", "i2": "0", "i4": "-1", "i8": "0", "o": "0", "f4": "NaN", "f8": "Infinity", "n": "NaN",
        "n10": "0", "t": "", "vc": "", "bc": "", "nm": "", "ch": "", "by": "\\x", "d": "infinity",
        "tm": "24:00:00", "ttz": "00:00:00-12:34:56", "ts": "-infinity", "tstz": "infinity",
        "iv": "-1 days +02:03:04", "u": "00000000-0000-0000-0000-000000000000", "j": "[]", "jb": '"str"',
        "jp": "$", "x": "", "ia": "[0:2]={7,8,9}", "ia2": "[-3:-2][1:2]={{1,2},{3,4}}", "ta": "{}",
        "fa": "{{1,2},{3,4}}", "f4a": "{-0,3.4028235e38,1e-45}", "na": "{}", "ba": "{}", "da": "{}", "tsa": "{}",
        "ua": "{NULL}", "jba": "{}", "bxa": "{}", "bya": "{}", "iva": "{}", "ipa": "{}",
        "e": "so-so", "ea": "{}", "pi": "1", "lb": "", "ip": "::ffff:1.2.3.4", "cr": "2001:db8::/32",
        "mac": "00:00:00:00:00:00", "mac8": "00:00:00:00:00:00:00:00", "bt": "0000", "vb": "",
        "pt": "(0,0)", "ln": "{0.5,-1,1e-300}", "ls": "[(1e300,-1e-300),(0,0)]", "bx": "(0,0),(0,0)",
        "pa": "((0,0),(1,1))", "pg": "((1,1))", "ci": "<(0,0),0>", "lsn": "0/0", "tid_": "(0,0)", "x8": "0",
        "r4": "empty", "nr": "(,)", "tr": '(,"2024-01-01 00:00:00+00"]', "dr": "[2024-01-01,infinity)",
        "mr": "{}", "acl": "postgres=arwdDxt/postgres",
    },
    {  # extremes
        "b": "t", "i2": "32767", "i4": "-2147483648", "i8": "9223372036854775807", "o": "1",
        "f4": "-Infinity", "f8": "-0", "n": "-Infinity", "n10": "123456789012345678901234567890.0123456789",
        "t": "line\nbreak\ttab \\ back 'q' \"dq\" 😀", "vc": "ñ", "bc": "abcde", "nm": "x" * 63, "ch": "é",
        "by": "\\x" + "ab" * 300, "d": "4713-01-01 BC", "tm": "00:00:00", "ttz": "23:59:59.999999+14",
        "ts": "0001-01-01 00:00:00 BC", "tstz": "294276-12-31 23:59:59.999999+00", "iv": "-178000000 years",
        "u": "ffffffff-ffff-ffff-ffff-ffffffffffff", "j": '  {"k" : "v"}  ', "jb": "[1e100, -0.0, 1.000]",
        "jp": "strict $.a", "x": "<x/>", "ia": "{{{1}},{{2}}}", "ia2": "{}",
        "ta": '{" lead","trail ","a\\\\b","x\\"y","{","}","nULl"}', "fa": "{5e-324,1.7976931348623157e308,-1e-05}",
        "f4a": "{}", "na": "{-0.00000000000000000001,1e30}", "ba": "{NULL,NULL}",
        "da": "{4713-01-01 BC,5874897-12-31}", "tsa": '{"0001-01-01 00:00:00+00 BC"}', "ua": "{}",
        "jba": "{null}", "bxa": "{(1e300,2),(0,-1e-300)}", "bya": '{"\\\\x"}', "iva": '{"1 mon -1 days"}',
        "ipa": "{NULL}", "e": "with space", "ea": "{NULL,NULL}", "pi": "2147483647", "lb": "NULL",
        "ip": "::1", "cr": "1.2.3.4/32", "mac": "ff:ff:ff:ff:ff:ff", "mac8": "ff:ff:ff:ff:ff:ff:ff:ff",
        "bt": "1111", "vb": "1" * 77, "pt": "(-0,5e-324)", "ln": "{-1,0,3}", "ls": "[(1,2),(3,4)]",
        "bx": "(-1,-1),(-2,-2)", "pa": "[(1e-5,1e15)]", "pg": "((0,0),(0,1),(1,1),(1,0))", "ci": "<(-1,-1),1e-10>",
        "lsn": "FFFFFFFF/FFFFFFFF", "tid_": "(4294967295,65535)", "x8": "18446744073709551615",
        "r4": "(,5]", "nr": "[-1.5,1e20]", "tr": "(,)", "dr": "[4713-01-01 BC,2000-01-01)", "mr": "{(,3),[5,)}",
        "acl": "=/postgres",
    },
    {  # more network and time forms
        "ip": "1:0:0:1:0:0:0:1", "cr": "::/0", "tm": "23:59:59.000001", "ttz": "12:00:00-00:00:01",
        "ts": "12345-06-07 08:09:10.5", "tstz": "1999-12-31 23:59:59.999999-08", "d": "0001-12-31 BC",
        "iv": "-2 years -3 mons +1 day -00:00:00.000001", "ipa": "{::ffff:0:1,0:0:0:0:0:ffff:0:1,::1.2.3.4,1::}",
        "n": "0.0000000000000000000000000001", "n10": "-0.0000000001", "f4": "1e-38", "f8": "1e15",
        "fa": "{1e14,123456789012345.6,1234567890123456,0.0001,1e-05}", "f4a": "{100000,1000000,123456,1e14}",
    },
    {},  # every column NULL
]


def random_rows(rng: random.Random, n: int, first_id: int) -> list[tuple[int, dict[str, str]]]:
    """Rows of random values for the columns where formatting has the most cases."""
    alphabet = string.ascii_letters + string.digits + " \t\n\\\"'{},;()[]é😀NULnul"

    def rfloat() -> str:
        k = rng.random()
        if k < 0.4:
            return repr(rng.uniform(-1e6, 1e6))
        if k < 0.7:
            return f"{rng.randint(1, 9999)}e{rng.randint(-30, 30)}"
        return repr(rng.choice([1.0, -1.0]) * 10 ** rng.uniform(-300, 300))

    def rtext() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))

    def rts() -> str:
        bc = rng.random() < 0.1
        y = rng.randint(1, 4713) if bc else rng.randint(1, 294275)
        return (f"{y:04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
                f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}.{rng.randint(0, 999999):06d}{' BC' if bc else ''}")

    def quote(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    out = []
    for k in range(n):
        row = {
            "f4": f"{rng.uniform(-1, 1) * 10 ** rng.uniform(-37, 38):.{rng.randint(1, 12)}g}",
            "f8": rfloat(),
            "n": str(rng.randint(-10**30, 10**30)) + "." + str(rng.randint(0, 10**rng.randint(0, 20))),
            "t": rtext(), "ta": "{" + ",".join(quote(rtext()) for _ in range(rng.randint(0, 5))) + "}",
            "fa": "{" + ",".join(rfloat() for _ in range(rng.randint(0, 6))) + "}",
            "f4a": "{" + ",".join(f"{rng.uniform(-1e4, 1e4):.{rng.randint(1, 12)}g}" for _ in range(3)) + "}",
            "ts": rts(), "tstz": rts(),
            "tm": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}.{rng.randint(0, 999999)}",
            "iv": (f"{rng.randint(-1000, 1000)} mons {rng.randint(-1000, 1000)} days "
                   f"{rng.randint(-10**12, 10**12)} microseconds"),
            "d": f"{rng.randint(1, 9999):04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            "ip": ":".join(f"{rng.choice([0, 0, 0, rng.randint(0, 0xFFFF)]):x}" for _ in range(8))
                  + f"/{rng.randint(0, 128)}",
            "pt": f"({rfloat()},{rfloat()})",
        }
        out.append((first_id + k, row))
    return out


@dataclass
class Capture:
    """Decoded pgoutput of one peek: relations and types by OID, inserts in order."""

    relations: dict[int, Relation]
    types: dict[int, Type]
    inserts: list[Insert]

    def relation(self, name: str) -> Relation:
        return next(r for r in self.relations.values() if r.name == name)

    def rows(self, name: str) -> list[Insert]:
        oid = self.relation(name).oid
        return [i for i in self.inserts if i.relation_oid == oid]


def capture(conn: psycopg.Connection[Any], slot: str, binary: bool) -> Capture:
    """Everything in the slot so far (peeked, not consumed), decoded."""
    opts = ["proto_version", "2", "publication_names", "pub"] + (["binary", "true"] if binary else [])
    rows = conn.execute("SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, VARIADIC %s::text[])",
                        [slot, opts]).fetchall()
    dec = Decoder()
    out = Capture({}, {}, [])
    for (data,) in rows:
        m = dec.decode(bytes(data))
        if isinstance(m, Relation):
            out.relations[m.oid] = m
        elif isinstance(m, Type):
            out.types[m.oid] = m
        elif isinstance(m, Insert):
            out.inserts.append(m)
    return out


def connect(db: ScratchDb) -> psycopg.Connection[Any]:
    return psycopg.connect(db.dsn, autocommit=True, options=PINNED)


def has_xml(conn: psycopg.Connection[Any]) -> bool:
    try:
        conn.execute("SELECT '<a/>'::xml")
        return True
    except psycopg.Error:
        return False


def table_ddl(name: str, columns: dict[str, str]) -> str:
    cols = ", ".join(f"{quote_ident(c)} {t}" for c, t in columns.items())
    return f"CREATE TABLE {name} (id int PRIMARY KEY, {cols})"


@dataclass
class Captured:
    db: ScratchDb
    conn: psycopg.Connection[Any]
    columns: dict[str, str]
    text: Capture
    binary: Capture


def make_capture(db: ScratchDb, ddl: str, table: str, columns: dict[str, str],
                 rows: list[tuple[int, dict[str, str]]]) -> Captured:
    """Create the schema, publish ``table``, insert ``rows`` (text literals) and capture both modes."""
    conn = connect(db)
    conn.execute(ddl)
    conn.execute(table_ddl(table, columns))
    conn.execute(f"CREATE PUBLICATION pub FOR TABLE {table}")
    slot = f"s_{db.dbname}"
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [slot])
    for rid, row in rows:
        names = ["id", *row]
        sql = (f"INSERT INTO {table} ({', '.join(quote_ident(c) for c in names)}) "
               f"VALUES ({', '.join(['%s'] * len(names))})")
        conn.execute(sql, [str(rid), *row.values()])
    return Captured(db, conn, columns, capture(conn, slot, False), capture(conn, slot, True))


@pytest.fixture
def everything(source_db: ScratchDb) -> Iterator[Captured]:
    """The big table on the source, every row captured in text and in binary mode."""
    probe = connect(source_db)
    columns = dict(COLUMNS)
    if not has_xml(probe):
        del columns["x"]
    probe.close()
    rows = [(i + 1, {k: v for k, v in r.items() if k in columns}) for i, r in enumerate(ROWS)]
    rows += random_rows(random.Random(20240613), 40, first_id=100)
    cap = make_capture(source_db, USER_TYPES, "everything", columns, rows)
    try:
        yield cap
    finally:
        cap.conn.close()


def same(a: Any, b: Any) -> bool:
    """Equal and of the same type (floats by repr, so -0.0 and 0.0 differ)."""
    if type(a) is not type(b):
        return False
    return repr(a) == repr(b) if isinstance(a, float) else a == b


# -- what the server sends ----------------------------------------------------------------------


def test_binary_capture_kinds(everything: Captured) -> None:
    """Binary mode sends 'b' for every type with a send function and 't' for aclitem (no send function)."""
    rel = everything.binary.relation("everything")
    names = [c.name for c in rel.columns]
    first = everything.binary.rows("everything")[0].new
    for name, kind in zip(names, first.kinds, strict=True):
        assert kind == (TEXT if name == "acl" else BINARY), name
    assert all(k == TEXT for k in everything.text.rows("everything")[0].new.kinds)
    # user types come with a Type message; a domain's names its base type
    by_oid = {c.name: c.type_oid for c in rel.columns}
    assert everything.binary.types[by_oid["pi"]][2:] == ("", "int4")
    assert everything.binary.types[by_oid["e"]][2:] == ("public", "mood")
    assert everything.binary.types[by_oid["ea"]][2:] == ("public", "_mood")


# -- SQLite: binary mode stores exactly what text mode stores ---------------------------------


def test_sqlite_binary_equals_text(everything: Captured) -> None:
    text, binary = everything.text, everything.binary
    rel_t, rel_b = text.relation("everything"), binary.relation("everything")
    assert rel_t == rel_b
    conv_t = sqlite_text_converters(rel_t)
    conv_b = binary_converters(rel_b, binary.types, "sqlite")
    rows_t, rows_b = text.rows("everything"), binary.rows("everything")
    assert len(rows_t) == len(rows_b) == len(ROWS) + 40
    bt = Binding(rel_t, "x", '"x"', conv_t, SQLITE)
    bb = Binding(rel_b, "x", '"x"', conv_b, SQLITE)
    idx = range(len(rel_t.columns))
    mismatches = []
    for it, ib in zip(rows_t, rows_b, strict=True):
        vt, vb = bt.values(it.new, idx), bb.values(ib.new, idx)
        for col, a, b in zip(rel_t.columns, vt, vb, strict=True):
            if not same(a, b):
                mismatches.append((vt[0], col.name, a, b))
    assert not mismatches, mismatches[:20]

    # and SQLite takes them all, giving the same rows back
    db = sqlite3.connect(":memory:")
    cols = ", ".join(quote_ident(c.name) for c in rel_t.columns)
    for table in ("text_mode", "binary_mode"):
        db.execute(f"CREATE TABLE {table} ({cols})")
    into_t = Binding(rel_t, "text_mode", "text_mode", conv_t, SQLITE)
    into_b = Binding(rel_b, "binary_mode", "binary_mode", conv_b, SQLITE)
    db.executemany(into_t.insert_sql(tuple(idx)), [into_t.values(i.new, idx) for i in rows_t])
    db.executemany(into_b.insert_sql(tuple(idx)), [into_b.values(i.new, idx) for i in rows_b])
    got_t = db.execute("SELECT * FROM text_mode ORDER BY 1").fetchall()
    got_b = db.execute("SELECT * FROM binary_mode ORDER BY 1").fetchall()
    assert repr(got_t) == repr(got_b)


# -- PostgreSQL: the binary values, passed through, give the same rows ---------------------------


def _pg_apply(captured: Captured, target_db: ScratchDb, table: str) -> psycopg.Connection[Any]:
    """Create the table on the target and insert the binary-mode rows with the binary converters."""
    tgt = connect(target_db)
    tgt.execute(USER_TYPES)
    tgt.execute(table_ddl(table, captured.columns))
    register_pg_binary(tgt)
    rel = captured.binary.relation(table)
    b = Binding(rel, table, quote_ident(table), binary_converters(rel, captured.binary.types, "postgresql"), POSTGRES)
    idx = tuple(range(len(rel.columns)))
    with tgt.cursor() as cur:
        cur.executemany(b.insert_sql(idx), [b.values(i.new, idx) for i in captured.binary.rows(table)])
    return tgt


def _as_text_rows(conn: psycopg.Connection[Any], table: str, columns: list[str]) -> list[tuple[Any, ...]]:
    cols = ", ".join(f"{quote_ident(c)}::text" for c in columns)
    return conn.execute(f"SELECT {cols} FROM {table} ORDER BY id").fetchall()


def test_postgres_binary_passthrough(everything: Captured, target_db: ScratchDb) -> None:
    tgt = _pg_apply(everything, target_db, "everything")
    try:
        columns = ["id", *everything.columns]
        src_rows = _as_text_rows(everything.conn, "everything", columns)
        tgt_rows = _as_text_rows(tgt, "everything", columns)
        assert len(src_rows) == len(ROWS) + 40
        diffs = [(s[0], c, a, b) for s, t in zip(src_rows, tgt_rows, strict=True)
                 for c, a, b in zip(columns, s, t, strict=True) if a != b]
        assert not diffs, diffs[:20]
    finally:
        tgt.close()


def test_postgres_locates_rows_with_binary_values(everything: Captured, target_db: ScratchDb) -> None:
    """Every non-null binary value finds its row by equality (text comparison where there is no '=')."""
    tgt = _pg_apply(everything, target_db, "everything")
    try:
        rel = everything.binary.relation("everything")
        conv = binary_converters(rel, everything.binary.types, "postgresql")
        no_equality = {"json", "jsonpath", "xml", "point", "line", "lseg", "box", "path", "polygon", "circle", "box[]"}
        for ins in everything.binary.rows("everything")[:len(ROWS)]:
            rid = int.from_bytes(ins.new.values[0], "big", signed=True)
            for col, c, v in zip(rel.columns, conv, ins.new.values, strict=True):
                if v is None:
                    continue
                ctype = everything.columns.get(col.name, "int")
                q = quote_ident(col.name)
                cond = f"{q}::text = %s::text" if ctype in no_equality else f"{q} = %s"
                found = tgt.execute(f"SELECT id FROM everything WHERE {cond} AND id = %s", [c(v), rid]).fetchall()
                assert found == [(rid,)], (rid, col.name)
    finally:
        tgt.close()


def test_postgres_converter_passes_builtin_values_through(everything: Captured) -> None:
    """Built-in types are not decoded at all: the bytes go back with the column's type OID."""
    rel = everything.binary.relation("everything")
    conv = dict(zip([c.name for c in rel.columns], binary_converters(rel, everything.binary.types, "postgresql"),
                    strict=True))
    row = everything.binary.rows("everything")[1].new  # infinities
    values = dict(zip([c.name for c in rel.columns], row.values, strict=True))
    assert conv["d"](values["d"]) == PgBinary(1082, values["d"])
    assert conv["tstz"](values["tstz"]) == PgBinary(1184, values["tstz"])
    assert conv["pi"](values["pi"]) == PgBinary(23, values["pi"])  # a domain travels as its base type
    assert conv["e"](values["e"]) == "so-so"  # an enum's binary form is its label
    assert conv["acl"](values["acl"]) == "postgres=arwdDxt/postgres"  # sent as text: no send function


# -- types binary mode cannot read -------------------------------------------------------------

ODD_TYPES = """
CREATE TYPE pair AS (a int4, b text);
CREATE TYPE floatrange AS RANGE (subtype = float8);
CREATE TYPE mytext;
CREATE FUNCTION mytext_in(cstring) RETURNS mytext AS 'textin' LANGUAGE internal IMMUTABLE STRICT;
CREATE FUNCTION mytext_out(mytext) RETURNS cstring AS 'textout' LANGUAGE internal IMMUTABLE STRICT;
CREATE TYPE mytext (INPUT = mytext_in, OUTPUT = mytext_out, LIKE = text);
CREATE TYPE mood AS ENUM ('happy', 'sad');
"""
ODD_COLUMNS = {"p": "pair", "fr": "floatrange", "mt": "mytext", "pa": "pair[]", "ma": "mood[]", "m": "money"}
ODD_ROWS = [
    (1, {"p": "(1,\"x y\")", "fr": "[1.5,2)", "mt": "some text", "pa": "{\"(1,a)\",NULL}", "ma": "{happy,sad}",
         "m": "12.34"}),
    (2, {"p": "(,)", "fr": "empty", "mt": "", "pa": "{}", "ma": "{}", "m": "-1"}),
]


@pytest.fixture
def odd(source_db: ScratchDb) -> Iterator[Captured]:
    cap = make_capture(source_db, ODD_TYPES, "odd", ODD_COLUMNS, ODD_ROWS)
    try:
        yield cap
    finally:
        cap.conn.close()


def test_type_without_send_function_arrives_as_text(odd: Captured) -> None:
    """pgoutput falls back to text, per type, when the type has no send function (mytext here)."""
    rel = odd.binary.relation("odd")
    kinds = dict(zip([c.name for c in rel.columns], odd.binary.rows("odd")[0].new.kinds, strict=True))
    assert kinds == {"id": BINARY, "p": BINARY, "fr": BINARY, "mt": TEXT, "pa": BINARY, "ma": BINARY, "m": BINARY}
    col = next(c for c in rel.columns if c.name == "mt")
    for dialect in ("sqlite", "postgresql"):
        conv = binary_loader(col.type_oid, odd.binary.types, dialect, rel, "mt")
        assert [conv(r.new.values[3]) for r in odd.binary.rows("odd")] == ["some text", ""]


def test_sqlite_error_names_builtin_type(odd: Captured) -> None:
    """A built-in type without a converter is refused when the table is bound, naming type, table and column."""
    rel = odd.binary.relation("odd")
    with pytest.raises(ApplyError) as exc:
        binary_converters(rel, odd.binary.types, "sqlite")
    msg = str(exc.value)
    assert "pg_catalog.money" in msg and "'m'" in msg and "public.odd" in msg and "source.binary = false" in msg


def test_sqlite_error_names_user_type(odd: Captured) -> None:
    """A user type whose binary form is not text is refused when a value arrives, naming it."""
    rel = odd.binary.relation("odd")
    cols = {c.name: (i, c) for i, c in enumerate(rel.columns)}
    row = odd.binary.rows("odd")[0].new
    for name, type_name in (("p", "public.pair"), ("fr", "public.floatrange"), ("pa", "public._pair")):
        i, col = cols[name]
        conv = binary_loader(col.type_oid, odd.binary.types, "sqlite", rel, name)
        with pytest.raises(ApplyError) as exc:
            conv(row.values[i])
        msg = str(exc.value)
        assert type_name in msg and f"'{name}'" in msg and "source.binary = false" in msg
    # an array of an enum is read: its elements are labels
    i, col = cols["ma"]
    text_row = odd.text.rows("odd")[0].new
    assert binary_loader(col.type_oid, odd.binary.types, "sqlite", rel, "ma")(row.values[i]) == \
        text_row.values[i].decode() == "{happy,sad}"


def test_postgres_user_types(odd: Captured, target_db: ScratchDb) -> None:
    """Composites and ranges of built-in types go in binary with OID 0 (the target's receive function reads
    them), an array of an enum as its literal; an array of a composite is refused with the type named."""
    columns = {k: v for k, v in ODD_COLUMNS.items() if k != "pa"}
    tgt = connect(target_db)
    try:
        tgt.execute(ODD_TYPES)
        tgt.execute(table_ddl("odd", columns))
        register_pg_binary(tgt)
        rel = odd.binary.relation("odd")
        conv = binary_converters(rel, odd.binary.types, "postgresql")
        keep = [i for i, c in enumerate(rel.columns) if c.name != "pa"]
        names = [rel.columns[i].name for i in keep]
        pa = next(i for i, c in enumerate(rel.columns) if c.name == "pa")
        sql = (f"INSERT INTO odd ({', '.join(quote_ident(n) for n in names)}) "
               f"VALUES ({', '.join(['%s'] * len(names))})")
        rows = odd.binary.rows("odd")
        for ins in rows:
            vals = ins.new.values
            tgt.execute(sql, [None if vals[i] is None else conv[i](vals[i]) for i in keep])
        with pytest.raises(ApplyError, match=r"public\._pair"):
            conv[pa](rows[0].new.values[pa])  # {"(1,a)",NULL}
        assert conv[pa](rows[1].new.values[pa]) == "{}"
        assert _as_text_rows(odd.conn, "odd", names) == _as_text_rows(tgt, "odd", names)
    finally:
        tgt.close()


# -- pure helpers ------------------------------------------------------------------------------


def test_float8_text_matches_postgres_rules() -> None:
    assert float8_text(6.76e22) == "6.7599999999999996e+22"  # exactly halfway: PostgreSQL's Ryu refuses it
    assert float8_text(1e15) == "1e+15" and float8_text(1e14) == "100000000000000"
    assert float8_text(0.0001) == "0.0001" and float8_text(1e-05) == "1e-05"
    assert float8_text(-0.0) == "-0" and float8_text(float("nan")) == "NaN"


def test_unknown_dialect() -> None:
    rel = Relation(None, 1, "public", "t", "d", ())
    with pytest.raises(ValueError):
        binary_loader(23, {}, "mysql", rel, "c")


@pytest.mark.parametrize(("scale", "positive", "negative", "units", "shown"), [
    (2, "$1,234,567,890,123,456.78", "-$1,234,567,890,123,456.78", -5, "-$0.05"),
    (2, "1.234.567.890.123.456,78 €", "-1.234.567.890.123.456,78 €", 123456, "1.234,56 €"),
    (0, "¥123,456,789,012,345,678", "¥-123,456,789,012,345,678", -1000, "¥-1,000"),
    (3, "($123456789012345.678)", "($-123456789012345.678)", 7, "($0.007)"),
])
def test_money_text_follows_the_probed_format(scale: int, positive: str, negative: str, units: int,
                                              shown: str) -> None:
    """Money printed as the source's lc_monetary prints it (formats of locales the test servers may lack)."""
    assert money_text(scale, positive, negative)(units.to_bytes(8, "big", signed=True)) == shown
