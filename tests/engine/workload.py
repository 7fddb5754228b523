"""Schemas, random workloads and source-vs-target comparison for the engine's end-to-end tests.

Why: exactly-once is only proven by comparing whole tables after real workloads,
so this module holds one description of each table (``Table``) from which the
source/PostgreSQL-target DDL, the SQLite DDL, the random changes and the
comparison are all derived.

Comparison rules (strict: a missing, duplicated or different row fails):
- rows are compared as multisets (``collections.Counter``), so duplicates count;
- PostgreSQL target: every column's ``::text`` on both sides, with the session
  settings pinned to what the walsender uses (ISO dates, UTC, postgres
  intervals, shortest-exact floats, hex bytea);
- SQLite target: the source's text forms are converted by the mapping
  documented in ``applier/targets/values.py`` (an independent oracle: this file
  does not call the engine's converters), and every value is compared with
  its Python type, so ``1`` vs ``1.0`` vs ``'1'`` differ.
"""

from __future__ import annotations

import json
import random
import sqlite3
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

PINNED_OPTIONS = ("-c datestyle=ISO -c intervalstyle=postgres -c timezone=UTC -c extra_float_digits=3 "
                  "-c bytea_output=hex")


def qi(name: str) -> str:
    """Quote an identifier (PostgreSQL and SQLite alike)."""
    return '"' + name.replace('"', '""') + '"'


def pg_connect(dsn: str, autocommit: bool = True) -> psycopg.Connection[Any]:
    """A connection with the output settings pinned (see the module header)."""
    return psycopg.connect(dsn, autocommit=autocommit, options=PINNED_OPTIONS, connect_timeout=10)


# -- tables ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Col:
    """One column: its name, PostgreSQL type (DDL and cast) and the generator kind of its values."""

    name: str
    pgtype: str
    kind: str
    nullable: bool = True

    @property
    def sqlite_type(self) -> str:
        """The SQLite affinity the documented mapping calls for."""
        if self.pgtype in ("int2", "int4", "int8", "bool"):
            return "INTEGER"
        if self.pgtype in ("real", "float8"):
            return "REAL"
        if self.pgtype == "bytea":
            return "BLOB"
        return "TEXT"


@dataclass(frozen=True)
class Table:
    """A replicated table; ``key`` empty means no primary key and REPLICA IDENTITY FULL."""

    schema: str
    name: str
    cols: tuple[Col, ...]
    key: tuple[str, ...] = ()
    uniq: str | None = None  # the key column that gets a fresh counter value per new row
    unique: tuple[str, ...] = ()  # columns with a UNIQUE constraint besides the key (fresh values too)

    @property
    def pg(self) -> str:
        """Quoted schema.table on PostgreSQL."""
        return f"{qi(self.schema)}.{qi(self.name)}"

    @property
    def sqlite_name(self) -> str:
        """The SQLite table name: bare for schema public, 'schema.table' otherwise."""
        return self.name if self.schema == "public" else f"{self.schema}.{self.name}"

    @property
    def label(self) -> str:
        """schema.table for messages."""
        return f"{self.schema}.{self.name}"

    def col(self, name: str) -> Col:
        """The column called ``name``."""
        return next(c for c in self.cols if c.name == name)

    @property
    def nonkey(self) -> list[Col]:
        """Columns outside the primary key."""
        return [c for c in self.cols if c.name not in self.key]

    def fresh_valued(self, c: Col) -> bool:
        """True for columns whose new values must not collide (key and UNIQUE columns)."""
        return c.name in self.key or c.name in self.unique

    def pg_ddl(self) -> str:
        """CREATE TABLE for the source and a PostgreSQL target."""
        parts = [f"{qi(c.name)} {c.pgtype}{'' if c.nullable else ' NOT NULL'}" for c in self.cols]
        if self.key:
            parts.append(f"PRIMARY KEY ({', '.join(qi(k) for k in self.key)})")
        parts += [f"UNIQUE ({qi(u)})" for u in self.unique]
        ddl = f"CREATE TABLE {self.pg} ({', '.join(parts)});"
        if not self.key:
            ddl += f" ALTER TABLE {self.pg} REPLICA IDENTITY FULL;"
        return ddl

    def sqlite_ddl(self) -> str:
        """CREATE TABLE for a SQLite target (affinities from the documented mapping)."""
        parts = [f"{qi(c.name)} {c.sqlite_type}{'' if c.nullable else ' NOT NULL'}" for c in self.cols]
        if self.key:
            parts.append(f"PRIMARY KEY ({', '.join(qi(k) for k in self.key)})")
        parts += [f"UNIQUE ({qi(u)})" for u in self.unique]
        return f"CREATE TABLE {qi(self.sqlite_name)} ({', '.join(parts)});"


ENUM_LABELS = ("sad", "ok", "happy", "Very Happy", "it's \"complicated\"", "日本")


def _enum_ddl() -> str:
    labels = ", ".join("'" + x.replace("'", "''") + "'" for x in ENUM_LABELS)
    return f"CREATE TYPE public.mood AS ENUM ({labels});"


ALL_TYPES = Table("public", "all_types", (
    Col("id", "int8", "serialkey", nullable=False),
    Col("c_int2", "int2", "int2"),
    Col("c_int4", "int4", "int4"),
    Col("c_int8", "int8", "int8"),
    Col("c_num", "numeric", "numeric"),
    Col("c_num_p", "numeric(38,12)", "numeric_p"),
    Col("c_f4", "real", "float4"),
    Col("c_f8", "float8", "float8"),
    Col("c_text", "text", "text"),
    Col("c_vc", "varchar(20)", "varchar20"),
    Col("c_bool", "bool", "bool"),
    Col("c_bytea", "bytea", "bytea"),
    Col("c_date", "date", "date"),
    Col("c_ts", "timestamp", "timestamp"),
    Col("c_tstz", "timestamptz", "timestamptz"),
    Col("c_iv", "interval", "interval"),
    Col("c_uuid", "uuid", "uuid"),
    Col("c_json", "json", "json"),
    Col("c_jsonb", "jsonb", "jsonb"),
    Col("c_ia", "int[]", "intarr"),
    Col("c_ta", "text[]", "textarr"),
    Col("c_mood", "public.mood", "enum"),
    Col("c_big", "text", "bigtext"),      # TOASTed when big: updates that leave it alone send it as unchanged
    Col("c_null", "text", "alwaysnull"),
), key=("id",), uniq="id")

# Key columns not first and not contiguous; the counter column is in the middle.
COMPOSITE = Table("public", "composite_pk", (
    Col("note", "text", "text"),
    Col("region", "text", "region", nullable=False),
    Col("amount", "numeric(12,2)", "numeric_fixed"),
    Col("id", "int4", "serialkey", nullable=False),
    Col("seq", "int2", "seq", nullable=False),
    Col("tag", "varchar(8)", "varchar8"),
), key=("region", "id", "seq"), uniq="id")

# No key: rows are found by every column; duplicates are allowed and made on purpose.
# Values avoid pairs that are equal but print differently (-0 vs 0, 1.5 vs 1.50).
FULL_NOPK = Table("public", "full_nopk", (
    Col("a", "int4", "smallint_dup"),
    Col("b", "text", "text_or_big"),
    Col("c", "float8", "float8_safe"),
    Col("d", "jsonb", "jsonb"),
    Col("e", "timestamptz", "timestamptz"),
    Col("f", "bytea", "bytea"),
    Col("g", "numeric(10,2)", "numeric_fixed"),
    Col("h", "bool", "bool"),
    Col("j", "json", "json"),
))

QUOTED = Table("public", 'Order Items "Q"', (
    Col("order", "int8", "serialkey", nullable=False),
    Col("Select", "text", "text"),
    Col("col with space", "int4", "int4"),
    Col("it's", "bool", "bool"),
    Col('we"ird', "numeric", "numeric"),
    Col("UPPER", "timestamptz", "timestamptz"),
), key=("order",), uniq="order")

# The same table name in two schemas: changes must land in the right one.
_ITEMS_COLS = (
    Col("sku", "text", "skukey", nullable=False),
    Col("qty", "int4", "int4"),
    Col("price", "numeric", "numeric"),
    Col("updated", "timestamptz", "timestamptz"),
    Col("attrs", "jsonb", "jsonb"),
    Col("tags", "text[]", "textarr"),
    Col("ratio", "float8", "float8"),
)
INV_ITEMS = Table("inv", "items", _ITEMS_COLS, key=("sku",), uniq="sku")
PUB_ITEMS = Table("public", "items", _ITEMS_COLS, key=("sku",), uniq="sku")

# A UNIQUE column besides the key: rows swap their values (valid in source order, not in any other).
SWAP = Table("public", "uniq_swap", (
    Col("id", "int4", "serialkey", nullable=False),
    Col("email", "text", "email", nullable=False),
    Col("n", "int4", "int4"),
), key=("id",), uniq="id", unique=("email",))

TABLES: tuple[Table, ...] = (ALL_TYPES, COMPOSITE, FULL_NOPK, QUOTED, INV_ITEMS, PUB_ITEMS, SWAP)
TABLE_WEIGHTS = (3.0, 2.0, 2.0, 1.5, 1.5, 1.0, 1.0)
UNPUBLISHED = "public.unpublished"


def source_ddl(tables: Sequence[Table] = TABLES, publication: str = "applier_pub") -> str:
    """Everything the source needs: types, schemas, tables, an unpublished table, the publication."""
    parts = [_enum_ddl(), "CREATE SCHEMA inv;"]
    parts += [t.pg_ddl() for t in tables]
    parts.append(f"CREATE TABLE {UNPUBLISHED} (id bigserial PRIMARY KEY, v text);")
    parts.append(f"CREATE PUBLICATION {qi(publication)} FOR TABLE {', '.join(t.pg for t in tables)};")
    return "\n".join(parts)


def pg_target_ddl(tables: Sequence[Table] = TABLES) -> str:
    """The same tables on a PostgreSQL target."""
    return "\n".join([_enum_ddl(), "CREATE SCHEMA inv;", *(t.pg_ddl() for t in tables)])


def sqlite_target_ddl(tables: Sequence[Table] = TABLES) -> str:
    """The same tables on a SQLite target."""
    return "\n".join(t.sqlite_ddl() for t in tables)


# -- values -----------------------------------------------------------------------------

TEXT_PIECES = (
    "'", "''", '"', "\\", "\\\\", "\n", "\r\n", "\r", "\t", "\\N", "\\.", "\\t", "NULL", "null", "", " ", "  ",
    ",", "{", "}", "(", ")", "[", "]", "é", "ß", "Ω", "日本語", "🙂", "👩‍💻", "\u200b", "e\u0301", "\u202e",
    "\x01", "\x1f", "\x7f", "\x0b", "\x0c", "a", "abc", "O'Brien", 'say "hi"', "C:\\path\\x", "$1", "%s", "%%",
    "?", ";", "--", "/*", "\\x41", "a\\nb", "tab\there", "line1\nline2", "zwj\u200dx", "\ufeff",
)
ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "


class Values:
    """Random values as PostgreSQL text input (None = NULL), by generator kind."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self, max_pieces: int = 8) -> str:
        r = self.rng
        if r.random() < 0.1:
            return "".join(r.choices(ALNUM, k=r.randint(0, 30)))
        return "".join(r.choice(TEXT_PIECES) for _ in range(r.randint(0, max_pieces)))

    def _int(self, bits: int) -> str:
        r = self.rng
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        if r.random() < 0.2:
            return str(r.choice([lo, hi, 0, -1, 1]))
        return str(r.randint(lo, hi) if r.random() < 0.5 else r.randint(-1000, 1000))

    def _numeric(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.05:
            return "NaN"
        if x < 0.08:
            return r.choice(["Infinity", "-Infinity"])
        if x < 0.12:
            return r.choice(["0", "-0.000", "0.0000000000000000000000000000001", "1e-30", "-12.5e20"])
        ip = "".join(r.choices("0123456789", k=r.randint(1, 40))).lstrip("0") or "0"
        fp = "".join(r.choices("0123456789", k=r.randint(0, 30)))
        return ("-" if r.random() < 0.3 else "") + ip + ("." + fp if fp else "")

    def _float(self, safe: bool, bits: int = 64) -> str:
        r = self.rng
        x = r.random()
        if x < 0.15:
            specials = ["NaN", "Infinity", "-Infinity"]
            if not safe:
                specials += ["-0", "0"]
            if bits == 64:
                specials += ["5e-324", "1.7976931348623157e+308", "2.2250738585072014e-308", "0.1", "1e100"]
            else:
                specials += ["3.4028235e+38", "1e-45", "0.1"]
            return r.choice(specials)
        if bits == 32:
            return repr(round(r.uniform(-1e6, 1e6), r.randint(0, 4)))
        return repr(r.uniform(-1, 1) * 10.0 ** r.randint(-300, 300))

    def _date(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.05:
            return r.choice(["infinity", "-infinity"])
        if x < 0.1:
            return f"{r.randint(1, 4713):04d}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d} BC"
        year = r.randint(1, 9999) if x < 0.3 else r.randint(1950, 2050)
        return f"{year:04d}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"

    def _time(self) -> str:
        r = self.rng
        frac = "" if r.random() < 0.3 else "." + f"{r.randint(0, 999999):06d}"
        return f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}{frac}"

    def _timestamp(self, tz: bool) -> str:
        r = self.rng
        x = r.random()
        if x < 0.05:
            return r.choice(["infinity", "-infinity"])
        year = r.randint(1, 9999) if x < 0.2 else r.randint(1950, 2050)
        ts = f"{year:04d}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d} {self._time()}"
        if tz:
            ts += r.choice(["+00", "Z", "+05:30", "-08", "+14", "-03:45", "+01"])
        elif r.random() < 0.05:
            ts = f"{r.randint(1, 4000):04d}-01-02 03:04:05 BC"
        return ts

    def _interval(self) -> str:
        r = self.rng
        if r.random() < 0.1:
            return r.choice(["0", "00:00:00.000001", "-1 day", "1 mon -1 days", "178000000 years"])
        return (f"{r.randint(-100, 100)} years {r.randint(-11, 11)} mons {r.randint(-400, 400)} days "
                f"{r.randint(-100, 100)} hours {r.randint(-59, 59)} minutes "
                f"{r.randint(-59, 59)}.{r.randint(0, 999999):06d} seconds")

    def _json_obj(self, depth: int = 0) -> Any:
        r = self.rng
        x = r.random()
        if depth < 3 and x < 0.25:
            return {self.text(3): self._json_obj(depth + 1) for _ in range(r.randint(0, 4))}
        if depth < 3 and x < 0.4:
            return [self._json_obj(depth + 1) for _ in range(r.randint(0, 4))]
        choices: list[Any] = [self.text(4), r.randint(-(2 ** 70), 2 ** 70), r.randint(-5, 5), True, False, None,
                              round(r.uniform(-1e6, 1e6), r.randint(0, 8)), 1.5e-20, ""]
        return r.choice(choices)

    def json(self, exact: bool) -> str:
        r = self.rng
        obj = self._json_obj()
        if exact and r.random() < 0.2:  # json keeps its text: whitespace and duplicate keys survive
            return r.choice(['{"a":1,  "a" : [1, 2.50, "x\\"y"] }', ' [ 1 ,2 ] ', '{"k": "\\u00e9\\n"}',
                             '"just a string"', '12.3400', 'null', '{\n\t"x": {}\n}'])
        return json.dumps(obj, ensure_ascii=r.random() < 0.5, indent=r.choice([None, None, 1]) if exact else None)

    def _array_elem(self, s: str | None) -> str:
        if s is None:
            return "NULL"
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def value(self, c: Col) -> str | None:
        """A random value for column ``c`` (None = NULL)."""
        r = self.rng
        k = c.kind
        if k == "alwaysnull":
            return None
        if c.nullable and k not in ("smallint_dup",) and r.random() < 0.1:
            return None
        if k in ("int2", "seq"):
            return self._int(16) if k == "int2" else str(r.randint(0, 3))
        if k == "int4":
            return self._int(32)
        if k == "int8":
            return self._int(64)
        if k == "smallint_dup":
            return None if r.random() < 0.1 else str(r.randint(0, 6))
        if k == "numeric":
            return self._numeric()
        if k == "numeric_p":
            v = self._numeric()
            if v in ("Infinity", "-Infinity") or len(v.split(".")[0].lstrip("-")) > 26 or "e" in v:
                return "-12345678901234567890123456.123456789012"
            return v
        if k == "numeric_fixed":
            return f"{r.randint(-99999999, 99999999) / 100:.2f}"
        if k == "float8":
            return self._float(safe=False)
        if k == "float8_safe":
            return self._float(safe=True)
        if k == "float4":
            return self._float(safe=False, bits=32)
        if k == "text":
            return self.text()
        if k == "text_or_big":
            if r.random() < 0.1:
                return "".join(r.choices(ALNUM, k=r.randint(3000, 9000)))
            return self.text()
        if k == "bigtext":
            if r.random() < 0.3:
                return "".join(r.choices(ALNUM, k=r.randint(3000, 12000)))
            return self.text()
        if k == "varchar20":
            return self.text()[:20]
        if k == "varchar8":
            return self.text()[:8]
        if k == "region":
            return r.choice(["eu", "us", "日本", "o'k", "a b", ""])
        if k == "bool":
            return r.choice(["t", "f"])
        if k == "bytea":
            n = r.choice([0, 1, 2, 5, 16, 40]) if r.random() < 0.95 else 3000
            return "\\x" + r.randbytes(n).hex()
        if k == "date":
            return self._date()
        if k == "timestamp":
            return self._timestamp(tz=False)
        if k == "timestamptz":
            return self._timestamp(tz=True)
        if k == "interval":
            return self._interval()
        if k == "uuid":
            return str(uuid.UUID(int=r.getrandbits(128)))
        if k == "json":
            return self.json(exact=True)
        if k == "jsonb":
            return self.json(exact=False)
        if k == "intarr":
            if r.random() < 0.1:
                return "{}"
            return "{" + ",".join("NULL" if r.random() < 0.1 else self._int(32)
                                  for _ in range(r.randint(1, 6))) + "}"
        if k == "textarr":
            if r.random() < 0.1:
                return "{}"
            return "{" + ",".join(self._array_elem(None if r.random() < 0.1 else self.text(3))
                                  for _ in range(r.randint(1, 5))) + "}"
        if k == "enum":
            return r.choice(ENUM_LABELS)
        raise AssertionError(f"no generator for kind {k!r}")


# -- the workload -------------------------------------------------------------------------


class Workload:
    """Seeded random transactions on the source tables (see ``transaction``).

    Each change reads the rows it touches from the source first (ordered, so the
    choice is reproducible from the seed); new keys come from one counter, so
    no statement fails and rolled-back work never collides with later work.
    """

    OPS = ("insert", "update", "update_key", "delete", "bulk_update", "bulk_delete", "unpublished",
           "truncate", "big_insert", "swap")
    OP_WEIGHTS = (35, 25, 8, 14, 4, 2, 3, 0.7, 0.4, 2)

    def __init__(self, dsn: str, rng: random.Random, tables: Sequence[Table] = TABLES,
                 weights: Sequence[float] = TABLE_WEIGHTS) -> None:
        self.conn = pg_connect(dsn)
        self.rng = rng
        self.vals = Values(rng)
        self.tables = list(tables)
        self.weights = list(weights)
        self.counter = 0
        self.committed = 0
        self.rolled_back = 0
        self.ops: Counter[str] = Counter()

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()

    def _x(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(sql, params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description is not None else []

    def fresh(self, n: int = 1) -> int:
        """A new counter value (the first of ``n`` consecutive ones)."""
        self.counter += n
        return self.counter - n + 1

    # -- one row ---------------------------------------------------------------------

    def key_value(self, t: Table, c: Col) -> str:
        if c.name == t.uniq or c.name in t.unique:
            n = self.fresh()
            if c.kind == "email":
                return f"user{n}@example.com"
            if c.kind == "skukey":
                return f"sku-{n:06d}-" + self.rng.choice(["", "é", " x", "'", '"', "日本"])
            return str(n)
        v = self.vals.value(c)
        assert v is not None
        return v

    def new_row(self, t: Table) -> list[str | None]:
        return [self.key_value(t, c) if t.fresh_valued(c) else self.vals.value(c) for c in t.cols]

    def pick(self, t: Table) -> list[str] | None:
        """One existing row's locator: key values as text, or [ctid] for a table without a key."""
        n = self._x(f"SELECT count(*) FROM {t.pg}")[0][0]
        if n == 0:
            return None
        i = self.rng.randrange(n)
        if t.key:
            cols = ", ".join(f"{qi(k)}::text" for k in t.key)
            order = ", ".join(qi(k) for k in t.key)
            return list(self._x(f"SELECT {cols} FROM {t.pg} ORDER BY {order} OFFSET %s LIMIT 1", [i])[0])
        return [self._x(f"SELECT x.ctid::text FROM {t.pg} x ORDER BY x::text, x.ctid OFFSET %s LIMIT 1", [i])[0][0]]

    def where(self, t: Table, loc: list[str]) -> str:
        if t.key:
            return " AND ".join(f"{qi(k)} = %s::{t.col(k).pgtype}" for k in t.key)
        return "ctid = %s::tid"

    # -- operations ------------------------------------------------------------------

    def op_insert(self, t: Table) -> None:
        if not t.key and self.rng.random() < 0.25 and (loc := self.pick(t)) is not None:
            self._x(f"INSERT INTO {t.pg} SELECT * FROM {t.pg} x WHERE x.ctid = %s::tid", loc)  # a duplicate row
            return
        rows = [self.new_row(t) for _ in range(self.rng.choice([1, 1, 1, 2, 3, 5]))]
        cols = ", ".join(qi(c.name) for c in t.cols)
        one = "(" + ", ".join(f"%s::{c.pgtype}" for c in t.cols) + ")"
        self._x(f"INSERT INTO {t.pg} ({cols}) VALUES {', '.join([one] * len(rows))}", [v for r in rows for v in r])

    def op_update(self, t: Table, change_key: bool = False) -> None:
        loc = self.pick(t)
        if loc is None:
            return self.op_insert(t)
        choices = [c for c in t.nonkey if c.kind != "alwaysnull"]
        if self.rng.random() < 0.85:
            choices = [c for c in choices if c.kind != "bigtext"]  # leave the TOASTed column unchanged
        cols = self.rng.sample(choices, self.rng.randint(1, min(3, len(choices))))
        if change_key and t.key:
            cols = [t.col(t.uniq or t.key[0]), *cols]
            if len(t.key) > 1 and self.rng.random() < 0.5:
                cols.append(t.col(next(k for k in t.key if k != t.uniq)))
        vals = [self.key_value(t, c) if t.fresh_valued(c) else self.vals.value(c) for c in cols]
        sets = ", ".join(f"{qi(c.name)} = %s::{c.pgtype}" for c in cols)
        self._x(f"UPDATE {t.pg} SET {sets} WHERE {self.where(t, loc)}", vals + loc)
        return None

    def op_update_key(self, t: Table) -> None:
        self.op_update(t, change_key=True)

    def op_delete(self, t: Table) -> None:
        loc = self.pick(t)
        if loc is not None:
            self._x(f"DELETE FROM {t.pg} WHERE {self.where(t, loc)}", loc)

    def op_bulk_update(self, t: Table) -> None:
        choices = [c for c in t.nonkey if c.kind not in ("alwaysnull", "bigtext") and not t.fresh_valued(c)]
        c = self.rng.choice(choices)
        m = self.rng.choice([2, 3, 5])
        self._x(f"UPDATE {t.pg} AS x SET {qi(c.name)} = %s::{c.pgtype} "
                f"WHERE mod(abs(hashtext(x::text)::int8), {m}) = %s",
                [self.vals.value(c), self.rng.randrange(m)])

    def op_bulk_delete(self, t: Table) -> None:
        m = self.rng.choice([3, 5, 8])
        self._x(f"DELETE FROM {t.pg} AS x WHERE mod(abs(hashtext(x::text)::int8), {m}) = %s", [self.rng.randrange(m)])

    def op_unpublished(self, t: Table) -> None:
        self._x(f"INSERT INTO {UNPUBLISHED} (v) VALUES (%s)", [self.vals.text()])

    def op_truncate(self, t: Table) -> None:
        others = [x for x in self.tables if x is not t]
        names = [t] + (self.rng.sample(others, 1) if self.rng.random() < 0.3 else [])
        self._x(f"TRUNCATE {', '.join(x.pg for x in names)}")

    def op_swap(self, t: Table) -> None:
        """Two rows of ``uniq_swap`` exchange their UNIQUE emails (through a temporary value)."""
        rows = self._x(f"SELECT id, email FROM {SWAP.pg} ORDER BY id")
        if len(rows) < 2:
            return self.op_insert(SWAP)
        (a, ea), (b, eb) = self.rng.sample(rows, 2)
        for rid, email in ((a, f"tmp{self.fresh()}"), (b, ea), (a, eb)):
            self._x(f"UPDATE {SWAP.pg} SET email = %s WHERE id = %s", [email, rid])
        return None

    def op_big_insert(self, t: Table) -> None:
        """2,500 rows in one statement (more than one batch and one COPY)."""
        n = 2500
        first = self.fresh(n)
        self._x(f"INSERT INTO {COMPOSITE.pg} (note, region, amount, id, seq, tag) "
                f"SELECT md5(g::text) || E'\\t\\\\', 'bulk', (mod(g, 100000) / 7.0)::numeric(12,2), g, "
                f"mod(g, 4)::int2, left(md5(g::text), 8) FROM generate_series(%s::int4, %s::int4) g",
                [first, first + n - 1])

    def random_op(self) -> None:
        op = self.rng.choices(self.OPS, self.OP_WEIGHTS)[0]
        t = self.rng.choices(self.tables, self.weights)[0]
        if op == "big_insert" and COMPOSITE not in self.tables:
            op = "insert"
        self.ops[op] += 1
        getattr(self, f"op_{op}")(t)

    # -- transactions ------------------------------------------------------------------

    def transaction(self, rollback_rate: float = 0.08) -> bool:
        """One source transaction of 1–10 changes, some in savepoints; True if committed."""
        r = self.rng
        self._x("BEGIN")
        for i in range(r.choice([1, 1, 1, 2, 2, 3, 4, 6, 10])):
            x = r.random()
            if x < 0.15:
                self._x(f"SAVEPOINT sp{i}")
                for _ in range(r.randint(1, 3)):
                    self.random_op()
                if x < 0.09:
                    self._x(f"ROLLBACK TO SAVEPOINT sp{i}")
                    self.ops["savepoint_rollback"] += 1
                else:
                    self._x(f"RELEASE SAVEPOINT sp{i}")
                    self.ops["savepoint_release"] += 1
            else:
                self.random_op()
        if r.random() < rollback_rate:
            self._x("ROLLBACK")
            self.rolled_back += 1
            return False
        self._x("COMMIT")
        self.committed += 1
        return True

    def big_transaction(self) -> None:
        """One large transaction (well over logical_decoding_work_mem): 2,500 inserts, a bulk update
        rolled back to a savepoint, a released savepoint with random changes, a bulk update kept."""
        self._x("BEGIN")
        self.op_big_insert(COMPOSITE)
        self._x("SAVEPOINT big_a")
        self._x(f"UPDATE {COMPOSITE.pg} SET note = 'rolled back' WHERE region = 'bulk'")
        self._x("ROLLBACK TO SAVEPOINT big_a")
        self._x("SAVEPOINT big_b")
        for _ in range(5):
            self.random_op()
        self._x("RELEASE SAVEPOINT big_b")
        self._x(f"UPDATE {COMPOSITE.pg} AS x SET tag = %s WHERE region = 'bulk' AND mod(x.id, 3) = 0",
                [self.vals.text()[:8]])
        self._x("COMMIT")
        self.committed += 1
        self.ops["big_transaction"] += 1

    def run(self, n: int, big: int = 0) -> None:
        """``n`` random transactions, ``big`` of them large ones at random points."""
        at = set(self.rng.sample(range(n), big))
        for i in range(n):
            if i in at:
                self.big_transaction()
            else:
                self.transaction()

    def unpublished_only(self, n: int = 2) -> None:
        """Transactions that change nothing published (the catch-up must still end)."""
        for _ in range(n):
            self._x(f"INSERT INTO {UNPUBLISHED} (v) VALUES ('x')")


# -- comparison ---------------------------------------------------------------------------


def source_texts(conn: psycopg.Connection[Any], t: Table) -> list[tuple[str | None, ...]]:
    """Every row of ``t`` as a tuple of column texts."""
    cols = ", ".join(f"{qi(c.name)}::text" for c in t.cols)
    return [tuple(r) for r in conn.execute(f"SELECT {cols} FROM {t.pg}").fetchall()]


def sqlite_expected(c: Col, text: str | None) -> Any:
    """What the documented mapping (applier/targets/values.py) stores in SQLite for a source value."""
    if text is None:
        return None
    if c.pgtype in ("int2", "int4", "int8"):
        return int(text)
    if c.pgtype in ("real", "float8"):
        return "NaN" if text == "NaN" else float(text)
    if c.pgtype == "bool":
        return {"true": 1, "false": 0}[text]  # the ::text cast spells it out
    if c.pgtype == "bytea":
        assert text.startswith("\\x"), text
        return bytes.fromhex(text[2:])
    return text  # numeric, dates and times, json, uuid, enums, arrays: as PostgreSQL prints them


def typed(row: Iterable[Any]) -> tuple[tuple[str, Any], ...]:
    """Values with their Python type, so 1, 1.0, True and '1' never compare equal."""
    return tuple((type(v).__name__, v) for v in row)


def _short(row: Any, limit: int = 300) -> str:
    s = repr(row)
    return s if len(s) <= limit else s[:limit] + "…"


def diff_rows(label: str, src: Sequence[Any], tgt: Sequence[Any], show: int = 4) -> str | None:
    """None when both are the same multiset of rows; else what is missing and what is extra."""
    cs, ct = Counter(src), Counter(tgt)
    if cs == ct:
        return None
    missing, extra = cs - ct, ct - cs
    lines = [f"{label}: source {len(src)} rows, target {len(tgt)} rows; "
             f"{sum(missing.values())} missing on the target, {sum(extra.values())} extra/different"]
    lines += [f"  missing x{n}: {_short(r)}" for r, n in list(missing.items())[:show]]
    lines += [f"  extra   x{n}: {_short(r)}" for r, n in list(extra.items())[:show]]
    return "\n".join(lines)


def compare(source_dsn: str, target_kind: str, target_ref: str, tables: Sequence[Table] = TABLES) -> list[str]:
    """Differences between source and target, one text per differing table (empty: identical).

    ``target_ref``: the target's libpq DSN for ``pg``, the SQLite file path for ``sqlite``.
    """
    problems = []
    with pg_connect(source_dsn) as src:
        if target_kind == "pg":
            with pg_connect(target_ref) as tgt:
                for t in tables:
                    if d := diff_rows(t.label, source_texts(src, t), source_texts(tgt, t)):
                        problems.append(d)
        else:
            db = sqlite3.connect(target_ref)
            try:
                for t in tables:
                    want = [typed(sqlite_expected(c, v) for c, v in zip(t.cols, row, strict=True))
                            for row in source_texts(src, t)]
                    cols = ", ".join(qi(c.name) for c in t.cols)
                    got = [typed(r) for r in db.execute(f"SELECT {cols} FROM {qi(t.sqlite_name)}")]
                    if d := diff_rows(t.label, want, got):
                        problems.append(d)
            finally:
                db.close()
    return problems
