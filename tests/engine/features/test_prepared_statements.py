"""Prepared statements on a PostgreSQL target over a long session.

The fast path prepares its statements on the target session (``PostgresTarget._send``), per binding, and a table
is bound anew at every Relation message, which the source sends again after any invalidation of the table (any
catalog change to it, even one that changes nothing published). What a DBA checks in the applying session's ``pg_prepared_statements``: it never holds more
than ``PREPARED_MAX`` statements, and the statements in use are among them however many bindings came before.
"""

from __future__ import annotations

import pytest

from applier.decoder import Decoder, XLogData
from applier.decoder.messages import Relation
from applier.engine.apply import ApplyEngine
from applier.inspect import open_peek_source
from applier.targets import opener, postgres

from .conftest import Rig

ROUNDS = 12


def test_a_long_session_keeps_its_statements_prepared_and_bounded(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    if rig.target is None:
        pytest.skip("prepared statements are the PostgreSQL target's")
    monkeypatch.setattr(postgres, "PREPARED_MAX", 5)
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 3) g")
    for k in range(ROUNDS):  # each transaction after the table's invalidation: its Relation message comes again
        rig.src(f"UPDATE t SET v = 'u{k}' WHERE id = {k % 3 + 1}")
        rig.src(f"ALTER TABLE t ALTER COLUMN v SET STATISTICS {100 + k}")
    src = open_peek_source(rig.cfg())
    decoder = Decoder()
    msgs = []
    try:
        while (frame := src.read(1.0)) is not None:
            if type(frame) is XLogData:
                msgs.append(decoder.decode(frame.payload))
    finally:
        src.close()
    assert sum(isinstance(m, Relation) for m in msgs) == ROUNDS  # one before each update

    target = opener.open(rig.cfg())
    engine = ApplyEngine(target, applied=target.read_progress().lsn, work_dir=rig.tmp / "spool", group_delay=0)
    try:
        for m in msgs:
            engine.handle(m)
        engine.flush_group()
        held = [s for (s,) in target.conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()]
    finally:
        engine.close()
        target.close()
    assert 0 < len(held) <= postgres.PREPARED_MAX, held
    assert any(s.startswith("WITH c AS (UPDATE") for s in held), held  # the last update's, after 12 bindings
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "u9"), (2, "u10"), (3, "u11")]
