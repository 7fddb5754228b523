"""Canonical values: one byte string per value, equal exactly when the two sides hold the same value.

``applier verify`` compares a PostgreSQL source with a target column by column.

- PostgreSQL target: both sides are read as PostgreSQL's text output with the
  same session settings (ISO dates, UTC, ``extra_float_digits = 3``, hex
  bytea), so the text *is* the canonical form; no conversion at all.
- SQLite target: the source's text goes through the apply engine's own
  converters (``sqlite_text_converters``, the documented mapping), and both the
  converted source value and the value SQLite returns are encoded by Python
  type: ``i`` + decimal for INTEGER, ``f`` + ``repr`` for REAL, ``s`` + UTF-8
  for TEXT, ``x`` + hex for BLOB. A value stored with another storage class
  than the mapping's therefore differs, as it should.

NULL stays NULL (None) in both cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from applier.decoder.messages import Column, Relation
from applier.targets.backends import backend
from applier.targets.sqlite.values import sqlite_text_converters
from applier.url import Kind

_EMPTY = pa.scalar(b"", pa.binary())
_PREFIX = {tag: pa.scalar(tag, pa.binary()) for tag in (b"i", b"f", b"s", b"x")}


def canon(v: Any) -> bytes | None:
    """The canonical form of a Python value as SQLite stores it."""
    if v is None:
        return None
    t = type(v)
    if t is int:
        return b"i%d" % v
    if t is str:
        text: bytes = b"s" + v.encode()
        return text
    if t is float:
        return b"f" + repr(v).encode()
    if t is bytes:
        raw: bytes = b"x" + v.hex().encode()
        return raw
    if t is bool:
        return b"i%d" % int(v)
    return b"s" + str(v).encode()


def _prefixed(arr: pa.Array, tag: bytes) -> pa.Array:
    return pc.binary_join_element_wise(_PREFIX[tag], arr, _EMPTY)


def sqlite_source_canonicalizer(type_oids: list[int]) -> Callable[[pa.RecordBatch], pa.RecordBatch]:
    """A function turning a batch of source text values (binary columns) into their SQLite canonical form."""
    rel = Relation(None, 0, "", "", "d", tuple(Column(0, f"c{i}", oid, -1) for i, oid in enumerate(type_oids)))
    convs = sqlite_text_converters(rel)

    def convert(batch: pa.RecordBatch) -> pa.RecordBatch:
        out = []
        for arr, conv in zip(batch.columns, convs, strict=True):
            if conv is bytes.decode:  # TEXT: the text itself
                out.append(_prefixed(arr, b"s"))
            elif conv is int:  # INTEGER from PostgreSQL's integer output: already canonical decimal
                out.append(_prefixed(arr, b"i"))
            else:
                out.append(pa.array([None if v is None else canon(conv(v)) for v in arr.to_pylist()], pa.binary()))
        return pa.RecordBatch.from_arrays(out, names=batch.schema.names)

    return convert


def canonical_rows_batch(rows: list[tuple[Any, ...]], names: list[str]) -> pa.RecordBatch:
    """SQLite rows (Python values) as a batch of canonical binary columns."""
    if not rows:
        return pa.RecordBatch.from_arrays([pa.array([], pa.binary()) for _ in names], names=names)
    cols = list(zip(*rows))
    return pa.RecordBatch.from_arrays([pa.array([canon(v) for v in col], pa.binary()) for col in cols], names=names)


def display(value: bytes | None, kind: Kind) -> Any:
    """A canonical value of a target of ``kind`` for people (and JSON): text, number, or None."""
    if value is None:
        return None
    if backend(kind).keeps_types:  # PostgreSQL's text
        return value.decode(errors="replace")
    tag, body = value[:1], value[1:]
    if tag == b"i":
        return int(body)
    if tag == b"f":
        f = float(body)
        return f if math.isfinite(f) else body.decode()
    if tag == b"x":
        return "\\x" + body.decode()
    return body.decode(errors="replace")
