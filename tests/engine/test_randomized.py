"""Exactly-once under seeded random workloads: source and target must end up identical.

Every combination of target kind (PostgreSQL, SQLite) and source major version
gets the same shape of test: tables covering many column types (``workload.TABLES``:
composite key, REPLICA IDENTITY FULL without a key and with duplicate rows,
names that need quoting, the same table name in two schemas), then rounds of
random transactions (inserts, updates, key changes, deletes, bulk statements,
truncates, savepoints rolled back or released, whole transactions rolled back,
transactions touching only unpublished tables) each followed by an in-process
``Runner(cfg, catchup=True).run()`` that resumes where the previous one stopped.
After every round each table is compared whole (``workload.compare``), and the
engine may not have logged any warning (no row missing on the target, no apply
error retried row by row).

Rounds vary the apply settings so resume crosses them: default grouping, one
target transaction per source transaction, streaming of large transactions, and
binary mode (whose values must be exactly text mode's, on either target).

The seed is random per run unless APPLIER_TEST_SEED is set; it is printed and
named in every failure message.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path

import pytest

from applier.admin import init, read_progress
from applier.engine.runner import Runner
from tests.engine import workload as wl
from tests.engine.conftest import Target, make_cfg
from tests.plugins.clusters import ScratchDb

# (transactions, config overrides) per round
ROUNDS: list[tuple[int, dict[str, object]]] = [
    (120, {}),
    (100, {"apply__group_commit_delay": 0.0}),
    (80, {"source__streaming": True}),
    (60, {"source__binary": True}),  # binary mode must store exactly what text mode stores
]


def _seed() -> int:
    env = os.environ.get("APPLIER_TEST_SEED")
    return int(env) if env else random.randrange(2**32)


def stream_txns(source: ScratchDb, slot: str) -> int:
    """How many transactions the slot has streamed (the walsender reports its statistics as it exits)."""
    deadline = time.monotonic() + 10
    while True:
        rows = source.cluster.execute("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s",
                                      source.dbname, [slot])
        if (rows and rows[0][0]) or time.monotonic() > deadline:
            return rows[0][0] if rows else 0
        time.sleep(0.1)


def setup_replication(source: ScratchDb, target: Target, tmp_path: Path, tables=wl.TABLES):
    """Tables on both sides, the publication on the source, ``applier init``; returns the config."""
    source.cluster.execute(wl.source_ddl(tables), source.dbname)
    target.execute_script(wl.pg_target_ddl(tables), wl.sqlite_target_ddl(tables))
    cfg = make_cfg(source, target, tmp_path / "work")
    init(cfg)
    return cfg


@pytest.mark.parametrize("target", ["pg", "sqlite"], indirect=True)
def test_random_workload_replicates_exactly_once(source_db: ScratchDb, target: Target, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    seed = _seed()
    print(f"seed {seed} (rerun with APPLIER_TEST_SEED={seed})")
    where = f"[seed {seed}, pg{source_db.cluster.install.version}, target {target.kind}]"
    rng = random.Random(seed)
    setup_replication(source_db, target, tmp_path)
    work = wl.Workload(source_db.dsn, rng)
    caplog.set_level(logging.WARNING, logger="applier")
    applied_before = None
    try:
        for i, (n, overrides) in enumerate(ROUNDS, 1):
            work.run(n, big=1)
            if i == 2:
                work.unpublished_only(2)  # the round ends with transactions the slot never sends
            cfg = make_cfg(source_db, target, tmp_path / "work", **overrides)
            summary = Runner(cfg, catchup=True).run()
            assert not summary.errors, f"{where} round {i}: {summary.errors}"
            progress = read_progress(cfg).lsn
            assert summary.goal is not None and progress <= summary.goal, f"{where} round {i}: {summary.line()}"
            if applied_before is not None:
                assert progress >= applied_before, f"{where} round {i}: progress went back"
            applied_before = progress
            problems = wl.compare(source_db.dsn, target.kind, target.ref)
            assert not problems, f"{where} after round {i} ({summary.line()}):\n" + "\n".join(problems)
            if overrides.get("source__streaming"):
                streamed = stream_txns(source_db, cfg.source["slot"])
                assert streamed > 0, f"{where} round {i}: nothing was streamed, the spool path went untested"
            noisy = [r.getMessage() for r in caplog.records if r.name.startswith("applier")]
            assert not noisy, f"{where} round {i}: the engine warned: {noisy[:5]}"
        # A last catch-up with nothing new applies nothing and moves nothing.
        summary = Runner(make_cfg(source_db, target, tmp_path / "work"), catchup=True).run()
        assert summary.transactions == 0 and summary.rows == 0, f"{where}: {summary.line()}"
        assert read_progress(make_cfg(source_db, target, tmp_path / "work")).lsn == applied_before, where
    finally:
        print(f"{where} committed {work.committed}, rolled back {work.rolled_back}, ops {dict(work.ops)}")
        work.close()
    # Enough of everything happened for the comparison to mean something.
    assert work.committed > 200 and work.ops["update_key"] > 10 and work.ops["savepoint_rollback"] > 5, where


@pytest.mark.parametrize("target", ["pg", "sqlite"], indirect=True)
def test_rows_swapping_unique_values_apply_in_source_order(source_db: ScratchDb, target: Target, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Two rows exchange the values of a UNIQUE column (through a temporary value), in one transaction
    and across three: valid in source order only, so the target must not reorder changes across rows
    (PostgreSQL's own subscriber applies them one by one). No apply error, no row-by-row retry."""
    tables = (wl.SWAP,)
    cfg = setup_replication(source_db, target, tmp_path, tables)
    sql = f"UPDATE {wl.SWAP.pg} SET email = %s WHERE id = %s"
    with wl.pg_connect(source_db.dsn) as conn:
        conn.execute(f"INSERT INTO {wl.SWAP.pg} VALUES (1, 'a', 0), (2, 'b', 0), (3, 'c', 0)")
        Runner(cfg, catchup=True).run()  # the rows exist on the target before they swap
        with conn.transaction():
            for email, rid in (("tmp1", 1), ("a", 2), ("b", 1)):
                conn.execute(sql, [email, rid])
        for email, rid in (("tmp2", 3), ("c", 1), ("b", 3)):  # three transactions
            conn.execute(sql, [email, rid])
    caplog.set_level(logging.WARNING, logger="applier")
    summary = Runner(cfg, catchup=True).run()
    assert not summary.errors, summary.errors
    problems = wl.compare(source_db.dsn, target.kind, target.ref, tables)
    assert not problems, "\n".join(problems)
    noisy = [r.getMessage() for r in caplog.records if r.name.startswith("applier")]
    assert not noisy, f"the engine had to retry: {noisy}"
