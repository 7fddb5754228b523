"""``applier check``: every start-up check printed with ok/fail, exit 0 only if all pass, nothing created or changed.
The installed script against real servers: a good setup (PostgreSQL and SQLite targets), then one mistake at a time
(a missing publication, wal_level, a target table missing a column, a missing slot, an uninitialized target, a
running applier), each named on its own line with a non-zero exit.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from applier.progress.store import CONTROL_TABLES
from applier.sandbox.clusters import PgInstall, find_install
from tests.cli.opsrig import SLOT, Rig
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db

CHECKS = ["config", "source connection", "source privileges", "wal_level", "publications", "DDL capture",
          "replication connection",
          "slot", "slot state", "target", "slot and progress", "target tables", "claim"]


def states(r: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """check name -> ok/fail/skip, from the output."""
    out = {}
    for line in r.stdout.splitlines():
        state, _, rest = line.partition(" ")
        out[rest.strip().partition(":")[0]] = state
    return out


def failed(r: subprocess.CompletedProcess[str]) -> set[str]:
    return {name for name, state in states(r).items() if state != "ok"}


@pytest.fixture(params=["postgresql", "sqlite"])
def rig(request: pytest.FixtureRequest, source_db: ScratchDb, target_db: ScratchDb, tmp_path: Path) -> Iterator[Rig]:
    rig = Rig.make(source_db, target_db if request.param == "postgresql" else None, tmp_path)
    rig.prepare("init")
    yield rig


def test_passes_on_a_good_setup_and_changes_nothing(rig: Rig) -> None:
    rig.src("INSERT INTO t VALUES (1, 'pending')")
    before = (rig.slots(), rig.target_tables(), rig.src("SELECT confirmed_flush_lsn::text FROM pg_replication_slots"))
    r = rig.applier("check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(states(r)) == CHECKS and set(states(r).values()) == {"ok"}, r.stdout
    assert r.stderr == ""
    assert (rig.slots(), rig.target_tables(),
            rig.src("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")) == before
    assert rig.tgt("SELECT count(*) FROM t") == [(0,)]  # nothing applied


def test_names_each_failing_check(rig: Rig) -> None:
    cases = {
        "missing_publication": ({"source": {"publications": ["pub", "nope"]}}, {"publications", "target tables"},
                                "'nope'"),
        "missing_slot": ({"source": {"slot": "nosuch"}}, {"slot", "slot state", "slot and progress"}, "'nosuch'"),
        "uninitialized_target": ({"target": {"url": f"sqlite:///{rig.sqlite_path.with_name('new.db')}"}},
                                 {"target", "slot and progress", "target tables", "claim"}, "applier init"),
    }
    for name, (changes, expected, words) in cases.items():
        r = rig.applier("check", config=rig.variant(name, **changes))
        assert r.returncode != 0, (name, r.stdout)
        assert failed(r) == expected, (name, r.stdout)
        assert words in r.stdout, (name, r.stdout)
        assert r.stderr.startswith("applier: error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert rig.slots() == {SLOT}  # the missing slot was not made
    assert not rig.sqlite_path.with_name("new.db").exists()  # nor the target file

    rig.tgt("ALTER TABLE t DROP COLUMN v")
    r = rig.applier("check")
    assert r.returncode != 0
    assert failed(r) == {"target tables"}, r.stdout
    assert f"table {'public.t' if rig.target is not None else 't'}: column v: missing on the target" in r.stdout


def test_a_target_role_that_cannot_change_a_table_fails(source_db: ScratchDb, target_db: ScratchDb,
                                                          tmp_path: Path) -> None:
    rig = Rig.make(source_db, target_db, tmp_path)
    rig.prepare("init")
    role = f"ops_{target_db.dbname}"
    rig.tgt(f"CREATE ROLE {role} LOGIN")
    try:
        rig.tgt(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}; "
                f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}; REVOKE UPDATE, DELETE ON t FROM {role}")
        url = target_db.url.replace("postgres@", f"{role}@")
        r = rig.applier("check", config=rig.variant("reader", target={"url": url}))
        assert r.returncode != 0
        assert failed(r) == {"target tables"}, r.stdout
        assert 'table public.t: the target role lacks UPDATE, DELETE on it' in r.stdout
    finally:
        rig.tgt(f"DROP OWNED BY {role}; DROP ROLE {role}")


def test_a_running_applier_fails_slot_state_and_claim(rig: Rig) -> None:
    daemon = rig.start_daemon()
    try:
        r = rig.applier("check")
    finally:
        daemon.terminate()
        daemon.communicate(timeout=60)
    assert r.returncode == 5
    assert failed(r) == {"slot state", "claim"}, r.stdout
    assert "applier run (pid " in r.stdout


@pytest.fixture
def replica_wal_source(pg_clusters: ClusterPool) -> Iterator[ScratchDb]:
    cluster = pg_clusters.get(find_install(), "wal-replica", {"wal_level": "replica"})
    with scratch_db(cluster, "src") as db:
        yield db


def test_wal_level_replica_fails(replica_wal_source: ScratchDb, tmp_path: Path) -> None:
    rig = Rig.make(replica_wal_source, None, tmp_path)
    r = rig.applier("check")
    assert r.returncode == 2
    assert "fail  wal_level: source: wal_level is 'replica'" in r.stdout, r.stdout
    assert {"wal_level", "slot", "target"} <= failed(r)
    assert rig.slots() == set() and rig.target_tables() == set()
    assert set(CONTROL_TABLES).isdisjoint(rig.target_tables())


@pytest.fixture
def small_wal_keep_source(pg_clusters: ClusterPool, pg_install: PgInstall) -> Iterator[ScratchDb]:
    cluster = pg_clusters.get(pg_install, "slot-keep", {"max_slot_wal_keep_size": "1MB", "min_wal_size": "32MB"})
    with scratch_db(cluster, "src") as db:
        yield db


def test_an_invalidated_slot_fails_slot_state(small_wal_keep_source: ScratchDb, tmp_path: Path) -> None:
    rig = Rig.make(small_wal_keep_source, None, tmp_path)
    rig.prepare("init")
    for _ in range(4):  # past max_slot_wal_keep_size: the next checkpoint removes the WAL the slot holds
        rig.src("INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series(1, 5000) g; DELETE FROM t")
        rig.src("SELECT pg_switch_wal()")
    rig.src("CHECKPOINT")
    assert rig.src("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", [SLOT]) == [("lost",)]
    r = rig.applier("check")
    assert r.returncode == 6
    assert "slot state" in failed(r), r.stdout
    assert f"fail  slot state: replication slot '{SLOT}' was invalidated on the source (wal_removed" in r.stdout, \
        r.stdout
