"""The pieces of sync and verify that need neither Spark nor a server.

What they promise: page ranges cover a heap exactly once; PostgreSQL's CSV is
parsed back into exactly the text values (NULL and empty string apart, quotes,
newlines, one-column tables of NULLs); canonical values of the SQLite mapping
agree between a converted source value and what SQLite returns; constant
defaults are told from expressions; ``StopBefore`` stops the stream exactly
before the first transaction committed at or after its point; a Spark error is
reduced to its Python cause; a Spark start that failed is one line (the Java hint only when no Java can be
found), or the interrupt that caused it.
"""

from __future__ import annotations

import sqlite3
import struct

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from applier.decoder.messages import Keepalive, XLogData, decision_position  # noqa: E402
from applier.lsn import LSN  # noqa: E402
from applier.migrate.schema import SourceColumn, SourceTable, default_is_constant  # noqa: E402
from applier.migrate.spark.canonical import canon, canonical_rows_batch, display, sqlite_source_canonicalizer  # noqa: E402
from applier.migrate.spark.copy import GROUP_PAGES, spark_error_line, task_groups  # noqa: E402
from applier.migrate.spark.pgcopy import CopyPlan  # noqa: E402
from applier.migrate.spark.session import SparkStartError, _start_failed, copy_streams, task_slots  # noqa: E402
from applier.migrate.spark.source import csv_batches, ctid_ranges  # noqa: E402
from applier.migrate.spark.verify import StopBefore  # noqa: E402
from applier.targets.sqlite.schema import sqlite_affinity, sqlite_declared_types  # noqa: E402


@pytest.mark.parametrize("pages,parts", [(0, 4), (1, 4), (15, 4), (16, 4), (100, 3), (1000, 4), (1000, 1)])
def test_ctid_ranges_cover_every_page_once(pages: int, parts: int) -> None:
    ranges = ctid_ranges(pages, parts)
    assert 1 <= len(ranges) <= parts
    assert ranges[0][0] is None and ranges[-1][1] is None  # open at both ends: later pages are read too
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi == lo
    covered = [p for p in range(pages + 5) if sum((lo is None or p >= lo) and (hi is None or p < hi)
                                                  for lo, hi in ranges) == 1]
    assert covered == list(range(pages + 5))


def test_csv_round_trip_of_postgres_values() -> None:
    data = (b'1,"a,b",\n'
            b'2,"",""\n'
            b'3,"line1\nline2","say ""hi"""\n'
            b'4,\\N,"\xc3\xa9\t"\n')
    [batch] = list(csv_batches(iter([data]), ["c0", "c1", "c2"]))
    assert batch.to_pydict() == {"c0": [b"1", b"2", b"3", b"4"], "c1": [b"a,b", b"", b"line1\nline2", b"\\N"],
                                 "c2": [None, b"", b'say "hi"', "é\t".encode()]}


def test_csv_single_column_nulls_are_rows() -> None:
    batches = list(csv_batches(iter([b'\n""\nx\n\n']), ["c0"]))
    assert [v for b in batches for v in b.column(0).to_pylist()] == [None, b"", b"x", None]


def _table(*cols: tuple[str, int]) -> SourceTable:
    return SourceTable("public", "t", 1, "r", "d",
                       [SourceColumn(n, oid, -1, "x", "x", "pg_catalog", False, None, None) for n, oid in cols])


def test_sqlite_declared_types_follow_the_engine_mapping() -> None:
    t = _table(("i", 23), ("b", 20), ("f", 701), ("r", 700), ("n", 1700), ("bo", 16), ("by", 17), ("tx", 25),
               ("ts", 1184), ("j", 3802))
    assert sqlite_declared_types(t) == ["INTEGER", "INTEGER", "REAL", "REAL", "TEXT", "INTEGER", "BLOB", "TEXT",
                                        "TEXT", "TEXT"]
    assert [sqlite_affinity(d) for d in ("INTEGER", "REAL", "TEXT", "BLOB", "", "NUMERIC", "VARCHAR(3)", "DOUBLE")] \
        == ["INTEGER", "REAL", "TEXT", "BLOB", "BLOB", "NUMERIC", "TEXT", "REAL"]


def test_canonical_source_values_match_what_sqlite_returns(tmp_path) -> None:
    import pyarrow as pa

    oids = [23, 701, 1700, 16, 17, 25]
    text = [b"-42", b"1e+15", b"1.50", b"t", b"\\x00ff", "é".encode()]
    special = [b"0", b"NaN", b"0", b"f", b"\\x", b""]
    batch = pa.RecordBatch.from_arrays([pa.array([a, b, None], pa.binary()) for a, b in zip(text, special)],
                                       names=[f"c{i}" for i in range(6)])
    src = sqlite_source_canonicalizer(oids)(batch)
    db = sqlite3.connect(tmp_path / "c.db")
    db.execute("CREATE TABLE t (a INTEGER, b REAL, c TEXT, d INTEGER, e BLOB, f TEXT)")
    db.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?, ?)",
                   [(-42, 1e15, "1.50", 1, b"\x00\xff", "é"), (0, "NaN", "0", 0, b"", ""), (None,) * 6])
    tgt = canonical_rows_batch(db.execute("SELECT * FROM t ORDER BY rowid").fetchall(), [f"c{i}" for i in range(6)])
    assert src.to_pydict() == tgt.to_pydict()
    assert canon(1.5) != canon("1.5") != canon(b"1.5")  # the storage class counts
    assert display(b"i7", "sqlite") == 7 and display(b"x00ff", "sqlite") == "\\x00ff" and display(b"7", "postgresql") == "7"


@pytest.mark.parametrize("tree,constant", [
    ("{CONST :consttype 23 :constlen 4 :constvalue 4 [ 5 0 0 0 0 0 0 0 ]}", True),
    ("{FUNCEXPR :funcid 669 :funcresulttype 1043 :funcretset false :funcvariadic false :funcformat 2 "
     ":funccollid 100 :inputcollid 100 :args ({CONST :consttype 1043})}", True),
    ("{FUNCEXPR :funcid 1574 :funcresulttype 20 :funcretset false :funcvariadic false :funcformat 0 "
     ":funccollid 0 :inputcollid 0 :args ({CONST :consttype 2205})}", False),  # nextval(…)
    ("{FUNCEXPR :funcid 1299 :funcresulttype 1184 :funcretset false :funcvariadic false :funcformat 3 "
     ":funccollid 0 :inputcollid 0 :args <>}", False),  # CURRENT_TIMESTAMP (16+)
    ("{SQLVALUEFUNCTION :op 3 :type 1184 :typmod -1 :location 40}", False),
    ("{OPEXPR :opno 551 :opfuncid 177 :args ({CONST} {CONST})}", False),
])
def test_constant_defaults(tree: str, constant: bool) -> None:
    assert default_is_constant(tree) is constant


class _Frames:
    def __init__(self, frames: list) -> None:
        self.frames = list(frames)
        self.confirmed = LSN(0)
        self.closed = False
        self.asked = 0

    def send_status(self, reply: bool = False) -> None:
        self.asked += 1

    def read(self, timeout: float):
        return self.frames.pop(0) if self.frames else None

    def confirm(self, lsn: LSN) -> None:
        self.confirmed = lsn

    def close(self) -> None:
        self.closed = True


def _x(payload: bytes) -> XLogData:
    return XLogData(0, 0, 0, payload)


def _begin(final: int) -> XLogData:
    return _x(b"B" + struct.pack(">QqI", final, 0, 7))


def _commit(end: int) -> XLogData:
    return _x(b"C" + struct.pack(">BQQq", 0, end - 8, end, 0))


def test_stop_before_withholds_the_first_transaction_at_or_after_the_point() -> None:
    point = 1000
    frames = [_begin(900), _x(b"I..."), _commit(950), _begin(1000), _x(b"I..."), _commit(1100)]
    src = StopBefore(_Frames(frames), LSN(point))
    got = [src.read(0) for _ in range(8)]
    assert [f.payload[:1] if f else None for f in got] == [b"B", b"I", b"C", None, None, None, None, None]
    assert src.exhausted and src.reached


def test_stop_before_stops_on_a_keepalive_past_the_point_outside_a_transaction() -> None:
    frames = [_begin(900), Keepalive(LSN(2000), 0, False), _commit(950), Keepalive(LSN(2000), 0, False),
              _begin(960)]
    src = StopBefore(_Frames(frames), LSN(1000))
    got = [src.read(0) for _ in range(5)]
    assert isinstance(got[1], Keepalive)  # inside the transaction: passed on, not the end
    assert got[2].payload[:1] == b"C" and got[3] is None and src.reached
    src.confirm(LSN(5))
    src.send_status(True)  # exhausted: nothing to ask any more
    src.close()
    assert src.inner.confirmed == 5 and src.inner.closed and src.inner.asked == 0


def test_stop_before_knows_streamed_and_prepared_commits() -> None:
    stream_commit = _x(b"c" + struct.pack(">IBQQq", 5, 0, 1500, 1600, 0))
    assert decision_position(stream_commit.payload) == 1500
    commit_prepared = _x(b"K" + struct.pack(">BQQq", 0, 1200, 1300, 0) + b"\x00\x00\x00\x05gid\x00")
    assert decision_position(commit_prepared.payload) == 1200
    rollback_prepared = _x(b"r" + struct.pack(">BQQqq", 0, 800, 1001, 0, 0))
    assert decision_position(rollback_prepared.payload) == 1000  # ends after 1000: at or after the point
    assert decision_position(b"I\x00") is None


def test_spark_error_line_finds_the_python_cause() -> None:
    text = ("An error occurred while calling o123.save.\n: org.apache.spark.SparkException: Job aborted\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in write\n"
            "psycopg.errors.CheckViolation: new row for relation \"t\" violates check constraint \"c\"\n"
            "\tat org.apache.spark.api.python.BasePythonRunner")
    assert spark_error_line(RuntimeError(text)) == \
        'CheckViolation: new row for relation "t" violates check constraint "c"'


def test_spark_error_line_takes_the_exception_that_ends_the_python_traceback() -> None:
    # a psycopg error whose class name ends in neither Error nor Exception, raised in an executor's Python
    text = ("Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 times, most recent failure: Lost task "
            "0.0 in stage 3.0 (TID 5): org.apache.spark.api.python.PythonException: Traceback (most recent call "
            "last):\n  File \"/x/applier/migrate/spark/source.py\", line 122, in read\n    yield from read_pg_range(...)\n"
            "psycopg.errors.InsufficientPrivilege: permission denied for table b\n\n"
            "\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(...)\n"
            "Driver stacktrace:\n\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(...)")
    assert spark_error_line(RuntimeError(text)) == "InsufficientPrivilege: permission denied for table b"


def test_spark_error_line_names_a_workers_python_that_does_not_start() -> None:
    text = ("Job aborted due to stage failure: Task 0 in stage 1.0 failed 4 times, most recent failure: Lost task 0.3 "
            "(TID 7) (127.0.0.1 executor 0): org.apache.spark.SparkException: Error from python worker:\n"
            "  /usr/bin/python3: No module named pyspark\nPYTHONPATH was:\n  /opt/spark/python/lib/pyspark.zip\n"
            "org.apache.spark.SparkException: EOFException\n\tat org.apache.spark.api.python.PythonWorkerFactory")
    assert spark_error_line(RuntimeError(text)) == (
        "the workers' Python failed: /usr/bin/python3: No module named pyspark (point spark.pyspark.python or "
        "PYSPARK_PYTHON at a Python 3.11 with pyspark, psycopg and pyarrow)")


def test_spark_error_line_names_the_class_of_what_the_driver_met_reading_rows(tmp_path) -> None:
    """verify reads small tables in its driver: a SQLite or Arrow error met there reads as the same error in a
    Spark task would (its class, then its message)."""
    conn = sqlite3.connect(tmp_path / "t.db")
    with pytest.raises(sqlite3.Error) as lite:
        conn.execute("SELECT * FROM gone")
    conn.close()
    assert spark_error_line(lite.value) == "OperationalError: no such table: gone"
    with pytest.raises(pa.ArrowInvalid) as arrow:
        pa.array([1, "x"])
    assert spark_error_line(arrow.value).startswith("ArrowInvalid: Could not convert 'x'")


def test_task_slots_of_the_session_are_its_local_threads(spark) -> None:
    assert task_slots(spark) == 2  # the tests' local[2]
    # a local master streams half its threads' worth of partitions at once: 8 partitions run as 1 task of 8
    assert copy_streams(spark) == 1


def _copy_plan(pages: int, partitions: int, weight: float = 1.0) -> CopyPlan:
    return CopyPlan({"ranges": ctid_ranges(pages, partitions)}, "postgresql", "", "t", [], [], "n", "r", "public.t",
                    weight=weight)


@pytest.mark.parametrize("pages,partitions,parts,streams,want,weight", [
    (1000, 8, range(8), 1, [[[0, 1, 2, 3, 4, 5, 6, 7]]], 1.0),  # a local[2] master: one task, one group
    (1000, 8, range(8), 16, [[[p]] for p in range(8)], 1.0),  # a cluster with more slots: a partition each
    (1000, 8, range(8), 3, [[[0, 1]], [[2, 3, 4]], [[5, 6, 7]]], 1.0),  # slices of consecutive partitions
    (1000, 8, [0, 1, 3, 4, 7], 1, [[[0, 1], [3, 4], [7]]], 1.0),  # a resumed copy: the missing runs, a group each
    (8 * GROUP_PAGES, 8, range(8), 2, [[[0], [1], [2], [3]], [[4], [5], [6], [7]]], 1.0),  # at most GROUP_PAGES
    (8 * GROUP_PAGES, 16, range(16), 1, [[[p, p + 1] for p in range(0, 16, 2)]], 1.0),
    (10 ** 9, 1, range(1), 1, [[[0]]], 1.0),  # one partition: one group, however large
    # a partitioned table of 365 leaves (its ranges cover each leaf), or one whose TOAST is 300 times its heap:
    # weighed by the whole table, each partition is a group of its own
    (131072, 8, range(8), 1, [[[p] for p in range(8)]], 365.0),
    (20000, 8, range(8), 1, [[[p] for p in range(8)]], 300.0),
])
def test_task_groups_are_consecutive_partitions_of_bounded_size(pages: int, partitions: int, parts: range | list[int],
                                                                 streams: int, want: list[list[list[int]]],
                                                                 weight: float) -> None:
    assert task_groups(_copy_plan(pages, partitions, weight), list(parts), streams) == want


def test_a_failed_spark_start_is_one_line_or_its_interrupt(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    launcher = RuntimeError("[JAVA_GATEWAY_EXITED] Java gateway process exited before sending its port number.\n"
                            "\tat org.apache.spark.deploy.SparkSubmit.main(SparkSubmit.scala)")
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.touch()
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))  # a Java there: the launcher failed for another reason
    said = _start_failed("local[2]", launcher)
    assert isinstance(said, SparkStartError) and str(said) == (
        "Spark could not start with master 'local[2]': [JAVA_GATEWAY_EXITED] Java gateway process exited before "
        "sending its port number.")
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "none"))
    assert str(_start_failed("local[2]", launcher)).endswith(
        "; no Java found: Spark needs Java 17 (JAVA_HOME, or java on the PATH)")
    # PySpark's clean-up after a Ctrl-C raising in the interrupt's place: the interrupt
    assert not isinstance(_start_failed("local[2]", RuntimeError("Answer from Java side is empty")), KeyboardInterrupt)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("Answer from Java side is empty")  # noqa: B904 - as PySpark's clean-up raises it
    except RuntimeError as exc:
        cleanup = exc
    assert isinstance(_start_failed("local[2]", cleanup), KeyboardInterrupt)
