"""Capturing pgoutput from a live server: shared by the golden and framing tests.

``Source`` wraps one fresh database (the ``source_db`` fixture) with a publication
``pub``: it creates logical slots, runs SQL, and reads a slot back through
``pg_logical_slot_peek_binary_changes``, decoding every row in order with one
``Decoder``. It cleans up what it made that outlives the database (prepared
transactions, replication origins) and its slots.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from applier.decoder.messages import (
    NULL,
    TEXT,
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Insert,
    Origin,
    Relation,
    StreamStart,
    StreamStop,
    TupleData,
    pg_timestamp,
)
from applier.decoder.pgoutput import Decoder
from applier.decoder.render import render_message
from tests.plugins.clusters import ScratchDb

# Enough rows to overflow logical_decoding_work_mem (64kB on the test clusters) many times.
BIG = 5000


class Source:
    """One fresh database with a publication ``pub``: SQL in, decoded pgoutput out."""

    def __init__(self, db: ScratchDb) -> None:
        self.db = db
        self.version = db.cluster.install.version
        self.proto = 4 if self.version >= 16 else 3
        self.conn = psycopg.connect(db.dsn, autocommit=True)
        self.slots: list[str] = []
        self.gids: list[str] = []
        self.origins: list[str] = []

    def q(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(query, params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description is not None else []

    def one(self, query: str, params: Any = None) -> Any:
        rows = self.q(query, params)
        assert len(rows) == 1 and len(rows[0]) == 1, rows
        return rows[0][0]

    def xid(self) -> int:
        return int(self.one("SELECT txid_current()")) & 0xFFFFFFFF

    def oid(self, table: str) -> int:
        return int(self.one("SELECT %s::regclass::oid", [table]))

    def slot(self, two_phase: bool = False) -> str:
        name = f"s{len(self.slots)}_{self.db.dbname}"
        self.q("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)", [name, two_phase])
        self.slots.append(name)
        return name

    def gid(self, label: str) -> str:
        gid = f"{label}_{self.db.dbname}"
        self.gids.append(gid)
        return gid

    def peek(self, slot: str, *, proto: int | None = None, streaming: str | None = None, binary: bool = False,
             messages: bool = False, two_phase: bool = False, conn: psycopg.Connection[Any] | None = None,
             ) -> list[Any]:
        """Every message in ``slot`` so far, decoded in order by one Decoder."""
        opts = ["proto_version", str(proto or self.proto), "publication_names", "pub"]
        if streaming:
            opts += ["streaming", streaming]
        if binary:
            opts += ["binary", "true"]
        if messages:
            opts += ["messages", "true"]
        if two_phase:
            opts += ["two_phase", "true"]
        rows = (conn or self.conn).execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, VARIADIC %s::text[])",
            [slot, opts]).fetchall()
        dec = Decoder()
        out = []
        for (data,) in rows:
            msg = dec.decode(bytes(data))
            render_message(msg)  # every real message renders
            out.append(msg)
        assert not dec.in_stream, "the capture ended inside a stream block"
        return out

    def close(self) -> None:
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            self.conn.execute("ROLLBACK")  # a test that failed inside a transaction
        for gid in self.gids:
            if self.q("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s", [gid]):
                self.q(f"ROLLBACK PREPARED '{gid}'")
        for origin in self.origins:
            self.q("SELECT pg_replication_origin_session_reset() WHERE pg_replication_origin_session_is_setup()")
            if self.q("SELECT 1 FROM pg_replication_origin WHERE roname = %s", [origin]):
                self.q("SELECT pg_replication_origin_drop(%s)", [origin])
        for slot in self.slots:  # active ones (a walsender still exiting) are left to drop_database
            self.q("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                   " WHERE slot_name = %s AND NOT active", [slot])
        self.conn.close()


def kinds_of(msgs: list[Any]) -> list[str]:
    return [type(m).__name__ for m in msgs]


def texts(t: TupleData) -> list[str | None]:
    """Column values as text; 'n' as None, 'u' as the marker '<u>'."""
    out: list[str | None] = []
    for kind, value in zip(t.kinds, t.values, strict=True):
        if kind == NULL:
            assert value is None
            out.append(None)
        elif kind == UNCHANGED_TOAST:
            assert value is None
            out.append("<u>")
        else:
            assert kind == TEXT, bytes([kind])
            assert value is not None
            out.append(value.decode())
    return out


def catalog_columns(src: Source, table: str) -> list[tuple[str, int, int]]:
    return [(n, int(t), int(m)) for n, t, m in src.q(
        "SELECT attname, atttypid, atttypmod FROM pg_attribute WHERE attrelid = %s::regclass"
        " AND attnum > 0 AND NOT attisdropped ORDER BY attnum", [table])]


def check_transaction(msgs: list[Any], xid: int) -> tuple[Begin, Commit]:
    """One Begin … Commit transaction: xid, and the LSN and time relations between them."""
    begin, commit = msgs[0], msgs[-1]
    assert isinstance(begin, Begin) and isinstance(commit, Commit)
    assert begin.xid == xid
    assert begin.final_lsn == commit.commit_lsn
    assert commit.end_lsn > commit.commit_lsn > 0
    assert commit.flags == 0
    assert begin.commit_time == commit.commit_time
    assert abs(pg_timestamp(commit.commit_time) - datetime.now(UTC)) < timedelta(minutes=5)
    assert not any(isinstance(m, (Begin, Commit)) for m in msgs[1:-1])
    return begin, commit


def in_transaction(src: Source, *statements: str) -> int:
    """Run ``statements`` in one transaction; its xid."""
    with src.conn.transaction():
        xid = src.xid()
        for s in statements:
            src.q(s)
    return xid


def stream_blocks(msgs: list[Any]) -> list[list[Any]]:
    """The messages inside each Stream Start … Stream Stop, checking the brackets."""
    blocks: list[list[Any]] = []
    current: list[Any] | None = None
    for m in msgs:
        if isinstance(m, StreamStart):
            assert current is None
            current = [m]
        elif isinstance(m, StreamStop):
            assert current is not None
            blocks.append(current)
            current = None
        elif current is not None:
            current.append(m)
    assert current is None
    return blocks


def check_streamed(msgs: list[Any], xid: int, subxids: set[int],
                   allowed: tuple[type, ...] = (Relation, Insert)) -> dict[int, list[Insert]]:
    """Stream blocks of one transaction: xid on every Stream Start and change; inserts by (sub)xid."""
    blocks = stream_blocks(msgs)
    assert len(blocks) >= 3, "the transaction should have been streamed in several segments"
    assert [b[0].first_segment for b in blocks] == [True] + [False] * (len(blocks) - 1)
    assert all(b[0].xid == xid for b in blocks)
    by_xid: dict[int, list[Insert]] = {}
    for block in blocks:
        for m in block[1:]:
            assert isinstance(m, allowed), m
            if not isinstance(m, Origin):
                assert m.xid in {xid} | subxids
            if isinstance(m, Insert):
                by_xid.setdefault(m.xid, []).append(m)
    assert not any(isinstance(m, (Begin, Commit)) for m in msgs)
    return by_xid
