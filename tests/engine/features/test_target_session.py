"""What a PostgreSQL target's session keeps from one group to the next: prepared statements and durability.

The fast path prepares its statements on the target session (``PostgresTarget._send``), by text and the target
columns' types, and a table is bound anew at every Relation message, which the source sends again after any
invalidation of the table (an ALTER TABLE, even one that changes nothing published). What a DBA checks in the
applying session's ``pg_prepared_statements``: a table bound again unchanged uses its statements again, the session
never holds more than ``PREPARED_MAX`` statements, and the statements in use are among them. A group the target
refuses leaves the session able to apply the next one. A commit is reported durable (what may be confirmed to the
source) once the target has flushed it, with no later commit needed.
"""

from __future__ import annotations

import time

import pytest

from applier.decoder.messages import PgOutputMessage, Relation
from applier.errors import ApplyError
from applier.lsn import LSN
from applier.targets.postgres import target as postgres

from .conftest import Rig

ROUNDS = 12


def apply_holding(rig: Rig, msgs: list[PgOutputMessage]) -> list[str]:
    """Apply ``msgs`` in one session on the fast path; the statements the session holds prepared at its end."""
    engine = rig.engine(group_delay=0)
    try:
        for m in msgs:
            engine.handle(m)
        engine.flush_group()
        return [s for (s,) in engine.target.conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()]
    finally:
        engine.close()
        engine.target.close()


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
    msgs = rig.decoded()
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
    held = apply_holding(rig, rig.decoded())
    assert 0 < len(held) <= postgres.PREPARED_MAX, held
    assert any(s.startswith("WITH c AS (UPDATE") and '"t5"' in s for s in held), held  # the last one used
    for t in tables:
        assert rig.tgt(f"SELECT id, v FROM {t} ORDER BY id") == [(1, "v"), (2, "u1"), (3, "v")]



def test_a_session_goes_on_after_a_group_the_target_refused(rig: Rig) -> None:
    """A failing statement makes the server skip the rest of its pipeline, PREPAREs of statements not used yet
    included: those are prepared again when next used, so the same session applies the next transaction."""
    if rig.target is None:
        pytest.skip("prepared statements are the PostgreSQL target's")
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt("ALTER TABLE t ADD CONSTRAINT no_bad CHECK (v <> 'bad')")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'bad')")
    rig.src("INSERT INTO t VALUES (2, 'good')")
    msgs = rig.decoded()
    second = [i for i, m in enumerate(msgs) if type(m).__name__ == "Begin"][1]
    engine = rig.engine(group_delay=0)
    try:
        with pytest.raises(ApplyError, match="no_bad"):  # its commit's statements were prepared after the failure
            for m in msgs[:second]:
                engine.handle(m)
        for m in msgs[second:]:
            engine.handle(m)
        engine.flush_group()
    finally:
        engine.close()
        engine.target.close()
    assert rig.tgt("SELECT id, v FROM t") == [(2, "good")]
    assert rig.progress_lsn() > LSN(0)


def test_a_commit_becomes_durable_without_a_later_one(rig: Rig) -> None:
    """With ``synchronous_commit = off`` (the default) a commit sends nothing to learn where it sits in the WAL:
    ``durable_lsn`` places it when next asked, and reports it once the target has flushed that far, with no later
    commit needed (the slot of a replica gone quiet is confirmed up to its last transaction)."""
    if rig.target is None:
        pytest.skip("the PostgreSQL target's asynchronous commit")
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'v')")
    engine = rig.engine(group_delay=0)
    try:
        for m in rig.decoded():
            engine.handle(m)
        engine.flush_group()
        applied = engine.applied
        assert applied > LSN(0) and rig.progress_lsn() == applied
        deadline = time.monotonic() + 10
        while (durable := engine.target.durable_lsn()) < applied and time.monotonic() < deadline:
            time.sleep(0.05)  # the target's WAL writer flushes within wal_writer_delay
    finally:
        engine.close()
        engine.target.close()
    assert durable == applied
