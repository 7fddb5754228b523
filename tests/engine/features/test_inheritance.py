"""Inheritance on a PostgreSQL target: a change touches exactly the table it names, as PostgreSQL's subscriber does.

What a user sees: a target made with ``pg_dump --schema-only`` of the source keeps the source's inheritance, and
a change to a parent (``UPDATE ONLY``, ``DELETE FROM ONLY``, ``TRUNCATE ONLY`` on the source: pgoutput sends each
row's change for the table that holds it) changes the parent's rows on the target and none of its children's:
on the fast path (one row, a set-based batch, REPLICA IDENTITY FULL's row-locating subquery) and on the careful
one (a conflict's local rows found, overwritten, inserted). A partitioned target table still routes every
change to its partitions. A server error about earlier work still in flight names that work, not the change
that happened to come next.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from applier.errors import ApplyError

from .conftest import Rig

pytestmark = pytest.mark.parametrize("target_kind", ["postgresql"])

PAIRS = """
CREATE TABLE inh_p (id int PRIMARY KEY, v text);
CREATE TABLE inh_c (extra text) INHERITS (inh_p);
ALTER TABLE inh_c ADD PRIMARY KEY (id);
CREATE TABLE trunc_p (id int PRIMARY KEY, v text);
CREATE TABLE trunc_c (extra text) INHERITS (trunc_p);
ALTER TABLE trunc_c ADD PRIMARY KEY (id);
CREATE TABLE full_p (id int, v text);
ALTER TABLE full_p REPLICA IDENTITY FULL;
CREATE TABLE full_c (extra text) INHERITS (full_p);
ALTER TABLE full_c REPLICA IDENTITY FULL;
"""

# keys collide across parent and child: a statement that reaches the children finds rows there
ROWS = """
INSERT INTO inh_p SELECT g, 'p' || g FROM generate_series(1, 40) g;
INSERT INTO inh_c SELECT g, 'c' || g, 'x' FROM generate_series(1, 40) g;
INSERT INTO trunc_p SELECT g, 'p' || g FROM generate_series(1, 5) g;
INSERT INTO trunc_c SELECT g, 'c' || g, 'x' FROM generate_series(1, 5) g;
INSERT INTO full_p VALUES (1, 'same'), (2, 'two');
INSERT INTO full_c VALUES (1, 'same', 'x'), (3, 'c3', 'x');
"""


def copy_schema(rig: Rig) -> None:
    """The target's schema as ``pg_dump --schema-only`` of the source makes it (that major's pg_dump and psql)."""
    assert rig.target is not None
    install = rig.source.cluster.install
    dump = subprocess.run([str(install.bin("pg_dump")), "--schema-only", "--no-publications", "--no-owner",
                           "-d", rig.source.dsn], capture_output=True, text=True, check=True, timeout=60)
    path = Path(rig.tmp / "schema.sql")
    path.write_text(dump.stdout)
    subprocess.run([str(install.bin("psql")), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", rig.target.dsn,
                    "-f", str(path)], capture_output=True, text=True, check=True, timeout=60)


def only(rig: Rig, table: str) -> list[tuple]:
    return rig.tgt(f"SELECT * FROM ONLY {table} ORDER BY 1, 2")


def test_changes_to_a_parent_leave_its_children_alone(rig: Rig) -> None:
    rig.src(PAIRS + ROWS + "INSERT INTO full_p VALUES (3, 'c3')")  # full_p's row 3 is on the source only
    copy_schema(rig)
    rig.tgt_script(ROWS)
    rig.publish("inh_p", "trunc_p", "full_p")  # with their children (no ONLY)
    rig.init()
    children = {t: only(rig, t) for t in ("inh_c", "trunc_c", "full_c")}

    rig.src("UPDATE ONLY inh_p SET v = 'p1 updated' WHERE id = 1")
    rig.src("DELETE FROM ONLY inh_p WHERE id = 2")
    rig.src("UPDATE ONLY inh_p SET v = v || ' batch' WHERE id BETWEEN 11 AND 30")  # 20 rows: one set-based UPDATE
    rig.src("DELETE FROM ONLY inh_p WHERE id BETWEEN 31 AND 40")  # 10 rows: one set-based DELETE
    rig.src("TRUNCATE ONLY trunc_p")
    rig.src("UPDATE ONLY full_p SET v = 'changed' WHERE id = 1")  # found by the whole old row
    rig.src("UPDATE ONLY full_p SET v = 'changed' WHERE id = 3")  # not in the target's full_p: update_missing
    summary = rig.catchup()
    assert not summary.errors

    assert only(rig, "inh_p") == ([(1, "p1 updated")] + [(g, f"p{g}") for g in range(3, 11)]
                                  + [(g, f"p{g} batch") for g in range(11, 31)])
    assert only(rig, "trunc_p") == []
    assert only(rig, "full_p") == [(1, "changed"), (2, "two")]
    assert {t: only(rig, t) for t in children} == children  # not one child row changed, deleted or emptied
    assert rig.tgt("SELECT conflict_type, table_name FROM applier_conflicts") == [("update_missing", "public.full_p")]


def test_conflicts_resolved_row_by_row_leave_the_children_alone(rig: Rig) -> None:
    """The careful path: a collision's local rows (found, overwritten) and a missing row (inserted) are the
    parent's own; a child's row with the same key is neither taken for the parent's nor changed."""
    rig.src("CREATE TABLE ip (id int PRIMARY KEY, v text); INSERT INTO ip VALUES (8, 'p8')")
    rig.tgt_script("CREATE TABLE ip (id int PRIMARY KEY, v text); CREATE TABLE ic (extra text) INHERITS (ip); "
                   "ALTER TABLE ic ADD PRIMARY KEY (id); INSERT INTO ip VALUES (7, 'local'); "
                   "INSERT INTO ic VALUES (7, 'child7', 'x'), (8, 'child8', 'x')")
    rig.publish("ip")
    rig.init()
    rig.src("INSERT INTO ip VALUES (7, 'remote')")  # collides with the target parent's row 7: insert_exists
    rig.src("UPDATE ip SET v = 'u8' WHERE id = 8")  # the target parent has no row 8 (its child has): update_missing
    rig.catchup(conflicts_insert_exists="apply_remote", conflicts_update_missing="apply_remote")

    assert only(rig, "ip") == [(7, "remote"), (8, "u8")]
    assert only(rig, "ic") == [(7, "child7", "x"), (8, "child8", "x")]
    assert rig.tgt("SELECT conflict_type, resolution FROM applier_conflicts ORDER BY id") == [
        ("insert_exists", "apply_remote"), ("update_missing", "apply_remote")]


def test_a_partitioned_target_table_gets_every_change(rig: Rig) -> None:
    ddl = ("CREATE TABLE pt (id int PRIMARY KEY, v text) PARTITION BY RANGE (id); "
           "CREATE TABLE pt_1 PARTITION OF pt FOR VALUES FROM (0) TO (100); "
           "CREATE TABLE pt_2 PARTITION OF pt FOR VALUES FROM (100) TO (200)")
    rig.both(ddl)
    rig.publish("pt", options="publish_via_partition_root = true")
    rig.init()
    rig.src("INSERT INTO pt SELECT g, 'v' || g FROM generate_series(90, 129) g")
    rig.src("UPDATE pt SET v = 'one' WHERE id = 90")
    rig.src("DELETE FROM pt WHERE id = 91")
    rig.src("UPDATE pt SET v = 'many' WHERE id BETWEEN 95 AND 109")  # a set-based batch across both partitions
    rig.src("DELETE FROM pt WHERE id BETWEEN 110 AND 129")
    rig.catchup()
    want = [(90, "one")] + [(g, f"v{g}") for g in range(92, 95)] + [(g, "many") for g in range(95, 110)]
    assert rig.tgt("SELECT id, v FROM pt ORDER BY id") == want
    assert rig.tgt("SELECT count(*) FROM pt_2") == [(10,)]
    rig.src("TRUNCATE pt")
    rig.catchup()
    assert rig.tgt("SELECT count(*) FROM pt") == [(0,)]


def test_a_failure_of_work_in_flight_names_that_work(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """The fast path sends an UPDATE without waiting; the target refuses it. The next change binds another table,
    which reads the pipeline first: the failure is the UPDATE's, and the line says so (not the INSERT's)."""
    rig.src("CREATE TABLE a (id int PRIMARY KEY, v text); CREATE TABLE b (id int PRIMARY KEY)")
    rig.tgt_script("CREATE TABLE a (id int PRIMARY KEY, v text CHECK (v <> 'bad')); CREATE TABLE b (id int PRIMARY KEY)")
    rig.publish("a", "b")
    rig.init()
    rig.src("INSERT INTO a VALUES (1, 'ok'), (2, 'ok')")
    rig.catchup()
    # one transaction: the DELETE sends the queued UPDATE (another kind of change), the INSERT binds b
    rig.src("UPDATE a SET v = 'bad' WHERE id = 1; DELETE FROM a WHERE id = 2; INSERT INTO b VALUES (1)")
    caplog.set_level(logging.WARNING, logger="applier")
    with pytest.raises(ApplyError, match=r"^UPDATE on table public\.a \(key \(id\)=\(1\)\).*check constraint"):
        rig.catchup()
    fast = [r.getMessage() for r in caplog.records if "row by row" in r.getMessage()]
    assert len(fast) == 1, fast
    assert "row by row: UPDATE on table public.a (one of the rows sent" in fast[0], fast[0]
    assert "public.b" not in fast[0], fast[0]
    assert rig.tgt("SELECT id, v FROM a ORDER BY id") == [(1, "ok"), (2, "ok")]  # nothing of it applied
    assert rig.tgt("SELECT count(*) FROM b") == [(0,)]
