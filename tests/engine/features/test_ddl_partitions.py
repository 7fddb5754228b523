"""Partitioned tables under DDL capture (``apply.schema_changes = "follow"``), on both targets and every installed major.

A FOR ALL TABLES publication, with ``publish_via_partition_root`` false (rows sent as each leaf's) and true (sent as
the root's). The PostgreSQL target holds the parent partitioned and its partition as pg_dump --schema-only makes
them; the SQLite target holds each table the stream sends as a plain table (the leaf, or the root). In one source
transaction: a row, CREATE TABLE p2 PARTITION OF parent, a row routed to p2, ALTER TABLE parent ADD COLUMN with a
default, a row, and an update of the first row. What a user checks afterwards: on PostgreSQL, p2 is a partition of
the target's parent with the source's bound and every level has the new column; on SQLite, the tables the stream
sends (and no other) hold what the source's hold, the column's default filled in as the source fills it.
ATTACH and DETACH PARTITION, which applier does not do itself, stop with one line saying what to do on the target, and the
stream goes on once the target holds the table as the source does.

Without the change (capture describing only the command's own table, the follower taking every table as one of
its own; checked: 20 of these 24 fail, the four SQLite leaf-mode ATTACH/DETACH cases, where nothing changes, pass
either way): on PostgreSQL p2 is made a plain table beside the parent and the apply stops when a row brings the new column
to p1 (a partition takes no ADD COLUMN); via the root the row routed to p2 finds no partition; on SQLite the
leaves' rows written before the column came keep NULL where the source has its default, and via the root a stray
p2 table is made; ATTACH and DETACH are not noticed (via the root a PostgreSQL target's parent has no partition for x's
rows; otherwise the target's parent lacks or keeps the table's rows, or an update is a missing row, silently).
"""

from __future__ import annotations

import pytest

from applier.errors import ApplyError
from applier.source import capture

from .conftest import Rig

FOLLOW = {"apply_schema_changes": "follow"}
PARENT = ("CREATE TABLE parent (id int, k int, v text, PRIMARY KEY (id, k)) PARTITION BY RANGE (k);"
          "CREATE TABLE p1 PARTITION OF parent FOR VALUES FROM (0) TO (10)")
SQLITE_TABLE = "CREATE TABLE {} (id INTEGER, k INTEGER, v TEXT, PRIMARY KEY (id, k))"
STREAM = ("BEGIN; INSERT INTO parent VALUES (1, 1, 'a');"
          "CREATE TABLE p2 PARTITION OF parent FOR VALUES FROM (10) TO (20);"
          "INSERT INTO parent VALUES (2, 12, 'b');"
          "ALTER TABLE parent ADD COLUMN c int DEFAULT 7;"
          "INSERT INTO parent VALUES (3, 13, 'c', 8); UPDATE parent SET v = 'a2' WHERE id = 1; COMMIT")


def replica(rig: Rig, via_root: bool) -> None:
    """The source's parent and p1, published FOR ALL TABLES; the target's as described in the header; capture
    installed; the slot made."""
    rig.src(PARENT)
    rig.src(f"CREATE PUBLICATION {rig.publication} FOR ALL TABLES WITH (publish_via_partition_root = {via_root})")
    if rig.target is not None:
        rig.tgt_script(PARENT)
    else:
        rig.tgt_script(SQLITE_TABLE.format("parent" if via_root else "p1"))
    capture.install(rig.source.dsn)
    rig.init()


def tables(rig: Rig) -> list[str]:
    """The target's tables, applier's own left out."""
    if rig.target is not None:
        return [r[0] for r in rig.tgt("SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace AND "
                                      "relkind IN ('r', 'p') AND relname NOT LIKE 'applier%%' ORDER BY 1")]
    return [r[0] for r in rig.tgt("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'applier%' "
                                  "ORDER BY 1")]


def columns(rig: Rig, table: str, on_source: bool = False) -> list[tuple[str, str | None]]:
    """(name, default) of a table's columns, in order, on the target (or the source)."""
    if on_source or rig.target is not None:
        run = rig.src if on_source else rig.tgt
        return [(r[0], r[1]) for r in run(
            "SELECT attname, pg_get_expr(d.adbin, d.adrelid) FROM pg_attribute a LEFT JOIN pg_attrdef d ON "
            "d.adrelid = a.attrelid AND d.adnum = a.attnum WHERE attrelid = %s::regclass AND attnum > 0 AND NOT "
            "attisdropped ORDER BY attnum", [table])]
    return [(r[1], r[4]) for r in rig.tgt(f"PRAGMA table_info({table})")]


def content(rig: Rig, table: str, on_source: bool = False) -> list[tuple[object, ...]]:
    query = f"SELECT * FROM {table} ORDER BY 1, 2"
    return rig.src(query) if on_source else rig.tgt(query)


@pytest.mark.parametrize("via_root", [False, True], ids=["leaves", "via-root"])
def test_a_partition_created_and_a_column_added_to_the_parent(rig: Rig, via_root: bool) -> None:
    replica(rig, via_root)
    rig.src(STREAM)
    rig.catchup(**FOLLOW)
    if rig.target is not None:
        assert tables(rig) == ["p1", "p2", "parent"]
        assert rig.tgt("SELECT inhparent::regclass::text, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
                       "JOIN pg_class c ON c.oid = i.inhrelid WHERE c.relname = 'p2'") == [
            ("parent", "FOR VALUES FROM (10) TO (20)")]
        for table in ("parent", "p1", "p2"):
            assert [n for n, _ in columns(rig, table)] == ["id", "k", "v", "c"], table
        assert content(rig, "parent") == content(rig, "parent", on_source=True)
        return
    sent = ["parent"] if via_root else ["p1", "p2"]
    assert tables(rig) == sent
    for table in sent:
        assert [n for n, _ in columns(rig, table)] == ["id", "k", "v", "c"], table
        assert content(rig, table) == content(rig, table, on_source=True), table
    assert content(rig, "parent", on_source=True) == [(1, 1, "a2", 7), (2, 12, "b", 7), (3, 13, "c", 8)]


@pytest.mark.parametrize("via_root", [False, True], ids=["leaves", "via-root"])
def test_attach_partition_stops_until_the_target_holds_the_table_so(rig: Rig, via_root: bool) -> None:
    replica(rig, via_root)
    rig.src("CREATE TABLE x (id int, k int, v text, PRIMARY KEY (id, k)); INSERT INTO x VALUES (5, 25, 'x')")
    rig.catchup(**FOLLOW)
    rig.src("BEGIN; ALTER TABLE parent ATTACH PARTITION x FOR VALUES FROM (20) TO (30);"
            "INSERT INTO parent VALUES (6, 26, 'y'); UPDATE parent SET v = 'x2' WHERE id = 5; COMMIT")
    if rig.target is None and not via_root:  # x is sent as itself before and after: nothing on the target changes
        rig.catchup(**FOLLOW)
        assert content(rig, "x") == content(rig, "x", on_source=True)
        return
    with pytest.raises(ApplyError) as stop:
        rig.catchup(**FOLLOW)
    line = str(stop.value)
    assert "\n" not in line and "source table public.x was attached to partitioned table public.parent" in line, line
    assert "ALTER TABLE parent ATTACH PARTITION x FOR VALUES FROM (20) TO (30)" in line, line  # the statement
    assert content(rig, "x") == [(5, 25, "x")]  # nothing of the transaction
    if rig.target is not None:
        assert "run `ALTER TABLE public.parent ATTACH PARTITION public.x FOR VALUES FROM (20) TO (30)` on the " \
               "target" in line, line
        rig.tgt_script("ALTER TABLE parent ATTACH PARTITION x FOR VALUES FROM (20) TO (30)")
    else:
        assert "its rows are now sent as its root's" in line and "move them (and drop the table)" in line, line
        rig.tgt_script("INSERT INTO parent SELECT * FROM x; DROP TABLE x")
    rig.catchup(**FOLLOW)
    assert content(rig, "parent") == content(rig, "parent", on_source=True)


@pytest.mark.parametrize("via_root", [False, True], ids=["leaves", "via-root"])
def test_detach_partition_stops_until_the_target_holds_the_table_so(rig: Rig, via_root: bool) -> None:
    replica(rig, via_root)
    rig.src("CREATE TABLE p2 PARTITION OF parent FOR VALUES FROM (10) TO (20); INSERT INTO parent VALUES (2, 12, 'b')")
    rig.catchup(**FOLLOW)
    rig.src("BEGIN; ALTER TABLE parent DETACH PARTITION p2; INSERT INTO p2 VALUES (3, 13, 'c');"
            "UPDATE p2 SET v = 'b2' WHERE id = 2; COMMIT")
    if rig.target is None and not via_root:  # p2 is sent as itself before and after: nothing on the target changes
        rig.catchup(**FOLLOW)
        assert content(rig, "p2") == content(rig, "p2", on_source=True) == [(2, 12, "b2"), (3, 13, "c")]
        return
    with pytest.raises(ApplyError) as stop:
        rig.catchup(**FOLLOW)
    line = str(stop.value)
    assert "\n" not in line and "source table public.p2 was detached from partitioned table public.parent" in line
    if rig.target is not None:
        assert "run `ALTER TABLE public.parent DETACH PARTITION public.p2` on the target" in line, line
        rig.tgt_script("ALTER TABLE parent DETACH PARTITION p2")
    else:
        assert "its rows are now sent as its own" in line and "make its target table with them" in line, line
        rig.tgt_script(SQLITE_TABLE.format("p2") + "; INSERT INTO p2 SELECT * FROM parent WHERE k >= 10 AND k < 20;"
                       "DELETE FROM parent WHERE k >= 10 AND k < 20")
    rig.catchup(**FOLLOW)
    for table in ("parent", "p2"):
        assert content(rig, table) == content(rig, table, on_source=True), table
    assert content(rig, "p2") == [(2, 12, "b2"), (3, 13, "c")]
