"""Render decoded messages as JSON-ready dicts: every field named, LSNs as ``X/Y``.

This is what ``applier decode`` prints, one message a line. Tuple columns come
out as ``{"kind": "t", "value": "..."}``; binary values as hexadecimal; n and u
columns with their kind only. Timestamps as ISO 8601 in UTC.
"""

from __future__ import annotations

from typing import Any

from applier.decoder.messages import BINARY, TEXT, Column, PgOutputMessage, TupleData, pg_timestamp
from applier.lsn import LSN

_TIME_FIELDS = frozenset({"commit_time", "prepare_time", "rollback_time", "abort_time"})


def render_tuple(t: TupleData) -> list[dict[str, str]]:
    """One dict per column: kind and, for t/b, the value."""
    out: list[dict[str, str]] = []
    for kind, value in zip(t.kinds, t.values):
        if kind == TEXT:
            out.append({"kind": "t", "value": value.decode(errors="replace")})  # type: ignore[union-attr]
        elif kind == BINARY:
            out.append({"kind": "b", "value": value.hex()})  # type: ignore[union-attr]
        else:
            out.append({"kind": chr(kind)})
    return out


def _value(name: str, v: Any) -> Any:
    if isinstance(v, LSN):
        return str(v)
    if isinstance(v, TupleData):
        return render_tuple(v)
    if isinstance(v, bytes):
        try:
            return v.decode()
        except UnicodeDecodeError:
            return {"hex": v.hex()}
    if name in _TIME_FIELDS and isinstance(v, int):
        return pg_timestamp(v).isoformat()
    if isinstance(v, tuple) and v and isinstance(v[0], Column):
        return [{**c._asdict(), "is_key": c.is_key} for c in v]
    if isinstance(v, tuple):
        return list(v)
    return v


def render_message(msg: PgOutputMessage) -> dict[str, Any]:
    """A JSON-ready dict with ``type`` and every field of the message."""
    out: dict[str, Any] = {"type": type(msg).__name__}
    for name, v in zip(msg._fields, msg):
        out[name] = _value(name, v)
    return out
