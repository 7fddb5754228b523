"""The decoder against real pgoutput bytes from PostgreSQL 15 and 18, plus hand-built spec bytes.

The live capture is the golden: each test makes a publication and a logical slot
in a fresh database, runs SQL whose effect it knows (xids from
``txid_current()`` inside the transaction, OIDs from ``::regclass``, typmods and
replica identities from the catalogs), reads the slot with
``pg_logical_slot_peek_binary_changes`` and feeds every row, in order, through
one ``Decoder``. Every decoded field is checked against what the test knows.

Server behaviour worth knowing (all asserted below):

* Non-key columns of a 'K' (key) tuple are sent as NULLs ('n'), not left out.
* Under REPLICA IDENTITY FULL every column of the Relation message has the key flag.
* Relation is sent again after anything that invalidates pgoutput's cache: every
  TRUNCATE, and, in a streamed transaction, every Stream Abort (the re-sent one
  carries the xid of the subtransaction whose change needs it).
* With an origin set up, Origin follows Begin, and the transaction's commit time
  is the origin timestamp given to ``pg_replication_origin_xact_setup``. In a
  streamed transaction the Origin comes right after the first Stream Start only,
  with commit_lsn 0/0.
* Message.lsn is exactly what ``pg_logical_emit_message`` returned. A
  non-transactional message is not flushed by itself; the SQL functions (which
  read flushed WAL only) see it once a later commit flushes.
* A Stream Abort (for a rolled-back savepoint or a whole transaction) is sent
  outside Stream Start … Stream Stop. At protocol 4 it carries abort_lsn and
  abort_time only when ``streaming`` is ``parallel``; with ``streaming 'on'`` the
  server sends the short (protocol 2/3) form even at proto_version 4 (pgoutput:
  ``write_abort_info = (streaming == LOGICALREP_STREAM_PARALLEL)``). abort_lsn is
  the end of the abort WAL record (ROLLBACK TO SAVEPOINT's for a subtransaction).
* ROLLBACK TO SAVEPOINT leaves the savepoint open as a *new* subtransaction with
  its own xid; what follows it carries that xid until the savepoint is released.
* A streamed transaction that is already aborted when decoding reaches it (the SQL
  functions decode after the fact) differs by version: PostgreSQL 15 sends an empty
  Stream Start … Stream Stop and a top-level Stream Abort, PostgreSQL 18 nothing.
"""

from __future__ import annotations

import struct
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from applier.decoder.messages import (
    BINARY,
    KIND_OF,
    NULL,
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
    decided_at,
    decision_position,
    pg_timestamp,
)
from applier.decoder.pgoutput import DecodeError, Decoder, decode_message
from applier.decoder.render import render_message
from applier.lsn import LSN
from tests.decoder.live import (
    BIG,
    Source,
    catalog_columns,
    check_streamed,
    check_transaction,
    in_transaction,
    kinds_of,
    texts,
)

INT4, TEXT_OID, VARCHAR, NUMERIC, BOOL, FLOAT8, INT8 = 23, 25, 1043, 1700, 16, 701, 20


# ---------------------------------------------------------------------------
# Begin, Type, Relation, Insert, Update, Delete, Commit.


def test_dml_relation_type_and_identities(src: Source) -> None:
    src.q("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    src.q("CREATE TABLE t (id int PRIMARY KEY, name text, note varchar(20), m mood, n numeric(10,2))")
    src.q("CREATE TABLE tfull (id int, v text)")
    src.q("ALTER TABLE tfull REPLICA IDENTITY FULL")
    src.q("CREATE TABLE tidx (a int NOT NULL, b int NOT NULL, c text)")
    src.q("CREATE UNIQUE INDEX tidx_ab ON tidx (a, b)")
    src.q("ALTER TABLE tidx REPLICA IDENTITY USING INDEX tidx_ab")
    src.q("CREATE TABLE tnothing (a int)")
    src.q("ALTER TABLE tnothing REPLICA IDENTITY NOTHING")
    src.q("CREATE TABLE tcols (id int PRIMARY KEY, keep text, secret text)")
    src.q("CREATE TABLE unpublished (id int PRIMARY KEY)")
    src.q("CREATE PUBLICATION pub FOR TABLE t, tfull, tidx, tnothing, tcols (id, keep)")
    slot = src.slot()

    xid = in_transaction(
        src,
        "INSERT INTO t VALUES (1, 'one', NULL, 'happy', 1.5)",
        "INSERT INTO t VALUES (2, 'two', 'x', NULL, NULL)",
        "INSERT INTO unpublished VALUES (1)",
        "UPDATE t SET name = 'uno' WHERE id = 1",
        "UPDATE t SET id = 20 WHERE id = 2",
        "DELETE FROM t WHERE id = 20",
        "INSERT INTO tfull VALUES (1, 'a')",
        "UPDATE tfull SET v = 'b'",
        "DELETE FROM tfull",
        "INSERT INTO tidx VALUES (1, 2, 'c')",
        "UPDATE tidx SET c = 'd'",
        "UPDATE tidx SET b = 3",
        "DELETE FROM tidx",
        "INSERT INTO tnothing VALUES (7)",
        "INSERT INTO tcols VALUES (1, 'k', 's')",
    )
    msgs = src.peek(slot)
    assert kinds_of(msgs) == [
        "Begin",
        "Type", "Relation", "Insert", "Insert", "Update", "Update", "Delete",
        "Relation", "Insert", "Update", "Delete",
        "Relation", "Insert", "Update", "Update", "Delete",
        "Relation", "Insert",
        "Relation", "Insert",
        "Commit",
    ]
    check_transaction(msgs, xid)
    (_, typ, rel_t, ins1, ins2, upd_plain, upd_key, del_key,
     rel_full, ins_full, upd_full, del_full,
     rel_idx, ins_idx, upd_idx_plain, upd_idx_key, del_idx,
     rel_nothing, ins_nothing, rel_cols, ins_cols, _) = msgs

    # Type: sent for the user-defined enum, before the relation that uses it.
    mood = int(src.one("SELECT 'mood'::regtype::oid"))
    assert typ == Type(None, mood, "public", "mood")

    t = src.oid("t")
    assert rel_t == Relation(None, t, "public", "t", "d", (
        Column(1, "id", INT4, -1),
        Column(0, "name", TEXT_OID, -1),
        Column(0, "note", VARCHAR, 20 + 4),
        Column(0, "m", mood, -1),
        Column(0, "n", NUMERIC, ((10 << 16) | 2) + 4),
    ))
    assert [(c.name, c.type_oid, c.type_modifier) for c in rel_t.columns] == catalog_columns(src, "t")
    assert [c.is_key for c in rel_t.columns] == [True, False, False, False, False]

    assert ins1 == Insert(None, t, TupleData(b"ttntt", (b"1", b"one", None, b"happy", b"1.50")))
    assert texts(ins2.new) == ["2", "two", "x", None, None]
    # Key unchanged: no old part.
    assert upd_plain == Update(None, t, None, None, TupleData(b"ttntt", (b"1", b"uno", None, b"happy", b"1.50")))
    # Key changed: 'K' with the old key; the other columns come as NULLs.
    assert upd_key.old_kind == "K" and upd_key.relation_oid == t
    assert texts(upd_key.old) == ["2", None, None, None, None]
    assert texts(upd_key.new) == ["20", "two", "x", None, None]
    assert del_key == Delete(None, t, "K", TupleData(b"tnnnn", (b"20", None, None, None, None)))

    # REPLICA IDENTITY FULL: every column is flagged as key; old rows come whole, as 'O'.
    tfull = src.oid("tfull")
    assert rel_full == Relation(None, tfull, "public", "tfull", "f",
                                (Column(1, "id", INT4, -1), Column(1, "v", TEXT_OID, -1)))
    assert ins_full == Insert(None, tfull, TupleData(b"tt", (b"1", b"a")))
    assert upd_full == Update(None, tfull, "O", TupleData(b"tt", (b"1", b"a")), TupleData(b"tt", (b"1", b"b")))
    assert del_full == Delete(None, tfull, "O", TupleData(b"tt", (b"1", b"b")))

    # REPLICA IDENTITY USING INDEX: the index columns are the key.
    tidx = src.oid("tidx")
    assert rel_idx == Relation(None, tidx, "public", "tidx", "i",
                               (Column(1, "a", INT4, -1), Column(1, "b", INT4, -1), Column(0, "c", TEXT_OID, -1)))
    assert texts(ins_idx.new) == ["1", "2", "c"]
    assert upd_idx_plain.old_kind is None and texts(upd_idx_plain.new) == ["1", "2", "d"]
    assert upd_idx_key.old_kind == "K" and texts(upd_idx_key.old) == ["1", "2", None]
    assert texts(upd_idx_key.new) == ["1", "3", "d"]
    assert del_idx.old_kind == "K" and texts(del_idx.old) == ["1", "3", None]

    # REPLICA IDENTITY NOTHING: no key columns.
    tnothing = src.oid("tnothing")
    assert rel_nothing == Relation(None, tnothing, "public", "tnothing", "n", (Column(0, "a", INT4, -1),))
    assert ins_nothing == Insert(None, tnothing, TupleData(b"t", (b"7",)))

    # A publication column list: only the listed columns, in the Relation and in the tuples.
    tcols = src.oid("tcols")
    assert rel_cols == Relation(None, tcols, "public", "tcols", "d",
                                (Column(1, "id", INT4, -1), Column(0, "keep", TEXT_OID, -1)))
    assert ins_cols == Insert(None, tcols, TupleData(b"tt", (b"1", b"k")))

    # Relation identity chars are the catalog's relreplident.
    for rel in (rel_t, rel_full, rel_idx, rel_nothing, rel_cols):
        assert rel.replica_identity == src.one("SELECT relreplident::text FROM pg_class WHERE oid = %s", [rel.oid])


def test_transactions_in_commit_order_and_nulls(src: Source) -> None:
    src.q("CREATE TABLE n (id int PRIMARY KEY, a text, b int, c bool)")
    src.q("CREATE PUBLICATION pub FOR TABLE n")
    slot = src.slot()
    x1 = in_transaction(src, "INSERT INTO n VALUES (1, NULL, NULL, NULL)")
    x2 = in_transaction(src, "INSERT INTO n VALUES (2, '', 0, false)", "UPDATE n SET a = NULL, c = true WHERE id = 2")
    x3 = in_transaction(src, "UPDATE n SET a = 'x' WHERE id = 1", "DELETE FROM n WHERE id = 2")
    msgs = src.peek(slot)
    assert kinds_of(msgs) == ["Begin", "Relation", "Insert", "Commit",
                              "Begin", "Insert", "Update", "Commit",
                              "Begin", "Update", "Delete", "Commit"]
    _, c1 = check_transaction(msgs[0:4], x1)
    _, c2 = check_transaction(msgs[4:8], x2)
    _, c3 = check_transaction(msgs[8:12], x3)
    assert x1 < x2 < x3
    assert c1.end_lsn <= c2.commit_lsn and c2.end_lsn <= c3.commit_lsn
    assert c1.commit_time <= c2.commit_time <= c3.commit_time
    assert msgs[2].new == TupleData(b"tnnn", (b"1", None, None, None))
    assert texts(msgs[5].new) == ["2", "", "0", "f"]  # an empty string is not NULL
    assert texts(msgs[6].new) == ["2", None, "0", "t"]
    assert texts(msgs[9].new) == ["1", "x", None, None]
    assert msgs[10] == Delete(None, src.oid("n"), "K", TupleData(b"tnnn", (b"2", None, None, None)))
    # The slot is still where it was: what is in it has not moved beyond the last commit.
    assert LSN(str(src.one("SELECT pg_current_wal_lsn()"))) >= c3.end_lsn


def test_unchanged_toast(src: Source) -> None:
    src.q("CREATE TABLE big (id int PRIMARY KEY, doc text, n int)")
    src.q("ALTER TABLE big ALTER COLUMN doc SET STORAGE EXTERNAL")  # out of line, uncompressed
    src.q("CREATE PUBLICATION pub FOR TABLE big")
    slot = src.slot()
    doc = uuid.uuid4().hex * 200  # 6400 bytes: TOASTed
    with src.conn.transaction():
        x1 = src.xid()
        src.q("INSERT INTO big VALUES (1, %s, 1)", [doc])
    x2 = in_transaction(src, "UPDATE big SET n = 2 WHERE id = 1")
    x3 = in_transaction(src, "UPDATE big SET doc = doc || 'x', n = 3 WHERE id = 1")
    assert int(src.one("SELECT count(*) FROM pg_class c JOIN pg_class t ON t.reltoastrelid = c.oid"
                       " WHERE t.relname = 'big'")) == 1
    msgs = src.peek(slot)
    assert kinds_of(msgs) == ["Begin", "Relation", "Insert", "Commit", "Begin", "Update", "Commit",
                              "Begin", "Update", "Commit"]
    check_transaction(msgs[0:4], x1)
    check_transaction(msgs[4:7], x2)
    check_transaction(msgs[7:10], x3)
    assert msgs[2].new == TupleData(b"ttt", (b"1", doc.encode(), b"1"))
    # The TOASTed column did not change: 'u', no value.
    assert msgs[5] == Update(None, src.oid("big"), None, None, TupleData(b"tut", (b"1", None, b"2")))
    assert msgs[8].new == TupleData(b"ttt", (b"1", (doc + "x").encode(), b"3"))


def test_truncate_options(src: Source) -> None:
    src.q("CREATE TABLE parent (id serial PRIMARY KEY)")
    src.q("CREATE TABLE child (id serial PRIMARY KEY, parent_id int REFERENCES parent)")
    src.q("CREATE PUBLICATION pub FOR TABLE parent, child")
    slot = src.slot()
    parent, child = src.oid("parent"), src.oid("child")
    xids = [
        in_transaction(src, "TRUNCATE parent RESTART IDENTITY CASCADE"),
        in_transaction(src, "TRUNCATE parent CASCADE"),
        in_transaction(src, "TRUNCATE child RESTART IDENTITY"),
        in_transaction(src, "TRUNCATE child"),
    ]
    everything = src.peek(slot)
    # A TRUNCATE invalidates the relation cache, so the server sends Relation again before each one.
    relations = [m for m in everything if isinstance(m, Relation)]
    assert {r.oid for r in relations} == {parent, child}
    assert kinds_of(everything[:4]) == ["Begin", "Relation", "Relation", "Truncate"]
    msgs = [m for m in everything if not isinstance(m, Relation)]
    assert kinds_of(msgs) == ["Begin", "Truncate", "Commit"] * 4
    for start, xid in zip((0, 3, 6, 9), xids, strict=True):
        check_transaction(msgs[start:start + 3], xid)
    truncates = [m for m in msgs if isinstance(m, Truncate)]
    assert [t.options for t in truncates] == [3, 1, 2, 0]
    assert [(t.cascade, t.restart_identity) for t in truncates] == [(True, True), (True, False), (False, True),
                                                                    (False, False)]
    assert sorted(truncates[0].relation_oids) == sorted([parent, child])
    assert sorted(truncates[1].relation_oids) == sorted([parent, child])
    assert truncates[2].relation_oids == (child,) == truncates[3].relation_oids
    assert all(t.xid is None for t in truncates)


def test_logical_decoding_messages(src: Source) -> None:
    src.q("CREATE TABLE m (id int PRIMARY KEY)")
    src.q("CREATE PUBLICATION pub FOR TABLE m")
    slot = src.slot()
    with src.conn.transaction():
        xid = src.xid()
        src.q("INSERT INTO m VALUES (1)")
        lsn1 = LSN(str(src.one("SELECT pg_logical_emit_message(true, 'prefix', 'content')")))
        lsn2 = LSN(str(src.one(r"SELECT pg_logical_emit_message(true, 'bin', '\x00ff'::bytea)")))
    lsn3 = LSN(str(src.one("SELECT pg_logical_emit_message(false, 'nontx', 'now')")))
    # A non-transactional message has no commit to flush its WAL, and the SQL interface only
    # reads flushed WAL: a later transaction's commit flushes it.
    x2 = in_transaction(src, "INSERT INTO m VALUES (2)")
    msgs = src.peek(slot, messages=True)
    assert kinds_of(msgs) == ["Begin", "Relation", "Insert", "Message", "Message", "Commit", "Message",
                              "Begin", "Insert", "Commit"]
    _, commit = check_transaction(msgs[:6], xid)
    check_transaction(msgs[7:], x2)
    assert msgs[3] == Message(None, True, lsn1, "prefix", b"content")
    assert msgs[4] == Message(None, True, lsn2, "bin", b"\x00\xff")
    # Non-transactional: on its own, no Begin/Commit around it.
    assert msgs[6] == Message(None, False, lsn3, "nontx", b"now")
    assert lsn1 < lsn2 <= commit.commit_lsn < lsn3
    # Without messages=true the server sends none.
    assert "Message" not in kinds_of(src.peek(slot))


def test_origin(src: Source) -> None:
    src.q("CREATE TABLE o (id int PRIMARY KEY)")
    src.q("CREATE PUBLICATION pub FOR TABLE o")
    slot = src.slot()
    origin = f"node_a_{src.db.dbname}"
    src.origins.append(origin)
    src.q("SELECT pg_replication_origin_create(%s)", [origin])
    src.q("SELECT pg_replication_origin_session_setup(%s)", [origin])
    with src.conn.transaction():
        xid = src.xid()
        origin_time = src.one("SELECT now() - interval '1 hour'")
        src.q("SELECT pg_replication_origin_xact_setup('0/1234', %s)", [origin_time])
        src.q("INSERT INTO o VALUES (1)")
    src.q("SELECT pg_replication_origin_session_reset()")
    x2 = in_transaction(src, "INSERT INTO o VALUES (2)")
    msgs = src.peek(slot)
    assert kinds_of(msgs) == ["Begin", "Origin", "Relation", "Insert", "Commit", "Begin", "Insert", "Commit"]
    begin, origin_msg, commit = msgs[0], msgs[1], msgs[4]
    assert begin.xid == xid and begin.final_lsn == commit.commit_lsn
    assert origin_msg == Origin(LSN("0/1234"), origin)
    # The replicated commit keeps the origin's commit time, not the local one.
    assert pg_timestamp(commit.commit_time) == origin_time
    assert begin.commit_time == commit.commit_time
    check_transaction(msgs[5:], x2)  # no origin: no Origin message


def test_binary_mode(src: Source) -> None:
    src.q("CREATE TABLE b (id int4 PRIMARY KEY, big int8, f float8, s text, ok bool, nothing int4)")
    src.q("CREATE PUBLICATION pub FOR TABLE b")
    slot = src.slot()
    xid = in_transaction(src, "INSERT INTO b VALUES (42, -5000000000, 1.5, 'héllo', true, NULL)",
                         "UPDATE b SET id = 43")
    msgs = src.peek(slot, binary=True)
    assert kinds_of(msgs) == ["Begin", "Relation", "Insert", "Update", "Commit"]
    check_transaction(msgs, xid)
    assert [c.type_oid for c in msgs[1].columns] == [INT4, INT8, FLOAT8, TEXT_OID, BOOL, INT4]
    row = (struct.pack(">i", 42), struct.pack(">q", -5000000000), struct.pack(">d", 1.5), "héllo".encode(),
           b"\x01", None)
    assert msgs[2].new == TupleData(bytes([BINARY] * 5 + [NULL]), row)
    assert msgs[3].old_kind == "K"
    assert msgs[3].old == TupleData(bytes([BINARY] + [NULL] * 5), (struct.pack(">i", 42),) + (None,) * 5)
    assert msgs[3].new == TupleData(bytes([BINARY] * 5 + [NULL]), (struct.pack(">i", 43),) + row[1:])
    # And the same changes in text mode.
    text = src.peek(slot)
    assert text[2].new == TupleData(b"tttttn", (b"42", b"-5000000000", b"1.5", "héllo".encode(), b"t", None))


# ---------------------------------------------------------------------------
# Streaming (protocol 2+).


def big_streamed_transaction(src: Source) -> tuple[int, int, int, tuple[LSN, LSN]]:
    """Top xid, a rolled-back savepoint's xid, a released savepoint's xid, WAL around the rollback."""
    with src.conn.transaction():
        xid = src.xid()
        src.q("INSERT INTO s SELECT g, 'top' FROM generate_series(1, 10) g")
        src.q("SAVEPOINT a")
        src.q(f"INSERT INTO s SELECT g, 'rolled back' FROM generate_series(1001, {1000 + BIG}) g")
        sub_a = int(src.one("SELECT xmin::text::bigint FROM s WHERE id = 1001"))
        before = LSN(str(src.one("SELECT pg_current_wal_insert_lsn()")))
        src.q("ROLLBACK TO SAVEPOINT a")
        after = LSN(str(src.one("SELECT pg_current_wal_insert_lsn()")))
        # ROLLBACK TO keeps savepoint a open as a new subtransaction; leave it so that what follows
        # is at the top level again.
        src.q("RELEASE SAVEPOINT a")
        src.q("SAVEPOINT b")
        src.q(f"INSERT INTO s SELECT g, 'kept' FROM generate_series(100001, {100000 + BIG}) g")
        sub_b = int(src.one("SELECT xmin::text::bigint FROM s WHERE id = 100001"))
        src.q("RELEASE SAVEPOINT b")
        src.q("INSERT INTO s VALUES (11, 'last')")
    assert len({xid, sub_a, sub_b}) == 3
    return xid, sub_a, sub_b, (before, after)


@pytest.mark.parametrize("streaming", ["on", "parallel"])
def test_streamed_transaction_with_savepoints(src: Source, streaming: str) -> None:
    if streaming == "parallel" and src.version < 16:
        pytest.skip("streaming = parallel needs protocol 4 (PostgreSQL 16+)")
    src.q("CREATE TABLE s (id int PRIMARY KEY, v text)")
    src.q("CREATE PUBLICATION pub FOR TABLE s")
    slot = src.slot()
    xid, sub_a, sub_b, (before_rollback, after_rollback) = big_streamed_transaction(src)
    msgs = src.peek(slot, streaming=streaming)

    by_xid = check_streamed(msgs, xid, {sub_a, sub_b})
    s = src.oid("s")
    relations = [m for m in msgs if isinstance(m, Relation)]
    assert all(r.oid == s and r.name == "s" for r in relations)
    # Sent first thing in the first block, with the top xid (the first change's) ...
    assert msgs[1] == relations[0] and relations[0].xid == xid
    # ... and again after the Stream Abort (pgoutput forgets what it sent to a streamed transaction
    # on any Stream Abort), now with the xid of the subtransaction whose change needs it.
    assert len(relations) == 2
    after_abort = msgs[msgs.index(relations[1]) + 1]
    assert isinstance(after_abort, Insert) and relations[1].xid == after_abort.xid
    # Changes carry the xid of the subtransaction that made them.
    assert [texts(m.new)[0] for m in by_xid[xid]][:10] == [str(i) for i in range(1, 11)]
    assert {texts(m.new)[1] for m in by_xid[sub_a]} == {"rolled back"}
    assert {texts(m.new)[1] for m in by_xid[sub_b]} == {"kept"}
    assert len(by_xid[sub_a]) <= BIG and len(by_xid[sub_b]) <= BIG

    aborts = [m for m in msgs if isinstance(m, StreamAbort)]
    commits = [m for m in msgs if isinstance(m, StreamCommit)]
    assert len(aborts) == 1 and len(commits) == 1
    abort, commit = aborts[0], commits[0]
    assert (abort.xid, abort.subxid) == (xid, sub_a)
    assert msgs[-1] == commit and commit.xid == xid
    assert commit.end_lsn > commit.commit_lsn > 0 and commit.flags == 0
    assert abs(pg_timestamp(commit.commit_time) - datetime.now(UTC)) < timedelta(minutes=5)
    # The abort comes between stream blocks, after the rolled-back rows were streamed.
    i = msgs.index(abort)
    assert isinstance(msgs[i - 1], StreamStop) and isinstance(msgs[i + 1], (StreamStart, StreamCommit))
    assert msgs.index(by_xid[sub_a][0]) < i
    if streaming == "parallel":
        assert abort.abort_lsn is not None and abort.abort_time is not None
        # The end of the subtransaction's abort record, which ROLLBACK TO SAVEPOINT wrote.
        assert before_rollback < abort.abort_lsn <= after_rollback < commit.commit_lsn
        assert abs(pg_timestamp(abort.abort_time) - datetime.now(UTC)) < timedelta(minutes=5)
        assert abort.abort_time <= commit.commit_time
    else:
        # streaming 'on': the short form, even at protocol 4.
        assert abort.abort_lsn is None and abort.abort_time is None

    # Applying the stream as a subscriber would gives the table's content.
    # (Stream Commit is preceded by a last block with what was not streamed yet, so all is there.)
    assert len(by_xid[xid]) == 11 and len(by_xid[sub_b]) == BIG
    applied = {int(texts(m.new)[0]) for x, ins in by_xid.items() if x != sub_a for m in ins}
    assert applied == {int(r[0]) for r in src.q("SELECT id FROM s")}


def test_streamed_transaction_every_kind_carries_the_xid(src: Source) -> None:
    """Type, Relation, Insert, Message, Truncate, Update and Delete inside stream blocks; Origin too."""
    src.q("CREATE TYPE mood AS ENUM ('sad', 'ok')")
    src.q("CREATE TABLE s (id int PRIMARY KEY, v text, m mood DEFAULT 'ok')")
    src.q("CREATE TABLE t2 (id int)")
    src.q("CREATE PUBLICATION pub FOR TABLE s, t2")
    slot = src.slot()
    origin = f"node_s_{src.db.dbname}"
    src.origins.append(origin)
    src.q("SELECT pg_replication_origin_create(%s)", [origin])
    src.q("SELECT pg_replication_origin_session_setup(%s)", [origin])
    with src.conn.transaction():
        xid = src.xid()
        src.q("SELECT pg_replication_origin_xact_setup('0/1234', now())")
        src.q(f"INSERT INTO s SELECT g, 'x' FROM generate_series(1, {BIG}) g")
        lsn = LSN(str(src.one("SELECT pg_logical_emit_message(true, 'p', 'c')")))
        src.q("TRUNCATE t2")
        src.q("UPDATE s SET v = 'y' WHERE id = 1")
        src.q("DELETE FROM s WHERE id = 2")
    src.q("SELECT pg_replication_origin_session_reset()")
    msgs = src.peek(slot, streaming="on", messages=True)
    s, t2, mood = src.oid("s"), src.oid("t2"), int(src.one("SELECT 'mood'::regtype::oid"))

    # The first block starts with the origin (no commit LSN yet: 0/0), then the schema.
    assert msgs[:4] == [
        StreamStart(xid, True),
        Origin(LSN(0), origin),
        Type(xid, mood, "public", "mood"),
        Relation(xid, s, "public", "s", "d",
                 (Column(1, "id", INT4, -1), Column(0, "v", TEXT_OID, -1), Column(0, "m", mood, -1))),
    ]
    assert sum(isinstance(m, Origin) for m in msgs) == 1  # later blocks do not repeat it
    inserts = [m for m in msgs if isinstance(m, Insert)]
    assert len(inserts) == BIG and all(m.xid == xid for m in inserts)
    assert inserts[0] == Insert(xid, s, TupleData(b"ttt", (b"1", b"x", b"ok")))
    assert msgs[-7:] == [
        Message(xid, True, lsn, "p", b"c"),
        Relation(xid, t2, "public", "t2", "d", (Column(0, "id", INT4, -1),)),
        Truncate(xid, 0, (t2,)),
        Update(xid, s, None, None, TupleData(b"ttt", (b"1", b"y", b"ok"))),
        Delete(xid, s, "K", TupleData(b"tnn", (b"2", None, None))),
        StreamStop(),
        msgs[-1],
    ]
    commit = msgs[-1]
    assert isinstance(commit, StreamCommit) and commit.xid == xid
    assert commit.commit_lsn > lsn
    check_streamed(msgs[:-1], xid, set(), allowed=(Origin, Type, Relation, Insert, Message, Truncate, Update, Delete))


@pytest.mark.parametrize("streaming", ["on", "parallel"])
def test_streamed_transaction_aborted_whole(src: Source, streaming: str) -> None:
    if streaming == "parallel" and src.version < 16:
        pytest.skip("streaming = parallel needs protocol 4 (PostgreSQL 16+)")
    src.q("CREATE TABLE s (id int PRIMARY KEY, v text)")
    src.q("CREATE TABLE unpublished (id int)")
    src.q("CREATE PUBLICATION pub FOR TABLE s")
    slot = src.slot()
    src.conn.execute("BEGIN")
    xid = src.xid()
    src.q(f"INSERT INTO s SELECT g, 'gone' FROM generate_series(1, {BIG}) g")
    with psycopg.connect(src.db.dsn, autocommit=True) as other:
        # The SQL interface reads flushed WAL only. A commit that wrote WAL flushes everything
        # before it, the open transaction's too (one that only took an xid commits asynchronously).
        other.execute("INSERT INTO unpublished VALUES (1)")
        # While it is open, the big transaction streams (it cannot be in the output otherwise).
        live = src.peek(slot, streaming=streaming, conn=other)
    by_xid = check_streamed(live, xid, set())
    assert set(by_xid) == {xid} and len(by_xid[xid]) <= BIG
    assert texts(by_xid[xid][0].new) == ["1", "gone"]
    assert not any(isinstance(m, (StreamAbort, StreamCommit)) for m in live)

    src.conn.execute("ROLLBACK")
    after = in_transaction(src, "INSERT INTO s VALUES (1, 'small')")
    msgs = src.peek(slot, streaming=streaming)
    if src.version >= 18:
        # PostgreSQL 18 checks whether a transaction has already aborted before streaming it, and
        # drops it without a word: decoded after the ROLLBACK, the big transaction leaves no trace.
        # (test_framing.py sees its Stream Abort through a live walsender instead.)
        assert kinds_of(msgs) == ["Begin", "Relation", "Insert", "Commit"]
        check_transaction(msgs, after)
        return
    # PostgreSQL 15, decoding again after the ROLLBACK, finds the transaction aborted as soon as it
    # reads the catalogs for its first change: it closes the block it opened with nothing in it,
    # then sends a top-level Stream Abort.
    assert kinds_of(msgs) == ["StreamStart", "StreamStop", "StreamAbort", "Begin", "Relation", "Insert", "Commit"]
    assert msgs[0] == StreamStart(xid, True)
    abort = msgs[2]
    assert abort.xid == abort.subxid == xid
    if streaming == "parallel":
        assert abort.abort_lsn is not None and abort.abort_time is not None
        assert abs(pg_timestamp(abort.abort_time) - datetime.now(UTC)) < timedelta(minutes=5)
        assert abort.abort_lsn < msgs[-1].commit_lsn
        assert abort.abort_time <= msgs[-1].commit_time
    else:
        assert abort.abort_lsn is None and abort.abort_time is None
    # A small transaction after it is not streamed: plain Begin … Commit, no xids.
    check_transaction(msgs[3:], after)
    assert msgs[4].xid is None
    assert msgs[5] == Insert(None, src.oid("s"), TupleData(b"tt", (b"1", b"small")))


def test_small_transaction_is_not_streamed(src: Source) -> None:
    src.q("CREATE TABLE s (id int PRIMARY KEY, v text)")
    src.q("CREATE PUBLICATION pub FOR TABLE s")
    slot = src.slot()
    xid = in_transaction(src, "INSERT INTO s VALUES (1, 'x')")
    msgs = src.peek(slot, streaming="on")
    assert kinds_of(msgs) == ["Begin", "Relation", "Insert", "Commit"]
    check_transaction(msgs, xid)


# ---------------------------------------------------------------------------
# Two-phase commit (protocol 3+).


def prepare(src: Source, gid: str, *statements: str) -> int:
    src.conn.execute("BEGIN")
    xid = src.xid()
    for s in statements:
        src.q(s)
    src.q(f"PREPARE TRANSACTION '{gid}'")
    return xid


def test_two_phase(src: Source) -> None:
    src.q("CREATE TABLE p (id int PRIMARY KEY, v text)")
    src.q("CREATE PUBLICATION pub FOR TABLE p")
    slot = src.slot(two_phase=True)
    g1, g2, g3 = src.gid("gid1"), src.gid("gid2"), src.gid("gid3")
    x1 = prepare(src, g1, "INSERT INTO p VALUES (1, 'committed')")
    src.q(f"COMMIT PREPARED '{g1}'")
    x2 = prepare(src, g2, "INSERT INTO p VALUES (2, 'rolled back')")
    src.q(f"ROLLBACK PREPARED '{g2}'")
    x3 = prepare(src, g3, f"INSERT INTO p SELECT g, 'big' FROM generate_series(10, {10 + BIG}) g")
    src.q(f"COMMIT PREPARED '{g3}'")
    msgs = src.peek(slot, streaming="on", two_phase=True)
    p = src.oid("p")

    assert kinds_of(msgs[:6]) == ["BeginPrepare", "Relation", "Insert", "Prepare", "CommitPrepared", "BeginPrepare"]
    bp1, rel, ins1, pr1, cp1 = msgs[:5]
    assert bp1.xid == x1 and bp1.gid == g1
    assert rel.oid == p and rel.xid is None
    assert ins1 == Insert(None, p, TupleData(b"tt", (b"1", b"committed")))
    assert pr1 == Prepare(0, bp1.prepare_lsn, bp1.end_lsn, bp1.prepare_time, x1, g1)
    assert pr1.end_lsn > pr1.prepare_lsn > 0
    assert cp1.xid == x1 and cp1.gid == g1 and cp1.flags == 0
    assert cp1.end_lsn > cp1.commit_lsn >= pr1.end_lsn
    assert cp1.commit_time >= pr1.prepare_time
    assert abs(pg_timestamp(cp1.commit_time) - datetime.now(UTC)) < timedelta(minutes=5)

    bp2, ins2, pr2, rb2 = msgs[5:9]
    assert bp2.xid == x2 and bp2.gid == g2 and bp2.prepare_lsn >= cp1.end_lsn
    assert ins2 == Insert(None, p, TupleData(b"tt", (b"2", b"rolled back")))
    assert pr2 == Prepare(0, bp2.prepare_lsn, bp2.end_lsn, bp2.prepare_time, x2, g2)
    assert isinstance(rb2, RollbackPrepared)
    assert rb2 == RollbackPrepared(0, pr2.end_lsn, rb2.rollback_end_lsn, pr2.prepare_time, rb2.rollback_time, x2, g2)
    assert rb2.rollback_end_lsn > rb2.prepare_end_lsn
    assert rb2.rollback_time >= rb2.prepare_time

    # The big one is streamed, then prepared with Stream Prepare.
    rest = msgs[9:]
    by_xid = check_streamed(rest[:-2], x3, set())
    assert sum(len(v) for v in by_xid.values()) <= BIG + 1
    sp3, cp3 = rest[-2:]
    assert isinstance(sp3, StreamPrepare) and isinstance(cp3, CommitPrepared)
    assert (sp3.flags, sp3.xid, sp3.gid) == (0, x3, g3)
    assert sp3.end_lsn > sp3.prepare_lsn > rb2.rollback_end_lsn
    assert (cp3.xid, cp3.gid) == (x3, g3) and cp3.commit_lsn >= sp3.end_lsn
    assert not any(isinstance(m, (BeginPrepare, Prepare)) for m in rest)
    assert int(src.one("SELECT count(*) FROM p")) == 1 + BIG + 1


# ---------------------------------------------------------------------------
# Hand-built bytes, straight from the protocol documentation: one per message kind.

L1, L2 = 0x0000001600000010, 0x0000001600000020  # LSNs 16/10 and 16/20
TS, TS2 = 700_000_000_000_000, 700_000_000_000_777  # 2022-03-05 … in µs since 2000-01-01


def q8(v: int) -> bytes:
    return struct.pack(">Q", v)


SPEC_CASES: list[tuple[str, bytes, bool, Any]] = [
    ("begin", b"B" + q8(L1) + q8(TS) + b"\0\0\x02\xd2", False, Begin(LSN("16/10"), TS, 722)),
    ("message", b"M\x01" + q8(L1) + b"pfx\0" + b"\0\0\0\x03abc", False,
     Message(None, True, LSN("16/10"), "pfx", b"abc")),
    ("message, streamed, non-transactional", b"M\0\0\0\x09\0" + q8(L1) + b"\0" + b"\0\0\0\0", True,
     Message(9, False, LSN("16/10"), "", b"")),
    ("commit", b"C\0" + q8(L1) + q8(L2) + q8(TS), False, Commit(0, LSN("16/10"), LSN("16/20"), TS)),
    ("origin", b"O" + q8(0x1234) + b"node_a\0", False, Origin(LSN("0/1234"), "node_a")),
    ("relation", b"R" + b"\0\0\x40\x01" + b"public\0" + b"t\0" + b"d" + b"\0\x02"
     + b"\x01id\0" + b"\0\0\0\x17" + b"\xff\xff\xff\xff"
     + b"\0note\0" + b"\0\0\x04\x13" + b"\0\0\0\x18", False,
     Relation(None, 16385, "public", "t", "d", (Column(1, "id", 23, -1), Column(0, "note", 1043, 24)))),
    ("relation, streamed, pg_catalog namespace", b"R\0\0\0\x07" + b"\0\0\x40\x01" + b"\0" + b"x\0" + b"n\0\0",
     True, Relation(7, 16385, "", "x", "n", ())),
    ("type", b"Y" + b"\0\0\x40\x02" + b"public\0mood\0", False, Type(None, 16386, "public", "mood")),
    ("type, streamed", b"Y\0\0\0\x07" + b"\0\0\x40\x02" + b"s\0h\xc3\xa9\0", True, Type(7, 16386, "s", "hé")),
    ("insert", b"I" + b"\0\0\x40\x01" + b"N" + b"\0\x04" + b"t\0\0\0\x0242" + b"n" + b"u" + b"b\0\0\0\x02\x00\xff",
     False, Insert(None, 16385, TupleData(b"tnub", (b"42", None, None, b"\x00\xff")))),
    ("insert, streamed", b"I\0\0\0\x08" + b"\0\0\x40\x01" + b"N\0\0", True, Insert(8, 16385, TupleData(b"", ()))),
    ("update, new only", b"U" + b"\0\0\x40\x01" + b"N\0\x01t\0\0\0\x01x", False,
     Update(None, 16385, None, None, TupleData(b"t", (b"x",)))),
    ("update, key", b"U" + b"\0\0\x40\x01" + b"K\0\x02t\0\0\0\x011n" + b"N\0\x02t\0\0\0\x012t\0\0\0\0", False,
     Update(None, 16385, "K", TupleData(b"tn", (b"1", None)), TupleData(b"tt", (b"2", b"")))),
    ("update, old, streamed", b"U\0\0\0\x09" + b"\0\0\x40\x01" + b"O\0\x01t\0\0\0\x01a" + b"N\0\x01u", True,
     Update(9, 16385, "O", TupleData(b"t", (b"a",)), TupleData(b"u", (None,)))),
    ("delete, key", b"D" + b"\0\0\x40\x01" + b"K\0\x01t\0\0\0\x011", False,
     Delete(None, 16385, "K", TupleData(b"t", (b"1",)))),
    ("delete, old, streamed", b"D\0\0\0\x09" + b"\0\0\x40\x01" + b"O\0\x01n", True,
     Delete(9, 16385, "O", TupleData(b"n", (None,)))),
    ("truncate", b"T" + b"\0\0\0\x02" + b"\x03" + b"\0\0\x40\x01\0\0\x40\x02", False,
     Truncate(None, 3, (16385, 16386))),
    ("truncate, streamed", b"T\0\0\0\x09" + b"\0\0\0\x01" + b"\x02" + b"\0\0\x40\x01", True,
     Truncate(9, 2, (16385,))),
    ("stream start", b"S\0\0\x02\xd2\x01", False, StreamStart(722, True)),
    ("stream start, later segment", b"S\0\0\x02\xd2\x00", True, StreamStart(722, False)),
    ("stream stop", b"E", True, StreamStop()),
    ("stream commit", b"c\0\0\x02\xd2\0" + q8(L1) + q8(L2) + q8(TS), False,
     StreamCommit(722, 0, LSN("16/10"), LSN("16/20"), TS)),
    ("stream abort, v2", b"A\0\0\x02\xd2\0\0\x02\xd3", False, StreamAbort(722, 723, None, None)),
    ("stream abort, v4", b"A\0\0\x02\xd2\0\0\x02\xd2" + q8(L1) + q8(TS), False,
     StreamAbort(722, 722, LSN("16/10"), TS)),
    ("begin prepare", b"b" + q8(L1) + q8(L2) + q8(TS) + b"\0\0\x02\xd2" + b"gid1\0", False,
     BeginPrepare(LSN("16/10"), LSN("16/20"), TS, 722, "gid1")),
    ("prepare", b"P\0" + q8(L1) + q8(L2) + q8(TS) + b"\0\0\x02\xd2" + b"gid1\0", False,
     Prepare(0, LSN("16/10"), LSN("16/20"), TS, 722, "gid1")),
    ("commit prepared", b"K\0" + q8(L1) + q8(L2) + q8(TS) + b"\0\0\x02\xd2" + b"gid1\0", False,
     CommitPrepared(0, LSN("16/10"), LSN("16/20"), TS, 722, "gid1")),
    ("rollback prepared", b"r\0" + q8(L1) + q8(L2) + q8(TS) + q8(TS2) + b"\0\0\x02\xd2" + b"gid2\0", False,
     RollbackPrepared(0, LSN("16/10"), LSN("16/20"), TS, TS2, 722, "gid2")),
    ("stream prepare", b"p\0" + q8(L1) + q8(L2) + q8(TS) + b"\xff\xff\xff\xff" + b"g\0", False,
     StreamPrepare(0, LSN("16/10"), LSN("16/20"), TS, 0xFFFFFFFF, "g")),
]


@pytest.mark.parametrize(("data", "in_stream", "expected"), [c[1:] for c in SPEC_CASES],
                         ids=[c[0] for c in SPEC_CASES])
def test_spec_bytes(data: bytes, in_stream: bool, expected: Any) -> None:
    got = decode_message(data, in_stream)
    assert got == expected
    assert type(got) is type(expected)
    for name in got._fields:  # field by field, types too (LSN, not a bare int)
        assert type(getattr(got, name)) is type(getattr(expected, name)), name
    assert decode_message(bytearray(data), in_stream) == expected
    assert decode_message(memoryview(data), in_stream) == expected


def test_every_kind_has_its_class_and_reader() -> None:
    # MessageKind is the protocol's whole set, each kind decoded to its own class (KIND_OF)
    assert {MessageKind(data[0]) for _, data, _, _ in SPEC_CASES} == set(MessageKind)
    for _, data, in_stream, _ in SPEC_CASES:
        assert KIND_OF[type(decode_message(data, in_stream))] == data[0]


@pytest.mark.parametrize(("data", "expected"), [(c[1], c[3]) for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES])
def test_decision_position_from_bytes_is_decided_at(data: bytes, expected: Any) -> None:
    # the raw-bytes reader (verify's StopBefore) finds the field the decoder finds: the record's start, or inside
    # the record (its end - 1) for Rollback Prepared, which carries only the end
    decided = decided_at(expected)
    at = decision_position(data)
    if decided is None:
        assert at is None
    else:
        assert at == decided - (1 if type(expected) is RollbackPrepared else 0)
        assert decision_position(data[:8]) is None  # too short to hold the field: not read as an LSN


def test_spec_bytes_render() -> None:
    assert render_message(SPEC_CASES[0][3]) == {
        "type": "Begin", "final_lsn": "16/10", "commit_time": pg_timestamp(TS).isoformat(), "xid": 722}
    ins = render_message(decode_message(SPEC_CASES[9][1]))
    assert ins["new"] == [{"kind": "t", "value": "42"}, {"kind": "n"}, {"kind": "u"}, {"kind": "b", "value": "00ff"}]
    rel = render_message(decode_message(SPEC_CASES[5][1]))
    assert rel["columns"][0] == {"flags": 1, "name": "id", "type_oid": 23, "type_modifier": -1, "is_key": True}
    abort = render_message(StreamAbort(1, 2, None, None))
    assert abort == {"type": "StreamAbort", "xid": 1, "subxid": 2, "abort_lsn": None, "abort_time": None}


@pytest.mark.parametrize(
    ("data", "in_stream", "name", "field"),
    [
        (b"", False, "(empty)", "kind"),
        (b"Z", False, "(unknown)", "kind"),
        (b"B" + q8(L1) + q8(TS) + b"\0\0\x02", False, "Begin", "xid"),
        (b"B" + q8(L1) + q8(TS) + b"\0\0\x02\xd2\0", False, "Begin", "end"),
        (b"M\x02" + q8(L1) + b"p\0\0\0\0\0", False, "Message", "flags"),
        (b"R\0\0\x40\x01public\0t\0x\0\0", False, "Relation", "replica identity"),
        (b"Y\0\0\x40\x02\xff\0mood\0", False, "Type", "namespace"),
        (b"I\0\0\x40\x01X\0\0", False, "Insert", "tuple kind"),
        (b"I\0\0\x40\x01N\0\x01z", False, "Insert", "new tuple column 1 kind"),
        (b"I\0\0\x40\x01N\0\x01t\0\0\0\x05ab", False, "Insert", "new tuple column 1 value"),
        (b"U\0\0\x40\x01K\0\0K\0\0", False, "Update", "new tuple kind"),
        (b"D\0\0\x40\x01N\0\0", False, "Delete", "tuple kind"),
        (b"T\0\0\0\x01\x04\0\0\x40\x01", False, "Truncate", "options"),
        (b"T\0\0\0\x02\x00\0\0\x40\x01", False, "Truncate", "relation oids"),
        (b"S\0\0\x02\xd2\x02", False, "Stream Start", "first segment"),
        (b"E\0", False, "Stream Stop", "end"),
        (b"A\0\0\x02\xd2\0\0\x02\xd2\0", False, "Stream Abort", "abort_lsn"),
        (b"b" + q8(L1) + q8(L2) + q8(TS) + b"\0\0\x02\xd2gid", False, "Begin Prepare", "gid"),
        # The streamed xid decides the layout: a streamed Insert read as a plain one is garbage.
        (b"I\0\0\0\x08\0\0\x40\x01N\0\0", False, "Insert", "tuple kind"),
    ],
)
def test_spec_errors_name_message_field_and_byte(data: bytes, in_stream: bool, name: str, field: str) -> None:
    with pytest.raises(DecodeError) as excinfo:
        decode_message(data, in_stream)
    err = excinfo.value
    assert err.message_type == name and err.field == field
    assert 0 <= err.offset <= len(data)
    assert str(err).startswith(f"{name} message: {field} at byte {err.offset}: ")


def test_decoder_tracks_stream_blocks() -> None:
    dec = Decoder()
    insert_streamed = b"I\0\0\0\x08\0\0\x40\x01N\0\0"
    assert dec.decode(b"S\0\0\0\x08\x01") == StreamStart(8, True)
    assert dec.in_stream
    assert dec.decode(insert_streamed) == Insert(8, 16385, TupleData(b"", ()))
    with pytest.raises(DecodeError, match="Stream Start.*inside an open stream block"):
        dec.decode(b"S\0\0\0\x08\x00")
    assert dec.in_stream
    assert dec.decode(b"E") == StreamStop()
    assert not dec.in_stream
    with pytest.raises(DecodeError, match="Stream Stop.*outside a stream block"):
        dec.decode(b"E")
    with pytest.raises(DecodeError):
        dec.decode(insert_streamed)  # outside a stream the xid is not there
    assert dec.decode(b"A\0\0\0\x08\0\0\0\x08") == StreamAbort(8, 8, None, None)
    assert dec.decode(b"I\0\0\x40\x01N\0\0") == Insert(None, 16385, TupleData(b"", ()))
