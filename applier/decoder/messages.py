"""Typed, immutable pgoutput messages (protocol versions 1 to 4).

Every message is a ``NamedTuple``: cheap to build on the hot path, immutable,
comparable in tests. Field names follow PostgreSQL's documentation of the
logical replication message formats. LSNs are ``LSN``; timestamps stay as the
wire's microseconds since 2000-01-01 (``pg_timestamp`` turns one into a
``datetime``). ``xid`` on DML/Relation/Type/Truncate/Message is the
(sub)transaction id that only streamed transactions carry; it is ``None``
outside Stream Start … Stream Stop.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
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

# The field holding the LSN of the record that decides a transaction (its commit, prepare or rollback), for each
# message that opens or ends one (``decided_at``).
_DECIDED_AT: dict[type, str] = {Begin: "final_lsn", BeginPrepare: "prepare_lsn", Prepare: "prepare_lsn",
                                StreamPrepare: "prepare_lsn", CommitPrepared: "commit_lsn",
                                StreamCommit: "commit_lsn", RollbackPrepared: "rollback_end_lsn"}


def decided_at(msg: object) -> LSN | None:
    """The LSN of the commit, prepare or rollback record of the transaction that ``msg`` opens or ends (None: a
    message of another kind)."""
    field = _DECIDED_AT.get(type(msg))
    return None if field is None else getattr(msg, field)


# Messages that carry the subtransaction xid inside Stream Start … Stream Stop.
STREAMED_XID_MESSAGES = frozenset(b"MRYIUDT")


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
