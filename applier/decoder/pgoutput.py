"""Read pgoutput messages from bytes (the wire format of PostgreSQL's proto.c).

Pure: no I/O, no state but what the caller passes in. One ``read_<message>``
per message kind, dispatched on the first byte (a ``MessageKind``) by ``decode_message``. Every
read is bounds-checked; bytes that are not exactly one valid message (short,
trailing garbage, unknown kind, bad UTF-8, bad enum byte) raise
``DecodeError`` naming the message, the field and the byte offset, never
anything else.

Streamed transactions: between Stream Start and Stream Stop, DML, Relation,
Type, Truncate and Message carry an extra xid. The caller says whether it is
inside a stream (``in_stream``); ``Decoder`` keeps that state for a sequence.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from applier._cmodule import twin
from applier.decoder.messages import (
    BINARY,
    NULL,
    TEXT,
    UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    MessageKind,
    Origin,
    PgOutputMessage,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)
from applier.lsn import LSN

_new_tuple = tuple.__new__  # a NamedTuple without its Python-level __new__ (hot paths: one per change)
_I16 = struct.Struct(">h")
_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")
_LLQ = struct.Struct(">QQq")  # lsn, lsn, timestamp
_BQQQ = struct.Struct(">BQQq")  # flags, lsn, lsn, timestamp
_XID_OID = struct.Struct(">II")


class DecodeError(ValueError):
    """Bytes that are not a valid message; says which message, field and byte offset."""

    def __init__(self, message: str, field: str, offset: int, detail: str) -> None:
        self.message_type = message
        self.field = field
        self.offset = offset
        self.detail = detail
        super().__init__(f"{message} message: {field} at byte {offset}: {detail}")


class _Reader:
    """Cursor over one message's bytes; every read checks bounds."""

    __slots__ = ("buf", "pos", "end", "name")

    def __init__(self, buf: bytes, name: str) -> None:
        self.buf = buf
        self.pos = 1  # past the kind byte
        self.end = len(buf)
        self.name = name

    def fail(self, field: str, detail: str, offset: int | None = None) -> DecodeError:
        return DecodeError(self.name, field, self.pos if offset is None else offset, detail)

    def _need(self, n: int, field: str) -> int:
        pos = self.pos
        if pos + n > self.end:
            raise self.fail(field, f"needs {n} bytes, {self.end - pos} left")
        self.pos = pos + n
        return pos

    def u8(self, field: str) -> int:
        return self.buf[self._need(1, field)]

    def i16(self, field: str) -> int:
        v: int = _I16.unpack_from(self.buf, self._need(2, field))[0]
        return v

    def u32(self, field: str) -> int:
        v: int = _U32.unpack_from(self.buf, self._need(4, field))[0]
        return v

    def i32(self, field: str) -> int:
        v: int = _I32.unpack_from(self.buf, self._need(4, field))[0]
        return v

    def i64(self, field: str) -> int:
        v: int = _I64.unpack_from(self.buf, self._need(8, field))[0]
        return v

    def lsn(self, field: str) -> LSN:
        return int.__new__(LSN, _U64.unpack_from(self.buf, self._need(8, field))[0])

    def string(self, field: str) -> str:
        pos = self.pos
        nul = self.buf.find(b"\0", pos, self.end)
        if nul < 0:
            raise self.fail(field, "string has no terminating NUL")
        try:
            value = self.buf[pos:nul].decode()
        except UnicodeDecodeError as exc:
            raise self.fail(field, f"string is not valid UTF-8 ({exc.reason})") from None
        self.pos = nul + 1
        return value

    def raw(self, n: int, field: str) -> bytes:
        pos = self._need(n, field)
        return self.buf[pos : pos + n]

    def flags0(self, field: str = "flags") -> int:
        return self.u8(field)

    def xid_if(self, in_stream: bool) -> int | None:
        return self.u32("xid") if in_stream else None

    def submessage(self, field: str, allowed: bytes) -> str:
        pos = self.pos
        b = self.u8(field)
        if b not in allowed:
            raise self.fail(field, f"expected one of {allowed.decode()!r}, got {bytes([b])!r}", pos)
        return chr(b)

    def tuple_data(self, field: str) -> TupleData:
        """Read TupleData at the cursor."""
        t, self.pos = read_tuple(self.buf, self.pos, self.end, self.name, field)
        return t

    def done(self) -> None:
        if self.pos != self.end:
            raise self.fail("end", f"{self.end - self.pos} unexpected trailing bytes")


def read_tuple(buf: bytes, pos: int, end: int, name: str, field: str) -> tuple[TupleData, int]:
    """Read TupleData at ``pos``: Int16 column count, then n/u/(t|b Int32 len, bytes) per column."""
    fast = _read_text_tuple(buf, pos, end)
    if fast is not None:
        return fast
    if pos + 2 > end:
        raise DecodeError(name, f"{field} column count", pos, f"needs 2 bytes, {end - pos} left")
    ncols = _I16.unpack_from(buf, pos)[0]
    if ncols < 0:
        raise DecodeError(name, f"{field} column count", pos, f"negative ({ncols})")
    pos += 2
    kinds = bytearray(ncols)
    values: list[bytes | None] = [None] * ncols
    unpack = _I32.unpack_from
    for i in range(ncols):
        if pos >= end:
            raise DecodeError(name, f"{field} column {i + 1} kind", pos, "needs 1 byte, 0 left")
        kind = buf[pos]
        kinds[i] = kind
        pos += 1
        if kind == TEXT or kind == BINARY:
            if pos + 4 > end:
                raise DecodeError(name, f"{field} column {i + 1} length", pos, f"needs 4 bytes, {end - pos} left")
            n = unpack(buf, pos)[0]
            pos += 4
            if n < 0 or pos + n > end:
                raise DecodeError(name, f"{field} column {i + 1} value", pos - 4, f"length {n} but {end - pos} bytes left")
            values[i] = buf[pos : pos + n]
            pos += n
        elif kind != NULL and kind != UNCHANGED_TOAST:
            raise DecodeError(name, f"{field} column {i + 1} kind", pos - 1,
                              f"expected n, u, t or b, got {bytes([kind])!r}")
    return _new_tuple(TupleData, (bytes(kinds), tuple(values))), pos


def _read_text_tuple(buf: bytes, pos: int, end: int) -> tuple[TupleData, int] | None:
    """The common tuple, every column 't' or 'n', read without per-field checks; None: anything else or bad bytes."""
    nulls = False
    try:
        ncols = _I16.unpack_from(buf, pos)[0]
        if ncols < 0:
            return None
        pos += 2
        values: list[bytes | None] = []
        append = values.append
        unpack = _I32.unpack_from
        for _ in range(ncols):
            kind = buf[pos]
            if kind == TEXT:
                n = unpack(buf, pos + 1)[0]
                pos += 5
                if n < 0:
                    return None
                append(buf[pos : pos + n])
                pos += n
            elif kind == NULL:
                append(None)
                pos += 1
                nulls = True
            else:
                return None
    except (IndexError, struct.error):
        return None
    if pos > end:
        return None
    if nulls:
        kinds = bytes([NULL if v is None else TEXT for v in values])
    else:
        cached = _ALL_TEXT.get(ncols)
        if cached is None:
            cached = _ALL_TEXT[ncols] = b"t" * ncols
        kinds = cached
    return _new_tuple(TupleData, (kinds, tuple(values))), pos


_ALL_TEXT: dict[int, bytes] = {}  # column count -> its kinds when every column is 't'


def _fast_insert(data: bytes) -> Insert | None:
    """Insert outside a stream without a cursor object (the hot path); None: use the reader."""
    end = len(data)
    if end < 8 or data[5] != 0x4E:  # 'N'
        return None
    got = _read_text_tuple(data, 6, end)
    if got is None or got[1] != end:
        return None
    return _new_tuple(Insert, (None, _U32.unpack_from(data, 1)[0], got[0]))


def _fast_update(data: bytes) -> Update | None:
    """Update outside a stream without a cursor object; None: use the reader."""
    end = len(data)
    if end < 8:
        return None
    part = data[5]
    oid = _U32.unpack_from(data, 1)[0]
    if part == 0x4E:
        t, pos = read_tuple(data, 6, end, "Update", "new tuple")
        return _new_tuple(Update, (None, oid, None, None, t)) if pos == end else None
    if part != 0x4B and part != 0x4F:  # 'K', 'O'
        return None
    old, pos = read_tuple(data, 6, end, "Update", "key tuple" if part == 0x4B else "old tuple")
    if pos >= end or data[pos] != 0x4E:
        return None
    t, pos = read_tuple(data, pos + 1, end, "Update", "new tuple")
    return _new_tuple(Update, (None, oid, chr(part), old, t)) if pos == end else None


def _fast_delete(data: bytes) -> Delete | None:
    """Delete outside a stream without a cursor object; None: use the reader."""
    end = len(data)
    if end < 8:
        return None
    part = data[5]
    if part != 0x4B and part != 0x4F:  # 'K', 'O'
        return None
    old, pos = read_tuple(data, 6, end, "Delete", "key tuple" if part == 0x4B else "old tuple")
    return _new_tuple(Delete, (None, _U32.unpack_from(data, 1)[0], chr(part), old)) if pos == end else None


def read_begin(r: _Reader, in_stream: bool) -> Begin:
    return Begin(r.lsn("final_lsn"), r.i64("commit_time"), r.u32("xid"))


def read_message(r: _Reader, in_stream: bool) -> Message:
    xid = r.xid_if(in_stream)
    flags = r.u8("flags")
    if flags not in (0, 1):
        raise r.fail("flags", f"expected 0 or 1, got {flags}", r.pos - 1)
    lsn = r.lsn("lsn")
    prefix = r.string("prefix")
    n = r.i32("content length")
    if n < 0:
        raise r.fail("content length", f"negative ({n})", r.pos - 4)
    return Message(xid, bool(flags), lsn, prefix, r.raw(n, "content"))


def read_commit(r: _Reader, in_stream: bool) -> Commit:
    return Commit(r.u8("flags"), r.lsn("commit_lsn"), r.lsn("end_lsn"), r.i64("commit_time"))


def read_origin(r: _Reader, in_stream: bool) -> Origin:
    return Origin(r.lsn("commit_lsn"), r.string("name"))


_IDENTITIES = "dnfi"


def read_relation(r: _Reader, in_stream: bool) -> Relation:
    xid = r.xid_if(in_stream)
    oid = r.u32("oid")
    namespace = r.string("namespace")
    name = r.string("name")
    ident_pos = r.pos
    ident = chr(r.u8("replica identity"))
    if ident not in _IDENTITIES:
        raise r.fail("replica identity", f"expected one of d, n, f, i, got {ident!r}", ident_pos)
    ncols = r.i16("column count")
    if ncols < 0:
        raise r.fail("column count", f"negative ({ncols})", r.pos - 2)
    columns = tuple(
        Column(r.u8(f"column {i + 1} flags"), r.string(f"column {i + 1} name"),
               r.u32(f"column {i + 1} type oid"), r.i32(f"column {i + 1} typmod"))
        for i in range(ncols)
    )
    return Relation(xid, oid, namespace, name, ident, columns)


def read_type(r: _Reader, in_stream: bool) -> Type:
    return Type(r.xid_if(in_stream), r.u32("oid"), r.string("namespace"), r.string("name"))


def read_insert(r: _Reader, in_stream: bool) -> Insert:
    xid = r.xid_if(in_stream)
    oid = r.u32("relation oid")
    r.submessage("tuple kind", b"N")
    return Insert(xid, oid, r.tuple_data("new tuple"))


def read_update(r: _Reader, in_stream: bool) -> Update:
    xid = r.xid_if(in_stream)
    oid = r.u32("relation oid")
    part = r.submessage("tuple kind", b"KON")
    if part == "N":
        return Update(xid, oid, None, None, r.tuple_data("new tuple"))
    old = r.tuple_data("key tuple" if part == "K" else "old tuple")
    r.submessage("new tuple kind", b"N")
    return Update(xid, oid, part, old, r.tuple_data("new tuple"))


def read_delete(r: _Reader, in_stream: bool) -> Delete:
    xid = r.xid_if(in_stream)
    oid = r.u32("relation oid")
    part = r.submessage("tuple kind", b"KO")
    return Delete(xid, oid, part, r.tuple_data("key tuple" if part == "K" else "old tuple"))


def write_truncate(oid: int, restart_identity: bool) -> bytes:
    """A Truncate message (outside a stream block) of relation ``oid`` alone, without CASCADE: what applier keeps of a
    TRUNCATE for a table whose changes it holds (``applier.engine.holding``)."""
    return bytes([MessageKind.TRUNCATE]) + _I32.pack(1) + bytes([int(restart_identity) << 1]) + _U32.pack(oid)


_DEFINITIONS: dict[int, str] = {MessageKind.RELATION: "R", MessageKind.TYPE: "Y"}


def definition_key(raw: bytes, in_stream: bool) -> tuple[str, int] | None:
    """("R", OID) of a Relation message's bytes, ("Y", OID) of a Type message's (the keys of
    ``RelationMap.meta_raw``); None for any other kind. ``in_stream``: the message carries a streamed xid first."""
    tag = _DEFINITIONS.get(raw[0]) if raw else None
    if tag is None or len(raw) < 9:
        return None
    at = 5 if in_stream else 1
    return tag, _U32.unpack_from(raw, at)[0]


def read_truncate(r: _Reader, in_stream: bool) -> Truncate:
    xid = r.xid_if(in_stream)
    n = r.i32("relation count")
    if n < 0:
        raise r.fail("relation count", f"negative ({n})", r.pos - 4)
    options = r.u8("options")
    if options & ~3:
        raise r.fail("options", f"unknown option bits {options:#x}", r.pos - 1)
    if r.pos + 4 * n > r.end:
        raise r.fail("relation oids", f"{n} oids need {4 * n} bytes, {r.end - r.pos} left")
    return Truncate(xid, options, tuple(r.u32(f"relation oid {i + 1}") for i in range(n)))


def read_stream_start(r: _Reader, in_stream: bool) -> StreamStart:
    xid = r.u32("xid")
    first = r.u8("first segment")
    if first not in (0, 1):
        raise r.fail("first segment", f"expected 0 or 1, got {first}", r.pos - 1)
    return StreamStart(xid, bool(first))


def read_stream_stop(r: _Reader, in_stream: bool) -> StreamStop:
    return StreamStop()


def read_stream_commit(r: _Reader, in_stream: bool) -> StreamCommit:
    return StreamCommit(r.u32("xid"), r.u8("flags"), r.lsn("commit_lsn"), r.lsn("end_lsn"), r.i64("commit_time"))


def read_stream_abort(r: _Reader, in_stream: bool) -> StreamAbort:
    xid = r.u32("xid")
    subxid = r.u32("subxid")
    if r.pos == r.end:  # protocol < 4, or streaming = on rather than parallel
        return StreamAbort(xid, subxid, None, None)
    return StreamAbort(xid, subxid, r.lsn("abort_lsn"), r.i64("abort_time"))


def read_begin_prepare(r: _Reader, in_stream: bool) -> BeginPrepare:
    return BeginPrepare(r.lsn("prepare_lsn"), r.lsn("end_lsn"), r.i64("prepare_time"), r.u32("xid"), r.string("gid"))


def read_prepare(r: _Reader, in_stream: bool) -> Prepare:
    return Prepare(r.u8("flags"), r.lsn("prepare_lsn"), r.lsn("end_lsn"), r.i64("prepare_time"),
                   r.u32("xid"), r.string("gid"))


def read_commit_prepared(r: _Reader, in_stream: bool) -> CommitPrepared:
    return CommitPrepared(r.u8("flags"), r.lsn("commit_lsn"), r.lsn("end_lsn"), r.i64("commit_time"),
                          r.u32("xid"), r.string("gid"))


def read_rollback_prepared(r: _Reader, in_stream: bool) -> RollbackPrepared:
    return RollbackPrepared(r.u8("flags"), r.lsn("prepare_end_lsn"), r.lsn("rollback_end_lsn"),
                            r.i64("prepare_time"), r.i64("rollback_time"), r.u32("xid"), r.string("gid"))


def read_stream_prepare(r: _Reader, in_stream: bool) -> StreamPrepare:
    return StreamPrepare(r.u8("flags"), r.lsn("prepare_lsn"), r.lsn("end_lsn"), r.i64("prepare_time"),
                         r.u32("xid"), r.string("gid"))


_READERS: dict[int, tuple[str, Callable[[_Reader, bool], PgOutputMessage]]] = {
    MessageKind.BEGIN.value: ("Begin", read_begin),
    MessageKind.MESSAGE.value: ("Message", read_message),
    MessageKind.COMMIT.value: ("Commit", read_commit),
    MessageKind.ORIGIN.value: ("Origin", read_origin),
    MessageKind.RELATION.value: ("Relation", read_relation),
    MessageKind.TYPE.value: ("Type", read_type),
    MessageKind.INSERT.value: ("Insert", read_insert),
    MessageKind.UPDATE.value: ("Update", read_update),
    MessageKind.DELETE.value: ("Delete", read_delete),
    MessageKind.TRUNCATE.value: ("Truncate", read_truncate),
    MessageKind.STREAM_START.value: ("Stream Start", read_stream_start),
    MessageKind.STREAM_STOP.value: ("Stream Stop", read_stream_stop),
    MessageKind.STREAM_COMMIT.value: ("Stream Commit", read_stream_commit),
    MessageKind.STREAM_ABORT.value: ("Stream Abort", read_stream_abort),
    MessageKind.BEGIN_PREPARE.value: ("Begin Prepare", read_begin_prepare),
    MessageKind.PREPARE.value: ("Prepare", read_prepare),
    MessageKind.COMMIT_PREPARED.value: ("Commit Prepared", read_commit_prepared),
    MessageKind.ROLLBACK_PREPARED.value: ("Rollback Prepared", read_rollback_prepared),
    MessageKind.STREAM_PREPARE.value: ("Stream Prepare", read_stream_prepare),
}


_BEGIN = struct.Struct(">QqI")
_COMMIT = struct.Struct(">BQQq")
_new_lsn = int.__new__  # LSN(x) without LSN.__new__'s range check: the struct already bounds it


def _fast_begin(data: bytes) -> Begin | None:
    """Begin without a cursor object; None: use the reader."""
    if len(data) != 1 + _BEGIN.size:
        return None
    lsn, ts, xid = _BEGIN.unpack_from(data, 1)
    return Begin(_new_lsn(LSN, lsn), ts, xid)


def _fast_commit(data: bytes) -> Commit | None:
    """Commit without a cursor object; None: use the reader."""
    if len(data) != 1 + _COMMIT.size:
        return None
    flags, lsn, end, ts = _COMMIT.unpack_from(data, 1)
    return Commit(flags, _new_lsn(LSN, lsn), _new_lsn(LSN, end), ts)


_FAST: dict[int, Callable[[bytes], PgOutputMessage | None]] = {
    MessageKind.INSERT.value: _fast_insert, MessageKind.UPDATE.value: _fast_update, MessageKind.DELETE.value: _fast_delete, MessageKind.BEGIN.value: _fast_begin,
    MessageKind.COMMIT.value: _fast_commit,
}

FastDecode = Callable[[bytes, bool], PgOutputMessage | None]


def fast_decode_pure(data: bytes, in_stream: bool = False) -> PgOutputMessage | None:
    """Begin, Commit, Insert, Update or Delete outside a stream, read on the common path; None: use the
    field-checking readers (anything else, anything inside a stream, or bytes they must judge).
    Twin of ``applier._rowpath.fast_decode`` (which also reads changes inside a stream)."""
    fast = _FAST.get(data[0]) if data and not in_stream else None
    return fast(data) if fast is not None else None


fast_decode: FastDecode = twin("fast_decode", fast_decode_pure)  # compiled or pure (applier._cmodule)


def decode_message(data: bytes, in_stream: bool = False) -> PgOutputMessage:
    """Decode exactly one pgoutput message; ``in_stream`` when inside Stream Start … Stop."""
    if data:
        msg = fast_decode(data if type(data) is bytes else bytes(data), in_stream)
        if msg is not None:
            return msg
    return _read_message(data, in_stream)


def _read_message(data: bytes, in_stream: bool) -> PgOutputMessage:
    """Decode one message with the field-checking readers (every kind, every byte checked)."""
    if not data:
        raise DecodeError("(empty)", "kind", 0, "no bytes")
    entry = _READERS.get(data[0])
    if entry is None:
        raise DecodeError("(unknown)", "kind", 0, f"unknown message kind {data[:1]!r}")
    name, reader = entry
    r = _Reader(bytes(data), name)
    msg = reader(r, in_stream)
    r.done()
    return msg


class Decoder:
    """Decodes a sequence of messages, tracking Stream Start … Stream Stop for the extra xid."""

    __slots__ = ("in_stream", "fast")

    def __init__(self, fast: FastDecode | None = None) -> None:
        """``fast``: the common-path reader (``fast_decode_pure`` or the compiled twin; default: ``fast_decode``),
        which a caller may run itself on a message while ``in_stream`` stays as it is (it decodes no message that
        changes it)."""
        self.in_stream = False
        self.fast = fast or fast_decode

    def decode(self, data: bytes) -> PgOutputMessage:
        """Decode one message of the sequence; Stream Start/Stop switch the streamed-xid mode."""
        if data:  # the hot path: a change, Begin or Commit
            msg = self.fast(data if type(data) is bytes else bytes(data), self.in_stream)
            if msg is not None:
                return msg
        msg = _read_message(data, self.in_stream)
        kind = data[0]
        if kind == MessageKind.STREAM_START:
            if self.in_stream:
                raise DecodeError("Stream Start", "kind", 0, "Stream Start inside an open stream block")
            self.in_stream = True
        elif kind == MessageKind.STREAM_STOP:
            if not self.in_stream:
                raise DecodeError("Stream Stop", "kind", 0, "Stream Stop outside a stream block")
            self.in_stream = False
        return msg
