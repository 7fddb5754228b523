"""The source session's own settings never change what reaches the target.

pgoutput writes each value with its type's output function, in the session's DateStyle, IntervalStyle,
TimeZone and extra_float_digits, and converts the text to the session's client encoding (the native
subscriber's connection sets them; so does applier's, for the walsender and for the SQL interface alike). A
source database in LATIN1 whose defaults are DateStyle 'SQL, DMY', TimeZone Asia/Tokyo, IntervalStyle
sql_standard: what the target holds is what the source holds.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from applier.sandbox.clusters import find_install
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db

from .conftest import Rig

TEXTS = ["é", "Ã©", "naïve café", "£½ÿ"]  # 'Ã©' is valid UTF-8 too, read as LATIN1 bytes: 'é'


@pytest.fixture
def latin1_rig(pg_clusters: ClusterPool, target_kind: str, tmp_path: Path) -> Iterator[Rig]:
    """A LATIN1 source database with unusual output defaults (newest PostgreSQL) and a target of each kind."""
    cluster = pg_clusters.get(find_install(), "source")
    name = f"latin1_{uuid.uuid4().hex[:12]}"
    cluster.execute(f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    cluster.execute(f"ALTER DATABASE {name} SET datestyle = 'SQL, DMY'")
    cluster.execute(f"ALTER DATABASE {name} SET timezone = 'Asia/Tokyo'")
    cluster.execute(f"ALTER DATABASE {name} SET intervalstyle = 'sql_standard'")
    try:
        source = ScratchDb(cluster, name, cluster.dsn(name))
        if target_kind == "sqlite":
            yield Rig(source, target_kind, None, tmp_path)
        else:
            with scratch_db(pg_clusters.get(find_install(), "target"), "tgt") as target:
                yield Rig(source, target_kind, target, tmp_path)
    finally:
        cluster.drop_database(name)


@pytest.mark.parametrize("sql_interface", [False, True], ids=["walsender", "sql-interface"])
def test_a_latin1_source_with_other_output_defaults_arrives_as_it_is(latin1_rig: Rig, sql_interface: bool) -> None:
    rig = latin1_rig
    rig.src("CREATE TABLE t (id int PRIMARY KEY, v text, d date, ts timestamptz, iv interval)")
    rig.tgt_script("CREATE TABLE t (id int PRIMARY KEY, v text, d date, ts timestamptz, iv interval)"
                   if rig.target is not None else "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT, d, ts, iv)")
    rig.publish("t")
    rig.init(source_sql_interface=sql_interface)
    with rig.src_conn() as conn:  # the client speaks UTF-8; the server stores LATIN1
        conn.execute("SET client_encoding = 'UTF8'")
        for i, text in enumerate(TEXTS):
            conn.execute("INSERT INTO t VALUES (%s, %s, '2024-03-04', '2024-03-04 05:06:07+00', "
                         "'1 day 02:03:04')", [i, text])
    rig.catchup(source_sql_interface=sql_interface)
    got = rig.tgt("SELECT id, v, d, ts, iv FROM t ORDER BY id")
    assert [r[1] for r in got] == TEXTS
    if rig.target is not None:
        assert {(r[2], r[3], r[4]) for r in got} == {
            (dt.date(2024, 3, 4), dt.datetime(2024, 3, 4, 5, 6, 7, tzinfo=dt.UTC), dt.timedelta(days=1, seconds=7384))}
    else:  # SQLite keeps the text as the source session wrote it: it must be ISO, in UTC
        assert {(r[2], r[3], r[4]) for r in got} == {("2024-03-04", "2024-03-04 05:06:07+00", "1 day 02:03:04")}
