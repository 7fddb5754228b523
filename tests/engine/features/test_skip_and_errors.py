"""A transaction the target refuses: rolled back whole, reported in one line, skipped on request.

What a user sees: ``applier catchup`` exits non-zero with one ``applier: error:``
line naming the operation, the table, the row's key and the finish LSN of the
source transaction; the target holds none of that transaction's rows and its
recorded progress stops before it; ``applier skip --lsn`` then makes the next
``catchup`` skip exactly that transaction (and log that it did), and apply the
ones after it.
"""

from __future__ import annotations

import re

import pytest

from applier import admin
from applier.decoder.messages import Begin, Commit, Insert, Relation
from applier.errors import ApplyError, FinalError
from applier.lsn import LSN
from tests.plugins.cli import run_cli

from .conftest import Rig

FINISHED_AT = re.compile(r"finished at ([0-9A-F]{1,8}/[0-9A-F]{1,8})\b")
LSN_IN_TEXT = re.compile(r"\b([0-9A-F]{1,8}/[0-9A-F]{1,8})\b")


def error_line(stderr: str) -> str:
    """The one error line of a failed command; it is also the last thing printed."""
    errors = [line for line in stderr.splitlines() if line.startswith("applier: error:")]
    assert len(errors) == 1, stderr
    assert stderr.rstrip().splitlines()[-1] == errors[0], stderr
    return errors[0]


def status(rig: Rig) -> dict:
    """What `applier status` shows (in-process: the command itself is run in test_apply_features.py)."""
    return admin.status(rig.cfg())


def test_refused_transaction_is_rolled_back_reported_and_skipped_once(cli_rig: Rig) -> None:
    rig = cli_rig
    rig.src("CREATE TABLE t (id int PRIMARY KEY, email text)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, email text UNIQUE)")  # the constraint exists only here
    rig.publish("t")
    rig.init()
    cfg = rig.config_file()
    rig.src("INSERT INTO t VALUES (1, 'a@x')")
    rig.catchup()
    rig.src("INSERT INTO t VALUES (2, 'b@x')")  # T1: fine
    before = rig.wal_lsn()
    rig.src("INSERT INTO t VALUES (3, 'c@x'); INSERT INTO t VALUES (4, 'a@x'); "  # T2: row 4 breaks the target's
            "UPDATE t SET email = 'c2@x' WHERE id = 3")                         # UNIQUE (email)
    after = rig.wal_lsn()
    rig.src("INSERT INTO t VALUES (5, 'e@x')")  # T3: fine, after the failing one

    failed = run_cli("catchup", "-c", str(cfg))
    assert failed.returncode != 0
    line = error_line(failed.stderr)
    assert "INSERT" in line and "public.t" in line and "(id)=(4)" in line and "unique" in line.lower()
    m = FINISHED_AT.search(line)
    assert m, line
    lsn = LSN.parse(m.group(1))
    assert before < lsn < after  # the finish LSN of T2
    assert rig.tgt("SELECT id, email FROM t ORDER BY id") == [(1, "a@x"), (2, "b@x")]  # nothing of T2 (nor T3)
    assert rig.progress_lsn() < lsn
    assert status(rig)["applied_lsn"] == str(rig.progress_lsn())
    with pytest.raises(ApplyError, match=f"finished at {lsn}"):  # without a skip, it fails the same way
        rig.catchup()

    skipped = run_cli("skip", "-c", str(cfg), "--lsn", str(lsn))
    assert skipped.returncode == 0, skipped.stderr
    assert str(lsn) in skipped.stdout
    assert status(rig)["skip_lsn"] == str(lsn)

    done = run_cli("catchup", "-c", str(cfg))
    assert done.returncode == 0, done.stderr
    assert f"skipping the transaction finished at {lsn}" in done.stderr
    assert rig.tgt("SELECT id, email FROM t ORDER BY id") == [(1, "a@x"), (2, "b@x"), (5, "e@x")]
    info = status(rig)
    assert info["skip_lsn"] is None  # once only
    assert LSN.parse(info["applied_lsn"]) > after

    rig.src("INSERT INTO t VALUES (6, 'f@x')")  # the next run skips nothing
    assert rig.catchup().skipped == 0
    assert rig.tgt("SELECT max(id) FROM t") == [(6,)]


def test_missing_target_table_rolls_back_the_whole_transaction(rig: Rig) -> None:
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.src("CREATE TABLE t2 (id int PRIMARY KEY, v text)")
    rig.publish("t", "t2")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'before')")
    before = rig.wal_lsn()
    rig.src("INSERT INTO t VALUES (2, 'same transaction'); INSERT INTO t2 VALUES (20, 'no table')")
    after = rig.wal_lsn()
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    msg = str(err.value)
    assert "\n" not in msg
    assert "INSERT" in msg and "t2" in msg and "(id)=(20)" in msg, msg
    lsns = [LSN.parse(x) for x in LSN_IN_TEXT.findall(msg)]
    assert lsns and all(before < x < after for x in lsns), msg
    assert rig.tgt("SELECT id FROM t ORDER BY id") == [(1,)]
    assert rig.progress_lsn() <= before
    rig.tgt_script("CREATE TABLE t2 (id int PRIMARY KEY, v text)")
    rig.catchup()
    assert rig.tgt("SELECT id FROM t ORDER BY id") == [(1,), (2,)]
    assert rig.tgt("SELECT id, v FROM t2") == [(20, "no table")]


def test_unique_violation_in_process_names_operation_table_key_and_lsn(rig: Rig) -> None:
    """The same failure as above, on every PostgreSQL major and both targets, through the library."""
    rig.src("CREATE TABLE t (id int PRIMARY KEY, code text)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, code text UNIQUE)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'x'), (2, 'y')")
    before = rig.wal_lsn()
    rig.src("UPDATE t SET code = 'z' WHERE id = 1; UPDATE t SET code = 'z' WHERE id = 2")
    after = rig.wal_lsn()
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    msg = str(err.value)
    assert msg.startswith("UPDATE on table public.t (key (id)=(2))"), msg
    lsn = LSN.parse(FINISHED_AT.search(msg).group(1))
    assert before < lsn < after
    assert rig.tgt("SELECT id, code FROM t ORDER BY id") == [(1, "x"), (2, "y")]


def test_a_row_refused_inside_a_batch_is_named_and_nothing_is_half_applied(rig: Rig) -> None:
    """Batches go by COPY and set-based UPDATE whose errors come back later; the error still names the row."""
    rig.src("CREATE TABLE t (id int PRIMARY KEY, code text)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, code text CHECK (code <> 'bad'))")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t SELECT g, 'ok' FROM generate_series(1, 100) g")
    rig.catchup()
    rig.src("UPDATE t SET code = CASE WHEN id = 57 THEN 'bad' ELSE 'new' END")  # one batch of 100 updates
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    assert str(err.value).startswith("UPDATE on table public.t (key (id)=(57))"), err.value
    assert rig.tgt("SELECT count(*), min(code), max(code) FROM t") == [(100, "ok", "ok")]
    rig.src("DELETE FROM t")
    rig.src("INSERT INTO t SELECT g, CASE WHEN g = 261 THEN 'bad' ELSE 'x' END FROM generate_series(201, 300) g")
    admin.skip(rig.cfg(), LSN.parse(FINISHED_AT.search(str(err.value)).group(1)))
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    assert str(err.value).startswith("INSERT on table public.t (key (id)=(261))"), err.value
    assert rig.tgt("SELECT count(*) FROM t WHERE id > 200") == [(0,)]


@pytest.mark.parametrize("target_kind", ["postgresql"], indirect=True)
def test_a_transaction_refused_at_commit_is_named_and_nothing_of_it_lands(rig: Rig) -> None:
    """A deferred constraint fails the COMMIT itself, which travels in one round trip with the progress upsert
    and the origin's position: the error names the transaction, neither its rows nor its progress land, and
    the next catch-up applies it once the target accepts it."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.tgt_script("""
        CREATE FUNCTION no_bad() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.v = 'bad' THEN RAISE EXCEPTION 'v may not be bad (id %)', NEW.id; END IF;
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER no_bad AFTER INSERT OR UPDATE ON t DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW EXECUTE FUNCTION no_bad();
        ALTER TABLE t ENABLE ALWAYS TRIGGER no_bad;  -- it fires for replicated rows too
    """)
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'ok')")
    rig.catchup()
    applied = rig.progress_lsn()
    before = rig.wal_lsn()
    rig.src("INSERT INTO t SELECT g, CASE WHEN g = 7 THEN 'bad' ELSE 'fine' END FROM generate_series(2, 20) g")
    after = rig.wal_lsn()
    with pytest.raises(ApplyError) as err:
        rig.catchup()
    msg = str(err.value)
    assert "\n" not in msg
    m = re.match(r"commit of the transaction ending at (\S+) failed on the target: .*v may not be bad \(id 7\)", msg)
    assert m, msg
    assert before < LSN.parse(m.group(1)) <= after
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "ok")]
    assert rig.progress_lsn() == applied
    rig.tgt_script("ALTER TABLE t DISABLE TRIGGER no_bad")
    rig.catchup()
    assert rig.tgt("SELECT count(*), max(id) FROM t") == [(20, 20)]
    assert rig.progress_lsn() >= LSN.parse(m.group(1))


def test_update_and_delete_without_replica_identity_are_clear_errors(rig: Rig) -> None:
    """A source never sends an UPDATE or DELETE of a table without a replica identity (see
    test_replica_identity_nothing_with_insert_only_publication), so the engine's error is reached
    here by feeding it a real stream whose Relation message is rewritten to REPLICA IDENTITY NOTHING."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    rig.src("UPDATE t SET v = 'changed' WHERE id = 1")
    rig.src("DELETE FROM t WHERE id = 2")
    msgs = [m._replace(replica_identity="n", columns=tuple(c._replace(flags=0) for c in m.columns))
            if isinstance(m, Relation) else m for m in rig.decoded()]
    begins = [m.final_lsn for m in msgs if type(m).__name__ == "Begin"]
    assert len(begins) == 3 and sum(isinstance(m, Commit) for m in msgs) == 3

    for op, lsn, skip in (("UPDATE", begins[1], None), ("DELETE", begins[2], begins[1])):
        engine = rig.engine(careful=True, skip_lsn=skip)
        try:
            with pytest.raises(ApplyError) as err:
                for m in msgs:
                    engine.handle(m)
        finally:
            engine.close()
            engine.target.close()
        msg = str(err.value)
        assert f"cannot apply {op} to table public.t at LSN {lsn}" in msg and "REPLICA IDENTITY NOTHING" in msg, msg
        assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "a"), (2, "b")]  # the insert only


def test_a_message_kind_the_engine_has_no_handler_for_is_one_error_naming_it_and_the_lsn(rig: Rig) -> None:
    """A message the decoder makes but the engine has no handler for (a kind added to the decoder only; here a
    decoded Insert of a new class) stops the apply with one line naming the kind and the LSN of its
    transaction; nothing of that transaction lands."""

    class InsertNew(Insert):  # the decoder's Insert under a new class: a kind the engine's dispatch lacks
        pass

    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a')")
    msgs = rig.decoded()
    begin = next(m for m in msgs if isinstance(m, Begin))
    msgs = [InsertNew(*m) if isinstance(m, Insert) else m for m in msgs]
    engine = rig.engine()
    try:
        with pytest.raises(FinalError) as err:
            for m in msgs:
                engine.handle(m)
    finally:
        engine.close()
        engine.target.close()
    assert str(err.value) == (f"pgoutput message InsertNew in transaction {begin.xid} finished at {begin.final_lsn}: "
                              f"the apply engine has no handler for this message kind")
    assert rig.tgt("SELECT count(*) FROM t") == [(0,)]
