"""Streamed (in-progress) transactions, protocol 2+: spooled per xid on disk, applied at their commit.

Every test runs on each installed PostgreSQL major and on both targets with
``streaming = true``; the savepoint and interleaving tests also with ``"parallel"``
(protocol 4: Stream Abort carries the abort LSN and time) on 16+, and with protocol 2
(streaming without two-phase) on the older server.

The source's ``logical_decoding_work_mem`` is 64kB, so ``BIG`` rows stream. The server
streams a subtransaction's changes only while it does not know that it aborted, so the
savepoint tests run their statements while the daemon follows (in-process, on a thread)
and watch the transaction's spool file grow, and shrink at each rollback.
"""

from __future__ import annotations

import time

import pytest

from applier.lsn import LSN

from .conftest import BIG, Daemon, TpRig, wait_for


def ins(first: int, n: int, tag: str) -> str:
    """INSERT n rows into t, ids first.., v = tag:id."""
    return f"INSERT INTO t SELECT g, '{tag}:' || g, 0 FROM generate_series({first}, {first + n - 1}) g"


BULK = 40_000  # spool bytes of well over one streaming pass (~450 rows of t per 64kB pass)


class Streamer:
    """One source session with a streamed transaction open, watched through its spool file.

    The server streams what it has decoded once it holds more than logical_decoding_work_mem,
    and streams a subtransaction's changes only while it does not know the subtransaction has
    aborted; so the statements run while the daemon is following, and each step waits until the
    spool shows that the server has sent it.
    """

    def __init__(self, rig: TpRig, daemon: Daemon) -> None:
        self.rig = rig
        self.daemon = daemon
        self.s = rig.session()
        self.xid = self.s.begin()
        self.history: list[tuple[str, int, int]] = []  # (first statement, size before, size after)

    def size(self) -> int:
        return self.rig.spool_size(self.xid)

    def grow(self, *sqls: str, by: int = 1) -> None:
        """Run statements, then wait until the spool has grown by ``by`` bytes (they were streamed).

        What the server holds below logical_decoding_work_mem is streamed only with the next
        changes; a step that must be on disk before a rollback inserts ``3 * BIG`` rows, several
        streaming passes, and waits for ``by = BULK``.
        """
        before = max(self.size(), 0)
        self.s.run(*sqls)
        self.rig.flush_source_wal()
        self.rig.wait(f"the spool of {self.xid} to grow from {before} by {by} bytes after {sqls}",
                      lambda: self.size() >= before + by, daemon=self.daemon, diag=self.diag)
        self.history.append((sqls[0][:40], before, self.size()))

    def diag(self) -> str:
        return f"size now {self.size()}, steps so far {self.history}"

    def abort_to(self, savepoint: str) -> None:
        """ROLLBACK TO a savepoint whose changes were streamed; the spool must shrink (Stream Abort)."""
        before = self.size()
        self.s.run(f"ROLLBACK TO SAVEPOINT {savepoint}")
        self.rig.flush_source_wal()  # a subtransaction's abort record is not flushed by itself
        self.rig.wait(f"the spool of {self.xid} to shrink below {before} bytes at ROLLBACK TO {savepoint}",
                      lambda: 0 <= self.size() < before, daemon=self.daemon, diag=self.diag)
        # ROLLBACK TO aborts the savepoint's subtransaction and its children: one Stream Abort each, which
        # may arrive a moment apart; let the spool settle before the next step measures growth from it
        settled, last = 0, self.size()
        deadline = time.monotonic() + 30
        while settled < 3 and time.monotonic() < deadline:
            time.sleep(0.3)
            now = self.size()
            settled, last = (settled + 1, last) if now == last else (0, now)
        self.history.append((f"ROLLBACK TO {savepoint}", before, self.size()))


# Watching the spool grow and shrink step by step depends on when the server decides to stream (it
# streams the largest transaction once 64kB of changes wait): on a loaded machine a step can miss
# its window, so the test may run again; the end state is checked in full every time.
@pytest.mark.flaky(reruns=2)
def test_nested_savepoints_rolled_back_at_several_depths(tps: TpRig) -> None:
    """Stream Abort of a subtransaction drops exactly it and its children; of the top level, all of it.

    One streamed transaction rolls back to savepoints at depth 3 (with updates and deletes of
    the parent's rows), at depth 2 (with a released child) and at depth 1, and keeps going after
    each; each rollback is seen to cut the spool file. Another streamed transaction is rolled
    back whole: its spool goes. The target ends equal to the source, the streamed transaction in
    one target transaction with its progress (PostgreSQL: one xmin), and the spool dir empty.
    """
    rig = tps
    rig.setup()
    with rig.daemon() as daemon:
        gone = Streamer(rig, daemon)
        gone.grow(ins(900_000, BIG, "gone"), "SAVEPOINT g1", ins(910_000, 3 * BIG, "gone1"), by=BULK)
        gone.s.run("ROLLBACK")
        rig.flush_source_wal()
        rig.wait("the spool of the rolled-back transaction to go", lambda: gone.size() == -1, daemon=daemon)

        x = Streamer(rig, daemon)
        x.grow(ins(0, BIG, "top"), "INSERT INTO log VALUES (0, 'top')")
        x.grow("SAVEPOINT a", ins(10_000, BIG, "a"))
        x.grow("SAVEPOINT b", ins(20_000, BIG, "b"), "INSERT INTO t2 SELECT g, 'b' FROM generate_series(1, 50) g")
        x.grow("SAVEPOINT c", "UPDATE t SET n = n + 1 WHERE id < 50", "DELETE FROM t WHERE id BETWEEN 50 AND 99",
               "INSERT INTO log VALUES (3, 'c')", ins(30_000, 3 * BIG, "c"), by=BULK)
        x.abort_to("c")                                                   # depth 3
        x.grow(ins(35_000, BIG, "c2"), "RELEASE SAVEPOINT c", "INSERT INTO t2 VALUES (10001, 'b-after-c')",
               "RELEASE SAVEPOINT b")
        x.grow("SAVEPOINT d", ins(40_000, BIG, "d"))
        x.grow("SAVEPOINT e", "INSERT INTO log VALUES (5, 'e')", ins(50_000, 3 * BIG, "e"), "RELEASE SAVEPOINT e",
               by=BULK)
        x.abort_to("d")                                                   # depth 2, with its released child e
        x.grow(ins(45_000, BIG, "d2"), "INSERT INTO log VALUES (4, 'd2')", "RELEASE SAVEPOINT a")
        x.grow("SAVEPOINT f", "DELETE FROM t WHERE id < 10", ins(60_000, 3 * BIG, "f"), by=BULK)
        x.abort_to("f")                                                   # depth 1
        x.s.run("UPDATE t SET n = n + 10 WHERE id < 20", "DELETE FROM t WHERE id = 25",
                "INSERT INTO log VALUES (9, 'top')", "COMMIT")
        rig.wait("the streamed transaction applied", lambda: 45_000 in rig.ids(), daemon=daemon)

    rig.assert_same()
    got = rig.ids()
    for first, tag in ((0, "top"), (10_000, "a"), (20_000, "b"), (35_000, "c2"), (45_000, "d2")):
        assert {first + 1, first + BIG - 1} <= got, f"rows of {tag} are missing"
    for first in (30_000, 40_000, 50_000, 60_000, 900_000, 910_000):
        assert not any(first <= i < first + 3 * BIG for i in got), f"rows from {first} should have been discarded"
    assert {50, 99, 5} <= got and 25 not in got
    assert rig.tgt("SELECT n FROM t WHERE id = 3") == [(10,)]
    assert rig.spool_files() == []
    if rig.target is not None:
        # the whole streamed transaction and its progress: one target transaction
        assert rig.tgt("SELECT count(DISTINCT xmin::text) FROM t") == [(1,)]
        assert rig.tgt("SELECT xmin::text FROM t LIMIT 1") == rig.tgt("SELECT xmin::text FROM applier_progress")


def test_relation_first_sent_in_rolled_back_savepoint(tp: TpRig) -> None:
    """A table first touched inside a savepoint that is rolled back: its Relation message was
    spooled with (and cut away with) that subtransaction. The server sends it again for the
    changes that follow (pgoutput forgets what it sent in a streamed transaction at each Stream
    Abort); the applier must not be left without the table's definition either way."""
    rig = tp
    rig.setup()
    with rig.daemon() as daemon:
        x = Streamer(rig, daemon)
        x.grow(ins(1, BIG, "top"))
        x.grow("SAVEPOINT x", "INSERT INTO t2 SELECT g, 'x' FROM generate_series(1, 800) g", ins(5000, 3 * BIG, "x"),
               by=BULK)
        x.abort_to("x")
        x.grow("INSERT INTO t2 VALUES (900, 'after')", "INSERT INTO log VALUES (1, 'after')",
               "SAVEPOINT y", "INSERT INTO log SELECT g, 'y' FROM generate_series(1, 3000) g", by=BULK)
        x.abort_to("y")
        x.s.run("INSERT INTO log VALUES (2, 'after y')", "COMMIT")
        rig.wait("the streamed transaction applied",
                 lambda: rig.tgt("SELECT count(*) FROM log") == [(2,)], daemon=daemon)
    rig.assert_same()
    assert rig.tgt("SELECT id, v FROM t2") == [(900, "after")]
    assert rig.spool_files() == []


def test_interleaved_streamed_and_small_transactions(tps: TpRig) -> None:
    """Several streamed transactions open at once, with small autocommit ones between: each is
    spooled in a file of its own xid while open, and applied at its own commit, in commit order."""
    rig = tps
    rig.setup()
    a, b, c, d = (rig.session() for _ in range(4))
    small = rig.session()
    with rig.daemon():
        xa = a.begin()
        a.run(ins(100_000, BIG, "A"), "INSERT INTO log VALUES (100, 'A')")
        xb = b.begin()
        b.run(ins(200_000, BIG, "B"))
        small.run(ins(1, 3, "s1"), "UPDATE acct SET bal = bal + 1 WHERE id = 1")
        xc = c.begin()
        c.run(ins(300_000, BIG, "C"), "SAVEPOINT s", ins(310_000, BIG, "C-sub"), "ROLLBACK TO SAVEPOINT s")
        xd = d.begin()
        d.run(ins(400_000, BIG, "D"))
        names = {f"stream-{x}.spool" for x in (xa, xb, xc, xd)}
        wait_for("a spool file per open streamed transaction", lambda: names <= set(rig.spool_files()))
        assert wait_for("the small transaction committed meanwhile", lambda: rig.ids() == {1, 2, 3})

        a.run(ins(101_000, BIG, "A2"))
        small.run(ins(4, 2, "s2"), "INSERT INTO log VALUES (4, 's2')")
        b.run("COMMIT")
        wait_for("B applied at its commit", lambda: 200_000 in rig.ids())
        got = rig.ids()
        assert {1, 2, 3, 4, 5} <= got and 200_000 + BIG - 1 in got
        assert not got & {100_000, 101_000, 300_000, 400_000}, "only committed transactions may be applied"
        wait_for("B's spool removed", lambda: f"stream-{xb}.spool" not in rig.spool_files())

        small.run("UPDATE t SET n = 7 WHERE id = 200000")    # depends on B
        d.run("ROLLBACK")
        wait_for("D's spool removed at its Stream Abort", lambda: f"stream-{xd}.spool" not in rig.spool_files())
        a.run("COMMIT")
        small.run("DELETE FROM t WHERE id = 100000", "UPDATE t SET n = 8 WHERE id = 101000")  # depend on A
        c.run(ins(320_000, BIG, "C2"), "UPDATE t SET n = 9 WHERE id = 200001", "COMMIT")
        small.run("UPDATE acct SET bal = bal + 1 WHERE id = 1")
        wait_for("C and the last small transaction applied",
                 lambda: rig.tgt("SELECT bal FROM acct WHERE id = 1") == [(102,)], timeout=30)
    rig.assert_same()
    got = rig.ids()
    assert 310_000 not in got and 400_000 not in got
    assert rig.tgt("SELECT n FROM t WHERE id IN (200000, 101000, 200001) ORDER BY id") == [(8,), (7,), (9,)]
    assert rig.spool_files() == []


def test_restart_in_the_middle_of_a_streamed_transaction(tp: TpRig) -> None:
    """Runs that end while a streamed transaction is open (part of it spooled, a later small
    transaction already applied and confirmed), and a stale spool file left by a killed process:
    the server sends the transaction again from its first segment, the stale spool is replaced,
    and it is applied once, whole."""
    rig = tp
    rig.setup()
    a = rig.session()
    xa = a.begin()
    a.run(ins(0, BIG, "A"), "INSERT INTO log VALUES (1, 'A')", "SAVEPOINT s1", ins(10_000, BIG, "A-s1"))
    rig.tx(ins(500_000, 2, "small1"))
    rig.catchup()                        # spools part of A, applies small1, confirms past A's start
    assert rig.ids() == {500_000, 500_001}
    assert rig.spool_files() == []
    confirmed_after_first = rig.src("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                                    "WHERE slot_name = %s", [rig.slot])[0][0]

    a.run("ROLLBACK TO SAVEPOINT s1", ins(20_000, BIG, "A2"), "INSERT INTO log VALUES (2, 'A2')")
    rig.flush_source_wal()
    rig.catchup()                        # A is still open: spooled again, nothing applied
    assert rig.ids() == {500_000, 500_001}

    # a killed applier leaves its spool behind: one for A with garbage, one for an unknown xid
    rig.spool_dir().mkdir(parents=True, exist_ok=True)
    (rig.spool_dir() / f"stream-{xa}.spool").write_bytes(b"\x01\x00\x00\x00\x05Igarb" * 100)
    (rig.spool_dir() / "stream-4000000000.spool").write_bytes(b"junk")

    a.run("SAVEPOINT s2", ins(30_000, BIG, "A3"), "RELEASE SAVEPOINT s2", "UPDATE t SET n = n + 1 WHERE id < 10",
          "COMMIT")
    rig.tx(ins(600_000, 1, "small2"), "UPDATE t SET n = 5 WHERE id = 30000")
    summary = rig.catchup()
    assert summary.transactions >= 2
    rig.assert_same()
    got = rig.ids()
    assert 10_000 not in got and {0, 20_000, 30_000, 600_000} <= got
    assert rig.tgt("SELECT count(*) FROM t") == [(3 * BIG + 3,)]
    assert rig.spool_files() == []
    assert rig.progress() > LSN.parse(confirmed_after_first)
