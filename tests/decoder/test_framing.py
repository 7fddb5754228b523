"""CopyData framing: hand-built frames from the protocol documentation, and a live walsender.

The live test speaks the streaming replication protocol to a real server
(``START_REPLICATION … LOGICAL`` over a ``replication=database`` connection, with
psycopg's libpq wrapper), parses every CopyData with ``read_frame``, decodes the
XLogData payloads with one ``Decoder``, and answers with
``encode_standby_status``. It is also the only way to see a whole streamed
transaction aborted *after* it was streamed: the SQL functions decode after the
fact, when the server already knows the transaction aborted (see test_golden.py).

Server behaviour asserted here:

* Every XLogData has dataStart == walEnd (walsender fills both with the same LSN).
  Relation and Type messages go out with 0/0 there (they are not a position one
  may confirm); a Commit's is the end of the commit record (Commit.end_lsn), and a
  protocol 4 parallel Stream Abort's is its abort_lsn.
* A Standby status update asking for a reply gets a Primary keepalive back, and
  the flush position it reports becomes the slot's confirmed_flush_lsn.
"""

from __future__ import annotations

import select
import struct
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import pq

from applier.decoder.framing import encode_standby_status, now_pg_micros, read_frame
from applier.decoder.messages import (
    Begin,
    Commit,
    Insert,
    Keepalive,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStop,
    TupleData,
    XLogData,
    pg_timestamp,
)
from applier.decoder.pgoutput import DecodeError, Decoder
from applier.lsn import LSN
from tests.decoder.live import BIG, Source, check_streamed, check_transaction, in_transaction, texts

# ---------------------------------------------------------------------------
# Hand-built frames.

W_HEADER = struct.pack(">QQq", 0x16_0000_0010, 0x16_0000_0020, 700_000_000_000_000)


def test_xlogdata_frame() -> None:
    frame = read_frame(b"w" + W_HEADER + b"E")
    assert frame == XLogData(LSN("16/10"), LSN("16/20"), 700_000_000_000_000, b"E")
    assert (frame.start, frame.wal_end) == (LSN("16/10"), LSN("16/20"))  # plain ints on the hot path
    assert type(frame.payload) is bytes
    assert read_frame(b"w" + W_HEADER).payload == b""  # an empty payload is the decoder's business
    assert read_frame(bytearray(b"w" + W_HEADER + b"E")) == frame
    assert read_frame(memoryview(b"w" + W_HEADER + b"E")) == frame
    assert type(read_frame(memoryview(b"w" + W_HEADER + b"E")).payload) is bytes


def test_keepalive_frame() -> None:
    body = struct.pack(">Qq", 0xFFFFFFFF_FFFFFFFF, -1)
    assert read_frame(b"k" + body + b"\x01") == Keepalive(LSN("FFFFFFFF/FFFFFFFF"), -1, True)
    assert read_frame(b"k" + body + b"\x00") == Keepalive(LSN("FFFFFFFF/FFFFFFFF"), -1, False)


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (b"", "CopyData"),
        (b"r" + bytes(33), "CopyData"),  # a standby status update is ours to send, not to read
        (b"x", "CopyData"),
        (b"w", "XLogData"),
        (b"w" + W_HEADER[:-1], "XLogData"),
        (b"k", "Primary keepalive"),
        (b"k" + bytes(16), "Primary keepalive"),
        (b"k" + bytes(18), "Primary keepalive"),
        (b"k" + bytes(16) + b"\x02", "Primary keepalive"),
    ],
)
def test_bad_frames(data: bytes, name: str) -> None:
    with pytest.raises(DecodeError) as excinfo:
        read_frame(data)
    assert excinfo.value.message_type == name
    assert name in str(excinfo.value) and "byte" in str(excinfo.value)


def test_standby_status_update_bytes() -> None:
    data = encode_standby_status(LSN("16/30"), LSN("16/20"), LSN("16/10"), reply=True, now=12345)
    assert data == (b"r" + bytes.fromhex("0000001600000030") + bytes.fromhex("0000001600000020")
                    + bytes.fromhex("0000001600000010") + struct.pack(">q", 12345) + b"\x01")
    assert len(data) == 34
    assert encode_standby_status(0, 0, 0, now=0) == b"r" + bytes(33)


def test_standby_status_update_time_defaults_to_now() -> None:
    before = now_pg_micros()
    data = encode_standby_status(1, 1, 1)
    after = now_pg_micros()
    (sent,) = struct.unpack_from(">q", data, 25)
    assert before <= sent <= after
    assert abs(pg_timestamp(sent) - datetime.now(UTC)) < timedelta(seconds=5)
    assert data[-1] == 0


# ---------------------------------------------------------------------------
# A live walsender.


class Walsender:
    """A replication connection streaming one logical slot, frame by frame."""

    def __init__(self, dsn: str, slot: str, options: dict[str, str]) -> None:
        self.pg = pq.PGconn.connect(f"{dsn} replication=database".encode())
        if self.pg.status != pq.ConnStatus.OK:
            raise RuntimeError(self.pg.error_message.decode(errors="replace"))
        opts = ", ".join(f"{k} '{v}'" for k, v in options.items())
        res = self.pg.exec_(f"START_REPLICATION SLOT {slot} LOGICAL 0/0 ({opts})".encode())
        if res.status != pq.ExecStatus.COPY_BOTH:
            raise RuntimeError(self.pg.error_message.decode(errors="replace"))
        self.decoder = Decoder()
        self.keepalives: list[Keepalive] = []

    def frame(self, deadline: float) -> XLogData | Keepalive:
        while True:
            n, data = self.pg.get_copy_data(1)
            if n > 0:
                return read_frame(bytes(data))
            if n < 0:
                raise RuntimeError(f"replication stream ended: {self.pg.error_message.decode(errors='replace')}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no frame from the walsender in time")
            select.select([self.pg.socket], [], [], remaining)
            self.pg.consume_input()

    def read_until(self, done: Callable[[Any], bool], timeout: float = 30.0) -> list[tuple[XLogData, Any]]:
        """(frame, decoded message) pairs up to and including the first message ``done`` accepts."""
        deadline = time.monotonic() + timeout
        out: list[tuple[XLogData, Any]] = []
        while True:
            frame = self.frame(deadline)
            if isinstance(frame, Keepalive):
                self.keepalives.append(frame)
                continue
            msg = self.decoder.decode(frame.payload)
            out.append((frame, msg))
            if done(msg):
                return out

    def keepalive(self, timeout: float = 30.0) -> Keepalive:
        deadline = time.monotonic() + timeout
        while True:
            frame = self.frame(deadline)
            if isinstance(frame, Keepalive):
                return frame
            self.decoder.decode(frame.payload)

    def send(self, data: bytes) -> None:
        assert self.pg.put_copy_data(data) == 1
        while self.pg.flush() == 1:
            select.select([], [self.pg.socket], [], 5)

    def close(self) -> None:
        self.pg.finish()


def check_frames(pairs: list[tuple[XLogData, Any]]) -> None:
    now = datetime.now(UTC)
    for frame, msg in pairs:
        assert frame.start == frame.wal_end
        assert abs(pg_timestamp(frame.send_time) - now) < timedelta(minutes=5)
        if isinstance(msg, Relation):
            assert frame.start == 0
        if isinstance(msg, Commit):
            assert frame.start == msg.end_lsn


def flush_wal(src: Source) -> None:
    """Make the server flush its WAL (a commit that wrote some), so the walsender can read it."""
    with psycopg.connect(src.db.dsn, autocommit=True) as other:
        other.execute("INSERT INTO unpublished VALUES (1)")


@pytest.mark.parametrize("streaming", ["on", "parallel"])
def test_live_walsender(src: Source, streaming: str) -> None:
    if streaming == "parallel" and src.version < 16:
        pytest.skip("streaming = parallel needs protocol 4 (PostgreSQL 16+)")
    src.q("CREATE TABLE s (id int PRIMARY KEY, v text)")
    src.q("CREATE TABLE unpublished (id int)")
    src.q("CREATE PUBLICATION pub FOR TABLE s")
    slot = src.slot()
    ws = Walsender(src.db.dsn, slot, {"proto_version": str(src.proto), "publication_names": "pub",
                                      "streaming": streaming})
    try:
        # A small transaction: plain Begin … Commit.
        x0 = in_transaction(src, "INSERT INTO s VALUES (0, 'first')")
        pairs = ws.read_until(lambda m: isinstance(m, Commit))
        check_frames(pairs)
        msgs = [m for _, m in pairs]
        assert [type(m).__name__ for m in msgs] == ["Begin", "Relation", "Insert", "Commit"]
        _, commit0 = check_transaction(msgs, x0)
        assert msgs[2] == Insert(None, src.oid("s"), TupleData(b"tt", (b"0", b"first")))

        # A big transaction, streamed while it is open, then rolled back.
        src.conn.execute("BEGIN")
        xid = src.xid()
        src.q(f"INSERT INTO s SELECT g, 'gone' FROM generate_series(1, {BIG}) g")
        flush_wal(src)
        pairs = _read_stream_blocks(ws, 3)  # it streams while still open
        before = LSN(str(src.one("SELECT pg_current_wal_insert_lsn()")))
        src.conn.execute("ROLLBACK")
        after = LSN(str(src.one("SELECT pg_current_wal_insert_lsn()")))
        flush_wal(src)
        pairs += ws.read_until(lambda m: isinstance(m, StreamAbort))
        check_frames(pairs)
        msgs = [m for _, m in pairs]
        by_xid = check_streamed(msgs[:-1], xid, set())
        streamed = [int(texts(m.new)[0]) for m in by_xid[xid]]
        assert streamed == list(range(1, len(streamed) + 1)) and len(streamed) <= BIG
        assert not any(isinstance(m, (Begin, Commit, StreamCommit)) for m in msgs)
        abort_frame, abort = pairs[-1]
        assert abort.xid == abort.subxid == xid
        assert isinstance(msgs[-2], StreamStop)
        if streaming == "parallel":
            # The end of the abort record that ROLLBACK wrote; it is also the frame's position.
            assert abort.abort_lsn is not None and abort.abort_time is not None
            assert before < abort.abort_lsn <= after
            assert abort_frame.start == abort.abort_lsn
            assert abs(pg_timestamp(abort.abort_time) - datetime.now(UTC)) < timedelta(minutes=5)
            assert abort.abort_time >= commit0.commit_time
        else:
            assert abort.abort_lsn is None and abort.abort_time is None

        # Another small transaction after the abort: not streamed, the relation sent again.
        x1 = in_transaction(src, "INSERT INTO s VALUES (1, 'after')")
        pairs = ws.read_until(lambda m: isinstance(m, Commit))
        check_frames(pairs)
        msgs = [m for _, m in pairs]
        _, commit1 = check_transaction(msgs, x1)
        assert msgs[-2] == Insert(None, src.oid("s"), TupleData(b"tt", (b"1", b"after")))

        # Confirm it, asking for a reply: a keepalive comes back and the slot moves.
        ws.send(encode_standby_status(commit1.end_lsn, commit1.end_lsn, commit1.end_lsn, reply=True))
        keepalive = ws.keepalive()
        assert keepalive.wal_end >= commit1.end_lsn
        assert abs(pg_timestamp(keepalive.send_time) - datetime.now(UTC)) < timedelta(minutes=5)
        deadline = time.monotonic() + 10
        while True:
            confirmed = LSN(str(src.one("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
                                        [slot])))
            if confirmed == commit1.end_lsn or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert confirmed == commit1.end_lsn
        assert all(k.wal_end > 0 for k in ws.keepalives + [keepalive])
    finally:
        ws.close()


def _read_stream_blocks(ws: Walsender, n: int, timeout: float = 30.0) -> list[tuple[XLogData, Any]]:
    """Frames up to the ``n``-th Stream Stop."""
    count = 0

    def done(m: Any) -> bool:
        nonlocal count
        count += isinstance(m, StreamStop)
        return count >= n

    return ws.read_until(done, timeout)
