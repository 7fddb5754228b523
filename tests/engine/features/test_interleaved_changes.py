"""One source transaction of many small changes that alternate (an update, an insert, an update…): each is a
batch of one row, so on a PostgreSQL target every change is a statement of its own, sent in one libpq pipeline
without waiting (``PostgresTarget._send``) and read in one round trip, and the pipeline is read mid-transaction
once ``PIPELINE_DEPTH`` statements are in it. What a user checks: a row missing deep inside such a transaction is found,
resolved by its policy and recorded once, and the rest applied; a row the target refuses deep inside fails the
transaction whole, named by its key, with nothing of it applied and the position not advanced; so does one
refused in a transaction of a few inserts only, whose COMMIT goes in the same round trip as the inserts. The
server checks the row counts of updates and deletes itself, so their COMMIT goes in the same round trip too: a row
missing there still commits nothing of the fast attempt, and is resolved and recorded once.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from applier.errors import ApplyError
from applier.targets.postgres.target import PIPELINE_DEPTH, PostgresTarget

from .conftest import Rig
from .test_conflicts import recorded, tname

PAIRS = 700  # update + insert pairs: twice PIPELINE_DEPTH and more, so the pipeline is read mid-transaction
ALTERNATING = (f"DO $$ BEGIN FOR k IN 1..{PAIRS} LOOP UPDATE t SET v = 'u' || k WHERE id = k; "
               "INSERT INTO t VALUES (1000 + k, 'n' || k); END LOOP; END $$")


def setup(rig: Rig, target_ddl: str) -> None:
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt_script(target_ddl)
    rig.publish("t")
    rig.init()
    rig.src(f"INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, {PAIRS}) g")
    rig.catchup()


def test_a_row_missing_deep_in_a_pipelined_transaction_is_resolved_once(rig: Rig) -> None:
    assert 2 * PAIRS > 2 * PIPELINE_DEPTH
    setup(rig, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt("DELETE FROM t WHERE id = 650")  # a statement after the pipeline was read mid-transaction misses it
    rig.src(ALTERNATING)
    summary = rig.catchup()
    assert summary.transactions == 1
    expected = ([(k, f"u{k}") for k in range(1, PAIRS + 1) if k != 650]
                + [(1000 + k, f"n{k}") for k in range(1, PAIRS + 1)])
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == expected
    rows = recorded(rig)
    assert [(r.type, r.table, r.key, r.resolution) for r in rows] == [
        ("update_missing", tname(rig, "t"), "(id)=(650)", "skip")]
    assert rig.catchup().transactions == 0 and len(recorded(rig)) == 1


@pytest.mark.parametrize("bad", [3, 600])  # in the first pipeline read, and after it was read mid-transaction
def test_a_row_refused_deep_in_a_pipelined_transaction_fails_it_whole(rig: Rig, bad: int) -> None:
    setup(rig, "CREATE TABLE t (id int PRIMARY KEY, v text CHECK (v <> 'bad'))")
    before = rig.progress_lsn()
    rig.src(ALTERNATING.replace("'n' || k", f"CASE WHEN k = {bad} THEN 'bad' ELSE 'n' || k END"))
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    msg = str(err.value)
    assert f"(id)=({1000 + bad})" in msg and "INSERT" in msg and "\n" not in msg, msg
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(k, f"v{k}") for k in range(1, PAIRS + 1)]
    assert rig.progress_lsn() == before


def test_a_row_refused_where_commit_shares_the_pipeline_commits_nothing(rig: Rig) -> None:
    setup(rig, "CREATE TABLE t (id int PRIMARY KEY, v text CHECK (v <> 'bad'))")
    before = rig.progress_lsn()
    rig.src("INSERT INTO t VALUES (2001, 'fine'); INSERT INTO t VALUES (2002, 'bad')")  # one batch of two rows
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    assert "(id)=(2002)" in str(err.value), err.value
    assert rig.tgt("SELECT count(*), max(id) FROM t") == [(PAIRS, PAIRS)]
    assert rig.progress_lsn() == before


@pytest.mark.parametrize("rows", [3, 20])  # a statement per row; one statement for the batch (set-based)
@pytest.mark.parametrize("op", ["UPDATE", "DELETE"])
def test_a_row_missing_where_commit_shares_the_pipeline_is_resolved_once(rig: Rig, op: str, rows: int,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    setup(rig, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt("DELETE FROM t WHERE id = 2")
    change = "UPDATE t SET v = 'w' || id" if op == "UPDATE" else "DELETE FROM t"
    rig.src(f"{change} WHERE id <= {rows}")
    with caplog.at_level(logging.INFO, logger="applier"):
        assert rig.catchup().transactions == 1
    assert not failures_retried(caplog)  # a conflict, resolved as one; not a failure
    kept = [] if op == "DELETE" else [(k, f"w{k}") for k in range(1, rows + 1) if k != 2]
    assert rig.tgt(f"SELECT id, v FROM t WHERE id <= {rows} ORDER BY id") == kept
    assert rig.tgt(f"SELECT count(*) FROM t WHERE id > {rows}") == [(PAIRS - rows,)]
    kind = "update_missing" if op == "UPDATE" else "delete_missing"
    assert [(r.type, r.table, r.key, r.resolution) for r in recorded(rig)] == [(kind, tname(rig, "t"), "(id)=(2)", "skip")]
    assert rig.catchup().transactions == 0 and len(recorded(rig)) == 1


def failures_retried(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The runner's "apply failed, retrying" warnings: a failure, where a conflict or nothing was expected."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("apply failed")]


def test_a_transaction_of_keyed_changes_commits_in_one_round_trip(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """BEGIN, the changes and the commit go in one pipeline, read once: the row counts are the server's to check."""
    if rig.target is None:
        pytest.skip("the PostgreSQL target's pipeline")
    setup(rig, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    reads: list[int] = []
    read = PostgresTarget._sync

    def counted(self: PostgresTarget, check: bool = True) -> Any:
        reads.append(len(self._inflight))
        return read(self, check)

    monkeypatch.setattr(PostgresTarget, "_sync", counted)
    seen = []
    for attempt in range(3):
        # a walsender slowed by the machine's other load can hand the transaction over in two reads, and the batch
        # then splits where the read did: one attempt in three with the whole transaction at once is enough (a
        # pipeline read per statement would show in every attempt)
        reads.clear()
        rig.src(f"UPDATE t SET v = 'a{attempt}' WHERE id = 1; DELETE FROM t WHERE id = 2; "
                f"INSERT INTO t VALUES (5000 + {attempt}, 'n'); UPDATE t SET v = 'c{attempt}' WHERE id = 3; "
                f"INSERT INTO t VALUES (2, 'b')")
        assert rig.catchup().transactions == 1
        seen.append(list(reads))
        if len(reads) == 1:
            break
    assert len(seen[-1]) == 1, seen
    assert rig.tgt("SELECT id, v FROM t WHERE id <= 3 OR id >= 5000 ORDER BY id")[:4] == [
        (1, f"a{attempt}"), (2, "b"), (3, f"c{attempt}"), (5000, "n")]


@pytest.mark.parametrize("rows", [3, 20])  # a statement per row; one statement for the batch (set-based)
def test_a_table_with_rules_is_applied_on_the_fast_path(rig: Rig, rows: int, caplog: pytest.LogCaptureFixture) -> None:
    """A rule's statement cannot be part of a WITH query: on such a table the client checks the row counts."""
    if rig.target is None:
        pytest.skip("rules are PostgreSQL's")
    setup(rig, "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE audit (id int, v text); "
               "CREATE RULE audited AS ON UPDATE TO t DO ALSO INSERT INTO audit VALUES (new.id, new.v); "
               "ALTER TABLE t ENABLE ALWAYS RULE audited")
    rig.src(f"UPDATE t SET v = 'r' || id WHERE id <= {rows}")
    with caplog.at_level(logging.INFO, logger="applier"):
        assert rig.catchup().transactions == 1
    assert not failures_retried(caplog)
    expected = [(k, f"r{k}") for k in range(1, rows + 1)]
    assert rig.tgt(f"SELECT id, v FROM t WHERE id <= {rows} ORDER BY id") == expected
    assert rig.tgt("SELECT id, v FROM audit ORDER BY id") == expected
