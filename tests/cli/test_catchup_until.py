"""``applier catchup --until LSN`` (pg_recvlogical's ``--endpos``): every transaction whose commit is at or before
the LSN is applied, none after it; the progress is the last one's end; a position the source has not reached yet is
waited for. The installed script against a real source and a SQLite target.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from applier.lsn import LSN
from tests.cli.opsrig import Rig
from tests.plugins.clusters import ScratchDb

MARGIN = 16 << 20  # bytes of WAL between the source's position and --until (``test_until_past_the_source_waits_for_it``)


@pytest.fixture
def rig(source_db: ScratchDb, tmp_path: Path) -> Iterator[Rig]:
    yield Rig.initialized(source_db, tmp_path)


def ids(rig: Rig) -> list[int]:
    return [r[0] for r in rig.tgt("SELECT id FROM t ORDER BY id")]


def test_until_applies_the_commits_at_or_before_it_and_stops(rig: Rig) -> None:
    for i in (1, 2, 3):
        rig.src("INSERT INTO t VALUES (%s, 'x')", [i])
    (a_commit, _), (b_commit, b_end), _ = rig.pending()

    r = rig.applier("catchup", "--until", str(LSN(a_commit - 1)))  # before the first commit: nothing
    assert r.returncode == 0, r.stderr
    assert ids(rig) == []
    assert f"(goal {LSN(a_commit - 1)})" in r.stdout

    r = rig.applier("catchup", "--until", str(b_commit))  # exactly the second commit: it is applied, the third not
    assert r.returncode == 0, r.stderr
    assert "applied 2 transactions" in r.stdout
    assert ids(rig) == [1, 2]
    assert rig.applied_lsn() == b_end


def test_until_and_a_streamed_transaction(source_db: ScratchDb, tmp_path: Path) -> None:
    # the walsender streams a transaction larger than logical_decoding_work_mem (64kB on the test servers) before
    # it commits
    rig = Rig.make(source_db, None, tmp_path, streaming=True)
    rig.prepare("init")
    rig.src("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 3000) g")
    rig.src("INSERT INTO t VALUES (0, 'after')")
    (big_commit, big_end), _ = rig.pending()

    r = rig.applier("catchup", "--until", str(LSN(big_commit - 1)))
    assert r.returncode == 0, r.stderr
    assert rig.tgt("SELECT count(*) FROM t") == [(0,)]
    r = rig.applier("catchup", "--until", str(big_commit))
    assert r.returncode == 0, r.stderr
    assert rig.tgt("SELECT count(*), min(id) FROM t") == [(3000, 1)]
    assert rig.applied_lsn() == big_end


def test_until_between_prepare_and_commit_prepared(source_db: ScratchDb, tmp_path: Path) -> None:
    rig = Rig.make(source_db, None, tmp_path, two_phase=True)
    rig.prepare("init")
    rig.src("BEGIN; INSERT INTO t VALUES (10, 'prepared'); PREPARE TRANSACTION 'g1'")
    rig.src("CREATE TABLE unpublished (id int); INSERT INTO unpublished VALUES (1)")  # WAL after the PREPARE's end
    between = rig.wal_insert_lsn()
    rig.src("COMMIT PREPARED 'g1'")

    # just before the COMMIT PREPARED's record (which starts at ``between``): the PREPARE is applied, it is not
    r = rig.applier("catchup", "--until", str(LSN(between - 1)))
    assert r.returncode == 0, r.stderr
    assert ids(rig) == []
    assert rig.tgt("SELECT gid FROM applier_prepared") == [("g1",)]
    r = rig.applier("catchup")
    assert r.returncode == 0, r.stderr
    assert ids(rig) == [10]
    assert rig.tgt("SELECT gid FROM applier_prepared") == []


def test_until_past_the_source_waits_for_it(rig: Rig) -> None:
    rig.src("INSERT INTO t VALUES (1, 'x')")
    # a margin that the WAL of the whole cluster does not cross in the wait: the server's own (a running-xacts
    # record every 15 s, autovacuum) and that of the other tests sharing the cluster (64 kB was crossed once)
    ahead = LSN(rig.wal_insert_lsn() + MARGIN)
    proc = rig.start("catchup", "--until", str(ahead))
    try:
        time.sleep(4)
        assert proc.poll() is None, proc.communicate()  # still waiting: the source has not reached it
        assert ids(rig) == [1]  # what lies before it is applied meanwhile
        # the WAL brought past the position by an unpublished table's rows, then a change committed past it: the
        # wait ends, the change is not applied
        rig.src("CREATE TABLE pad (g int, v text)")
        while rig.wal_insert_lsn() <= ahead:
            rig.src("INSERT INTO pad SELECT g, md5(g::text) FROM generate_series(1, 100000) AS g")
        rig.src("INSERT INTO t VALUES (2, 'past')")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert f"(goal {ahead})" in out
    assert ids(rig) == [1]
    assert rig.applied_lsn() < ahead


def test_until_not_an_lsn_is_one_line(rig: Rig) -> None:
    r = rig.applier("catchup", "--until", "12/zz")
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["applier: error: --until: not an LSN (expected X/Y in hexadecimal): '12/zz'"]
