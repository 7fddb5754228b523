"""Value conversion from the wire to a SQLite target's parameters.

Text mode to SQLite (documented mapping, by source type):

| PostgreSQL type                         | SQLite value                                  |
|-----------------------------------------|-----------------------------------------------|
| smallint, integer, bigint, oid          | INTEGER                                       |
| real, double precision                  | REAL; Infinity/-Infinity as ±inf; NaN as TEXT 'NaN' (SQLite has no NaN) |
| numeric                                 | TEXT, exactly as PostgreSQL prints it         |
| boolean                                 | INTEGER 1 / 0                                 |
| bytea                                   | BLOB                                          |
| date, time, timestamp, timestamptz, interval | TEXT in ISO form as PostgreSQL prints it (timestamptz in UTC) |
| json, jsonb, uuid, enums, arrays, everything else | TEXT as PostgreSQL prints it (arrays as `{…}` literals) |

Binary mode (``applier.targets.binary``): values arrive in PostgreSQL's binary
send format. SQLite gets exactly the values above; PostgreSQL gets each value
back undecoded, in binary with its type OID. A type binary mode cannot read is
an error naming it; the fallback is ``source.binary = false``: the server picks
binary or text per type (text only for types without a send function), so no
setting can ask for text for some types only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from applier.decoder.messages import Relation
from applier.targets.values import BOOL, BYTEA, FLOAT4, FLOAT8, INT2, INT4, INT8, OID


def _sqlite_float(v: bytes) -> float | str:
    f = float(v)
    return "NaN" if math.isnan(f) else f


def _sqlite_bool(v: bytes) -> int:
    return 1 if v == b"t" else 0


def _sqlite_bytea(v: bytes) -> bytes:
    if v[:2] == b"\\x":
        return bytes.fromhex(v[2:].decode())
    return _unescape_bytea(v)


def _unescape_bytea(v: bytes) -> bytes:
    """PostgreSQL's old 'escape' bytea output format."""
    out = bytearray()
    i = 0
    while i < len(v):
        c = v[i]
        if c == 0x5C and v[i + 1 : i + 2] == b"\\":
            out.append(0x5C)
            i += 2
        elif c == 0x5C:
            out.append(int(v[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(c)
            i += 1
    return bytes(out)


_SQLITE_TEXT: dict[int, Callable[[bytes], Any]] = {
    INT2: int, INT4: int, INT8: int, OID: int,
    FLOAT4: _sqlite_float, FLOAT8: _sqlite_float,
    BOOL: _sqlite_bool, BYTEA: _sqlite_bytea,
}


def sqlite_converter(type_oid: int) -> Callable[[bytes], Any]:
    """The converter of a text-mode value of the source type ``type_oid`` into SQLite."""
    return _SQLITE_TEXT.get(type_oid, bytes.decode)


def sqlite_text_converters(rel: Relation) -> list[Callable[[bytes], Any]]:
    """One converter per column for text-mode values into SQLite."""
    return [sqlite_converter(c.type_oid) for c in rel.columns]


def sqlite_declared(rel: Relation) -> list[str]:
    """The declared SQLite type of each column (INTEGER, REAL, TEXT or BLOB), from what the text converter makes of a
    value: the table above, one mapping for the engine, ``applier sync`` and schema changes followed."""
    return [sqlite_declared_type(c.type_oid) for c in rel.columns]


def sqlite_declared_type(type_oid: int) -> str:
    """The declared SQLite type of a column of the source type ``type_oid`` (see ``sqlite_declared``)."""
    try:
        sample = sqlite_converter(type_oid)(b"1")
    except (ValueError, TypeError):
        sample = ""
    return {int: "INTEGER", float: "REAL", bytes: "BLOB"}.get(type(sample), "TEXT")


def sqlite_affinity(declared: str) -> str:
    """SQLite's column affinity of a declared type (section 3.1 of SQLite's datatype page)."""
    d = declared.upper()
    if "INT" in d:
        return "INTEGER"
    if "CHAR" in d or "CLOB" in d or "TEXT" in d:
        return "TEXT"
    if "BLOB" in d or not d:
        return "BLOB"
    if "REAL" in d or "FLOA" in d or "DOUB" in d:
        return "REAL"
    return "NUMERIC"
