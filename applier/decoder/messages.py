"""Typed, immutable pgoutput messages (protocol versions 1 to 4).

Every message is a ``NamedTuple``: cheap to build on the hot path, immutable,
comparable in tests. Field names follow PostgreSQL's documentation of the
logical replication message formats. LSNs are ``LSN``; timestamps stay as the
wire's microseconds since 2000-01-01 (``pg_timestamp`` turns one into a
``datetime``). ``xid`` on DML/Relation/Type/Truncate/Message is the
(sub)transaction id that only streamed transactions carry; it is ``None``
outside Stream Start … Stream Stop.

The wire format's message kinds live here and nowhere else (PostgreSQL's one ``LogicalRepMsgType``,
logicalproto.h): ``MessageKind`` is the first byte of every message, ``KIND_OF`` the kind of each class, and
the boundary rules are sets and functions of the kind that every other module asks instead of spelling a
kind's letter (tests/test_layout.py fails on a letter spelled outside applier/decoder/):

- ``CLOSED_BY``: the kinds that open a block (Begin, Begin Prepare, Stream Start) and the kind that closes
  each (Commit, Prepare, Stream Stop); the messages between belong to the block.
- ``ENDS_TRANSACTION``: after one of these no transaction is open on the wire (it is committed, prepared,
  committed or rolled back prepared, or a streamed (sub)transaction aborted): where a recording may stop.
- ``CHECKPOINTS``: ``ENDS_TRANSACTION`` and the two kinds after which a receiver that tracks its own
  transaction state may be between transactions: Stream Stop (a stream block closed) and Message (which
  stands alone when not transactional). The apply loop looks at its goals after these only.
- ``AT_RECORD_END``: the kinds whose LSN in the SQL interface (``pg_logical_slot_peek_binary_changes``'s
  ``lsn``) is the end of their WAL record (logical.c writes them at ``txn->end_lsn``); every other kind
  carries the start of its record.
- ``decided_at`` (a decoded message) and ``decision_position`` (raw bytes, for a caller that does not decode):
  the LSN of the record that decides the transaction a message opens or ends, read from the field the
  protocol defines for it.
- ``ROW_CHANGES``: Insert, Update, Delete, Truncate.

The sets hold plain ``int`` byte values (a lookup on the hot path costs what a set of ints costs); a
``MessageKind`` is an ``int`` and finds its member.
"""

from __future__ import annotations

import struct
from datetime import UTC, datetime, timedelta
from enum import IntEnum
from typing import NamedTuple

from applier.lsn import LSN

PG_EPOCH_UNIX = 946684800  # 2000-01-01 UTC, where PostgreSQL's timestamps count from, in Unix seconds
PG_EPOCH = datetime.fromtimestamp(PG_EPOCH_UNIX, UTC)

# TupleData column kinds, as they appear on the wire.
NULL = ord("n")
UNCHANGED_TOAST = ord("u")
TEXT = ord("t")
BINARY = ord("b")


def pg_timestamp(micros: int) -> datetime:
    """Turn a wire TimestampTz (µs since 2000-01-01 UTC) into an aware datetime."""
    return PG_EPOCH + timedelta(microseconds=micros)


class TupleData(NamedTuple):
    """One tuple: ``kinds[i]`` is n/u/t/b (as a byte value), ``values[i]`` its bytes or None."""

    kinds: bytes
    values: tuple[bytes | None, ...]


class Column(NamedTuple):
    """A Relation message's column: flags (1 = part of the key), name, type OID, typmod."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        """True when the column is part of the replica identity."""
        return bool(self.flags & 1)


class Begin(NamedTuple):
    final_lsn: LSN
    commit_time: int
    xid: int


class Message(NamedTuple):
    xid: int | None
    transactional: bool
    lsn: LSN
    prefix: str
    content: bytes


class Commit(NamedTuple):
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: int


class Origin(NamedTuple):
    commit_lsn: LSN
    name: str


class Relation(NamedTuple):
    xid: int | None
    oid: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]


class Type(NamedTuple):
    xid: int | None
    oid: int
    namespace: str
    name: str


class Insert(NamedTuple):
    xid: int | None
    relation_oid: int
    new: TupleData


class Update(NamedTuple):
    xid: int | None
    relation_oid: int
    old_kind: str | None  # 'K' (key), 'O' (old tuple, REPLICA IDENTITY FULL) or None
    old: TupleData | None
    new: TupleData


class Delete(NamedTuple):
    xid: int | None
    relation_oid: int
    old_kind: str  # 'K' or 'O'
    old: TupleData


TRUNCATE_CASCADE = 1
TRUNCATE_RESTART_IDENTITY = 2


class Truncate(NamedTuple):
    xid: int | None
    options: int
    relation_oids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        """TRUNCATE … CASCADE was given."""
        return bool(self.options & TRUNCATE_CASCADE)

    @property
    def restart_identity(self) -> bool:
        """TRUNCATE … RESTART IDENTITY was given."""
        return bool(self.options & TRUNCATE_RESTART_IDENTITY)


class StreamStart(NamedTuple):
    xid: int
    first_segment: bool


class StreamStop(NamedTuple):
    pass


class StreamCommit(NamedTuple):
    xid: int
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: int


class StreamAbort(NamedTuple):
    xid: int
    subxid: int
    abort_lsn: LSN | None  # protocol 4 with parallel streaming only
    abort_time: int | None


class BeginPrepare(NamedTuple):
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: int
    xid: int
    gid: str


class Prepare(NamedTuple):
    flags: int
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: int
    xid: int
    gid: str


class CommitPrepared(NamedTuple):
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: int
    xid: int
    gid: str


class RollbackPrepared(NamedTuple):
    flags: int
    prepare_end_lsn: LSN
    rollback_end_lsn: LSN
    prepare_time: int
    rollback_time: int
    xid: int
    gid: str


class StreamPrepare(NamedTuple):
    flags: int
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: int
    xid: int
    gid: str


PgOutputMessage = (
    Begin | Message | Commit | Origin | Relation | Type | Insert | Update | Delete | Truncate | StreamStart | StreamStop | StreamCommit | StreamAbort | BeginPrepare | Prepare | CommitPrepared | RollbackPrepared | StreamPrepare
)

class MessageKind(IntEnum):
    """The first byte of a pgoutput message (PostgreSQL's ``LogicalRepMsgType``, with its names)."""

    BEGIN = ord("B")
    MESSAGE = ord("M")
    COMMIT = ord("C")
    ORIGIN = ord("O")
    RELATION = ord("R")
    TYPE = ord("Y")
    INSERT = ord("I")
    UPDATE = ord("U")
    DELETE = ord("D")
    TRUNCATE = ord("T")
    BEGIN_PREPARE = ord("b")
    PREPARE = ord("P")
    COMMIT_PREPARED = ord("K")
    ROLLBACK_PREPARED = ord("r")
    STREAM_START = ord("S")
    STREAM_STOP = ord("E")
    STREAM_COMMIT = ord("c")
    STREAM_ABORT = ord("A")
    STREAM_PREPARE = ord("p")


# The kind of each message class (one class per kind).
KIND_OF: dict[type, MessageKind] = {
    Begin: MessageKind.BEGIN, Message: MessageKind.MESSAGE, Commit: MessageKind.COMMIT,
    Origin: MessageKind.ORIGIN, Relation: MessageKind.RELATION, Type: MessageKind.TYPE,
    Insert: MessageKind.INSERT, Update: MessageKind.UPDATE, Delete: MessageKind.DELETE,
    Truncate: MessageKind.TRUNCATE, BeginPrepare: MessageKind.BEGIN_PREPARE, Prepare: MessageKind.PREPARE,
    CommitPrepared: MessageKind.COMMIT_PREPARED, RollbackPrepared: MessageKind.ROLLBACK_PREPARED,
    StreamStart: MessageKind.STREAM_START, StreamStop: MessageKind.STREAM_STOP,
    StreamCommit: MessageKind.STREAM_COMMIT, StreamAbort: MessageKind.STREAM_ABORT,
    StreamPrepare: MessageKind.STREAM_PREPARE,
}


def kind_of(payload: bytes) -> int | None:
    """The kind byte a message's raw bytes start with (None: no bytes); compare it with the sets below."""
    return payload[0] if payload else None


def _ints(*kinds: MessageKind) -> frozenset[int]:
    return frozenset(int(k) for k in kinds)


# A block's opening kind -> the kind that closes it.
CLOSED_BY: dict[int, int] = {int(opens): int(closes) for opens, closes in (
    (MessageKind.BEGIN, MessageKind.COMMIT), (MessageKind.BEGIN_PREPARE, MessageKind.PREPARE),
    (MessageKind.STREAM_START, MessageKind.STREAM_STOP))}
OPENS_BLOCK = frozenset(CLOSED_BY)
CLOSES_BLOCK = frozenset(CLOSED_BY.values())
ENDS_TRANSACTION = _ints(MessageKind.COMMIT, MessageKind.PREPARE, MessageKind.COMMIT_PREPARED,
                         MessageKind.ROLLBACK_PREPARED, MessageKind.STREAM_COMMIT, MessageKind.STREAM_PREPARE,
                         MessageKind.STREAM_ABORT)
CHECKPOINTS = ENDS_TRANSACTION | _ints(MessageKind.STREAM_STOP, MessageKind.MESSAGE)
# Stream Abort is written at its abort record's start (abort_lsn), so it is not here.
AT_RECORD_END = ENDS_TRANSACTION - _ints(MessageKind.STREAM_ABORT)
ROW_CHANGES = _ints(MessageKind.INSERT, MessageKind.UPDATE, MessageKind.DELETE, MessageKind.TRUNCATE)

# For each kind that opens or ends a transaction: the field holding the LSN of the WAL record that decides it
# (its commit, prepare or rollback), that field's byte offset in the message (the protocol's layout: kind byte,
# then Begin/Begin Prepare's LSN; Prepare/Stream Prepare/Commit Prepared/Rollback Prepared's flags byte first;
# Stream Commit's xid and flags first), and whether it is the record's end rather than its start (Rollback
# Prepared carries only the end of its record).
_DECIDED_BY: dict[int, tuple[str, int, bool]] = {int(kind): entry for kind, entry in (
    (MessageKind.BEGIN, ("final_lsn", 1, False)),
    (MessageKind.BEGIN_PREPARE, ("prepare_lsn", 1, False)),
    (MessageKind.PREPARE, ("prepare_lsn", 2, False)),
    (MessageKind.STREAM_PREPARE, ("prepare_lsn", 2, False)),
    (MessageKind.COMMIT_PREPARED, ("commit_lsn", 2, False)),
    (MessageKind.STREAM_COMMIT, ("commit_lsn", 6, False)),
    (MessageKind.ROLLBACK_PREPARED, ("rollback_end_lsn", 10, True)))}
_LSN_FIELD = struct.Struct(">Q")


def decided_at(msg: object) -> LSN | None:
    """The LSN of the commit, prepare or rollback record of the transaction that ``msg`` opens or ends, as the
    message carries it (None: a message of another kind)."""
    kind = KIND_OF.get(type(msg))
    entry = _DECIDED_BY.get(kind) if kind is not None else None
    return None if entry is None else getattr(msg, entry[0])


def decision_position(payload: bytes) -> int | None:
    """From a message's raw bytes: a position inside the WAL record that decides the transaction the message
    opens or ends (the record's start, or its end - 1 when the message carries only the end), so that the
    record lies before a record boundary ``p`` exactly when this is below ``p``. None: a message of another
    kind, or too short to be one."""
    entry = _DECIDED_BY.get(payload[0]) if payload else None
    if entry is None or len(payload) < entry[1] + 8:
        return None
    lsn: int = _LSN_FIELD.unpack_from(payload, entry[1])[0]
    return lsn - 1 if entry[2] else lsn


# The streaming replication protocol's frames around the messages (applier.decoder.framing reads them).


class XLogData(NamedTuple):
    """One WAL payload: start LSN (0/0 for some messages), WAL end, send time, message bytes.

    The LSNs are plain ints here (one of these is built per change: ``LSN(frame.start)`` to print).
    """

    start: int
    wal_end: int
    send_time: int
    payload: bytes


class Keepalive(NamedTuple):
    """Primary keepalive: the server's WAL end, send time, and whether it wants a reply now."""

    wal_end: LSN
    send_time: int
    reply_requested: bool
