"""A daemon on a quiet publication must not hold back the source's WAL forever.

When nothing published changes but the source writes other WAL, keepalives carry
the server's WAL end; once everything received is applied, the daemon records
that position on the target and confirms it, so the slot moves on. It never
confirms past what the target recorded.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from applier.admin import init, read_progress
from applier.engine.runner import Runner
from applier.lsn import LSN
from tests.engine.conftest import Target, make_cfg
from tests.plugins.clusters import ScratchDb


def _slot_lsn(source: ScratchDb) -> LSN:
    row = source.cluster.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                                 source.dbname, [source.dbname])
    return LSN.parse(row[0][0])


@pytest.mark.parametrize("target", ["pg", "sqlite"], indirect=True)
def test_quiet_publication_lets_the_slot_advance(source_db: ScratchDb, target: Target, tmp_path: Path) -> None:
    src = source_db
    src.cluster.execute("CREATE TABLE pub_t (id int PRIMARY KEY, v text); CREATE TABLE other (id serial, v text);"
                        "CREATE PUBLICATION applier_pub FOR TABLE pub_t", src.dbname)
    target.execute_script("CREATE TABLE pub_t (id int PRIMARY KEY, v text)",
                          "CREATE TABLE pub_t (id INTEGER PRIMARY KEY, v TEXT)")
    cfg = make_cfg(src, target, tmp_path / "work", source__status_interval=0.5)
    init(cfg)
    src.cluster.execute("INSERT INTO pub_t VALUES (1, 'a')", src.dbname)
    stop = threading.Event()
    runner = Runner(cfg, catchup=False, stop=stop)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while read_progress(cfg).lsn == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        after_commit = read_progress(cfg).lsn
        assert after_commit > 0, "the published insert was not applied"
        # WAL that publishes nothing
        for _ in range(20):
            src.cluster.execute("INSERT INTO other (v) SELECT repeat('x', 100) FROM generate_series(1, 200)", src.dbname)
        wal_now = LSN.parse(src.cluster.execute("SELECT pg_current_wal_insert_lsn()::text", src.dbname)[0][0])
        deadline = time.monotonic() + 30
        while _slot_lsn(src) < wal_now - 8192 and time.monotonic() < deadline:
            time.sleep(0.2)
        recorded = read_progress(cfg).lsn
        slot = _slot_lsn(src)
        assert slot > after_commit, "the slot stayed at the last published commit"
        assert slot <= recorded, "the slot was confirmed past what the target recorded"
        # published changes after the quiet spell still arrive
        src.cluster.execute("INSERT INTO pub_t VALUES (2, 'b')", src.dbname)
        deadline = time.monotonic() + 20
        while len(target.query("SELECT id FROM pub_t")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(r[0] for r in target.query("SELECT id FROM pub_t")) == [1, 2]
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
