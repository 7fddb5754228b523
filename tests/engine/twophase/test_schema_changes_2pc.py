"""Schema changes followed (``apply.schema_changes = "add_columns"``) by streamed and prepared transactions.

A streamed transaction binds its tables when it is replayed at its commit: the column goes in that target
transaction. A prepared transaction kept in ``applier_prepared`` (SQLite, ``two_phase_mode = "table"``) is
replayed at COMMIT PREPARED: likewise. One prepared on the target (PREPARE TRANSACTION) may not add it: the
ALTER TABLE would keep the table locked until COMMIT PREPARED; that is one error saying so, and once the column
is added by hand the transaction is prepared and committed as usual.
"""

from __future__ import annotations

import pytest

from applier.decoder.messages import StreamCommit
from applier.errors import ApplyError

from .conftest import BIG, TpRig
from .test_two_phase import assert_waiting, prepare

FOLLOW = {"apply.schema_changes": "add_columns"}


def test_added_column_used_by_a_streamed_transaction(tp: TpRig) -> None:
    """A column added on the source, first used by a transaction large enough to be streamed: added on the
    target when the transaction is replayed, its values there."""
    rig = tp
    rig.extra.update(FOLLOW)
    rig.setup()
    rig.tx("INSERT INTO t VALUES (1, 'one', 0)")
    rig.src("ALTER TABLE t ADD COLUMN z bigint")
    rig.tx(f"INSERT INTO t SELECT g, 'big', 0, g * 10000000000 FROM generate_series(10, {10 + BIG}) g",
           f"INSERT INTO log SELECT g, 'big' FROM generate_series(1, {BIG}) g")
    assert any(type(m) is StreamCommit for m in rig.peek()), "expected the transaction to be streamed"
    rig.catchup()
    assert rig.tgt("SELECT z FROM t WHERE id IN (1, 10) ORDER BY id") == [(None,), (100000000000,)]
    rig.assert_same()


def test_added_column_used_by_a_prepared_transaction(tp: TpRig) -> None:
    """A column added on the source, first used by a prepared transaction: kept in the table, it is added at
    COMMIT PREPARED; prepared on the target, it is refused naming the way out, then prepared once added by hand."""
    rig = tp
    rig.extra.update(FOLLOW)
    rig.setup()
    rig.src("ALTER TABLE t ADD COLUMN z bigint")
    x1 = prepare(rig, "g1", "INSERT INTO t VALUES (1, 'one', 0, 5000000000)")
    if rig.native_prepare():
        with pytest.raises(ApplyError) as err:
            rig.catchup()
        msg = str(err.value)
        assert "\n" not in msg
        assert "target table public.t needs column 'z' added as bigint" in msg
        assert f"source transaction {x1} is prepared on the target" in msg
        assert rig.pg_prepared_gids() == []  # nothing prepared, nothing added
        assert "z" not in [r[0] for r in rig.tgt("SELECT attname FROM pg_attribute WHERE attrelid = 't'::regclass")]
        rig.tgt("ALTER TABLE t ADD COLUMN z bigint")
    rig.catchup()
    assert_waiting(rig, {"g1": x1})
    rig.tx("COMMIT PREPARED 'g1'")
    rig.catchup()
    assert_waiting(rig, {})
    assert rig.tgt("SELECT id, z FROM t") == [(1, 5000000000)]
    rig.assert_same()
