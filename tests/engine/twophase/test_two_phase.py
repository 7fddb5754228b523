"""Two-phase transactions (protocol 3+): applied at PREPARE, finished at COMMIT/ROLLBACK PREPARED.

On a PostgreSQL target (``two_phase_mode = "prepare"``) the changes run and PREPARE
TRANSACTION names them ``applier_<name>_<source xid>``; a SQLite target (and a
PostgreSQL one in ``"table"`` mode) keeps the prepared transaction in
``applier_prepared`` until its commit. Every test runs on each installed major
and both targets; ``catchup`` runs in-process and leaves the source's prepared
transactions open where the test says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from applier.admin import init, status
from applier.config import ConfigError
from applier.decoder.messages import StreamPrepare
from applier.sandbox.clusters import Cluster
from applier.targets.postgres.target import PostgresTarget
from tests.plugins.clusters import ScratchDb

from .conftest import BIG, TpRig


def prepare(rig: TpRig, gid: str, *sqls: str) -> int:
    """Run statements in a source transaction and PREPARE it as ``gid``; returns its xid."""
    s = rig.session()
    xid = s.begin()
    s.run(*sqls, f"PREPARE TRANSACTION '{gid}'")
    return xid


def waiting(rig: TpRig) -> list[str]:
    """What ``status`` lists as waiting: target gids (PREPARE TRANSACTION) or source gids (kept in the table)."""
    return sorted(w["gid"] for w in rig.status_waiting())


def assert_waiting(rig: TpRig, expected: dict[str, int]) -> None:
    """The target holds exactly these prepared transactions (source gid -> source xid), each once."""
    if rig.native_prepare():
        gids = sorted(rig.target_gid(x) for x in expected.values())
        assert rig.pg_prepared_gids() == gids
        assert rig.kept_prepared() == []
        assert waiting(rig) == gids
        assert all(w["kept_in"] == "pg_prepared_xacts" for w in rig.status_waiting())
    else:
        assert rig.kept_prepared() == sorted(expected.items())
        if rig.target is not None:
            assert rig.pg_prepared_gids() == []
        listed = rig.status_waiting()
        assert sorted((w["gid"], int(w["xid"])) for w in listed) == sorted(expected.items())
        assert all(w["kept_in"] == "applier_prepared" for w in listed)
    assert rig.spool_files() == []


def test_prepare_then_commit_prepared(tp: TpRig) -> None:
    """Prepared at PREPARE (rows invisible, one prepared transaction on the target); still open when
    catchup exits and through a second catchup (not prepared twice); committed later on the
    source and applied by the next run, together with a transaction that depends on it."""
    rig = tp
    rig.setup()
    rig.tx("INSERT INTO t VALUES (1, 'one', 0), (2, 'two', 0)")
    x1 = prepare(rig, "g1", "INSERT INTO t SELECT g, 'p' || g, 0 FROM generate_series(100, 149) g",
                 "UPDATE acct SET bal = bal + 5 WHERE id = 1", "DELETE FROM t WHERE id = 1",
                 "INSERT INTO log VALUES (1, 'g1')")
    rig.tx("INSERT INTO t VALUES (3, 'three', 0)")
    rig.catchup()
    assert rig.ids() == {1, 2, 3}
    assert rig.tgt("SELECT bal FROM acct WHERE id = 1") == [(100,)]
    assert_waiting(rig, {"g1": x1})

    rig.catchup()                                   # nothing new: the prepared transaction stays as it is
    assert_waiting(rig, {"g1": x1})

    rig.tx("COMMIT PREPARED 'g1'")
    rig.tx("UPDATE t SET n = 7 WHERE id = 100", "UPDATE acct SET bal = bal * 2 WHERE id = 1")
    rig.catchup()
    assert_waiting(rig, {})
    assert rig.tgt("SELECT bal FROM acct WHERE id = 1") == [(210,)]
    assert rig.tgt("SELECT n FROM t WHERE id = 100") == [(7,)]
    rig.assert_same()


def test_prepared_transaction_with_batches_of_updates_and_deletes(tp: TpRig, caplog: pytest.LogCaptureFixture) -> None:
    """Batches of keyed updates and deletes (on PostgreSQL one statement each, sent ahead) inside a prepared
    transaction: prepared with them, not prepared again by a second run, committed; a row already gone from
    the target is logged, recorded and skipped (update_missing), the others apply once."""
    rig = tp
    rig.setup()
    rig.tx("INSERT INTO t SELECT g, 'r' || g, 0 FROM generate_series(1, 40) g")
    rig.catchup()
    rig.tgt_script("DELETE FROM t WHERE id IN (5, 33)")  # the update of 5 and the delete of 33 find nothing
    x1 = prepare(rig, "g1", "UPDATE t SET n = id * 10 WHERE id <= 20", "DELETE FROM t WHERE id > 30",
                 "UPDATE acct SET bal = bal - id")
    with caplog.at_level(logging.WARNING, logger="applier"):
        rig.catchup()
        assert_waiting(rig, {"g1": x1})
        rig.catchup()  # nothing new: not prepared twice
        assert_waiting(rig, {"g1": x1})
        rig.tx("COMMIT PREPARED 'g1'")
        rig.catchup()
    assert_waiting(rig, {})
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("conflict update_missing: row to be updated in table") and "(id)=(5) " in m
               for m in logged), logged
    assert not any("retrying" in m for m in logged), logged
    rig.tgt_script("INSERT INTO t VALUES (5, 'r5', 50)")  # put back the row the target lacked, then compare
    rig.assert_same()


def test_prepare_then_rollback_prepared(tp: TpRig) -> None:
    """ROLLBACK PREPARED discards the prepared transaction on the target; prepare and finish in the
    same run work too (one committed, one rolled back before any catchup)."""
    rig = tp
    rig.setup()
    x1 = prepare(rig, "r1", "INSERT INTO t SELECT g, 'r' || g, 0 FROM generate_series(1, 20) g",
                 "UPDATE acct SET bal = 0 WHERE id = 2", "INSERT INTO log VALUES (1, 'r1')")
    prepare(rig, "same-run-commit", "INSERT INTO t VALUES (500, 'c', 0)", "INSERT INTO log VALUES (2, 'c')")
    prepare(rig, "same-run-rollback", "INSERT INTO t VALUES (600, 'r', 0)", "UPDATE acct SET bal = 1 WHERE id = 3")
    x_empty = prepare(rig, "nothing-published", "INSERT INTO unpublished VALUES (1)")
    rig.tx("COMMIT PREPARED 'same-run-commit'")
    rig.tx("ROLLBACK PREPARED 'same-run-rollback'")
    x_reused = prepare(rig, "same-run-commit", "INSERT INTO t VALUES (700, 'gid reused', 0)")  # the gid, again
    rig.catchup()
    assert rig.ids() == {500}
    # a prepared transaction without published changes is still sent (empty) and prepared
    assert_waiting(rig, {"r1": x1, "same-run-commit": x_reused, "nothing-published": x_empty})
    rig.tx("COMMIT PREPARED 'nothing-published'")
    rig.tx("COMMIT PREPARED 'same-run-commit'")
    rig.catchup()
    assert rig.ids() == {500, 700}
    assert_waiting(rig, {"r1": x1})

    rig.tx("ROLLBACK PREPARED 'r1'")
    rig.tx("INSERT INTO t VALUES (1, 'after', 0)")   # the key the rolled-back transaction had used
    rig.catchup()
    assert_waiting(rig, {})
    assert rig.ids() == {1, 500, 700}
    assert rig.tgt("SELECT bal FROM acct WHERE id IN (2, 3) ORDER BY id") == [(100,), (100,)]
    rig.assert_same()


def test_two_prepared_open_commit_order_differs_from_prepare_order(tp: TpRig) -> None:
    """Two prepared transactions open at once, ordinary ones committing between; the later-prepared
    one commits first, the other after several more commits; later changes to their rows follow."""
    rig = tp
    rig.setup()
    x1 = prepare(rig, "p1", "INSERT INTO t SELECT g, 'p1', 0 FROM generate_series(1000, 1009) g",
                 "UPDATE acct SET bal = bal + 1 WHERE id = 2", "INSERT INTO log VALUES (1, 'p1')")
    rig.tx("INSERT INTO t VALUES (1, 'o1', 0), (2, 'o1', 0), (3, 'o1', 0)")
    rig.tx("UPDATE acct SET bal = bal + 10 WHERE id = 3")
    x2 = prepare(rig, "p2", "INSERT INTO t SELECT g, 'p2', 0 FROM generate_series(2000, 2009) g",
                 "DELETE FROM t WHERE id = 1", "UPDATE acct SET bal = bal + 100 WHERE id = 4")
    rig.tx("INSERT INTO t VALUES (4, 'o3', 0)")
    rig.catchup()
    assert rig.ids() == {1, 2, 3, 4}
    assert_waiting(rig, {"p1": x1, "p2": x2})

    rig.tx("COMMIT PREPARED 'p2'")
    rig.tx("INSERT INTO t VALUES (5, 'o4', 0)")
    rig.tx("UPDATE t SET n = 5 WHERE id = 2000")
    rig.catchup()
    assert 2000 in rig.ids() and 1 not in rig.ids() and 1000 not in rig.ids()
    assert_waiting(rig, {"p1": x1})

    rig.tx("INSERT INTO t VALUES (6, 'o6', 0)")
    rig.tx("UPDATE acct SET bal = bal + 1000 WHERE id = 3")
    rig.tx("COMMIT PREPARED 'p1'")
    rig.tx("UPDATE t SET n = 9 WHERE id = 1000", "UPDATE acct SET bal = bal * 3 WHERE id = 2")
    rig.catchup()
    assert_waiting(rig, {})
    assert rig.tgt("SELECT id, bal FROM acct WHERE id IN (2, 3, 4) ORDER BY id") == [(2, 303), (3, 1110), (4, 200)]
    rig.assert_same()


def test_streamed_prepared_transaction(tp: TpRig) -> None:
    """Stream Prepare: a large prepared transaction (with a rolled-back savepoint) is streamed, then
    prepared on the target from its spool; one is committed, the other rolled back."""
    rig = tp
    rig.setup()
    x1 = prepare(rig, "sp1", f"INSERT INTO t SELECT g, 's1', 0 FROM generate_series(1, {BIG}) g",
                 "SAVEPOINT a", f"INSERT INTO t SELECT g, 'gone', 0 FROM generate_series(10000, {10000 + BIG}) g",
                 "ROLLBACK TO SAVEPOINT a",
                 f"INSERT INTO log SELECT g, 's1' FROM generate_series(1, {BIG}) g",
                 "UPDATE acct SET bal = bal - 1 WHERE id = 5")
    rig.tx("INSERT INTO t VALUES (50000, 'between', 0)")
    x2 = prepare(rig, "sp2", f"INSERT INTO t SELECT g, 's2', 0 FROM generate_series(20000, {20000 + 2 * BIG}) g",
                 "UPDATE t SET n = 1 WHERE id = 50000")
    msgs = rig.peek()
    prepared = {m.xid for m in msgs if type(m) is StreamPrepare}
    assert prepared == {x1, x2}, f"expected both to be streamed and stream-prepared, got {msgs[:5]}…"

    rig.catchup()
    assert rig.ids() == {50000}
    assert_waiting(rig, {"sp1": x1, "sp2": x2})

    rig.tx("ROLLBACK PREPARED 'sp2'")
    rig.tx("COMMIT PREPARED 'sp1'")
    rig.tx("UPDATE t SET n = 3 WHERE id = 1")
    rig.catchup()
    assert_waiting(rig, {})
    got = rig.ids()
    assert len(got) == BIG + 1 and 10000 not in got and 20000 not in got
    assert rig.tgt("SELECT n FROM t WHERE id IN (1, 50000) ORDER BY id") == [(3,), (0,)]
    rig.assert_same()


# -- a restart between PREPARE and its progress (PostgreSQL: two target transactions) -----------------

_FAIL_ONCE = """
CREATE SEQUENCE fail_once;
CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF nextval('fail_once') = 1 THEN RAISE EXCEPTION 'injected failure writing the progress'; END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER fail_once BEFORE INSERT ON applier_progress FOR EACH ROW EXECUTE FUNCTION fail_once();
ALTER TABLE applier_progress ENABLE ALWAYS TRIGGER fail_once;
"""
_DISARM = "DROP TRIGGER fail_once ON applier_progress; DROP FUNCTION fail_once(); DROP SEQUENCE fail_once"


@pytest.mark.parametrize("tp_target", ["postgresql"], indirect=True)
def test_restart_between_prepare_and_commit_finds_it(tp: TpRig) -> None:
    """PREPARE TRANSACTION on the target commits before the progress (its own transaction); a
    failure between the two restarts the session from the old position, the server sends the
    prepared transaction again, and it is found in pg_prepared_xacts: not prepared twice. The same
    after COMMIT PREPARED: not committed twice, not lost. (On SQLite, and in "table" mode, the
    kept transaction and the progress are one transaction: there is no in-between.)"""
    rig = tp
    rig.setup()
    rig.tx("INSERT INTO t VALUES (1, 'before', 0)")
    rig.catchup()
    x1 = prepare(rig, "g1", "INSERT INTO t SELECT g, 'g1', 0 FROM generate_series(10, 19) g",
                 "INSERT INTO log VALUES (1, 'g1')")
    before = rig.progress()
    rig.tgt_script(_FAIL_ONCE)
    summary = rig.catchup()              # prepares, fails on the progress, retries: finds it prepared
    # 1: the injected failure, 2: the error recorded for `applier status`, 3: the retry's progress
    assert rig.tgt("SELECT last_value FROM fail_once") == [(3,)], "the failure was not injected"
    assert "injected failure writing the progress" in status(rig.cfg())["last_error"]
    assert summary.skipped >= 1
    assert rig.progress() > before
    assert_waiting(rig, {"g1": x1})
    assert rig.ids() == {1}

    # the same for a streamed prepared transaction (Stream Prepare, sent again whole)
    x2 = prepare(rig, "g2", f"INSERT INTO t SELECT g, 'g2', 0 FROM generate_series(1000, {1000 + 2 * BIG}) g",
                 "SAVEPOINT a", "DELETE FROM t WHERE id = 1000", "ROLLBACK TO SAVEPOINT a",
                 "UPDATE t SET n = 1 WHERE id = 1")
    rig.tgt("SELECT setval('fail_once', 1, false)")
    before = rig.progress()
    rig.catchup()
    assert rig.tgt("SELECT last_value FROM fail_once") == [(3,)]
    assert rig.progress() > before
    assert_waiting(rig, {"g1": x1, "g2": x2})
    assert rig.ids() == {1}

    rig.tgt_script(_DISARM)
    rig.tx("COMMIT PREPARED 'g1'")
    rig.tx("INSERT INTO t VALUES (2, 'after', 0)")
    rig.tx("COMMIT PREPARED 'g2'")
    before = rig.progress()
    rig.tgt_script(_FAIL_ONCE)
    rig.catchup()                        # commits g1, fails on the progress, retries: not committed twice
    assert rig.tgt("SELECT last_value FROM fail_once")[0][0] >= 3    # failed once, then went on
    assert rig.progress() > before
    rig.tgt_script(_DISARM)
    assert_waiting(rig, {})
    rig.assert_same()


# -- a target that cannot prepare ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def no_prepare_cluster(pg_install: Any) -> Iterator[Cluster]:
    """A target cluster with max_prepared_transactions = 0."""
    cluster = Cluster(pg_install, name=f"pg{pg_install.version}-noprepare",
                      settings={"max_prepared_transactions": "0"}).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def no_prepare_rig(request: pytest.FixtureRequest, source_db: ScratchDb, no_prepare_cluster: Cluster,
                   tmp_path: Path) -> Iterator[TpRig]:
    name = f"tgt_{source_db.dbname}"
    no_prepare_cluster.create_database(name)
    rig = TpRig(source_db, "postgresql", ScratchDb(no_prepare_cluster, name, no_prepare_cluster.dsn(name)), tmp_path)
    try:
        yield rig
    finally:
        rig.cleanup()
        no_prepare_cluster.drop_database(name)


def test_target_without_prepared_transactions(no_prepare_rig: TpRig) -> None:
    """max_prepared_transactions = 0 on the target: a clear error at init; with two_phase_mode =
    "table" init works and prepared transactions are kept in applier_prepared until their commit."""
    rig = no_prepare_rig
    rig.schema()
    with pytest.raises(ConfigError) as err:
        init(rig.cfg())
    text = str(err.value)
    assert "max_prepared_transactions = 0" in text and "two_phase_mode" in text, text
    assert rig.src("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", [rig.slot]) == [(0,)]
    assert rig.tgt("SELECT count(*) FROM pg_tables WHERE tablename = 'applier_progress'") == [(0,)]

    rig.extra["target.two_phase_mode"] = "table"
    rig.init()
    target = PostgresTarget(rig.target_url, rig.name, two_phase_mode="table")
    try:
        assert target.native_prepare is False
    finally:
        target.close()
    x1 = prepare(rig, "k1", "INSERT INTO t SELECT g, 'k1', 0 FROM generate_series(1, 5) g",
                 "UPDATE acct SET bal = 1 WHERE id = 1")
    x2 = prepare(rig, "k2", f"INSERT INTO t SELECT g, 'k2', 0 FROM generate_series(100, {100 + BIG}) g")
    rig.tx("INSERT INTO t VALUES (5000, 'plain', 0)")
    rig.catchup()
    assert rig.ids() == {5000}
    assert_waiting(rig, {"k1": x1, "k2": x2})
    rig.tx("COMMIT PREPARED 'k2'")
    rig.tx("ROLLBACK PREPARED 'k1'")
    rig.catchup()
    assert_waiting(rig, {})
    rig.assert_same()
