"""Conflicts (issue 16 item 3): the target does not look as a change expects, and the configured policy decides.

Every conflict type is made on purpose against real servers: a row put on, changed on or deleted from the target
by the test, then a source change that meets it. What a user checks: the target's rows after ``catchup`` under
each policy, the rows of ``applier_conflicts`` (one per conflict: type, table, key, the local and the remote row,
the source transaction's xid and commit LSN, the policy and the resolution taken), the error of the ``error``
policy, ``applier status``, ``applier conflicts [--prune AGE]`` and the ``applier_conflicts_total`` metric.
*_origin_differs needs a PostgreSQL target with ``track_commit_timestamp = on`` (``ts_rig``: a target cluster
of its own per major). The restart tests SIGKILL ``applier run`` while it resolves conflicts (tests/engine/
test_crash.py's daemon and workload) and check that each conflict is resolved and recorded exactly once.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from applier.admin import read_progress
from applier.errors import ApplyError
from applier.lsn import LSN
from applier.targets.postgres.target import PostgresTarget
from tests.engine import test_crash as crash
from tests.engine.conftest import NEWEST_PG, Target
from tests.plugins.cli import run_cli
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db

from .conftest import Rig
from .test_observability import by_label, daemon, free_port, scrape_until

PRUNED_2 = re.compile(r"\bpruned\b\D*\b2\b", re.IGNORECASE)  # how many, said by `applier conflicts --prune`
LSN_IN_TEXT = re.compile(r"\b([0-9A-F]{1,8}/[0-9A-F]{1,8})\b")
COLUMNS = "conflict_type, table_name, key, local_row, remote_row, xid, commit_lsn, policy, resolution"
CONFLICT_TYPES = ("insert_exists", "update_exists", "multiple_unique_conflicts", "update_missing", "delete_missing",
                  "update_origin_differs", "delete_origin_differs")


# -- helpers ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Txn:
    """A committed source transaction: its xid and the source's WAL position before and after it."""

    xid: int
    before: LSN
    after: LSN

    def has(self, lsn: LSN) -> bool:
        """``lsn`` is this transaction's commit (or end) LSN."""
        return self.before < lsn <= self.after


def src_txn(rig: Rig, *statements: str) -> Txn:
    """Run ``statements`` as one source transaction."""
    before = rig.wal_lsn()
    with rig.src_conn() as conn, conn.transaction():
        xid = conn.execute("SELECT txid_current() % 4294967296").fetchone()[0]  # type: ignore[index]
        for s in statements:
            conn.execute(s)  # type: ignore[arg-type]
    return Txn(int(xid), before, rig.wal_lsn())


def texts(row: dict[str, Any] | None) -> dict[str, str | None] | None:
    """A JSON row with its values as text (the local row's values may be typed, the remote row's are text)."""
    return None if row is None else {k: None if v is None else str(v) for k, v in row.items()}


@dataclass(frozen=True)
class Recorded:
    """One row of applier_conflicts."""

    type: str
    table: str
    key: str
    local: Any
    remote: Any
    xid: int
    commit_lsn: LSN
    policy: str
    resolution: str


def recorded(rig: Rig) -> list[Recorded]:
    """applier_conflicts, oldest first."""
    out = []
    for t, table, key, local, remote, xid, lsn, policy, resolution in rig.tgt(
            f"SELECT {COLUMNS} FROM applier_conflicts ORDER BY id"):
        out.append(Recorded(t, table, key, None if local is None else json.loads(local),
                            None if remote is None else json.loads(remote), int(xid), LSN.parse(lsn), policy,
                            resolution))
    return out


def tname(rig: Rig, table: str) -> str:
    """The target table as applier names it."""
    return f"public.{table}" if rig.kind == "postgresql" else table


def check(row: Recorded, rig: Rig, type_: str, table: str, keys: tuple[str, ...], txn: Txn, policy: str,
          resolution: str, local: Any, remote: dict[str, str | None] | None) -> None:
    """``row`` is this conflict; ``local`` ``...``: not compared; ``remote`` lists only the columns to compare
    (a delete sends the key alone)."""
    where = f"{row}"
    assert (row.type, row.table, row.policy, row.resolution) == (type_, tname(rig, table), policy, resolution), where
    assert row.key in keys, where
    assert row.xid == txn.xid and txn.has(row.commit_lsn), (where, txn)
    assert local is ... or texts(row.local) == local, where
    if remote is not None:
        got = texts(row.remote)
        assert got is not None and {k: got.get(k) for k in remote} == remote, where


def one(rows: list[Recorded], type_: str, key_part: str) -> Recorded:
    """The one recorded conflict of ``type_`` whose key mentions ``key_part``."""
    found = [r for r in rows if r.type == type_ and key_part in r.key]
    assert len(found) == 1, (type_, key_part, rows)
    return found[0]


def error_of(rig: Rig, **extra: Any) -> str:
    """The message of the ApplyError a catchup stops with (one line)."""
    with pytest.raises(ApplyError) as err:
        rig.catchup(**extra)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def lsns_in(text: str) -> list[LSN]:
    return [LSN.parse(x) for x in LSN_IN_TEXT.findall(text)]


def one_error_line(r: Any) -> str:
    """The script's one ``applier: error:`` line (and nothing else on stderr but log lines before it)."""
    errors = [x for x in r.stderr.splitlines() if x.startswith("applier: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == errors[0], r.stderr
    return errors[0]


# -- every type and policy, both targets -------------------------------------------------------------------


def test_each_conflict_type_and_policy(rig: Rig) -> None:
    rig.both("CREATE TABLE ins (id integer PRIMARY KEY, v text)")  # SQLite: a rowid alias, no index of its own
    rig.both("CREATE TABLE upd (id int PRIMARY KEY, code text UNIQUE, v text)")
    rig.both("CREATE TABLE multi (id int PRIMARY KEY, email text UNIQUE, v text)")
    rig.both("CREATE TABLE miss (id int PRIMARY KEY, v text)")
    rig.publish("ins", "upd", "multi", "miss")
    rig.init()
    rig.src("INSERT INTO upd VALUES (1, 'a', 's1'), (2, 'b', 's2'), (3, 'c', 's3')")
    rig.src("INSERT INTO miss SELECT g, 'm' || g FROM generate_series(1, 6) g")
    rig.catchup()
    assert recorded(rig) == []

    # round 1: apply_remote everywhere it changes something; delete_missing skipped (its default)
    rig.tgt("INSERT INTO ins VALUES (1, 'local')")
    rig.tgt("INSERT INTO multi VALUES (1, 'b@x', 'L1'), (2, 'a@x', 'L2')")
    rig.tgt("INSERT INTO upd VALUES (9, 'z', 'local9')")
    rig.tgt("DELETE FROM miss WHERE id IN (1, 2)")
    rig.tgt("UPDATE miss SET v = 'local6' WHERE id = 6")  # changed here, but no origin tracking: no conflict
    t1 = src_txn(rig, "INSERT INTO ins VALUES (1, 'remote'), (2, 'remote2')",
                 "INSERT INTO multi VALUES (1, 'a@x', 'R')")  # collides with L1 (id) and L2 (email)
    t2 = src_txn(rig, "UPDATE upd SET code = 'z' WHERE id = 1",  # collides with local row 9
                 "UPDATE miss SET v = 'u1' WHERE id = 1", "DELETE FROM miss WHERE id = 2",
                 "UPDATE miss SET v = 'u6' WHERE id = 6")
    rig.catchup(conflicts_insert_exists="apply_remote", conflicts_update_exists="apply_remote",
                conflicts_multiple_unique_conflicts="apply_remote", conflicts_update_missing="apply_remote")
    assert rig.tgt("SELECT id, v FROM ins ORDER BY id") == [(1, "remote"), (2, "remote2")]
    assert rig.tgt("SELECT id, email, v FROM multi ORDER BY id") == [(1, "a@x", "R")]
    assert rig.tgt("SELECT id, code, v FROM upd ORDER BY id") == [(1, "z", "s1"), (2, "b", "s2"), (3, "c", "s3")]
    assert rig.tgt("SELECT id, v FROM miss ORDER BY id") == [(1, "u1"), (3, "m3"), (4, "m4"), (5, "m5"), (6, "u6")]
    first = recorded(rig)
    assert len(first) == 5, first
    check(one(first, "insert_exists", "(1)"), rig, "insert_exists", "ins", ("(id)=(1)",), t1, "apply_remote",
          "apply_remote", {"id": "1", "v": "local"}, {"id": "1", "v": "remote"})
    multi = one(first, "multiple_unique_conflicts", "")
    check(multi, rig, "multiple_unique_conflicts", "multi", (multi.key,), t1, "apply_remote", "apply_remote", ...,
          {"id": "1", "email": "a@x", "v": "R"})
    assert "(1)" in multi.key or "(a@x)" in multi.key, multi
    assert "L1" in json.dumps(multi.local) and "L2" in json.dumps(multi.local), multi  # both local rows
    check(one(first, "update_exists", ""), rig, "update_exists", "upd", ("(id)=(1)", "(code)=(z)"), t2,
          "apply_remote", "apply_remote", {"id": "9", "code": "z", "v": "local9"}, {"id": "1", "code": "z"})
    check(one(first, "update_missing", "(1)"), rig, "update_missing", "miss", ("(id)=(1)",), t2, "apply_remote",
          "apply_remote", None, {"id": "1", "v": "u1"})
    check(one(first, "delete_missing", "(2)"), rig, "delete_missing", "miss", ("(id)=(2)",), t2, "skip", "skip",
          None, {"id": "2"})
    assert rig.progress_lsn() > t2.before
    assert rig.catchup().transactions == 0  # a restart with nothing new resolves and records nothing again
    assert len(recorded(rig)) == 5
    assert read_progress(rig.cfg()).last_error is None  # a resolved conflict is no error

    # round 2: skip / keep_local leave the local rows as they are
    rig.tgt("INSERT INTO ins VALUES (3, 'local3')")
    rig.tgt("INSERT INTO upd VALUES (8, 'y', 'local8')")
    rig.tgt("INSERT INTO multi VALUES (3, 'c@x', 'L3'), (4, 'd@x', 'L4')")
    rig.tgt("DELETE FROM miss WHERE id = 3")
    t3 = src_txn(rig, "INSERT INTO ins VALUES (3, 'remote3'), (4, 'remote4')",
                 "UPDATE upd SET code = 'y' WHERE id = 2", "INSERT INTO multi VALUES (3, 'd@x', 'R3')",
                 "UPDATE miss SET v = 'u3' WHERE id = 3")
    rig.catchup(conflicts_insert_exists="skip", conflicts_update_exists="keep_local",
                conflicts_multiple_unique_conflicts="skip", conflicts_update_missing="skip")
    assert rig.tgt("SELECT id, v FROM ins ORDER BY id") == [(1, "remote"), (2, "remote2"), (3, "local3"),
                                                           (4, "remote4")]
    assert rig.tgt("SELECT id, code, v FROM upd ORDER BY id") == [(1, "z", "s1"), (2, "b", "s2"), (3, "c", "s3"),
                                                                 (8, "y", "local8")]
    assert rig.tgt("SELECT id, email, v FROM multi ORDER BY id") == [(1, "a@x", "R"), (3, "c@x", "L3"),
                                                                    (4, "d@x", "L4")]
    assert rig.tgt("SELECT id, v FROM miss ORDER BY id") == [(1, "u1"), (4, "m4"), (5, "m5"), (6, "u6")]
    second = recorded(rig)
    assert second[:5] == first, "a conflict of round 1 was recorded again"
    new = second[5:]
    assert len(new) == 4, new
    check(one(new, "insert_exists", "(3)"), rig, "insert_exists", "ins", ("(id)=(3)",), t3, "skip", "skip",
          {"id": "3", "v": "local3"}, {"id": "3", "v": "remote3"})
    check(one(new, "update_exists", ""), rig, "update_exists", "upd", ("(id)=(2)", "(code)=(y)"), t3, "keep_local",
          "keep_local", {"id": "8", "code": "y", "v": "local8"}, {"id": "2", "code": "y"})
    m2 = one(new, "multiple_unique_conflicts", "")
    check(m2, rig, "multiple_unique_conflicts", "multi", (m2.key,), t3, "skip", "skip", ...,
          {"id": "3", "email": "d@x", "v": "R3"})
    assert "L3" in json.dumps(m2.local) and "L4" in json.dumps(m2.local), m2
    check(one(new, "update_missing", "(3)"), rig, "update_missing", "miss", ("(id)=(3)",), t3, "skip", "skip", None,
          {"id": "3", "v": "u3"})

    # round 3: the error policy stops the apply with one line; nothing of that transaction is applied
    rig.tgt("INSERT INTO ins VALUES (5, 'local5'), (6, 'local6')")
    rig.tgt("DELETE FROM miss WHERE id = 5")
    t4 = src_txn(rig, "INSERT INTO ins VALUES (5, 'remote5')")
    t5 = src_txn(rig, "DELETE FROM miss WHERE id = 5")
    t6 = src_txn(rig, "INSERT INTO ins VALUES (6, 'remote6'), (7, 'remote7')")
    msg = error_of(rig)  # insert_exists = "error" is the default
    assert "insert_exists" in msg and tname(rig, "ins") in msg and "(id)=(5)" in msg, msg
    assert any(t4.has(x) for x in lsns_in(msg)), (msg, t4)
    assert rig.progress_lsn() <= t4.before
    assert rig.tgt("SELECT id, v FROM ins WHERE id >= 5 ORDER BY id") == [(5, "local5"), (6, "local6")]
    assert len(recorded(rig)) == 9
    msg = error_of(rig, conflicts_insert_exists="keep_local", conflicts_delete_missing="error")
    assert "delete_missing" in msg and tname(rig, "miss") in msg and "(id)=(5)" in msg, msg
    assert any(t5.has(x) for x in lsns_in(msg)), (msg, t5)
    assert rig.progress_lsn() <= t5.before  # T4 may be committed (resolved) or not yet; T5 is not
    rig.catchup(conflicts_insert_exists="keep_local")
    assert rig.tgt("SELECT id, v FROM ins WHERE id >= 5 ORDER BY id") == [(5, "local5"), (6, "local6"),
                                                                         (7, "remote7")]
    assert rig.tgt("SELECT id FROM miss ORDER BY id") == [(1,), (4,), (6,)]
    third = recorded(rig)
    assert third[:9] == second
    new = third[9:]
    assert len(new) == 3, new
    check(one(new, "insert_exists", "(5)"), rig, "insert_exists", "ins", ("(id)=(5)",), t4, "keep_local",
          "keep_local", {"id": "5", "v": "local5"}, {"id": "5", "v": "remote5"})
    check(one(new, "delete_missing", "(5)"), rig, "delete_missing", "miss", ("(id)=(5)",), t5, "skip", "skip",
          None, {"id": "5"})
    check(one(new, "insert_exists", "(6)"), rig, "insert_exists", "ins", ("(id)=(6)",), t6, "keep_local",
          "keep_local", {"id": "6", "v": "local6"}, {"id": "6", "v": "remote6"})


# -- origin_differs: a PostgreSQL target that tracks commit timestamps -------------------------------------


@pytest.fixture
def ts_rig(source_db: ScratchDb, pg_clusters: ClusterPool, tmp_path: Path) -> Iterator[Rig]:
    """A source database and a PostgreSQL target database on a cluster with track_commit_timestamp = on
    (one per major, shared by the tests that ask for it)."""
    cluster = pg_clusters.get(source_db.cluster.install, "target-ts", {"track_commit_timestamp": "on"})
    with scratch_db(cluster, "tgt") as target:
        yield Rig(source_db, "postgresql", target, tmp_path)


def test_origin_differs_policies(ts_rig: Rig) -> None:
    rig = ts_rig
    rig.both("CREATE TABLE o (id int PRIMARY KEY, v text)")
    rig.publish("o")
    rig.init()
    rig.src("INSERT INTO o SELECT g, 's' || g FROM generate_series(1, 6) g")
    rig.catchup()  # written by applier: never "local"
    assert recorded(rig) == []

    rig.tgt("UPDATE o SET v = 'local' WHERE id IN (1, 2)")  # changed on the target by someone else
    t1 = src_txn(rig, "UPDATE o SET v = 'r1' WHERE id = 1", "DELETE FROM o WHERE id = 2",
                 "UPDATE o SET v = 'r3' WHERE id = 3")
    rig.catchup(conflicts_update_origin_differs="apply_remote", conflicts_delete_origin_differs="keep_local")
    assert rig.tgt("SELECT id, v FROM o ORDER BY id") == [(1, "r1"), (2, "local"), (3, "r3"), (4, "s4"), (5, "s5"),
                                                          (6, "s6")]
    first = recorded(rig)
    assert len(first) == 2, first  # row 3 was last written by applier: no conflict
    check(one(first, "update_origin_differs", "(1)"), rig, "update_origin_differs", "o", ("(id)=(1)",), t1,
          "apply_remote", "apply_remote", {"id": "1", "v": "local"}, {"id": "1", "v": "r1"})
    check(one(first, "delete_origin_differs", "(2)"), rig, "delete_origin_differs", "o", ("(id)=(2)",), t1,
          "keep_local", "keep_local", {"id": "2", "v": "local"}, {"id": "2"})

    # last_update_wins: the later commit wins, whichever side made it
    rig.tgt("UPDATE o SET v = 'local4' WHERE id = 4")
    time.sleep(0.05)
    t2 = src_txn(rig, "UPDATE o SET v = 'r4' WHERE id = 4")  # after the local change: applied
    t3 = src_txn(rig, "UPDATE o SET v = 'r5' WHERE id = 5")  # before the local change below: the local row stays
    time.sleep(0.05)
    rig.tgt("UPDATE o SET v = 'local5' WHERE id = 5")
    rig.tgt("UPDATE o SET v = 'local6' WHERE id = 6")
    t4 = src_txn(rig, "DELETE FROM o WHERE id = 6")
    rig.catchup(conflicts_update_origin_differs="last_update_wins", conflicts_delete_origin_differs="apply_remote")
    assert rig.tgt("SELECT id, v FROM o ORDER BY id") == [(1, "r1"), (2, "local"), (3, "r3"), (4, "r4"),
                                                          (5, "local5")]
    second = recorded(rig)
    assert second[:2] == first
    new = second[2:]
    assert len(new) == 3, new
    check(one(new, "update_origin_differs", "(4)"), rig, "update_origin_differs", "o", ("(id)=(4)",), t2,
          "last_update_wins", "apply_remote", {"id": "4", "v": "local4"}, {"id": "4", "v": "r4"})
    check(one(new, "update_origin_differs", "(5)"), rig, "update_origin_differs", "o", ("(id)=(5)",), t3,
          "last_update_wins", "keep_local", {"id": "5", "v": "local5"}, {"id": "5", "v": "r5"})
    check(one(new, "delete_origin_differs", "(6)"), rig, "delete_origin_differs", "o", ("(id)=(6)",), t4,
          "apply_remote", "apply_remote", {"id": "6", "v": "local6"}, {"id": "6"})


KATHMANDU = "?options=-c%20TimeZone%3DAsia/Kathmandu"  # a target session at +05:45: an offset no conversion hides


def committed(rig: Rig, name: str) -> tuple[list[tuple[int, float]], list[LSN]]:
    """Table c's rows' commit timestamps (µs since 2000-01-01 UTC, and seconds since 1970), by id; the position of
    apply.name ``name``'s replication origin."""
    rows = rig.tgt("SELECT (extract(epoch FROM pg_xact_commit_timestamp(xmin) - "
                   "timestamptz '2000-01-01 00:00:00+00') * 1000000)::bigint, "
                   "extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8 FROM c ORDER BY id")
    origin = rig.tgt("SELECT remote_lsn::text FROM pg_replication_origin_status s JOIN pg_replication_origin o "
                     "ON o.roident = s.local_id WHERE o.roname = %s", [f"applier_{name}"])
    return [(int(us), float(s)) for us, s in rows], [LSN.parse(v) for (v,) in origin]


def drop_origin(rig: Rig, name: str) -> None:
    """Origins are the cluster's, not the database's: a test's own is dropped at its end."""
    rig.tgt("SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname = %s",
            [f"applier_{name}"])


def test_a_replicated_commit_carries_the_source_commits_end_and_time(ts_rig: Rig) -> None:
    """As PostgreSQL's subscriber: the target's commit of a replicated transaction records, through applier's
    replication origin, the source commit's end LSN (``pg_replication_origin_status``) and its time, to the
    microsecond (the target's commit timestamp: what *_origin_differs and last_update_wins compare), not the time
    it was applied, whatever the target session's time zone."""
    rig = ts_rig
    name = f"ts_{rig.slot}"  # an origin of this test's own
    url = rig.target_url + KATHMANDU
    rig.both("CREATE TABLE c (id int PRIMARY KEY)")
    rig.publish("c")
    rig.init(apply_name=name, target_url=url)
    rig.src("INSERT INTO c VALUES (1)")
    rig.src("INSERT INTO c VALUES (2)")
    time.sleep(1.1)
    started = time.time()
    try:  # each transaction a target commit of its own
        rig.catchup(apply_name=name, target_url=url, apply_group_commit_delay=0.0)
        ((lsn, commit_time),) = rig.tgt("SELECT lsn, commit_time FROM applier_progress WHERE name = %s", [name])
        rows, origin = committed(rig, name)
        assert rows[1][0] == commit_time, (rows, commit_time)  # the last one's time, as the stream gave it
        assert rows[0][0] < rows[1][0] and rows[1][1] < started - 1.0, rows  # the source's times, before the apply
        assert origin == [LSN.parse(lsn)], (origin, lsn)
    finally:
        drop_origin(rig, name)


def test_a_commit_without_a_progress_write_carries_the_source_commits_end_and_time(ts_rig: Rig) -> None:
    """``Target.commit`` given a source commit's end and time with no progress write in its transaction (the
    contract allows it) still sets the origin's position and the commit timestamp, as one with the write does."""
    rig = ts_rig
    name = f"bare_{rig.slot}"
    rig.tgt("CREATE TABLE c (id int PRIMARY KEY)")
    target = PostgresTarget(rig.target_url + KATHMANDU, name)
    try:
        target.begin()
        target.cur.execute("INSERT INTO c VALUES (1)")
        target.commit(LSN.parse("1/2345678"), 849_000_000_123_456)
        rows, origin = committed(rig, name)
        assert [us for us, _ in rows] == [849_000_000_123_456], rows
        assert origin == [LSN.parse("1/2345678")], origin
    finally:
        target.close()
        drop_origin(rig, name)


# -- restarts: resolved once, recorded once -----------------------------------------------------------------


LOCAL_EVERY = 7  # the target holds a local row for every 7th log id: the source's insert of it is insert_exists
LOCAL_UP_TO = 20000
KILLS = 5


@pytest.mark.parametrize("pg_install", [NEWEST_PG], indirect=True, ids=lambda v: f"pg{v}")
@pytest.mark.parametrize("target", ["pg", "sqlite"], indirect=True)
def test_sigkill_while_resolving_conflicts_resolves_each_once(source_db: ScratchDb, target: Target,
                                                              tmp_path: Path) -> None:
    seed = crash._seed()
    where = f"[seed {seed}, target {target.kind}]"
    rng = random.Random(seed)
    config, cfg = crash.setup(source_db, target, tmp_path)
    with config.open("a") as f:
        f.write('[conflicts]\ninsert_exists = "apply_remote"\n')
    local = (f"WITH RECURSIVE g(x) AS (SELECT {LOCAL_EVERY} UNION ALL SELECT x + {LOCAL_EVERY} FROM g "
             f"WHERE x + {LOCAL_EVERY} <= {LOCAL_UP_TO}) INSERT INTO log (id, note) SELECT x, 'local' FROM g")
    target.execute_script(local, local)
    daemon = crash.Daemon(config, tmp_path / "daemon.log")
    hammer = crash.Hammer(source_db.dsn, rng.randrange(2**32))
    hammer.start()
    mid_txn = 0
    last_pid: int | None = None
    try:
        for i in range(KILLS):
            daemon.start()
            last_pid = crash.wait_streaming(source_db, daemon, last_pid)
            time.sleep(rng.uniform(0.3, 1.2))
            assert daemon.proc is not None and daemon.proc.poll() is None, f"{where} cycle {i}:\n{daemon.tail()}"
            deadline = time.monotonic() + 1.0
            inside = crash.target_in_transaction(target)
            while not inside and time.monotonic() < deadline:
                time.sleep(0.005)
                inside = crash.target_in_transaction(target)
            mid_txn += inside
            daemon.signal(signal.SIGKILL)
            daemon.wait(10)
    finally:
        daemon.ensure_dead()
        hammer.stop()
    during = target.query("SELECT count(*) FROM applier_conflicts")[0][0]
    assert during > 0, f"{where}: no conflict was resolved while the daemon ran:\n{daemon.tail()}"
    assert mid_txn >= 2, f"{where}: only {mid_txn} kills landed inside a target transaction"
    result = crash.catchup(config)
    assert result.returncode == 0, f"{where}: catchup failed:\n{result.stdout}\n{result.stderr}"
    n = source_db.cluster.execute("SELECT max(id) FROM log", source_db.dbname)[0][0]
    assert n < LOCAL_UP_TO, where
    target.execute_script(f"DELETE FROM log WHERE id > {n}", f"DELETE FROM log WHERE id > {n}")  # never sent
    crash.check_result(source_db, target, where)  # every local row overwritten, each transaction applied once
    rows = target.query("SELECT conflict_type, table_name, key, resolution FROM applier_conflicts")
    table = "public.log" if target.kind == "pg" else "log"
    expected = {f"(id)=({i})" for i in range(LOCAL_EVERY, n + 1, LOCAL_EVERY)}
    assert len(rows) == len(expected), f"{where}: {len(rows)} conflicts recorded for {len(expected)} local rows"
    assert {r[2] for r in rows} == expected, where
    assert {(r[0], r[1], r[3]) for r in rows} == {("insert_exists", table, "apply_remote")}, where


def test_rows_a_copy_wrote_are_not_local_changes(ts_rig: Rig) -> None:
    """Rows written on the target before the table's copy finished (``applier_sync_tables.finished_at``: what
    `applier sync --table` records) are applier's, not someone else's: updating them is no *_origin_differs; a row
    changed on the target after the copy is."""
    rig = ts_rig
    rig.both("CREATE TABLE c (id int PRIMARY KEY, v text)")
    rig.publish("c")
    rig.src("INSERT INTO c VALUES (1, 'a'), (2, 'b')")
    rig.tgt("INSERT INTO c VALUES (1, 'a'), (2, 'b')")  # as the copy wrote them, without applier's origin
    time.sleep(1.1)
    rig.init()
    rig.tgt("INSERT INTO applier_sync_tables (name, schema_name, table_name, state, snapshot_lsn, run, started_at, "
            "finished_at) VALUES ('applier', 'public', 'c', 'ready', %s, 'r', %s, %s)",
            [str(rig.wal_lsn()), *[time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())] * 2])
    time.sleep(2.1)  # past the copy's finish (kept to the second, so a second is added)
    rig.tgt("UPDATE c SET v = 'local' WHERE id = 2")
    rig.src("UPDATE c SET v = 'remote'")
    rig.catchup(conflicts_update_origin_differs="keep_local")
    assert rig.tgt("SELECT id, v FROM c ORDER BY id") == [(1, "remote"), (2, "local")]
    assert [(r.type, r.key) for r in recorded(rig)] == [("update_origin_differs", "(id)=(2)")]


# -- bad input and faults -------------------------------------------------------------------------------


@pytest.mark.parametrize("target_kind", ["sqlite"])
def test_bad_conflict_settings_are_one_line_and_exit_2(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1)")
    cases: list[tuple[dict[str, Any], dict[str, str], list[str]]] = [
        ({"conflicts_insert_exits": "skip"}, {}, ["conflicts.insert_exits"]),
        ({"conflicts_insert_exists": "overwrite"}, {}, ["conflicts.insert_exists", "'overwrite'", "apply_remote"]),
        ({"conflicts_insert_exists": "last_update_wins"}, {}, ["conflicts.insert_exists", "'last_update_wins'"]),
        ({"conflicts_update_origin_differs": "newest"}, {}, ["conflicts.update_origin_differs", "last_update_wins"]),
        ({"conflicts_prune_after": "7x"}, {}, ["conflicts.prune_after", "'7x'"]),
        ({}, {"APPLIER_CONFLICTS_DELETE_MISSING": "ignore"}, ["APPLIER_CONFLICTS_DELETE_MISSING", "'ignore'"]),
    ]
    configs = [rig.config_file(f"bad{i}.toml", **keys) for i, (keys, _, _) in enumerate(cases)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda i: run_cli("catchup", "-c", str(configs[i]), env=cases[i][1], timeout=60),
                                range(len(cases))))
    for (keys, env, words), r in zip(cases, results):
        assert r.returncode == 2, (keys, env, r.stderr)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("applier: error: "), r.stderr
        assert all(w in lines[0] for w in words), (words, lines[0])
    assert rig.tgt("SELECT count(*) FROM t") == [(0,)]  # nothing applied
    assert rig.progress_lsn() == 0


def test_unwritable_conflict_table_stops_before_anything_is_applied(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'one')")
    rig.catchup()
    applied = rig.progress_lsn()
    rig.tgt("INSERT INTO t VALUES (3, 'local')")
    rig.src("INSERT INTO t VALUES (2, 'two')")  # no conflict, before the one that needs the table
    rig.src("INSERT INTO t VALUES (3, 'remote')")

    def refused(url: str) -> None:
        r = run_cli("catchup", "-c", str(rig.config_file(target_url=url, conflicts_insert_exists="apply_remote")))
        assert r.returncode != 0, r.stderr
        assert "applier_conflicts" in one_error_line(r)
        assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "one"), (3, "local")], r.stderr
        assert rig.progress_lsn() == applied

    if rig.target is not None:  # a role that may write everything but applier_conflicts, or but its id sequence
        for n, revoke in enumerate(("REVOKE INSERT ON applier_conflicts",
                                    "REVOKE USAGE ON SEQUENCE applier_conflicts_id_seq")):
            role = f"writer{n}_{rig.target.dbname[-8:]}"
            rig.tgt(f"CREATE ROLE {role} LOGIN")
            try:
                rig.tgt(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}; "
                        f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}; {revoke} FROM {role}")
                refused(rig.target_url.replace("//postgres@", f"//{role}@"))
            finally:
                rig.tgt(f"DROP OWNED BY {role}; DROP ROLE {role}")
    rig.tgt("DROP TABLE applier_conflicts")
    refused(rig.target_url)


# -- what an operator sees: metrics, status, the conflicts command ----------------------------------------


def counts_in(obj: Any) -> dict[str, int] | None:
    """The first mapping in a JSON document whose keys are conflict types (counts by type)."""
    if isinstance(obj, dict):
        if obj and set(obj) <= set(CONFLICT_TYPES) and all(isinstance(v, int) for v in obj.values()):
            return obj
        for v in obj.values():
            if (found := counts_in(v)) is not None:
                return found
    if isinstance(obj, list):
        for v in obj:
            if (found := counts_in(v)) is not None:
                return found
    return None


def test_metrics_status_and_prune(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.both("CREATE TABLE u (id int PRIMARY KEY, v text)")
    rig.publish("t", "u")
    rig.init()
    rig.src("INSERT INTO u VALUES (1, 'a'), (2, 'b')")
    rig.catchup()
    rig.tgt("INSERT INTO t VALUES (1, 'local'), (2, 'local')")
    rig.tgt("DELETE FROM u WHERE id IN (1, 2)")
    port = free_port()
    config = rig.config_file(metrics_listen=f"127.0.0.1:{port}", conflicts_insert_exists="apply_remote")
    t, u = tname(rig, "t"), tname(rig, "u")
    with daemon(rig, config) as (proc, err):
        rig.src("INSERT INTO t VALUES (1, 'r1'), (2, 'r2'), (3, 'r3')")
        rig.src("UPDATE u SET v = 'x' WHERE id = 1")
        rig.src("DELETE FROM u WHERE id = 2")
        done = scrape_until(port, "three kinds of conflict", lambda m: len(by_label(
            m, "applier_conflicts_total", "type", "table")) == 3, proc, err)
        assert by_label(done, "applier_conflicts_total", "type", "table") == {
            ("insert_exists", t): 2, ("update_missing", u): 1, ("delete_missing", u): 1}
        assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "r1"), (2, "r2"), (3, "r3")]
    assert "insert_exists" in err.read_text()  # logged too
    counts = {"insert_exists": 2, "update_missing": 1, "delete_missing": 1}

    s = run_cli("status", "-c", str(config), "--json")
    assert s.returncode == 0, s.stderr
    assert counts_in(json.loads(s.stdout)) == counts, s.stdout
    s = run_cli("status", "-c", str(config))
    assert s.returncode == 0, s.stderr
    shown = [line for line in s.stdout.splitlines() if "conflict" in line.lower() or "insert_exists" in line]
    assert shown and all(re.search(rf"{k}\W+{n}\b", "\n".join(shown)) for k, n in counts.items()), s.stdout

    listed = run_cli("conflicts", "-c", str(config))
    assert listed.returncode == 0, listed.stderr
    assert "insert_exists" in listed.stdout and "(id)=(2)" in listed.stdout and t in listed.stdout, listed.stdout

    # two old rows, and one of another apply.name that is never pruned by this one
    rig.tgt("UPDATE applier_conflicts SET recorded_at = '2000-01-01T00:00:00Z' WHERE conflict_type = 'insert_exists'")
    rig.tgt("INSERT INTO applier_conflicts (name, recorded_at, conflict_type, table_name, key, local_row, remote_row, "
            "xid, commit_lsn, commit_time, policy, resolution) SELECT 'other', recorded_at, conflict_type, table_name, "
            "key, local_row, remote_row, xid, commit_lsn, commit_time, policy, resolution FROM applier_conflicts "
            "WHERE conflict_type = 'insert_exists' AND key = '(id)=(1)'")
    pruned = run_cli("conflicts", "-c", str(config), "--prune", "7d")
    assert pruned.returncode == 0, pruned.stderr
    assert PRUNED_2.search(pruned.stdout), pruned.stdout
    name = rig.cfg().apply["name"]
    assert sorted(rig.tgt("SELECT name, conflict_type FROM applier_conflicts")) == [
        (name, "delete_missing"), (name, "update_missing"), ("other", "insert_exists")]
    # conflicts.prune_after: a session trims at its start
    rig.tgt(f"UPDATE applier_conflicts SET recorded_at = '2001-01-01T00:00:00Z' WHERE name = '{name}' "
            "AND conflict_type = 'update_missing'")
    rig.catchup(conflicts_prune_after="7d")
    assert sorted(rig.tgt("SELECT name, conflict_type FROM applier_conflicts")) == [
        (name, "delete_missing"), ("other", "insert_exists")]
    time.sleep(1.1)
    pruned = run_cli("conflicts", "-c", str(config), "--prune", "1s")
    assert pruned.returncode == 0, pruned.stderr
    assert re.search(r"\bpruned\b\D*\b1\b", pruned.stdout, re.IGNORECASE), pruned.stdout
    assert rig.tgt("SELECT name FROM applier_conflicts") == [("other",)]

    bad = run_cli("conflicts", "-c", str(config), "--prune", "7x")
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("applier: error: ") and "'7x'" in lines[0], bad.stderr
    assert "--prune" in lines[0], lines[0]
    assert rig.tgt("SELECT count(*) FROM applier_conflicts") == [(1,)]
