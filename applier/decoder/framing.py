"""The streaming replication protocol's CopyData framing.

A walsender in COPY_BOTH mode sends XLogData (``w``) frames, each wrapping one
pgoutput message, and Primary keepalive (``k``) frames; the client answers with
Standby status update (``r``) frames. ``read_frame`` parses the former,
``encode_standby_status`` builds the latter. Pure: no I/O.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

from applier._cmodule import twin
from applier.decoder.messages import PG_EPOCH_UNIX, Keepalive, XLogData
from applier.decoder.pgoutput import DecodeError
from applier.lsn import LSN

_W = struct.Struct(">QQq")
_K = struct.Struct(">QqB")
_R = struct.Struct(">cQQQqB")


_new_tuple = tuple.__new__  # XLogData without its Python-level __new__ (one per change)

Frame = XLogData | Keepalive


def read_frame(data: bytes | memoryview) -> Frame:
    """Parse one CopyData payload from a walsender (a memoryview is read in place; the payload is copied out)."""
    frame = _read_first(data)
    return frame if frame is not None else read_frame_pure(data)


def read_frame_pure(data: bytes | memoryview) -> Frame:
    """``read_frame`` in Python: every frame, and the errors (the compiled twin returns None for those)."""
    if not data:
        raise DecodeError("CopyData", "kind", 0, "no bytes")
    kind = data[0]
    if kind == 0x77:  # 'w'
        if len(data) < 1 + _W.size:
            raise DecodeError("XLogData", "header", 1, f"needs {_W.size} bytes, {len(data) - 1} left")
        start, end, ts = _W.unpack_from(data, 1)
        payload = data[25:]
        return _new_tuple(XLogData, (start, end, ts, payload if type(payload) is bytes else bytes(payload)))
    if kind == 0x6B:  # 'k'
        if len(data) != 1 + _K.size:
            raise DecodeError("Primary keepalive", "length", 0, f"expected {1 + _K.size} bytes, got {len(data)}")
        end, ts, reply = _K.unpack_from(data, 1)
        if reply not in (0, 1):
            raise DecodeError("Primary keepalive", "reply", 17, f"expected 0 or 1, got {reply}")
        return Keepalive(LSN(end), ts, bool(reply))
    raise DecodeError("CopyData", "kind", 0, f"unknown frame kind {bytes(data[:1])!r}")


# compiled or pure (applier._cmodule): the compiled one reads XLogData and well-formed keepalives and returns None
# for anything else (``read_frame`` then reads it with the pure one, which reads every frame or raises)
_read_first: Callable[[bytes | memoryview], Frame | None] = twin("read_frame", read_frame_pure)


def now_pg_micros() -> int:
    """The current time as microseconds since 2000-01-01 UTC."""
    return int((time.time() - PG_EPOCH_UNIX) * 1_000_000)


def encode_standby_status(write: int, flush: int, apply: int, reply: bool = False, now: int | None = None) -> bytes:
    """Build a Standby status update (``r``) frame."""
    return _R.pack(b"r", write, flush, apply, now_pg_micros() if now is None else now, 1 if reply else 0)
