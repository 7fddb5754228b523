"""The SQL-interface source (peek + advance) against real servers (PG 15 and 18).

What a user relies on: peeking shows exactly what the walsender would stream
for the same slot, without consuming it; ``confirm`` moves the slot so a new
source does not see confirmed transactions again; every transaction is handed
out whole and once, even when transactions interleave or a peek is cut into
batches; ``once=True`` ends the stream when nothing is left.
"""

from __future__ import annotations

import time

import psycopg
import pytest

from applier.decoder.messages import AT_RECORD_END, Begin, BeginPrepare, Commit, Insert, Keepalive, Message
from applier.decoder.pgoutput import Decoder
from applier.lsn import LSN
from applier.source.base import SourceError, StreamOptions
from applier.source.sql import SqlSlotSource
from applier.source.walsender import WalSender

PUB = "pub"
OPTS = StreamOptions(publications=(PUB,))


@pytest.fixture
def db(source_db):
    """A fresh database with table ``t`` published by ``pub`` and a slot ``s``."""
    source_db.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text)", source_db.dbname)
    source_db.cluster.execute(f"CREATE PUBLICATION {PUB} FOR TABLE t", source_db.dbname)
    source_db.cluster.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')", source_db.dbname)
    return source_db


def sql(db, query: str, params=None) -> list[tuple]:
    return db.cluster.execute(query, db.dbname, params)


def confirmed_flush(db, slot: str = "s") -> LSN:
    (lsn,) = sql(db, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", [slot])[0]
    return LSN.parse(lsn)


def drain(src, timeout: float = 0.2) -> list:
    """Every frame the source hands out until it has nothing within ``timeout``."""
    out = []
    while (frame := src.read(timeout)) is not None:
        out.append(frame)
    return out


def decode_all(frames) -> list:
    dec = Decoder()
    return [dec.decode(f.payload) for f in frames if not isinstance(f, Keepalive)]


def ids(msgs) -> list[int]:
    return [int(m.new.values[0]) for m in msgs if isinstance(m, Insert)]


def kinds(msgs) -> list[str]:
    return [type(m).__name__ for m in msgs]


def test_peek_shows_what_the_walsender_streams_without_consuming(db):
    before = confirmed_flush(db)
    sql(db, "INSERT INTO t VALUES (1, 'one'), (2, 'two')")
    sql(db, "SELECT pg_logical_emit_message(false, 'note', 'outside')")
    sql(db, "UPDATE t SET v = 'uno' WHERE id = 1")
    with psycopg.connect(db.dsn, autocommit=True) as conn, conn.transaction():
        conn.execute("DELETE FROM t WHERE id = 2")
        conn.execute("SELECT pg_logical_emit_message(true, 'note', 'inside')")

    src = SqlSlotSource(db.dsn, "s", OPTS, once=True)
    peeked = drain(src)
    assert src.exhausted
    src.close()
    assert confirmed_flush(db) == before  # peeking consumed nothing

    with WalSender(db.dsn) as ws:
        ws.start("s", LSN(0), OPTS)
        streamed = []
        commits = 0
        deadline = time.monotonic() + 15
        while commits < 3 and time.monotonic() < deadline:
            frame = ws.read(1.0)
            if frame is None or isinstance(frame, Keepalive):
                continue
            streamed.append(frame)
            commits += frame.payload[:1] == b"C"

    assert [f.payload for f in peeked] == [f.payload for f in streamed]
    msgs = decode_all(peeked)
    assert kinds(msgs) == ["Begin", "Relation", "Insert", "Insert", "Commit",
                           "Message",
                           "Begin", "Update", "Commit",
                           "Begin", "Delete", "Message", "Commit"]
    notes = [(m.transactional, m.content) for m in msgs if isinstance(m, Message)]
    assert notes == [(False, b"outside"), (True, b"inside")]
    # Commit frames sit at the transaction's end, as over the walsender.
    peeked_commits = [(f, m) for f, m in zip(peeked, msgs, strict=True) if isinstance(m, Commit)]
    streamed_commits = [f for f in streamed if f.payload[:1] == b"C"]
    assert [f.start for f, _ in peeked_commits] == [m.end_lsn for _, m in peeked_commits]
    assert [f.start for f, _ in peeked_commits] == [f.start for f in streamed_commits]


def test_confirmed_transactions_are_not_seen_again(db):
    sql(db, "INSERT INTO t VALUES (1, 'first')")
    sql(db, "INSERT INTO t VALUES (2, 'second')")
    src = SqlSlotSource(db.dsn, "s", OPTS, once=True)
    msgs = decode_all(drain(src))
    assert ids(msgs) == [1, 2]
    first_commit = next(m for m in msgs if isinstance(m, Commit))
    src.confirm(first_commit.end_lsn)
    src.close()
    assert confirmed_flush(db) == first_commit.end_lsn

    again = SqlSlotSource(db.dsn, "s", OPTS, once=True)
    msgs = decode_all(drain(again))
    again.close()
    assert kinds(msgs)[0] == "Begin"
    assert ids(msgs) == [2]


def test_confirm_never_moves_the_slot_backwards(db):
    sql(db, "INSERT INTO t VALUES (1, 'x')")
    src = SqlSlotSource(db.dsn, "s", OPTS, once=True)
    commit = next(m for m in decode_all(drain(src)) if isinstance(m, Commit))
    src.confirm(commit.end_lsn)
    src.confirm(LSN(commit.end_lsn - 8))
    src.close()
    assert confirmed_flush(db) == commit.end_lsn


def test_once_returns_none_and_is_exhausted_when_nothing_is_left(db):
    src = SqlSlotSource(db.dsn, "s", OPTS, once=True)
    t0 = time.monotonic()
    assert src.read(5.0) is None
    assert src.exhausted
    assert src.read(5.0) is None
    assert time.monotonic() - t0 < 2.0  # it did not wait for the timeout
    src.close()


def test_following_source_waits_then_hands_out_new_transactions(db):
    src = SqlSlotSource(db.dsn, "s", OPTS, poll_interval=0.1)
    assert src.read(0.3) is None
    assert not src.exhausted
    sql(db, "INSERT INTO t VALUES (1, 'x')")
    assert ids(decode_all(drain(src))) == [1]
    sql(db, "INSERT INTO t VALUES (2, 'y')")
    assert ids(decode_all(drain(src))) == [2]  # 1 is not handed out twice
    src.close()


@pytest.mark.parametrize("confirm_between", [False, True], ids=["unconfirmed", "confirmed"])
def test_interleaved_transaction_is_handed_out_whole(db, confirm_between):
    # A starts first, B commits first: A's first rows sit below B's commit LSN.
    src = SqlSlotSource(db.dsn, "s", OPTS, poll_interval=0.1)
    with psycopg.connect(db.dsn) as a:
        a.execute("INSERT INTO t VALUES (1, 'a1')")
        sql(db, "INSERT INTO t VALUES (2, 'b')")
        b_msgs = decode_all(drain(src))
        assert ids(b_msgs) == [2]
        if confirm_between:
            src.confirm(b_msgs[-1].end_lsn)
        a.execute("INSERT INTO t VALUES (3, 'a3')")
        a.commit()
    a_msgs = decode_all(drain(src))
    src.close()
    assert [k for k in kinds(a_msgs) if k != "Relation"] == ["Begin", "Insert", "Insert", "Commit"]
    assert ids(a_msgs) == [1, 3]
    assert isinstance(a_msgs[0], Begin) and a_msgs[0].final_lsn == a_msgs[-1].commit_lsn


def test_unconfirmed_slot_larger_than_one_batch_is_read_to_the_end(db):
    for i in range(1, 4):
        sql(db, "INSERT INTO t SELECT g, 'v' FROM generate_series(%s::int, %s::int) g", [i * 10, i * 10 + 4])
    src = SqlSlotSource(db.dsn, "s", OPTS, batch_changes=3, once=True)
    msgs = decode_all(drain(src))
    src.close()
    assert kinds(msgs).count("Commit") == 3
    assert ids(msgs) == [*range(10, 15), *range(20, 25), *range(30, 35)]


def test_unknown_slot_is_a_source_error_naming_it(db):
    src = SqlSlotSource(db.dsn, "no_such_slot", OPTS, once=True)
    with pytest.raises(SourceError, match="no_such_slot") as exc:
        src.read(1.0)
    assert "\n" not in str(exc.value)
    src.close()


def test_a_query_on_a_lost_connection_is_a_source_error(db):
    """The runner's start-up reads (the slot's state, binary mode's money format) go through ``query``: rows as the
    server gives them, and a failure is a SourceError in one line (retried as the walsender's would be), not the
    driver's error."""
    src = SqlSlotSource(db.dsn, "s", OPTS, once=True)
    try:
        assert src.query("SELECT slot_name, plugin FROM pg_replication_slots WHERE slot_name = %s", ["s"]) == [
            ("s", "pgoutput")]
        sql(db, "SELECT pg_terminate_backend(%s)", [src.conn.info.backend_pid])
        with pytest.raises(SourceError, match="cannot query the source") as exc:
            src.query("SELECT 1")
        assert "\n" not in str(exc.value)
    finally:
        src.close()


def test_rows_at_the_end_of_their_record_are_the_decoders_at_record_end_kinds(db):
    # the rule the SQL source sorts peeked rows by (decoder.messages.AT_RECORD_END), checked against the server:
    # a commit-like row's lsn is its message's end LSN, any other row's is the start of a record
    sql(db, "SELECT pg_create_logical_replication_slot('s2', 'pgoutput', false, true)")  # two_phase
    sql(db, "INSERT INTO t VALUES (1, 'one')")
    sql(db, "SELECT pg_logical_emit_message(false, 'note', 'outside')")
    for key, gid, end in ((3, "g1", "COMMIT PREPARED 'g1'"), (4, "g2", "ROLLBACK PREPARED 'g2'")):
        with psycopg.connect(db.cluster.dsn(db.dbname), autocommit=True) as conn:
            conn.execute(f"BEGIN; INSERT INTO t VALUES ({key}, 'p'); PREPARE TRANSACTION '{gid}'")
        sql(db, end)
    rows = sql(db, "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes('s2', NULL, NULL, "
                   "'proto_version', '3', 'publication_names', %s, 'two_phase', 'true', 'messages', 'true')", [PUB])
    dec = Decoder()
    seen = set()
    for lsn_text, data in rows:
        lsn, msg = LSN.parse(lsn_text), dec.decode(bytes(data))
        seen.add(type(msg).__name__)
        end = getattr(msg, "end_lsn", None) or getattr(msg, "rollback_end_lsn", None)
        if data[0] in AT_RECORD_END:
            assert lsn == end, msg
            continue
        assert end is None or lsn < end, msg  # the start of a record
        if isinstance(msg, Begin):  # its first change's record
            assert lsn < msg.final_lsn, msg
        elif isinstance(msg, BeginPrepare):  # likewise
            assert lsn < msg.prepare_lsn, msg
        elif isinstance(msg, Message):
            assert lsn == msg.lsn, msg
    assert {"Commit", "Prepare", "CommitPrepared", "RollbackPrepared", "Message"} <= seen, seen
