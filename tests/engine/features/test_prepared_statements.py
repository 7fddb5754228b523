"""Prepared statements on a PostgreSQL target over a long session.

The fast path prepares its statements on the target session (``PostgresTarget._send``), by text and the target
columns' types, and a table is bound anew at every Relation message, which the source sends again after any
invalidation of the table (an ALTER TABLE, even one that changes nothing published). What a DBA checks in the
applying session's ``pg_prepared_statements``: a table bound again unchanged uses its statements again, the session
never holds more than ``PREPARED_MAX`` statements, and the statements in use are among them.
"""

from __future__ import annotations

import pytest

from applier.decoder import Decoder, XLogData
from applier.decoder.messages import PgOutputMessage, Relation
from applier.engine.apply import ApplyEngine
from applier.inspect import open_peek_source
from applier.targets import opener, postgres

from .conftest import Rig

ROUNDS = 12


def pending(rig: Rig) -> list[PgOutputMessage]:
    """The slot's pending messages, decoded (the slot is peeked, not consumed)."""
    src = open_peek_source(rig.cfg())
    decoder = Decoder()
    msgs = []
    try:
        while (frame := src.read(1.0)) is not None:
            if type(frame) is XLogData:
                msgs.append(decoder.decode(frame.payload))
    finally:
        src.close()
    return msgs


def apply_holding(rig: Rig, msgs: list[PgOutputMessage]) -> list[str]:
    """Apply ``msgs`` in one session on the fast path; the statements the session holds prepared at its end."""
    target = opener.open(rig.cfg())
    engine = ApplyEngine(target, applied=target.read_progress().lsn, work_dir=rig.tmp / "spool", group_delay=0)
    try:
        for m in msgs:
            engine.handle(m)
        engine.flush_group()
        return [s for (s,) in target.conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()]
    finally:
        engine.close()
        target.close()


def test_a_table_bound_again_unchanged_uses_its_statements_again(rig: Rig) -> None:
    if rig.target is None:
        pytest.skip("prepared statements are the PostgreSQL target's")
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t SELECT g, 'v' FROM generate_series(1, 3) g")
    for k in range(ROUNDS):  # each update after the table's invalidation: its Relation message comes again
        rig.src(f"UPDATE t SET v = 'u{k}' WHERE id = {k % 3 + 1}")
        rig.src(f"ALTER TABLE t ALTER COLUMN v SET STATISTICS {100 + k}")
    msgs = pending(rig)
    assert sum(isinstance(m, Relation) for m in msgs) == ROUNDS  # the insert's, then one after each ALTER
    held = apply_holding(rig, msgs)
    updates = [s for s in held if s.startswith("WITH c AS (UPDATE")]
    assert len(updates) == 1, held
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "u9"), (2, "u10"), (3, "u11")]


def test_a_session_holds_at_most_prepared_max_statements(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    if rig.target is None:
        pytest.skip("prepared statements are the PostgreSQL target's")
    monkeypatch.setattr(postgres, "PREPARED_MAX", 3)
    tables = [f"t{n}" for n in range(1, 6)]
    for t in tables:
        rig.both(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
    rig.publish(*tables)
    rig.init()
    for t in tables:
        rig.src(f"INSERT INTO {t} VALUES (1, 'v'), (2, 'v'), (3, 'v')")
    for rnd in range(2):  # a statement per table and one for the commit: more than PREPARED_MAX, twice over
        for t in tables:
            rig.src(f"UPDATE {t} SET v = 'u{rnd}' WHERE id = 2")
    held = apply_holding(rig, pending(rig))
    assert 0 < len(held) <= postgres.PREPARED_MAX, held
    assert any(s.startswith("WITH c AS (UPDATE") and '"t5"' in s for s in held), held  # the last one used
    for t in tables:
        assert rig.tgt(f"SELECT id, v FROM {t} ORDER BY id") == [(1, "v"), (2, "u1"), (3, "v")]

